package fuzz_test

import (
	"errors"
	"fmt"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// bytesReader decodes fuzz input into bounded values; it yields zeros once
// the input is exhausted, so a short input picks the first choice of
// everything.
type bytesReader struct{ b []byte }

func (r *bytesReader) byte() byte {
	if len(r.b) == 0 {
		return 0
	}
	v := r.b[0]
	r.b = r.b[1:]
	return v
}

// pick returns one of vs.
func pick[T any](r *bytesReader, vs ...T) T { return vs[int(r.byte())%len(vs)] }

// intn returns a value in [0, n) (n <= 256 is uniform enough).
func (r *bytesReader) intn(n int) int { return int(r.byte()) % n }

// u16 returns a value in [0, 65536).
func (r *bytesReader) u16() int { return int(r.byte()) | int(r.byte())<<8 }

// wild returns an arbitrary int: small, negative, zero or huge.
func (r *bytesReader) wild() int {
	switch r.byte() % 8 {
	case 0:
		return 0
	case 1:
		return -int(r.byte())
	case 2:
		return 1 << (r.byte() % 63)
	case 3:
		return -(1 << (r.byte() % 63))
	case 4:
		return 1<<(r.byte()%63) - 1
	default:
		return r.u16()
	}
}

// FuzzBlockMapping checks Align against a naive token-level model. Block
// sizes: a unit m, the two kernel blocks m·a and m·b with one of a, b equal
// to 1 (so one divides the other, powers of two or not), each logical block
// 1..3 kernel blocks. Lists of 0..8 random ids start at random multiples of
// their logical block size. The unit pairs, expanded with topology.UnitBlock, must
// cover exactly the tokens both lists hold (below the token bound rounded up
// to a unit when tokens > 0), each once, in token order, with both sides of
// a pair holding the same token at the same offset.
func FuzzBlockMapping(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 0, 3, 3, 0, 0, 40, 0})
	f.Add([]byte{4, 1, 1, 0, 1, 5, 2, 0, 2, 70, 0})      // dst kernel twice src's, 2 pages per logical block
	f.Add([]byte{2, 2, 0, 2, 0, 4, 6, 1, 0, 0, 0})       // src kernel larger, tokens 0: no bound
	f.Add([]byte{1, 6, 2, 1, 2, 7, 1, 3, 1, 200, 1})     // unit 3 (non power of two), prefix hit on dst
	f.Add([]byte{5, 3, 1, 2, 0, 8, 8, 2, 4, 255, 3, 9})  // longest lists, starts far apart
	f.Add([]byte{3, 5, 0, 0, 2, 1, 8, 0, 5, 17, 0, 0})   // one src block against a long dst list
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0, 0}) // empty lists
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &bytesReader{data}
		m := pick(r, 1, 2, 4, 8, 3, 5)
		a, b := 1, 1
		if k := pick(r, 1, 2, 3, 4, 1, 2, 3); r.byte()%2 == 0 {
			a = k
		} else {
			b = k
		}
		sk, dk := m*a, m*b
		sppl, dppl := 1+r.intn(3), 1+r.intn(3)
		src := tinyLayout(1, 0, sk*sppl, sk, 2, topology.LayoutHND, topology.PackedKV)
		dst := tinyLayout(1, 0, dk*dppl, dk, 2, topology.LayoutHND, topology.PackedKV)
		p, err := topology.NewPlan(src, dst, topology.PlanOptions{})
		if err != nil {
			t.Fatalf("topology.NewPlan(kernel %d logical %d -> kernel %d logical %d) = %v", sk, sk*sppl, dk, dk*dppl, err)
		}
		g := &p.Groups[0]
		if g.UnitTokens != m || g.SrcUnits*m != sk || g.DstUnits*m != dk || g.SrcPPL != sppl || g.DstPPL != dppl {
			t.Fatalf("group plan %+v, want unit %d, src %d·%d, dst %d·%d", g, m, sppl, sk, dppl, dk)
		}
		ss := topology.Span{Start: r.intn(6) * src.LogicalBlockSize}
		ds := topology.Span{Start: r.intn(6) * dst.LogicalBlockSize}
		for i := r.intn(9); i > 0; i-- {
			ss.IDs = append(ss.IDs, topology.BlockID(r.intn(int(g.SrcLimit))))
		}
		for i := r.intn(9); i > 0; i-- {
			ds.IDs = append(ds.IDs, topology.BlockID(r.intn(int(g.DstLimit))))
		}
		sEnd := ss.Start + len(ss.IDs)*src.LogicalBlockSize
		dEnd := ds.Start + len(ds.IDs)*dst.LogicalBlockSize
		end := max(sEnd, dEnd) + 2*m
		tokens := 0
		if r.byte()%4 != 0 {
			tokens = r.u16() % end
		}
		s0, d0, n, err := g.Align(ss, ds, tokens)
		if err != nil {
			t.Fatalf("Align(%+v, %+v, %d) = %v", ss, ds, tokens, err)
		}
		desc := fmt.Sprintf("src %+v (logical %d, kernel %d), dst %+v (logical %d, kernel %d), tokens %d: Align = %d, %d, %d",
			ss, src.LogicalBlockSize, sk, ds, dst.LogicalBlockSize, dk, tokens, s0, d0, n)
		// where is the naive model: the kernel block and offset in it at
		// which a side's list holds token tok.
		where := func(sp topology.Span, l *topology.Layout, tok int) (kernel topology.BlockID, in int, ok bool) {
			if tok < sp.Start || tok >= sp.Start+len(sp.IDs)*l.LogicalBlockSize {
				return 0, 0, false
			}
			idx, off := (tok-sp.Start)/l.LogicalBlockSize, (tok-sp.Start)%l.LogicalBlockSize
			return sp.IDs[idx]*topology.BlockID(l.PagesPerBlock()) + topology.BlockID(off/l.KernelBlockSize), off % l.KernelBlockSize, true
		}
		covered := make([]bool, end)
		prev := -1
		for k := 0; k < n; k++ {
			skb, su := topology.UnitBlock(ss.IDs, s0+k, g.SrcPPL, g.SrcUnits)
			dkb, du := topology.UnitBlock(ds.IDs, d0+k, g.DstPPL, g.DstUnits)
			t0 := ss.Start + (s0+k)*m
			if t1 := ds.Start + (d0+k)*m; t1 != t0 {
				t.Fatalf("%s: pair %d: src unit starts at token %d, dst unit at %d", desc, k, t0, t1)
			}
			if t0 <= prev {
				t.Fatalf("%s: pair %d starts at token %d, not after the previous pair's %d", desc, k, t0, prev)
			}
			prev = t0
			for tok := t0; tok < t0+m; tok++ {
				if tok < 0 || tok >= end {
					t.Fatalf("%s: pair %d holds token %d outside 0..%d", desc, k, tok, end-1)
				}
				if covered[tok] {
					t.Fatalf("%s: token %d paired twice", desc, tok)
				}
				covered[tok] = true
				wk, win, ok := where(ss, src, tok)
				if !ok || wk != skb || win != su*m+(tok-t0) {
					t.Fatalf("%s: token %d: pair %d puts it at src kernel %d+%d, naive %d+%d (held %v)", desc, tok, k, skb, su*m+(tok-t0), wk, win, ok)
				}
				wk, win, ok = where(ds, dst, tok)
				if !ok || wk != dkb || win != du*m+(tok-t0) {
					t.Fatalf("%s: token %d: pair %d puts it at dst kernel %d+%d, naive %d+%d (held %v)", desc, tok, k, dkb, du*m+(tok-t0), wk, win, ok)
				}
			}
		}
		bound := end
		if tokens > 0 {
			bound = (tokens + m - 1) / m * m
		}
		for tok := 0; tok < end; tok++ {
			_, _, a := where(ss, src, tok)
			_, _, b := where(ds, dst, tok)
			if want := a && b && tok < bound; want != covered[tok] {
				t.Fatalf("%s: token %d: covered %v, want %v (src holds %v, dst holds %v, bound %d)", desc, tok, covered[tok], want, a, b, bound)
			}
		}
	})
}

// wildLayout decodes an arbitrary layout: any field may be negative, zero
// or huge; region and group counts stay small.
func wildLayout(r *bytesReader) *topology.Layout {
	l := &topology.Layout{
		TPRank: r.wild(), TPSize: r.wild(), PPRank: r.wild() % 4, PPSize: r.wild() % 4,
		TotalKVHeads: r.wild(), HeadSize: r.wild(), ElemBytes: r.wild() % 17,
		KVLayout: topology.KVLayout(r.byte() % 4), Packing: topology.KVPacking(r.byte() % 5),
		LogicalBlockSize: r.wild(), KernelBlockSize: r.wild(), RegionOffset: r.wild() % 8,
	}
	// Often make the core shape valid so later checks are reached.
	if r.byte()%2 == 0 {
		l.TPSize = pick(r, 1, 2, 4, 8)
		l.TPRank = r.intn(l.TPSize)
		l.PPSize, l.PPRank = 1, 0
		l.TotalKVHeads = pick(r, 1, 2, 4, 8)
		l.HeadSize, l.ElemBytes = pick(r, 1, 2, 4), pick(r, 1, 2)
		l.KVLayout, l.Packing = pick(r, topology.LayoutHND, topology.LayoutNHD), pick(r, topology.PackedKV, topology.SplitKV, topology.SeparateKV)
		l.KernelBlockSize = pick(r, 1, 2, 4, 16)
		l.LogicalBlockSize = l.KernelBlockSize * pick(r, 1, 2)
		l.RegionOffset = 0
	}
	nr := r.intn(4)
	tame := l.KernelBlockSize > 0 && l.TPSize > 0 && l.TotalKVHeads > 0
	for i := 0; i < nr; i++ {
		reg := topology.Region{Kind: topology.Kind(r.byte() % 6), Window: r.wild(), Base: uint64(r.wild()), NumBlocks: r.wild() % 64,
			BlockLen: int64(r.wild()), DeviceID: int32(r.byte())}
		for j := r.intn(4); j > 0; j-- {
			reg.ConvBytes = append(reg.ConvBytes, int64(r.wild()))
		}
		reg.SSMBytes = int64(r.wild())
		if tame && r.byte()%4 != 0 {
			// A region valid for the layout, of a random kind.
			reg.Kind = pick(r, topology.KindFullAttention, topology.KindSlidingWindow, topology.KindMLA, topology.KindMamba)
			reg.Base, reg.NumBlocks, reg.Window = uint64(r.u16())<<20, 1+r.intn(16), 0
			switch reg.Kind {
			case topology.KindSlidingWindow:
				reg.Window = 1 + r.intn(64)
				fallthrough
			case topology.KindFullAttention:
				reg.BlockLen = l.AttentionBlockLen()
			case topology.KindMLA:
				reg.BlockLen = int64(l.KernelBlockSize) * int64(1+r.intn(8))
			case topology.KindMamba:
				reg.ConvBytes = reg.ConvBytes[:0]
				for j := r.intn(4); j > 0; j-- {
					reg.ConvBytes = append(reg.ConvBytes, int64(1+r.intn(8)))
				}
				reg.SSMBytes = int64(r.intn(16))
				reg.BlockLen = reg.SSMBytes + int64(r.intn(4))
				for _, c := range reg.ConvBytes {
					reg.BlockLen += c
				}
				reg.BlockLen = max(reg.BlockLen, 1)
			}
		}
		l.Regions = append(l.Regions, reg)
	}
	if tame && r.byte()%2 == 0 {
		// topology.Groups by kind (and window), as an engine registers them, with
		// attention and MLA regions sometimes pooled into one group.
		pool := r.byte()%2 == 0
		at := map[[2]int]int{}
		for i, reg := range l.Regions {
			key := [2]int{int(reg.Kind), reg.Window}
			if pool && reg.Kind != topology.KindMamba {
				key = [2]int{0, 0}
			}
			g, ok := at[key]
			if !ok {
				g = len(l.Groups)
				at[key] = g
				l.Groups = append(l.Groups, topology.Group{Kind: reg.Kind, Window: reg.Window})
			}
			l.Groups[g].Regions = append(l.Groups[g].Regions, i)
		}
		return l
	}
	ng := r.intn(3)
	for g := 0; g < ng; g++ {
		grp := topology.Group{Kind: topology.Kind(r.byte() % 6), Window: r.wild()}
		for j := r.intn(4); j > 0; j-- {
			grp.Regions = append(grp.Regions, r.wild()%5)
		}
		l.Groups = append(l.Groups, grp)
	}
	return l
}

// derivedLayout returns a copy of l with a few fields changed: a peer that
// is often compatible with l, so that topology.NewPlan's planning is reached.
func derivedLayout(r *bytesReader, l *topology.Layout) *topology.Layout {
	d := *l
	d.Regions = append([]topology.Region(nil), l.Regions...)
	d.Groups = append([]topology.Group(nil), l.Groups...)
	d.PPSize, d.PPRank, d.RegionOffset = 1, 0, 0
	if r.byte()%2 == 0 {
		d.TPSize = pick(r, 1, 2, 4, 8)
		d.TPRank = r.intn(d.TPSize)
	}
	if r.byte()%2 == 0 {
		d.KernelBlockSize = pick(r, 1, 2, 4, 8, 16, 32)
		d.LogicalBlockSize = d.KernelBlockSize * pick(r, 1, 2, 4)
	}
	if r.byte()%2 == 0 {
		d.KVLayout = pick(r, topology.LayoutHND, topology.LayoutNHD)
	}
	if r.byte()%2 == 0 {
		d.Packing = pick(r, topology.PackedKV, topology.SplitKV, topology.SeparateKV)
	}
	for i := range d.Regions {
		reg := &d.Regions[i]
		switch {
		case (reg.Kind == topology.KindFullAttention || reg.Kind == topology.KindSlidingWindow) && d.KernelBlockSize > 0 && d.TPSize > 0 && d.TotalKVHeads > 0:
			reg.BlockLen = d.AttentionBlockLen()
		case reg.Kind == topology.KindMLA && l.KernelBlockSize > 0 && d.KernelBlockSize > 0:
			reg.BlockLen = reg.BlockLen / int64(l.KernelBlockSize) * int64(d.KernelBlockSize)
		}
		if r.byte()%4 == 0 {
			reg.NumBlocks = r.wild() % 64
		}
	}
	return &d
}

// checkPlan checks the structure of a plan topology.NewPlan returned: region
// indices in range, unit geometry consistent with the layouts, every
// segment of every unit inside its block on both sides, and no destination
// byte of a unit covered twice.
func checkPlan(t *testing.T, src, dst *topology.Layout, p *topology.Plan) {
	t.Helper()
	if len(p.Groups) != len(src.GroupList()) {
		t.Fatalf("plan has %d groups, src %d", len(p.Groups), len(src.GroupList()))
	}
	for g := range p.Groups {
		gp := &p.Groups[g]
		if gp.Kind != topology.KindMamba {
			if gp.UnitTokens <= 0 || gp.SrcUnits*gp.UnitTokens != src.KernelBlockSize || gp.DstUnits*gp.UnitTokens != dst.KernelBlockSize {
				t.Fatalf("group %d: unit %d tokens, %d·unit src, %d·unit dst, kernels %d and %d", g, gp.UnitTokens, gp.SrcUnits, gp.DstUnits, src.KernelBlockSize, dst.KernelBlockSize)
			}
		}
		if gp.SrcLimit < 0 || gp.DstLimit < 0 {
			t.Fatalf("group %d: limits %d, %d", g, gp.SrcLimit, gp.DstLimit)
		}
		for _, rp := range gp.Regions {
			if rp.Src < 0 || rp.Src >= len(src.Regions) || rp.Dst < 0 || rp.Dst >= len(dst.Regions) {
				t.Fatalf("group %d: region pair %d -> %d out of range (%d, %d regions)", g, rp.Src, rp.Dst, len(src.Regions), len(dst.Regions))
			}
			var sum int64
			for k, sg := range rp.Segs {
				if sg.Len <= 0 || sg.SrcOff < 0 || sg.DstOff < 0 {
					t.Fatalf("group %d region %d: segment %d = %+v", g, rp.Src, k, sg)
				}
				sum += sg.Len
				for u := 0; u < gp.SrcUnits; u++ {
					if e := int64(u)*rp.SrcSlotStride + sg.SrcOff + sg.Len; e > rp.SrcBlockLen {
						t.Fatalf("group %d region %d: segment %+v of src unit %d ends at %d, past the block (%d)", g, rp.Src, sg, u, e, rp.SrcBlockLen)
					}
				}
				for u := 0; u < gp.DstUnits; u++ {
					if e := int64(u)*rp.DstSlotStride + sg.DstOff + sg.Len; e > rp.DstBlockLen {
						t.Fatalf("group %d region %d: segment %+v of dst unit %d ends at %d, past the block (%d)", g, rp.Dst, sg, u, e, rp.DstBlockLen)
					}
				}
				for j := 0; j < k; j++ {
					o := rp.Segs[j]
					if o.DstOff < sg.DstOff+sg.Len && sg.DstOff < o.DstOff+o.Len {
						t.Fatalf("group %d region %d: segments %+v and %+v overlap on dst", g, rp.Dst, o, sg)
					}
				}
			}
			if sum != rp.UnitBytes {
				t.Fatalf("group %d region %d: topology.UnitBytes %d, segments sum to %d", g, rp.Src, rp.UnitBytes, sum)
			}
		}
		checkGroupRepeats(t, g, gp)
	}
}

// checkGroupRepeats checks what topology.NewPlan precomputes for a group: every Repeats
// report holds and is maximal, and MaxDescs equals its region-by-region
// sum.
func checkGroupRepeats(t *testing.T, g int, gp *topology.GroupPlan) {
	t.Helper()
	rs := gp.Regions
	for i := range rs {
		n, ss, ds := rs[i].Repeats()
		if n < 0 || i+n >= len(rs) {
			t.Fatalf("group %d region pair %d: %d repeats, %d pairs follow", g, i, n, len(rs)-1-i)
		}
		for k := 1; k <= n+1 && i+k < len(rs); k++ {
			a, b := rs[i], rs[i+k]
			shifted := b.SrcBase == a.SrcBase+uint64(k)*ss && b.DstBase == a.DstBase+uint64(k)*ds
			same := a.SameShape(&b)
			if k <= n && (!shifted || !same) {
				t.Fatalf("group %d region pair %d: pair %d after it is no copy %d steps of (%#x, %#x) on: %+v, %+v", g, i, i+k, k, ss, ds, rs[i], rs[i+k])
			}
			if k == n+1 && n > 0 && shifted && same {
				t.Fatalf("group %d region pair %d: %d repeats, but pair %d repeats it too", g, i, n, i+k)
			}
		}
		if n == 0 && i+1 < len(rs) && rs[i].SameShape(&rs[i+1]) {
			t.Fatalf("group %d region pair %d: the next pair has its shape, but Repeats reports none", g, i)
		}
	}
	loop := 0 // MaxDescs by its definition, region by region
	for _, r := range rs {
		if r.Whole {
			loop += 3
		} else {
			loop += 7 * len(r.Segs)
		}
	}
	if got := gp.MaxDescs(3, 7); got != loop {
		t.Fatalf("group %d: MaxDescs(3, 7) = %d, region by region %d", g, got, loop)
	}
}

// FuzzValidate: validation and planning never panic on any input,
// topology.CheckCompatible fails whenever either layout is invalid, topology.NewPlan's errors
// wrap a topology sentinel, and any plan it returns is well formed.
func FuzzValidate(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3})
	f.Add([]byte{7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0, 0, 2, 1, 0, 1, 0, 0, 1, 0, 3, 0, 0, 0, 0})
	f.Add([]byte("\x04\x02\x01\x00\x05\x05\x01\x02\x03\x00\x00\x00\x00\x00\x00\x01\x02\x01\x01\x00\x01\x02\x01\x00\x00\x00\x01\x00\x00\x02"))
	// A valid src with one attention region and a derived dst.
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 0, 0, 0, 0, 1, 3})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &bytesReader{data}
		src := wildLayout(r)
		var dst *topology.Layout
		if r.byte()%2 == 0 {
			dst = wildLayout(r)
		} else {
			dst = derivedLayout(r, src)
		}
		se, de := src.Validate(), dst.Validate()
		for _, e := range []error{se, de} {
			if e != nil && !errors.Is(e, topology.ErrInvalidLayout) {
				t.Fatalf("Validate = %v, want an error wrapping topology.ErrInvalidLayout", e)
			}
		}
		_ = topology.CheckSameEngine(src, dst)
		err := topology.CheckCompatible(src, dst)
		if (se != nil || de != nil) && err == nil {
			t.Fatalf("topology.CheckCompatible = nil with invalid layouts (src %v, dst %v)", se, de)
		}
		maxSeg := pick(r, 0, 1, 4, 128, 1<<12, -1)
		p, perr := topology.NewPlan(src, dst, topology.PlanOptions{MaxSegments: maxSeg})
		if err != nil && perr == nil {
			t.Fatalf("topology.NewPlan succeeded where topology.CheckCompatible failed: %v", err)
		}
		if perr != nil {
			if !errors.Is(perr, topology.ErrInvalidLayout) && !errors.Is(perr, topology.ErrIncompatible) && !errors.Is(perr, topology.ErrUnsupported) {
				t.Fatalf("topology.NewPlan error %v wraps no topology sentinel", perr)
			}
			if p != nil {
				t.Fatalf("topology.NewPlan returned a plan with error %v", perr)
			}
			return
		}
		checkPlan(t, src, dst, p)
		for g := range p.Groups {
			ss := topology.Span{Start: r.wild(), IDs: make([]topology.BlockID, r.intn(5))}
			ds := topology.Span{Start: r.wild(), IDs: make([]topology.BlockID, r.intn(5))}
			s0, d0, n, err := p.Groups[g].Align(ss, ds, r.wild())
			if err != nil {
				if !errors.Is(err, topology.ErrInvalidBlocks) {
					t.Fatalf("Align error %v does not wrap topology.ErrInvalidBlocks", err)
				}
				continue
			}
			gp := &p.Groups[g]
			sPer, dPer := gp.SrcPPL*gp.SrcUnits, gp.DstPPL*gp.DstUnits
			if n < 0 || s0 < 0 || d0 < 0 || n > 0 && (s0+n > len(ss.IDs)*sPer || d0+n > len(ds.IDs)*dPer) {
				t.Fatalf("Align = %d, %d, %d for lists of %d and %d ids (%d and %d units each)", s0, d0, n, len(ss.IDs), len(ds.IDs), sPer, dPer)
			}
		}
	})
}

// tinyLayout is a rank of one full-attention region of 64 blocks.
func tinyLayout(tp, rank, logical, kernel, heads int, kv topology.KVLayout, packing topology.KVPacking) *topology.Layout {
	l := &topology.Layout{TPRank: rank, TPSize: tp, PPSize: 1, TotalKVHeads: heads, HeadSize: 2, ElemBytes: 2,
		KVLayout: kv, Packing: packing, LogicalBlockSize: logical, KernelBlockSize: kernel}
	l.Regions = []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: l.AttentionBlockLen(), NumBlocks: 64}}
	return l
}
