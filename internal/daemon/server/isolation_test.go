package server_test

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/topology"
)

// One engine's failure stays its own: the tests below break one engine's
// rank (its backend does not open, its worker panics) in a daemon that
// serves others, and check that the others keep transferring.

var isoModel = kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}

func isoEngine(id int) kvsim.Engine {
	return kvsim.Engine{ID: id, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 64}
}

// pushOne moves request n (blocks 4n to 4n+3 on both engines) from P to D,
// both attached to d, and checks both outcomes and D's bytes.
func pushOne(t *testing.T, d *daemon, P, D *engine, n int) {
	t.Helper()
	ids := []topology.BlockID{topology.BlockID(4 * n), topology.BlockID(4*n + 1), topology.BlockID(4*n + 2)}
	req := &kvsim.Request{Tokens: 40, P: []topology.Span{{IDs: ids}}, D: []topology.Span{{IDs: ids}}, Salt: n}
	P.ranks[0][0].FillSalt(req.P, n)
	before := D.ranks[0][0].Snapshot()
	id, now := fmt.Sprint(n), time.Now()
	D.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{{ReqID: "d-" + id, TransferID: "t-" + id, Local: req.D,
		Deadline: now.Add(time.Minute), Remote: kvxfer.RemoteRef{EngineID: P.id, Addr: d.peerAddr, ReqID: "p-" + id, TPSize: 1, Tokens: 40}}}})
	P.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{{ReqID: "p-" + id, TransferID: "t-" + id,
		Deadline: now.Add(30 * time.Second), Blocks: req.P, Tokens: 40}}})
	if o := P.collect(t, 1, true)["p-"+id]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Errorf("%s outcomes of p-%s = %+v, want done", P.id, id, o)
	}
	if o := D.collect(t, 1, false)["d-"+id]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Errorf("%s outcomes of d-%s = %+v, want done", D.id, id, o)
	}
	if err := D.ranks[0][0].CheckValues(before, []*kvsim.Request{req}, 16, 16); err != nil {
		t.Error(err)
	}
}

// panicky is the built-in backend with a fault: once armed, DrainNotifs
// panics, on the worker's loop goroutine, as a broken invariant would.
type panicky struct {
	*tcp.Backend
	armed *atomic.Bool
}

func (p panicky) DrainNotifs(dst []kvxfer.Notif) []kvxfer.Notif {
	if p.armed.Load() {
		panic("injected: backend invariant broken")
	}
	return p.Backend.DrainNotifs(dst)
}

// A rank whose backend fails to open is refused with an error naming the
// engine, the rank and the failure; nothing of it stays (its engine may
// attach again), and the daemon and its other engines carry on. The
// factory here breaks Go's convention the way kvxferd's once did (a nil
// *nixl.Backend in a non-nil interface beside the error): the server must
// not trust, and above all not Close, what comes with an error.
func TestAttachBackendOpenFails(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		var fail atomic.Bool
		fail.Store(true)
		errOpen := errors.New("injected: the agent did not open")
		d := startDaemonWith(t, shmDir, func(c *server.Config) {
			c.NewBackend = func(engine string, _ *topology.Layout, _ bool) (server.Backend, error) {
				if engine == "BAD" && fail.Load() {
					var none *tcp.Backend
					var be server.Backend = none // what `return nixl.New(...)` gave when the open failed
					return be, errOpen
				}
				return backendOf(tcp.New(tcp.Config{Logger: quiet, Conns: 2, DisableLocal: true}))
			}
		})
		P := attach(t, d, shmDir, "P", &isoModel, isoEngine(1), kvxfer.ModePush)
		D := attach(t, d, shmDir, "D", &isoModel, isoEngine(2), kvxfer.ModePush)
		pushOne(t, d, P, D, 0)

		_, err := tryAttach(t, d, shmDir, "BAD", &isoModel, isoEngine(3), kvxfer.ModePush)
		if err == nil || !strings.Contains(err.Error(), "backend for BAD rank tp 0 pp 0") || !strings.Contains(err.Error(), errOpen.Error()) {
			t.Fatalf("attaching BAD with a backend that does not open: %v, want an error naming the backend, the rank and why", err)
		}
		if d.srv.Workers()["BAD"] != nil {
			t.Errorf("BAD has workers after its attach failed: %v", d.srv.Workers())
		}
		pushOne(t, d, P, D, 1)

		// Nothing of the failed attach stays: BAD attaches once its
		// backend opens, and works.
		fail.Store(false)
		bad := attach(t, d, shmDir, "BAD", &isoModel, isoEngine(3), kvxfer.ModePush)
		pushOne(t, d, P, bad, 2)
		P.close(t)
		D.close(t)
		bad.close(t)
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}
