package kvxfer

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// A request that names a known producer engine at another address moves
// the engine there: a new handshake at the new address, and the answer
// of the one still out at the old address is not taken as the engine's
// (it answers for a place the engine left). A request that came in
// before the move and names the old address fails once, naming both
// addresses, instead of being sent to the engine at the new one.
func TestEngineMovesToTheAddressARequestNames(t *testing.T) {
	now := traceEpoch
	d := newTestCore(t, "D", ModePush, traceLayout(0, 1, 1<<30), now)
	var asks []hsAsk
	run := func(in input) Finished {
		t.Helper()
		d.Step(now, in)
		carryOut(d, nil, nil, func(int, *op) error { return nil })
		asks = append(asks, d.fx.asks...)
		d.fx.asks = d.fx.asks[:0]
		out := d.out
		d.out = Finished{}
		return out
	}
	answer := func(a hsAsk, gen uint64) Finished {
		t.Helper()
		h := &hsResult{engine: a.engine, probe: a.probe, moves: a.moves,
			res:   HandshakeResult{Generation: gen, Ranks: []RankInfo{{EngineID: "P", CompatHash: "h", Layout: traceLayout(0, 1, 1<<20), Agent: []byte("P/0")}}},
			names: []PeerName{"P/0"}, loadErrs: []error{nil}}
		return run(input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	}
	recv := func(id, addr string, block topology.BlockID) Finished {
		t.Helper()
		q := RecvReq{ReqID: id, TransferID: "t-" + id, Deadline: now.Add(time.Minute), Local: []topology.Span{{IDs: []topology.BlockID{block}}},
			Remote: RemoteRef{EngineID: "P", Addr: addr, ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
		return run(input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: now, Recv: []RecvReq{q}}}})
	}

	recv("d-1", "P:1", 1)
	if len(asks) != 1 || asks[0].addr != "P:1" {
		t.Fatalf("asks = %+v, want one handshake at P:1", asks)
	}
	old := asks[0]
	asks = nil
	now = now.Add(time.Millisecond)
	recv("d-2", "P:2", 2)
	if len(asks) != 1 || asks[0].addr != "P:2" || asks[0].probe {
		t.Fatalf("asks after a request named P at P:2 = %+v, want one handshake there", asks)
	}
	moved := asks[0]
	asks = nil
	// The old address answers first: not the engine's word now.
	if out := answer(old, 1); len(out.Recving) != 0 {
		t.Fatalf("the old address's answer reported %+v", out.Recving)
	}
	if e := d.engines["P"]; e.state != hsPending || e.addr != "P:2" {
		t.Fatalf("after the old address answered: engine state %v at %s, want pending at P:2", e.state, e.addr)
	}
	out := answer(moved, 2)
	if e := d.engines["P"]; e.state != hsReady || e.gen != 2 {
		t.Fatalf("after the new address answered: engine state %v generation %d, want ready at generation 2", e.state, e.gen)
	}
	if len(out.Recving) != 1 || out.Recving[0].ReqID != "d-1" || out.Recving[0].Result != ResultFailed ||
		!strings.Contains(out.Recving[0].Reason, "P:1") || !strings.Contains(out.Recving[0].Reason, "P:2") {
		t.Fatalf("reported %+v, want d-1 failed naming both addresses (d-2 registered with the engine at P:2)", out.Recving)
	}
	// A request that came in after that names the first address: the
	// engine moves back (a move is per request, never a ping-pong).
	now = now.Add(time.Millisecond)
	recv("d-3", "P:1", 3)
	if len(asks) != 1 || asks[0].addr != "P:1" {
		t.Fatalf("asks = %+v, want one handshake at P:1", asks)
	}
}

// A producer engine a request's params named is moved by requests alone:
// a message from an agent its handshake does not list, sent from another
// address (an in-process engine's rank restarted on its own port, which
// differs from the first rank's the params name), has the engine asked
// again where the params say, not moved to the rank's port. Before, it
// moved, and the next request moved it back: two handshakes, a false
// alarm of two engines sharing an id, and the requests in between failed
// as naming an engine elsewhere.
func TestNamedEngineNotMovedByAPeerMessage(t *testing.T) {
	now := traceEpoch
	d := newTestCore(t, "D", ModePush, traceLayout(0, 1, 1<<30), now)
	var asks []hsAsk
	run := func(in input) {
		t.Helper()
		d.Step(now, in)
		carryOut(d, nil, nil, func(int, *op) error { return nil })
		asks = append(asks, d.fx.asks...)
		d.fx.asks = d.fx.asks[:0]
		d.out = Finished{}
	}
	q := RecvReq{ReqID: "d-1", TransferID: "t-1", Deadline: now.Add(time.Minute), Local: []topology.Span{{IDs: []topology.BlockID{1}}},
		Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p-1", TPSize: 1, PPSize: 1, Tokens: 16}}
	run(input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: now, Recv: []RecvReq{q}}}})
	if len(asks) != 1 {
		t.Fatalf("asks = %+v, want one handshake", asks)
	}
	h := &hsResult{engine: "P", moves: asks[0].moves,
		res:   HandshakeResult{Generation: 1, Ranks: []RankInfo{{EngineID: "P", CompatHash: "h", Layout: traceLayout(0, 1, 1<<20), Agent: []byte("P/0")}}},
		names: []PeerName{"P/0"}, loadErrs: []error{nil}}
	asks = nil
	run(input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	now = now.Add(5 * time.Second) // past handshakeRetry: a message from a new agent is verified at once
	m := &msg{Kind: msgDone, Engine: "P", Addr: "P:2", TPSize: 1, PPSize: 1, TransferID: "t-1", DReq: "d-1", PReq: "p-1"}
	run(input{kind: inNotifs, notifs: []Notif{{From: "P/9", Msg: appendMsg(nil, m)}}})
	if e := d.engines["P"]; e.addr != "P:1" {
		t.Errorf("engine P at %s after a message from an unlisted agent at P:2, want P:1 (the params')", e.addr)
	}
	for _, a := range asks {
		if a.addr != "P:1" {
			t.Errorf("asked %+v, want P asked at P:1 alone", a)
		}
	}
	if got := d.metrics.Snapshot().BadInput["engine_id_shared"]; got != 0 {
		t.Errorf("engine_id_shared = %d, want 0", got)
	}
}
