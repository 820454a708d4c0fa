package server_test

import (
	"bytes"
	"context"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// lockedBuffer is a log sink safe for the server's goroutines.
type lockedBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (l *lockedBuffer) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.b.Write(p)
}

func (l *lockedBuffer) lines(prefix string) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, s := range strings.Split(l.b.String(), "\n") {
		if strings.Contains(s, prefix) {
			out = append(out, s)
		}
	}
	return out
}

// A producer daemon's graceful drain logs (Warn) what it waits for, as a
// closing worker does: a second into it, and when -drain-timeout runs
// out, naming the engine, its rank and the requests held. Before, the
// shutdown waited up to -drain-timeout and logged nothing.
func TestDrainLogsWhatItWaitsFor(t *testing.T) {
	shmDir := t.TempDir()
	logs := &lockedBuffer{}
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.DrainTimeout = 1500 * time.Millisecond
		c.Logger = slog.New(slog.NewTextHandler(logs, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	P := attachSmall(t, d, shmDir, "P", 1)
	now := time.Now()
	// No consumer comes for p-held: it is held for its lease (an hour).
	P.step(t, &kvxfer.StepMeta{Step: 1, SchedulerClock: now, Send: []kvxfer.SendReq{{ReqID: "p-held", TransferID: "t-held",
		Blocks: []topology.Span{{IDs: []topology.BlockID{1, 2}}}, Deadline: now.Add(time.Hour)}}})
	w := d.srv.Workers()["P"][0]
	for {
		st, err := w.State()
		if err != nil {
			t.Fatal(err)
		}
		if st.Sends == 1 {
			break
		}
		if time.Since(now) > 5*time.Second {
			t.Fatal("p-held never held")
		}
		time.Sleep(5 * time.Millisecond)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	began := time.Now()
	if err := d.srv.Drain(ctx); err != nil {
		t.Fatal(err)
	}
	if took := time.Since(began); took < 1500*time.Millisecond {
		t.Fatalf("the drain took %v, want its DrainTimeout (1.5 s): p-held is held", took)
	}
	waits := logs.lines("kvxferd: a draining rank")
	if len(waits) != 2 {
		t.Fatalf("%d logs of what the drain waits for %q, want 2: past its first second and at its timeout", len(waits), waits)
	}
	for _, l := range waits {
		if !strings.Contains(l, "level=WARN") || !strings.Contains(l, "engine=P tp_rank=0 pp_rank=0") ||
			!strings.Contains(l, "producer_requests=1") || !strings.Contains(l, `p-held (transfer \"t-held\", lease ends in`) {
			t.Errorf("log %q: want a warning naming engine P rank 0 and p-held", l)
		}
	}
	if !strings.Contains(waits[0], "still waits") || !strings.Contains(waits[0], "for=1") {
		t.Errorf("first log %q, want 'still waits' after 1 s", waits[0])
	}
	if !strings.Contains(waits[1], "-drain-timeout ran out") || !strings.Contains(waits[1], "for=1.5") {
		t.Errorf("second log %q, want '-drain-timeout ran out' after 1.5 s", waits[1])
	}
}
