package kvxfer_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// Layer-wise push between engines of other TP sizes and block sizes, the
// layers saved out of order and one twice: every byte of D's blocks is the
// request's, each side ends once, done, and nothing is held after.
func TestLayerwiseHeteroBytes(t *testing.T) {
	for _, c := range []struct{ ptp, dtp, plog, dlog int }{{2, 1, 16, 32}, {1, 2, 32, 16}, {2, 4, 16, 16}, {4, 1, 16, 16}} {
		t.Run(fmt.Sprintf("P tp%d b%d to D tp%d b%d", c.ptp, c.plog, c.dtp, c.dlog), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPairOf(t, kvxfer.ModePush, e2eEngine(1, c.ptp, 1, c.plog, c.plog), e2eEngine(2, c.dtp, 1, c.dlog, c.dlog),
					func(side string, cfg *kvxfer.WorkerConfig) { cfg.Layerwise = side == "P" })
				q := x.req("r1", 70, 0)
				x.recvD(q)
				now := time.Now()
				x.p.step(t, &kvxfer.StepMeta{Step: 7, SchedulerClock: now, Prefill: []kvxfer.SendReq{q.send(time.Time{})}})
				x.settle()
				for _, l := range []int{1, 1, 0} {
					for _, w := range x.p.workers[0] {
						if err := w.LayerSaved(7, l); err != nil {
							t.Fatal(err)
						}
					}
					x.settle()
				}
				if len(x.recvResult(q)) != 0 {
					t.Fatal("D done before P finished")
				}
				x.p.step(t, &kvxfer.StepMeta{Step: 8, SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(30 * time.Second))}})
				x.settle()
				// One outcome per rank (the pair has no aggregator), done.
				for _, o := range []struct {
					side  string
					got   []kvxfer.Outcome
					ranks int
				}{{"D", x.recvResult(q), c.dtp}, {"P", x.sendResult(q), c.ptp}} {
					if len(o.got) != o.ranks {
						t.Errorf("%s outcomes %+v, want one per rank (%d)", o.side, o.got, o.ranks)
					}
					for _, g := range o.got {
						if g.Result != kvxfer.ResultDone {
							t.Errorf("%s outcome %+v, want done", o.side, g)
						}
					}
				}
				for _, r := range x.d.ranks[0] {
					if err := r.CheckRequest(&q.sim, c.plog, c.plog); err != nil {
						t.Error(err)
					}
				}
				for _, se := range []*simEngine{x.p, x.d} {
					for _, w := range se.workers[0] {
						s, err := w.State()
						if err != nil {
							t.Fatal(err)
						}
						if s.Sends+s.Recvs+s.Matches+s.LayerSteps+s.Handles != 0 {
							t.Errorf("%s still holds: %+v", se.id, s)
						}
					}
				}
			})
		})
	}
}
