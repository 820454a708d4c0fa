package kvxfer

import (
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
)

// A hop trace (WorkerConfig.HopTrace) records when each request passes
// each point of its path through a Worker: the step that names it, its
// registration sent or received, its WRITE or READ posted and seen
// ended, its completion notice, its outcome. Put beside the other side's
// trace and the engine's own points, it says where a transfer's time goes
// (kvxferd -hop-trace writes one; python/tests/hoptrace.py tabulates
// them).
//
// The Worker's driver reports each point when it happens (a step when
// Step takes it, a message when the driver sends or drains it, a transfer
// when the backend call is made or its end is seen), never when the core
// decides on it: the core reads no clock. With no tracer set, each point
// costs one nil check.

// HopTracer receives a Worker's hop events (WorkerConfig.HopTrace).
//
// Hop is called on the goroutine where the event happens (the Worker's
// loop, Step's caller, kvxferd's stream sender), at the moment it happens
// or, for a backend call (Call > 0), right after the call returned: the
// event is when the call began, Call before. Hop must be safe for
// concurrent use and must not block: the Worker's loop waits for it (an
// implementation queues the event and writes it elsewhere, dropping what
// does not fit). It may keep e.
type HopTracer interface {
	Hop(e HopEvent)
}

// Hop events' names (HopEvent.Hop). A consumer (D) rank's request in push
// mode passes HopRecvStep, HopRecvLoop, HopRegSent, HopDoneRecv and
// HopOutcome; its producer (P) rank's, HopSendStep, HopSendLoop,
// HopRegRecv, HopWritePost (the completion notice rides on the WRITE;
// HopDoneSent where it goes bare, with nothing or nothing more to WRITE),
// HopWriteDone and HopOutcome. In pull mode D passes HopRecvStep,
// HopRecvLoop, HopReadPost, HopReadDone and HopOutcome, and P
// HopSendStep, HopSendLoop, HopDoneRecv (the notice the READ carries) and
// HopOutcome. kvxferd adds HopOutcomeSent on either side.
const (
	// HopRecvStep and HopSendStep: Worker.Step took in a step naming the
	// request (on Step's caller's goroutine).
	HopRecvStep = "recv.step"
	HopSendStep = "send.step"
	// HopRecvLoop and HopSendLoop: the Worker's loop handed that step to
	// its core.
	HopRecvLoop = "recv.loop"
	HopSendLoop = "send.loop"
	// HopRegSent and HopRegRecv: a registration (push) was handed to the
	// backend (Call: the Notify call), and drained from it.
	HopRegSent = "reg.sent"
	HopRegRecv = "reg.recv"
	// HopWritePost and HopReadPost: a WRITE (push) or READ (pull) was
	// posted (Call: the Post call); the notification it carries names its
	// request.
	HopWritePost = "write.post"
	HopReadPost  = "read.post"
	// HopWriteDone and HopReadDone: the loop saw the transfer end
	// (Result: its state, done or failed; Xfer: the backend's own measure
	// of it, where it keeps one).
	HopWriteDone = "write.done"
	HopReadDone  = "read.done"
	// HopDoneSent and HopDoneRecv: a completion notice went bare (Call:
	// the Notify call), and one was drained (push: D; pull: P).
	HopDoneSent = "done.sent"
	HopDoneRecv = "done.recv"
	// Failure notices, cancels and their acknowledgements, sent and
	// drained.
	HopFailSent   = "fail.sent"
	HopFailRecv   = "fail.recv"
	HopCancelSent = "cancel.sent"
	HopCancelRecv = "cancel.recv"
	HopAckSent    = "ack.sent"
	HopAckRecv    = "ack.recv"
	// HopOutcome: the loop published the request's outcome to Finished
	// (Result: the outcome's result).
	HopOutcome = "outcome"
	// HopOutcomeSent: kvxferd sent the outcome on the rank's stream (the
	// event is when its sender woke for it; Call: draining, encoding and
	// sending).
	HopOutcomeSent = "outcome.sent"
)

// HopEvent is one point a request passed (HopTracer).
type HopEvent struct {
	// Hop names the point (the Hop constants).
	Hop string
	// Side is the rank's side of the request: RoleConsumer (D) or
	// RoleProducer (P).
	Side Role
	// Engine, TPRank and PPRank name the rank.
	Engine         string
	TPRank, PPRank int
	// DReq, PReq and TransferID name the request where the point knows
	// them: D's and P's ids and the router's transfer id. Points about a
	// peer message fill them in from the message (ResolveIDs).
	DReq, PReq, TransferID string
	// Result is an outcome's result or a transfer's end state.
	Result string
	// Call is how long the backend call the point names took; the event
	// is when it began (0: the point is no call).
	Call time.Duration
	// Began is when that call began, where the point knows it (zero: the
	// event is Call before it is reported). A tracer places the event
	// by it: Call, measured as the call returned, is reported later, by
	// however long the reporting goroutine was kept from running
	// meanwhile (milliseconds on a loaded host), which would put a
	// message's sending after its receipt on the other side.
	Began time.Time
	// Xfer is the backend's own measure of a transfer that ended
	// (HopWriteDone, HopReadDone; Telemeter: NIXL's telemetry), 0 where
	// it keeps none: beside the time the loop took to see the end.
	Xfer time.Duration

	// msg is the peer message the point is about, ids not read yet.
	msg []byte
}

// ResolveIDs fills DReq, PReq and TransferID, where empty, from the peer
// message the event is about (none: nothing to do). It decodes the
// message: a tracer calls it off the Worker's loop, on a goroutine of its
// own. A message that does not decode leaves them as they were.
func (e *HopEvent) ResolveIDs() {
	if e.msg == nil {
		return
	}
	m, err := decodeMsg(e.msg)
	e.msg = nil
	if err != nil {
		return
	}
	if e.DReq == "" {
		e.DReq = m.DReq
	}
	if e.PReq == "" {
		e.PReq = m.PReq
	}
	if e.TransferID == "" {
		e.TransferID = m.TransferID
	}
}

// hopOfMsg returns the event of a peer message of the Worker's mode, sent
// or drained, and the side of the rank that sent or drained it ("": not
// traced: heartbeats, layer tags, what does not decode).
func hopOfMsg(b []byte, mode Mode, sent bool) (string, Role) {
	if len(b) < 3 || b[0] != wireMagic {
		return "", 0
	}
	// The side that sends each kind.
	var hop [2]string // [sent, drained]
	from := RoleConsumer
	switch msgKind(b[2]) {
	case msgReg:
		hop = [2]string{HopRegSent, HopRegRecv}
	case msgDone:
		hop = [2]string{HopDoneSent, HopDoneRecv}
		if mode == ModePush {
			from = RoleProducer
		}
	case msgFail:
		hop = [2]string{HopFailSent, HopFailRecv}
		if mode == ModePush {
			from = RoleProducer
		}
	case msgCancel:
		hop = [2]string{HopCancelSent, HopCancelRecv}
	case msgAck:
		hop = [2]string{HopAckSent, HopAckRecv}
		from = RoleProducer
	default:
		return "", 0
	}
	if sent {
		return hop[0], from
	}
	return hop[1], otherRole(from)
}

func otherRole(r Role) Role {
	if r == RoleProducer {
		return RoleConsumer
	}
	return RoleProducer
}

// hop reports one event to the Worker's tracer, naming the Worker's rank.
// Callers check w.trace != nil first (the check is all a point costs
// without a tracer).
func (w *Worker) hop(e HopEvent) {
	l := &w.cfg.Layout
	e.Engine, e.TPRank, e.PPRank = w.cfg.EngineID, l.TPRank, l.PPRank
	w.trace.Hop(e)
}

// hopMsg reports a message sent (call: the Notify call, begun at began,
// which returned err) or drained: a copy of its bytes goes with the event, for
// ResolveIDs.
func (w *Worker) hopMsg(b []byte, sent bool, began time.Time, call time.Duration, err error) {
	name, side := hopOfMsg(b, w.cfg.Mode, sent)
	if name == "" {
		return
	}
	e := HopEvent{Hop: name, Side: side, Call: call, Began: began, msg: append([]byte(nil), b...)}
	if err != nil {
		e.Result = XferFailed.String()
	}
	w.hop(e)
}

// hopEnded reports a posted transfer that left XferInProgress (tel: the
// backend's figures, if any).
func (w *Worker) hopEnded(x *xferEntry, s XferState, err error, tel *XferTelemetry) {
	e := HopEvent{Hop: HopWriteDone, Side: RoleProducer, Result: s.String(), msg: x.note}
	if tel != nil {
		e.Xfer = tel.Transfer
	}
	if x.op == hotpath.OpRead {
		e.Hop, e.Side = HopReadDone, RoleConsumer
	}
	if err != nil {
		e.Result = XferFailed.String()
	}
	w.hop(e)
}

// hopStep reports the requests a step names (name: HopRecvStep and
// HopSendStep, or HopRecvLoop and HopSendLoop).
func (w *Worker) hopStep(meta *StepMeta, recv, send string) {
	if meta == nil {
		return
	}
	for i := range meta.Recv {
		r := &meta.Recv[i]
		w.hop(HopEvent{Hop: recv, Side: RoleConsumer, DReq: r.ReqID, PReq: r.Remote.ReqID, TransferID: r.TransferID})
	}
	for i := range meta.Send {
		s := &meta.Send[i]
		w.hop(HopEvent{Hop: send, Side: RoleProducer, PReq: s.ReqID, TransferID: s.TransferID})
	}
}

// hopOutcomes reports the outcomes about to be published.
func (w *Worker) hopOutcomes(f *Finished) {
	for _, o := range f.Sending {
		w.hop(HopEvent{Hop: HopOutcome, Side: RoleProducer, PReq: o.ReqID, Result: o.Result.String()})
	}
	for _, o := range f.Recving {
		w.hop(HopEvent{Hop: HopOutcome, Side: RoleConsumer, DReq: o.ReqID, Result: o.Result.String()})
	}
}
