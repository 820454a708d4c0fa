package kvxfer

import (
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
