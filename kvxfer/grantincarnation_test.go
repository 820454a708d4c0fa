package kvxfer

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
)

// A consumer request id used again for another transfer (a router's
// retry, an engine without random request ids) once the request under it
// ended: its WRITE grant is for its own transfer. A late WRITE of the
// earlier transfer (its producer never confirmed the cancel: the consumer
// reported it at its fence timeout) into a block both requests were given
// is refused; before, the grant named the consumer id alone, and that
// WRITE landed the earlier request's KV in the new request's block.
func TestWriteGrantIsForItsTransfer(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	var ops []op
	tc.onOp = func(o *op) {
		if o.kind == opGrant || o.kind == opRevoke {
			ops = append(ops, *o)
		}
	}
	tc.run(t, "core mode=push engine=D tp=0/1")
	tc.st.guarded = true
	tc.run(t, "step recv=d-1 remote=P tid=t1 preq=p-1 blocks=2 tokens=16 deadline=10s")
	tc.run(t, "handshake P tp=1")
	tc.run(t, "advance 11s") // the deadline: cancelled, fenced
	tc.run(t, "advance 1h")  // the fence times out: reported, revoked
	tc.run(t, "step recv=d-1 remote=P tid=t2 preq=p-2 blocks=2 tokens=16 deadline=10s")
	if got := tc.run(t, "handshake P tp=1"); !strings.Contains(got, "notify P/0 reg tid=t2 dreq=d-1 preq=p-2 spans=[2]") {
		t.Fatalf("the new request under d-1: %q, want its registration", got)
	}
	if len(ops) != 3 || ops[0].kind != opGrant || ops[1].kind != opRevoke || ops[2].kind != opGrant {
		t.Fatalf("grant ops %+v, want grant, revoke, grant", ops)
	}
	l := traceLayout(0, 1, 1<<20)
	tab := newAccessTable(&l, []int{16}, ModePush, NewMetrics())
	w := &Worker{access: tab}
	for i := range ops {
		if err := w.do(0, &ops[i]); err != nil {
			t.Fatal(err)
		}
	}
	blockLen := uint64(l.Regions[0].BlockLen)
	block2 := []Range{{l.Regions[0].Base + 2*blockLen, blockLen}}
	write := func(tid, preq string) Access {
		tag := appendMsg(nil, &msg{Kind: msgDone, Engine: "P", TPSize: 1, PPSize: 1, TransferID: tid, DReq: "d-1", PReq: preq})
		a, _, adm := tab.Admit("P/0", hotpath.OpWrite, block2, tag, nil)
		tab.Done(adm)
		return a
	}
	if a := write("t1", "p-1"); a != AccessLate {
		t.Errorf("the late WRITE of the earlier transfer under d-1: %v, want %v", a, AccessLate)
	}
	if a := write("t2", "p-2"); a != AccessAllow {
		t.Errorf("the new request's own WRITE: %v, want %v", a, AccessAllow)
	}
}
