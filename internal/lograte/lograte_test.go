package lograte

import (
	"bytes"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"
)

// Burst records of a message pass each window; the rest are dropped and
// counted, the count said on the next that passes; other messages and
// levels have limits of their own, shared by the handler's derived
// loggers; the messages tracked are bounded.
func TestHandler(t *testing.T) {
	var buf bytes.Buffer
	now := time.Unix(0, 0)
	log := slog.New(NewWith(slog.NewTextHandler(&buf, nil), 3, time.Second, func() time.Time { return now }))
	with := log.With("peer", "p")
	for i := range 10 {
		with.Warn("refused", "i", i)
		log.Info("other")
		log.Error("refused")
	}
	lines := func(s string) int { return strings.Count(buf.String(), s) }
	if n := lines("msg=refused peer=p"); n != 3 {
		t.Errorf("%d warnings passed in a window, want 3:\n%s", n, buf.String())
	}
	if n, m := lines("msg=other"), lines("level=ERROR msg=refused"); n != 3 || m != 3 {
		t.Errorf("other message: %d, error level: %d; want 3 each (limits of their own)", n, m)
	}
	buf.Reset()
	now = now.Add(time.Second)
	with.Warn("refused", "i", 10)
	with.Warn("refused", "i", 11)
	if !strings.Contains(buf.String(), "i=10 suppressed=7") || strings.Contains(buf.String(), "i=11 suppressed") {
		t.Errorf("next window: %q, want the first line to say 7 suppressed, the next none", buf.String())
	}
	for i := range MaxMessages + 100 {
		log.Debug(fmt.Sprint("m", i)) // below the handler's level: not counted
		log.Info(fmt.Sprint("m", i))
	}
	h := log.Handler().(*Handler)
	if n := len(h.st.m); n > MaxMessages+1 {
		t.Errorf("%d messages tracked, want at most %d", n, MaxMessages+1)
	}
	if Logger(log) != log {
		t.Error("Logger wrapped a rate-limited logger again")
	}
}
