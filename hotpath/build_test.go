package hotpath_test

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/topology"
)

// pairOf builds a P rank and a D rank layout for a small attention model.
func kinds(k ...topology.Kind) []topology.Kind { return k }

const (
	fa  = topology.KindFullAttention
	swa = topology.KindSlidingWindow
	mla = topology.KindMLA
	mmb = topology.KindMamba
)

var eng = kvsim.SmallEngine

func pairOf(t *testing.T, p, d kvsim.Engine, heads int, layers ...topology.Kind) (*topology.Layout, *topology.Layout) {
	t.Helper()
	m := kvsim.SmallModel(heads, layers...)
	pr, err := kvsim.Build(&m, &p)
	if err != nil {
		t.Fatal(err)
	}
	dr, err := kvsim.Build(&m, &d)
	if err != nil {
		t.Fatal(err)
	}
	return &pr[0][0].Layout, &dr[0][0].Layout
}

func ids(v ...int) []topology.BlockID {
	out := make([]topology.BlockID, len(v))
	for i, x := range v {
		out[i] = topology.BlockID(x)
	}
	return out
}

func mustBuilder(t *testing.T, o hotpath.Options) *hotpath.Builder {
	t.Helper()
	b, err := hotpath.NewBuilder(o)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestNewBuilderRejectsBadOptions(t *testing.T) {
	for _, tc := range []struct {
		name string
		opts hotpath.Options
		want string
	}{
		{"missing op", hotpath.Options{}, "Options.Op"},
		{"unknown op", hotpath.Options{Op: 9}, "Op(9)"},
		{"negative cap", hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: -1}, "MaxRunBytes = -1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := hotpath.NewBuilder(tc.opts)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewBuilder(%+v) = %v, want error containing %q", tc.opts, err, tc.want)
			}
		})
	}
}

// TestCoalesceFreshRuns checks the descriptor counts of coalescing rules:
// one descriptor per run per region when both sides are contiguous, a
// split where either side breaks, never across regions, and the cap.
func TestCoalesceFreshRuns(t *testing.T) {
	hnd := topology.LayoutHND
	src, dst := pairOf(t, eng(1, 1, 16, 16, hnd, topology.PackedKV), eng(2, 1, 16, 16, hnd, topology.PackedKV), 4, fa, fa, fa)
	plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if err != nil {
		t.Fatal(err)
	}
	blockLen := uint64(src.Regions[0].BlockLen)
	for _, tc := range []struct {
		name     string
		src, dst []topology.BlockID
		cap      int64
		want     int // descriptors over 3 regions
		wantLen0 uint64
	}{
		{"one run both sides", ids(3, 4, 5, 6), ids(10, 11, 12, 13), 0, 3, 4 * blockLen},
		{"src break splits", ids(3, 4, 8, 9), ids(10, 11, 12, 13), 0, 6, 2 * blockLen},
		{"dst break splits", ids(3, 4, 5, 6), ids(10, 11, 13, 14), 0, 6, 2 * blockLen},
		{"reversed order never merges", ids(6, 5, 4), ids(13, 12, 11), 0, 9, blockLen},
		{"cap splits runs", ids(3, 4, 5, 6), ids(10, 11, 12, 13), int64(2 * blockLen), 6, 2 * blockLen},
		{"cap below a unit keeps units whole", ids(3, 4), ids(10, 11), 1, 6, blockLen},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: tc.cap})
			req := &hotpath.Request{Src: []topology.Span{{IDs: tc.src}}, Dst: []topology.Span{{IDs: tc.dst}}}
			got, err := b.AppendDescs(nil, plan, req)
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != tc.want || got[0].Len != tc.wantLen0 {
				t.Fatalf("AppendDescs = %d descs (first len %d), want %d (first len %d)", len(got), got[0].Len, tc.want, tc.wantLen0)
			}
			// Never across a region: every descriptor stays inside one.
			for _, d := range got {
				if !inside(src, d.Local, d.Len) || !inside(dst, d.Remote, d.Len) {
					t.Fatalf("descriptor %+v crosses a region boundary", d)
				}
			}
		})
	}
}

func inside(l *topology.Layout, addr, n uint64) bool {
	for _, r := range l.Regions {
		end := r.Base + uint64(r.BlockLen)*uint64(r.NumBlocks)
		if addr >= r.Base && addr+n <= end {
			return true
		}
	}
	return false
}

func TestOpReadSwapsSides(t *testing.T) {
	hnd := topology.LayoutHND
	src, dst := pairOf(t, eng(1, 2, 16, 16, hnd, topology.PackedKV), eng(2, 1, 16, 16, hnd, topology.PackedKV), 4, fa)
	plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if err != nil {
		t.Fatal(err)
	}
	req := &hotpath.Request{Src: []topology.Span{{IDs: ids(1, 2)}}, Dst: []topology.Span{{IDs: ids(7, 8)}}}
	w, err := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite}).AppendDescs(nil, plan, req)
	if err != nil {
		t.Fatal(err)
	}
	r, err := mustBuilder(t, hotpath.Options{Op: hotpath.OpRead}).AppendDescs(nil, plan, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(w) != len(r) || len(w) == 0 {
		t.Fatalf("write %d descs, read %d", len(w), len(r))
	}
	for i := range w {
		want := hotpath.Desc{Local: w[i].Remote, Remote: w[i].Local, Len: w[i].Len, LocalDev: w[i].RemoteDev, RemoteDev: w[i].LocalDev}
		if r[i] != want {
			t.Fatalf("read desc %d = %+v, want %+v", i, r[i], want)
		}
	}
	// Source rank 0 of TP 2 holds heads 0-1 of 4: it lands in the first
	// half of D's block (HND packed), read from the whole of its own block.
	if w[0].Remote != dst.Regions[0].Base+7*uint64(dst.Regions[0].BlockLen) || w[0].Len != uint64(src.Regions[0].BlockLen) {
		t.Fatalf("first desc = %+v, want dst block 7 start, len %d", w[0], src.Regions[0].BlockLen)
	}
}

func TestAppendDescsRejectsBadRequests(t *testing.T) {
	hnd := topology.LayoutHND
	src, dst := pairOf(t, eng(1, 1, 16, 16, hnd, topology.PackedKV), eng(2, 1, 16, 16, hnd, topology.PackedKV), 4, fa)
	plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if err != nil {
		t.Fatal(err)
	}
	span := func(start int, v ...int) []topology.Span { return []topology.Span{{Start: start, IDs: ids(v...)}} }
	for _, tc := range []struct {
		name     string
		req      hotpath.Request
		contains string
	}{
		{"group count mismatch", hotpath.Request{Src: span(0, 1), Dst: nil}, "groups: src 1, dst 0, plan 1"},
		{"src id beyond region", hotpath.Request{Src: span(0, 1, 24), Dst: span(0, 1, 2)}, "src group 0 block 1: id 24, want 0..23"},
		{"negative dst id", hotpath.Request{Src: span(0, 1), Dst: span(0, -3)}, "dst group 0 block 0: id -3"},
		{"start not block aligned", hotpath.Request{Src: span(0, 1), Dst: span(5, 2)}, "dst start = 5"},
		{"negative tokens", hotpath.Request{Tokens: -1, Src: span(0, 1), Dst: span(0, 2)}, "tokens = -1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite})
			prefix := []hotpath.Desc{{Len: 1}}
			got, err := b.AppendDescs(prefix, plan, &tc.req)
			if !errors.Is(err, hotpath.ErrInvalidRequest) || !strings.Contains(err.Error(), tc.contains) {
				t.Fatalf("AppendDescs = %v, want ErrInvalidRequest containing %q", err, tc.contains)
			}
			if len(got) != 1 {
				t.Fatalf("AppendDescs left %d descs, want the original 1", len(got))
			}
			if _, err := hotpath.AppendReference(nil, plan, &tc.req, hotpath.OpWrite); !errors.Is(err, hotpath.ErrInvalidRequest) {
				t.Fatalf("AppendReference = %v, want ErrInvalidRequest", err)
			}
		})
	}
}

// TestPreparedIndicesMatchReference checks that resolving AppendIndices
// through both sides' prepared lists gives exactly the reference's
// descriptors, in order, across hetero TP, block sizes, NHD, Mamba and MLA.
func TestPreparedIndicesMatchReference(t *testing.T) {
	hnd, nhd := topology.LayoutHND, topology.LayoutNHD
	for _, tc := range []struct {
		name   string
		p, d   kvsim.Engine
		heads  int
		layers []topology.Kind
		op     hotpath.Op
	}{
		{"equal", eng(1, 1, 16, 16, hnd, topology.PackedKV), eng(2, 1, 16, 16, hnd, topology.PackedKV), 4, kinds(fa, fa), hotpath.OpWrite},
		{"tp2to1_bs16to32", eng(1, 2, 16, 16, hnd, topology.PackedKV), eng(2, 1, 32, 32, hnd, topology.PackedKV), 4, kinds(fa, fa), hotpath.OpRead},
		{"tp1to2_nhd_bs32to16", eng(1, 1, 32, 32, nhd, topology.SplitKV), eng(2, 2, 16, 16, nhd, topology.SplitKV), 4, kinds(fa), hotpath.OpWrite},
		{"mamba_mla", eng(1, 2, 16, 16, hnd, topology.PackedKV), eng(2, 1, 16, 16, hnd, topology.PackedKV), 4, kinds(fa, mmb, mla), hotpath.OpWrite},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, dst := pairOf(t, tc.p, tc.d, tc.heads, tc.layers...)
			plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
			if err != nil {
				t.Fatal(err)
			}
			req := &hotpath.Request{Tokens: 70}
			for _, g := range plan.Groups {
				s := topology.Span{IDs: ids(5, 6, 2, 9, 10)}
				d := topology.Span{IDs: ids(1, 2, 3, 11, 4)}
				if g.Kind == mmb {
					s, d = topology.Span{IDs: ids(4)}, topology.Span{IDs: ids(7)}
				}
				req.Src, req.Dst = append(req.Src, s), append(req.Dst, d)
			}
			ref, err := hotpath.AppendReference(nil, plan, req, tc.op)
			if err != nil {
				t.Fatal(err)
			}
			b := mustBuilder(t, hotpath.Options{Op: tc.op})
			idx, err := b.AppendIndices(nil, plan, req)
			if err != nil {
				t.Fatal(err)
			}
			srcList, err := hotpath.AppendPrepared(nil, plan, hotpath.SrcSide)
			if err != nil {
				t.Fatal(err)
			}
			dstList, err := hotpath.AppendPrepared(nil, plan, hotpath.DstSide)
			if err != nil {
				t.Fatal(err)
			}
			if int64(len(srcList)) != hotpath.PreparedLen(plan, hotpath.SrcSide) || int64(len(dstList)) != hotpath.PreparedLen(plan, hotpath.DstSide) {
				t.Fatalf("prepared lists %d/%d entries, PreparedLen says %d/%d", len(srcList), len(dstList),
					hotpath.PreparedLen(plan, hotpath.SrcSide), hotpath.PreparedLen(plan, hotpath.DstSide))
			}
			local, remote := srcList, dstList
			if tc.op == hotpath.OpRead {
				local, remote = dstList, srcList
			}
			if len(idx) != len(ref) {
				t.Fatalf("AppendIndices = %d pairs, reference %d descs", len(idx), len(ref))
			}
			for i, p := range idx {
				l, r := local[p.Local], remote[p.Remote]
				got := hotpath.Desc{Local: l.Addr, Remote: r.Addr, Len: l.Len, LocalDev: l.Dev, RemoteDev: r.Dev}
				if l.Len != r.Len || got != ref[i] {
					t.Fatalf("pair %d %+v resolves to %+v (remote len %d), want %+v", i, p, got, r.Len, ref[i])
				}
			}
		})
	}
}

// TestTooManySegmentsRefused: HND on one side and NHD on the other with
// many heads scatters every cell; the default bound refuses it with an
// error naming both layouts.
func TestTooManySegmentsRefused(t *testing.T) {
	// 8 heads · 32 tokens = 256 cells (K and V of a cell stay adjacent).
	src, dst := pairOf(t, eng(1, 1, 32, 32, topology.LayoutHND, topology.PackedKV), eng(2, 1, 32, 32, topology.LayoutNHD, topology.PackedKV), 8, fa)
	_, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if !errors.Is(err, topology.ErrUnsupported) || !strings.Contains(err.Error(), "HND/packed TP 1 block 32 -> dst NHD/packed TP 1 block 32") {
		t.Fatalf("NewPlan(HND -> NHD, 8 heads) = %v, want ErrUnsupported naming both layouts", err)
	}
	if _, err := topology.NewPlan(src, dst, topology.PlanOptions{MaxSegments: 32 * 8}); err != nil {
		t.Fatalf("NewPlan with MaxSegments 256 = %v, want success", err)
	}
}

func ExampleAppendReference() {
	m := kvsim.SmallModel(2, fa)
	pe, de := eng(1, 1, 16, 16, topology.LayoutHND, topology.PackedKV), eng(2, 1, 16, 16, topology.LayoutHND, topology.PackedKV)
	pr, _ := kvsim.Build(&m, &pe)
	dr, _ := kvsim.Build(&m, &de)
	plan, _ := topology.NewPlan(&pr[0][0].Layout, &dr[0][0].Layout, topology.PlanOptions{})
	req := &hotpath.Request{Src: []topology.Span{{IDs: ids(0, 1)}}, Dst: []topology.Span{{IDs: ids(4, 5)}}}
	ref, _ := hotpath.AppendReference(nil, plan, req, hotpath.OpWrite)
	b, _ := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
	opt, _ := b.AppendDescs(nil, plan, req)
	fmt.Println("reference:", len(ref), "descriptors; optimised:", len(opt), "of", opt[0].Len, "bytes")
	// Output: reference: 2 descriptors; optimised: 1 of 1024 bytes
}

// TestCapInMixedGroup: in one group holding an attention region (split by
// the cap) and an MLA region (not split), the capped region's extra
// descriptors must not eat the room planned for the next region.
func TestCapInMixedGroup(t *testing.T) {
	hnd := topology.LayoutHND
	src, dst := pairOf(t, eng(1, 1, 16, 16, hnd, topology.PackedKV), eng(2, 1, 16, 16, hnd, topology.PackedKV), 4, fa, mla)
	for _, l := range []*topology.Layout{src, dst} {
		l.Groups = []topology.Group{{Kind: fa, Regions: []int{0, 1}}}
	}
	plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if err != nil {
		t.Fatal(err)
	}
	attn, latent := uint64(src.Regions[0].BlockLen), uint64(src.Regions[1].BlockLen)
	capBytes := int64(attn + attn/2) // splits the attention run per block, not the MLA run
	req := &hotpath.Request{Src: []topology.Span{{IDs: ids(2, 3, 4, 5)}}, Dst: []topology.Span{{IDs: ids(8, 9, 10, 11)}}}
	b := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: capBytes})
	got, err := b.AppendDescs(nil, plan, req)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 5 || got[4].Len != 4*latent {
		t.Fatalf("AppendDescs = %d descs (last %+v), want 4 capped attention descs and 1 MLA desc of %d bytes", len(got), got[len(got)-1], 4*latent)
	}
	if err := hotpath.VerifyAgainstReference(got, plan, req, hotpath.Options{Op: hotpath.OpWrite, MaxRunBytes: capBytes}); err != nil {
		t.Fatal(err)
	}
}

// TestNotifyOnlyRankStillRejectsBadInput: a source rank that moves nothing
// (a GQA duplicate) refuses the same bad request the writing rank refuses.
func TestNotifyOnlyRankStillRejectsBadInput(t *testing.T) {
	m := kvsim.SmallModel(2, fa)
	pe, de := eng(1, 4, 16, 16, topology.LayoutHND, topology.PackedKV), eng(2, 1, 16, 16, topology.LayoutHND, topology.PackedKV)
	pr, err := kvsim.Build(&m, &pe)
	if err != nil {
		t.Fatal(err)
	}
	dr, err := kvsim.Build(&m, &de)
	if err != nil {
		t.Fatal(err)
	}
	plan, err := topology.NewPlan(&pr[0][1].Layout, &dr[0][0].Layout, topology.PlanOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if !plan.NotifyOnly {
		t.Fatal("P rank 1 of TP 4 with 2 heads should be notify-only")
	}
	req := &hotpath.Request{Src: []topology.Span{{IDs: ids(-5)}}, Dst: []topology.Span{{Start: 7, IDs: ids(1)}}}
	b := mustBuilder(t, hotpath.Options{Op: hotpath.OpWrite})
	if _, err := b.AppendDescs(nil, plan, req); !errors.Is(err, hotpath.ErrInvalidRequest) {
		t.Errorf("AppendDescs = %v, want ErrInvalidRequest", err)
	}
	if _, err := b.AppendIndices(nil, plan, req); !errors.Is(err, hotpath.ErrInvalidRequest) {
		t.Errorf("AppendIndices = %v, want ErrInvalidRequest", err)
	}
	if _, err := hotpath.AppendReference(nil, plan, req, hotpath.OpWrite); !errors.Is(err, hotpath.ErrInvalidRequest) {
		t.Errorf("AppendReference = %v, want ErrInvalidRequest", err)
	}
}

// IndexRuns counts the runs of pairs consecutive on both sides.
func TestIndexRuns(t *testing.T) {
	p := func(l, r int32) hotpath.IndexPair { return hotpath.IndexPair{Local: l, Remote: r} }
	for _, tc := range []struct {
		pairs []hotpath.IndexPair
		want  int
	}{
		{nil, 0},
		{[]hotpath.IndexPair{p(3, 9)}, 1},
		{[]hotpath.IndexPair{p(3, 9), p(4, 10), p(5, 11)}, 1},
		{[]hotpath.IndexPair{p(3, 9), p(4, 11), p(5, 12)}, 2}, // remote jumps
		{[]hotpath.IndexPair{p(3, 9), p(5, 10), p(6, 11)}, 2}, // local jumps
		{[]hotpath.IndexPair{p(3, 9), p(2, 8), p(1, 7)}, 3},   // going down
		{[]hotpath.IndexPair{p(0, 0), p(1, 1), p(0, 2), p(1, 3)}, 2},
	} {
		if got := hotpath.IndexRuns(tc.pairs); got != tc.want {
			t.Errorf("IndexRuns(%v) = %d, want %d", tc.pairs, got, tc.want)
		}
	}
}
