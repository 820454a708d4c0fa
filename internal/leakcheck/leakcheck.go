// Package leakcheck is the tests' goroutine-leak check: count the
// goroutines before the code under test starts and, once it ended, wait
// (bounded) for the count to come back down.
package leakcheck

import (
	"runtime"
	"testing"
	"time"
)

// Check waits up to wait for the number of goroutines to drop to
// before+slack (slack: goroutines the runtime or the test framework may
// still be winding down), and fails t with every goroutine's stack if it
// does not.
func Check(t testing.TB, before, slack int, wait time.Duration) {
	t.Helper()
	deadline := time.Now().Add(wait)
	for runtime.NumGoroutine() > before+slack && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	if n := runtime.NumGoroutine(); n > before+slack {
		buf := make([]byte, 1<<20)
		t.Errorf("%d goroutines left (before: %d):\n%s", n, before, buf[:runtime.Stack(buf, true)])
	}
}
