package registry

import (
	"testing"
	"time"
)

// A retry waits between half its backoff and all of it, drawn anew each
// time: daemons cut off from etcd together do not retry in lockstep.
func TestJitteredRetries(t *testing.T) {
	for _, d := range []time.Duration{100 * time.Millisecond, 800 * time.Millisecond, maxBackoff} {
		seen := map[time.Duration]bool{}
		for range 200 {
			w := jittered(d)
			if w < d/2 || w > d {
				t.Fatalf("jittered(%v) = %v, want within [%v, %v]", d, w, d/2, d)
			}
			seen[w] = true
		}
		if len(seen) < 100 {
			t.Errorf("jittered(%v): %d distinct waits in 200, want them spread", d, len(seen))
		}
	}
	if w := jittered(0); w != 0 {
		t.Errorf("jittered(0) = %v", w)
	}
}
