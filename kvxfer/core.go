package kvxfer

import (
	"time"

	"github.com/kvxfer/kvxfer/internal/invariants"
)

// The Worker's core (loopState, in the files TestCoreIsPure lists) is the
// per-rank protocol as a deterministic state machine: Step takes one
// input, stamped with its time, and leaves what the driver must do in
// its effects (ops to carry out and hand back, transfers to release,
// handshakes to run), its outcomes (out) and when it wants to run again
// (nextWake). It starts no goroutine, reads no clock and calls no
// backend; worker.go is its driver.

// inputKind says what happened.
type inputKind uint8

const (
	inEvent     inputKind = iota + 1 // a Worker event: a step, a saved layer, a handshake's answer
	inNotifs                         // peers' notifications
	inXferEnded                      // a posted transfer left XferInProgress
	inOpsDone                        // the results of the ops the core asked for
	inTimers                         // time passed: fire what is due
	inClose                          // the Worker closes: end every request, transfers in flight fenced
	inCloseNow                       // the close's fence timed out: abandon what is left
	inReleased                       // an abandoned transfer was released: none of its bytes move any more
)

// input is one thing that happened, for Step.
type input struct {
	kind   inputKind
	ev     *event
	notifs []Notif
	// inXferEnded, inReleased
	xfer  XferID
	state XferState
	err   error
	tel   *XferTelemetry
	post  time.Duration
	// inOpsDone: errs[i] is ops[i]'s result
	ops  []op
	errs []error
}

// Step handles one input at time now. The driver carries out the effects
// it leaves (st.fx), handing op results back as an inOpsDone input before
// any other, publishes st.out, and calls Step with inTimers at nextWake.
func (st *loopState) Step(now time.Time, in input) {
	st.now = now
	switch in.kind {
	case inEvent:
		st.handle(in.ev)
	case inNotifs:
		st.onNotifs(in.notifs)
	case inXferEnded:
		st.xferEnded(in.xfer, in.state, in.err, in.tel, in.post)
	case inOpsDone:
		st.opsDone(in.ops, in.errs)
	case inTimers:
		st.runTimers()
	case inClose:
		st.closeDown()
	case inCloseNow:
		st.shutdown()
	case inReleased:
		st.released(in.xfer)
	}
	if len(st.regAgain) > 0 {
		st.replayRegs()
	}
	if st.beatFresh && !st.closing {
		st.heartbeatFresh() // (waiting requests this input added or readied)
	}
	st.recycleSends()
	if invariants.Enabled {
		st.checkRegIDs()
		st.checkEarlyBytes()
		st.checkOutboxed()
	}
}

// maxFreeSends bounds the producer records kept for reuse.
const maxFreeSends = 4096

// recycleSends clears the records of the requests forgotten during an
// input, once it is handled, and keeps them for the next requests: a
// record is the one allocation a producer request costs the core.
func (st *loopState) recycleSends() {
	for i, s := range st.deadSends {
		if len(st.freeSends) < maxFreeSends {
			*s = sendReq{}
			st.freeSends = append(st.freeSends, s)
		}
		st.deadSends[i] = nil
	}
	st.deadSends = st.deadSends[:0]
}
