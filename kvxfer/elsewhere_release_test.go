package kvxfer

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// Two live producer engines share an id at two addresses (P:1, P:2). A
// pull consumer request names P:1: the engine is handshaken there and
// the hold check asks P:1's agent, which extends its hold by its own
// Lease·2/3 (20 s with the default lease, whatever the request's lease).
// A request that came in after names P:2: the engine moves there, and
// the first fails as naming it elsewhere. The agent it asked is told that
// the request ended (never the agent at P:2, which holds nothing of it).
// Before, nothing told it: P:1 held its blocks until that extension ran
// out, past the request's own lease (TestTwoProducersShareAnID/nixl
// failed on a loaded machine: "p-c1 did not end within 10 s").
func TestRequestFailedElsewhereReleasesTheAgentItAsked(t *testing.T) {
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
	recv := func(id, addr string, block topology.BlockID) Finished {
		t.Helper()
		q := RecvReq{ReqID: id, TransferID: "t-" + id, Deadline: now.Add(time.Minute), Local: []topology.Span{{IDs: []topology.BlockID{block}}},
			Remote: RemoteRef{EngineID: "P", Addr: addr, ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
		return run(input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: now, Recv: []RecvReq{q}}}})
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

	recv("d-1", "P:1", 1)
	if len(asks) != 1 || asks[0].addr != "P:1" {
		t.Fatalf("asks = %+v, want one handshake at P:1", asks)
	}
	answer(asks[0], 1, "P1/0")
	asks = nil
	asked := false
	for _, s := range notes {
		asked = asked || s.peer == "P1/0" && s.m.Kind == msgHeartbeat && names(s, "d-1")
	}
	if !asked {
		t.Fatalf("sent %+v, want d-1's hold check asking P1/0", notes)
	}
	notes = nil
	now = now.Add(time.Millisecond)
	recv("d-2", "P:2", 2)
	if len(asks) != 1 || asks[0].addr != "P:2" {
		t.Fatalf("asks = %+v, want one handshake at P:2", asks)
	}
	out := answer(asks[0], 2, "P2/0")
	var failed bool
	for _, o := range out.Recving {
		failed = failed || o.ReqID == "d-1" && o.Result == ResultFailed
	}
	if !failed {
		t.Fatalf("reported %+v, want d-1 failed as naming its engine elsewhere", out.Recving)
	}
	told := 0
	for _, s := range notes {
		if !names(s, "d-1") {
			continue
		}
		switch {
		case s.peer == "P1/0" && (s.m.Kind == msgFail || s.m.Kind == msgDone) && s.m.PReq == "p-d-1" && s.m.TransferID == "t-d-1":
			told++
		case s.peer == "P1/0":
			t.Errorf("P1/0 sent %+v about d-1 after it ended, want only the notice of its end", s.m)
		default:
			t.Errorf("%s sent %+v about d-1, want nothing sent to the engine at the other address", s.peer, s.m)
		}
	}
	if told != 1 {
		t.Errorf("P1/0, which d-1's hold check asked (extending its hold there), was told of d-1's end %d times, want once", told)
	}
}
