package topology

import (
	"errors"
	"strings"
	"testing"
)

// tinyLayout is a valid one-region full-attention layout: head size 2,
// 2-byte elements, 64 kernel blocks.
func tinyLayout(tp, rank, logical, kernel, heads int, kv KVLayout, packing KVPacking) *Layout {
	l := &Layout{TPRank: rank, TPSize: tp, PPSize: 1, TotalKVHeads: heads, HeadSize: 2, ElemBytes: 2,
		KVLayout: kv, Packing: packing, LogicalBlockSize: logical, KernelBlockSize: kernel}
	l.Regions = []Region{{Kind: KindFullAttention, Base: 1 << 20, BlockLen: l.attentionBlockLen(), NumBlocks: 64}}
	return l
}

// validLayout returns a layout with full attention, sliding window, MLA and
// Mamba regions in explicit groups.
func validLayout() *Layout {
	l := tinyLayout(2, 1, 32, 16, 8, LayoutHND, PackedKV)
	bl := l.attentionBlockLen()
	l.Regions = []Region{
		{Kind: KindFullAttention, Base: 1 << 20, BlockLen: bl, NumBlocks: 64},
		{Kind: KindSlidingWindow, Window: 64, Base: 2 << 20, BlockLen: bl, NumBlocks: 64},
		{Kind: KindMLA, Base: 3 << 20, BlockLen: 16 * 24, NumBlocks: 64},
		{Kind: KindMamba, Base: 4 << 20, BlockLen: 256, NumBlocks: 32, ConvBytes: []int64{32, 16, 16}, SSMBytes: 128},
	}
	l.Groups = []Group{
		{Kind: KindFullAttention, Regions: []int{0, 2}},
		{Kind: KindSlidingWindow, Window: 64, Regions: []int{1}},
		{Kind: KindMamba, Regions: []int{3}},
	}
	return l
}

func TestValidateAcceptsValidLayouts(t *testing.T) {
	pooled := tinyLayout(1, 0, 16, 16, 4, LayoutNHD, SplitKV)
	pooled.Regions = append(pooled.Regions, pooled.Regions[0])
	pooled.Regions[1].Base = 8 << 20
	pooled.Groups = []Group{{Kind: KindFullAttention, Regions: []int{0, 1}}, {Kind: KindSlidingWindow, Window: 32, Regions: []int{0, 1}}}
	sep := tinyLayout(4, 3, 16, 16, 8, LayoutHND, SeparateKV)
	for _, tc := range []struct {
		name string
		l    *Layout
	}{
		{"full attention HND", tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV)},
		{"full attention NHD split", tinyLayout(2, 1, 16, 16, 8, LayoutNHD, SplitKV)},
		{"separate K and V regions", sep},
		{"GQA heads fewer than ranks", tinyLayout(8, 7, 16, 16, 2, LayoutHND, PackedKV)},
		{"hybrid: attention, sliding window, MLA and Mamba groups", validLayout()},
		{"HMA pooled groups share regions", pooled},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if err := tc.l.Validate(); err != nil {
				t.Fatalf("Validate() = %v, want nil", err)
			}
		})
	}
}

func TestValidateRejectsEveryBadField(t *testing.T) {
	for _, tc := range []struct {
		name string
		mod  func(l *Layout)
		want string // field and value in the message
	}{
		{"zero TP size", func(l *Layout) { l.TPSize = 0 }, "TPSize = 0"},
		{"negative TP size", func(l *Layout) { l.TPSize = -2 }, "TPSize = -2"},
		{"TP rank out of range", func(l *Layout) { l.TPRank = 2 }, "TPRank = 2"},
		{"zero PP size", func(l *Layout) { l.PPSize = 0 }, "PPSize = 0"},
		{"PP rank out of range", func(l *Layout) { l.PPRank = 1 }, "PPRank = 1"},
		{"zero logical block size", func(l *Layout) { l.LogicalBlockSize = 0 }, "LogicalBlockSize = 0"},
		{"negative kernel block size", func(l *Layout) { l.KernelBlockSize = -16 }, "KernelBlockSize = -16"},
		{"logical not a multiple of kernel", func(l *Layout) { l.LogicalBlockSize = 40 }, "LogicalBlockSize = 40 is not a multiple of KernelBlockSize = 16"},
		{"heads and TP do not divide", func(l *Layout) { l.TotalKVHeads = 3 }, "TotalKVHeads = 3 and TPSize = 2"},
		{"zero heads", func(l *Layout) { l.TotalKVHeads = 0 }, "TotalKVHeads = 0"},
		{"zero head size", func(l *Layout) { l.HeadSize = 0 }, "HeadSize = 0"},
		{"zero element bytes", func(l *Layout) { l.ElemBytes = 0 }, "ElemBytes = 0"},
		{"unknown KV layout", func(l *Layout) { l.KVLayout = 9 }, "KVLayout = KVLayout(9)"},
		{"unknown packing", func(l *Layout) { l.Packing = 0 }, "Packing = KVPacking(0)"},
		{"no regions", func(l *Layout) { l.Regions = nil; l.Groups = nil }, "Regions is empty"},
		{"unknown region kind", func(l *Layout) { l.Regions[0].Kind = 0 }, "Regions[0].Kind = Kind(0)"},
		{"zero block count", func(l *Layout) { l.Regions[0].NumBlocks = 0 }, "Regions[0].NumBlocks = 0"},
		{"negative block length", func(l *Layout) { l.Regions[0].BlockLen = -1 }, "Regions[0].BlockLen = -1"},
		{"block length disagrees with heads", func(l *Layout) { l.Regions[0].BlockLen = 100 }, "Regions[0].BlockLen = 100, want 512"},
		{"base wraps the address space", func(l *Layout) { l.Regions[0].Base = ^uint64(0) - 10 }, "wraps the address space"},
		{"sliding window without a window", func(l *Layout) { l.Regions[1].Window = 0 }, "Regions[1].Window = 0"},
		{"MLA block not a multiple of the block size", func(l *Layout) { l.Regions[2].BlockLen = 100 }, "Regions[2].BlockLen = 100 is not a multiple of KernelBlockSize = 16"},
		{"Mamba conv part not positive", func(l *Layout) { l.Regions[3].ConvBytes[1] = 0 }, "Regions[3].ConvBytes[1] = 0"},
		{"Mamba state larger than its page", func(l *Layout) { l.Regions[3].SSMBytes = 250 }, "conv and SSM bytes total 314"},
		{"Mamba negative SSM", func(l *Layout) { l.Regions[3].SSMBytes = -1 }, "Regions[3].SSMBytes = -1"},
		{"group with a bad region index", func(l *Layout) { l.Groups[0].Regions[1] = 7 }, "Groups[0].Regions[1] = 7"},
		{"group without regions", func(l *Layout) { l.Groups[1].Regions = nil }, "Groups[1].Regions is empty"},
		{"region in no group", func(l *Layout) { l.Groups[1].Regions = []int{0} }, "Regions[1] belongs to no group"},
		{"Mamba group listing an attention region", func(l *Layout) { l.Groups[2].Regions = []int{3, 0} }, "Groups[2] (mamba) lists Regions[0] of kind full_attention"},
		{"sliding-window group without a window", func(l *Layout) { l.Groups[1].Window = -4 }, "Groups[1].Window = -4"},
		{"unknown group kind", func(l *Layout) { l.Groups[0].Kind = 77 }, "Groups[0].Kind = Kind(77)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := validLayout()
			tc.mod(l)
			err := l.Validate()
			if !errors.Is(err, ErrInvalidLayout) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Validate() = %v, want ErrInvalidLayout containing %q", err, tc.want)
			}
		})
	}
}

func TestLayoutAccessors(t *testing.T) {
	l := tinyLayout(8, 0, 128, 64, 2, LayoutHND, PackedKV)
	if got := l.PagesPerBlock(); got != 2 {
		t.Errorf("PagesPerBlock() = %d, want 2", got)
	}
	if got := l.LocalHeads(); got != 1 {
		t.Errorf("LocalHeads() with TP 8 > 2 heads = %d, want 1 (replicated)", got)
	}
	if got := tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV).LocalHeads(); got != 4 {
		t.Errorf("LocalHeads() = %d, want 4", got)
	}
	g := l.GroupList()
	if len(g) != 1 || g[0].Kind != KindFullAttention || len(g[0].Regions) != 1 {
		t.Errorf("GroupList() default = %+v, want one full-attention group over region 0", g)
	}
	if s := (Kind(42)).String() + LayoutHND.String() + SplitKV.String(); s != "Kind(42)HNDsplit" {
		t.Errorf("String() = %q", s)
	}
}
