package topology

import (
	"errors"
	"testing"
)

// bytesReader decodes fuzz input into bounded values; it yields zeros once
// the input is exhausted.
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

// intn returns a value in [0, n).
func (r *bytesReader) intn(n int) int { return int(r.byte()) % n }

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
	default:
		return int(r.byte()) + int(r.byte())<<8
	}
}

// FuzzBlockMapping checks Align against a naive token-level model: the unit
// pairs cover exactly the tokens both lists hold (below the token bound
// rounded up to a unit), each once, and each pair's two positions hold the
// same token.
func FuzzBlockMapping(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 3, 3, 0, 0, 40})
	f.Add([]byte{0, 1, 1, 0, 5, 2, 0, 2, 70})
	f.Add([]byte{2, 0, 0, 3, 4, 6, 1, 0, 0})
	f.Add([]byte{1, 2, 3, 1, 7, 1, 3, 1, 200})
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &bytesReader{data}
		sk := pick(r, 4, 8, 16)
		sppl := pick(r, 1, 2, 4)
		dk := pick(r, 4, 8, 16)
		dppl := pick(r, 1, 2, 4)
		src := tinyLayout(1, 0, sk*sppl, sk, 2, LayoutHND, PackedKV)
		dst := tinyLayout(1, 0, dk*dppl, dk, 2, LayoutHND, PackedKV)
		p, err := NewPlan(src, dst, PlanOptions{})
		if err != nil {
			t.Fatal(err)
		}
		g := &p.Groups[0]
		ns, nd := r.intn(8), r.intn(8)
		ss := Span{Start: r.intn(6) * src.LogicalBlockSize}
		ds := Span{Start: r.intn(6) * dst.LogicalBlockSize}
		for i := 0; i < ns; i++ {
			ss.IDs = append(ss.IDs, BlockID(r.intn(int(g.SrcLimit))))
		}
		for i := 0; i < nd; i++ {
			ds.IDs = append(ds.IDs, BlockID(r.intn(int(g.DstLimit))))
		}
		tokens := int(r.byte())
		s0, d0, n, err := g.Align(ss, ds, tokens)
		if err != nil {
			t.Fatal(err)
		}
		m := g.UnitTokens
		// Naive: where does each side hold token T?
		where := func(sp Span, l *Layout, tok int) (kernel BlockID, in int, ok bool) {
			if tok < sp.Start || tok >= sp.Start+len(sp.IDs)*l.LogicalBlockSize {
				return 0, 0, false
			}
			idx, off := (tok-sp.Start)/l.LogicalBlockSize, (tok-sp.Start)%l.LogicalBlockSize
			ppl := l.PagesPerBlock()
			return sp.IDs[idx]*BlockID(ppl) + BlockID(off/l.KernelBlockSize), off % l.KernelBlockSize, true
		}
		covered := map[int]bool{}
		for k := 0; k < n; k++ {
			skb, su := UnitBlock(ss.IDs, s0+k, g.SrcPPL, g.SrcUnits)
			dkb, du := UnitBlock(ds.IDs, d0+k, g.DstPPL, g.DstUnits)
			t0 := ss.Start + (s0+k)*m
			if t1 := ds.Start + (d0+k)*m; t1 != t0 {
				t.Fatalf("pair %d: src unit starts at token %d, dst unit at %d", k, t0, t1)
			}
			for tok := t0; tok < t0+m; tok++ {
				if covered[tok] {
					t.Fatalf("token %d paired twice", tok)
				}
				covered[tok] = true
				wk, win, ok := where(ss, src, tok)
				if !ok || wk != skb || win != su*m+(tok-t0) {
					t.Fatalf("token %d: pair %d puts it at src kernel %d+%d, naive %d+%d (held %v)", tok, k, skb, su*m+(tok-t0), wk, win, ok)
				}
				wk, win, ok = where(ds, dst, tok)
				if !ok || wk != dkb || win != du*m+(tok-t0) {
					t.Fatalf("token %d: pair %d puts it at dst kernel %d+%d, naive %d+%d (held %v)", tok, k, dkb, du*m+(tok-t0), wk, win, ok)
				}
			}
		}
		bound := 1 << 30
		if tokens > 0 {
			bound = (tokens + m - 1) / m * m
		}
		for tok := 0; tok < 6*64+8*64; tok++ {
			_, _, a := where(ss, src, tok)
			_, _, b := where(ds, dst, tok)
			if want := a && b && tok < bound; want != covered[tok] {
				t.Fatalf("token %d: covered %v, want %v (src holds %v, dst holds %v, bound %d)", tok, covered[tok], want, a, b, bound)
			}
		}
	})
}

// wildLayout decodes an arbitrary layout: any field may be negative, zero
// or huge; region and group counts stay small.
func wildLayout(r *bytesReader) *Layout {
	l := &Layout{
		TPRank: r.wild(), TPSize: r.wild(), PPRank: r.wild() % 4, PPSize: r.wild() % 4,
		TotalKVHeads: r.wild(), HeadSize: r.wild(), ElemBytes: r.wild() % 17,
		KVLayout: KVLayout(r.byte() % 4), Packing: KVPacking(r.byte() % 5),
		LogicalBlockSize: r.wild(), KernelBlockSize: r.wild(), RegionOffset: r.wild() % 8,
	}
	// Often make the core shape valid so later checks are reached.
	if r.byte()%2 == 0 {
		l.TPSize = pick(r, 1, 2, 4, 8)
		l.TPRank = r.intn(l.TPSize)
		l.PPSize, l.PPRank = 1, 0
		l.TotalKVHeads = pick(r, 1, 2, 4, 8)
		l.HeadSize, l.ElemBytes = pick(r, 1, 2, 4), pick(r, 1, 2)
		l.KVLayout, l.Packing = pick(r, LayoutHND, LayoutNHD), pick(r, PackedKV, SplitKV, SeparateKV)
		l.KernelBlockSize = pick(r, 1, 2, 4, 16)
		l.LogicalBlockSize = l.KernelBlockSize * pick(r, 1, 2)
		l.RegionOffset = 0
	}
	nr := r.intn(4)
	for i := 0; i < nr; i++ {
		reg := Region{Kind: Kind(r.byte() % 6), Window: r.wild(), Base: uint64(r.wild()), NumBlocks: r.wild() % 64,
			BlockLen: int64(r.wild()), DeviceID: int32(r.byte())}
		if r.byte()%2 == 0 && l.KernelBlockSize > 0 && l.TPSize > 0 && l.TotalKVHeads > 0 {
			reg.BlockLen = l.attentionBlockLen()
			reg.NumBlocks = 1 + r.intn(16)
		}
		for j := r.intn(4); j > 0; j-- {
			reg.ConvBytes = append(reg.ConvBytes, int64(r.wild()))
		}
		reg.SSMBytes = int64(r.wild())
		l.Regions = append(l.Regions, reg)
	}
	ng := r.intn(3)
	for g := 0; g < ng; g++ {
		grp := Group{Kind: Kind(r.byte() % 6), Window: r.wild()}
		for j := r.intn(4); j > 0; j-- {
			grp.Regions = append(grp.Regions, r.wild()%5)
		}
		l.Groups = append(l.Groups, grp)
	}
	return l
}

// FuzzValidate: validation and planning never panic on any input, and
// CheckCompatible fails whenever either layout is invalid.
func FuzzValidate(f *testing.F) {
	f.Add([]byte{})
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 2, 3})
	f.Add([]byte{7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 0, 0, 2, 1, 0, 1, 0, 0, 1, 0, 3, 0, 0, 0, 0})
	f.Add([]byte("\x04\x02\x01\x00\x05\x05\x01\x02\x03\x00\x00\x00\x00\x00\x00\x01\x02\x01\x01\x00\x01\x02\x01\x00\x00\x00\x01\x00\x00\x02"))
	f.Fuzz(func(t *testing.T, data []byte) {
		r := &bytesReader{data}
		src, dst := wildLayout(r), wildLayout(r)
		se, de := src.Validate(), dst.Validate()
		err := CheckCompatible(src, dst)
		if (se != nil || de != nil) && err == nil {
			t.Fatalf("CheckCompatible = nil with invalid layouts (src %v, dst %v)", se, de)
		}
		p, perr := NewPlan(src, dst, PlanOptions{MaxSegments: r.intn(300)})
		if err != nil && perr == nil {
			t.Fatalf("NewPlan succeeded where CheckCompatible failed: %v", err)
		}
		if perr != nil {
			if !errors.Is(perr, ErrInvalidLayout) && !errors.Is(perr, ErrIncompatible) && !errors.Is(perr, ErrUnsupported) {
				t.Fatalf("NewPlan error %v wraps no topology sentinel", perr)
			}
			return
		}
		for g := range p.Groups {
			ss := Span{Start: r.wild(), IDs: make([]BlockID, r.intn(5))}
			ds := Span{Start: r.wild(), IDs: make([]BlockID, r.intn(5))}
			_, _, n, err := p.Groups[g].Align(ss, ds, r.wild())
			if err == nil && n < 0 {
				t.Fatalf("Align returned n = %d", n)
			}
		}
	})
}
