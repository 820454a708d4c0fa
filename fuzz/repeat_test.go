package fuzz_test

import (
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// repeatCase is a pair of layouts built directly (no simulated memory), so
// a model can have many layers and its regions can be placed anywhere.
type repeatCase struct {
	src, dst *topology.Layout
	// overlap is set when two regions of one side share bytes, where
	// regionOf cannot tell which region a descriptor belongs to.
	overlap bool
}

// repeatLayout builds one rank's layout: one region per entry of kinds
// (full attention or MLA), in one pooled group or one group per kind, with
// a group listing its regions forwards or backwards, placed by mode:
// 0 back to back with one gap, 1 each step repeating the last one or not,
// 2 descending at equal steps, 3 all at one base, 4 anywhere near base.
// Every region holds blocks logical blocks; with devices each region is
// on device 0 or 1; oddBlock gives one region one more kernel block than
// the others.
func repeatLayout(r *fuzzReader, tp, rank, logical, kernel int, lay topology.KVLayout, pack topology.KVPacking,
	heads, headSize, elem, mlaTok int, kinds []topology.Kind, pooled, backwards bool, base uint64, blocks, mode int,
	devices bool, oddBlock int) (*topology.Layout, bool) {
	l := &topology.Layout{TPRank: rank, TPSize: tp, PPSize: 1, TotalKVHeads: heads, HeadSize: headSize, ElemBytes: elem,
		KVLayout: lay, Packing: pack, LogicalBlockSize: logical, KernelBlockSize: kernel}
	kv := int64(2)
	if pack == topology.SeparateKV {
		kv = 1
	}
	var sizes []uint64
	for i, k := range kinds {
		reg := topology.Region{Kind: k, NumBlocks: blocks * logical / kernel}
		if i == oddBlock {
			reg.NumBlocks++
		}
		if k == mla {
			reg.BlockLen = int64(kernel * mlaTok)
		} else {
			reg.BlockLen = kv * int64(l.LocalHeads()*kernel*headSize*elem)
		}
		if devices {
			reg.DeviceID = int32(r.intn(2))
		}
		l.Regions = append(l.Regions, reg)
		sizes = append(sizes, uint64(reg.BlockLen)*uint64(reg.NumBlocks))
	}
	biggest := slices.Max(sizes)
	gap := uint64(64 * r.intn(4))
	step := biggest + gap
	addr := base
	for i := range l.Regions {
		reg := &l.Regions[i]
		switch mode {
		case 0:
			reg.Base = addr
			addr += sizes[i] + gap
		case 1:
			if r.byte()%2 == 0 {
				step = biggest + uint64(64*r.intn(8))
			}
			reg.Base = addr
			addr += step
		case 2:
			reg.Base = base + uint64(len(kinds)-1-i)*step
		case 3:
			reg.Base = base
		default:
			reg.Base = base + uint64(64*r.u16())
		}
	}
	overlap := false
	for i := range l.Regions {
		for j := range i {
			a, b := &l.Regions[i], &l.Regions[j]
			if a.Base < b.Base+sizes[j] && b.Base < a.Base+sizes[i] {
				overlap = true
			}
		}
	}
	groups := map[topology.Kind]int{}
	for i, k := range kinds {
		if pooled {
			k = kinds[0]
		}
		g, ok := groups[k]
		if !ok {
			g = len(l.Groups)
			groups[k] = g
			l.Groups = append(l.Groups, topology.Group{Kind: k})
		}
		l.Groups[g].Regions = append(l.Groups[g].Regions, i)
	}
	if backwards {
		for g := range l.Groups {
			slices.Reverse(l.Groups[g].Regions)
		}
	}
	return l, overlap
}

// FuzzRepeats is the differential test of the builder on region pairs
// that repeat one another (topology.RegionPlan.Repeats: AppendDescs writes
// the first of a stretch and shifts its descriptors for the others), on
// layouts built directly: 1..16 layers of full attention and MLA (pooled
// in one group or not, listed forwards or backwards), 1..8 KV heads, TP
// 1, 2 or 4 on each side, kernel blocks m·a and m·b, HND or NHD, any
// packing, and regions placed back to back, at steps that repeat or
// change, descending, all at one base or anywhere (overlapping), on one
// device or two, with one region sometimes one block longer than the
// rest. Ids follow fuzzIDs' patterns and caps FuzzCoalesce's. Checks:
// AppendDescs equals the reference split back into pieces (checkCoalesced
// and CheckAgainstReference), descriptors lie in a region pair of the plan
// and are maximal where no region overlaps another, OpRead is OpWrite
// swapped, and every Repeats report holds.
func FuzzRepeats(f *testing.F) {
	f.Add([]byte{})
	// 16 full-attention layers back to back, TP 4 -> 4, shuffled ids.
	f.Add([]byte{15, 0, 0, 3, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0})
	// 12 layers of attention and MLA pooled, P TP 1 -> D TP 4, steps that change, two devices, cap 96.
	f.Add([]byte{11, 1, 1, 0, 2, 0, 1, 1, 0, 1, 0, 1, 2, 2, 0, 1, 1, 0, 1, 3, 1, 0, 1, 1, 0, 1, 0, 1, 1, 0, 3, 1, 95, 0})
	// 9 MLA layers, descending, listed backwards, kernel 4 -> 8.
	f.Add([]byte{8, 2, 0, 0, 0, 1, 1, 0, 1, 0, 0, 2, 1, 2, 2, 0, 0, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0})
	f.Fuzz(func(t *testing.T, in []byte) {
		r := &fuzzReader{in}
		layers := 1 + r.intn(16)
		mix := r.intn(3) // 0 attention, 1 attention and MLA, 2 MLA
		kinds := make([]topology.Kind, layers)
		for i := range kinds {
			kinds[i] = fa
			if mix == 2 || mix == 1 && r.byte()%3 == 0 {
				kinds[i] = mla
			}
		}
		heads := fpick(r, 1, 2, 4, 8)
		sTP, dTP := fpick(r, 1, 2, 4), fpick(r, 1, 2, 4)
		headSize, elem, mlaTok := fpick(r, 1, 2, 3), fpick(r, 1, 2), fpick(r, 1, 2, 6)
		unit, mul := fpick(r, 1, 2, 4, 3), fpick(r, 1, 2, 3)
		sk, dk := unit, unit
		if r.byte()%2 == 0 {
			sk *= mul
		} else {
			dk *= mul
		}
		sl, dl := sk*fpick(r, 1, 2), dk*fpick(r, 1, 2)
		lay := fpick(r, topology.LayoutHND, topology.LayoutNHD)
		pack := fpick(r, topology.PackedKV, topology.SplitKV, topology.SeparateKV)
		pooled, backwards := r.byte()%2 == 0, r.byte()%4 == 0
		sRank := r.intn(sTP)
		peers, err := topology.TargetRanks(nil, sTP, dTP, sRank)
		if err != nil {
			t.Fatal(err)
		}
		dRank := peers[r.intn(len(peers))]
		dBlocks := 3 + r.intn(6)
		sBlocks := (dBlocks*dl + sl - 1) / sl
		odd := -1
		if r.byte()%4 == 0 {
			odd = r.intn(layers)
		}
		sMode, dMode := r.intn(5), r.intn(5)
		sDev, dDev := r.byte()%3 == 0, r.byte()%3 == 0
		var c repeatCase
		var so, do bool
		c.src, so = repeatLayout(r, sTP, sRank, sl, sk, lay, pack, heads, headSize, elem, mlaTok, kinds, pooled, backwards, 1<<40, sBlocks, sMode, sDev, odd)
		c.dst, do = repeatLayout(r, dTP, dRank, dl, dk, lay, pack, heads, headSize, elem, mlaTok, kinds, pooled, backwards, 1<<42, dBlocks, dMode, dDev, odd)
		c.overlap = so || do
		plan, err := topology.NewPlan(c.src, c.dst, topology.PlanOptions{MaxSegments: 1 << 12})
		if err != nil {
			t.Fatal(err)
		}
		checkRepeats(t, plan)

		var maxRun int64
		switch r.intn(3) {
		case 1:
			maxRun = int64(1+r.intn(256)) << r.intn(8)
		case 2:
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
		req := &hotpath.Request{}
		for _, g := range plan.Groups {
			ns := min(1+rng.IntN(int(g.SrcLimit)), int(g.SrcLimit))
			nd := min(1+rng.IntN(int(g.DstLimit)), int(g.DstLimit))
			req.Src = append(req.Src, topology.Span{IDs: fuzzIDs(rng, ns, int(g.SrcLimit), idMode)})
			req.Dst = append(req.Dst, topology.Span{IDs: fuzzIDs(rng, nd, int(g.DstLimit), idMode)})
		}
		if r.byte()%2 == 0 {
			req.Tokens = rng.IntN(dBlocks*dl + 1)
		}
		t.Cleanup(func() {
			if t.Failed() {
				t.Logf("src %+v\ndst %+v\nMaxRunBytes %d, request %+v", c.src, c.dst, maxRun, req)
			}
		})

		ref, err := hotpath.AppendReference(nil, plan, req, hotpath.OpWrite)
		if err != nil {
			t.Fatal(err)
		}
		prefix := []hotpath.Desc{{Local: 1, Len: 1}}
		b := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: maxRun})
		out, err := b.AppendDescs(slices.Clip(prefix), plan, req)
		if err != nil {
			t.Fatal(err)
		}
		if out[0] != prefix[0] {
			t.Fatalf("AppendDescs changed the output's prefix to %+v", out[0])
		}
		got := out[1:]
		checkCoalesced(t, got, ref, maxRun)
		checkAgainstReference(got, plan, req, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: maxRun})
		if !c.overlap {
			checkRegions(t, got, plan, c.src, c.dst)
			checkMaximal(t, got, ref, maxRun, c.src, c.dst)
		}
		rb := mustBuilder(t, hotpath.Options{Op: hotpath.OpRead, MaxRunBytes: maxRun})
		read, err := rb.AppendDescs(nil, plan, req)
		if err != nil {
			t.Fatal(err)
		}
		if want := swapped(got); !slices.Equal(read, want) {
			t.Fatalf("OpRead gives %d descriptors, OpWrite swapped %d (first difference at %d)", len(read), len(want), firstDiff(read, want))
		}
	})
}

// checkRepeats fails unless every Repeats report of plan holds: the k-th
// region pair after a repeated one equals it but for its indices and its
// bases, which are k steps further.
func checkRepeats(t *testing.T, plan *topology.Plan) {
	t.Helper()
	for g := range plan.Groups {
		rs := plan.Groups[g].Regions
		for i := range rs {
			n, ss, ds := rs[i].Repeats()
			if i+n >= len(rs) {
				t.Fatalf("group %d region pair %d: %d repeats, %d pairs follow", g, i, n, len(rs)-1-i)
			}
			for k := 1; k <= n; k++ {
				a, b := rs[i], rs[i+k]
				if b.SrcBase != a.SrcBase+uint64(k)*ss || b.DstBase != a.DstBase+uint64(k)*ds {
					t.Fatalf("group %d region pair %d: repeat %d at %#x/%#x, want %#x/%#x", g, i, k, b.SrcBase, b.DstBase,
						a.SrcBase+uint64(k)*ss, a.DstBase+uint64(k)*ds)
				}
				a.Src, a.Dst, a.SrcBase, a.DstBase = b.Src, b.Dst, b.SrcBase, b.DstBase
				if !samePlan(&a, &b) {
					t.Fatalf("group %d region pair %d: repeat %d differs beyond its bases: %+v, %+v", g, i, k, rs[i], rs[i+k])
				}
			}
		}
	}
}

// samePlan compares the exported fields of two region plans.
func samePlan(a, b *topology.RegionPlan) bool {
	return a.Src == b.Src && a.Dst == b.Dst && a.SrcBase == b.SrcBase && a.DstBase == b.DstBase &&
		a.SrcDev == b.SrcDev && a.DstDev == b.DstDev && a.SrcBlockLen == b.SrcBlockLen && a.DstBlockLen == b.DstBlockLen &&
		a.SrcNumBlocks == b.SrcNumBlocks && a.DstNumBlocks == b.DstNumBlocks &&
		a.SrcSlotStride == b.SrcSlotStride && a.DstSlotStride == b.DstSlotStride &&
		slices.Equal(a.Segs, b.Segs) && a.Whole == b.Whole && a.UnitBytes == b.UnitBytes
}
