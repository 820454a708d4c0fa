package kvxfer

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

// The requests a pull producer rank keeps early completion notices for
// (notices for a request its engine has not handed it yet) are bounded:
// past maxEarly a notice for one more is dropped and counted
// (done_unknown_request); a request whose notices were kept ends on
// arrival, one whose notice was dropped when its consumer's next notice
// comes, and the room comes back once the kept ones lapse
// (RegistrationTTL).
func TestPullEarlyNoticeRequestsBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePull, traceLayout(0, 1, 1<<20), now)
	knowEngine(t, p, "D", 1)
	tc := &traceCore{st: p, now: now, fail: map[opKind]int{}}
	done := func(i int) Notif {
		m := &msg{Kind: msgDone, Engine: "D", Addr: "D:1", TPSize: 1, PPSize: 1,
			TransferID: fmt.Sprintf("t-%d", i), DReq: fmt.Sprintf("d-%d", i), PReq: fmt.Sprintf("p-%d", i)}
		return Notif{From: "D/0", Msg: appendMsg(nil, m)}
	}
	deliver := func(ns ...Notif) string {
		p.Step(tc.now, input{kind: inNotifs, notifs: ns})
		return strings.Join(tc.drive(nil, ""), "\n")
	}
	dropped := func() uint64 { return p.metrics.Snapshot().Dropped["done_unknown_request"] }
	const over = 100
	var ns []Notif
	for i := range maxEarly + over {
		ns = append(ns, done(i))
		if len(ns) == 4096 {
			deliver(ns...)
			ns = nil
		}
	}
	deliver(ns...)
	if got := len(p.early); got != maxEarly {
		t.Fatalf("early notices kept for %d requests after %d notices, want the bound %d", got, maxEarly+over, maxEarly)
	}
	if got := dropped(); got != over {
		t.Errorf(`dropped{reason="done_unknown_request"} = %d, want %d`, got, over)
	}
	send := func(i int) string {
		return tc.run(t, fmt.Sprintf("step send=p-%d tid=t-%d blocks=1,2 tokens=32 deadline=30s", i, i))
	}
	if got := send(3); got != "outcome send p-3 done" {
		t.Errorf("p-3, its notice kept, at its arrival: %q, want done at once", got)
	}
	last := maxEarly + over - 1
	if got := send(last); got != "(nothing)" {
		t.Errorf("p-%d, its notice dropped, at its arrival: %q, want held", last, got)
	}
	if got := deliver(done(last)); got != fmt.Sprintf("outcome send p-%d done", last) {
		t.Errorf("p-%d at its consumer's notice again: %q, want done", last, got)
	}
	// The kept ones lapse at RegistrationTTL (swept at a tick): room again.
	tc.run(t, "advance 1s")
	tc.run(t, "advance "+(p.cfg.RegistrationTTL+time.Minute).String())
	if n := len(p.early); n != 0 {
		t.Fatalf("%d requests' early notices kept past RegistrationTTL, want none", n)
	}
	before := dropped()
	deliver(done(last + 1))
	if p.early[fmt.Sprintf("p-%d", last+1)] == nil || dropped() != before {
		t.Errorf("a notice once the kept ones lapsed: kept %v, %d dropped; want kept", p.early[fmt.Sprintf("p-%d", last+1)] != nil, dropped()-before)
	}
}

// The waiting requests (StepMeta.Await) a pull consumer rank heartbeats
// are bounded: past maxWaits one more is not heartbeaten, counted
// (await_limit); the ones kept are heartbeaten, and room made by one
// ending (AwaitEnd) is taken again.
func TestPullWaitsBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	d := newTestCore(t, "D", ModePull, traceLayout(0, 1, 1<<20), now)
	knowEngine(t, d, "P", 1)
	tc := &traceCore{st: d, now: now, fail: map[opKind]int{}}
	beaten := map[string]bool{}
	tc.onOp = func(o *op) {
		if m, err := decodeMsg(o.msg); o.kind == opNotify && err == nil && m.Kind == msgHeartbeat {
			for i := 0; i+2 < len(m.IDs); i += 3 {
				beaten[m.IDs[i+2]] = true
			}
		}
	}
	await := func(i int) AwaitReq {
		return AwaitReq{ReqID: fmt.Sprintf("d-%d", i), TransferID: fmt.Sprintf("t-%d", i), Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: fmt.Sprintf("p-%d", i)}}
	}
	step := func(m *StepMeta) {
		m.SchedulerClock = tc.now
		d.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
		tc.drive(nil, "")
	}
	const over = 100
	m := &StepMeta{}
	for i := range maxWaits + over {
		m.Await = append(m.Await, await(i))
	}
	step(m)
	if got := len(d.waits); got != maxWaits {
		t.Fatalf("%d waiting requests kept after %d, want the bound %d", got, maxWaits+over, maxWaits)
	}
	if got := d.metrics.Snapshot().Dropped["await_limit"]; got != over {
		t.Errorf(`dropped{reason="await_limit"} = %d, want %d`, got, over)
	}
	if !beaten["d-0"] || !beaten[fmt.Sprintf("d-%d", maxWaits-1)] || beaten[fmt.Sprintf("d-%d", maxWaits)] {
		t.Errorf("heartbeaten: d-0 %v, d-%d %v, d-%d %v; want the kept ones alone", beaten["d-0"], maxWaits-1,
			beaten[fmt.Sprintf("d-%d", maxWaits-1)], maxWaits, beaten[fmt.Sprintf("d-%d", maxWaits)])
	}
	// One ends: a new one takes its place, and is heartbeaten.
	clear(beaten)
	step(&StepMeta{AwaitEnd: []string{"d-0"}, Await: []AwaitReq{await(maxWaits + over)}})
	if id := fmt.Sprintf("d-%d", maxWaits+over); d.waits[id] == nil || !beaten[id] {
		t.Errorf("a waiting request after one ended: kept %v, heartbeaten %v; want both", d.waits[id] != nil, beaten[id])
	}
	if got := d.metrics.Snapshot().Dropped["await_limit"]; got != over {
		t.Errorf(`dropped{reason="await_limit"} = %d after room was made, want still %d`, got, over)
	}
}

// The failure notices a rank keeps to send again (the backend could not
// send them) are bounded: past maxLost one more is given up, counted
// (notice_lost); the kept ones go again at the next tick, which makes
// room for more.
func TestLostNoticesBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), now)
	tc := &traceCore{st: p, now: now, fail: map[opKind]int{}}
	failed := func(i int) *op {
		m := &msg{Kind: msgFail, DReq: fmt.Sprintf("d-%d", i), PReq: fmt.Sprintf("p-%d", i), Reason: "gone", FailKind: FailurePeerGone}
		return &op{kind: opNotify, peer: "D/0", msg: appendMsg(nil, p.self(m)), m: m, notice: noticePlain}
	}
	const over = 10
	for i := range maxLost + over {
		p.noticeDone(failed(i), errors.New("unreachable"))
	}
	if len(p.lost) != maxLost {
		t.Fatalf("%d undelivered failure notices kept, want the bound %d", len(p.lost), maxLost)
	}
	if got := p.metrics.Snapshot().Dropped["notice_lost"]; got != over {
		t.Errorf(`dropped{reason="notice_lost"} = %d, want %d`, got, over)
	}
	resent := 0
	tc.onOp = func(o *op) {
		if o.kind == opNotify && o.notice == noticeResent {
			resent++
		}
	}
	p.resendLost()
	tc.drive(nil, "")
	if resent != maxLost || len(p.lost) != 0 {
		t.Errorf("at the tick: %d sent again, %d still kept; want %d sent (delivered), none kept", resent, len(p.lost), maxLost)
	}
	p.noticeDone(failed(maxLost+over), errors.New("unreachable"))
	if len(p.lost) != 1 {
		t.Errorf("a failure notice not sent after the kept ones went: %d kept, want 1", len(p.lost))
	}
}

// Each heartbeat that extends a hold arms its lease's timer anew: a
// consumer heartbeating as fast as it can (one extension each time the
// loop wakes) leaves the replaced timers stale in the heap, behind an
// earlier live one (another request's shorter lease), which the loop
// compacts as it computes its next wake-up (nextWake), so the heap stays
// within a few entries per request held however many heartbeats come;
// the lease still ends at the last extension.
func TestLeaseTimersBoundedUnderHeartbeats(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "step send=p-0 tid=t0 blocks=3 tokens=16 deadline=5s")
	tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=10s")
	tc.run(t, "notif from=D/0 kind=heartbeat ids=t1,p-1,d-1")
	tc.run(t, "handshake D tp=1")
	hb := Notif{From: "D/0", Msg: appendMsg(nil, &msg{Kind: msgHeartbeat, Engine: "D", Addr: "D:1", TPSize: 1, PPSize: 1, IDs: []string{"t1", "p-1", "d-1"}})}
	st := tc.st
	const n = 4000 // (4 s: p-0's lease, the heap's top, still runs)
	most := 0
	for range n {
		tc.now = tc.now.Add(time.Millisecond)
		st.Step(tc.now, input{kind: inNotifs, notifs: []Notif{hb}})
		tc.drive(nil, "")
		st.nextWake() // (the loop, before it waits)
		most = max(most, len(st.timers))
	}
	if s := st.sends.get("p-1"); s == nil || !s.deadline.Equal(tc.now.Add(20*time.Second)) {
		t.Fatalf("p-1 after %d heartbeats: %+v, want held to 20 s past the last", n, s)
	}
	if most > 66 {
		t.Errorf("the timer heap grew to %d entries under %d heartbeats for one request, want at most 66 (compacted past 64)", most, n)
	}
	if got := tc.run(t, "advance 19s"); got != "outcome send p-0 expired (expired): lease expired" {
		t.Errorf("19 s after the last heartbeat: %q, want p-0 (its lease long over) alone expired", got)
	}
	if got := tc.run(t, "advance 1s"); got != "outcome send p-1 expired (expired): lease expired" {
		t.Errorf("p-1 at its last extension's end: %q, want expired", got)
	}
}

// What the early notices keep in all is bounded in bytes too
// (maxEarlyBytes): within the counts' bounds, peers naming long ids and
// reasons (1 KiB each) keep at most that much; past it a notice is
// dropped and counted (done_unknown_request), a notice of usual ids
// still fits in what is left, and the bytes come back as the kept ones
// are applied or lapse. Before, the counts alone bounded them.
func TestPullEarlyNoticesBoundedInBytes(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePull, traceLayout(0, 1, 1<<20), now)
	knowEngine(t, p, "D", 1)
	tc := &traceCore{st: p, now: now, fail: map[opKind]int{}}
	long := func(s string) string { return s + strings.Repeat("x", 1000-len(s)) }
	fail := func(tid, dreq, preq, reason string) Notif {
		m := &msg{Kind: msgFail, Engine: "D", Addr: "D:1", TPSize: 1, PPSize: 1, TransferID: tid, DReq: dreq, PReq: preq,
			Reason: reason, FailKind: FailurePeerGone}
		return Notif{From: "D/0", Msg: appendMsg(nil, m)}
	}
	deliver := func(ns ...Notif) string {
		p.Step(tc.now, input{kind: inNotifs, notifs: ns})
		return strings.Join(tc.drive(nil, ""), "\n")
	}
	cost := 256 + len("D:1") + 4*1000
	fit := maxEarlyBytes / cost
	if fit >= maxEarly {
		t.Fatalf("%d notices of %d bytes fit, not fewer than maxEarly (%d): the count bound would hit first", fit, cost, maxEarly)
	}
	const over = 100
	var ns []Notif
	for i := range fit + over {
		ns = append(ns, fail(long(fmt.Sprintf("t-%d", i)), long(fmt.Sprintf("d-%d", i)), long(fmt.Sprintf("p-%d", i)), long("gone")))
		if len(ns) == 4096 {
			deliver(ns...)
			ns = nil
		}
	}
	deliver(ns...)
	if p.earlyBytes != fit*cost || len(p.early) != fit {
		t.Fatalf("early notices keep %d bytes for %d requests, want %d (%d of %d bytes: the bound %d)", p.earlyBytes, len(p.early), fit*cost, fit, cost, maxEarlyBytes)
	}
	if got := p.metrics.Snapshot().Dropped["done_unknown_request"]; got != over {
		t.Errorf(`dropped{reason="done_unknown_request"} = %d, want %d`, got, over)
	}
	// A notice of usual ids fits in what is left.
	deliver(fail("t-u", "d-u", "p-u", "gone"))
	if p.early["p-u"] == nil {
		t.Errorf("a notice of usual ids at the byte bound was not kept (%d of %d bytes kept)", p.earlyBytes, maxEarlyBytes)
	}
	// Kept notices apply as their requests arrive, giving their bytes back.
	want := p.earlyBytes - noticeCost(p.early["p-u"].msgs[0])
	if got := tc.run(t, "step send=p-u tid=t-u blocks=1,2 tokens=32 deadline=30s"); !strings.HasPrefix(got, "outcome send p-u failed") {
		t.Errorf("p-u at its arrival: %q, want failed by its kept notice", got)
	}
	if p.earlyBytes != want {
		t.Errorf("after p-u's notice applied: %d bytes kept, want %d", p.earlyBytes, want)
	}
	// The rest lapse at RegistrationTTL: every byte comes back.
	tc.run(t, "advance 1s")
	tc.run(t, "advance "+(p.cfg.RegistrationTTL+time.Minute).String())
	if len(p.early) != 0 || p.earlyBytes != 0 {
		t.Errorf("after the kept notices lapsed: %d requests' notices, %d bytes kept; want none", len(p.early), p.earlyBytes)
	}
}

// The push requests a producer rank remembers as ended paired
// (endedPaired: a registration of another consumer request naming one is
// told at once) are bounded by count (maxEndedPaired, two entries for a
// request with a transfer id, the oldest forgotten first) and by time
// (RegistrationTTL). Flooded past the bound: a registration naming a
// forgotten request waits, as for any request not held yet; one naming a
// request within the bound is still told at once; a new pair is written
// and remembered as ever, the oldest entry making room.
func TestEndedPairedBounded(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=push engine=P tp=0/1")
	st := tc.st
	knowEngine(t, st, "D", 1)
	const over = 10
	n := maxEndedPaired/2 + over
	for i := range n {
		st.rememberPaired(&sendReq{req: SendReq{ReqID: fmt.Sprintf("p-%d", i), TransferID: fmt.Sprintf("t-%d", i)},
			match: &regGroup{key: regKey{engine: "D1", dreq: fmt.Sprintf("d-%d", i)}}})
	}
	if st.endedPaired.len() != maxEndedPaired || len(st.endedPaired.q) != maxEndedPaired {
		t.Fatalf("after %d requests ended paired: %d remembered, %d queued, want the bound %d",
			n, st.endedPaired.len(), len(st.endedPaired.q), maxEndedPaired)
	}
	remembered := func(i int) (p, tid bool) {
		_, _, p = st.endedPaired.get(fmt.Sprintf("p:p-%d", i))
		_, _, tid = st.endedPaired.get(fmt.Sprintf("t:t-%d", i))
		return p, tid
	}
	for _, c := range []struct {
		i    int
		want bool
	}{{0, false}, {over - 1, false}, {over, true}, {n - 1, true}} {
		if p, tid := remembered(c.i); p != c.want || tid != c.want {
			t.Errorf("p-%d remembered by id %v, by transfer id %v; want %v", c.i, p, tid, c.want)
		}
	}
	last := n - 1
	if got, want := tc.run(t, fmt.Sprintf("notif from=D/0 kind=reg tid=t-%d dreq=x-new preq=p-%d spans=11", last, last)),
		fmt.Sprintf(`notify D/0 fail tid=t-%d dreq=x-new preq=p-%d reason="the producer request it names (p-%d) was paired with consumer request \"d-%d\" of engine \"D1\", and has ended" kind=transfer_setup_failed`,
			last, last, last, last); got != want {
		t.Errorf("a registration naming p-%d, remembered:\n%s\nwant told at once:\n%s", last, got, want)
	}
	if got := tc.run(t, "notif from=D/0 kind=reg tid=t-0 dreq=x-old preq=p-0 spans=12"); got != "(nothing)" {
		t.Errorf("a registration naming p-0, forgotten: %q, want it waiting", got)
	}
	// Healthy traffic: a new pair is written, and remembered once it ends.
	tc.run(t, "notif from=D/0 kind=reg tid=t-new dreq=d-new preq=p-new spans=13")
	if got := tc.run(t, "step send=p-new tid=t-new blocks=1 tokens=16"); got != "post #1 write D/0: 1 descs, 512 bytes, then done tid=t-new dreq=d-new preq=p-new" {
		t.Errorf("a new pair: %q, want written", got)
	}
	if got := tc.run(t, "ended xfer=1"); got != "outcome send p-new done" {
		t.Errorf("its WRITE ended: %q, want done", got)
	}
	if _, _, ok := st.endedPaired.get("t:t-new"); !ok || st.endedPaired.len() != maxEndedPaired {
		t.Errorf("p-new ended paired: remembered %v, %d remembered in all; want remembered, the bound %d", ok, st.endedPaired.len(), maxEndedPaired)
	}
	if p, tid := remembered(over); p || tid {
		t.Errorf("p-%d, the oldest remembered, not forgotten for p-new (by id %v, by transfer id %v)", over, p, tid)
	}
	// Past RegistrationTTL (swept at a tick): none remembered.
	tc.run(t, "advance 1s")
	tc.run(t, "advance "+(st.cfg.RegistrationTTL+time.Minute).String())
	if st.endedPaired.len() != 0 || len(st.endedPaired.q) != 0 {
		t.Errorf("past RegistrationTTL: %d remembered, %d queued, want none", st.endedPaired.len(), len(st.endedPaired.q))
	}
}

// A pull producer rank remembers the requests that ended (a consumer's
// notice after that is dropped as late: done_after_end) up to maxAborted
// of each of ids and transfer ids: past it the oldest are forgotten,
// counted (ended_limit), and a notice for one is kept as an early one.
// Before, past the bound the newest were not remembered (for the 8
// minutes of RegistrationTTL), and every late notice of theirs was kept.
func TestPullEndedBound(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	st := tc.st
	knowEngine(t, st, "D", 1)
	snap := func() map[string]uint64 { return st.metrics.Snapshot().Dropped }
	end := func(i int) {
		tc.run(t, fmt.Sprintf("step send=p-%d tid=t-%d blocks=1 tokens=16 deadline=1s", i, i))
		if got, want := tc.run(t, "advance 2s"), fmt.Sprintf("outcome send p-%d expired (expired): lease expired", i); got != want {
			t.Fatalf("p-%d past its lease: %q, want %q", i, got, want)
		}
	}
	late := func(i int) string {
		return tc.run(t, fmt.Sprintf("notif from=D/0 kind=done tid=t-%d dreq=d-%d preq=p-%d", i, i, i))
	}
	// Within the bound: remembered, a late notice dropped as late.
	end(0)
	late(0)
	if n := snap()["done_after_end"]; n != 1 || len(st.early) != 0 {
		t.Fatalf("a late notice of p-0, remembered: done_after_end %d, %d kept early; want 1, none", n, len(st.early))
	}
	// Fill the memory up to its bound: the oldest, p-0, is forgotten
	// first.
	for i := st.abortedP.len(); i < maxAborted; i++ {
		st.abortedP.put(fmt.Sprintf("x-%d", i), tc.now, goneSend{}, maxAborted)
		st.abortedT.put(fmt.Sprintf("tx-%d", i), tc.now, goneSend{}, maxAborted)
	}
	end(1)
	if n := snap()["ended_limit"]; n != 2 {
		t.Errorf(`dropped{reason="ended_limit"} = %d once p-1 ended past the bound, want 2 (p-0's id and transfer id forgotten)`, n)
	}
	if _, _, ok := st.abortedP.get("p-1"); !ok || st.abortedP.len() != maxAborted || st.abortedT.len() != maxAborted {
		t.Errorf("past the bound: p-1 remembered %v, %d ids and %d transfer ids remembered; want it remembered, the bound %d", ok, st.abortedP.len(), st.abortedT.len(), maxAborted)
	}
	late(1)
	if st.early["p-1"] != nil || snap()["done_after_end"] != 2 {
		t.Errorf("a late notice of p-1, the newest: kept early %v, done_after_end %d; want dropped as late, 2", st.early["p-1"] != nil, snap()["done_after_end"])
	}
	late(0)
	if st.early["p-0"] == nil {
		t.Errorf("a late notice of p-0, forgotten: not kept as an early one")
	}
}

// The messages a rank keeps for peer engines whose handshake is pending
// (engine.outbox) are bounded, all engines together: an engine that hands
// over requests aborted before they were scheduled (each a release to its
// producer's ranks, holding nothing else) while the producer's handshake
// is pending fills it up to maxOutbox; one more is dropped, counted
// (outbox_full). The handshake's answer sends the kept ones and makes the
// room again, and requests carry on.
func TestOutboxBounded(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=push engine=D tp=0/1")
	st := tc.st
	aborted := func(i int) RecvReq {
		return RecvReq{ReqID: fmt.Sprintf("d-%d", i), TransferID: fmt.Sprintf("t-%d", i), Aborted: true,
			Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: fmt.Sprintf("p-%d", i), TPSize: 1, PPSize: 1, Tokens: 16}}
	}
	const over = 100
	m := &StepMeta{SchedulerClock: tc.now}
	for i := range maxOutbox + over {
		m.Recv = append(m.Recv, aborted(i))
	}
	st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
	tc.drive(nil, "")
	e := st.engines["P"]
	if e == nil || e.state != hsPending || len(e.outbox) != maxOutbox || st.outboxed != maxOutbox {
		t.Fatalf("after %d aborted requests naming P, its handshake pending: outbox %d (outboxed %d), want the bound %d",
			maxOutbox+over, len(e.outbox), st.outboxed, maxOutbox)
	}
	if n := st.metrics.Snapshot().Dropped["outbox_full"]; n != over {
		t.Errorf(`dropped{reason="outbox_full"} = %d, want %d`, n, over)
	}
	sent := 0
	tc.onOp = func(o *op) {
		if o.kind == opNotify {
			sent++
		}
	}
	tc.run(t, "handshake P tp=1")
	if sent != maxOutbox || len(e.outbox) != 0 || st.outboxed != 0 {
		t.Errorf("at P's handshake: %d sent, %d kept (outboxed %d); want the %d kept sent, none left", sent, len(e.outbox), st.outboxed, maxOutbox)
	}
	// Requests carry on: one more aborted one is released at once.
	tc.onOp = nil
	if got := tc.run(t, "step recv=d-new remote=P tid=t-new preq=p-new blocks=1 aborted=true"); got != "notify P/0 reg tid=t-new dreq=d-new preq=p-new\noutcome recv d-new aborted: aborted before it was scheduled" {
		t.Errorf("an aborted request once P's handshake is in: %q, want its release sent", got)
	}
}
