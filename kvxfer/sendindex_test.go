package kvxfer

import (
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// The producer's request indexes (by transfer id; by base id, oldest
// first) stay what a plain model of them says over random requests held
// and forgotten, several to a base id and to a transfer id.
func TestSendIndexes(t *testing.T) {
	now := time.Unix(1000, 0)
	st := newTestCore(t, "P", ModePull, traceLayout(0, 1, 1<<20), now)
	rng := rand.New(rand.NewPCG(5, 6))
	base := map[string][]string{} // base id -> request ids, oldest first
	tid := map[string]string{}    // transfer id -> request id
	var held []string
	for op := range 5000 {
		if rng.IntN(2) == 0 || len(held) == 0 {
			id := fmt.Sprintf("r%d-%08x", rng.IntN(4), op) // base r0..r3
			if rng.IntN(3) == 0 {
				id = fmt.Sprintf("r%d", rng.IntN(4)) // its own base
			}
			if st.sends.get(id) != nil {
				continue
			}
			req := SendReq{ReqID: id, TransferID: fmt.Sprintf("t%d", rng.IntN(6))}
			if rng.IntN(4) == 0 {
				req.TransferID = ""
			}
			st.newSend(&req, now.Add(time.Hour))
			held = append(held, id)
			if req.TransferID == "" { // a transfer id is matched by itself alone
				b := BaseRequestID(id)
				base[b] = append(base[b], id)
			}
			if _, taken := tid[req.TransferID]; req.TransferID != "" && !taken {
				tid[req.TransferID] = id
			}
		} else {
			i := rng.IntN(len(held))
			id := held[i]
			held = slices.Delete(held, i, i+1)
			s := st.sends.get(id)
			t := s.req.TransferID
			st.forgetSend(s)
			if rng.IntN(8) == 0 {
				st.recycleSends() // as the end of an input does: records reused
			}
			b := BaseRequestID(id)
			base[b] = slices.DeleteFunc(base[b], func(x string) bool { return x == id })
			if len(base[b]) == 0 {
				delete(base, b)
			}
			if tid[t] == id {
				delete(tid, t)
			}
		}
		if len(st.sendBase) != len(base) || st.sendByTID.len() != len(tid) {
			t.Fatalf("op %d: %d base ids and %d transfer ids indexed, want %d and %d", op, len(st.sendBase), st.sendByTID.len(), len(base), len(tid))
		}
		for b, want := range base {
			var got []string
			var prev *sendReq
			for s := st.sendBase[b]; s != nil; s = s.nextBase {
				if s.prevBase != prev {
					t.Fatalf("op %d: base %s: %s's prevBase is not the request before it", op, b, s.req.ReqID)
				}
				got, prev = append(got, s.req.ReqID), s
			}
			if !slices.Equal(got, want) {
				t.Fatalf("op %d: base %s lists %v, want %v", op, b, got, want)
			}
		}
		for k, id := range tid {
			if s := st.sendByTID.get(k); s == nil || s.req.ReqID != id {
				t.Fatalf("op %d: transfer id %s indexes %v, want %s", op, k, s, id)
			}
		}
	}
}

// A producer request taken in by a step and settled at its lease's end
// costs the core no allocation once warm: its record is reused (the
// requests forgotten during one input are recycled when it ends), and
// a request with a transfer id is indexed by it and its own id alone.
func TestProducerRequestZeroAllocs(t *testing.T) {
	if raceOn {
		t.Skip("allocation counts are not meaningful under -race")
	}
	now := time.Unix(1000, 0)
	st := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), now)
	// As kvxferd runs: expiries log at Info, which it leaves off.
	st.log = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
	const n = 256
	metas := make([]StepMeta, 4)
	for k := range metas {
		for i := range n {
			metas[k].Send = append(metas[k].Send, SendReq{ReqID: fmt.Sprintf("s%d-%d", k, i), TransferID: fmt.Sprintf("t%d-%d", k, i)})
		}
	}
	round := 0
	one := func() {
		m := &metas[round%len(metas)]
		round++
		st.Step(now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
		now = now.Add(time.Minute) // past every lease
		st.Step(now, input{kind: inTimers})
		if len(st.out.Sending) != n || st.sends.len()+st.sendByTID.len()+len(st.sendBase) != 0 {
			t.Fatalf("round %d: %d outcomes, %d requests still held", round, len(st.out.Sending), st.sends.len())
		}
		st.out.Clear()
	}
	for range 8 {
		one()
	}
	if a := testing.AllocsPerRun(20, one); a > 1 {
		t.Errorf("%d producer requests in and expired: %v allocations, want at most 1 (a map's occasional rehash)", n, a)
	}
	if len(st.freeSends) != n {
		t.Errorf("%d records kept for reuse, want %d", len(st.freeSends), n)
	}
}

// A rank holds at most WorkerConfig.MaxRequests requests a side: one
// past it fails at once (setup, the bound named, counted), a consumer's
// blocks reported invalid; the others, duplicates of held ones and
// consumer requests that hold nothing carry on, and room made by
// requests ending is taken again.
func TestRequestLimit(t *testing.T) {
	now := time.Unix(1000, 0)
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), now)
	p.cfg.MaxRequests = 2
	send := func(ids ...string) {
		m := &StepMeta{}
		for _, id := range ids {
			m.Send = append(m.Send, SendReq{ReqID: id, TransferID: "t" + id, Blocks: []topology.Span{{IDs: []topology.BlockID{1}}}, Tokens: 16})
		}
		p.Step(now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
	}
	send("a", "b", "c", "a")
	if got := p.out.Sending; len(got) != 1 || got[0].ReqID != "c" || got[0].Result != ResultFailed || got[0].Kind != FailureSetup ||
		!strings.Contains(got[0].Reason, "limit") {
		t.Fatalf("outcomes %+v, want c failed (setup) naming the limit", got)
	}
	if p.sends.len() != 2 {
		t.Fatalf("P holds %d requests, want 2", p.sends.len())
	}
	if s := p.metrics.Snapshot(); s.BadInput["send_req.limit"] != 1 || s.BadInput["send_req.duplicate"] != 1 {
		t.Errorf("bad input counts %v, want one send_req.limit and one send_req.duplicate", s.BadInput)
	}
	p.out.Clear()
	now = now.Add(time.Minute) // a and b expire
	p.Step(now, input{kind: inTimers})
	p.out.Clear()
	send("d")
	if len(p.out.Sending) != 0 || p.sends.get("d") == nil {
		t.Fatalf("after the others ended, d: outcomes %+v, held %v", p.out.Sending, p.sends.get("d") != nil)
	}

	d := newTestCore(t, "D", ModePush, traceLayout(0, 1, 1<<30), now)
	d.cfg.MaxRequests = 1
	m := &StepMeta{}
	for i, id := range []string{"x", "y", "z"} {
		r := RecvReq{ReqID: id, TransferID: "t" + id, Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
		if id != "z" { // z: a full prefix hit, nothing to hold
			r.Local = []topology.Span{{IDs: []topology.BlockID{topology.BlockID(3 + i)}}}
		}
		m.Recv = append(m.Recv, r)
	}
	d.Step(now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
	got := map[string]Outcome{}
	for _, o := range d.out.Recving {
		got[o.ReqID] = o
	}
	if len(got) != 2 || got["y"].Result != ResultFailed || got["y"].Kind != FailureSetup || got["z"].Result != ResultDone {
		t.Fatalf("consumer outcomes %+v, want y failed (setup) and z done", d.out.Recving)
	}
	if !slices.Equal(d.out.InvalidBlocks, []topology.BlockID{4}) {
		t.Errorf("invalid blocks %v, want y's [4]", d.out.InvalidBlocks)
	}
	if len(d.recvs) != 1 || d.recvs["x"] == nil {
		t.Errorf("D holds %d requests, want x alone", len(d.recvs))
	}
}

// The aborted producer requests a push rank remembers (ids an engine
// names in NotProcessed) are bounded, the oldest forgotten first, each
// counted.
func TestAbortedBound(t *testing.T) {
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), time.Unix(1000, 0))
	m := &StepMeta{NotProcessedTransferIDs: map[string]string{}}
	for i := range maxAborted + 10 {
		id := fmt.Sprintf("gone-%d", i)
		m.NotProcessed = append(m.NotProcessed, id)
		m.NotProcessedTransferIDs[id] = "t" + id
	}
	p.Step(p.now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
	if p.abortedP.len() != maxAborted || p.abortedT.len() != maxAborted {
		t.Errorf("remembers %d aborted ids and %d transfer ids, want %d each", p.abortedP.len(), p.abortedT.len(), maxAborted)
	}
	if _, _, ok := p.abortedP.get(fmt.Sprintf("gone-%d", maxAborted+9)); !ok {
		t.Errorf("the newest aborted id is not remembered, want the oldest forgotten first")
	}
	if n := p.metrics.Snapshot().Dropped["ended_limit"]; n != 20 {
		t.Errorf("ended_limit counted %d times, want 20 (10 ids, 10 transfer ids forgotten)", n)
	}
}

// The producer engines a consumer rank's requests may name are bounded:
// a request naming one past the bound fails (handshake, counted), one
// naming a known engine carries on.
func TestEngineBound(t *testing.T) {
	d := newTestCore(t, "D", ModePush, traceLayout(0, 1, 1<<30), time.Unix(1000, 0))
	recv := func(id, engine string) RecvReq {
		return RecvReq{ReqID: id, Local: []topology.Span{{IDs: []topology.BlockID{1}}},
			Remote: RemoteRef{EngineID: engine, Addr: engine + ":1", ReqID: "p" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
	}
	m := &StepMeta{}
	for i := range maxEngines {
		m.Recv = append(m.Recv, recv(fmt.Sprintf("r%d", i), fmt.Sprintf("P%d", i)))
	}
	m.Recv = append(m.Recv, recv("over", "Pnew"), recv("known", "P7"))
	d.Step(d.now, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
	if len(d.out.Recving) != 1 || d.out.Recving[0].ReqID != "over" || d.out.Recving[0].Kind != FailureHandshake {
		t.Fatalf("outcomes %+v, want over failed (handshake)", d.out.Recving)
	}
	if len(d.engines) != maxEngines || d.recvs["known"] == nil {
		t.Errorf("%d engines known (want %d), known held: %v", len(d.engines), maxEngines, d.recvs["known"] != nil)
	}
	if n := d.metrics.Snapshot().BadInput["recv_req.remote.engine_id.limit"]; n != 1 {
		t.Errorf("engine limit counted %d times, want 1", n)
	}
}

// The registrations a producer rank keeps waiting for their requests are
// bounded: one more is refused (its rank told, counted); a request
// arriving still finds the ones kept.
func TestRegistrationBound(t *testing.T) {
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), time.Unix(1000, 0))
	knowEngine(t, p, "D", 1)
	reg := func(i int) Notif {
		m := &msg{Kind: msgReg, Engine: "D", Addr: "D:1", TPSize: 1, PPSize: 1, TransferID: fmt.Sprintf("t%d", i), DReq: fmt.Sprintf("d%d", i),
			PReq: fmt.Sprintf("p%d", i), Spans: []topology.Span{{IDs: []topology.BlockID{1}}}}
		return Notif{From: "D/0", Msg: appendMsg(nil, m)}
	}
	var ns []Notif
	for i := range maxRegs + 1 {
		ns = append(ns, reg(i))
	}
	p.Step(p.now, input{kind: inNotifs, notifs: ns})
	if len(p.regs) != maxRegs {
		t.Fatalf("%d registrations kept, want %d", len(p.regs), maxRegs)
	}
	if n := p.metrics.Snapshot().Dropped["reg_limit"]; n != 1 {
		t.Errorf("reg_limit counted %d times, want 1", n)
	}
	p.Step(p.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{Send: []SendReq{{ReqID: "p5", TransferID: "t5",
		Blocks: []topology.Span{{IDs: []topology.BlockID{2}}}, Tokens: 16}}}}})
	if s := p.sends.get("p5"); s == nil || s.match == nil {
		t.Errorf("p5 did not find its waiting registration")
	}
}

// The block ids held in waiting registrations are bounded too (each may
// be as long as a message): past maxRegIDs one more is refused, its rank
// told and counted; the budget is given back as registrations pair or
// go, so later ones are kept again.
func TestRegistrationIDsBound(t *testing.T) {
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), time.Unix(1000, 0))
	knowEngine(t, p, "D", 1)
	const per = maxWireBlocks
	ids := make([]topology.BlockID, per)
	for i := range ids {
		ids[i] = topology.BlockID(i)
	}
	reg := func(i int) Notif {
		m := &msg{Kind: msgReg, Engine: "D", Addr: "D:1", TPSize: 1, PPSize: 1, TransferID: fmt.Sprintf("t%d", i), DReq: fmt.Sprintf("d%d", i),
			PReq: fmt.Sprintf("p%d", i), Spans: []topology.Span{{IDs: ids}}}
		return Notif{From: "D/0", Msg: appendMsg(nil, m)}
	}
	fit := maxRegIDs / per
	for i := range fit + 1 {
		p.Step(p.now, input{kind: inNotifs, notifs: []Notif{reg(i)}})
	}
	if len(p.regs) != fit || p.regIDs != fit*per {
		t.Fatalf("%d registrations of %d ids kept (%d ids), want %d (%d ids: the limit %d)", len(p.regs), per, p.regIDs, fit, fit*per, maxRegIDs)
	}
	if n := p.metrics.Snapshot().Dropped["reg_limit"]; n != 1 {
		t.Errorf("reg_limit counted %d times, want 1", n)
	}
	// Their requests arrive: each pairs, and gives its ids back.
	var sends []SendReq
	for i := range fit {
		sends = append(sends, SendReq{ReqID: fmt.Sprintf("p%d", i), TransferID: fmt.Sprintf("t%d", i),
			Blocks: []topology.Span{{IDs: []topology.BlockID{2}}}, Tokens: 16})
	}
	p.Step(p.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{Send: sends}}})
	if len(p.regs) != 0 || p.regIDs != 0 {
		t.Fatalf("after their requests paired: %d registrations, %d ids kept, want none", len(p.regs), p.regIDs)
	}
	p.Step(p.now, input{kind: inNotifs, notifs: []Notif{reg(fit + 1)}})
	if len(p.regs) != 1 || p.regIDs != per {
		t.Errorf("a registration after the budget was given back: %d kept (%d ids), want 1 (%d)", len(p.regs), p.regIDs, per)
	}
}
