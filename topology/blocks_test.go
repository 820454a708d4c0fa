package topology

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func bids(v ...int) []BlockID {
	out := make([]BlockID, len(v))
	for i, x := range v {
		out[i] = BlockID(x)
	}
	return out
}

func TestBlockSizeRatio(t *testing.T) {
	for _, tc := range []struct {
		name                     string
		src, dst                 int
		unit, srcUnits, dstUnits int
		wantErr                  string
	}{
		{name: "equal block sizes", src: 16, dst: 16, unit: 16, srcUnits: 1, dstUnits: 1},
		{name: "P blocks divide D blocks (the reference's only case)", src: 16, dst: 64, unit: 16, srcUnits: 1, dstUnits: 4},
		{name: "P blocks a multiple of D blocks (exact in kvxfer)", src: 64, dst: 16, unit: 16, srcUnits: 4, dstUnits: 1},
		{name: "neither divides: error names both sizes", src: 16, dst: 24, wantErr: "src = 16, dst = 24"},
		{name: "zero size", src: 0, dst: 16, wantErr: "src = 0"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u, s, d, err := BlockSizeRatio(tc.src, tc.dst)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("BlockSizeRatio(%d, %d) = %v, want error containing %q", tc.src, tc.dst, err, tc.wantErr)
				}
				return
			}
			if err != nil || u != tc.unit || s != tc.srcUnits || d != tc.dstUnits {
				t.Fatalf("BlockSizeRatio(%d, %d) = %d, %d, %d, %v, want %d, %d, %d", tc.src, tc.dst, u, s, d, err, tc.unit, tc.srcUnits, tc.dstUnits)
			}
		})
	}
}

func TestBlockListRules(t *testing.T) {
	for _, tc := range []struct {
		name string
		got  []BlockID
		want []BlockID
	}{
		{"logical to kernel expansion b*ppl+[0,ppl)", ExpandKernel(nil, bids(3, 7), 2), bids(6, 7, 14, 15)},
		{"Mamba groups are never expanded (ppl 1)", ExpandKernel(nil, bids(3, 7), 1), bids(3, 7)},
		{"block-size mapping to the fine-grained view", MapToFine(nil, bids(2, 5), 4, -1), bids(8, 9, 10, 11, 20, 21, 22, 23)},
		{"block-size mapping truncated to the remote count", MapToFine(nil, bids(2, 5), 4, 6), bids(8, 9, 10, 11, 20, 21)},
		{"prefix-hit end-trim keeps P's tail", EndTrim(bids(10, 11, 12, 13, 14), 2), bids(13, 14)},
		{"end-trim with a zero count is empty (SPEC §14)", EndTrim(bids(10, 11, 12), 0), bids()},
		{"end-trim with a larger count keeps all", EndTrim(bids(10, 11), 5), bids(10, 11)},
		{"sliding window keeps cdiv(window, block)+1 blocks", first(ClipWindow(bids(1, 2, 3, 4, 5, 6), 40, 16)), bids(3, 4, 5, 6)},
		{"sliding window shorter than the window is unchanged", first(ClipWindow(bids(1, 2), 40, 16)), bids(1, 2)},
		{"Mamba clipping keeps the last block", ClipMamba(bids(1, 2, 3), 0, false), bids(3)},
		{"Mamba clipping drops speculative tail blocks first", ClipMamba(bids(1, 2, 3, 4), 2, false), bids(2)},
		{"Mamba clipping never empties the list", ClipMamba(bids(1, 2), 5, false), bids(1)},
		{"Mamba clipping in cache mode all keeps the rest", ClipMamba(bids(1, 2, 3, 4), 1, true), bids(1, 2, 3)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if !slices.Equal(tc.got, tc.want) && !(len(tc.got) == 0 && len(tc.want) == 0) {
				t.Fatalf("got %v, want %v", tc.got, tc.want)
			}
		})
	}
	if _, dropped := ClipWindow(bids(1, 2, 3, 4, 5, 6), 40, 16); dropped != 2 {
		t.Fatalf("ClipWindow dropped %d, want 2", dropped)
	}
	if got := WindowBlocks(32, 16); got != 3 {
		t.Fatalf("WindowBlocks(32, 16) = %d, want 3", got)
	}
	if kept, d := Clip(Group{Kind: KindSlidingWindow, Window: 16}, bids(1, 2, 3, 4), 16, 0, true, false); !slices.Equal(kept, bids(3, 4)) || d != 2 {
		t.Fatalf("Clip(sliding) = %v, %d", kept, d)
	}
	if kept, _ := Clip(Group{Kind: KindMamba}, bids(1, 2, 3), 16, 0, false, false); !slices.Equal(kept, bids(1, 2, 3)) {
		t.Fatalf("Clip(Mamba, clipSSM false) = %v, want unchanged (host-save path)", kept)
	}
	if kept, _ := Clip(Group{Kind: KindFullAttention}, bids(1, 2, 3), 16, 0, true, false); !slices.Equal(kept, bids(1, 2, 3)) {
		t.Fatalf("Clip(full attention) = %v, want unchanged", kept)
	}
}

func first(ids []BlockID, _ int) []BlockID { return ids }

func TestTrimSSM(t *testing.T) {
	for _, tc := range []struct {
		name      string
		src, dst  int
		s0, d0, n int
		wantErr   bool
	}{
		{name: "equal counts pair positionally", src: 2, dst: 2, n: 2},
		{name: "longer P keeps its tail", src: 3, dst: 2, s0: 1, n: 2},
		{name: "longer D loses its tail", src: 2, dst: 3, n: 2},
		{name: "counts differing by more than one are an error", src: 1, dst: 3, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s0, d0, n, err := TrimSSM(tc.src, tc.dst)
			if tc.wantErr {
				if !errors.Is(err, ErrInvalidBlocks) || !strings.Contains(err.Error(), "src = 1, dst = 3") {
					t.Fatalf("TrimSSM(%d, %d) = %v, want ErrInvalidBlocks naming both counts", tc.src, tc.dst, err)
				}
				return
			}
			if err != nil || s0 != tc.s0 || d0 != tc.d0 || n != tc.n {
				t.Fatalf("TrimSSM(%d, %d) = %d, %d, %d, %v, want %d, %d, %d", tc.src, tc.dst, s0, d0, n, err, tc.s0, tc.d0, tc.n)
			}
		})
	}
}

// attnGroup returns a GroupPlan with the given logical and kernel sizes.
func attnGroup(t *testing.T, srcLogical, srcKernel, dstLogical, dstKernel int) *GroupPlan {
	t.Helper()
	src := tinyLayout(1, 0, srcLogical, srcKernel, 4, LayoutHND, PackedKV)
	dst := tinyLayout(1, 0, dstLogical, dstKernel, 4, LayoutHND, PackedKV)
	p, err := NewPlan(src, dst, PlanOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return &p.Groups[0]
}

func TestAlign(t *testing.T) {
	for _, tc := range []struct {
		name           string
		sL, sK, dL, dK int
		src, dst       Span
		tokens         int
		s0, d0, n      int
		reason         string
	}{
		{name: "no prefix hit pairs everything", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2, 3)}, dst: Span{IDs: bids(7, 8, 9)}, tokens: 40, n: 3},
		{name: "prefix-hit end-trim equals token anchoring when tails align", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(10, 11, 12, 13, 14)}, dst: Span{Start: TailStart(70, 16, 2), IDs: bids(500, 501)}, tokens: 70,
			s0: 3, n: 2, reason: "SPEC §12 item 40: P [10..14] against D [500, 501] writes [13, 14]"},
		{name: "full prefix hit pairs nothing", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2)}, dst: Span{Start: 32}, tokens: 32, n: 0},
		{name: "hetero block size with prefix hit and partial last block", sL: 16, sK: 16, dL: 32, dK: 32,
			src: Span{IDs: bids(1, 2, 3)}, dst: Span{Start: 32, IDs: bids(9)}, tokens: 40, s0: 2, d0: 0, n: 1,
			reason: "tokens 32..47 are P block 2; the reference's end-trim would pair P blocks 1 and 2 with D's two halves"},
		{name: "D blocks larger: D list truncated to P's count", sL: 16, sK: 16, dL: 64, dK: 64,
			src: Span{IDs: bids(1, 2, 3)}, dst: Span{IDs: bids(4)}, tokens: 40, n: 3},
		{name: "P blocks larger: P's last block truncated to D's count", sL: 64, sK: 64, dL: 16, dK: 16,
			src: Span{IDs: bids(1)}, dst: Span{IDs: bids(4, 5, 6)}, tokens: 40, n: 3},
		{name: "tokens bound the last unit", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2, 3)}, dst: Span{IDs: bids(4, 5, 6)}, tokens: 17, n: 2},
		{name: "logical 32 with kernel 16 counts kernel units", sL: 32, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2)}, dst: Span{Start: 16, IDs: bids(4, 5, 6)}, tokens: 64, s0: 1, n: 3},
		{name: "clipped sliding window starts later on P", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{Start: 32, IDs: bids(3, 4)}, dst: Span{IDs: bids(7, 8, 9, 10)}, tokens: 64, d0: 2, n: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := attnGroup(t, tc.sL, tc.sK, tc.dL, tc.dK)
			s0, d0, n, err := g.Align(tc.src, tc.dst, tc.tokens)
			if err != nil || s0 != tc.s0 || d0 != tc.d0 || n != tc.n {
				t.Fatalf("Align = %d, %d, %d, %v, want %d, %d, %d (%s)", s0, d0, n, err, tc.s0, tc.d0, tc.n, tc.reason)
			}
		})
	}
	// The reference's end-trim mispairs the hetero-block prefix-hit case.
	fine := MapToFine(nil, bids(9), 2, -1)
	if ref := EndTrim(bids(1, 2, 3), len(fine)); slices.Equal(ref, bids(3)) {
		t.Fatal("the reference end-trim unexpectedly pairs correctly; the test above would not show a difference")
	}
}

func TestAlignRejectsBadStarts(t *testing.T) {
	g := attnGroup(t, 16, 16, 32, 32)
	for _, tc := range []struct {
		name     string
		src, dst Span
		tokens   int
		want     string
	}{
		{"src start not a multiple of its logical block", Span{Start: 8, IDs: bids(1)}, Span{IDs: bids(1)}, 0, "src start = 8, want a multiple of the logical block size 16"},
		{"negative dst start", Span{IDs: bids(1)}, Span{Start: -32, IDs: bids(1)}, 0, "dst start = -32"},
		{"dst start not a multiple of D's block", Span{IDs: bids(1)}, Span{Start: 16, IDs: bids(1)}, 0, "dst start = 16, want a multiple of the logical block size 32"},
		{"negative tokens", Span{IDs: bids(1)}, Span{IDs: bids(1)}, -5, "tokens = -5"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := g.Align(tc.src, tc.dst, tc.tokens)
			if !errors.Is(err, ErrInvalidBlocks) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Align = %v, want ErrInvalidBlocks containing %q", err, tc.want)
			}
		})
	}
}

func TestUnitBlock(t *testing.T) {
	// Logical ids [5, 9], 2 kernel blocks per logical block, 2 units per
	// kernel block: units 0..7.
	want := [][2]int{{10, 0}, {10, 1}, {11, 0}, {11, 1}, {18, 0}, {18, 1}, {19, 0}, {19, 1}}
	for u, w := range want {
		k, unit := UnitBlock(bids(5, 9), u, 2, 2)
		if int(k) != w[0] || unit != w[1] {
			t.Fatalf("UnitBlock(unit %d) = %d, %d, want %d, %d", u, k, unit, w[0], w[1])
		}
	}
}

func TestTailStart(t *testing.T) {
	for _, tc := range []struct{ tokens, bs, n, want int }{
		{70, 16, 2, 48}, {64, 16, 4, 0}, {65, 16, 1, 64}, {0, 16, 3, 0},
	} {
		if got := TailStart(tc.tokens, tc.bs, tc.n); got != tc.want {
			t.Errorf("TailStart(%d, %d, %d) = %d, want %d", tc.tokens, tc.bs, tc.n, got, tc.want)
		}
	}
}
