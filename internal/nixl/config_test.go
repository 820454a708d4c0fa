package nixl

import (
	"testing"
	"time"
)

func TestConfigDelayMicros(t *testing.T) {
	for d, want := range map[time.Duration]uint64{0: 0, -time.Second: 0, 999 * time.Nanosecond: 0, time.Microsecond: 1,
		DefaultProgressDelay: 100, 2500 * time.Microsecond: 2500} {
		c := Config{ProgressDelay: d}
		if got := c.delayMicros(); got != want {
			t.Errorf("ProgressDelay %v: %d µs, want %d", d, got, want)
		}
	}
}
