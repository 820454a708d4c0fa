package leakcheck

import (
	"runtime"
	"strings"
	"testing"
	"time"
)

// recorder is a testing.TB that keeps what Errorf said.
type recorder struct {
	testing.TB
	msgs []string
}

func (r *recorder) Helper() {}
func (r *recorder) Errorf(format string, args ...any) {
	r.msgs = append(r.msgs, format)
}

func TestCheck(t *testing.T) {
	before := runtime.NumGoroutine()
	stop := make(chan struct{})
	go func() { <-stop }()
	r := &recorder{TB: t}
	Check(r, before, 0, 50*time.Millisecond)
	if len(r.msgs) != 1 || !strings.Contains(r.msgs[0], "goroutines left") {
		t.Errorf("a goroutine left running was not reported: %q", r.msgs)
	}
	close(stop)
	r = &recorder{TB: t}
	Check(r, before, 0, 5*time.Second) // it ends by itself: the check waits for it
	if len(r.msgs) != 0 {
		t.Errorf("a goroutine that ended was reported: %q", r.msgs)
	}
}
