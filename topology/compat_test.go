package topology

import (
	"errors"
	"strings"
	"testing"
)

func TestCheckCompatible(t *testing.T) {
	for _, tc := range []struct {
		name   string
		mod    func(src, dst *Layout)
		wantIs error
		want   string
	}{
		{name: "same model, hetero TP and block size is compatible", mod: func(src, dst *Layout) {
			*dst = *tinyLayout(4, 0, 32, 32, 8, LayoutHND, PackedKV)
		}},
		{name: "HND vs NHD is accepted (placement is exact)", mod: func(src, dst *Layout) {
			*dst = *tinyLayout(2, 0, 16, 16, 8, LayoutNHD, PackedKV)
		}},
		{name: "KV heads mismatch", mod: func(src, dst *Layout) { *dst = *tinyLayout(2, 0, 16, 16, 16, LayoutHND, PackedKV) },
			wantIs: ErrIncompatible, want: "TotalKVHeads: src 8, dst 16"},
		{name: "head size mismatch", mod: func(src, dst *Layout) {
			dst.HeadSize = 4
			dst.Regions[0].BlockLen = dst.attentionBlockLen()
		}, wantIs: ErrIncompatible, want: "HeadSize: src 2, dst 4"},
		{name: "element size mismatch", mod: func(src, dst *Layout) {
			dst.ElemBytes = 1
			dst.Regions[0].BlockLen = dst.attentionBlockLen()
		}, wantIs: ErrIncompatible, want: "ElemBytes: src 2, dst 1"},
		{name: "separate K/V regions against packed", mod: func(src, dst *Layout) {
			dst.Packing = SeparateKV
			dst.Regions[0].BlockLen = dst.attentionBlockLen()
		}, wantIs: ErrIncompatible, want: "Packing: src packed, dst separate"},
		{name: "TP sizes not multiples", mod: func(src, dst *Layout) {
			*dst = *tinyLayout(8, 0, 16, 16, 8, LayoutHND, PackedKV)
			src.TPSize, src.TPRank = 4, 0
			src.Regions[0].BlockLen = src.attentionBlockLen()
			dst.TPSize = 6
			dst.TotalKVHeads = 24
			src.TotalKVHeads = 24
			src.Regions[0].BlockLen = src.attentionBlockLen()
			dst.Regions[0].BlockLen = dst.attentionBlockLen()
		},
			wantIs: ErrIncompatible, want: "remote TP 6 is not a multiple of local TP 4"},
		{name: "block sizes not multiples", mod: func(src, dst *Layout) { *dst = *tinyLayout(2, 0, 24, 24, 8, LayoutHND, PackedKV) },
			wantIs: ErrIncompatible, want: "src = 16, dst = 24"},
		{name: "group count mismatch", mod: func(src, dst *Layout) {
			dst.Regions = append(dst.Regions, dst.Regions[0])
			dst.Groups = []Group{{Kind: KindFullAttention, Regions: []int{0}}, {Kind: KindFullAttention, Regions: []int{1}}}
		}, wantIs: ErrIncompatible, want: "len(Groups): src 1, dst 2"},
		{name: "group kind mismatch", mod: func(src, dst *Layout) {
			dst.Regions[0].Kind, dst.Regions[0].Window = KindSlidingWindow, 32
		}, wantIs: ErrIncompatible, want: "Groups[0].Kind: src full_attention, dst sliding_window"},
		{name: "region count mismatch", mod: func(src, dst *Layout) { dst.Regions = append(dst.Regions, dst.Regions[0]) },
			wantIs: ErrIncompatible, want: "len(Regions): src 1, dst 2"},
		{name: "a pipeline-parallel consumer is unsupported", mod: func(src, dst *Layout) { dst.PPSize = 2 },
			wantIs: ErrUnsupported, want: "dst PPSize = 2"},
		{name: "invalid src names the side", mod: func(src, dst *Layout) { src.HeadSize = -1 },
			wantIs: ErrInvalidLayout, want: "src: topology: invalid layout: HeadSize = -1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src := tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV)
			dst := tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV)
			tc.mod(src, dst)
			err := CheckCompatible(src, dst)
			if tc.wantIs == nil {
				if err != nil {
					t.Fatalf("CheckCompatible() = %v, want nil", err)
				}
				return
			}
			if !errors.Is(err, tc.wantIs) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("CheckCompatible() = %v, want %v containing %q", err, tc.wantIs, tc.want)
			}
		})
	}
}

func TestCheckCompatibleRegionRules(t *testing.T) {
	mla := func(tp, kernel int, perToken int64) *Layout {
		l := tinyLayout(tp, 0, kernel, kernel, 8, LayoutHND, PackedKV)
		l.Regions[0] = Region{Kind: KindMLA, Base: 1 << 20, BlockLen: int64(kernel) * perToken, NumBlocks: 32}
		return l
	}
	mamba := func(tp int, conv []int64, ssm int64) *Layout {
		l := tinyLayout(tp, 0, 16, 16, 8, LayoutHND, PackedKV)
		l.Regions[0] = Region{Kind: KindMamba, Base: 1 << 20, BlockLen: 1024, NumBlocks: 8, ConvBytes: conv, SSMBytes: ssm}
		return l
	}
	for _, tc := range []struct {
		name     string
		src, dst *Layout
		want     string // "" = compatible
	}{
		{"MLA replicated: same bytes per token across block sizes", mla(1, 16, 24), mla(2, 64, 24), ""},
		{"MLA bytes per token mismatch", mla(1, 16, 24), mla(1, 16, 32), "BlockLen per token (MLA): src 24, dst 32"},
		{"Mamba shards consistent with TP", mamba(1, []int64{64, 32}, 256), mamba(2, []int64{32, 16}, 128), ""},
		{"Mamba conv part inconsistent with TP", mamba(1, []int64{64, 32}, 256), mamba(2, []int64{64, 16}, 128), "ConvBytes[0]·TPSize: src 64·1, dst 64·2"},
		{"Mamba conv part count", mamba(1, []int64{64, 32}, 256), mamba(1, []int64{64}, 256), "len(ConvBytes): src 2, dst 1"},
		{"Mamba SSM inconsistent with TP", mamba(2, []int64{32}, 128), mamba(1, []int64{64}, 128), "SSMBytes·TPSize: src 128·2, dst 128·1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := CheckCompatible(tc.src, tc.dst)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("CheckCompatible() = %v, want nil", err)
				}
				return
			}
			if !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("CheckCompatible() = %v, want ErrIncompatible containing %q", err, tc.want)
			}
		})
	}
}

// ppStage returns stage s of a P engine with PP stages of n regions each,
// against a PP=1 D with total regions.
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
	src, dst := ppLayouts(1, 2, 4)
	if err := CheckCompatible(src, dst); err != nil {
		t.Fatalf("PP stage 1 of 2 (regions 2..3 of 4) = %v, want compatible", err)
	}
	src.RegionOffset = 3
	if err := CheckCompatible(src, dst); !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), "src regions 3..4 (RegionOffset 3, 2 regions) fall outside dst's 4 regions") {
		t.Fatalf("PP stage past dst's regions = %v, want ErrIncompatible naming the window", err)
	}
}

func TestCheckSameEngine(t *testing.T) {
	a := tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV)
	for _, tc := range []struct {
		name string
		mod  func(b *Layout)
		want string
	}{
		{"ranks of one engine match", func(b *Layout) {}, ""},
		{"different block counts across ranks", func(b *Layout) { b.Regions[0].NumBlocks = 63 }, "Regions[0].NumBlocks: src 64, dst 63"},
		{"different TP sizes", func(b *Layout) { b.TPSize = 4 }, "TPSize: src 2, dst 4"},
		{"different KV layout", func(b *Layout) { b.KVLayout = LayoutNHD }, "KVLayout: src HND, dst NHD"},
		{"different kernel block size", func(b *Layout) { b.KernelBlockSize = 8 }, "KernelBlockSize: src 16, dst 8"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b := tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV)
			tc.mod(b)
			err := CheckSameEngine(a, b)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("CheckSameEngine() = %v, want nil", err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("CheckSameEngine() = %v, want an error containing %q", err, tc.want)
			}
		})
	}
}
