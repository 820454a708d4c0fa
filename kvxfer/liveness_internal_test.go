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
// plane's grants in force, reports the request at once, and the engine
// registers its blocks again, with the same producer, for its next
// request: the producer's late WRITE for the first request is refused
// there (it names the request it is for; a grant is for one request),
// and the second request's own WRITE is admitted. FuzzCores found the
// hole when grants were by block and peer (P TP 2 with D TP 1: D's
// registration reached P after D failed the request, P wrote it into
// blocks D had handed to its next request):
// testdata/fuzz/FuzzCores/peer-gone-regrant.
func TestPeerGoneWithGrantsRefusesLateWrites(t *testing.T) {
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
				table.grantWrite(o.grant, o.peers, o.spans, writeKey(o.req, o.tid))
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
		h := &hsResult{engine: "P", probe: a.probe, moves: a.moves, err: err}
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
	answer(nil) // d-1 registers: block 3 is granted to P/0 for d-1
	// P goes silent; D's probe fails past PeerTimeout: d-1 fails, at once.
	now = now.Add(6 * time.Second)
	run(input{kind: inTimers})
	out := answer(fmt.Errorf("injected: %w", context.DeadlineExceeded))
	if len(out.Recving) != 1 || out.Recving[0].Result != ResultFailed || out.Recving[0].Kind != FailurePeerGone {
		t.Fatalf("D reported %+v, want d-1 failed (peer gone) at once", out.Recving)
	}
	// Its block goes to the next request, registered with the same
	// producer.
	recv("d-2")
	for len(asks) > 0 {
		answer(nil)
	}
	write := func(dreq string) Access {
		// As P's notice names it: its transfer, D's request, P's.
		tag := appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPSize: 1, PPSize: 1, TransferID: "t-" + dreq, DReq: dreq, PReq: "p-" + dreq})
		a, _, adm := table.Admit("P/0", hotpath.OpWrite, []Range{{block3, 16}}, tag, nil)
		table.Done(adm)
		return a
	}
	if a := write("d-1"); a == AccessAllow {
		t.Errorf("P's late WRITE for d-1 admitted into the block granted for d-2")
	}
	if a := write("d-2"); a != AccessAllow {
		t.Errorf("d-2's own WRITE: %v, want allowed", a)
	}
}
