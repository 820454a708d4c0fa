package fuzz_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/topology"
)

// semCase is one semantic scenario: a model, a P engine, a D engine and a
// request shape.
type semCase struct {
	name      string
	model     kvsim.Model
	p, d      kvsim.Engine
	tokens    int  // request tokens on P
	hit       int  // D's prefix-cache hit, tokens (a multiple of D's logical block)
	fragment  bool // shuffled block ids
	op        hotpath.Op
	reference bool
	maxRun    int64
	maxSegs   int // PlanOptions.MaxSegments
	seed      uint64
}

// pickIDs returns n distinct block ids below limit: consecutive from a
// random start, or shuffled.
func pickIDs(rng *rand.Rand, n, limit int, fragment bool) []topology.BlockID {
	ids := make([]topology.BlockID, n)
	if !fragment {
		s := rng.IntN(limit - n + 1)
		for i := range ids {
			ids[i] = topology.BlockID(s + i)
		}
		return ids
	}
	perm := rng.Perm(limit)
	for i := range ids {
		ids[i] = topology.BlockID(perm[i])
	}
	return ids
}

// buildRequest returns per-group spans for P and D as their schedulers
// would: P holds [0, tokens); D holds [hit, tokens); sliding-window
// groups clip to the window; Mamba groups keep their last block.
func buildRequest(rng *rand.Rand, c *semCase, groups []topology.Group) *kvsim.Request {
	req := &kvsim.Request{Tokens: c.tokens}
	for _, g := range groups {
		ps, ds := attentionSpans(c, g, func(n, limit int) []topology.BlockID { return pickIDs(rng, n, limit, c.fragment) })
		if g.Kind == mmb {
			ps = topology.Span{IDs: topology.ClipMamba(pickIDs(rng, 3, c.p.Blocks, true), 0, false)}
			ds = topology.Span{IDs: topology.ClipMamba(pickIDs(rng, 3, c.d.Blocks, true), 0, false)}
		}
		req.P = append(req.P, ps)
		req.D = append(req.D, ds)
	}
	return req
}

// buildEngines builds the P and D engines of a case.
func buildEngines(t *testing.T, c *semCase) (p, d [][]*kvsim.Rank) {
	t.Helper()
	p, err := kvsim.Build(&c.model, &c.p)
	if err != nil {
		t.Fatal(err)
	}
	d, err = kvsim.Build(&c.model, &c.d)
	if err != nil {
		t.Fatal(err)
	}
	return p, d
}

// attentionSpans returns P's and D's spans of a non-Mamba group as their
// schedulers would: P holds [0, tokens), D holds [hit, tokens), and
// sliding-window groups are clipped to the window on both sides. pick
// chooses n distinct ids below limit.
func attentionSpans(c *semCase, g topology.Group, pick func(n, limit int) []topology.BlockID) (ps, ds topology.Span) {
	pn := (c.tokens + c.p.LogicalBlock - 1) / c.p.LogicalBlock
	dn := 0
	if c.tokens > c.hit {
		dn = (c.tokens - c.hit + c.d.LogicalBlock - 1) / c.d.LogicalBlock
	}
	ps = topology.Span{IDs: pick(pn, c.p.Blocks)}
	ds = topology.Span{Start: c.hit, IDs: pick(dn, c.d.Blocks)}
	if g.Kind == swa {
		var drop int
		ps.IDs, drop = topology.ClipWindow(ps.IDs, g.Window, c.p.LogicalBlock)
		ps.Start += drop * c.p.LogicalBlock
		ds.IDs, drop = topology.ClipWindow(ds.IDs, g.Window, c.d.LogicalBlock)
		ds.Start += drop * c.d.LogicalBlock
	}
	return ps, ds
}

func runSemantic(t *testing.T, c *semCase) {
	t.Helper()
	rng := rand.New(rand.NewPCG(uint64(len(c.name))+c.seed, 7))
	pr, dr := buildEngines(t, c)
	req := buildRequest(rng, c, dr[0][0].Layout.GroupList())
	for s, stage := range pr {
		for _, r := range stage {
			r.Scramble(uint64(s*100 + r.Layout.TPRank + 1))
			r.Fill(req.P)
		}
	}
	before := make([][]byte, len(dr[0]))
	for i, r := range dr[0] {
		r.Scramble(uint64(1000 + i))
		before[i] = r.Snapshot()
	}
	atDst, atSrc, descs, err := kvsim.Transfer(pr, dr[0], req, hotpath.Options{Op: c.op, MaxRunBytes: c.maxRun}, topology.PlanOptions{MaxSegments: c.maxSegs}, c.reference)
	if err != nil {
		t.Fatalf("Transfer: %v", err)
	}
	for i, r := range dr[0] {
		if err := r.Check(before[i], req, c.p.KernelBlock, c.p.LogicalBlock); err != nil {
			t.Fatalf("Check after %d descriptors:\n%v", descs, err)
		}
	}
	// Every D rank hears from every connected P rank of every stage, and in
	// pull every P rank hears from each D rank that reads it.
	wantDst, err := topology.NotificationsAtDst(c.p.TP, c.p.PP, c.d.TP)
	if err != nil {
		t.Fatal(err)
	}
	for d := 0; d < c.d.TP; d++ {
		if got := atDst[[2]int{d, 0}]; got != wantDst {
			t.Errorf("notifications at D rank %d = %d, want %d", d, got, wantDst)
		}
	}
	wantSrc, err := topology.NotificationsAtSrc(c.p.TP, c.d.TP)
	if err != nil {
		t.Fatal(err)
	}
	for pp := 0; pp < c.p.PP; pp++ {
		for p := 0; p < c.p.TP; p++ {
			if got := atSrc[[2]int{p, pp}]; got != wantSrc {
				t.Errorf("notifications at P rank %d/%d = %d, want %d", p, pp, got, wantSrc)
			}
		}
	}
}

// TestSemanticMatrix is the acceptance matrix: hetero TP both ways (with
// GQA where heads are fewer than ranks) × hetero block size both ways ×
// HND/NHD (and mixed) × packing × partial and full prefix hits, in push and
// pull, fresh and fragmented, through the optimised builder.
func TestSemanticMatrix(t *testing.T) {
	tps := [][2]int{{1, 1}, {2, 1}, {1, 2}, {4, 2}, {2, 4}, {8, 4}, {2, 8}}
	heads := []int{8, 2}
	blocks := [][4]int{ // P logical, P kernel, D logical, D kernel
		{16, 16, 16, 16}, {16, 16, 32, 32}, {32, 32, 16, 16}, {32, 16, 16, 16}, {16, 16, 64, 32}, {8, 8, 32, 32},
	}
	layouts := [][2]topology.KVLayout{{topology.LayoutHND, topology.LayoutHND}, {topology.LayoutNHD, topology.LayoutNHD}, {topology.LayoutHND, topology.LayoutNHD}}
	packings := []topology.KVPacking{topology.PackedKV, topology.SplitKV, topology.SeparateKV}
	hits := []int{0, 1, -1} // none, partial, full (multiples of D's logical block)
	n := 0
	for _, tp := range tps {
		for _, k := range heads {
			for _, bs := range blocks {
				for li, lay := range layouts {
					for hi, hit := range hits {
						n++
						if testing.Short() && n%5 != 0 {
							continue
						}
						packing := packings[n%3]
						op := hotpath.OpWrite
						if n%2 == 1 {
							op = hotpath.OpRead
						}
						tokens := 150 + n%37
						h := hit * bs[2]
						if hit < 0 {
							h = (tokens + bs[2] - 1) / bs[2] * bs[2]
						}
						c := &semCase{
							name: fmt.Sprintf("tp%dto%d/heads%d/bs%d_%d_to_%d_%d/%s%s/%s/hit%d/%v", tp[0], tp[1], k, bs[0], bs[1], bs[2], bs[3],
								lay[0], lay[1], packing, h, op),
							model:    kvsim.SmallModel(k, fa, fa, fa),
							p:        eng(1, tp[0], bs[0], bs[1], lay[0], packing),
							d:        eng(2, tp[1], bs[2], bs[3], lay[1], packing),
							tokens:   tokens,
							hit:      h,
							fragment: (li+hi+n)%2 == 0,
							op:       op,
						}
						if lay[0] != lay[1] {
							c.maxSegs = 1 << 12 // HND<->NHD places every cell: allow it here
						}
						t.Run(c.name, func(t *testing.T) { runSemantic(t, c) })
					}
				}
			}
		}
	}
}

// TestSemanticModels covers MLA, sliding window, Mamba hybrids, PP>1
// producers and the run-byte cap, each in push and pull.
func TestSemanticModels(t *testing.T) {
	hnd, nhd := topology.LayoutHND, topology.LayoutNHD
	packed, split := topology.PackedKV, topology.SplitKV
	cases := []semCase{
		{name: "mla/tp1to2", model: kvsim.SmallModel(4, mla, mla), p: eng(1, 1, 16, 16, hnd, packed), d: eng(2, 2, 16, 16, hnd, packed), tokens: 100},
		{name: "mla/tp4to2", model: kvsim.SmallModel(4, mla, mla), p: eng(1, 4, 16, 16, hnd, packed), d: eng(2, 2, 16, 16, hnd, packed), tokens: 100},
		{name: "mla/tp2to8/bs16to64", model: kvsim.SmallModel(4, mla, mla), p: eng(1, 2, 16, 16, hnd, packed), d: eng(2, 8, 64, 64, hnd, packed), tokens: 130, hit: 64},
		{name: "mla/tp8to1/bs64to16", model: kvsim.SmallModel(4, mla, mla), p: eng(1, 8, 64, 64, hnd, packed), d: eng(2, 1, 16, 16, hnd, packed), tokens: 130, hit: 32},
		{name: "mixed_fa_mla/tp2to4", model: kvsim.SmallModel(4, fa, mla, fa), p: eng(1, 2, 16, 16, hnd, packed), d: eng(2, 4, 16, 16, hnd, packed), tokens: 77},
		{name: "sliding/tp1to1", model: kvsim.SmallModel(4, fa, swa, fa, swa), p: eng(1, 1, 16, 16, hnd, packed), d: eng(2, 1, 16, 16, hnd, packed), tokens: 190},
		{name: "sliding/tp2to1/bs16to32", model: kvsim.SmallModel(4, swa, fa, swa), p: eng(1, 2, 16, 16, hnd, packed), d: eng(2, 1, 32, 32, hnd, packed), tokens: 190, hit: 32},
		{name: "sliding/tp1to4/bs32to16/nhd", model: kvsim.SmallModel(4, swa, fa), p: eng(1, 1, 32, 32, nhd, split), d: eng(2, 4, 16, 16, nhd, split), tokens: 201, hit: 16},
		{name: "sliding/logical64kernel16", model: kvsim.SmallModel(8, swa, fa), p: eng(1, 2, 64, 16, hnd, packed), d: eng(2, 2, 32, 32, hnd, packed), tokens: 230, hit: 96},
		{name: "mamba/tp1to1", model: kvsim.SmallModel(4, fa, mmb, fa, mmb), p: eng(1, 1, 16, 16, hnd, packed), d: eng(2, 1, 16, 16, hnd, packed), tokens: 99},
		{name: "mamba/tp2to1", model: kvsim.SmallModel(4, mmb, fa, mmb), p: eng(1, 2, 16, 16, hnd, packed), d: eng(2, 1, 16, 16, hnd, packed), tokens: 99},
		{name: "mamba/tp1to4", model: kvsim.SmallModel(4, mmb, fa), p: eng(1, 1, 16, 16, hnd, packed), d: eng(2, 4, 16, 16, hnd, packed), tokens: 99},
		{name: "mamba/tp4to2/gqa", model: kvsim.SmallModel(2, mmb, fa), p: eng(1, 4, 16, 16, hnd, packed), d: eng(2, 2, 16, 16, hnd, packed), tokens: 99},
		{name: "mamba/tp2to1/kernel16logical32", model: kvsim.SmallModel(4, mmb, fa), p: eng(1, 2, 32, 16, hnd, packed), d: eng(2, 1, 32, 16, hnd, packed), tokens: 99},
		{name: "pp2/tp2to1", model: kvsim.SmallModel(4, fa, fa, fa, fa), p: kvsim.Engine{ID: 1, TP: 2, PP: 2, LogicalBlock: 16, KernelBlock: 16, Layout: hnd, Packing: packed, Blocks: 24}, d: eng(2, 1, 16, 16, hnd, packed), tokens: 90},
		{name: "pp4/tp1to2", model: kvsim.SmallModel(4, fa, fa, fa, fa, fa), p: kvsim.Engine{ID: 1, TP: 1, PP: 4, LogicalBlock: 16, KernelBlock: 16, Layout: hnd, Packing: packed, Blocks: 24}, d: eng(2, 2, 16, 16, hnd, packed), tokens: 90, hit: 16},
		{name: "cap/fresh", model: kvsim.SmallModel(4, fa, fa), p: eng(1, 1, 16, 16, hnd, packed), d: eng(2, 1, 16, 16, hnd, packed), tokens: 300, maxRun: 3000},
		{name: "cap/nhd_bs", model: kvsim.SmallModel(4, fa, fa), p: eng(1, 1, 16, 16, nhd, packed), d: eng(2, 1, 64, 64, nhd, packed), tokens: 300, maxRun: 1000},
		{name: "nhd_to_hnd_split", model: kvsim.SmallModel(2, fa), p: eng(1, 2, 16, 16, nhd, split), d: eng(2, 1, 16, 16, hnd, packed), tokens: 100, hit: 16, maxSegs: 256},
		{name: "fullhit_empty", model: kvsim.SmallModel(4, fa, fa), p: eng(1, 2, 16, 16, hnd, packed), d: eng(2, 1, 32, 32, hnd, packed), tokens: 64, hit: 64},
	}
	for _, c := range cases {
		for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
			for _, frag := range []bool{false, true} {
				for _, ref := range []bool{false, true} {
					c := c
					c.op, c.fragment, c.reference = op, frag, ref
					name := fmt.Sprintf("%s/%v/frag=%v/ref=%v", c.name, op, frag, ref)
					t.Run(name, func(t *testing.T) { runSemantic(t, &c) })
				}
			}
		}
	}
}
