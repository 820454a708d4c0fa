package hotpath_test

import (
	"errors"
	"math/rand/v2"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/topology"
)

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

func fpick[T any](r *fuzzReader, vs ...T) T { return vs[int(r.byte())%len(vs)] }

// fuzzCase decodes a mostly valid semantic scenario.
func fuzzCase(r *fuzzReader) *semCase {
	hnd, nhd := topology.LayoutHND, topology.LayoutNHD
	heads := fpick(r, 1, 2, 4, 8, 16)
	layers := fpick(r, kinds(fa), kinds(fa, fa), kinds(fa, swa), kinds(mla, mla), kinds(fa, mla), kinds(fa, mmb), kinds(swa, fa, mmb))
	pk := fpick(r, 4, 8, 16, 32)
	dk := fpick(r, 4, 8, 16, 32)
	ppl, dppl := fpick(r, 1, 2), fpick(r, 1, 2)
	lp, ld := fpick(r, hnd, nhd), fpick(r, hnd, nhd)
	packing := fpick(r, topology.PackedKV, topology.SplitKV, topology.SeparateKV)
	c := &semCase{
		model: attnModel(fa, heads, layers...),
		p:     eng(1, fpick(r, 1, 2, 4, 8), pk*ppl, pk, lp, packing),
		d:     eng(2, fpick(r, 1, 2, 4, 8), dk*dppl, dk, ld, packing),
		op:    fpick(r, hotpath.OpWrite, hotpath.OpRead), fragment: r.byte()%2 == 0,
		maxRun: int64(fpick(r, 0, 0, 64, 1000)), maxSegs: 1 << 12,
	}
	maxTok := min(24*c.p.LogicalBlock, 24*c.d.LogicalBlock)
	c.tokens = 1 + (int(r.byte())|int(r.byte())<<8)%maxTok
	c.hit = r.intn(4) * c.d.LogicalBlock
	if c.hit > c.tokens {
		c.hit = (c.tokens / c.d.LogicalBlock) * c.d.LogicalBlock
	}
	c.name = "fuzz"
	c.seed = uint64(r.byte())
	return c
}

// newRNG seeds a generator from fuzz input.
func newRNG(in []byte) *rand.Rand {
	h := uint64(14695981039346656037)
	for _, b := range in {
		h = (h ^ uint64(b)) * 1099511628211
	}
	return rand.New(rand.NewPCG(h, 9))
}

// FuzzTPMapping: across all ranks, every D head byte of the request is
// written exactly once with the right value, nothing else is touched, and
// every rank receives the notification count topology promises, for
// random TP pairs (GQA included), block sizes, layouts, packings, model
// kinds, prefix hits, push and pull.
func FuzzTPMapping(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 40, 0, 0})
	f.Add([]byte{1, 5, 2, 3, 0, 1, 1, 0, 1, 2, 1, 1, 3, 2, 150, 0, 1})
	f.Add([]byte{3, 3, 1, 2, 1, 0, 0, 1, 0, 3, 0, 0, 2, 0, 77, 1, 2})
	f.Add([]byte{4, 6, 3, 0, 0, 1, 0, 0, 2, 1, 0, 0, 1, 1, 90, 0, 3})
	f.Add([]byte{2, 4, 0, 1, 1, 1, 1, 1, 3, 0, 1, 1, 0, 3, 255, 1, 1})
	f.Fuzz(func(t *testing.T, in []byte) {
		c := fuzzCase(&fuzzReader{in})
		runSemantic(t, c)
	})
}

// FuzzCoalesce is the differential test of the optimised builder against
// the reference: the same bytes paired the same way (each optimised
// descriptor a concatenation of consecutive reference descriptors), every
// descriptor inside one region on each side, the run cap respected, and
// prepared-list indices resolving to the reference's descriptors.
func FuzzCoalesce(f *testing.F) {
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 40, 0, 0, 1, 2, 3})
	f.Add([]byte{1, 5, 2, 3, 0, 1, 1, 0, 1, 2, 1, 1, 3, 2, 150, 0, 1, 9, 9})
	f.Add([]byte{2, 4, 0, 1, 1, 1, 1, 1, 3, 0, 1, 1, 0, 3, 255, 1, 1, 0})
	f.Fuzz(func(t *testing.T, in []byte) {
		r := &fuzzReader{in}
		c := fuzzCase(r)
		pr, dr := buildEngines(t, c)
		src := &pr[0][r.intn(c.p.TP)].Layout
		peers, _ := topology.TargetRanks(nil, c.p.TP, c.d.TP, src.TPRank)
		dst := &dr[0][peers[r.intn(len(peers))]].Layout
		if r.byte()%2 == 0 {
			// One group over every non-Mamba region (mixed attention and
			// MLA regions in a group, as HMA pooling makes them).
			src, dst = mergeGroups(src), mergeGroups(dst)
		}
		plan, err := topology.NewPlan(src, dst, topology.PlanOptions{MaxSegments: c.maxSegs})
		if err != nil {
			t.Fatal(err)
		}
		kreq := buildRequest(newRNG(in), c, dst.GroupList())
		req := &hotpath.Request{Tokens: c.tokens, Src: kreq.P, Dst: kreq.D}
		b := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: c.maxRun})
		got, err := b.AppendDescs(nil, plan, req)
		if err != nil {
			t.Fatal(err)
		}
		hotpath.CheckAgainstReference(got, plan, req, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: c.maxRun})
		for _, d := range got {
			if !inside(src, d.Local, d.Len) || !inside(dst, d.Remote, d.Len) {
				t.Fatalf("descriptor %+v leaves a region", d)
			}
		}
		ref, err := hotpath.AppendReference(nil, plan, req, hotpath.OpWrite)
		if err != nil {
			t.Fatal(err)
		}
		idx, err := b.AppendIndices(nil, plan, req)
		if err != nil {
			t.Fatal(err)
		}
		sl, err := hotpath.AppendPrepared(nil, plan, hotpath.SrcSide)
		if err != nil {
			t.Fatal(err)
		}
		dl, err := hotpath.AppendPrepared(nil, plan, hotpath.DstSide)
		if err != nil {
			t.Fatal(err)
		}
		if len(idx) != len(ref) {
			t.Fatalf("AppendIndices = %d pairs, reference %d", len(idx), len(ref))
		}
		for i, p := range idx {
			l, rm := sl[p.Local], dl[p.Remote]
			if l.Addr != ref[i].Local || rm.Addr != ref[i].Remote || l.Len != ref[i].Len || rm.Len != ref[i].Len {
				t.Fatalf("index pair %d resolves to %+v/%+v, reference %+v", i, l, rm, ref[i])
			}
		}
	})
}

// FuzzBuilderInput: arbitrary block ids, starts, token counts and group
// counts never panic; invalid ones return ErrInvalidRequest and leave dst
// at its original length.
func FuzzBuilderInput(f *testing.F) {
	f.Add([]byte{1, 0, 0, 3, 1, 2, 3, 2, 5, 6}, int64(0), int64(0), int64(40))
	f.Add([]byte{1, 255, 255, 255, 255}, int64(-16), int64(7), int64(-1))
	f.Add([]byte{2, 0, 1, 2}, int64(1<<40), int64(16), int64(1<<50))
	src, dst := layoutsForFuzz(f)
	plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if err != nil {
		f.Fatal(err)
	}
	f.Fuzz(func(t *testing.T, in []byte, sStart, dStart, tokens int64) {
		r := &fuzzReader{in}
		groups := r.intn(3)
		req := &hotpath.Request{Tokens: int(tokens)}
		valid := groups == 1
		for g := 0; g < groups; g++ {
			var s, d topology.Span
			s.Start, d.Start = int(sStart), int(dStart)
			for i := r.intn(6); i > 0; i-- {
				id := topology.BlockID(int32(uint32(r.byte()) | uint32(r.byte())<<8 | uint32(r.byte())<<16 | uint32(r.byte())<<24))
				s.IDs = append(s.IDs, id)
				if id < 0 || id >= plan.Groups[0].SrcLimit {
					valid = false
				}
			}
			for i := r.intn(6); i > 0; i-- {
				id := topology.BlockID(int8(r.byte()))
				d.IDs = append(d.IDs, id)
				if id < 0 || id >= plan.Groups[0].DstLimit {
					valid = false
				}
			}
			req.Src, req.Dst = append(req.Src, s), append(req.Dst, d)
		}
		if sStart < 0 || dStart < 0 || sStart%16 != 0 || dStart%32 != 0 || sStart > 1<<40 || dStart > 1<<40 || tokens < 0 || tokens > 1<<40 {
			valid = false
		}
		prefix := make([]hotpath.Desc, 2)
		for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
			b := mustBuilder(t, hotpath.Options{Op: op, MaxRunBytes: 4096})
			out, err := b.AppendDescs(prefix, plan, req)
			if err != nil {
				if !errors.Is(err, hotpath.ErrInvalidRequest) {
					t.Fatalf("AppendDescs error %v is not ErrInvalidRequest", err)
				}
				if len(out) != 2 {
					t.Fatalf("AppendDescs failed but returned %d descriptors, want the original 2", len(out))
				}
				if valid {
					t.Fatalf("AppendDescs rejected a valid request: %v", err)
				}
				continue
			}
			if !valid {
				t.Fatalf("AppendDescs accepted an invalid request %+v", req)
			}
			if _, err := b.AppendIndices(nil, plan, req); err != nil {
				t.Fatalf("AppendIndices = %v after AppendDescs accepted the request", err)
			}
		}
	})
}

func layoutsForFuzz(f *testing.F) (*topology.Layout, *topology.Layout) {
	m := attnModel(fa, 4, fa, fa)
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
