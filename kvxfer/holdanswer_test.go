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
	holds     int // answers P sent
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
	hp.p.run(t, "advance "+step.String())
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
	p, pc := newSched(t, ModePull, func(c *SchedulerConfig) { c.TPSize, c.EngineID, c.Addr = 1, "P", "P:1" })
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
