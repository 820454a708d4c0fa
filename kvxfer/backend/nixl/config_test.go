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

// A VRAM agent of the UCX plugin gets num_threads=GPUThreads unless its
// parameters set one; host-memory agents and other plugins get exactly
// what they asked for; the caller's map is never changed.
func TestGPUDefaults(t *testing.T) {
	mine := map[string]string{"ucx_error_handling_mode": "none"}
	got := withDefaults("UCX", mine, true)
	if got["num_threads"] != GPUThreads || got["ucx_error_handling_mode"] != "none" || len(mine) != 1 {
		t.Fatalf("VRAM agent: %v (caller's map now %v), want num_threads=%s added to a copy", got, mine, GPUThreads)
	}
	if got := withDefaults("UCX", map[string]string{"num_threads": "8"}, true); got["num_threads"] != "8" {
		t.Fatalf("num_threads set by the caller became %q", got["num_threads"])
	}
	if got := withDefaults("UCX", mine, false); len(got) != 1 {
		t.Fatalf("a host-memory agent's parameters became %v", got)
	}
	if got := withDefaults("POSIX", nil, true); got != nil {
		t.Fatalf("another plugin's parameters became %v", got)
	}
}
