// The injected panic propagates under -tags invariants (see TestWorkerPanic).

//go:build !invariants

package kvxfer_test

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// Once a Worker stopped on its own (a contained panic), which failed every
// request it held or was handed, StepDropped returns, with its error, the
// ids of those it names: their outcome is the worker's, so the caller
// (the daemon's dropped StepError) must not end them too. Before, it
// returned the error alone, and the daemon named them all: two outcomes.
func TestStepDroppedAfterPanicNamesHeld(t *testing.T) {
	if testing.Short() {
		t.Skip()
	}
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.ContainPanics = true })
		w := x.p.workers[0][0]
		held, pending, other := x.req("r1", 40, 0), x.req("r2", 40, 0), x.req("r3", 40, 0)
		x.sendP(held) // held: no consumer registers
		x.settle()
		now := time.Now()
		late := &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{pending.send(now.Add(30 * time.Second))}}
		breaking := &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{other.send(now.Add(30 * time.Second))}}
		if err := kvxfer.BreakWorker(w, "p-r3", []*kvxfer.StepMeta{breaking}, late); err != nil {
			t.Fatal(err)
		}
		x.settle()
		<-w.Done()
		ended, err := w.StepDropped([]string{"p-r1", "p-new", "p-r2", "p-r1"}, "step 9 dropped")
		if !errors.Is(err, kvxfer.ErrInternal) || !slices.Equal(ended, []string{"p-r1", "p-r2"}) {
			t.Errorf("StepDropped after the panic = %q, %v; want [p-r1 p-r2] (held, and handed before the panic), ErrInternal", ended, err)
		}
		for _, q := range []*xreq{held, pending} {
			if n := len(x.sendResult(q)); n != 1 {
				t.Errorf("%s: %d outcomes, want the broken worker's one", q.id, n)
			}
		}
	})
}
