package kvxfer

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// holdPair is a pull producer core (P) and a consumer core (D) whose
// notifications reach each other: D's heartbeats reach P and P's answers
// reach D (unless dropHolds: a producer of an earlier build, which does
// not answer). Each handshake either asks for is answered at once.
type holdPair struct {
	p, d      *traceCore
	toP, toD  []Notif
	dropHolds bool
	holds     int      // answers P sent
	pOut      []string // what P printed as the clocks advanced
}

func newHoldPair(t *testing.T) *holdPair {
	hp := &holdPair{p: &traceCore{now: traceEpoch, fail: map[opKind]int{}}, d: &traceCore{now: traceEpoch, fail: map[opKind]int{}}}
	hp.p.run(t, "core mode=pull engine=P tp=0/1")
	hp.d.run(t, "core mode=pull engine=D tp=0/1")
	hp.p.onOp = func(o *op) {
		if o.kind == opNotify && o.peer == "D/0" {
			m, err := decodeMsg(o.msg)
			if err == nil && m.Kind == msgHold {
				hp.holds++
			}
			if err == nil && !(hp.dropHolds && m.Kind == msgHold) {
				hp.toD = append(hp.toD, Notif{From: "P/0", Msg: o.msg})
			}
		}
	}
	hp.d.onOp = func(o *op) {
		if o.kind == opNotify && o.peer == "P/0" {
			hp.toP = append(hp.toP, Notif{From: "D/0", Msg: o.msg})
		}
	}
	return hp
}

// settle delivers the messages in flight and answers the handshakes
// asked for, until nothing more moves; it returns what D printed.
func (hp *holdPair) settle(t *testing.T, out string) string {
	t.Helper()
	var dOut []string
	if out != "" {
		dOut = append(dOut, out)
	}
	for range 20 {
		moved := false
		if len(hp.toP) > 0 {
			n := hp.toP
			hp.toP = nil
			hp.p.st.Step(hp.p.now, input{kind: inNotifs, notifs: n})
			got := strings.Join(hp.p.drive(nil, ""), "\n")
			hp.pOut = append(hp.pOut, got)
			if strings.Contains(got, "handshake D at") {
				hp.p.run(t, "handshake D tp=1")
			}
			moved = true
		}
		if len(hp.toD) > 0 {
			n := hp.toD
			hp.toD = nil
			hp.d.st.Step(hp.d.now, input{kind: inNotifs, notifs: n})
			dOut = append(dOut, hp.d.drive(nil, "")...)
			moved = true
		}
		if !moved {
			break
		}
	}
	return strings.Join(dOut, "\n")
}

// advance moves both cores' clocks by step, answering D's probes of P.
func (hp *holdPair) advance(t *testing.T, step time.Duration) string {
	hp.pOut = append(hp.pOut, hp.p.run(t, "advance "+step.String()))
	got := hp.d.run(t, "advance "+step.String())
	if strings.Contains(got, "probe P") {
		got += "\n" + hp.d.run(t, "handshake P tp=1 probe=true")
	}
	return hp.settle(t, got)
}

// pullHold has a real producer Scheduler finish p-1 (a 30 s lease, its
// expiry in the params) and stages it on P's core (unless notHeld: P's
// core never held it, as a request it no longer holds), and a real
// consumer Scheduler allocate d-1 for those params; it returns D's step.
func (hp *holdPair) pullHold(t *testing.T, notHeld bool) *StepMeta {
	t.Helper()
	p, pc := newSched(t, ModePull, func(c *SchedulerConfig) {
		c.Generation = gen1 // its params carry its generation (the trace handshake's)
		c.TPSize, c.EngineID, c.Addr = 1, "P", "P:1"
	})
	pc.t = traceEpoch
	hold, params, err := p.RequestFinished(&Request{ID: "p-1", PromptTokens: 80, Params: &TransferParams{DoRemoteDecode: true}},
		FinishLengthCapped, [][]topology.BlockID{ids(1, 2, 3, 4, 5)}, 80)
	if err != nil || !hold || !params.RemoteBlocksExpiry.Equal(traceEpoch.Add(30*time.Second)) {
		t.Fatalf("P finish = %v, %+v, %v; want its blocks held, the lease's end in the params", hold, params, err)
	}
	if pm := p.BuildMeta(); !notHeld {
		hp.p.st.Step(hp.p.now, input{kind: inEvent, ev: &event{kind: evStep, meta: pm}})
		hp.p.drive(nil, "")
	}
	d, dc := newSched(t, ModePull, func(c *SchedulerConfig) { c.TPSize, c.EngineID, c.Addr = 1, "D", "D:1" })
	dc.t = traceEpoch
	r := &Request{ID: "d-1", PromptTokens: 80, Params: params}
	n, async := d.MatchedTokens(r, 0)
	if n == 0 || !async {
		t.Fatalf("MatchedTokens = %d, %v; want the producer's tokens, async", n, async)
	}
	if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(5, 6, 7, 8, 9, 10)}, External: n}); err != nil {
		t.Fatal(err)
	}
	return d.BuildMeta()
}

// A large pull READ posted 22 s into P's 30 s lease, still in flight at
// 35 s: D's heartbeats kept P's hold (P extends it to 20 s past each),
// and P answers them with the deadline it holds the request to, so the
// READ ending at 35 s read the request's own blocks and is done. Without
// an answer (a producer of an earlier build, or one that no longer holds
// the request) D goes by the params' expiry alone: the READ is given up
// 250 ms before 30 s. Before, D never learned of the extension and gave
// up every READ in flight at the params' expiry.
func TestPullReadWithinTheHeartbeatExtendedHold(t *testing.T) {
	for _, tc := range []struct {
		name               string
		dropHolds, notHeld bool
		want               string
	}{
		{"answered", false, false, "outcome recv d-1 done"},
		{"an earlier producer build (no answer)", true, false, "outcome recv d-1 expired"},
		{"a request P does not hold", false, true, "outcome recv d-1 expired"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hp := newHoldPair(t)
			hp.dropHolds = tc.dropHolds
			meta := hp.pullHold(t, tc.notHeld)
			hp.advance(t, 22*time.Second)
			hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
			out := strings.Join(append(hp.d.drive(nil, ""), hp.d.run(t, "handshake P tp=1")), "\n")
			if !strings.Contains(out, "post #1 read P/0") {
				t.Fatalf("d-1 22 s into P's 30 s lease:\n%s\nwant its READ posted", out)
			}
			hp.settle(t, out)
			var all []string
			for range 13 { // to 35 s, the READ in flight
				got := hp.advance(t, time.Second)
				all = append(all, got)
				if strings.Contains(got, "outcome") {
					break
				}
			}
			if answered := hp.holds > 0; answered != !tc.notHeld {
				t.Fatalf("P answered D's heartbeats %d times, want answers: %v", hp.holds, !tc.notHeld)
			}
			if !strings.Contains(strings.Join(all, "\n"), "outcome") {
				all = append(all, hp.d.run(t, "ended xfer=1"))
			}
			if got := strings.Join(all, "\n"); !strings.Contains(got, tc.want) {
				t.Errorf("READ posted at 22 s of P's 30 s lease, ended at 35 s:\n%s\nwant %q", got, tc.want)
			}
		})
	}
}

// A hold answer names the request it extends by its transfer and
// producer request as well as D's id: one naming another transfer under
// d-1's id (a later request's, or a forged one) extends nothing, nor does
// one from an engine d-1 does not read from.
func TestPullHoldAnswerForAnotherRequestDoesNotExtend(t *testing.T) {
	for _, tc := range []struct{ name, from, agent, tid, preq string }{
		{"another transfer", "P/0", "P/0", "t-other", "p-1"},
		{"another producer request", "P/0", "P/0", "", "p-9"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hp := newHoldPair(t)
			meta := hp.pullHold(t, false)
			tid := meta.Recv[0].TransferID
			if tc.tid != "" {
				tid = tc.tid
			}
			hp.advance(t, 22*time.Second)
			hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
			hp.d.drive(nil, "")
			hp.d.run(t, "handshake P tp=1")
			hp.dropHolds = true
			m := hp.d.st.self(&msg{Kind: msgHold, IDs: []string{tid, tc.preq, "d-1"}, Holds: []time.Time{traceEpoch.Add(60 * time.Second)}})
			m.Engine, m.Addr = "P", "P:1"
			hp.d.st.Step(hp.d.now, input{kind: inNotifs, notifs: []Notif{{From: PeerName(tc.agent), Msg: appendMsg(nil, m)}}})
			hp.d.drive(nil, "")
			var all []string
			for range 13 {
				got := hp.advance(t, time.Second)
				all = append(all, got)
				if strings.Contains(got, "outcome") {
					break
				}
			}
			if got := strings.Join(all, "\n"); !strings.Contains(got, "outcome recv d-1 expired") {
				t.Errorf("d-1's READ in flight past P's 30 s lease, a hold answer of another request:\n%s\nwant d-1 expired", got)
			}
		})
	}
}

// queued has a real producer Scheduler finish p-1 (a 30 s lease) and
// stages it on P's core, and a real consumer Scheduler take d-1 for those
// params at its arrival (NewRequest), publishing it to D's core: d-1
// waits in D's queue, not allocated. It returns D's Scheduler and d-1.
func (hp *holdPair) queued(t *testing.T) (*Scheduler, *Request) {
	t.Helper()
	return hp.queuedAfter(t, 0)
}

// queuedAfter is queued with d-1 arriving at D `after` P finished p-1
// (both clocks moved on meanwhile, D's rank idle).
func (hp *holdPair) queuedAfter(t *testing.T, after time.Duration) (*Scheduler, *Request) {
	t.Helper()
	d, r, out := hp.arrives(t, after)
	if strings.Contains(out, "handshake P at") {
		out += "\n" + hp.d.run(t, "handshake P tp=1")
	}
	hp.settle(t, out)
	return d, r
}

// arrives has P finish p-1 (held under its 30 s lease) and d-1 arrive at
// D `after` that (both clocks moved on meanwhile, D's rank idle): D's
// Scheduler takes it in (NewRequest) and its step awaits it. It returns
// D's Scheduler, d-1, and what D's core printed for that step (a
// handshake of P asked for is left to the caller to answer).
func (hp *holdPair) arrives(t *testing.T, after time.Duration) (*Scheduler, *Request, string) {
	t.Helper()
	p, pc := newSched(t, ModePull, func(c *SchedulerConfig) {
		c.Generation = gen1 // its params carry its generation (the trace handshake's)
		c.TPSize, c.EngineID, c.Addr = 1, "P", "P:1"
	})
	pc.t = traceEpoch
	hold, params, err := p.RequestFinished(&Request{ID: "p-1", PromptTokens: 80, Params: &TransferParams{DoRemoteDecode: true}},
		FinishLengthCapped, [][]topology.BlockID{ids(1, 2, 3, 4, 5)}, 80)
	if err != nil || !hold {
		t.Fatalf("P finish = %v, %+v, %v; want its blocks held", hold, params, err)
	}
	hp.p.st.Step(hp.p.now, input{kind: inEvent, ev: &event{kind: evStep, meta: p.BuildMeta()}})
	hp.p.drive(nil, "")
	if after > 0 {
		hp.advance(t, after)
	}
	d, dc := newSched(t, ModePull, func(c *SchedulerConfig) { c.TPSize, c.EngineID, c.Addr = 1, "D", "D:1" })
	dc.t = traceEpoch.Add(after)
	r := &Request{ID: "d-1", PromptTokens: 80, Params: params}
	if err := d.NewRequest(r); err != nil {
		t.Fatal(err)
	}
	meta := d.BuildMeta()
	if len(meta.Await) != 1 || !d.HasPendingWork() && len(meta.Await) == 0 {
		t.Fatalf("D's step after d-1 arrived = %+v, want it awaited", meta)
	}
	hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	return d, r, strings.Join(hp.d.drive(nil, ""), "\n")
}

// A pull consumer request that waits in D's queue (not allocated) 40 s,
// past P's 30 s lease, then is allocated: D's ranks heartbeat it from its
// arrival, P keeps its hold and answers with it, and the READ posted at
// 40 s is within the hold: it loads. Before, D's ranks heartbeat only
// requests allocated to them: P's lease lapsed while d-1 waited, and the
// READ was refused at its start (expired: recomputed).
func TestPullQueuedPastTheLeaseIsLoaded(t *testing.T) {
	hp := newHoldPair(t)
	hp.advance(t, time.Second)
	d, r := hp.queued(t)
	for range 39 {
		if got := hp.advance(t, time.Second); strings.Contains(got, "outcome") {
			t.Fatalf("d-1 waiting at %v: %s", hp.d.now.Sub(traceEpoch), got)
		}
	}
	if hp.holds == 0 {
		t.Fatal("P never answered D's heartbeats for d-1 while it waited")
	}
	hp.allocatedAndRead(t, d, r, "d-1 allocated at 41 s, 10 s past P's first expiry, its hold kept by heartbeats since it arrived")
}

// allocatedAndRead allocates d-1 (r, waiting in d's queue) and checks
// that its READ is posted (when is what the caller says of it) and that
// d-1 ends done with it.
func (hp *holdPair) allocatedAndRead(t *testing.T, d *Scheduler, r *Request, when string) {
	t.Helper()
	n, async := d.MatchedTokens(r, 0)
	if n == 0 || !async {
		t.Fatalf("MatchedTokens = %d, %v; want the producer's tokens, async", n, async)
	}
	if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(5, 6, 7, 8, 9, 10)}, External: n}); err != nil {
		t.Fatal(err)
	}
	meta := d.BuildMeta()
	if len(meta.Recv) != 1 || len(meta.Await) != 0 || len(meta.AwaitEnd) != 0 {
		t.Fatalf("D's step allocating d-1 = %+v, want its receive alone", meta)
	}
	hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	out := hp.settle(t, strings.Join(hp.d.drive(nil, ""), "\n"))
	if strings.Contains(out, "probe P at") {
		// P's clock measured again: its handshake was long ago.
		out += "\n" + hp.d.run(t, "handshake P tp=1 probe=true")
	}
	if !strings.Contains(out, "post #1 read P/0") {
		t.Fatalf("%s:\n%s\nwant its READ posted", when, out)
	}
	if got := hp.advance(t, time.Second) + "\n" + hp.d.run(t, "ended xfer=1"); !strings.Contains(got, "outcome recv d-1 done") {
		t.Errorf("d-1's READ ended:\n%s\nwant d-1 done", got)
	}
}

// A pull consumer request that arrives 26 s into P's 30 s lease (the
// router slow to hand P's params on, or D's front end queued it) waits in
// D's queue past P's expiry: D's rank, idle until then, heartbeats it as
// soon as P's engine is handshaken, not a heartbeat interval (lease/6,
// 5 s) after, so P keeps its hold and d-1, allocated at 40 s, is loaded.
// Before, the first heartbeat went at 31 s: P had let p-1's blocks go at
// 30 s, and d-1's READ was refused (expired: recomputed).
func TestPullQueuedLateInTheLeaseHeartbeatenAtOnce(t *testing.T) {
	hp := newHoldPair(t)
	d, r := hp.queuedAfter(t, 26*time.Second)
	for range 3 {
		hp.advance(t, time.Second)
	}
	if hp.holds == 0 {
		t.Fatalf("d-1 arrived at D 26 s into P's 30 s lease; at 29 s P answered no heartbeat of it (P's output: %s); want one at its arrival",
			strings.Join(hp.pOut, "\n"))
	}
	for range 11 {
		if got := hp.advance(t, time.Second); strings.Contains(got, "outcome") {
			t.Fatalf("d-1 waiting at %v: %s", hp.d.now.Sub(traceEpoch), got)
		}
	}
	hp.allocatedAndRead(t, d, r, "d-1 allocated at 40 s, P's hold kept by heartbeats from its arrival at 26 s")
}

// A second waiting request that arrives while the rank ticks already
// (d-1 waits) for a producer engine it has handshaken is heartbeaten in
// the step that brings it, alone: the requests heartbeaten already wait
// for the tick. A request of a step that repeats its entry is not beaten
// again.
func TestPullQueuedSecondHeartbeatenAtItsStep(t *testing.T) {
	hp := newHoldPair(t)
	hp.queued(t)
	hp.advance(t, time.Second)
	a := AwaitReq{ReqID: "d-2", TransferID: "t-2", Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p-2", TPSize: 1, PPSize: 1,
		Expiry: hp.d.now.Add(20 * time.Second)}}
	for i, want := range []string{"heartbeat ids=t-2,p-2,d-2", ""} {
		hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: hp.d.now, Await: []AwaitReq{a}}}})
		out := strings.Join(hp.d.drive(nil, ""), "\n")
		if want == "" && strings.Contains(out, "heartbeat") || want != "" && (!strings.Contains(out, want) || strings.Contains(out, "d-1")) {
			t.Errorf("step %d awaiting d-2 (d-1 waiting, P handshaken):\n%s\nwant %q alone", i+1, out, want)
		}
	}
}

// A waiting request whose receive the rank refuses (past its
// MaxRequests, the refusal its one outcome: failed) stops its heartbeats
// with that outcome: the engine recomputes it, and P, which its
// heartbeats reached, is told: p-1 fails at once (before, it lapsed at
// its lease). Before that, the wait outlived its request: each heartbeat
// extended P's hold, P's answer extended the wait's estimate, and P held
// p-1's blocks as long as D's rank lived.
func TestPullQueuedReceiveRefusedStopsHeartbeats(t *testing.T) {
	hp := newHoldPair(t)
	d, r := hp.queued(t)
	hp.advance(t, 10*time.Second)
	n, _ := d.MatchedTokens(r, 0)
	if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(5, 6, 7, 8, 9, 10)}, External: n}); err != nil {
		t.Fatal(err)
	}
	hp.d.st.cfg.MaxRequests = 0 // the rank is full
	hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: d.BuildMeta()}})
	if out := hp.settle(t, strings.Join(hp.d.drive(nil, ""), "\n")); !strings.Contains(out, "outcome recv d-1 failed") {
		t.Fatalf("d-1's receive on a full rank:\n%s\nwant it refused (failed)", out)
	}
	var dOut []string
	for range 60 {
		dOut = append(dOut, hp.advance(t, time.Second))
	}
	if got := strings.Join(dOut, "\n"); strings.Contains(got, "heartbeat") || len(hp.d.st.waits) != 0 {
		t.Errorf("D's rank after d-1's receive was refused (%d waiting):\n%s\nwant no more heartbeats of it", len(hp.d.st.waits), got)
	}
	if got := strings.Join(hp.pOut, "\n"); !strings.Contains(got, "outcome send p-1 failed") || strings.Contains(got, "outcome send p-1 expired") {
		t.Errorf("P in the 60 s after d-1's receive was refused at D:\n%s\nwant p-1 failed as D told it (not lapsed)", got)
	}
}

// A waiting request that ends in D's queue (aborted before it was
// allocated) stops its heartbeats (P is told to free its blocks, as
// before). And one
// whose producer never answers (an earlier build) stops by itself once
// the params' expiry passed, whether or not it is ever allocated or
// finished.
func TestPullQueuedHeartbeatsStop(t *testing.T) {
	t.Run("ended in the queue", func(t *testing.T) {
		hp := newHoldPair(t)
		d, r := hp.queued(t)
		var got []string
		for range 7 {
			got = append(got, hp.advance(t, time.Second))
		}
		if !strings.Contains(strings.Join(got, "\n"), "heartbeat ids=") {
			t.Fatalf("D 7 s after d-1 arrived:\n%s\nwant a heartbeat of it", strings.Join(got, "\n"))
		}
		if _, _, err := d.RequestFinished(r, FinishAborted, nil, 0); err != nil {
			t.Fatal(err)
		}
		meta := d.BuildMeta()
		if len(meta.AwaitEnd) != 1 {
			t.Fatalf("D's step after d-1 ended in the queue = %+v, want it in AwaitEnd", meta)
		}
		hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
		hp.d.drive(nil, "")
		if len(hp.d.st.waits) != 0 {
			t.Fatalf("D's rank still waits on %d requests", len(hp.d.st.waits))
		}
		var dOut []string
		for range 30 {
			dOut = append(dOut, hp.advance(t, time.Second))
		}
		if got := strings.Join(dOut, "\n"); strings.Contains(got, "heartbeat") {
			t.Errorf("D after d-1 ended in its queue:\n%s\nwant no more heartbeats", got)
		}
	})
	t.Run("no answer", func(t *testing.T) {
		hp := newHoldPair(t)
		hp.dropHolds = true
		hp.queued(t)
		for range 32 {
			hp.advance(t, time.Second)
		}
		if len(hp.d.st.waits) != 0 || hp.d.st.busy() {
			t.Errorf("D's rank 32 s after d-1 arrived, P's 30 s hold never answered: %d waiting, busy %v; want none", len(hp.d.st.waits), hp.d.st.busy())
		}
	})
}

// The Scheduler publishes an arrived pull consumer request once, with the
// next step (StepMeta.Await), and its end once (AwaitEnd) unless its
// receive takes over; one allocated in the step it arrived in is never
// published; params no receive could use are not tracked, and left to
// AfterAlloc to refuse and count (once).
func TestSchedulerAwait(t *testing.T) {
	params := func() *TransferParams {
		return &TransferParams{DoRemotePrefill: true, RemoteEngineID: "P", RemoteAddr: "P:1", RemoteRequestID: "p-1", TransferID: "t-1",
			RemoteBlockIDs: []topology.Span{{IDs: ids(1, 2)}}, RemoteNumTokens: 32, RemoteBlocksExpiry: traceEpoch.Add(30 * time.Second)}
	}
	d, dc := newSched(t, ModePull, func(c *SchedulerConfig) { c.TPSize, c.EngineID, c.Addr = 1, "D", "D:1" })
	dc.t = traceEpoch
	a := &Request{ID: "d-a", PromptTokens: 32, Params: params()}
	b := &Request{ID: "d-b", PromptTokens: 32, Params: params()}
	b.Params.TransferID, b.Params.RemoteRequestID = "t-2", "p-2"
	c := &Request{ID: "d-c", PromptTokens: 32, Params: params()}
	c.Params.TransferID, c.Params.RemoteRequestID = "t-3", "p-3"
	for _, r := range []*Request{a, b, c, a} {
		if err := d.NewRequest(r); err != nil {
			t.Fatal(err)
		}
	}
	if err := d.AfterAlloc(c, Alloc{Blocks: [][]topology.BlockID{ids(7, 8)}, External: 32}); err != nil {
		t.Fatal(err)
	}
	m := d.BuildMeta()
	if len(m.Await) != 2 || m.Await[0].ReqID != "d-a" || m.Await[1].ReqID != "d-b" || m.Await[1].Remote.Expiry.IsZero() || len(m.Recv) != 1 {
		t.Fatalf("step 1 = await %+v, recv %d; want d-a and d-b awaited once, with their expiry, d-c received", m.Await, len(m.Recv))
	}
	if err := d.AfterAlloc(a, Alloc{Blocks: [][]topology.BlockID{ids(3, 4)}, External: 32}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := d.RequestFinished(b, FinishAborted, nil, 0); err != nil {
		t.Fatal(err)
	}
	m = d.BuildMeta()
	if len(m.Await) != 0 || len(m.AwaitEnd) != 1 || m.AwaitEnd[0] != "d-b" {
		t.Fatalf("step 2 = await %+v, ended %v; want d-b's end alone (d-a's receive takes over)", m.Await, m.AwaitEnd)
	}
	if _, _, err := d.RequestFinished(a, FinishStopped, nil, 0); err != nil {
		t.Fatal(err)
	}
	if m = d.BuildMeta(); len(m.AwaitEnd) != 0 {
		t.Fatalf("step 3 ended %v, want none (d-a was received)", m.AwaitEnd)
	}
	bad := &Request{ID: "d-x", PromptTokens: 32, Params: params()}
	bad.Params.RemoteEngineID = ""
	if err := d.NewRequest(bad); err != nil || d.Counters().BadParams != 0 {
		t.Errorf("NewRequest without RemoteEngineID = %v, bad params %d; want it left to AfterAlloc (which refuses it, counted once)", err, d.Counters().BadParams)
	}
	if m = d.BuildMeta(); len(m.Await) != 0 {
		t.Errorf("awaited %+v, want nothing of d-x", m.Await)
	}
	if err := d.AfterAlloc(bad, Alloc{Blocks: [][]topology.BlockID{ids(9, 10)}, External: 32}); err == nil || !strings.Contains(err.Error(), "RemoteEngineID") || d.Counters().BadParams != 1 {
		t.Errorf("AfterAlloc without RemoteEngineID = %v, bad params %d; want it refused naming the field, counted once", err, d.Counters().BadParams)
	}
}

// A pull consumer request its engine preempts back to its queue is not
// awaited again, nor read again: an engine preempts only a request that
// runs (vLLM 0.32's _preempt_request asserts it; a request whose receive
// was staged waits in WAITING_FOR_REMOTE_KVS, in the waiting queue, not
// preemptible), that is after its receive's outcome, and AfterAlloc
// turned its params' DoRemotePrefill off when it staged that receive: the
// producer released its blocks after the READ, and nothing of it is held
// for heartbeats to keep. Whether the load was done or failed, the
// request, queued again, is matched for nothing, allocated for nothing
// staged, and its finish stages nothing: one receive, one outcome.
func TestSchedulerConsumerPreemptedAfterItsReceive(t *testing.T) {
	for _, res := range []Result{ResultDone, ResultFailed} {
		t.Run(res.String(), func(t *testing.T) {
			d, dc := newSched(t, ModePull, func(c *SchedulerConfig) { c.TPSize, c.EngineID, c.Addr = 1, "D", "D:1" })
			dc.t = traceEpoch
			r := &Request{ID: "d-1", PromptTokens: 32, Params: &TransferParams{DoRemotePrefill: true, RemoteEngineID: "P", RemoteAddr: "P:1",
				RemoteRequestID: "p-1", TransferID: "t-1", RemoteBlockIDs: []topology.Span{{IDs: ids(1, 2)}}, RemoteNumTokens: 32,
				RemoteBlocksExpiry: traceEpoch.Add(30 * time.Second)}}
			if err := d.NewRequest(r); err != nil {
				t.Fatal(err)
			}
			if m := d.BuildMeta(); len(m.Await) != 1 {
				t.Fatalf("step 1 = %+v, want d-1 awaited", m)
			}
			n, _ := d.MatchedTokens(r, 0)
			if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(3, 4)}, External: n}); err != nil {
				t.Fatal(err)
			}
			if m := d.BuildMeta(); len(m.Recv) != 1 || len(m.Await) != 0 || len(m.AwaitEnd) != 0 {
				t.Fatalf("step 2 = %+v, want d-1's receive alone", m)
			}
			d.Update(&Finished{Recving: []Outcome{{ReqID: "d-1", Result: res}}})
			// Runs, then is preempted: back in the queue, its blocks freed,
			// its params as AfterAlloc left them (no call tells the
			// scheduler: vLLM makes none for a consumer).
			if n, async := d.MatchedTokens(r, 0); n != 0 || async {
				t.Errorf("MatchedTokens of d-1 queued again = %d, %v; want 0, false (computed here)", n, async)
			}
			if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(5, 6)}}); err != nil {
				t.Fatal(err)
			}
			if m := d.BuildMeta(); len(m.Recv) != 0 || len(m.Await) != 0 || len(m.AwaitEnd) != 0 {
				t.Errorf("step after d-1 was allocated again = %+v, want nothing of it", m)
			}
			if _, _, err := d.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(5, 6)}, 32); err != nil {
				t.Fatal(err)
			}
			if m := d.BuildMeta(); len(m.Recv) != 0 || len(m.AwaitEnd) != 0 || d.HasPendingWork() {
				t.Errorf("step after d-1 finished = %+v (pending %v), want nothing of it", m, d.HasPendingWork())
			}
			if c := d.Counters(); c.BadParams != 0 || c.UnknownUpdates != 0 {
				t.Errorf("counters = %+v, want none", c)
			}
		})
	}
}

// A waiting entry a rank cannot heartbeat (no request, no producer, an
// id past MaxIDBytes) is counted and dropped, the rest of the step kept.
func TestAwaitBadEntryCounted(t *testing.T) {
	c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	c.run(t, "core mode=pull engine=D tp=0/1")
	good := AwaitReq{ReqID: "d-1", TransferID: "t-1", Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p-1"}}
	long := good
	long.ReqID = strings.Repeat("x", MaxIDBytes+1)
	noEngine := good
	noEngine.ReqID, noEngine.Remote.EngineID = "d-2", ""
	c.st.Step(c.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: c.now, Await: []AwaitReq{long, noEngine, good}}}})
	c.drive(nil, "")
	if len(c.st.waits) != 1 || c.st.waits["d-1"] == nil {
		t.Fatalf("waiting = %v, want d-1 alone", c.st.waits)
	}
	if got := c.st.metrics.Snapshot().BadInput["await_req"]; got != 2 {
		t.Errorf("bad input await_req = %d, want 2", got)
	}
}

// A producer answers only a heartbeat that asks (Reason hbAskHold): a
// consumer of an earlier build, which does not ask, is never sent a kind
// it cannot decode. The answer is the deadline the lease now runs to.
func TestHoldAnsweredOnlyWhenAsked(t *testing.T) {
	for _, tc := range []struct {
		reason string
		want   bool
	}{{"", false}, {"reason=" + hbAskHold, true}} {
		c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
		c.run(t, "core mode=pull engine=P tp=0/1")
		c.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32")
		c.run(t, "advance 15s")
		out := c.run(t, "notif from=D/0 kind=heartbeat ids=t1,p-1,d-1 "+tc.reason)
		out += "\n" + c.run(t, "handshake D tp=1")
		answered := strings.Contains(out, "notify D/0 hold ids=t1,p-1,d-1 hold=35s")
		if answered != tc.want || !tc.want && strings.Contains(out, "hold") {
			t.Errorf("heartbeat %q at 15 s of a 30 s lease:\n%s\nwant answered (hold to 35 s): %v", tc.reason, out, tc.want)
		}
	}
}

// A hold longer than a heartbeat's extension (a bidirectional turn's,
// held for DecoderBlocksTTL with no heartbeats expected) is answered with
// its own deadline, not moved: the answer says what the hold is, never
// more.
func TestHoldAnswerOfALongHoldIsItsDeadline(t *testing.T) {
	c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	c.run(t, "core mode=pull engine=D tp=0/1")
	c.run(t, "step send=d-1 tid=t1 blocks=1,2 tokens=32 deadline=480s")
	c.run(t, "advance 10s")
	out := c.run(t, "notif from=P/0 kind=heartbeat ids=t1,d-1,p-2 reason="+hbAskHold)
	out += "\n" + c.run(t, "handshake P tp=1")
	if !strings.Contains(out, "notify P/0 hold ids=t1,d-1,p-2 hold=8m0s") {
		t.Errorf("heartbeat at 10 s of a 480 s hold:\n%s\nwant it answered with the hold's own end, 480 s", out)
	}
}

// A waiting request whose end its rank never hears of (its AwaitEnd was
// in a step dropped whole: unreadable, or no longer kept) is heartbeaten
// for RegistrationTTL from its arrival at most: P, which its heartbeats
// reached, is told then, and p-1 fails (before, its hold lapsed at its
// lease).
// Before, it was heartbeaten as long as the rank lived, each heartbeat
// extending P's hold: P never let p-1's blocks go.
func TestPullQueuedHeartbeatsEndAtRegistrationTTL(t *testing.T) {
	hp := newHoldPair(t)
	hp.d.st.cfg.RegistrationTTL = 120 * time.Second
	hp.queued(t)
	var dOut []string
	for range 200 {
		dOut = append(dOut, hp.advance(t, time.Second))
	}
	if got := strings.Join(dOut[100:118], "\n"); !strings.Contains(got, "heartbeat ids=") {
		t.Errorf("D 100-118 s after d-1 arrived (RegistrationTTL 120 s):\n%s\nwant it still heartbeaten", got)
	}
	if got := strings.Join(dOut[122:], "\n"); strings.Contains(got, "heartbeat") || len(hp.d.st.waits) != 0 {
		t.Errorf("D 122-200 s after d-1 arrived (RegistrationTTL 120 s), %d waiting:\n%s\nwant no heartbeat of it", len(hp.d.st.waits), got)
	}
	if got := strings.Join(hp.pOut, "\n"); !strings.Contains(got, "outcome send p-1 failed") || strings.Contains(got, "outcome send p-1 expired") {
		t.Errorf("P 200 s after d-1 arrived at D, its heartbeats stopped at 120 s:\n%s\nwant p-1 failed as D told it (not lapsed)", got)
	}
}

// A pull consumer request that arrives 22 s into P's 30 s lease while P
// cannot be handshaken (the first handshake fails): the rank's next tick
// (27 s) tries P again, and once that handshake answers the request is
// heartbeaten at once, so P keeps its hold and d-1, allocated at 40 s, is
// loaded. Before, a wait whose engine's handshake had failed was left to
// the ticks: the first heartbeat went a tick after the retry succeeded
// (32 s), P had let p-1's blocks go at 30 s, and d-1's READ was refused
// (expired: recomputed).
func TestPullQueuedHeartbeatenOnceARetriedHandshakeAnswers(t *testing.T) {
	hp := newHoldPair(t)
	d, r, out := hp.arrives(t, 22*time.Second)
	if !strings.Contains(out, "handshake P at") {
		t.Fatalf("d-1's arrival:\n%s\nwant P handshaken", out)
	}
	hp.d.run(t, "handshake P fail=refused")
	// A second request for P arrives before the retry: its step readies
	// the waits whose engine is handshaken (none).
	a := AwaitReq{ReqID: "d-2", TransferID: "t-2", Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p-2", TPSize: 1, PPSize: 1,
		Expiry: hp.d.now.Add(20 * time.Second)}}
	hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: hp.d.now, Await: []AwaitReq{a}}}})
	hp.d.drive(nil, "")
	retried := false
	for range 8 {
		got := hp.advance(t, time.Second)
		if strings.Contains(got, "handshake P at") {
			retried = true
			hp.settle(t, hp.d.run(t, "handshake P tp=1"))
		}
		if hp.holds > 0 || strings.Contains(got, "outcome") {
			break
		}
	}
	if !retried {
		t.Fatal("D's rank never handshook P again while d-1 waited")
	}
	if hp.holds == 0 || hp.d.now.Sub(traceEpoch) > 30*time.Second {
		t.Fatalf("P answered a heartbeat of d-1 first at %v (%d answers; P's lease ends at 30 s); want one as soon as the retried handshake answered",
			hp.d.now.Sub(traceEpoch), hp.holds)
	}
	for hp.d.now.Sub(traceEpoch) < 40*time.Second {
		if got := hp.advance(t, time.Second); strings.Contains(got, "outcome") {
			t.Fatalf("d-1 waiting at %v: %s", hp.d.now.Sub(traceEpoch), got)
		}
	}
	hp.allocatedAndRead(t, d, r, "d-1 allocated at 40 s, P's hold kept by a heartbeat as soon as P answered a retried handshake")
}

// A request that waits for a producer whose handshake fails stays listed
// to be heartbeaten once one answers; an engine that ends it and brings
// it again, over and over, while the producer stays unreachable, does
// not grow that list: it names each waiting request once.
func TestPullQueuedRepeatedWhileUnhandshakenListedOnce(t *testing.T) {
	hp := newHoldPair(t)
	step := func(m *StepMeta) string {
		m.SchedulerClock = hp.d.now
		hp.d.st.Step(hp.d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
		return strings.Join(hp.d.drive(nil, ""), "\n")
	}
	a := AwaitReq{ReqID: "d-1", TransferID: "t-1", Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p-1", TPSize: 1, PPSize: 1,
		Expiry: hp.d.now.Add(20 * time.Second)}}
	if out := step(&StepMeta{Await: []AwaitReq{a}}); strings.Contains(out, "handshake P at") {
		hp.d.run(t, "handshake P fail=refused")
	}
	for range 1000 {
		step(&StepMeta{AwaitEnd: []string{"d-1"}})
		step(&StepMeta{Await: []AwaitReq{a}})
	}
	if n := len(hp.d.st.fresh); n > 2 {
		t.Fatalf("d-1 listed %d times to be heartbeaten (P not handshaken); want once", n)
	}
}
