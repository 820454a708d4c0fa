package topology

import (
	"errors"
	"testing"
)

// twoRegions returns tinyLayout with a second region: kind k (window w)
// at a distinct base, in the default group.
func twoRegions(l *Layout, k Kind, w int) *Layout {
	r := l.Regions[0]
	r.Kind, r.Window, r.Base = k, w, 8<<20
	if k == KindMLA {
		r.BlockLen = int64(l.KernelBlockSize) * 24
	}
	l.Regions = append(l.Regions, r)
	return l
}

func TestCheckCompatible(t *testing.T) {
	hnd := LayoutHND
	for _, tc := range []struct {
		name     string
		src, dst *Layout
		wantIs   error // nil: compatible
		want     []string
		reason   string
	}{
		{name: "identical ranks are compatible",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV)},
		{name: "hetero TP and block size are compatible",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(4, 0, 32, 32, 8, hnd, PackedKV)},
		{name: "HND vs NHD is accepted (unlike the reference: placement is exact)",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 0, 16, 16, 8, LayoutNHD, PackedKV)},
		{name: "packed vs split K/V planes is accepted",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 0, 16, 16, 8, hnd, SplitKV)},
		{name: "GQA handshake with replication: K=8, D TP16, P TP8 with equal block_len passes",
			src: tinyLayout(8, 3, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(16, 7, 16, 16, 8, hnd, PackedKV),
			reason: "SPEC §12 item 14"},
		{name: "KV heads mismatch names both values",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 0, 16, 16, 16, hnd, PackedKV),
			wantIs: ErrIncompatible, want: []string{"TotalKVHeads: src 8, dst 16"}},
		{name: "head size mismatch names both values",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: withHead(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), 4, 2),
			wantIs: ErrIncompatible, want: []string{"HeadSize: src 2, dst 4"}},
		{name: "element size mismatch names both values",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: withHead(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), 2, 1),
			wantIs: ErrIncompatible, want: []string{"ElemBytes: src 2, dst 1"}},
		{name: "separate K/V regions against packed",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 1, 16, 16, 8, hnd, SeparateKV),
			wantIs: ErrIncompatible, want: []string{"Packing: src packed, dst separate"}},
		{name: "non-divisible TP sizes",
			src: tinyLayout(4, 0, 16, 16, 24, hnd, PackedKV), dst: tinyLayout(6, 0, 16, 16, 24, hnd, PackedKV),
			wantIs: ErrIncompatible, want: []string{"TP 6", "TP 4"}},
		{name: "non-divisible block sizes",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 0, 24, 24, 8, hnd, PackedKV),
			wantIs: ErrIncompatible, want: []string{"src = 16", "dst = 24"}},
		{name: "group count mismatch",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: withGroups(twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindFullAttention, 0),
				Group{Kind: KindFullAttention, Regions: []int{0}}, Group{Kind: KindFullAttention, Regions: []int{1}}),
			wantIs: ErrIncompatible, want: []string{"len(Groups): src 1, dst 2"}},
		{name: "group kind mismatch",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: withKind(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindSlidingWindow, 32),
			wantIs: ErrIncompatible, want: []string{"Groups[0].Kind: src full_attention, dst sliding_window"}},
		{name: "group window mismatch",
			src: withKind(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindSlidingWindow, 64), dst: withKind(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindSlidingWindow, 128),
			wantIs: ErrIncompatible, want: []string{"Groups[0].Window: src 64, dst 128"}},
		{name: "region count mismatch",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindFullAttention, 0),
			wantIs: ErrIncompatible, want: []string{"len(Regions): src 1, dst 2"}},
		{name: "region kind mismatch inside matching groups",
			src: twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindMLA, 0), dst: twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindFullAttention, 0),
			wantIs: ErrIncompatible, want: []string{"Regions[1].Kind: src mla, dst full_attention"}},
		{name: "region window mismatch inside matching groups",
			src: withGroups(twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindSlidingWindow, 64),
				Group{Kind: KindFullAttention, Regions: []int{0}}, Group{Kind: KindSlidingWindow, Window: 64, Regions: []int{1}}),
			dst: withGroups(twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindSlidingWindow, 128),
				Group{Kind: KindFullAttention, Regions: []int{0}}, Group{Kind: KindSlidingWindow, Window: 64, Regions: []int{1}}),
			wantIs: ErrIncompatible, want: []string{"Regions[1].Window: src 64, dst 128"}},
		{name: "region in different groups on the two sides",
			src: withGroups(twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindFullAttention, 0),
				Group{Kind: KindFullAttention, Regions: []int{0}}, Group{Kind: KindFullAttention, Regions: []int{1}}),
			dst: withGroups(twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindFullAttention, 0),
				Group{Kind: KindFullAttention, Regions: []int{1}}, Group{Kind: KindFullAttention, Regions: []int{0}}),
			wantIs: ErrIncompatible, want: []string{"src Regions[0] (global 0) is in Groups[0] on src but not on dst"}},
		{name: "dst region in a group src's region is not in",
			src: withGroups(twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindFullAttention, 0),
				Group{Kind: KindFullAttention, Regions: []int{0}}, Group{Kind: KindFullAttention, Regions: []int{0, 1}}),
			dst: withGroups(twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindFullAttention, 0),
				Group{Kind: KindFullAttention, Regions: []int{0, 1}}, Group{Kind: KindFullAttention, Regions: []int{0, 1}}),
			wantIs: ErrIncompatible, want: []string{"dst Regions[1] is in Groups[0] on dst but src Regions[1] is not"}},
		{name: "a pipeline-parallel consumer (dst PP > 1) is unsupported",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: withPP(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), 2, 0, 0),
			wantIs: ErrUnsupported, want: []string{"dst PPSize = 2", "src PPSize = 1"}},
		{name: "region offset without pipeline stages",
			src: withPP(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), 1, 0, 1), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV),
			wantIs: ErrIncompatible, want: []string{"RegionOffset: src 1, dst 0"}},
		{name: "invalid src is named as src",
			src: withHead(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), -1, 2), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV),
			wantIs: ErrInvalidLayout, want: []string{"src: ", "HeadSize = -1"}},
		{name: "wrong block_len without GQA replication: K=32, D TP4, P TP2",
			src: tinyLayout(2, 1, 16, 16, 32, hnd, PackedKV), dst: withBlockLen(tinyLayout(4, 3, 16, 16, 32, hnd, PackedKV), 2048),
			wantIs: ErrInvalidLayout, want: []string{"dst: ", "Regions[0].BlockLen = 2048, want 1024"},
			reason: "SPEC §12 item 15: each side's block_len must match its own local heads"},
		{name: "mixed attention and MLA regions with hetero TP",
			src: twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindMLA, 0), dst: twoRegions(tinyLayout(4, 2, 16, 16, 8, hnd, PackedKV), KindMLA, 0),
			reason: "SPEC §12 item 13: a SPLIT + REPLICATE region mix is accepted"},
		{name: "mixed attention and a wrongly scaled MLA region",
			src: twoRegions(tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), KindMLA, 0), dst: withBlockLen2(twoRegions(tinyLayout(4, 2, 16, 16, 8, hnd, PackedKV), KindMLA, 0), 1, 16*12),
			wantIs: ErrIncompatible, want: []string{"Regions[1].BlockLen per token (MLA): src 24, dst 12"},
			reason: "SPEC §12 item 13: a region scaled as if sharded is refused"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckCompatible(tc.src, tc.dst)
			if tc.wantIs == nil {
				if err != nil {
					t.Fatalf("CheckCompatible() = %v, want nil (%s)", err, tc.reason)
				}
				return
			}
			wantErr(t, "CheckCompatible()", err, tc.wantIs, tc.want...)
		})
	}
}

func withHead(l *Layout, headSize, elemBytes int) *Layout {
	l.HeadSize, l.ElemBytes = headSize, elemBytes
	if headSize > 0 && elemBytes > 0 {
		l.Regions[0].BlockLen = l.AttentionBlockLen()
	}
	return l
}

func withKind(l *Layout, k Kind, window int) *Layout {
	l.Regions[0].Kind, l.Regions[0].Window = k, window
	return l
}

func withGroups(l *Layout, g ...Group) *Layout {
	l.Groups = g
	return l
}

func withPP(l *Layout, size, rank, offset int) *Layout {
	l.PPSize, l.PPRank, l.RegionOffset = size, rank, offset
	return l
}

func withBlockLen(l *Layout, n int64) *Layout { return withBlockLen2(l, 0, n) }

func withBlockLen2(l *Layout, region int, n int64) *Layout {
	l.Regions[region].BlockLen = n
	return l
}

func TestCheckCompatibleRegionRules(t *testing.T) {
	for _, tc := range []struct {
		name     string
		src, dst *Layout
		want     string // "" = compatible
	}{
		{"MLA replicated: same bytes per token across block sizes", mlaLayout(1, 0, 16, 16, 24), mlaLayout(2, 1, 64, 64, 24), ""},
		{"MLA replicated: hetero TP with the same bytes per token", mlaLayout(4, 3, 16, 16, 24), mlaLayout(1, 0, 16, 16, 24), ""},
		{"MLA bytes per token mismatch", mlaLayout(1, 0, 16, 16, 24), mlaLayout(1, 0, 16, 16, 32), "Regions[0].BlockLen per token (MLA): src 24, dst 32"},
		{"MLA block sizes that do not divide", mlaLayout(1, 0, 16, 16, 24), mlaLayout(1, 0, 24, 24, 24), "src = 16, dst = 24"},
		{"Mamba shards consistent with TP", mambaLayout(1, 0, []int64{64, 32}, 256), mambaLayout(2, 1, []int64{32, 16}, 128), ""},
		{"Mamba shards consistent with TP the other way", mambaLayout(4, 3, []int64{16, 8}, 64), mambaLayout(2, 1, []int64{32, 16}, 128), ""},
		{"Mamba conv part inconsistent with TP", mambaLayout(1, 0, []int64{64, 32}, 256), mambaLayout(2, 0, []int64{64, 16}, 128), "Regions[0].ConvBytes[0]·TPSize: src 64·1, dst 64·2"},
		{"Mamba second conv part inconsistent with TP", mambaLayout(1, 0, []int64{64, 32}, 256), mambaLayout(2, 0, []int64{32, 32}, 128), "Regions[0].ConvBytes[1]·TPSize: src 32·1, dst 32·2"},
		{"Mamba conv part count", mambaLayout(1, 0, []int64{64, 32}, 256), mambaLayout(1, 0, []int64{64}, 256), "Regions[0].len(ConvBytes): src 2, dst 1"},
		{"Mamba SSM inconsistent with TP", mambaLayout(2, 0, []int64{32}, 128), mambaLayout(1, 0, []int64{64}, 128), "Regions[0].SSMBytes·TPSize: src 128·2, dst 128·1"},
		{"Mamba with hetero block sizes is fine (pages pair 1:1)", mambaLayout(1, 0, []int64{64}, 256), func() *Layout {
			l := mambaLayout(1, 0, []int64{64}, 256)
			l.LogicalBlockSize, l.KernelBlockSize = 24, 24
			return l
		}(), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckCompatible(tc.src, tc.dst)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("CheckCompatible() = %v, want nil", err)
				}
				return
			}
			wantErr(t, "CheckCompatible()", err, ErrIncompatible, tc.want)
		})
	}
}

// ppLayouts returns stage `stage` of a P engine whose PP stages hold
// perStage regions each, and a PP=1 D holding all `total` regions.
func ppLayouts(stage, perStage, total int) (src, dst *Layout) {
	src = tinyLayout(1, 0, 16, 16, 4, LayoutHND, PackedKV)
	src.PPSize, src.PPRank, src.RegionOffset = total/perStage, stage, stage*perStage
	r := src.Regions[0]
	src.Regions = nil
	for i := 0; i < perStage; i++ {
		r.Base = uint64(1+i) << 24
		src.Regions = append(src.Regions, r)
	}
	dst = tinyLayout(1, 0, 16, 16, 4, LayoutHND, PackedKV)
	dst.Regions = nil
	for i := 0; i < total; i++ {
		r.Base = uint64(1+i) << 28
		dst.Regions = append(dst.Regions, r)
	}
	return src, dst
}

func TestCheckCompatiblePipelineStages(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mod    func(src, dst *Layout)
		stage  int
		wantIs error
		want   []string
	}{
		{name: "PP>1 producer stage 1 of 2 inside dst's regions (2..3 of 4)", stage: 1},
		{name: "PP>1 producer stage 0 of 2 inside dst's regions (0..1 of 4)", stage: 0},
		{name: "PP>1 producer stage past dst's regions", stage: 1, mod: func(src, dst *Layout) { src.RegionOffset = 3 },
			wantIs: ErrIncompatible, want: []string{"src regions 3..4 (RegionOffset 3, 2 regions) fall outside dst's 4 regions"}},
		{name: "PP>1 producer against a dst with too few regions", stage: 1, mod: func(src, dst *Layout) { dst.Regions = dst.Regions[:3] },
			wantIs: ErrIncompatible, want: []string{"src regions 2..3", "dst's 3 regions"}},
		{name: "dst with a region offset", stage: 1, mod: func(src, dst *Layout) { dst.RegionOffset = 2 },
			wantIs: ErrIncompatible, want: []string{"RegionOffset: src 2, dst 2"}},
		{name: "PP>1 producer stage with a region of another kind than dst's", stage: 1,
			mod: func(src, dst *Layout) {
				src.Regions[1] = Region{Kind: KindMLA, Base: 9 << 24, BlockLen: 16 * 8, NumBlocks: 64}
			},
			wantIs: ErrIncompatible, want: []string{"Regions[3].Kind: src mla, dst full_attention"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, dst := ppLayouts(tc.stage, 2, 4)
			if tc.mod != nil {
				tc.mod(src, dst)
			}
			err := CheckCompatible(src, dst)
			if tc.wantIs == nil {
				if err != nil {
					t.Fatalf("CheckCompatible() = %v, want nil", err)
				}
				return
			}
			wantErr(t, "CheckCompatible()", err, tc.wantIs, tc.want...)
		})
	}
}

// TestLayoutMismatchAcceptedButBounded: unlike the reference, HND vs NHD
// passes the compatibility check, and NewPlan refuses it only when exact
// placement needs more than MaxSegments descriptors per unit.
func TestLayoutMismatchAcceptedButBounded(t *testing.T) {
	src := tinyLayout(1, 0, 32, 32, 8, LayoutHND, PackedKV)
	dst := tinyLayout(1, 0, 32, 32, 8, LayoutNHD, PackedKV)
	if err := CheckCompatible(src, dst); err != nil {
		t.Fatalf("CheckCompatible(HND, NHD) = %v, want nil", err)
	}
	_, err := NewPlan(src, dst, PlanOptions{})
	wantErr(t, "NewPlan(HND, NHD, default MaxSegments)", err, ErrUnsupported, "more than 128 descriptors", "src HND/packed", "dst NHD/packed")
	var seg *SegmentsError
	if !errors.As(err, &seg) || *seg != (SegmentsError{Region: 0, Max: 128, UnitTokens: 32, msg: seg.msg}) {
		t.Errorf("NewPlan(HND, NHD) error as *SegmentsError = %+v, want region 0, max 128, 32-token units", seg)
	}
	p, err := NewPlan(src, dst, PlanOptions{MaxSegments: 256})
	if err != nil {
		t.Fatalf("NewPlan(HND, NHD, MaxSegments 256) = %v, want a plan", err)
	}
	// One segment per (head, token) cell: 8 heads · 32 tokens.
	if got := p.MaxUnitSegments; got != 256 {
		t.Fatalf("NewPlan(HND, NHD).MaxUnitSegments = %d, want 256", got)
	}
	_, err = NewPlan(src, dst, PlanOptions{MaxSegments: 255})
	wantErr(t, "NewPlan(HND, NHD, MaxSegments 255)", err, ErrUnsupported, "more than 255 descriptors")
}

func TestCheckSameEngine(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(b *Layout)
		want string // "" = same engine
	}{
		{"two ranks of one engine match", func(b *Layout) {}, ""},
		{"different PP sizes", func(b *Layout) { b.PPSize = 2 }, "PPSize: src 1, dst 2"},
		{"different TP sizes", func(b *Layout) { b.TPSize = 4 }, "TPSize: src 2, dst 4"},
		{"different logical block sizes", func(b *Layout) { b.LogicalBlockSize = 32 }, "LogicalBlockSize: src 16, dst 32"},
		{"different kernel block sizes", func(b *Layout) { b.KernelBlockSize = 8 }, "KernelBlockSize: src 16, dst 8"},
		{"different KV layout", func(b *Layout) { b.KVLayout = LayoutNHD }, "KVLayout: src HND, dst NHD"},
		{"different packing", func(b *Layout) { b.Packing = SplitKV }, "Packing: src packed, dst split"},
		{"different region counts in one stage", func(b *Layout) { b.Regions = append(b.Regions, b.Regions[0]) }, "len(Regions): src 1, dst 2"},
		{"different region kinds", func(b *Layout) { b.Regions[0].Kind = KindMLA }, "Regions[0].Kind: src full_attention, dst mla"},
		{"different block lengths", func(b *Layout) { b.Regions[0].BlockLen = 256 }, "Regions[0].BlockLen: src 512, dst 256"},
		{"different block counts across ranks (the reference asserts equal num_blocks)", func(b *Layout) { b.Regions[0].NumBlocks = 63 }, "Regions[0].NumBlocks: src 64, dst 63"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a := tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV)
			b := tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV)
			tc.mod(b)
			err := CheckSameEngine(a, b)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("CheckSameEngine() = %v, want nil", err)
				}
				return
			}
			wantErr(t, "CheckSameEngine()", err, ErrIncompatible, tc.want)
		})
	}
	// Stages of one engine differ in their regions; only their shared
	// shape is compared.
	a := tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV)
	a.PPSize = 2
	b := twoRegions(tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV), KindMLA, 0)
	b.PPSize, b.PPRank = 2, 1
	if err := CheckSameEngine(a, b); err != nil {
		t.Fatalf("CheckSameEngine(stage 0 with 1 region, stage 1 with 2) = %v, want nil", err)
	}
}
