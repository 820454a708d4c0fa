//go:build !invariants

package server_test

import (
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/topology"
)

// A rank whose worker panics (ContainPanics, which the server sets) fails
// its open requests, one outcome each, then its stream ends with Internal
// naming the internal error; it is counted, and detached. The daemon and
// its other engines carry on, and nothing is left running. Built without
// -tags invariants only: with it the panic propagates instead (kvxfer's
// TestWorkerPanic checks that), and no test skips in CI.
func TestWorkerPanicEndsOnlyItsStream(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		var armed atomic.Bool
		d := startDaemonWith(t, shmDir, func(c *server.Config) {
			c.NewBackend = func(engine string, _ *topology.Layout, _ bool) (server.Backend, error) {
				b, err := tcp.New(tcp.Config{Logger: quiet, Conns: 2, DisableLocal: true})
				if err != nil {
					return nil, err
				}
				if engine == "BAD" {
					return panicky{b, &armed}, nil
				}
				return b, nil
			}
		})
		P := attach(t, d, shmDir, "P", &isoModel, isoEngine(1), kvxfer.ModePush)
		D := attach(t, d, shmDir, "D", &isoModel, isoEngine(2), kvxfer.ModePush)
		bad := attach(t, d, shmDir, "BAD", &isoModel, isoEngine(3), kvxfer.ModePush)
		pushOne(t, d, P, D, 0)

		// BAD holds d-1 (P never sends it); the step with d-2 wakes its
		// loop, whose backend then panics.
		now := time.Now()
		recv := func(id string, b topology.BlockID) kvxfer.RecvReq {
			return kvxfer.RecvReq{ReqID: id, Local: []topology.Span{{IDs: []topology.BlockID{b}}}, Deadline: now.Add(time.Hour),
				Remote: kvxfer.RemoteRef{EngineID: "P", Addr: d.peerAddr, ReqID: "p-" + id, TPSize: 1, Tokens: 16}}
		}
		bad.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{recv("d-1", 1)}})
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if st, err := d.srv.Workers()["BAD"][0].State(); err == nil && st.Recvs == 1 {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("BAD's state = %+v, %v; want d-1 held", st, err)
			}
		}
		armed.Store(true)
		bad.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{recv("d-2", 2)}})
		rs := bad.streams[0][0]
		got := map[string][]kvxfer.Outcome{}
		for f := range rs.Finished() {
			for _, o := range f.Recving {
				got[o.ReqID] = append(got[o.ReqID], o)
			}
		}
		for _, id := range []string{"d-1", "d-2"} {
			if o := got[id]; len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailureClosed ||
				!strings.Contains(o[0].Reason, "worker hit an internal error") {
				t.Errorf("BAD's outcomes of %s = %+v, want one: failed, worker_closed, the worker hit an internal error", id, o)
			}
		}
		if err := rs.Err(); status.Code(err) != codes.Internal || !strings.Contains(err.Error(), "internal error") ||
			!strings.Contains(err.Error(), "injected: backend invariant broken") {
			t.Errorf("BAD's stream ended with %v, want Internal naming the internal error and the panic", err)
		}
		for deadline := time.Now().Add(10 * time.Second); d.srv.WorkerPanics() != 1 || d.srv.Workers()["BAD"] != nil; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("WorkerPanics() = %d, workers %v; want 1, BAD detached", d.srv.WorkerPanics(), d.srv.Workers())
			}
		}

		// The daemon and its other engines carry on.
		pushOne(t, d, P, D, 1)
		P.close(t)
		D.close(t)
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}
