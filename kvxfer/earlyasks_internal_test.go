package kvxfer

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// askNotif is consumer rank tp of D's hold question (a pull heartbeat
// asking, Reason hbAskHold) about producer request preq of transfer tid,
// for its consumer request dreq, naming the producer blocks ids.
func askNotif(tp int, tid, preq, dreq string, ids []topology.BlockID) Notif {
	m := &msg{Kind: msgHeartbeat, Engine: "D", Addr: "D:1", TPRank: tp, TPSize: 2, PPSize: 1, Reason: hbAskHold,
		IDs: []string{tid, preq, dreq}, Spans: []topology.Span{{IDs: ids}}}
	return Notif{From: PeerName(fmt.Sprintf("D/%d", tp)), Msg: appendMsg(nil, m)}
}

// The hold questions a pull producer rank keeps for requests it does not
// hold yet (stashAsk) are bounded as every resource a peer can grow: at
// most maxEarlyAsks requests, and maxAsksPerRequest askers (consumer rank
// and request) for one; past either a question is dropped and counted
// (hold_ask_unknown_request), and a rank that asks again takes no more
// room (its latest stands). What is kept of a question is its blocks'
// digest, not its block lists (a question may name millions of blocks).
// Within the bounds, after the flood, a kept question is answered as its
// request arrives; a dropped one is not (its consumer asks again, and is
// answered then), and the room comes back once the kept ones age out.
func TestPullEarlyHoldAsksBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePull, traceLayout(0, 1, 1<<20), now)
	knowEngine(t, p, "D", 2)
	tc := &traceCore{st: p, now: now, fail: map[opKind]int{}}
	var holds []string // the hold answers P sent, described
	tc.onOp = func(o *op) {
		if o.kind == opNotify {
			if m, err := decodeMsg(o.msg); err == nil && m.Kind == msgHold {
				holds = append(holds, string(o.peer)+" "+describeMsg(o.msg))
			}
		}
	}
	deliver := func(ns []Notif) {
		t.Helper()
		p.Step(tc.now, input{kind: inNotifs, notifs: ns})
		tc.drive(nil, "")
	}
	dropped := func() uint64 { return p.metrics.Snapshot().Dropped["hold_ask_unknown_request"] }

	// Each question names 4096 blocks: 16 KiB of ids, were they kept.
	blocks := make([]topology.BlockID, 4096)
	var list []string
	for i := range blocks {
		blocks[i] = topology.BlockID(i + 1)
		list = append(list, fmt.Sprint(i+1))
	}
	const over = 100
	var ns []Notif
	for i := range maxEarlyAsks + over {
		ns = append(ns, askNotif(0, fmt.Sprintf("t-%d", i), fmt.Sprintf("p-%d", i), fmt.Sprintf("d-%d", i), blocks))
		if len(ns) == 512 {
			deliver(ns)
			ns = nil
		}
	}
	deliver(ns)
	if got := len(p.earlyAsks); got != maxEarlyAsks {
		t.Fatalf("questions about %d requests kept after %d asked, want the bound %d", got, maxEarlyAsks+over, maxEarlyAsks)
	}
	if got := dropped(); got != over {
		t.Errorf(`dropped{reason="hold_ask_unknown_request"} = %d after %d questions past the bound, want %d`, got, over, over)
	}
	if len(holds) != 0 {
		t.Fatalf("P answered questions about requests it does not hold: %q", holds)
	}

	// One request's askers: another consumer request each, from both
	// ranks, past maxAsksPerRequest; and the first asker again and again.
	ns = nil
	for j := range maxAsksPerRequest + over {
		ns = append(ns, askNotif(j%2, "t-0", "p-0", fmt.Sprintf("d-0-%d", j), blocks))
	}
	for range over {
		ns = append(ns, askNotif(0, "t-0", "p-0", "d-0", blocks))
	}
	deliver(ns)
	if got := len(p.earlyAsks["p-0"].msgs); got != maxAsksPerRequest {
		t.Errorf("p-0 keeps %d questions after %d askers (and its first %d times again), want the bound %d",
			got, maxAsksPerRequest+over+1, over+1, maxAsksPerRequest)
	}
	if got, want := dropped(), uint64(over+over+1); got != want {
		t.Errorf(`dropped{reason="hold_ask_unknown_request"} = %d, want %d (%d more past one request's bound)`, got, want, over+1)
	}

	// What is kept is each question's digest: no block list.
	kept := 0
	for k, e := range p.earlyAsks {
		for _, m := range e.msgs {
			kept++
			if m.Spans != nil || m.blocks.mask != 1 {
				t.Fatalf("a kept question about %s holds %d groups of blocks (digest mask %#x), want none: its digest alone", k, len(m.Spans), m.blocks.mask)
			}
		}
	}
	if want := maxEarlyAsks - 1 + maxAsksPerRequest; kept != want {
		t.Errorf("%d questions kept in all, want %d", kept, want)
	}

	// Legitimate traffic after the flood. p-0's request arrives: each of
	// its kept askers is answered at once, with the hold p-0 runs to.
	blockArg := strings.Join(list, ",")
	tc.run(t, "step send=p-0 tid=t-0 blocks="+blockArg+" tokens=32 deadline=30s")
	if len(holds) != maxAsksPerRequest {
		t.Errorf("p-0's arrival answered %d questions, want its %d kept ones", len(holds), maxAsksPerRequest)
	}
	if want := "D/0 hold ids=t-0,p-0,d-0 hold="; len(holds) == 0 || !strings.HasPrefix(holds[0], want) {
		t.Errorf("p-0's first answer %q, want %q...", holds, want)
	}
	if p.earlyAsks["p-0"] != nil {
		t.Errorf("p-0's questions still kept once it was answered")
	}
	// A request whose question was kept: answered on arrival.
	holds = nil
	tc.run(t, "step send=p-7 tid=t-7 blocks="+blockArg+" tokens=32 deadline=30s")
	if len(holds) != 1 || !strings.HasPrefix(holds[0], "D/0 hold ids=t-7,p-7,d-7 hold=") {
		t.Errorf("p-7's arrival answered %q, want its kept question (D/0, d-7)", holds)
	}
	// One whose question was dropped: not answered on arrival; its
	// consumer's next ask is, directly (the request is held: nothing kept).
	holds = nil
	last := maxEarlyAsks + over - 1
	tc.run(t, fmt.Sprintf("step send=p-%d tid=t-%d blocks=%s tokens=32 deadline=30s", last, last, blockArg))
	if len(holds) != 0 {
		t.Errorf("p-%d's arrival answered %q, though its question was dropped", last, holds)
	}
	deliver([]Notif{askNotif(1, fmt.Sprintf("t-%d", last), fmt.Sprintf("p-%d", last), fmt.Sprintf("d-%d", last), blocks)})
	if len(holds) != 1 || !strings.HasPrefix(holds[0], fmt.Sprintf("D/1 hold ids=t-%d,p-%d,d-%d hold=", last, last, last)) {
		t.Errorf("the consumer's next ask about held p-%d: answered %q, want once to D/1", last, holds)
	}
	before := dropped()
	// The kept questions age out (twice the check's bound, swept at a
	// tick, each Lease/6 from the first timers' run): the room is back,
	// and a new early question is kept again.
	tc.run(t, "advance 1s")
	tc.run(t, "advance 5s")
	if n := len(p.earlyAsks); n != 0 {
		t.Errorf("%d requests' questions kept past twice the hold check's bound, want none", n)
	}
	deliver([]Notif{askNotif(0, "t-new", "p-new", "d-new", blocks)})
	if p.earlyAsks["p-new"] == nil || dropped() != before {
		t.Errorf("a question after the kept ones aged out: kept %v, dropped %d more; want it kept", p.earlyAsks["p-new"] != nil, dropped()-before)
	}
}

// What the kept hold questions hold in all is bounded in bytes too
// (maxEarlyAskBytes): within the counts' bounds a peer naming long ids (1
// KiB each, and long fields a heartbeat does not read) keeps at most that
// much; past it a question is dropped and counted, a question of usual
// ids still fits in what is left, and the bytes come back as the kept
// ones are answered or lapse. Before, the counts alone bounded them:
// 262,144 questions of some 8 KiB each.
func TestPullEarlyHoldAsksBoundedInBytes(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePull, traceLayout(0, 1, 1<<20), now)
	knowEngine(t, p, "D", 2)
	tc := &traceCore{st: p, now: now, fail: map[opKind]int{}}
	holds := 0
	tc.onOp = func(o *op) {
		if m, err := decodeMsg(o.msg); o.kind == opNotify && err == nil && m.Kind == msgHold {
			holds++
		}
	}
	deliver := func(ns []Notif) {
		p.Step(tc.now, input{kind: inNotifs, notifs: ns})
		tc.drive(nil, "")
	}
	long := func(s string) string { return s + strings.Repeat("x", 1000-len(s)) }
	ask := func(tid, preq, dreq string) Notif {
		m := &msg{Kind: msgHeartbeat, Engine: "D", Addr: "D:1", TPSize: 2, PPSize: 1, Reason: hbAskHold,
			TransferID: long("tid"), DReq: long("dreq"), PReq: long("preq"),
			IDs: []string{tid, preq, dreq}, Spans: []topology.Span{{IDs: []topology.BlockID{1, 2}}}}
		return Notif{From: "D/0", Msg: appendMsg(nil, m)}
	}
	const reqs, per = 100, 60
	var ns []Notif
	for i := range reqs {
		for j := range per {
			ns = append(ns, ask(long(fmt.Sprintf("t-%d", i)), long(fmt.Sprintf("p-%d", i)), long(fmt.Sprintf("d-%d-%d", i, j))))
		}
	}
	deliver(ns)
	cost := 256 + 3*1000
	fit := maxEarlyAskBytes / cost
	if p.earlyAskBytes != fit*cost {
		t.Fatalf("kept questions cost %d bytes, want %d (%d questions of %d: the bound %d)", p.earlyAskBytes, fit*cost, fit, cost, maxEarlyAskBytes)
	}
	if got, want := p.metrics.Snapshot().Dropped["hold_ask_unknown_request"], uint64(reqs*per-fit); got != want {
		t.Errorf(`dropped{reason="hold_ask_unknown_request"} = %d, want %d`, got, want)
	}
	kept := 0
	for _, e := range p.earlyAsks {
		for _, m := range e.msgs {
			kept++
			if m.TransferID != "" || m.DReq != "" || m.PReq != "" || m.Spans != nil {
				t.Fatalf("a kept question keeps fields its answer does not read: %d, %d, %d bytes, %d groups", len(m.TransferID), len(m.DReq), len(m.PReq), len(m.Spans))
			}
		}
	}
	if kept != fit {
		t.Errorf("%d questions kept, want %d", kept, fit)
	}
	// A question of usual ids fits in what is left.
	deliver([]Notif{ask("t-u", "p-u", "d-u")})
	if p.earlyAsks["p-u"] == nil {
		t.Errorf("a question of usual ids at the byte bound was not kept (%d of %d bytes kept)", p.earlyAskBytes, maxEarlyAskBytes)
	}
	// Its request arrives: answered, and its bytes given back.
	tc.run(t, "step send=p-u tid=t-u blocks=1,2 tokens=32 deadline=30s")
	if holds != 1 || p.earlyAsks["p-u"] != nil || p.earlyAskBytes != fit*cost {
		t.Errorf("p-u's arrival: %d answers, kept %v, %d bytes kept; want 1, none, %d", holds, p.earlyAsks["p-u"] != nil, p.earlyAskBytes, fit*cost)
	}
	// The rest lapse: every byte comes back.
	tc.run(t, "advance 1s")
	tc.run(t, "advance 5s")
	if len(p.earlyAsks) != 0 || p.earlyAskBytes != 0 {
		t.Errorf("after the kept questions lapsed: %d requests' questions, %d bytes kept; want none", len(p.earlyAsks), p.earlyAskBytes)
	}
}
