package daemon

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"runtime"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

// idleEngineConn dials the engine socket and says HTTP/2's client preface
// and an empty SETTINGS frame, then nothing more: a connection that
// carries no stream. It reports whether the daemon kept it (its own
// SETTINGS came back) or closed it at once (EOF before any byte).
func idleEngineConn(t *testing.T, socket string) (net.Conn, bool) {
	t.Helper()
	c, err := net.Dial("unix", socket)
	if err != nil {
		t.Fatal(err)
	}
	_, _ = c.Write(append([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"), 0, 0, 0, 4, 0, 0, 0, 0, 0))
	_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var b [9]byte // a frame header
	_, err = io.ReadFull(c, b[:])
	var ne net.Error
	switch {
	case err == nil:
		_ = c.SetReadDeadline(time.Time{})
		return c, true
	case errors.As(err, &ne) && ne.Timeout():
		c.Close()
		t.Fatal("the daemon neither answered nor closed a new engine connection in 10 s")
	}
	c.Close()
	return nil, false
}

// Engine streams were bounded per uid and in all, not the connections
// under them: a local user could open connections to the engine socket
// that never carried a stream, each held for ever with a descriptor and
// gRPC's buffers, until the daemon ran out of descriptors and every
// engine's next connection and mapping failed (1100 idle connections of
// one uid all stayed open with the default -max-streams-per-uid 1024).
// Connections are bounded too (-max-engine-conns-per-uid,
// -max-engine-conns): one past the bound is closed at once and counted,
// the engines attached carry on, and a connection closed makes room.
func TestEngineConnsBounded(t *testing.T) {
	for _, tc := range []struct {
		name          string
		perUID, total int
		reason        string
	}{
		{"per uid", 3, 100, "engine_conns_per_uid"},
		{"in all", 100, 3, "engine_conns"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := runtime.NumGoroutine()
			c := testConfig(t)
			c.metricsListen = freePort(t)
			c.maxEngineConnsPerUID, c.maxEngineConns = tc.perUID, tc.total
			in, err := start(c, slog.New(slog.NewTextHandler(io.Discard, nil)), false)
			if err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()
			// An engine's rank attached: one connection.
			rs, closeRank, err := connectTinyRank(t, ctx, c.socket, c.shmDir, "E1")
			if err != nil {
				t.Fatal(err)
			}
			var idle []net.Conn
			for range 2 {
				conn, kept := idleEngineConn(t, c.socket)
				if !kept {
					t.Fatalf("an idle connection within the bound of 3 was closed")
				}
				idle = append(idle, conn)
			}
			for i := range 2 {
				if conn, kept := idleEngineConn(t, c.socket); kept {
					conn.Close()
					t.Fatalf("connection %d of a bound of 3 (%s) stayed open", 4+i, tc.name)
				}
			}
			if got := scrape(t, c.metricsListen, fmt.Sprintf(`kvxfer_refused_total{reason=%q}`, tc.reason)); got != 2 {
				t.Errorf(`kvxfer_refused_total{reason=%q} = %v, want 2`, tc.reason, got)
			}
			// The attached rank carries on: its stream still answers (a
			// layer it does not hold is told back as a step error).
			if err := rs.LayerSaved(1, 99); err != nil {
				t.Fatal(err)
			}
			select {
			case <-rs.StepErrors():
			case <-ctx.Done():
				t.Fatalf("the attached rank's stream no longer answers: %v", rs.Err())
			}
			// A connection closed makes room (once the daemon saw it go).
			idle[0].Close()
			deadline := time.Now().Add(10 * time.Second)
			for {
				conn, kept := idleEngineConn(t, c.socket)
				if kept {
					idle[0] = conn
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("no room for a connection 10 s after one closed")
				}
				time.Sleep(20 * time.Millisecond)
			}
			for _, conn := range idle {
				conn.Close()
			}
			closeRank()
			in.shutdown()
			http.DefaultClient.CloseIdleConnections()
			leakcheck.Check(t, before, 0, 10*time.Second)
		})
	}
}
