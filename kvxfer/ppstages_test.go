package kvxfer_test

import (
	"math/rand/v2"
	"testing"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// A pipelined producer's stages must cover the consumer's regions exactly
// once: stage p's regions start where stage p-1's end, the first at 0 and
// the last ending at the consumer's last region. Each stage was checked
// only on its own (its regions inside the consumer's), so a stage whose
// RegionOffset was off wrote its layers' KV into the wrong layers' regions,
// overlapping another stage's, and left a consumer region no stage writes;
// the consumer reported every request done. The consumer now refuses the
// producer at handshake, naming the stages' region ranges, in both modes.
func TestPipelineStagesMustTileConsumer(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, tc := range []struct {
			name   string
			offset int // stage 1's RegionOffset (2 is right)
			want   string
		}{
			{"overlap and gap", 1, "regions 1..2 of stage pp 1 start at 1, want 2"},
			{"right", 2, ""},
		} {
			t.Run(mode.String()+"/"+tc.name, func(t *testing.T) {
				inSynctest(t, func(t *testing.T) {
					x := &pair{t: t, mode: mode, fab: kvxfertest.NewFabric(), dir: kvxfertest.NewDirectory(), out: newOutcomes()}
					model := kvsim.Model{Kinds: []topology.Kind{fa, fa, fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
					pe, de := e2eEngine(1, 1, 2, 16, 16), e2eEngine(2, 1, 1, 16, 16)
					x.p = startEngine(t, x.fab, x.dir, &model, pe, "P", mode, func(c *kvxfer.WorkerConfig) {
						if c.Layout.PPRank == 1 {
							c.Layout.RegionOffset = tc.offset
						}
					})
					// The consumer hears of the stage as it is.
					r := x.p.ranks[1][0]
					l := r.Layout
					l.RegionOffset = tc.offset
					meta, err := x.p.backends[1].LocalMetadata()
					if err != nil {
						t.Fatal(err)
					}
					if err := x.dir.Publish(kvxfer.RankInfo{EngineID: "P", CompatHash: "model-x", Layout: l, Agent: meta}); err != nil {
						t.Fatal(err)
					}
					x.d = startEngine(t, x.fab, x.dir, &model, de, "D", mode, nil)
					t.Cleanup(func() { x.d.close(t); x.p.close(t) })
					x.groups = x.d.ranks[0][0].Layout.GroupList()
					rng := rand.New(rand.NewPCG(1, 2))
					x.pp, x.dp = newPool(rng, len(x.groups), pe.Blocks, false), newPool(rng, len(x.groups), de.Blocks, false)
					q := x.req("r", 40, 0)
					x.recvD(q)
					x.sendP(q)
					x.settle()
					got := x.recvResult(q)
					if tc.want == "" {
						wantResult(t, "D", got, kvxfer.ResultDone, "")
						return
					}
					wantResult(t, "D", got, kvxfer.ResultFailed, tc.want)
					wantKind(t, "D", got, kvxfer.FailureIncompatible)
					// Both stages' producer requests end at once, told.
					for _, o := range x.sendResult(q) {
						if o.Result != kvxfer.ResultFailed {
							t.Errorf("P outcome %+v, want failed", o)
						}
					}
					if n := len(x.sendResult(q)); n != 2 {
						t.Errorf("P has %d outcomes, want 2 (one per stage)", n)
					}
				})
			})
		}
	}
}
