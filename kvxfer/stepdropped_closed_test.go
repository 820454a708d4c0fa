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

// StepDropped racing Close: whichever comes first, each request it names
// that the worker held gets one outcome, the worker's, and StepDropped
// returns it (the caller ends the rest).
func TestStepDroppedRacingClose(t *testing.T) {
	for i := range 20 {
		inSynctest(t, func(t *testing.T) {
			x := newPair(t, kvxfer.ModePush, 1, 1, nil)
			w := x.p.workers[0][0]
			q := x.req("r1", 40, 0)
			x.sendP(q)
			x.settle()
			done := make(chan struct{})
			go func() {
				defer close(done)
				if i%2 == 0 {
					time.Sleep(time.Nanosecond)
				}
				_ = w.Close()
			}()
			ended, _ := w.StepDropped([]string{"p-r1", "p-new"}, "step 9 dropped")
			<-done
			x.settle()
			if !slices.Equal(ended, []string{"p-r1"}) {
				t.Errorf("run %d: StepDropped = %q, want [p-r1] (held: the worker's outcome)", i, ended)
			}
			if n := len(x.sendResult(q)); n != 1 {
				t.Errorf("run %d: p-r1 has %d outcomes, want 1", i, n)
			}
		})
	}
}

// RecvsHeld returns the receives of a dropped step whose outcome is the
// worker's: those it holds, live or when it closed (its close ended
// them), each once; the others are the caller's to end.
func TestRecvsHeld(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		w := x.d.workers[0][0]
		q := x.req("r1", 40, 0)
		x.recvD(q) // held: its producer never sends
		x.settle()
		if held, err := w.RecvsHeld([]string{"d-r1", "d-new", "d-r1"}); err != nil || !slices.Equal(held, []string{"d-r1"}) {
			t.Errorf("RecvsHeld = %q, %v; want [d-r1]", held, err)
		}
		_ = w.Close()
		x.settle()
		held, err := w.RecvsHeld([]string{"d-new", "d-r1"})
		if !errors.Is(err, kvxfer.ErrClosed) || !slices.Equal(held, []string{"d-r1"}) {
			t.Errorf("RecvsHeld after Close = %q, %v; want [d-r1] (its close ended it), ErrClosed", held, err)
		}
		if n := len(x.recvResult(q)); n != 1 {
			t.Errorf("d-r1: %d outcomes, want the closed worker's one", n)
		}
	})
}
