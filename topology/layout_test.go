package topology

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

// tinyLayout is a valid one-region full-attention layout: head size 2,
// 2-byte elements, 64 kernel blocks.
func tinyLayout(tp, rank, logical, kernel, heads int, kv KVLayout, packing KVPacking) *Layout {
	l := &Layout{TPRank: rank, TPSize: tp, PPSize: 1, TotalKVHeads: heads, HeadSize: 2, ElemBytes: 2,
		KVLayout: kv, Packing: packing, LogicalBlockSize: logical, KernelBlockSize: kernel}
	l.Regions = []Region{{Kind: KindFullAttention, Base: 1 << 20, BlockLen: l.AttentionBlockLen(), NumBlocks: 64}}
	return l
}

// validLayout returns a layout with full attention, sliding window, MLA and
// Mamba regions in explicit groups.
func validLayout() *Layout {
	l := tinyLayout(2, 1, 32, 16, 8, LayoutHND, PackedKV)
	bl := l.AttentionBlockLen()
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

// mlaLayout is a valid MLA-only layout: no KV heads (the latent is
// replicated), perToken bytes per token.
func mlaLayout(tp, rank, logical, kernel int, perToken int64) *Layout {
	return &Layout{TPRank: rank, TPSize: tp, PPSize: 1, LogicalBlockSize: logical, KernelBlockSize: kernel,
		Regions: []Region{{Kind: KindMLA, Base: 1 << 20, BlockLen: int64(kernel) * perToken, NumBlocks: 64}}}
}

// mambaLayout is a valid Mamba-only layout (one region, 1 KiB pages, 8
// logical blocks) with per-rank conv parts and SSM state.
func mambaLayout(tp, rank int, conv []int64, ssm int64) *Layout {
	return &Layout{TPRank: rank, TPSize: tp, PPSize: 1, LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []Region{{Kind: KindMamba, Base: 1 << 20, BlockLen: 1024, NumBlocks: 8, ConvBytes: conv, SSMBytes: ssm}}}
}

// wantErr fails unless err wraps is and its message contains every want
// (the field names and values).
func wantErr(t *testing.T, call string, err, is error, want ...string) {
	t.Helper()
	if err == nil {
		t.Fatalf("%s = nil, want %v containing %q", call, is, want)
	}
	if !errors.Is(err, is) {
		t.Fatalf("%s = %v, want an error wrapping %v", call, err, is)
	}
	for _, w := range want {
		if !strings.Contains(err.Error(), w) {
			t.Fatalf("%s = %v, want the message to contain %q", call, err, w)
		}
	}
}

func TestValidateAcceptsValidLayouts(t *testing.T) {
	pooled := tinyLayout(1, 0, 16, 16, 4, LayoutNHD, SplitKV)
	pooled.Regions = append(pooled.Regions, pooled.Regions[0])
	pooled.Regions[1].Base = 8 << 20
	pooled.Groups = []Group{{Kind: KindFullAttention, Regions: []int{0, 1}}, {Kind: KindSlidingWindow, Window: 32, Regions: []int{0, 1}}}

	sliding := tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV)
	sliding.Regions = append(sliding.Regions, sliding.Regions[0], sliding.Regions[0])
	sliding.Regions[1].Kind, sliding.Regions[1].Window = KindSlidingWindow, 128
	sliding.Regions[2].Base = 4 << 20
	sliding.Groups = []Group{{Kind: KindFullAttention, Regions: []int{0, 2}}, {Kind: KindSlidingWindow, Window: 128, Regions: []int{1}}}

	mambaHybrid := tinyLayout(4, 2, 64, 16, 8, LayoutHND, PackedKV)
	mambaHybrid.Regions = append(mambaHybrid.Regions,
		Region{Kind: KindMamba, Base: 8 << 20, BlockLen: 4096, NumBlocks: 16, ConvBytes: []int64{256, 64, 64}, SSMBytes: 2048})
	mambaHybrid.Groups = []Group{{Kind: KindFullAttention, Regions: []int{0}}, {Kind: KindMamba, Regions: []int{1}}}

	ppStage, _ := ppLayouts(1, 2, 4)

	for _, tc := range []struct {
		name string
		l    *Layout
	}{
		{"full attention HND packed", tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV)},
		{"full attention NHD packed", tinyLayout(2, 1, 16, 16, 8, LayoutNHD, PackedKV)},
		{"full attention NHD split K/V planes", tinyLayout(2, 1, 16, 16, 8, LayoutNHD, SplitKV)},
		{"separate K and V regions", tinyLayout(4, 3, 16, 16, 8, LayoutHND, SeparateKV)},
		{"GQA heads fewer than ranks (replicated heads)", tinyLayout(8, 7, 16, 16, 2, LayoutHND, PackedKV)},
		{"logical block of 4 kernel blocks", tinyLayout(1, 0, 64, 16, 4, LayoutHND, PackedKV)},
		{"MLA only, no KV heads needed", mlaLayout(4, 3, 64, 64, 576*2)},
		{"Mamba only, no KV heads needed", mambaLayout(2, 1, []int64{32}, 256)},
		{"hybrid sliding window with explicit groups", sliding},
		{"Mamba hybrid with explicit groups", mambaHybrid},
		{"hybrid: attention, sliding window, MLA and Mamba groups", validLayout()},
		{"HMA pooled groups share regions", pooled},
		{"PP stage 1 of 2 with a region offset", ppStage},
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
		want []string // field and value in the message
	}{
		{"zero TP size", func(l *Layout) { l.TPSize = 0 }, []string{"TPSize = 0"}},
		{"negative TP size", func(l *Layout) { l.TPSize = -2 }, []string{"TPSize = -2"}},
		{"TP size past the bound", func(l *Layout) { l.TPSize = 1 << 13 }, []string{"TPSize = 8192"}},
		{"TP rank out of range", func(l *Layout) { l.TPRank = 2 }, []string{"TPRank = 2", "0..1"}},
		{"negative TP rank", func(l *Layout) { l.TPRank = -1 }, []string{"TPRank = -1"}},
		{"zero PP size", func(l *Layout) { l.PPSize = 0 }, []string{"PPSize = 0"}},
		{"negative PP size", func(l *Layout) { l.PPSize = -3 }, []string{"PPSize = -3"}},
		{"PP rank out of range", func(l *Layout) { l.PPRank = 1 }, []string{"PPRank = 1", "0..0"}},
		{"negative PP rank", func(l *Layout) { l.PPRank = -1 }, []string{"PPRank = -1"}},
		{"zero logical block size", func(l *Layout) { l.LogicalBlockSize = 0 }, []string{"LogicalBlockSize = 0"}},
		{"negative logical block size", func(l *Layout) { l.LogicalBlockSize = -32 }, []string{"LogicalBlockSize = -32"}},
		{"logical block size past the bound", func(l *Layout) { l.LogicalBlockSize = 1 << 17 }, []string{"LogicalBlockSize = 131072"}},
		{"zero kernel block size", func(l *Layout) { l.KernelBlockSize = 0 }, []string{"KernelBlockSize = 0"}},
		{"negative kernel block size", func(l *Layout) { l.KernelBlockSize = -16 }, []string{"KernelBlockSize = -16"}},
		{"kernel block larger than logical", func(l *Layout) { l.KernelBlockSize = 64 }, []string{"KernelBlockSize = 64", "LogicalBlockSize (32)"}},
		{"logical not a multiple of kernel", func(l *Layout) { l.LogicalBlockSize = 40 }, []string{"LogicalBlockSize = 40 is not a multiple of KernelBlockSize = 16"}},
		{"negative region offset", func(l *Layout) { l.RegionOffset = -1 }, []string{"RegionOffset = -1"}},
		{"no regions", func(l *Layout) { l.Regions = nil; l.Groups = nil }, []string{"Regions is empty"}},
		{"zero heads", func(l *Layout) { l.TotalKVHeads = 0 }, []string{"TotalKVHeads = 0"}},
		{"negative heads", func(l *Layout) { l.TotalKVHeads = -8 }, []string{"TotalKVHeads = -8"}},
		{"heads not divisible by TP", func(l *Layout) { l.TotalKVHeads = 3 }, []string{"TotalKVHeads = 3 and TPSize = 2"}},
		{"TP not divisible by heads", func(l *Layout) { l.TPSize, l.TotalKVHeads = 6, 4 }, []string{"TotalKVHeads = 4 and TPSize = 6"}},
		{"zero head size", func(l *Layout) { l.HeadSize = 0 }, []string{"HeadSize = 0"}},
		{"negative head size", func(l *Layout) { l.HeadSize = -128 }, []string{"HeadSize = -128"}},
		{"zero element bytes", func(l *Layout) { l.ElemBytes = 0 }, []string{"ElemBytes = 0"}},
		{"element bytes past the bound", func(l *Layout) { l.ElemBytes = 17 }, []string{"ElemBytes = 17"}},
		{"unset KV layout", func(l *Layout) { l.KVLayout = 0 }, []string{"KVLayout = KVLayout(0)"}},
		{"unknown KV layout", func(l *Layout) { l.KVLayout = 9 }, []string{"KVLayout = KVLayout(9)"}},
		{"unset packing", func(l *Layout) { l.Packing = 0 }, []string{"Packing = KVPacking(0)"}},
		{"unknown packing", func(l *Layout) { l.Packing = 4 }, []string{"Packing = KVPacking(4)"}},
		{"unset region kind", func(l *Layout) { l.Regions[0].Kind = 0 }, []string{"Regions[0].Kind = Kind(0)"}},
		{"unknown region kind", func(l *Layout) { l.Regions[2].Kind = 5 }, []string{"Regions[2].Kind = Kind(5)"}},
		{"zero block count", func(l *Layout) { l.Regions[0].NumBlocks = 0 }, []string{"Regions[0].NumBlocks = 0"}},
		{"negative block count", func(l *Layout) { l.Regions[3].NumBlocks = -3 }, []string{"Regions[3].NumBlocks = -3"}},
		{"zero block length", func(l *Layout) { l.Regions[1].BlockLen = 0 }, []string{"Regions[1].BlockLen = 0"}},
		{"negative block length", func(l *Layout) { l.Regions[0].BlockLen = -1 }, []string{"Regions[0].BlockLen = -1"}},
		{"block length past the bound", func(l *Layout) { l.Regions[2].BlockLen = 1<<34 + 16 }, []string{"Regions[2].BlockLen = 17179869200"}},
		{"region size overflows", func(l *Layout) { l.Regions[2].BlockLen, l.Regions[2].NumBlocks = 1<<34, 1<<30 },
			[]string{"Regions[2] size BlockLen·NumBlocks = 17179869184·1073741824 overflows"}},
		{"attention block length disagrees with heads", func(l *Layout) { l.Regions[0].BlockLen = 100 },
			[]string{"Regions[0].BlockLen = 100, want 512", "4 local heads", "16 tokens", "head size 2", "2 bytes"}},
		{"sliding block length disagrees with heads", func(l *Layout) { l.Regions[1].BlockLen = 256 }, []string{"Regions[1].BlockLen = 256, want 512"}},
		{"base wraps the address space", func(l *Layout) { l.Regions[0].Base = ^uint64(0) - 10 },
			[]string{"Regions[0].Base = 0xfffffffffffffff5", "size 32768", "wraps the address space"}},
		{"sliding window without a window", func(l *Layout) { l.Regions[1].Window = 0 }, []string{"Regions[1].Window = 0"}},
		{"sliding window with a negative window", func(l *Layout) { l.Regions[1].Window = -64 }, []string{"Regions[1].Window = -64"}},
		{"MLA block not a multiple of the kernel block", func(l *Layout) { l.Regions[2].BlockLen = 100 },
			[]string{"Regions[2].BlockLen = 100 is not a multiple of KernelBlockSize = 16"}},
		{"Mamba conv part zero", func(l *Layout) { l.Regions[3].ConvBytes[1] = 0 }, []string{"Regions[3].ConvBytes[1] = 0", "BlockLen (256)"}},
		{"Mamba conv part negative", func(l *Layout) { l.Regions[3].ConvBytes[0] = -32 }, []string{"Regions[3].ConvBytes[0] = -32"}},
		{"Mamba conv part larger than its page", func(l *Layout) { l.Regions[3].ConvBytes[2] = 300 }, []string{"Regions[3].ConvBytes[2] = 300"}},
		{"Mamba with too many conv parts", func(l *Layout) { l.Regions[3].ConvBytes = make([]int64, 17) }, []string{"Regions[3].ConvBytes has 17 parts"}},
		{"Mamba negative SSM size", func(l *Layout) { l.Regions[3].SSMBytes = -1 }, []string{"Regions[3].SSMBytes = -1"}},
		{"Mamba SSM larger than its page", func(l *Layout) { l.Regions[3].SSMBytes = 300 }, []string{"Regions[3].SSMBytes = 300", "BlockLen (256)"}},
		{"Mamba conv and SSM larger than the page", func(l *Layout) { l.Regions[3].SSMBytes = 250 }, []string{"Regions[3]", "total 314", "BlockLen (256)"}},
		{"Mamba with no state at all", func(l *Layout) { l.Regions[3].ConvBytes, l.Regions[3].SSMBytes = nil, 0 }, []string{"Regions[3]", "total 0"}},
		{"group with a region index past the regions", func(l *Layout) { l.Groups[0].Regions[1] = 7 }, []string{"Groups[0].Regions[1] = 7", "0..3"}},
		{"group with a negative region index", func(l *Layout) { l.Groups[1].Regions[0] = -1 }, []string{"Groups[1].Regions[0] = -1"}},
		{"group without regions", func(l *Layout) { l.Groups[1].Regions = nil }, []string{"Groups[1].Regions is empty"}},
		{"group listing a region twice", func(l *Layout) { l.Groups[0].Regions = []int{0, 2, 0} }, []string{"Groups[0].Regions[2] = 0 repeats Groups[0].Regions[0]"}},
		{"region in no group", func(l *Layout) { l.Groups[1].Regions = []int{0} }, []string{"Regions[1] belongs to no group"}},
		{"Mamba group listing an attention region", func(l *Layout) { l.Groups[2].Regions = []int{3, 0} },
			[]string{"Groups[2] (mamba) lists Regions[0] of kind full_attention"}},
		{"attention group listing a Mamba region", func(l *Layout) { l.Groups[0].Regions = []int{0, 2, 3} },
			[]string{"Groups[0] (full_attention) lists Regions[3] of kind mamba"}},
		{"default single group over attention and Mamba regions", func(l *Layout) { l.Groups = nil },
			[]string{"Groups[0] (full_attention) lists Regions[3] of kind mamba"}},
		{"sliding-window group without a window", func(l *Layout) { l.Groups[1].Window = -4 }, []string{"Groups[1].Window = -4"}},
		{"unknown group kind", func(l *Layout) { l.Groups[0].Kind = 77 }, []string{"Groups[0].Kind = Kind(77)"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			l := validLayout()
			tc.mod(l)
			wantErr(t, "Validate()", l.Validate(), ErrInvalidLayout, tc.want...)
		})
	}
}

func TestValidateAttentionFieldsOnlyWithAttention(t *testing.T) {
	// Heads, head size, element size, KV layout and packing describe
	// attention blocks; an MLA- or Mamba-only model needs none of them.
	for _, tc := range []struct {
		name string
		l    *Layout
	}{
		{"MLA only", mlaLayout(2, 0, 16, 16, 64)},
		{"Mamba only", mambaLayout(1, 0, []int64{64, 32, 32}, 512)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.l.TotalKVHeads, tc.l.HeadSize, tc.l.ElemBytes, tc.l.KVLayout, tc.l.Packing = 0, 0, 0, 0, 0
			if err := tc.l.Validate(); err != nil {
				t.Fatalf("Validate() = %v, want nil", err)
			}
			tc.l.TPSize = 0
			wantErr(t, "Validate() with TPSize 0", tc.l.Validate(), ErrInvalidLayout, "TPSize = 0")
		})
	}
}

func TestLayoutAccessors(t *testing.T) {
	for _, tc := range []struct {
		name         string
		l            *Layout
		localHeads   int
		pagesPerBlck int
	}{
		{"sharded heads", tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV), 4, 1},
		{"one head per rank", tinyLayout(8, 3, 16, 16, 8, LayoutHND, PackedKV), 1, 1},
		{"replicated heads when TP > heads", tinyLayout(8, 0, 128, 64, 2, LayoutHND, PackedKV), 1, 2},
		{"TP 1 holds every head", tinyLayout(1, 0, 64, 16, 8, LayoutNHD, PackedKV), 8, 4},
		{"zero kernel block size gives zero pages, no panic", &Layout{TPSize: 1, TotalKVHeads: 1, LogicalBlockSize: 16}, 1, 0},
		{"zero TP size gives zero local heads, no panic", &Layout{TotalKVHeads: 8, LogicalBlockSize: 16, KernelBlockSize: 16}, 0, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.l.LocalHeads(); got != tc.localHeads {
				t.Errorf("LocalHeads() = %d, want %d", got, tc.localHeads)
			}
			if got := tc.l.PagesPerBlock(); got != tc.pagesPerBlck {
				t.Errorf("PagesPerBlock() = %d, want %d", got, tc.pagesPerBlck)
			}
		})
	}
}

func TestGroupList(t *testing.T) {
	sliding := tinyLayout(1, 0, 16, 16, 2, LayoutHND, PackedKV)
	sliding.Regions = append(sliding.Regions, sliding.Regions[0], sliding.Regions[0])
	for i := range sliding.Regions {
		sliding.Regions[i].Kind, sliding.Regions[i].Window = KindSlidingWindow, 48
	}
	explicit := validLayout()
	for _, tc := range []struct {
		name string
		l    *Layout
		want []Group
	}{
		{"default: one group of region 0's kind over every region", tinyLayout(1, 0, 16, 16, 2, LayoutHND, PackedKV),
			[]Group{{Kind: KindFullAttention, Regions: []int{0}}}},
		{"default group carries region 0's window", sliding,
			[]Group{{Kind: KindSlidingWindow, Window: 48, Regions: []int{0, 1, 2}}}},
		{"explicit groups are returned as given", explicit, explicit.Groups},
		{"no regions gives no groups", &Layout{}, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := tc.l.GroupList()
			if !slices.EqualFunc(got, tc.want, func(a, b Group) bool {
				return a.Kind == b.Kind && a.Window == b.Window && slices.Equal(a.Regions, b.Regions)
			}) {
				t.Fatalf("GroupList() = %+v, want %+v", got, tc.want)
			}
		})
	}
}

func TestStrings(t *testing.T) {
	for _, tc := range []struct {
		got, want string
	}{
		{KindFullAttention.String(), "full_attention"},
		{KindSlidingWindow.String(), "sliding_window"},
		{KindMLA.String(), "mla"},
		{KindMamba.String(), "mamba"},
		{Kind(42).String(), "Kind(42)"},
		{LayoutHND.String(), "HND"},
		{LayoutNHD.String(), "NHD"},
		{KVLayout(7).String(), "KVLayout(7)"},
		{PackedKV.String(), "packed"},
		{SplitKV.String(), "split"},
		{SeparateKV.String(), "separate"},
		{KVPacking(0).String(), "KVPacking(0)"},
	} {
		if tc.got != tc.want {
			t.Errorf("String() = %q, want %q", tc.got, tc.want)
		}
	}
}

// TestHeadRangeInvalidTP: a TP size that is not positive yields no heads
// instead of dividing by zero.
func TestHeadRangeInvalidTP(t *testing.T) {
	for _, tc := range []struct {
		name            string
		heads, tp, rank int
	}{
		{"zero TP", 8, 0, 0},
		{"zero TP and zero heads", 0, 0, 0},
		{"negative TP", 8, -2, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if f, n := HeadRange(tc.heads, tc.tp, tc.rank); f != 0 || n != 0 {
				t.Fatalf("HeadRange(%d, %d, %d) = %d, %d, want 0, 0", tc.heads, tc.tp, tc.rank, f, n)
			}
		})
	}
}
