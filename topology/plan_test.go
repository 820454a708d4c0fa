package topology

import (
	"errors"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite golden files under testdata/golden")

func mustPlan(t *testing.T, src, dst *Layout, opts PlanOptions) *Plan {
	t.Helper()
	p, err := NewPlan(src, dst, opts)
	if err != nil {
		t.Fatalf("NewPlan: %v", err)
	}
	return p
}

func segs(p *Plan) []Segment { return p.Groups[0].Regions[0].Segs }

// Geometry of tinyLayout: a K or V vector is 4 bytes; a packed cell (K+V)
// is 8 bytes.
func TestPlanRules(t *testing.T) {
	hnd, nhd := LayoutHND, LayoutNHD
	for _, tc := range []struct {
		name      string
		src, dst  *Layout
		want      []Segment
		whole     bool
		srcStride int64
		dstStride int64
		reason    string
	}{
		{name: "equal TP and block size moves whole blocks",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV),
			want: []Segment{{0, 0, 512}}, whole: true, srcStride: 512, dstStride: 512},
		{name: "D_TP > P_TP HND: D rank reads its head slice of P's block",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(4, 3, 16, 16, 8, hnd, PackedKV),
			want:   []Segment{{256, 0, 256}},
			reason: "D rank 3 holds heads 6-7 = local heads 2-3 of P rank 1: offset rank_offset_factor(1)·block_len(256)"},
		{name: "P_TP > D_TP HND: P rank lands at its head slot in D's block",
			src: tinyLayout(4, 3, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV),
			want: []Segment{{0, 256, 256}}},
		{name: "NHD with hetero TP places one segment per token",
			src: tinyLayout(1, 0, 4, 4, 4, nhd, PackedKV), dst: tinyLayout(2, 1, 4, 4, 4, nhd, PackedKV),
			want:   []Segment{{16, 0, 16}, {48, 16, 16}, {80, 32, 16}, {112, 48, 16}},
			reason: "token t of P holds 4 heads·8 bytes; D rank 1 needs heads 2-3 of every token"},
		{name: "block size 4 -> 8 HND with 2 heads: one segment per head per unit",
			src: tinyLayout(1, 0, 4, 4, 2, hnd, PackedKV), dst: tinyLayout(1, 0, 8, 8, 2, hnd, PackedKV),
			want: []Segment{{0, 0, 32}, {32, 64, 32}}, srcStride: 32, dstStride: 32,
			reason: "a P block's head h lands at head h's row of the D block; slot 1 is 4 tokens (32 bytes) further"},
		{name: "block size 4 -> 8 NHD with equal heads stays one segment per unit",
			src: tinyLayout(1, 0, 4, 4, 2, nhd, PackedKV), dst: tinyLayout(1, 0, 8, 8, 2, nhd, PackedKV),
			want: []Segment{{0, 0, 64}}, whole: true, srcStride: 64, dstStride: 64},
		{name: "block size 8 -> 4 (P blocks a multiple of D's) HND",
			src: tinyLayout(1, 0, 8, 8, 2, hnd, PackedKV), dst: tinyLayout(1, 0, 4, 4, 2, hnd, PackedKV),
			want: []Segment{{0, 0, 32}, {64, 32, 32}}, srcStride: 32, dstStride: 32},
		{name: "split K and V planes with hetero TP HND",
			src: tinyLayout(1, 0, 4, 4, 2, hnd, SplitKV), dst: tinyLayout(2, 1, 4, 4, 2, hnd, SplitKV),
			want: []Segment{{16, 0, 16}, {48, 16, 16}}},
		{name: "HND to NHD places every cell (refused past MaxSegments by default for big blocks)",
			src: tinyLayout(1, 0, 2, 2, 2, hnd, PackedKV), dst: tinyLayout(1, 0, 2, 2, 2, nhd, PackedKV),
			want: []Segment{{0, 0, 8}, {8, 16, 8}, {16, 8, 8}, {24, 24, 8}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustPlan(t, tc.src, tc.dst, PlanOptions{})
			rp := p.Groups[0].Regions[0]
			if !slices.Equal(rp.Segs, tc.want) || rp.Whole != tc.whole {
				t.Fatalf("segments = %v whole=%v, want %v whole=%v (%s)", rp.Segs, rp.Whole, tc.want, tc.whole, tc.reason)
			}
			if tc.srcStride != 0 && (rp.SrcSlotStride != tc.srcStride || rp.DstSlotStride != tc.dstStride) {
				t.Fatalf("slot strides = %d, %d, want %d, %d", rp.SrcSlotStride, rp.DstSlotStride, tc.srcStride, tc.dstStride)
			}
		})
	}
}

func TestPlanGQAAndMLANotifyOnly(t *testing.T) {
	// Heads 2, P TP 4 -> D TP 1: P ranks 1 and 3 duplicate heads 0 and 1.
	dst := tinyLayout(1, 0, 16, 16, 2, LayoutHND, PackedKV)
	for rank, notifyOnly := range []bool{false, true, false, true} {
		p := mustPlan(t, tinyLayout(4, rank, 16, 16, 2, LayoutHND, PackedKV), dst, PlanOptions{})
		if p.NotifyOnly != notifyOnly {
			t.Errorf("GQA P rank %d NotifyOnly = %v, want %v", rank, p.NotifyOnly, notifyOnly)
		}
	}
	// MLA, P TP 4 -> D TP 2: only the first connected P rank writes.
	mla := func(tp, rank int) *Layout {
		l := tinyLayout(tp, rank, 16, 16, 2, LayoutHND, PackedKV)
		l.Regions[0] = Region{Kind: KindMLA, Base: 1 << 20, BlockLen: 16 * 12, NumBlocks: 8}
		return l
	}
	for rank, notifyOnly := range []bool{false, true, false, true} {
		p := mustPlan(t, mla(4, rank), mla(2, rank/2), PlanOptions{})
		if p.NotifyOnly != notifyOnly {
			t.Errorf("MLA P rank %d NotifyOnly = %v, want %v", rank, p.NotifyOnly, notifyOnly)
		}
		if !notifyOnly && !slices.Equal(segs(p), []Segment{{0, 0, 192}}) {
			t.Errorf("MLA P rank %d segments = %v, want the whole block", rank, segs(p))
		}
	}
	// MLA push fan-out, P TP 1 -> D TP 2: P writes every D rank.
	for d := 0; d < 2; d++ {
		if p := mustPlan(t, mla(1, 0), mla(2, d), PlanOptions{}); p.NotifyOnly {
			t.Errorf("MLA fan-out to D rank %d is notify-only, want a write", d)
		}
	}
}

func TestPlanMambaSlicesPerTP(t *testing.T) {
	mamba := func(tp, rank int) *Layout {
		l := tinyLayout(tp, rank, 16, 16, 2, LayoutHND, PackedKV)
		n := int64(tp)
		l.Regions[0] = Region{Kind: KindMamba, Base: 1 << 20, BlockLen: 1024, NumBlocks: 8,
			ConvBytes: []int64{64 / n, 32 / n, 32 / n}, SSMBytes: 128 / n}
		return l
	}
	for _, tc := range []struct {
		name   string
		src    *Layout
		dst    *Layout
		want   []Segment
		reason string
	}{
		{"equal TP moves the conv parts and state as one segment", mamba(2, 1), mamba(2, 1), []Segment{{0, 0, 128}}, ""},
		{"D_TP > P_TP: D reads its slice of each P part", mamba(1, 0), mamba(2, 1),
			[]Segment{{32, 0, 32}, {80, 32, 16}, {112, 48, 16}, {192, 64, 64}},
			"local_offset 1: x at 0+1·32, B at 64+1·16, C at 96+1·16, SSM at 128+1·64"},
		{"P_TP > D_TP: each P part lands at p_idx·chunk of D's part", mamba(2, 1), mamba(1, 0),
			[]Segment{{0, 32, 32}, {32, 80, 16}, {48, 112, 16}, {64, 192, 64}},
			"P rank 1's x chunk at 1·32, B at 64+16, C at 96+16, SSM at 128+64"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustPlan(t, tc.src, tc.dst, PlanOptions{})
			if got := segs(p); !slices.Equal(got, tc.want) {
				t.Fatalf("segments = %v, want %v (%s)", got, tc.want, tc.reason)
			}
			if g := p.Groups[0]; g.SrcPPL != 1 || g.DstPPL != 1 || g.UnitTokens != 0 {
				t.Fatalf("Mamba group expanded: %+v", g)
			}
		})
	}
}

func TestPlanPipelineStageSlicesRegions(t *testing.T) {
	// SPEC §12 item 38: a P stage with 2 local regions writes regions
	// [2:4] of a D with 4.
	src, dst := ppLayouts(1, 2, 4)
	p := mustPlan(t, src, dst, PlanOptions{})
	var got [][2]int
	for _, r := range p.Groups[0].Regions {
		got = append(got, [2]int{r.Src, r.Dst})
		if r.DstBase != dst.Regions[r.Dst].Base {
			t.Fatalf("region %d: DstBase %#x, want dst region %d's base", r.Src, r.DstBase, r.Dst)
		}
	}
	if want := [][2]int{{0, 2}, {1, 3}}; !slices.Equal(got, want) {
		t.Fatalf("region pairs = %v, want %v", got, want)
	}
}

func TestPlanErrors(t *testing.T) {
	for _, tc := range []struct {
		name     string
		src, dst *Layout
		opts     PlanOptions
		wantIs   error
		want     string
	}{
		{"ranks not connected", tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(4, 3, 16, 16, 8, LayoutHND, PackedKV), PlanOptions{},
			ErrIncompatible, "src TP rank 0 is not connected to dst TP rank 3 (TP 2 -> 4 connects it to [1])"},
		{"exact placement past MaxSegments is refused", tinyLayout(1, 0, 32, 32, 8, LayoutHND, PackedKV), tinyLayout(1, 0, 32, 32, 8, LayoutNHD, PackedKV), PlanOptions{},
			ErrUnsupported, "needs more than 128 descriptors per 32-token unit (src HND/packed TP 1 block 32 -> dst NHD/packed TP 1 block 32)"},
		{"negative MaxSegments", tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), PlanOptions{MaxSegments: -1},
			ErrInvalidLayout, "MaxSegments = -1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NewPlan(tc.src, tc.dst, tc.opts)
			if !errors.Is(err, tc.wantIs) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("NewPlan() = %v, want %v containing %q", err, tc.wantIs, tc.want)
			}
		})
	}
}

// renderPlan prints a plan in a stable text form for golden files.
func renderPlan(p *Plan) string {
	var b strings.Builder
	fmt.Fprintf(&b, "src tp %d pp %d -> dst tp %d notify_only=%v max_unit_segments=%d\n", p.SrcTPRank, p.SrcPPRank, p.DstTPRank, p.NotifyOnly, p.MaxUnitSegments)
	for g, gp := range p.Groups {
		fmt.Fprintf(&b, "group %d %v window=%d unit_tokens=%d ppl=%d/%d units=%d/%d limit=%d/%d\n",
			g, gp.Kind, gp.Window, gp.UnitTokens, gp.SrcPPL, gp.DstPPL, gp.SrcUnits, gp.DstUnits, gp.SrcLimit, gp.DstLimit)
		for _, r := range gp.Regions {
			fmt.Fprintf(&b, "  region %d -> %d block %d/%d slot_stride %d/%d whole=%v unit_bytes=%d\n",
				r.Src, r.Dst, r.SrcBlockLen, r.DstBlockLen, r.SrcSlotStride, r.DstSlotStride, r.Whole, r.UnitBytes)
			for _, s := range r.Segs {
				fmt.Fprintf(&b, "    src +%d -> dst +%d len %d\n", s.SrcOff, s.DstOff, s.Len)
			}
		}
	}
	return b.String()
}

func TestPlanGolden(t *testing.T) {
	hybrid := func(tp, rank, bs int, kv KVLayout) *Layout {
		l := validLayout()
		l.TPSize, l.TPRank, l.LogicalBlockSize, l.KernelBlockSize, l.KVLayout = tp, rank, bs, bs, kv
		n := int64(tp)
		l.Regions[0].BlockLen = l.attentionBlockLen()
		l.Regions[1].BlockLen = l.attentionBlockLen()
		l.Regions[2].BlockLen = int64(bs) * 24
		l.Regions[3].ConvBytes = []int64{64 / n, 32 / n, 32 / n}
		l.Regions[3].SSMBytes = 128 / n
		return l
	}
	for _, tc := range []struct {
		name     string
		src, dst *Layout
	}{
		{"hybrid_tp2to4_bs16to32_hnd", hybrid(2, 1, 16, LayoutHND), hybrid(4, 2, 32, LayoutHND)},
		{"hybrid_tp4to2_bs32to16_nhd", hybrid(4, 3, 32, LayoutNHD), hybrid(2, 1, 16, LayoutNHD)},
		{"gqa_heads2_tp4to1_rank2", tinyLayout(4, 2, 16, 16, 2, LayoutHND, SplitKV), tinyLayout(1, 0, 32, 16, 2, LayoutHND, SplitKV)},
		{"pp_stage1_of2", func() *Layout { s, _ := ppLayouts(1, 2, 4); return s }(), func() *Layout { _, d := ppLayouts(1, 2, 4); return d }()},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := renderPlan(mustPlan(t, tc.src, tc.dst, PlanOptions{}))
			path := filepath.Join("testdata", "golden", tc.name+".txt")
			if *update {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if got != string(want) {
				t.Fatalf("plan differs from %s (-update rewrites it):\ngot:\n%s\nwant:\n%s", path, got, want)
			}
		})
	}
}
