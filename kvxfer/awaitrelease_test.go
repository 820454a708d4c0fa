package kvxfer

import (
	"errors"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// A pull consumer request waits in its engine's queue (StepMeta.Await),
// heartbeaten at its producer's agent P1/0 at P:1, which extends its hold
// there by its Lease·2/3. Another request moves the engine to P:2; the
// first's receive then comes, naming P:1, and fails as naming its engine
// elsewhere, never asking anyone itself. The agent its wait's heartbeats
// reached is told it ended: the receive took the wait's asked agents over
// (takeWait). Before, the receive's end told only the agents it asked
// itself: none, and P1/0 held the blocks for the whole extension.
func TestReceiveTakesOverTheAgentsItsWaitAsked(t *testing.T) {
	now := traceEpoch
	d := newTestCore(t, "D", ModePull, traceLayout(0, 1, 1<<30), now)
	var asks []hsAsk
	type sent struct {
		peer PeerName
		m    *msg
	}
	var notes []sent
	run := func(in input) Finished {
		t.Helper()
		d.Step(now, in)
		carryOut(d, nil, nil, func(_ int, o *op) error {
			if o.kind == opNotify {
				m, err := decodeMsg(o.msg)
				if err != nil {
					t.Fatalf("a notice that does not decode: %v", err)
				}
				notes = append(notes, sent{o.peer, m})
			}
			return nil
		})
		asks = append(asks, d.fx.asks...)
		d.fx.asks = d.fx.asks[:0]
		out := d.out
		d.out = Finished{}
		return out
	}
	answer := func(a hsAsk, gen uint64, agent PeerName) Finished {
		t.Helper()
		h := &hsResult{engine: a.engine, probe: a.probe, moves: a.moves,
			res:   HandshakeResult{Generation: gen, Ranks: []RankInfo{{EngineID: "P", CompatHash: "h", Layout: traceLayout(0, 1, 1<<20), Agent: []byte(agent)}}},
			names: []PeerName{agent}, loadErrs: []error{nil}}
		return run(input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	}
	q := func(id, addr string, block topology.BlockID) RecvReq {
		return RecvReq{ReqID: id, TransferID: "t-" + id, Deadline: now.Add(time.Minute), Local: []topology.Span{{IDs: []topology.BlockID{block}}},
			Remote: RemoteRef{EngineID: "P", Addr: addr, ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
	}
	step := func(m *StepMeta) Finished {
		t.Helper()
		m.SchedulerClock = now
		return run(input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
	}
	names := func(s sent, id string) bool {
		if s.m.DReq == id {
			return true
		}
		for i := 2; i < len(s.m.IDs); i += 3 {
			if s.m.IDs[i] == id {
				return true
			}
		}
		return false
	}

	q1 := q("d-1", "P:1", 1)
	step(&StepMeta{Await: []AwaitReq{{ReqID: q1.ReqID, TransferID: q1.TransferID, Remote: q1.Remote}}})
	if len(asks) != 1 || asks[0].addr != "P:1" {
		t.Fatalf("asks = %+v, want one handshake at P:1", asks)
	}
	answer(asks[0], 1, "P1/0")
	asks = nil
	beat := false
	for _, s := range notes {
		beat = beat || s.peer == "P1/0" && s.m.Kind == msgHeartbeat && names(s, "d-1")
	}
	if !beat {
		t.Fatalf("sent %+v, want d-1's wait heartbeaten at P1/0", notes)
	}
	notes = nil
	now = now.Add(time.Millisecond)
	step(&StepMeta{Recv: []RecvReq{q("d-2", "P:2", 2)}})
	if len(asks) != 1 || asks[0].addr != "P:2" {
		t.Fatalf("asks = %+v, want one handshake at P:2", asks)
	}
	answer(asks[0], 2, "P2/0")
	out := step(&StepMeta{Recv: []RecvReq{q1}})
	failed := false
	for _, o := range out.Recving {
		failed = failed || o.ReqID == "d-1" && o.Result == ResultFailed
	}
	if !failed {
		t.Fatalf("reported %+v, want d-1 failed as naming its engine elsewhere", out.Recving)
	}
	told := 0
	for _, s := range notes {
		if names(s, "d-1") && s.peer == "P1/0" && s.m.Kind == msgFail && s.m.PReq == "p-d-1" && s.m.TransferID == "t-d-1" {
			told++
		}
	}
	if told != 1 {
		t.Errorf("P1/0, which d-1's wait heartbeated (extending its hold there), was told of d-1's end %d times, want once (sent %+v)", told, notes)
	}
}

// A heartbeat not delivered is sent once more, after the completions of
// its batch were handled: a request it names that ended meanwhile (its
// end's notice queued before the retry) is left out of it, so nothing this
// rank sends after that notice extends the producer's hold of it again.
// Before, the retry went as built, after the notice, naming the ended
// request (the producer, if it had not ended its request at the notice,
// held it another Lease·2/3).
func TestHeartbeatRetryLeavesOutEndedRequests(t *testing.T) {
	now := traceEpoch
	d := newTestCore(t, "D", ModePull, traceLayout(0, 1, 1<<30), now)
	var asks []hsAsk
	var sent []*msg
	var beats []op
	run := func(in input) {
		t.Helper()
		d.Step(now, in)
		carryOut(d, nil, nil, func(_ int, o *op) error {
			if o.kind == opNotify {
				m, err := decodeMsg(o.msg)
				if err != nil {
					t.Fatalf("a notice that does not decode: %v", err)
				}
				sent = append(sent, m)
				if o.notice == noticeHeartbeat {
					beats = append(beats, *o)
				}
			}
			return nil
		})
		asks = append(asks, d.fx.asks...)
		d.fx.asks = d.fx.asks[:0]
		d.out = Finished{}
	}
	await := func(id string) AwaitReq {
		return AwaitReq{ReqID: id, TransferID: "t-" + id, Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
	}
	run(input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: now, Await: []AwaitReq{await("d-1"), await("d-2")}}}})
	if len(asks) != 1 {
		t.Fatalf("asks = %+v, want one handshake", asks)
	}
	a := asks[0]
	h := &hsResult{engine: a.engine, probe: a.probe, moves: a.moves,
		res:   HandshakeResult{Generation: 1, Ranks: []RankInfo{{EngineID: "P", CompatHash: "h", Layout: traceLayout(0, 1, 1<<20), Agent: []byte("P1/0")}}},
		names: []PeerName{"P1/0"}, loadErrs: []error{nil}}
	run(input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	if len(beats) != 1 || len(beats[0].m.IDs) != 6 {
		t.Fatalf("heartbeats %+v, want one naming d-1 and d-2", beats)
	}
	hb := beats[0]
	// d-1 ends (its AwaitEnd); then the heartbeat's completion says it
	// was not delivered.
	sent = nil
	run(input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: now, AwaitEnd: []string{"d-1"}}}})
	run(input{kind: inOpsDone, ops: []op{hb}, errs: []error{errors.New("not delivered")}})
	ended := false
	for _, m := range sent {
		switch {
		case m.Kind == msgFail && m.DReq == "d-1":
			ended = true
		case m.Kind == msgHeartbeat:
			if slices.Contains(m.IDs, "d-1") {
				t.Errorf("sent a heartbeat %v naming d-1 after it ended (its notice sent: %v)", m.IDs, ended)
			}
			if !slices.Contains(m.IDs, "d-2") {
				t.Errorf("sent a heartbeat %v, want d-2, still waiting, in its retry", m.IDs)
			}
		}
	}
	if !ended {
		t.Errorf("sent %+v, want d-1's end told", sent)
	}
}
