// ClipWindow must not overflow or panic on extreme windows (found by fuzzing).

package topology

import (
	"math"
	"testing"
)

func TestClipWindowHugeOrNegativeWindow(t *testing.T) {
	for _, tc := range []struct {
		name   string
		window int
	}{
		{"window near MaxInt (Validate accepts it)", math.MaxInt},
		{"negative window", -100},
	} {
		t.Run(tc.name, func(t *testing.T) {
			kept, dropped := ClipWindow([]BlockID{1, 2, 3}, tc.window, 16) // panics today
			if dropped < 0 || dropped+len(kept) != 3 {
				t.Fatalf("ClipWindow([1 2 3], %d, 16) = %v, %d", tc.window, kept, dropped)
			}
		})
	}
}

func TestTPRatioRejectsHugeSizes(t *testing.T) {
	if _, err := TargetRanks(nil, 1, 1<<40, 0); err == nil {
		t.Fatal("TargetRanks(1, 1<<40) = nil error, want TP size rejected before allocating")
	}
}
