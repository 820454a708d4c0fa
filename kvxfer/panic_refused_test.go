// The injected panic propagates under -tags invariants (see TestWorkerPanic).

//go:build !invariants

package kvxfer_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A step entry Worker.Step refused (its error said so) has its request's
// one failed outcome still to come when the Worker breaks before its loop
// handled that step (ContainPanics): the broken Worker fails it like the
// step's good entries, instead of leaving it with no outcome at all.
func TestWorkerPanicFailsRefusedEntries(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.ContainPanics = true })
		w := x.d.workers[0][0]
		now := time.Now()
		qs := []*xreq{x.req("r1", 40, 0), x.req("r2", 40, 0), x.req("r3", 40, 0)}
		step := func(q *xreq) *kvxfer.StepMeta {
			return &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(x.mode, x.p, now.Add(time.Minute))}}
		}
		// The core panics on r1's step; the next one of the batch holds r2
		// (good) and r3, whose entry Step refuses.
		next := step(qs[1])
		bad := qs[2].recv(x.mode, x.p, now.Add(time.Minute))
		bad.Remote.EngineID = ""
		next.Recv = append(next.Recv, bad)
		err := kvxfer.BreakWorker(w, "d-r1", []*kvxfer.StepMeta{step(qs[0]), next}, nil)
		if err == nil || !strings.Contains(err.Error(), "Remote.EngineID is empty") {
			t.Fatalf("Step of the bad entry = %v, want it refused", err)
		}
		x.settle()
		<-w.Done()
		x.settle()
		for _, q := range qs {
			got := x.recvResult(q)
			if len(got) != 1 || got[0].Result != kvxfer.ResultFailed {
				t.Errorf("D %s: outcomes %v, want one failed", q.id, got)
			}
		}
		_ = w.Close()
	})
}
