package nixl

import (
	"testing"
	"time"

	capi "github.com/kvxfer/kvxfer/internal/nixl"
)

// Config.ProgressDelay: zero is the default pause, negative a spin,
// anything else as given.
func TestNixlProgressDelay(t *testing.T) {
	for d, want := range map[time.Duration]time.Duration{0: capi.DefaultProgressDelay, -1: 0, -time.Second: 0,
		250 * time.Microsecond: 250 * time.Microsecond} {
		c := Config{ProgressDelay: d}
		if got := c.progressDelay(); got != want {
			t.Errorf("ProgressDelay %v: %v, want %v", d, got, want)
		}
	}
}
