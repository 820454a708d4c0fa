// Package lograte bounds how fast one kind of log line is written: a
// slog.Handler that passes at most Burst records of each message (its
// level and text) every Window, drops the others, and says how many it
// dropped on the next record of that message it passes ("suppressed").
//
// Lines that a peer or an engine can make (a refused connection, a
// malformed message) would otherwise come as fast as they can send:
// whatever they cause is counted in metrics, and the log keeps the first
// few of each kind.
package lograte

import (
	"context"
	"log/slog"
	"sync"
	"time"
)

// Defaults of New.
const (
	Burst  = 10
	Window = 10 * time.Second
	// MaxMessages bounds the messages tracked; records of others (a
	// program logs constant messages: only a bug gets there) share one
	// count.
	MaxMessages = 4096
)

// Handler is a rate-limiting slog.Handler (see the package).
type Handler struct {
	next slog.Handler
	st   *state
}

type key struct {
	level slog.Level
	msg   string
}

type bucket struct {
	start   time.Time
	n       int
	dropped uint64
}

type state struct {
	mu     sync.Mutex
	burst  int
	window time.Duration
	now    func() time.Time
	m      map[key]*bucket
}

// New returns a Handler over next with Burst records of a message per
// Window.
func New(next slog.Handler) *Handler { return NewWith(next, Burst, Window, nil) }

// NewWith returns a Handler over next passing burst records of a message
// every window, on clock now (nil: time.Now).
func NewWith(next slog.Handler, burst int, window time.Duration, now func() time.Time) *Handler {
	if now == nil {
		now = time.Now
	}
	return &Handler{next: next, st: &state{burst: max(burst, 1), window: window, now: now, m: map[key]*bucket{}}}
}

// Logger is log with its handler rate-limited (New), unless it is already.
func Logger(log *slog.Logger) *slog.Logger {
	if _, ok := log.Handler().(*Handler); ok {
		return log
	}
	return slog.New(New(log.Handler()))
}

// allow says whether a record of k passes now, and how many of k were
// dropped since the last that passed.
func (s *state) allow(k key) (bool, uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	b := s.m[k]
	if b == nil {
		if len(s.m) >= MaxMessages {
			k = key{level: k.level, msg: "\x00other"}
			b = s.m[k]
		}
		if b == nil {
			b = &bucket{}
			s.m[k] = b
		}
	}
	if now := s.now(); now.Sub(b.start) >= s.window {
		b.start, b.n = now, 0
	}
	if b.n >= s.burst {
		b.dropped++
		return false, 0
	}
	b.n++
	d := b.dropped
	b.dropped = 0
	return true, d
}

// Enabled implements slog.Handler.
func (h *Handler) Enabled(ctx context.Context, l slog.Level) bool { return h.next.Enabled(ctx, l) }

// Handle implements slog.Handler: r is passed on, or dropped and counted.
func (h *Handler) Handle(ctx context.Context, r slog.Record) error {
	ok, dropped := h.st.allow(key{r.Level, r.Message})
	if !ok {
		return nil
	}
	if dropped > 0 {
		r = r.Clone()
		r.AddAttrs(slog.Uint64("suppressed", dropped))
	}
	return h.next.Handle(ctx, r)
}

// WithAttrs implements slog.Handler; the limits are shared with h.
func (h *Handler) WithAttrs(as []slog.Attr) slog.Handler {
	return &Handler{next: h.next.WithAttrs(as), st: h.st}
}

// WithGroup implements slog.Handler; the limits are shared with h.
func (h *Handler) WithGroup(name string) slog.Handler {
	return &Handler{next: h.next.WithGroup(name), st: h.st}
}
