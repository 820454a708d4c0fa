package kvxfer

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// A push consumer that gives up on a producer gone silent, with the data
// plane's grants in force, still waits for the producer to confirm its
// cancel before it reports the request (its blocks free): the grants are
// by block and peer, and the engine registers the blocks again, with the
// same producer, for its next request, so the table would admit the
// producer's late WRITE for the first request into the second's blocks.
// FuzzCores found it (P TP 2 with D TP 1, grants: D's registration
// reached P after D failed the request, P wrote it into blocks D had
// handed to its next request): testdata/fuzz/FuzzCores/peer-gone-regrant.
func TestPeerGoneWaitsForConfirmationWithGrants(t *testing.T) {
	now := traceEpoch
	l := traceLayout(0, 1, 1<<30)
	d := newTestCore(t, "D", ModePush, l, now)
	d.guarded = true
	table := newAccessTable(&l, []int{16}, ModePush, NewMetrics())
	var asks []hsAsk
	run := func(in input) Finished {
		t.Helper()
		d.Step(now, in)
		carryOut(d, nil, nil, func(_ int, o *op) error {
			switch o.kind {
			case opGrant:
				table.grantWrite(o.grant, o.peers, o.spans, o.req)
			case opRevoke:
				table.revokeWrite(o.grant)
			}
			return nil
		})
		asks = append(asks, d.fx.asks...)
		d.fx.asks = d.fx.asks[:0]
		out := d.out
		d.out = Finished{}
		return out
	}
	answer := func(err error) Finished {
		t.Helper()
		if len(asks) == 0 {
			t.Fatal("D asked for no handshake")
		}
		a := asks[0]
		asks = asks[1:]
		h := &hsResult{engine: "P", probe: a.probe, err: err}
		if err == nil {
			h.res = HandshakeResult{Generation: 1, Ranks: []RankInfo{{EngineID: "P", CompatHash: "h", Layout: traceLayout(0, 1, 1<<20), Agent: []byte("P/0")}}}
			h.names, h.loadErrs = []PeerName{"P/0"}, []error{nil}
		}
		return run(input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	}
	recv := func(id string) {
		t.Helper()
		q := RecvReq{ReqID: id, TransferID: "t-" + id, Deadline: now.Add(time.Minute), Local: []topology.Span{{IDs: []topology.BlockID{3}}},
			Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
		run(input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: now, Recv: []RecvReq{q}}}})
	}
	block3 := l.Regions[0].Base + 3*uint64(l.Regions[0].BlockLen)

	recv("d-1")
	answer(nil) // d-1 registers: block 3 is granted to P/0
	// P goes silent; D's probe fails past PeerTimeout: d-1 fails.
	now = now.Add(6 * time.Second)
	run(input{kind: inTimers})
	out := answer(fmt.Errorf("injected: %w", context.DeadlineExceeded))
	if len(out.Recving) != 0 {
		// Reported, its block may go to the next request, granted to
		// the same producer, whose late WRITE for d-1 would land in it.
		recv("d-2")
		if answer(nil); table.CheckAccess("P/0", hotpath.OpWrite, block3, 16) == AccessAllow {
			t.Fatalf("D reported d-1 (%+v) before P confirmed its cancel, and P's WRITE for it is admitted into the same block registered for d-2", out.Recving)
		}
		t.Fatalf("D reported d-1 (%+v) before P confirmed its cancel", out.Recving)
	}
	// P confirms: nothing of it can land any more.
	ack := appendMsg(nil, &msg{Kind: msgAck, Engine: "P", Addr: "P:1", TPSize: 1, PPSize: 1, TransferID: "t-d-1", DReq: "d-1", PReq: "p-d-1"})
	out = run(input{kind: inNotifs, notifs: []Notif{{From: "P/0", Msg: ack}}})
	for len(asks) > 0 && len(out.Recving) == 0 { // a message of an engine whose handshake failed waits for a new one
		out = answer(nil)
	}
	if len(out.Recving) != 1 || out.Recving[0].Result != ResultFailed || out.Recving[0].Kind != FailurePeerGone {
		t.Fatalf("after P's confirmation D reported %+v, want d-1 failed: peer gone", out.Recving)
	}
	if a := table.CheckAccess("P/0", hotpath.OpWrite, block3, 16); a == AccessAllow {
		t.Errorf("P/0 may still WRITE into d-1's block after D reported it: %v", a)
	}
}
