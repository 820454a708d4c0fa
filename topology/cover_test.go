package topology

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
)

// windowGroup is a sliding-window group plan between a source of logical
// block sL (kernel sK) and a destination of logical block dL (kernel dK).
func windowGroup(t *testing.T, window, sL, sK, dL, dK int) *GroupPlan {
	t.Helper()
	g := *attnGroup(t, sL, sK, dL, dK)
	g.Kind, g.Window = KindSlidingWindow, window
	return &g
}

// windowList is the list an engine holding tokens tokens from token hit on
// (a prefix hit: hit is on the block grid) registers for a sliding-window
// group: its blocks clipped to the window (SPEC §6).
func windowList(tokens, hit, block, window, first int) Span {
	n := 0
	if tokens > hit {
		n = (tokens - hit + block - 1) / block
	}
	ids := make([]BlockID, n)
	for i := range ids {
		ids[i] = BlockID(first + i)
	}
	kept, drop := ClipWindow(ids, window, block)
	return Span{Start: hit + drop*block, IDs: kept}
}

// A sliding-window source list must hold the window's tokens that the
// destination's list takes: the window of the next token (the Window-1
// tokens before it). Covers
// exempted window lists from the start check altogether (they start where
// their window does), so a source list short of the window at its front
// (a source that clipped too much, or lost blocks) passed: the
// destination's blocks before it kept what they held and were reported
// loaded, though the next token attends to them. Every list that both
// sides clip by the window rule still passes, over random windows, block
// sizes either way, kernel blocks, prefix hits and token counts (tokens 0
// too); a source list missing one more leading block than needed is
// refused.
func TestCoversWindow(t *testing.T) {
	// The failing case by hand: window 64, blocks of 16, 128 tokens. D's
	// clipped list holds tokens 48..127; P's only its last block.
	g := windowGroup(t, 64, 16, 16, 16, 16)
	dst := windowList(128, 0, 16, 64, 100)
	if err := g.Covers(Span{Start: 112, IDs: bids(7)}, dst, 128); err == nil || !errors.Is(err, ErrInvalidBlocks) {
		t.Errorf("Covers(P tokens 112..127 only, D %+v, 128) = %v, want ErrInvalidBlocks: the next token's window 65..127 would lack 65..111", dst, err)
	}
	// Tokens 64..127: the window and one more.
	if err := g.Covers(Span{Start: 64, IDs: bids(7, 8, 9, 10)}, dst, 128); err != nil {
		t.Errorf("Covers(P tokens 64..127, D %+v, 128) = %v, want nil", dst, err)
	}
	rng := rand.New(rand.NewPCG(3, 4))
	sizes := []int{1, 2, 4, 16, 32, 64}
	passed, refused := 0, 0
	for i := 0; i < 20000; i++ {
		sK, dK := sizes[rng.IntN(len(sizes))], sizes[rng.IntN(len(sizes))]
		if max(sK, dK)%min(sK, dK) != 0 {
			continue
		}
		sL, dL := sK*(1<<rng.IntN(3)), dK*(1<<rng.IntN(3))
		window := 1 + rng.IntN(300)
		tokens := 1 + rng.IntN(1000)
		hit := rng.IntN(tokens+1) / dL * dL
		g := windowGroup(t, window, sL, sK, dL, dK)
		src := windowList(tokens, 0, sL, window, 0)
		dst := windowList(tokens, hit, dL, window, 5000)
		for _, tk := range []int{tokens, 0} {
			if tk == 0 && src.Start+len(src.IDs)*sL < dst.Start+len(dst.IDs)*dL {
				continue // a source saying nothing of its tokens must hold dst's whole list (TestCovers)
			}
			name := fmt.Sprintf("window %d P L%d K%d D L%d K%d tokens %d (given %d) hit %d: P %+v D %+v", window, sL, sK, dL, dK, tokens, tk, hit, src, dst)
			if err := g.Covers(src, dst, tk); err != nil {
				t.Fatalf("%s: clipped lists refused: %v", name, err)
			}
			passed++
			// One leading block fewer than the window's tokens need.
			dEnd := dst.Start + len(dst.IDs)*dL
			need := dEnd - window + 1 // the next token's window
			if tk > 0 {
				need = min(tk, dEnd) - window + 1
			}
			if len(dst.IDs) == 0 || min(tk, dEnd) <= dst.Start && tk > 0 {
				continue // the destination takes nothing
			}
			short := src
			for len(short.IDs) > 0 && short.Start <= max(need, dst.Start) {
				short = Span{Start: short.Start + sL, IDs: short.IDs[1:]}
			}
			if len(short.IDs) == 0 {
				continue
			}
			if err := g.Covers(short, dst, tk); err == nil {
				t.Fatalf("%s: P list %+v (starting past token %d the window needs) accepted", name, short, max(need, dst.Start))
			}
			refused++
		}
	}
	t.Logf("%d clipped pairs passed, %d short source lists refused", passed, refused)
	if passed < 5000 || refused < 5000 {
		t.Errorf("only %d clipped pairs and %d short lists were tried", passed, refused)
	}
}

// CheckStages: a pipelined source's stages must hold dst's regions once,
// in order; each error names the stage and where it must start.
func TestCheckStages(t *testing.T) {
	stage := func(offset, n int) *Layout { return &Layout{RegionOffset: offset, Regions: make([]Region, n)} }
	dst := stage(0, 6)
	for _, tc := range []struct {
		name   string
		stages []*Layout
		want   string
	}{
		{"tiled", []*Layout{stage(0, 2), stage(2, 3), stage(5, 1)}, ""},
		{"one stage", []*Layout{stage(0, 6)}, ""},
		{"overlap", []*Layout{stage(0, 3), stage(2, 3), stage(5, 1)}, "regions 2..4 of stage pp 1 start at 2, want 3"},
		{"gap", []*Layout{stage(0, 2), stage(3, 3)}, "regions 3..5 of stage pp 1 start at 3, want 2"},
		{"first stage off zero", []*Layout{stage(1, 5)}, "stage pp 0 start at 1, want 0"},
		{"short of the end", []*Layout{stage(0, 2), stage(2, 3)}, "the 2 stages hold regions 0..4, dst has 6 regions"},
	} {
		err := CheckStages(tc.stages, dst)
		if tc.want == "" {
			if err != nil {
				t.Errorf("%s: CheckStages = %v, want nil", tc.name, err)
			}
			continue
		}
		if !errors.Is(err, ErrIncompatible) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: CheckStages = %v, want ErrIncompatible naming %q", tc.name, err, tc.want)
		}
	}
}
