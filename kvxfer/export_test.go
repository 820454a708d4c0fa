package kvxfer

import (
	"errors"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// AppendRegMsg encodes a push registration as D rank tpRank of engine
// would send it, for tests that replay or forge peer messages.
func AppendRegMsg(engine string, tpRank, tpSize int, tid, dreq, preq string, spans []topology.Span) []byte {
	return appendMsg(nil, &msg{Kind: msgReg, Engine: engine, Addr: engine + ":1", TPRank: tpRank, TPSize: tpSize, PPSize: 1,
		TransferID: tid, DReq: dreq, PReq: preq, Spans: spans})
}

// AppendDoneMsg encodes a completion notice from rank tpRank of engine.
func AppendDoneMsg(engine string, tpRank, tpSize int, tid, dreq, preq string) []byte {
	return appendMsg(nil, &msg{Kind: msgDone, Engine: engine, TPRank: tpRank, TPSize: tpSize, PPSize: 1, TransferID: tid, DReq: dreq, PReq: preq})
}

// AppendFailMsg encodes a failure notice from rank tpRank of engine.
func AppendFailMsg(engine string, tpRank, tpSize int, tid, dreq, preq, reason string) []byte {
	return appendMsg(nil, &msg{Kind: msgFail, Engine: engine, TPRank: tpRank, TPSize: tpSize, PPSize: 1, TransferID: tid, DReq: dreq, PReq: preq, Reason: reason})
}

// RaceStepWithClose makes w's loop, the next time it is about to wait,
// accept meta as Step does and then be closed as Close begins, with the
// step's wake-up consumed: the loop then sees only the close while the
// step's events wait in its inbox (what a Close racing a Step can do). It
// returns Step's error; call Close after it.
func RaceStepWithClose(w *Worker, meta *StepMeta) error {
	errc := make(chan error, 1)
	var once bool
	hook := func(hw *Worker) {
		if hw != w || once {
			return
		}
		once = true
		errc <- w.Step(meta)
		select {
		case <-w.wake:
		default:
		}
		w.mu.Lock()
		w.mu.closed = true
		w.mu.Unlock()
		w.cancel()
	}
	hookBeforeWait.Store(&hook)
	defer hookBeforeWait.Store(nil)
	w.signal()
	return <-errc
}

// WriteGrants returns the access table of a push rank of layout l (groupBlocks
// blocks per group) in which writer may write blocks ids of group 0
// (BenchmarkGrants).
func WriteGrants(l *topology.Layout, groupBlocks []int, writer PeerName, ids []topology.BlockID) AccessChecker {
	tab := newAccessTable(l, groupBlocks, ModePush, NewMetrics())
	tab.grantWrite(1, []PeerName{writer}, []topology.Span{{IDs: ids}}, "")
	return tab
}

// ArmAndFireForTest arms n lease timers on a heap kept across calls, due
// at a few distinct times, and fires them all.
func ArmAndFireForTest() func(n int) {
	var h timerHeap
	at := time.Unix(1000, 0)
	return func(n int) {
		for i := range n {
			h.push(timerEntry{at: at.Add(time.Duration(i%7) * time.Second), kind: tLease, id: "r"})
		}
		for len(h) > 0 {
			h.pop()
		}
	}
}

// BreakWorker makes w's loop panic as a broken invariant would, in the
// middle of a batch of inputs: the next time the loop is about to wait,
// it hands w each of steps (they make one batch of its inbox); the loop
// then panics right after the core handled the first step that names
// request id (in Recv or Send), before that step's effects, having
// handed late to Step first (late waits in the inbox, never taken in). It
// returns the Steps' errors, joined.
func BreakWorker(w *Worker, id string, steps []*StepMeta, late *StepMeta) error {
	names := func(m *StepMeta) bool {
		for i := range m.Recv {
			if m.Recv[i].ReqID == id {
				return true
			}
		}
		for i := range m.Send {
			if m.Send[i].ReqID == id {
				return true
			}
		}
		return false
	}
	var fired bool
	core := func(hw *Worker, e *event) {
		if hw != w || fired || e.kind != evStep || !names(e.meta) {
			return
		}
		fired = true
		hookAfterEvent.Store(nil)
		if late != nil {
			_ = w.Step(late)
		}
		panic("kvxfer: injected invariant failure (BreakWorker)")
	}
	errc := make(chan error, 1)
	var once bool
	driver := func(hw *Worker) {
		if hw != w || once {
			return
		}
		once = true
		hookBeforeWait.Store(nil)
		var errs []error
		for _, m := range steps {
			errs = append(errs, w.Step(m))
		}
		hookAfterEvent.Store(&core)
		errc <- errors.Join(errs...)
	}
	hookBeforeWait.Store(&driver)
	w.signal()
	return <-errc
}

// MaxParked bounds the messages of one engine waiting for a handshake.
const MaxParked = maxParked

// RegrantedTable is a push rank's access table (layout l, groupBlocks
// blocks per group) in which writer held a grant on blocks ids of group 0
// for consumer request old (of transfer "t-"+old), revoked, and holds one
// on the same blocks for request next (of transfer "t-"+next)
// (TestLateTransferOfEndedRequestRefused).
func RegrantedTable(l *topology.Layout, groupBlocks []int, writer PeerName, ids []topology.BlockID, old, next string) AccessChecker {
	tab := newAccessTable(l, groupBlocks, ModePush, NewMetrics())
	tab.grantWrite(1, []PeerName{writer}, []topology.Span{{IDs: ids}}, writeKey(old, "t-"+old))
	tab.revokeWrite(1)
	tab.grantWrite(2, []PeerName{writer}, []topology.Span{{IDs: ids}}, writeKey(next, "t-"+next))
	return tab
}

// ReheldTable is a pull rank's access table in which blocks ids of group 0
// were held for producer request old, let go, and are held for next.
func ReheldTable(l *topology.Layout, groupBlocks []int, ids []topology.BlockID, old, next string) AccessChecker {
	tab := newAccessTable(l, groupBlocks, ModePull, NewMetrics())
	tab.hold([]topology.Span{{IDs: ids}}, 1, old, "")
	tab.hold([]topology.Span{{IDs: ids}}, -1, old, "")
	tab.hold([]topology.Span{{IDs: ids}}, 1, next, "")
	return tab
}

// StallLoop holds w's loop, from the next time it is about to wait, until
// the returned func is called: what the engine hands it meanwhile queues.
func StallLoop(w *Worker) (release func()) {
	stalled, gone := make(chan struct{}), make(chan struct{})
	var once bool
	hook := func(hw *Worker) {
		if hw != w || once {
			return
		}
		once = true
		close(stalled)
		<-gone
	}
	hookBeforeWait.Store(&hook)
	w.signal()
	<-stalled
	var done bool
	return func() {
		if !done {
			done = true
			hookBeforeWait.Store(nil)
			close(gone)
		}
	}
}

// Queued is how many events wait in w's inbox.
func Queued(w *Worker) int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.mu.inbox)
}

// MaxQueuedSteps bounds the engine's input waiting in a worker's inbox.
const MaxQueuedSteps = maxQueuedSteps

// Waiting returns the ids of the requests w heartbeats as waiting
// (StepMeta.Await), sorted.
func Waiting(w *Worker) []string {
	ch := make(chan []string, 1)
	if err := w.post(event{kind: evInspect, fn: func(st *loopState) { ch <- sortedKeys(st.waits) }}); err != nil {
		return nil
	}
	return <-ch
}

// RegBlockIDs is how many consumer block ids w's waiting registrations
// hold (a consumer's give-up, which waits among them, holds none).
func RegBlockIDs(w *Worker) int {
	ch := make(chan int, 1)
	if err := w.post(event{kind: evInspect, fn: func(st *loopState) { ch <- st.regIDs }}); err != nil {
		return 0
	}
	return <-ch
}
