package topology

import (
	"errors"
	"fmt"
	"slices"
	"testing"
)

func bids(v ...int) []BlockID {
	out := make([]BlockID, len(v))
	for i, x := range v {
		out[i] = BlockID(x)
	}
	return out
}

// sameIDs treats nil and empty as equal.
func sameIDs(a, b []BlockID) bool { return len(a) == 0 && len(b) == 0 || slices.Equal(a, b) }

func TestBlockSizeRatio(t *testing.T) {
	for _, tc := range []struct {
		name                     string
		src, dst                 int
		unit, srcUnits, dstUnits int
		wantIs                   error
		wantMsg                  []string
	}{
		{name: "equal block sizes", src: 16, dst: 16, unit: 16, srcUnits: 1, dstUnits: 1},
		{name: "P blocks divide D blocks (the reference's bsr = 4)", src: 16, dst: 64, unit: 16, srcUnits: 1, dstUnits: 4},
		{name: "P blocks a multiple of D blocks (bsr < 1, exact in kvxfer)", src: 64, dst: 16, unit: 16, srcUnits: 4, dstUnits: 1},
		{name: "one-token blocks against 16", src: 1, dst: 16, unit: 1, srcUnits: 1, dstUnits: 16},
		{name: "neither divides: error names both sizes", src: 16, dst: 24, wantIs: ErrIncompatible, wantMsg: []string{"src = 16", "dst = 24"}},
		{name: "neither divides the other way", src: 48, dst: 32, wantIs: ErrIncompatible, wantMsg: []string{"src = 48", "dst = 32"}},
		{name: "zero src size", src: 0, dst: 16, wantIs: ErrInvalidLayout, wantMsg: []string{"src = 0", "dst = 16"}},
		{name: "negative dst size", src: 16, dst: -16, wantIs: ErrInvalidLayout, wantMsg: []string{"src = 16", "dst = -16"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			u, s, d, err := BlockSizeRatio(tc.src, tc.dst)
			call := fmt.Sprintf("BlockSizeRatio(%d, %d)", tc.src, tc.dst)
			if tc.wantIs != nil {
				wantErr(t, call, err, tc.wantIs, tc.wantMsg...)
				return
			}
			if err != nil || u != tc.unit || s != tc.srcUnits || d != tc.dstUnits {
				t.Fatalf("%s = %d, %d, %d, %v, want %d, %d, %d", call, u, s, d, err, tc.unit, tc.srcUnits, tc.dstUnits)
			}
		})
	}
}

func TestExpandKernel(t *testing.T) {
	for _, tc := range []struct {
		name string
		ids  []BlockID
		ppl  int
		want []BlockID
	}{
		{"logical to kernel: b becomes b·ppl .. b·ppl+ppl-1", bids(3, 7), 2, bids(6, 7, 14, 15)},
		{"four kernel blocks per logical block", bids(0, 2), 4, bids(0, 1, 2, 3, 8, 9, 10, 11)},
		{"ppl 1 (Mamba groups are never expanded)", bids(3, 7), 1, bids(3, 7)},
		{"empty list", nil, 2, nil},
		{"ppl 0 expands to nothing", bids(1), 0, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := ExpandKernel(bids(99), tc.ids, tc.ppl)
			if want := append(bids(99), tc.want...); !slices.Equal(got, want) {
				t.Fatalf("ExpandKernel([99], %v, %d) = %v, want %v", tc.ids, tc.ppl, got, want)
			}
		})
	}
}

func TestMapToFine(t *testing.T) {
	for _, tc := range []struct {
		name     string
		ids      []BlockID
		r, limit int
		want     []BlockID
	}{
		{"get_mapped_blocks: b becomes b·r .. b·r+r-1", bids(2, 5), 4, -1, bids(8, 9, 10, 11, 20, 21, 22, 23)},
		{"truncated to the remote count (last block partly filled)", bids(2, 5), 4, 6, bids(8, 9, 10, 11, 20, 21)},
		{"remote count 0 is a full prefix hit: empty", bids(2, 5), 4, 0, nil},
		{"remote count past the fine list keeps it all", bids(1), 2, 9, bids(2, 3)},
		{"r 1 is the identity", bids(4, 0, 7), 1, -1, bids(4, 0, 7)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := MapToFine(nil, tc.ids, tc.r, tc.limit)
			if !sameIDs(got, tc.want) {
				t.Fatalf("MapToFine(%v, %d, %d) = %v, want %v", tc.ids, tc.r, tc.limit, got, tc.want)
			}
		})
	}
}

func TestEndTrim(t *testing.T) {
	for _, tc := range []struct {
		name string
		ids  []BlockID
		n    int
		want []BlockID
	}{
		{"prefix-hit end-trim keeps P's tail (SPEC §12 item 40)", bids(10, 11, 12, 13, 14), 2, bids(13, 14)},
		{"zero count is empty, not everything (SPEC §14)", bids(10, 11, 12), 0, nil},
		{"negative count is empty", bids(10, 11, 12), -1, nil},
		{"count equal to the length keeps all", bids(10, 11), 2, bids(10, 11)},
		{"count past the length keeps all", bids(10, 11), 5, bids(10, 11)},
		{"empty list", nil, 3, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := EndTrim(tc.ids, tc.n); !sameIDs(got, tc.want) {
				t.Fatalf("EndTrim(%v, %d) = %v, want %v", tc.ids, tc.n, got, tc.want)
			}
		})
	}
}

func TestWindowBlocks(t *testing.T) {
	for _, tc := range []struct {
		name              string
		window, blockSize int
		want              int
	}{
		{"cdiv(window, block)+1 with a partial block", 40, 16, 4},
		{"window an exact multiple of the block still adds one", 32, 16, 3},
		{"window of one block", 16, 16, 2},
		{"one-token window", 1, 16, 2},
		{"long window", 4096, 16, 257},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := WindowBlocks(tc.window, tc.blockSize); got != tc.want {
				t.Fatalf("WindowBlocks(%d, %d) = %d, want %d", tc.window, tc.blockSize, got, tc.want)
			}
		})
	}
}

func TestClipWindow(t *testing.T) {
	for _, tc := range []struct {
		name              string
		ids               []BlockID
		window, blockSize int
		want              []BlockID
		dropped           int
	}{
		{"keeps the last cdiv(window, block)+1 blocks", bids(1, 2, 3, 4, 5, 6), 40, 16, bids(3, 4, 5, 6), 2},
		{"exact multiple window keeps window/block+1", bids(1, 2, 3, 4, 5, 6), 32, 16, bids(4, 5, 6), 3},
		{"list as long as the window is unchanged", bids(1, 2, 3, 4), 40, 16, bids(1, 2, 3, 4), 0},
		{"list shorter than the window is unchanged", bids(1, 2), 40, 16, bids(1, 2), 0},
		{"empty list", nil, 40, 16, nil, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, dropped := ClipWindow(tc.ids, tc.window, tc.blockSize)
			if !sameIDs(got, tc.want) || dropped != tc.dropped {
				t.Fatalf("ClipWindow(%v, %d, %d) = %v, %d, want %v, %d", tc.ids, tc.window, tc.blockSize, got, dropped, tc.want, tc.dropped)
			}
		})
	}
}

func TestClipMamba(t *testing.T) {
	for _, tc := range []struct {
		name       string
		ids        []BlockID
		specBlocks int
		keepAll    bool
		want       []BlockID
	}{
		{"keeps only the last block", bids(1, 2, 3), 0, false, bids(3)},
		{"drops min(spec, len-1) speculative tail blocks first", bids(1, 2, 3, 4), 2, false, bids(2)},
		{"never empties the list", bids(1, 2), 5, false, bids(1)},
		{"a single block stays", bids(7), 3, false, bids(7)},
		{"cache mode all keeps every non-speculative block", bids(1, 2, 3, 4), 1, true, bids(1, 2, 3)},
		{"cache mode all without speculation keeps all", bids(1, 2, 3), 0, true, bids(1, 2, 3)},
		{"negative speculative count drops nothing", bids(1, 2, 3), -2, true, bids(1, 2, 3)},
		{"empty list stays empty", nil, 2, false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := ClipMamba(tc.ids, tc.specBlocks, tc.keepAll); !sameIDs(got, tc.want) {
				t.Fatalf("ClipMamba(%v, %d, %v) = %v, want %v", tc.ids, tc.specBlocks, tc.keepAll, got, tc.want)
			}
		})
	}
}

func TestClip(t *testing.T) {
	for _, tc := range []struct {
		name             string
		g                Group
		ids              []BlockID
		spec             int
		clipSSM, keepAll bool
		want             []BlockID
		dropped          int
	}{
		{"sliding-window group keeps its window", Group{Kind: KindSlidingWindow, Window: 16}, bids(1, 2, 3, 4), 0, true, false, bids(3, 4), 2},
		{"Mamba group with clip_ssm keeps the last state block", Group{Kind: KindMamba}, bids(1, 2, 3), 0, true, false, bids(3), 0},
		{"Mamba group with clip_ssm drops speculative blocks", Group{Kind: KindMamba}, bids(1, 2, 3), 1, true, true, bids(1, 2), 0},
		{"Mamba group without clip_ssm is unchanged (host-save path)", Group{Kind: KindMamba}, bids(1, 2, 3), 1, false, false, bids(1, 2, 3), 0},
		{"full-attention group is unchanged", Group{Kind: KindFullAttention}, bids(1, 2, 3), 1, true, false, bids(1, 2, 3), 0},
		{"MLA group is unchanged", Group{Kind: KindMLA}, bids(1, 2, 3), 1, true, false, bids(1, 2, 3), 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, dropped := Clip(tc.g, tc.ids, 16, tc.spec, tc.clipSSM, tc.keepAll)
			if !sameIDs(got, tc.want) || dropped != tc.dropped {
				t.Fatalf("Clip(%v, %v, 16, %d, %v, %v) = %v, %d, want %v, %d", tc.g.Kind, tc.ids, tc.spec, tc.clipSSM, tc.keepAll, got, dropped, tc.want, tc.dropped)
			}
		})
	}
}

func TestTrimSSM(t *testing.T) {
	for _, tc := range []struct {
		name      string
		src, dst  int
		s0, d0, n int
		wantMsg   []string
	}{
		{name: "equal counts pair positionally", src: 2, dst: 2, n: 2},
		{name: "both empty", src: 0, dst: 0, n: 0},
		{name: "longer P keeps its tail", src: 3, dst: 2, s0: 1, n: 2},
		{name: "longer P against empty D pairs nothing", src: 1, dst: 0, s0: 1, n: 0},
		{name: "longer D loses its tail", src: 2, dst: 3, n: 2},
		{name: "counts differing by more than one are an error", src: 1, dst: 3, wantMsg: []string{"src = 1", "dst = 3"}},
		{name: "P longer by two is an error", src: 5, dst: 3, wantMsg: []string{"src = 5", "dst = 3"}},
		{name: "negative count is an error", src: -1, dst: 0, wantMsg: []string{"src = -1", "dst = 0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s0, d0, n, err := TrimSSM(tc.src, tc.dst)
			call := fmt.Sprintf("TrimSSM(%d, %d)", tc.src, tc.dst)
			if tc.wantMsg != nil {
				wantErr(t, call, err, ErrInvalidBlocks, tc.wantMsg...)
				return
			}
			if err != nil || s0 != tc.s0 || d0 != tc.d0 || n != tc.n {
				t.Fatalf("%s = %d, %d, %d, %v, want %d, %d, %d", call, s0, d0, n, err, tc.s0, tc.d0, tc.n)
			}
		})
	}
}

func TestTailStart(t *testing.T) {
	for _, tc := range []struct {
		name          string
		tokens, bs, n int
		want          int
		reason        string
	}{
		{"last 2 of 5 blocks for 70 tokens", 70, 16, 2, 48, ""},
		{"all blocks start at 0", 64, 16, 4, 0, ""},
		{"one block holding only the last token", 65, 16, 1, 64, ""},
		{"no tokens", 0, 16, 3, 0, ""},
		{"zero block size", 10, 0, 1, 0, ""},
		{"more blocks than the tokens fill starts before 0", 10, 16, 3, -32, "Align then rejects the negative start"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := TailStart(tc.tokens, tc.bs, tc.n); got != tc.want {
				t.Fatalf("TailStart(%d, %d, %d) = %d, want %d (%s)", tc.tokens, tc.bs, tc.n, got, tc.want, tc.reason)
			}
		})
	}
}

// attnGroup returns the GroupPlan of one full-attention group with the
// given logical and kernel block sizes on each side.
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
		{name: "empty P list pairs nothing", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{}, dst: Span{IDs: bids(1, 2)}, tokens: 32, n: 0},
		{name: "hetero block size with prefix hit and partial last block", sL: 16, sK: 16, dL: 32, dK: 32,
			src: Span{IDs: bids(10, 11, 12)}, dst: Span{Start: 32, IDs: bids(9)}, tokens: 40, s0: 2, d0: 0, n: 1,
			reason: "tokens 32..47 are P block 2; the reference's end-trim pairs P blocks 1 and 2 with D's two halves"},
		{name: "hetero block size (P larger) with a prefix hit", sL: 32, sK: 32, dL: 16, dK: 16,
			src: Span{IDs: bids(10, 11)}, dst: Span{Start: 16, IDs: bids(5, 6)}, tokens: 40, s0: 1, d0: 0, n: 2,
			reason: "D holds tokens 16..47: the second half of P block 10 and the first half of P block 11"},
		{name: "D blocks larger: D's fine list truncated to P's count", sL: 16, sK: 16, dL: 64, dK: 64,
			src: Span{IDs: bids(1, 2, 3)}, dst: Span{IDs: bids(4)}, tokens: 40, n: 3},
		{name: "P blocks larger: P's last block truncated to D's count", sL: 64, sK: 64, dL: 16, dK: 16,
			src: Span{IDs: bids(1)}, dst: Span{IDs: bids(4, 5, 6)}, tokens: 40, n: 3},
		{name: "tokens bound the last unit", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2, 3)}, dst: Span{IDs: bids(4, 5, 6)}, tokens: 17, n: 2},
		{name: "tokens 0 means no bound", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2, 3)}, dst: Span{IDs: bids(4, 5, 6)}, tokens: 0, n: 3},
		{name: "FA groups with different ppl and no prefix hit front-keep min(d, p)", sL: 32, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2)}, dst: Span{IDs: bids(4, 5, 6)}, tokens: 40, n: 3,
			reason: "P has 4 kernel blocks, D 3: the reference keeps the first 3 of each"},
		{name: "logical 32 with kernel 16 counts kernel units", sL: 32, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1, 2)}, dst: Span{Start: 16, IDs: bids(4, 5, 6)}, tokens: 64, s0: 1, n: 3},
		{name: "clipped sliding window starts later on P", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{Start: 32, IDs: bids(3, 4)}, dst: Span{IDs: bids(7, 8, 9, 10)}, tokens: 64, d0: 2, n: 2},
		{name: "disjoint token ranges pair nothing", sL: 16, sK: 16, dL: 16, dK: 16,
			src: Span{IDs: bids(1)}, dst: Span{Start: 32, IDs: bids(2)}, tokens: 64, n: 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := attnGroup(t, tc.sL, tc.sK, tc.dL, tc.dK)
			s0, d0, n, err := g.Align(tc.src, tc.dst, tc.tokens)
			if err != nil || s0 != tc.s0 || d0 != tc.d0 || n != tc.n {
				t.Fatalf("Align(%+v, %+v, %d) = %d, %d, %d, %v, want %d, %d, %d (%s)", tc.src, tc.dst, tc.tokens, s0, d0, n, err, tc.s0, tc.d0, tc.n, tc.reason)
			}
		})
	}
}

// TestAlignFixesReferenceMispairing spells out the reference's pairing for
// the hetero block size prefix-hit case (P block 16, D block 32, 40
// tokens, D hit 32) and shows Align pairs the right tokens instead.
func TestAlignFixesReferenceMispairing(t *testing.T) {
	p := bids(10, 11, 12) // tokens 0..15, 16..31, 32..47
	d := bids(9)          // tokens 32..63 after a 32-token hit
	// Reference: D's fine view [18, 19], P end-trimmed to its length.
	fine := MapToFine(nil, d, 2, len(p))
	ref := EndTrim(p, len(fine))
	if !slices.Equal(fine, bids(18, 19)) || !slices.Equal(ref, bids(11, 12)) {
		t.Fatalf("reference pairing = P %v -> D fine %v, want P [11 12] -> D fine [18 19]", ref, fine)
	}
	g := attnGroup(t, 16, 16, 32, 32)
	s0, d0, n, err := g.Align(Span{IDs: p}, Span{Start: 32, IDs: d}, 40)
	if err != nil || s0 != 2 || d0 != 0 || n != 1 {
		t.Fatalf("Align = %d, %d, %d, %v, want 2, 0, 1", s0, d0, n, err)
	}
	sk, su := UnitBlock(p, s0, g.SrcPPL, g.SrcUnits)
	dk, du := UnitBlock(d, d0, g.DstPPL, g.DstUnits)
	if sk != 12 || su != 0 || dk != 9 || du != 0 {
		t.Fatalf("pair = P block %d unit %d -> D block %d unit %d, want P block 12 -> D block 9 unit 0 (fine 18)", sk, su, dk, du)
	}
}

// TestAlignEqualsEndTrimWhenTailsAlign sweeps token counts and prefix hits
// with equal block sizes (ppl 1 and 2): when both lists end at the
// request's last block (D's start = TailStart), Align pairs exactly the
// kernel blocks the reference's end-trim pairs.
func TestAlignEqualsEndTrimWhenTailsAlign(t *testing.T) {
	for _, geo := range []struct{ logical, kernel int }{{16, 16}, {32, 16}} {
		g := attnGroup(t, geo.logical, geo.kernel, geo.logical, geo.kernel)
		ppl := geo.logical / geo.kernel
		maxTokens := 100
		if testing.Short() {
			maxTokens = 40
		}
		for tokens := 1; tokens <= maxTokens; tokens++ {
			blocks := (tokens + geo.logical - 1) / geo.logical
			for hit := 0; hit <= blocks; hit++ {
				var p, d []BlockID
				for i := 0; i < blocks; i++ {
					p = append(p, BlockID(100+i))
				}
				for i := hit; i < blocks; i++ {
					d = append(d, BlockID(500+i))
				}
				dst := Span{Start: TailStart(tokens, geo.logical, len(d)), IDs: d}
				pk, dk := ExpandKernel(nil, p, ppl), ExpandKernel(nil, d, ppl)
				refP := EndTrim(pk, len(dk))
				s0, d0, n, err := g.Align(Span{IDs: p}, dst, 0)
				if err != nil || n != len(refP) {
					t.Fatalf("block %d tokens %d hit %d: Align = %d, %d, %d, %v, want %d pairs", geo.logical, tokens, hit, s0, d0, n, err, len(refP))
				}
				for k := 0; k < n; k++ {
					sb, _ := UnitBlock(p, s0+k, g.SrcPPL, g.SrcUnits)
					db, _ := UnitBlock(d, d0+k, g.DstPPL, g.DstUnits)
					if sb != refP[k] || db != dk[k] {
						t.Fatalf("block %d tokens %d hit %d pair %d: P %d -> D %d, reference P %d -> D %d", geo.logical, tokens, hit, k, sb, db, refP[k], dk[k])
					}
				}
				// With the token bound, Align keeps the reference's leading
				// pairs up to the unit holding the last token.
				_, _, nb, err := g.Align(Span{IDs: p}, dst, tokens)
				units := (tokens + geo.kernel - 1) / geo.kernel
				if want := max(0, units-hit*ppl); err != nil || nb != want {
					t.Fatalf("block %d tokens %d hit %d: bounded Align n = %d, %v, want %d", geo.logical, tokens, hit, nb, err, want)
				}
			}
		}
	}
}

func TestAlignMamba(t *testing.T) {
	p, err := NewPlan(mambaLayout(1, 0, []int64{64}, 256), mambaLayout(1, 0, []int64{64}, 256), PlanOptions{})
	if err != nil {
		t.Fatal(err)
	}
	g := &p.Groups[0]
	for _, tc := range []struct {
		name      string
		src, dst  Span
		s0, d0, n int
		wantErr   bool
	}{
		{name: "Mamba pairs by TrimSSM: equal counts", src: Span{IDs: bids(1, 2)}, dst: Span{IDs: bids(3, 4)}, n: 2},
		{name: "Mamba pairs by TrimSSM: P longer keeps its tail", src: Span{IDs: bids(1, 2)}, dst: Span{IDs: bids(3)}, s0: 1, n: 1},
		{name: "Mamba ignores token starts", src: Span{Start: 7, IDs: bids(1)}, dst: Span{Start: 999, IDs: bids(3)}, n: 1},
		{name: "Mamba counts differing by two are an error", src: Span{IDs: bids(1, 2, 3)}, dst: Span{IDs: bids(3)}, wantErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s0, d0, n, err := g.Align(tc.src, tc.dst, 0)
			if tc.wantErr {
				wantErr(t, "Align", err, ErrInvalidBlocks, "src = 3", "dst = 1")
				return
			}
			if err != nil || s0 != tc.s0 || d0 != tc.d0 || n != tc.n {
				t.Fatalf("Align = %d, %d, %d, %v, want %d, %d, %d", s0, d0, n, err, tc.s0, tc.d0, tc.n)
			}
		})
	}
}

func TestAlignRejectsBadInput(t *testing.T) {
	g := attnGroup(t, 16, 16, 32, 32)
	for _, tc := range []struct {
		name     string
		src, dst Span
		tokens   int
		want     []string
	}{
		{"src start not a multiple of its logical block", Span{Start: 8, IDs: bids(1)}, Span{IDs: bids(1)}, 0,
			[]string{"src start = 8", "multiple of the logical block size 16"}},
		{"negative src start", Span{Start: -16, IDs: bids(1)}, Span{IDs: bids(1)}, 0, []string{"src start = -16"}},
		{"negative dst start", Span{IDs: bids(1)}, Span{Start: -32, IDs: bids(1)}, 0, []string{"dst start = -32"}},
		{"dst start not a multiple of D's block", Span{IDs: bids(1)}, Span{Start: 16, IDs: bids(1)}, 0,
			[]string{"dst start = 16", "multiple of the logical block size 32"}},
		{"dst start from TailStart past the tokens", Span{IDs: bids(1)}, Span{Start: TailStart(10, 32, 2), IDs: bids(1, 2)}, 10,
			[]string{"dst start = -32"}},
		{"start past the bound", Span{Start: 1 << 41, IDs: bids(1)}, Span{IDs: bids(1)}, 0, []string{"src start = 2199023255552"}},
		{"negative tokens", Span{IDs: bids(1)}, Span{IDs: bids(1)}, -5, []string{"tokens = -5"}},
		{"tokens past the bound", Span{IDs: bids(1)}, Span{IDs: bids(1)}, 1 << 41, []string{"tokens = 2199023255552"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, _, err := g.Align(tc.src, tc.dst, tc.tokens)
			wantErr(t, fmt.Sprintf("Align(%+v, %+v, %d)", tc.src, tc.dst, tc.tokens), err, ErrInvalidBlocks, tc.want...)
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
			t.Fatalf("UnitBlock([5 9], %d, 2, 2) = %d, %d, want %d, %d", u, k, unit, w[0], w[1])
		}
	}
}

// TestWindowInvalidSizesKeepEverything: a window or block size that is not
// positive never panics and clips nothing.
func TestWindowInvalidSizesKeepEverything(t *testing.T) {
	for _, tc := range []struct{ window, block int }{{40, 0}, {-17, 16}, {0, 16}, {40, -16}} {
		kept, dropped := ClipWindow(bids(1, 2, 3), tc.window, tc.block)
		if len(kept) != 3 || dropped != 0 {
			t.Errorf("ClipWindow(window %d, block %d) = %v, %d, want all ids kept", tc.window, tc.block, kept, dropped)
		}
	}
}

// Covers refuses a source list that holds fewer of the tokens the source
// says it holds than the destination's list takes (its blocks past the
// short list would be taken as moved), and passes whatever Align pairs in
// full.
func TestCovers(t *testing.T) {
	for _, tc := range []struct {
		name           string
		sL, sK, dL, dK int
		src, dst       Span
		tokens         int
		ok             bool
	}{
		{"both lists hold the tokens", 16, 16, 16, 16, Span{IDs: bids(1, 2, 3)}, Span{IDs: bids(4, 5, 6)}, 40, true},
		{"the source's list is short of its tokens", 16, 16, 16, 16, Span{IDs: bids(1)}, Span{IDs: bids(4, 5, 6)}, 40, false},
		{"one block short", 16, 16, 16, 16, Span{IDs: bids(1, 2)}, Span{IDs: bids(4, 5, 6)}, 40, false},
		{"tokens 0: a source short of the destination's whole list", 16, 16, 16, 16, Span{IDs: bids(1)}, Span{IDs: bids(4, 5, 6)}, 0, false},
		{"tokens 0: a source one block short", 16, 16, 16, 16, Span{IDs: bids(1, 2)}, Span{IDs: bids(4, 5, 6)}, 0, false},
		{"tokens 0: a source holding the destination's whole list", 16, 16, 16, 16, Span{IDs: bids(1, 2, 3)}, Span{IDs: bids(4, 5, 6)}, 0, true},
		{"tokens 0: a prefix hit on the destination", 16, 16, 16, 16, Span{IDs: bids(1, 2, 3)}, Span{Start: 16, IDs: bids(5, 6)}, 0, true},
		{"a prefix hit on the destination", 16, 16, 16, 16, Span{IDs: bids(1, 2, 3)}, Span{Start: 16, IDs: bids(5, 6)}, 40, true},
		{"the source's list starts after the destination's", 16, 16, 16, 16, Span{Start: 16, IDs: bids(2, 3)}, Span{IDs: bids(4, 5, 6)}, 40, false},
		{"the destination's list past the tokens", 16, 16, 16, 16, Span{IDs: bids(1, 2, 3)}, Span{IDs: bids(4, 5, 6, 7)}, 40, true},
		{"source blocks larger", 64, 64, 16, 16, Span{IDs: bids(1)}, Span{IDs: bids(4, 5, 6)}, 40, true},
		{"destination blocks larger", 16, 16, 64, 64, Span{IDs: bids(1, 2, 3)}, Span{IDs: bids(4)}, 40, true},
		{"destination blocks larger, source short", 16, 16, 64, 64, Span{IDs: bids(1, 2)}, Span{IDs: bids(4)}, 40, false},
		{"nothing the destination takes", 16, 16, 16, 16, Span{IDs: bids(1)}, Span{Start: 48, IDs: bids(4)}, 40, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := attnGroup(t, tc.sL, tc.sK, tc.dL, tc.dK)
			err := g.Covers(tc.src, tc.dst, tc.tokens)
			if (err == nil) != tc.ok || err != nil && !errors.Is(err, ErrInvalidBlocks) {
				t.Fatalf("Covers(%+v, %+v, %d) = %v, want ok %v", tc.src, tc.dst, tc.tokens, err, tc.ok)
			}
		})
	}
}
