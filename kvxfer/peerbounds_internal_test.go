package kvxfer

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// The tombstones a push producer rank keeps of requests its consumers
// cancelled (to drop their late registrations and answer their cancels
// again) are bounded as every resource a peer can grow: a consumer that
// cancels ever new requests it never registered makes at most maxTombs;
// one more is dropped, unanswered (as a lost cancel: its rank sends it
// again at each tick until its fence's timeout), and counted
// (cancel_limit). A cancel of a request the rank pairs still stops it,
// and once the tombstones lapse (RegistrationTTL) a cancel is answered
// and remembered again. Before, the tombstones grew without bound.
func TestTombstonesBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), now)
	knowEngine(t, p, "D", 1)
	tc := &traceCore{st: p, now: now, fail: map[opKind]int{}}
	acks := 0
	tc.onOp = func(o *op) {
		if o.kind == opNotify {
			if m, err := decodeMsg(o.msg); err == nil && m.Kind == msgAck {
				acks++
			}
		}
	}
	deliver := func(ns ...*msg) {
		t.Helper()
		var b []Notif
		for _, m := range ns {
			m.Engine, m.Addr, m.TPSize, m.PPSize = "D", "D:1", 1, 1
			b = append(b, Notif{From: "D/0", Msg: appendMsg(nil, m)})
		}
		p.Step(tc.now, input{kind: inNotifs, notifs: b})
		tc.drive(nil, "")
	}
	cancel := func(i int) *msg {
		return &msg{Kind: msgCancel, TransferID: fmt.Sprintf("t-%d", i), DReq: fmt.Sprintf("d-%d", i), PReq: fmt.Sprintf("p-%d", i), Reason: "gave up"}
	}
	dropped := func() uint64 { return p.metrics.Snapshot().Dropped["cancel_limit"] }

	// A pair made before the flood.
	deliver(&msg{Kind: msgReg, TransferID: "t-x", DReq: "d-x", PReq: "p-x", Spans: []topology.Span{{IDs: []topology.BlockID{1}}}})
	p.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{Send: []SendReq{{ReqID: "p-x", TransferID: "t-x",
		Blocks: []topology.Span{{IDs: []topology.BlockID{2}}}, Tokens: 16, Deadline: now.Add(30 * time.Second)}}}}})
	tc.drive(nil, "")
	if s := p.sends.get("p-x"); s == nil || s.match == nil {
		t.Fatalf("p-x did not pair with its registration")
	}

	const over = 100
	var ns []*msg
	for i := range maxTombs + over {
		ns = append(ns, cancel(i))
		if len(ns) == 4096 {
			deliver(ns...)
			ns = nil
		}
	}
	deliver(ns...)
	if got := len(p.tombs); got != maxTombs {
		t.Fatalf("%d tombstones after %d cancels of requests never registered, want the bound %d", got, maxTombs+over, maxTombs)
	}
	if got := dropped(); got != over {
		t.Errorf(`dropped{reason="cancel_limit"} = %d, want %d`, got, over)
	}
	if acks != maxTombs {
		t.Errorf("%d cancels answered, want the %d kept", acks, maxTombs)
	}
	// One already remembered, cancelled again (its first answer lost):
	// answered, nothing more kept.
	acks = 0
	deliver(cancel(7))
	if acks != 1 || len(p.tombs) != maxTombs || dropped() != over {
		t.Errorf("a cancel again of a remembered request: %d answers, %d tombstones, %d dropped; want 1, %d, %d", acks, len(p.tombs), dropped(), maxTombs, over)
	}

	// Legitimate traffic at the bound: the cancel of a request paired
	// before the flood stops it (no tombstone needed to decide), and
	// its end is remembered.
	acks = 0
	// (its WRITE posted: the cancel is answered once it ends)
	deliver(&msg{Kind: msgCancel, TransferID: "t-x", DReq: "d-x", PReq: "p-x", Reason: "gave up"})
	var out string
	for id := range p.handles {
		out += tc.run(t, fmt.Sprintf("ended xfer=%d", id))
	}
	if acks != 1 || !strings.Contains(out, "outcome send p-x") || p.tombs[regKey{engine: "D", dreq: "d-x"}].tid != "t-x" {
		t.Errorf("p-x's cancel at the bound: %d answers, then %q; want it answered, p-x ended and remembered", acks, out)
	}
	// Past RegistrationTTL the tombstones lapse: a new cancel is answered
	// and remembered again.
	tc.now = now.Add(time.Second)
	tc.run(t, "advance 1s")
	tc.now = tc.now.Add(p.cfg.RegistrationTTL + time.Minute)
	tc.run(t, "advance 1s")
	if n := len(p.tombs); n > 1 {
		t.Fatalf("%d tombstones past RegistrationTTL, want at most p-x's", n)
	}
	acks = 0
	deliver(cancel(maxTombs + over + 1))
	if acks != 1 || p.tombs[regKey{engine: "D", dreq: fmt.Sprintf("d-%d", maxTombs+over+1)}].tid == "" || dropped() != over {
		t.Errorf("a cancel once the tombstones lapsed: %d answers, remembered %v, %d dropped; want answered, remembered, none more dropped",
			acks, len(p.tombs), dropped()-over)
	}
}

// The peer engines a rank knows are bounded (maxEngines) whoever names
// them: a message from an engine it does not know starts a handshake
// with it and waits for it, so past the bound one from one more engine is
// dropped, counted (engine_limit), and starts nothing; a known engine's
// messages are handled as ever. Before, peer messages naming ever new
// engines grew them without bound (each a handshake to the address the
// message named).
func TestPeerEnginesBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), now)
	knowEngine(t, p, "D", 1)
	tc := &traceCore{st: p, now: now, fail: map[opKind]int{}}
	handshakes := 0
	reg := func(engine string, i int) Notif {
		m := &msg{Kind: msgReg, Engine: engine, Addr: engine + ":1", TPSize: 1, PPSize: 1, TransferID: fmt.Sprintf("t-%d", i),
			DReq: fmt.Sprintf("d-%d", i), PReq: fmt.Sprintf("p-%d", i), Spans: []topology.Span{{IDs: []topology.BlockID{1}}}}
		return Notif{From: PeerName(engine + "/0"), Msg: appendMsg(nil, m)}
	}
	const over = 100
	var ns []Notif
	for i := range maxEngines + over {
		ns = append(ns, reg(fmt.Sprintf("E-%d", i), i))
	}
	p.Step(tc.now, input{kind: inNotifs, notifs: ns})
	for _, l := range tc.drive(nil, "") {
		if strings.HasPrefix(l, "handshake ") {
			handshakes++
		}
	}
	if len(p.engines) != maxEngines {
		t.Fatalf("%d peer engines known after messages from %d, want the bound %d", len(p.engines), maxEngines+over+1, maxEngines)
	}
	if got := p.metrics.Snapshot().Dropped["engine_limit"]; got != over+1 {
		t.Errorf(`dropped{reason="engine_limit"} = %d, want %d`, got, over+1)
	}
	if handshakes != maxEngines-1 {
		t.Errorf("%d handshakes started, want %d (one per engine kept)", handshakes, maxEngines-1)
	}
	// The known engine's registration pairs with its request.
	p.Step(tc.now, input{kind: inNotifs, notifs: []Notif{reg("D", 0)}})
	p.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{Send: []SendReq{{ReqID: "p-0", TransferID: "t-0",
		Blocks: []topology.Span{{IDs: []topology.BlockID{2}}}, Tokens: 16, Deadline: now.Add(30 * time.Second)}}}}})
	tc.drive(nil, "")
	if s := p.sends.get("p-0"); s == nil || s.match == nil || s.match.key.engine != "D" {
		t.Errorf("p-0 did not pair with known engine D's registration at the bound")
	}
}
