package kvxfer_test

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

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
