package kvxfer

import (
	"fmt"
	"testing"
)

// A pull producer keeps a consumer's completion notice for a request it
// does not hold yet (the early notices). What one request's notices keep
// is bounded as every resource a peer can grow: a consumer rank that
// sends its notice again and again (a resend, a bug, a hostile daemon
// holding the secret) keeps one, not one per message; its first is what
// counts when the request arrives (a duplicate is dropped then anyway).
func TestPullEarlyNoticesBoundedPerRequest(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-1 preq=p-1 tp=2")
	tc.run(t, "handshake D tp=2")
	const n = 5001
	for i := range n {
		rank := i % 2
		tid := "t1"
		if i%3 == 0 {
			tid = fmt.Sprintf("x%d", i) // other transfers under the id: one per rank stands
		}
		tc.run(t, fmt.Sprintf("notif from=D/%d kind=done tid=%s dreq=d-1 preq=p-1 tp=2", rank, tid))
	}
	e := tc.st.early["p-1"]
	if e == nil {
		t.Fatal("the early notices of p-1 were not kept")
	}
	if len(e.msgs) > 2 {
		t.Errorf("p-1 keeps %d early notices after %d from 2 consumer ranks, want at most one per rank (2)", len(e.msgs), n+1)
	}
	// The request, when it arrives, counts both ranks once: done.
	if got := tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=30s"); got != "outcome send p-1 done" {
		t.Errorf("p-1 held after its consumer ranks reported: %q, want done at once", got)
	}
}
