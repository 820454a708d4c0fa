package kvxfer

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/nixl"
)

// NixlConfig.ProgressDelay: zero is the default pause, negative a spin,
// anything else as given.
func TestNixlProgressDelay(t *testing.T) {
	for d, want := range map[time.Duration]time.Duration{0: nixl.DefaultProgressDelay, -1: 0, -time.Second: 0,
		250 * time.Microsecond: 250 * time.Microsecond} {
		c := NixlConfig{ProgressDelay: d}
		if got := c.progressDelay(); got != want {
			t.Errorf("ProgressDelay %v: %v, want %v", d, got, want)
		}
	}
}
