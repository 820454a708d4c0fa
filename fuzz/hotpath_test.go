package fuzz_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/topology"
)

// fuzzReader decodes fuzz input into bounded choices; once the input is
// exhausted every read yields zero, so a short input picks the first
// choice of everything.
type fuzzReader struct{ b []byte }

func (r *fuzzReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

func (r *fuzzReader) intn(n int) int { return int(r.byte()) % n }

func (r *fuzzReader) u16() int { return int(r.byte()) | int(r.byte())<<8 }

func fpick[T any](r *fuzzReader, vs ...T) T { return vs[int(r.byte())%len(vs)] }

// fuzzByteBudget bounds the simulated memory of both engines of a fuzz
// case, so that one execution (scramble, fill, transfer, check of every
// byte) stays around a millisecond.
const fuzzByteBudget = 256 << 10

// engineBytes estimates the arena bytes of all ranks of an engine.
func engineBytes(m *kvsim.Model, e *kvsim.Engine) int {
	tokens := e.Blocks * e.LogicalBlock
	n := 0
	for _, k := range m.Kinds {
		switch k {
		case fa, swa:
			n += tokens * 2 * max(m.TotalKVHeads, e.TP) * m.HeadSize * m.ElemBytes
		case mla:
			n += tokens * e.TP * m.MLABytesPerToken
		case mmb:
			n += e.Blocks * e.TP * 256
		}
	}
	return n
}

// fuzzCase decodes a mostly valid scenario: a model of one to three layer
// kinds (full attention, sliding window, MLA, Mamba; repeated per stage when
// P has two pipeline stages), K ∈ {1,2,4,8,16} KV heads, small head and
// element sizes; P and D TP sizes from {1,2,4,8} (GQA included); kernel
// blocks m·a and m·b with one of a, b equal to 1, 1 or 2 kernel blocks per
// logical block on each side; HND or NHD and a packing on each side (mixed
// ones with raised MaxSegments); the request's tokens and D's prefix hit.
func fuzzCase(r *fuzzReader) *semCase {
	hnd, nhd := topology.LayoutHND, topology.LayoutNHD
	packed, split, separate := topology.PackedKV, topology.SplitKV, topology.SeparateKV
	pattern := fpick(r, kinds(fa), kinds(fa, fa), kinds(fa, swa), kinds(swa), kinds(mla), kinds(fa, mla),
		kinds(fa, mmb), kinds(swa, fa, mmb), kinds(mmb, mla), kinds(mla, swa))
	pp := fpick(r, 1, 1, 2)
	var layers []topology.Kind
	for i := 0; i < pp; i++ {
		layers = append(layers, pattern...)
	}
	cell := fpick(r, [2]int{1, 1}, [2]int{2, 1}, [2]int{1, 2}, [2]int{4, 2}, [2]int{3, 2}, [2]int{2, 4})
	m := kvsim.Model{Kinds: layers, Window: fpick(r, 5, 24, 40, 100), TotalKVHeads: fpick(r, 1, 2, 4, 8, 16),
		HeadSize: cell[0], ElemBytes: cell[1], MLABytesPerToken: fpick(r, 1, 12, 40),
		MambaConv: fpick(r, []int64{48, 16, 16}, []int64{8}, []int64{32, 64}),
		MambaSSM:  fpick(r, int64(64), 16, 0), MambaPad: fpick(r, int64(0), 8)}
	unit, mul := fpick(r, 1, 2, 4, 8, 16, 3), fpick(r, 1, 2, 3, 4)
	pk, dk := unit, unit
	if r.byte()%2 == 0 {
		pk *= mul
	} else {
		dk *= mul
	}
	pl, dl := pk*fpick(r, 1, 2), dk*fpick(r, 1, 2)
	lp, ld := fpick(r, hnd, nhd), fpick(r, hnd, nhd)
	if r.byte()%2 == 0 {
		ld = lp
	}
	pPack := fpick(r, packed, split, separate)
	dPack := pPack
	if pPack != separate && r.byte()%3 == 0 {
		dPack = fpick(r, packed, split)
	}
	c := &semCase{
		name:  "fuzz",
		model: m,
		p:     kvsim.Engine{ID: 1, TP: fpick(r, 1, 2, 4, 8), PP: pp, LogicalBlock: pl, KernelBlock: pk, Layout: lp, Packing: pPack},
		d:     kvsim.Engine{ID: 2, TP: fpick(r, 1, 2, 4, 8), PP: 1, LogicalBlock: dl, KernelBlock: dk, Layout: ld, Packing: dPack, Blocks: 4 + r.intn(9)},
	}
	if lp != ld || pPack != dPack {
		c.maxSegs = 1 << 12 // exact placement of a mixed layout: one descriptor per cell
	}
	sizeP := func() { c.p.Blocks = max(3, (c.d.Blocks*dl+pl-1)/pl) } // P holds every token D can
	sizeP()
	for shrunk := false; !shrunk && engineBytes(&c.model, &c.p)+engineBytes(&c.model, &c.d) > fuzzByteBudget; {
		switch {
		case c.model.HeadSize*c.model.ElemBytes > 1:
			c.model.HeadSize, c.model.ElemBytes = 1, 1
		case c.model.MLABytesPerToken > 1:
			c.model.MLABytesPerToken = 1
		case c.d.Blocks > 4:
			c.d.Blocks = 4
			sizeP()
		case c.model.TotalKVHeads > 2:
			c.model.TotalKVHeads /= 2
		default:
			c.d.Blocks = 3
			sizeP()
			shrunk = true
		}
	}
	capTok := min(c.p.Blocks*pl, c.d.Blocks*dl)
	switch r.intn(8) {
	case 0:
		c.tokens = capTok
	case 1:
		c.tokens = 0 // no bound: empty attention lists, Mamba still moves
	default:
		c.tokens = 1 + r.u16()%capTok
	}
	switch r.intn(6) {
	case 2, 3:
		c.hit = min(1+r.intn(3), c.tokens/dl) * dl
	case 4:
		c.hit = (c.tokens + dl - 1) / dl * dl // full hit: D's list is empty
	case 5:
		c.hit = c.tokens / dl * dl
	}
	c.fragment = r.byte()%2 == 0
	c.reference = r.byte()%4 == 0
	c.seed = uint64(r.byte())
	return c
}

// describe names a fuzz case for failure messages.
func describe(c *semCase) string {
	return fmt.Sprintf("layers %v heads %d head %d·%dB mla %dB/tok mamba %v+%d+%d; P tp%d pp%d logical %d kernel %d %v/%v blocks %d; "+
		"D tp%d logical %d kernel %d %v/%v blocks %d; tokens %d hit %d fragment %v reference %v maxSegs %d seed %d",
		c.model.Kinds, c.model.TotalKVHeads, c.model.HeadSize, c.model.ElemBytes, c.model.MLABytesPerToken, c.model.MambaConv, c.model.MambaSSM, c.model.MambaPad,
		c.p.TP, c.p.PP, c.p.LogicalBlock, c.p.KernelBlock, c.p.Layout, c.p.Packing, c.p.Blocks,
		c.d.TP, c.d.LogicalBlock, c.d.KernelBlock, c.d.Layout, c.d.Packing, c.d.Blocks,
		c.tokens, c.hit, c.fragment, c.reference, c.maxSegs, c.seed)
}

// newRNG seeds a generator from fuzz input.
func newRNG(in []byte) *rand.Rand {
	h := uint64(14695981039346656037)
	for _, b := range in {
		h = (h ^ uint64(b)) * 1099511628211
	}
	return rand.New(rand.NewPCG(h, 9))
}

// tpSeeds decode (fuzzCase) into the scenarios named beside them.
var tpSeeds = [][]byte{
	// One full-attention layer, TP 1 -> 1, block 1, every token.
	{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0},
	// GQA: 2 heads, P TP 1 -> D TP 8, kernel 4 -> 8, logical 8 -> 16, prefix hit 16.
	{1, 0, 3, 0, 1, 0, 0, 0, 0, 2, 1, 1, 1, 1, 0, 0, 0, 0, 1, 0, 3, 4, 2, 100, 0, 2, 0, 0, 1, 3},
	// Sliding window, full attention and Mamba, NHD split, P TP 8 -> D TP 2, logical 16 -> 8, prefix hit 24.
	{7, 0, 1, 1, 2, 0, 0, 0, 1, 3, 0, 0, 1, 0, 1, 1, 0, 1, 1, 3, 1, 8, 3, 77, 0, 3, 2, 1, 0, 5},
	// Full attention and MLA over two P stages, P TP 4 HND packed -> D TP 1 NHD split, kernel 3 -> 12.
	{5, 2, 4, 0, 2, 2, 0, 0, 0, 5, 3, 1, 1, 0, 0, 1, 1, 0, 0, 1, 2, 0, 6, 2, 90, 0, 0, 0, 1, 7},
	// Separate K and V regions, 16 heads, P TP 2 -> D TP 4, logical 16 -> 32, full prefix hit.
	{1, 0, 2, 0, 4, 0, 0, 0, 0, 4, 0, 0, 0, 1, 0, 0, 0, 2, 1, 2, 0, 2, 200, 0, 4, 0, 1, 1},
	// Mamba and MLA only, P TP 8 -> D TP 4, tokens 0 (no bound), reference builder.
	{8, 0, 0, 0, 0, 1, 1, 1, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 3, 2, 2, 1, 0, 1, 0, 9},
	// One head, P TP 1 -> D TP 8 NHD, kernel 16 -> 4 (logical 16 -> 8), Mamba, every token.
	{6, 0, 5, 0, 0, 0, 2, 0, 1, 2, 3, 0, 0, 1, 1, 1, 0, 0, 1, 0, 3, 8, 0, 0, 0, 1, 2},
}

// FuzzTPMapping: across all ranks, every D head byte of the request is
// written exactly once with the right value, nothing else is touched, and
// every rank receives the notification count topology promises, for
// random TP pairs (GQA included), block sizes, layouts, packings, model
// kinds, PP stages, prefix hits, in push and in pull, through the
// optimised builder or the reference.
func FuzzTPMapping(f *testing.F) {
	for _, s := range tpSeeds {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		c := fuzzCase(&fuzzReader{in})
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("case: %s", describe(c))
			}
		})
		for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
			c.op = op
			runSemantic(t, c)
		}
	})
}

// fuzzIDs returns n distinct block ids below limit. Modes: 0 consecutive
// from a random start; 1 consecutive ending at the last block; 2 shuffled;
// 3 runs of 1..4 consecutive ids in shuffled order; 4 descending from the
// last block.
func fuzzIDs(rng *rand.Rand, n, limit, mode int) []topology.BlockID {
	ids := make([]topology.BlockID, 0, n)
	switch mode {
	case 0, 1:
		s := rng.IntN(limit - n + 1)
		if mode == 1 {
			s = limit - n
		}
		for i := 0; i < n; i++ {
			ids = append(ids, topology.BlockID(s+i))
		}
	case 2:
		for _, v := range rng.Perm(limit)[:n] {
			ids = append(ids, topology.BlockID(v))
		}
	case 3:
		var chunks [][2]int
		for s := 0; s < limit; {
			l := min(1+rng.IntN(4), limit-s)
			chunks = append(chunks, [2]int{s, l})
			s += l
		}
		rng.Shuffle(len(chunks), func(i, j int) { chunks[i], chunks[j] = chunks[j], chunks[i] })
		for _, ch := range chunks {
			for i := 0; i < ch[1] && len(ids) < n; i++ {
				ids = append(ids, topology.BlockID(ch[0]+i))
			}
		}
	default:
		for i := 0; i < n; i++ {
			ids = append(ids, topology.BlockID(limit-1-i))
		}
	}
	return ids
}

// fuzzRequest is buildRequest with more id patterns (fuzzIDs) and Mamba
// lists whose lengths differ by up to one.
func fuzzRequest(rng *rand.Rand, c *semCase, groups []topology.Group, mode int) *hotpath.Request {
	req := &hotpath.Request{Tokens: c.tokens}
	for _, g := range groups {
		ps, ds := attentionSpans(c, g, func(n, limit int) []topology.BlockID { return fuzzIDs(rng, n, limit, mode) })
		if g.Kind == mmb {
			ns := rng.IntN(4)
			nd := min(max(ns+rng.IntN(3)-1, 0), 3)
			ps = topology.Span{IDs: fuzzIDs(rng, ns, c.p.Blocks, mode)}
			ds = topology.Span{IDs: fuzzIDs(rng, nd, c.d.Blocks, mode)}
		}
		req.Src = append(req.Src, ps)
		req.Dst = append(req.Dst, ds)
	}
	return req
}

// relocate returns a copy of l whose regions lie back to back from base,
// with no gap, so that nothing but the builder's region boundaries keeps a
// descriptor from running into the next region; with devices, regions are
// spread over two devices.
func relocate(r *fuzzReader, l *topology.Layout, base uint64, devices bool) *topology.Layout {
	out := *l
	out.Regions = slices.Clone(l.Regions)
	for i := range out.Regions {
		reg := &out.Regions[i]
		reg.Base = base
		base += uint64(reg.BlockLen) * uint64(reg.NumBlocks)
		if devices {
			reg.DeviceID = int32(r.intn(2))
		}
	}
	return &out
}

// regionOf returns the index of the region of l that holds [addr, addr+n),
// or -1 when no single region does.
func regionOf(l *topology.Layout, addr, n uint64) int {
	for i := range l.Regions {
		reg := &l.Regions[i]
		end := reg.Base + uint64(reg.BlockLen)*uint64(reg.NumBlocks)
		if addr >= reg.Base && addr <= end && n <= end-addr {
			return i
		}
	}
	return -1
}

// checkCoalesced fails unless got moves exactly ref's bytes, paired the
// same way and in the same order: split back into reference-sized pieces,
// each descriptor of got is a run of consecutive reference descriptors,
// contiguous on both sides, on the same devices, and no longer than
// maxRun unless it is a single reference descriptor. Both lists are in
// write orientation (Local is the source).
func checkCoalesced(t *testing.T, got, ref []hotpath.Desc, maxRun int64) {
	t.Helper()
	i := 0
	for k, d := range got {
		if d.Len == 0 {
			t.Fatalf("descriptor %d %+v is empty", k, d)
		}
		var off uint64
		pieces := 0
		for off < d.Len {
			if i == len(ref) {
				t.Fatalf("descriptor %d %+v runs past the reference's %d descriptors", k, d, len(ref))
			}
			p := ref[i]
			if p.Local != d.Local+off || p.Remote != d.Remote+off || p.LocalDev != d.LocalDev || p.RemoteDev != d.RemoteDev || p.Len > d.Len-off {
				t.Fatalf("descriptor %d %+v at +%d: next reference descriptor %d is %+v", k, d, off, i, p)
			}
			off += p.Len
			i++
			pieces++
		}
		if maxRun > 0 && pieces > 1 && d.Len > uint64(maxRun) {
			t.Fatalf("descriptor %d %+v merges %d reference descriptors past MaxRunBytes %d", k, d, pieces, maxRun)
		}
	}
	if i != len(ref) {
		t.Fatalf("descriptors cover %d of the reference's %d descriptors", i, len(ref))
	}
}

// checkRegions fails unless every descriptor lies inside one region on
// each side, the two regions are a pair the plan moves, and the devices
// are the regions' devices.
func checkRegions(t *testing.T, got []hotpath.Desc, plan *topology.Plan, src, dst *topology.Layout) {
	t.Helper()
	pairs := map[[2]int]bool{}
	for g := range plan.Groups {
		for _, rp := range plan.Groups[g].Regions {
			pairs[[2]int{rp.Src, rp.Dst}] = true
		}
	}
	for k, d := range got {
		i, j := regionOf(src, d.Local, d.Len), regionOf(dst, d.Remote, d.Len)
		if i < 0 || j < 0 || !pairs[[2]int{i, j}] {
			t.Fatalf("descriptor %d %+v: src region %d, dst region %d, want one region each side, a pair of the plan %v", k, d, i, j, pairs)
		}
		if d.LocalDev != src.Regions[i].DeviceID || d.RemoteDev != dst.Regions[j].DeviceID {
			t.Fatalf("descriptor %d %+v: devices of regions %d and %d are %d and %d", k, d, i, j, src.Regions[i].DeviceID, dst.Regions[j].DeviceID)
		}
	}
}

func swapped(ds []hotpath.Desc) []hotpath.Desc {
	out := make([]hotpath.Desc, len(ds))
	for i, d := range ds {
		out[i] = hotpath.Desc{Local: d.Remote, Remote: d.Local, Len: d.Len, LocalDev: d.RemoteDev, RemoteDev: d.LocalDev}
	}
	return out
}

// FuzzCoalesce is the differential test of the optimised builder against
// the reference on random plans (the semantic shapes: hetero TP with GQA,
// hetero block sizes, NHD and mixed layouts, packings, sliding window,
// MLA and Mamba regions, pooled groups, PP stages; regions back to back and
// on several devices), random block ids (fresh, at the end of the pool,
// shuffled, runs in shuffled order, descending) and random run caps:
//   - split back into reference-sized pieces, AppendDescs moves the bytes
//     AppendReference moves, paired the same way, in the same order;
//   - every descriptor lies in one region on each side, of a region pair
//     of the plan (so nothing merges across regions), on its devices;
//   - a descriptor merging several units stays within MaxRunBytes;
//   - OpRead gives OpWrite's descriptors with the sides swapped, the
//     output slice's prefix is kept, and a Builder reused after another
//     request gives the same descriptors as a fresh one;
//   - AppendIndices resolved through AppendPrepared gives the reference.
//
// Request.Tokens is the request's, none (0), or a bound inside the lists.
// descBytes sums the descriptors' lengths.
func descBytes(ds []hotpath.Desc) int64 {
	var n int64
	for _, d := range ds {
		n += int64(d.Len)
	}
	return n
}

func FuzzCoalesce(f *testing.F) {
	// Each seed is a fuzzCase scenario, then: P stage, P rank, D peer,
	// group pooling, region placement (+ devices), run cap, id pattern,
	// token bound.
	for _, s := range [][]byte{
		// Two full-attention layers back to back on one device, both pools
		// used in full: only region boundaries stop a merge.
		{1, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 4, 0, 0, 1, 1, 0, 0, 0, 0, 1, 1, 0, 0},
		// GQA TP 1 -> 8, cap 64, runs in shuffled order.
		append(slices.Clone(tpSeeds[1]), 0, 0, 5, 1, 0, 1, 63, 0, 3),
		// Sliding window and full attention pooled, Mamba, regions on two devices, cap 32, shuffled ids.
		append(slices.Clone(tpSeeds[2]), 0, 1, 0, 0, 2, 1, 0, 1, 0, 1, 1, 1, 7, 2, 2),
		// Two P stages, mixed layout and packing, pooled groups, a 1-byte cap, descending ids,
		// a token bound inside the lists.
		append(slices.Clone(tpSeeds[3]), 1, 2, 0, 0, 1, 1, 0, 0, 4, 2),
		// Separate K and V, full prefix hit.
		append(slices.Clone(tpSeeds[4]), 0, 1, 0, 0, 1, 0, 1),
		// Mamba and MLA only.
		append(slices.Clone(tpSeeds[5]), 0, 0, 0, 1, 0, 0, 1),
		// One head TP 1 -> 8, kernel 16 -> 4, ids ending at the last block.
		append(slices.Clone(tpSeeds[6]), 0, 0, 7, 0, 1, 0, 1),
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		r := &fuzzReader{in}
		c := fuzzCase(r)
		var src, dst *topology.Layout
		var req *hotpath.Request
		var maxRun int64
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("case: %s", describe(c))
				if src != nil && dst != nil {
					t.Logf("plan src tp%d pp%d -> dst tp%d, MaxRunBytes %d, request %+v", src.TPRank, src.PPRank, dst.TPRank, maxRun, req)
				}
			}
		})
		pr, dr := buildEngines(t, c)
		stage := pr[r.intn(len(pr))]
		src = &stage[r.intn(len(stage))].Layout
		peers, err := topology.TargetRanks(nil, c.p.TP, c.d.TP, src.TPRank)
		if err != nil {
			t.Fatal(err)
		}
		dst = &dr[0][peers[r.intn(len(peers))]].Layout
		if r.byte()%2 == 0 {
			// One group over every non-Mamba region (mixed attention and
			// MLA regions in a group, as HMA pooling makes them).
			src, dst = mergeGroups(src), mergeGroups(dst)
		}
		if mode := r.intn(3); mode > 0 {
			src, dst = relocate(r, src, 1<<40, mode == 2), relocate(r, dst, 1<<41, mode == 2)
		}
		plan, err := topology.NewPlan(src, dst, topology.PlanOptions{MaxSegments: c.maxSegs})
		if err != nil {
			t.Fatal(err)
		}
		switch r.intn(3) {
		case 1:
			maxRun = int64(1+r.intn(256)) << r.intn(8)
		case 2:
			// A multiple of one region's segment length: merges reach the
			// cap exactly, the boundary of the merge test.
			maxRun = int64(1+r.intn(256)) << r.intn(8)
			for g := range plan.Groups {
				if rs := plan.Groups[g].Regions; len(rs) > 0 {
					rp := rs[r.intn(len(rs))]
					maxRun = rp.Segs[r.intn(len(rp.Segs))].Len * int64(1+r.intn(8))
					break
				}
			}
		}
		rng := newRNG(in)
		idMode := r.intn(5)
		req = fuzzRequest(rng, c, dst.GroupList(), idMode)
		switch r.intn(4) {
		case 1:
			req.Tokens = 0 // no bound: the lists alone decide
		case 2:
			req.Tokens = rng.IntN(c.tokens + 1) // a bound inside the lists
		}

		ref, err := hotpath.AppendReference(nil, plan, req, hotpath.OpWrite)
		if err != nil {
			t.Fatal(err)
		}
		prefix := []hotpath.Desc{{Local: 1, Len: 1}, {Remote: 2, Len: 2}}
		b := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: maxRun})
		out, err := b.AppendDescs(slices.Clip(prefix), plan, req)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(out[:2], prefix) {
			t.Fatalf("AppendDescs changed the output's prefix to %+v", out[:2])
		}
		got := out[2:]
		checkCoalesced(t, got, ref, maxRun)
		checkRegions(t, got, plan, src, dst)
		checkMaximal(t, got, ref, maxRun, src, dst)
		// The package's own invariant check agrees (it panics otherwise).
		checkAgainstReference(got, plan, req, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: maxRun})

		// A Builder's scratch state carries nothing from one call to the next.
		other := fuzzRequest(rng, c, dst.GroupList(), (idMode+1)%5)
		if _, err := b.AppendDescs(nil, plan, other); err != nil {
			t.Fatal(err)
		}
		again, err := b.AppendDescs(nil, plan, req)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(again, got) {
			t.Fatalf("a reused Builder gives %d descriptors, a fresh one %d (first difference at %d)", len(again), len(got), firstDiff(again, got))
		}

		// Layouts expand to the same descriptors, in order (and to the
		// read's, from a read Builder), after a prefix left alone.
		lays := &hotpath.Layouts{Bases: []hotpath.BasePair{{Local: 9}}, Entries: []hotpath.LayoutEntry{{Len: 9}},
			Spans: []hotpath.LayoutSpan{{B0: 0, B1: 1, E0: 0, E1: 1}}}
		if err := b.AppendLayouts(lays, plan, req); err != nil {
			t.Fatal(err)
		}
		if lays.Bases[0].Local != 9 || lays.Entries[0].Len != 9 || lays.Spans[0] != (hotpath.LayoutSpan{B0: 0, B1: 1, E0: 0, E1: 1}) {
			t.Fatal("AppendLayouts changed the layouts before it")
		}
		if exp := lays.Expand(nil, lays.Spans[1:]); !slices.Equal(exp, got) {
			t.Fatalf("the layouts expand to %d descriptors, AppendDescs gives %d (first difference at %d)", len(exp), len(got), firstDiff(exp, got))
		}
		if n, bytes := lays.Pieces(lays.Spans[1:]); n != len(got) || bytes != descBytes(got) {
			t.Fatalf("Pieces = %d, %d bytes; the descriptors are %d, %d bytes", n, bytes, len(got), descBytes(got))
		}

		// Pull: the same descriptors with local and remote swapped.
		rb := mustBuilder(t, hotpath.Options{Op: hotpath.OpRead, MaxRunBytes: maxRun})
		read, err := rb.AppendDescs(nil, plan, req)
		if err != nil {
			t.Fatal(err)
		}
		if want := swapped(got); !slices.Equal(read, want) {
			t.Fatalf("OpRead gives %d descriptors, OpWrite swapped %d (first difference at %d)", len(read), len(want), firstDiff(read, want))
		}
		var rl hotpath.Layouts
		if err := rb.AppendLayouts(&rl, plan, req); err != nil {
			t.Fatal(err)
		}
		if exp := rl.Expand(nil, rl.Spans); !slices.Equal(exp, read) {
			t.Fatalf("OpRead layouts expand to %d descriptors, AppendDescs gives %d", len(exp), len(read))
		}
		refRead, err := hotpath.AppendReference(nil, plan, req, hotpath.OpRead)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(refRead, swapped(ref)) {
			t.Fatal("AppendReference(OpRead) is not AppendReference(OpWrite) swapped")
		}

		// Prepared lists: indices resolve to the reference's descriptors.
		ns, nd := hotpath.PreparedLen(plan, hotpath.SrcSide), hotpath.PreparedLen(plan, hotpath.DstSide)
		if ns+nd > 1<<16 {
			return // a few huge mixed-layout plans: skip the slow list build
		}
		sl, err := hotpath.AppendPrepared(nil, plan, hotpath.SrcSide)
		if err != nil {
			t.Fatal(err)
		}
		dl, err := hotpath.AppendPrepared(nil, plan, hotpath.DstSide)
		if err != nil {
			t.Fatal(err)
		}
		if int64(len(sl)) != ns || int64(len(dl)) != nd {
			t.Fatalf("prepared lists have %d and %d entries, PreparedLen %d and %d", len(sl), len(dl), ns, nd)
		}
		idx, err := b.AppendIndices(nil, plan, req)
		if err != nil {
			t.Fatal(err)
		}
		if len(idx) != len(ref) {
			t.Fatalf("AppendIndices = %d pairs, reference %d descriptors", len(idx), len(ref))
		}
		if runs := hotpath.IndexRuns(idx); runs > len(got) {
			t.Fatalf("IndexRuns = %d, more than the %d descriptors AppendDescs gives (it must be a lower bound)", runs, len(got))
		}
		for i, p := range idx {
			if int(p.Local) >= len(sl) || int(p.Remote) >= len(dl) || p.Local < 0 || p.Remote < 0 {
				t.Fatalf("index pair %d = %+v outside the prepared lists (%d, %d)", i, p, len(sl), len(dl))
			}
			l, rm := sl[p.Local], dl[p.Remote]
			if l.Addr != ref[i].Local || rm.Addr != ref[i].Remote || l.Len != ref[i].Len || rm.Len != ref[i].Len ||
				l.Dev != ref[i].LocalDev || rm.Dev != ref[i].RemoteDev {
				t.Fatalf("index pair %d resolves to %+v/%+v, reference %+v", i, l, rm, ref[i])
			}
		}
		ridx, err := rb.AppendIndices(nil, plan, req)
		if err != nil {
			t.Fatal(err)
		}
		for i, p := range ridx {
			if p.Local != idx[i].Remote || p.Remote != idx[i].Local {
				t.Fatalf("OpRead index pair %d = %+v, OpWrite's %+v swapped", i, p, idx[i])
			}
		}
	})
}

func firstDiff(a, b []hotpath.Desc) int {
	for i := range min(len(a), len(b)) {
		if a[i] != b[i] {
			return i
		}
	}
	return min(len(a), len(b))
}

// FuzzBuilderInput: arbitrary block ids (negative, huge), starts, token
// counts and group counts against a fixed valid plan (a full-attention and
// a Mamba group; P TP 2 HND logical 16 -> D TP 1 NHD logical 32) never
// panic; invalid ones make AppendDescs, AppendIndices and AppendReference
// return ErrInvalidRequest and leave dst at its original length; valid
// ones are accepted, and the descriptors match the reference.
func FuzzBuilderInput(f *testing.F) {
	f.Add([]byte{2, 0, 0, 3, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 2, 5, 6, 1, 4, 0, 0, 0, 1, 9}, int64(0), int64(0), int64(40))
	f.Add([]byte{1, 255, 255, 255, 255}, int64(-16), int64(7), int64(-1))
	f.Add([]byte{2, 0, 1, 2}, int64(1<<40), int64(16), int64(1<<50))
	f.Add([]byte{2, 1, 7, 0, 0, 0, 1, 200, 0, 0, 0, 0, 3, 1, 2, 3}, int64(16), int64(32), int64(0))
	f.Add([]byte{3, 1, 1, 0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 2}, int64(0), int64(0), int64(1))
	src, dst := layoutsForFuzz(f)
	plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if err != nil {
		f.Fatal(err)
	}
	if len(plan.Groups) != 2 || plan.Groups[0].Kind != fa || plan.Groups[1].Kind != mmb ||
		len(plan.Groups[0].Regions) == 0 || len(plan.Groups[1].Regions) == 0 {
		f.Fatalf("fuzz plan groups %+v, want a full-attention and a Mamba group, both moving bytes", plan.Groups)
	}
	const maxStart = 1 << 40
	f.Fuzz(func(t *testing.T, in []byte, sStart, dStart, tokens int64) {
		r := &fuzzReader{in}
		groups := r.intn(4)
		req := &hotpath.Request{Tokens: int(tokens)}
		valid := groups == len(plan.Groups)
		for g := 0; g < groups; g++ {
			var s, d topology.Span
			if g == 0 {
				s.Start, d.Start = int(sStart), int(dStart)
			} else {
				s.Start, d.Start = int(int16(r.u16())), int(int16(r.u16()))
			}
			gp := &plan.Groups[min(g, len(plan.Groups)-1)]
			for i := r.intn(6); i > 0; i-- {
				id := topology.BlockID(int32(uint32(r.byte()) | uint32(r.byte())<<8 | uint32(r.byte())<<16 | uint32(r.byte())<<24))
				s.IDs = append(s.IDs, id)
				if id < 0 || id >= gp.SrcLimit {
					valid = false
				}
			}
			for i := r.intn(6); i > 0; i-- {
				id := topology.BlockID(int8(r.byte()))
				d.IDs = append(d.IDs, id)
				if id < 0 || id >= gp.DstLimit {
					valid = false
				}
			}
			switch {
			case g >= len(plan.Groups):
			case gp.Kind == mmb:
				// Mamba lists pair by count (TrimSSM); starts are unused.
				if n := len(s.IDs) - len(d.IDs); n < -1 || n > 1 {
					valid = false
				}
			case s.Start < 0 || d.Start < 0 || s.Start%gp.SrcBlockTokens != 0 || d.Start%gp.DstBlockTokens != 0 ||
				s.Start > maxStart || d.Start > maxStart || tokens < 0 || tokens > maxStart:
				valid = false
			}
			req.Src, req.Dst = append(req.Src, s), append(req.Dst, d)
		}
		var ref []hotpath.Desc
		refOut, refErr := hotpath.AppendReference(make([]hotpath.Desc, 2), plan, req, hotpath.OpWrite)
		if refErr == nil {
			ref = refOut[2:]
		}
		for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
			maxRun := int64(r.intn(3)) * 4096
			b := mustBuilder(t, hotpath.Options{Op: op, MaxRunBytes: maxRun})
			out, err := b.AppendDescs(make([]hotpath.Desc, 2), plan, req)
			idx, ierr := b.AppendIndices(make([]hotpath.IndexPair, 3), plan, req)
			for _, e := range []error{err, ierr, refErr} {
				if e != nil && !errors.Is(e, hotpath.ErrInvalidRequest) {
					t.Fatalf("error %v is not ErrInvalidRequest", e)
				}
			}
			if (err == nil) != valid || (ierr == nil) != valid || (refErr == nil) != valid {
				t.Fatalf("request %+v (valid %v): AppendDescs error %v, AppendIndices error %v, AppendReference error %v", req, valid, err, ierr, refErr)
			}
			if err != nil {
				if len(out) != 2 || len(idx) != 3 || len(refOut) != 2 {
					t.Fatalf("failed calls returned %d descriptors, %d index pairs, %d reference descriptors, want the original 2, 3, 2", len(out), len(idx), len(refOut))
				}
				continue
			}
			got := out[2:]
			if op == hotpath.OpRead {
				got = swapped(got)
			}
			checkCoalesced(t, got, ref, maxRun)
		}
	})
}

func layoutsForFuzz(f *testing.F) (*topology.Layout, *topology.Layout) {
	m := kvsim.SmallModel(4, fa, mmb)
	pe, de := eng(1, 2, 16, 16, topology.LayoutHND, topology.PackedKV), eng(2, 1, 32, 16, topology.LayoutNHD, topology.PackedKV)
	pr, err := kvsim.Build(&m, &pe)
	if err != nil {
		f.Fatal(err)
	}
	dr, err := kvsim.Build(&m, &de)
	if err != nil {
		f.Fatal(err)
	}
	return &pr[0][1].Layout, &dr[0][0].Layout
}

// mergeGroups returns a copy of l whose non-Mamba groups are one group.
func mergeGroups(l *topology.Layout) *topology.Layout {
	out := *l
	out.Groups = nil
	merged := -1
	for _, g := range l.Groups {
		if g.Kind == mmb {
			out.Groups = append(out.Groups, g)
			continue
		}
		if merged < 0 {
			merged = len(out.Groups)
			out.Groups = append(out.Groups, topology.Group{Kind: g.Kind, Window: g.Window})
		}
		out.Groups[merged].Regions = append(out.Groups[merged].Regions, g.Regions...)
	}
	return &out
}

// checkMaximal fails when two consecutive descriptors of one region pair are
// contiguous on both sides and the cap would have let the second's first
// reference piece join the first: AppendDescs promises to merge them.
func checkMaximal(t *testing.T, got, ref []hotpath.Desc, maxRun int64, src, dst *topology.Layout) {
	t.Helper()
	first := map[[2]uint64]uint64{}
	for _, p := range ref {
		k := [2]uint64{p.Local, p.Remote}
		if _, ok := first[k]; !ok {
			first[k] = p.Len
		}
	}
	for k := 1; k < len(got); k++ {
		a, b := got[k-1], got[k]
		if a.Local+a.Len != b.Local || a.Remote+a.Len != b.Remote || a.LocalDev != b.LocalDev || a.RemoteDev != b.RemoteDev {
			continue
		}
		if regionOf(src, a.Local, a.Len) != regionOf(src, b.Local, b.Len) || regionOf(dst, a.Remote, a.Len) != regionOf(dst, b.Remote, b.Len) {
			continue // a region boundary: never merged, by design
		}
		if maxRun > 0 && a.Len+first[[2]uint64{b.Local, b.Remote}] > uint64(maxRun) {
			continue
		}
		t.Fatalf("descriptors %d %+v and %d %+v are contiguous on both sides in one region pair but not merged (MaxRunBytes %d)", k-1, a, k, b, maxRun)
	}
}
