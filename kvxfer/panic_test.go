package kvxfer_test

import (
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/invariants"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// panicChildEnv makes TestWorkerPanic run its scenario as the child
// process of a -tags invariants run, where the panic must end it.
const panicChildEnv = "KVXFER_WORKER_PANIC_CHILD"

// A Worker with ContainPanics whose core panics in the middle of an input
// (a broken invariant) fails every request it held or was handed, once
// each, and stops; its memory is deregistered; the panic is counted and
// logged with its stack; the other Workers of the process keep
// transferring. Under -tags invariants the panic propagates instead: the
// scenario, run in a child process, dies of it.
func TestWorkerPanic(t *testing.T) {
	switch {
	case os.Getenv(panicChildEnv) != "":
		workerPanicScenario(t)
		t.Fatal("the injected panic did not end the process under -tags invariants")
	case invariants.Enabled:
		cmd := exec.Command(os.Args[0], "-test.run=^TestWorkerPanic$", "-test.count=1", "-test.v")
		cmd.Env = append(os.Environ(), panicChildEnv+"=1")
		out, err := cmd.CombinedOutput()
		var exit *exec.ExitError
		if !errors.As(err, &exit) || exit.ExitCode() != 2 || !strings.Contains(string(out), "panic: kvxfer: injected invariant failure") {
			t.Errorf("child with the injected panic under -tags invariants: %v, want it to die of the panic (exit 2); output:\n%s", err, out)
		}
	default:
		workerPanicScenario(t)
	}
}

func workerPanicScenario(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		logs := &logRecorder{}
		contain := func(side string, c *kvxfer.WorkerConfig) {
			c.ContainPanics = true
			if side == "D" {
				c.Logger = slog.New(logs)
			}
		}
		x := newPair(t, kvxfer.ModePush, 1, 1, contain) // D of x breaks
		y := newPair(t, kvxfer.ModePush, 1, 1, contain) // carries on
		w := x.d.workers[0][0]
		qs := []*xreq{x.req("r0", 40, 48), x.req("r1", 40, 0), x.req("r2", 40, 0), x.req("r3", 40, 0), x.req("r4", 40, 0)}
		now := time.Now()
		recv := func(q *xreq) *kvxfer.StepMeta {
			return &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(x.mode, x.p, now.Add(time.Minute))}}
		}
		// r1 is registered with P and waits (P never finishes it).
		x.recvD(qs[1])
		x.settle()
		// One batch: r0 (nothing to receive: done at once) and r2, where the
		// core panics; then r4, never handled. r3 is queued meanwhile.
		both := recv(qs[0])
		both.Recv = append(both.Recv, recv(qs[2]).Recv...)
		if err := kvxfer.BreakWorker(w, "d-r2", []*kvxfer.StepMeta{both, recv(qs[4])}, recv(qs[3])); err != nil {
			t.Fatal(err)
		}
		x.settle()
		<-w.Done()

		wantResult(t, "D r0 (done before the panic)", x.recvResult(qs[0]), kvxfer.ResultDone, "")
		for _, q := range qs[1:] {
			wantResult(t, "D "+q.id, x.recvResult(q), kvxfer.ResultFailed, "worker hit an internal error")
			wantKind(t, "D "+q.id, x.recvResult(q), kvxfer.FailureClosed)
		}
		for _, q := range qs[1:] {
			for _, b := range q.sim.D[0].IDs {
				if !slices.Contains(x.out.invalid, b) {
					t.Errorf("block %d of %s not reported invalid (invalid: %v)", b, q.id, x.out.invalid)
				}
			}
		}
		if err := w.Err(); !errors.Is(err, kvxfer.ErrInternal) || !errors.Is(err, kvxfer.ErrClosed) || !strings.Contains(err.Error(), "injected invariant failure") {
			t.Errorf("Err() = %v, want ErrInternal (and ErrClosed) quoting the panic", err)
		}
		if err := w.Step(recv(x.req("r5", 40, 0))); !errors.Is(err, kvxfer.ErrInternal) {
			t.Errorf("Step after the panic = %v, want ErrInternal", err)
		}
		if _, err := w.State(); !errors.Is(err, kvxfer.ErrInternal) {
			t.Errorf("State after the panic = %v, want ErrInternal", err)
		}
		if n := w.Metrics().Snapshot().Panics; n != 1 {
			t.Errorf("Stats.Panics = %d, want 1", n)
		}
		logged := false
		logs.mu.Lock()
		for _, r := range logs.recs {
			if strings.Contains(r["msg"], "internal error") && strings.Contains(r["panic"], "injected invariant failure") &&
				strings.Contains(r["stack"], "kvxfer.BreakWorker") {
				logged = true
			}
		}
		logs.mu.Unlock()
		if !logged {
			t.Errorf("no log record of the panic with its value and stack in %v", logs.recs)
		}
		// Its memory is deregistered already, before Close: no peer's WRITE
		// lands in blocks the engine got back.
		if err := x.d.agents[0][0].Deregister([]kvxfer.MemRegion{{Addr: x.d.ranks[0][0].Layout.Regions[0].Base}}); err == nil {
			t.Error("region still registered after the panic")
		}
		if err := w.Close(); err != nil {
			t.Errorf("Close after the panic = %v, want nil", err)
		}

		// The other Workers of the process carry on.
		q := y.req("r1", 40, 0)
		y.recvD(q)
		y.sendP(q)
		y.settle()
		wantResult(t, "other pair P", y.sendResult(q), kvxfer.ResultDone, "")
		wantResult(t, "other pair D", y.recvResult(q), kvxfer.ResultDone, "")
		if err := y.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
			t.Error(err)
		}
	})
}
