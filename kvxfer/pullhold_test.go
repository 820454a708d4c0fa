package kvxfer

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"
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

// The same bound holds whatever TP size the notices claim: a consumer rank
// speaks for an engine of the TP size its handshake says, and a notice
// naming another is refused (counted) rather than kept beside the rank's
// own. Before, each TP size claimed kept a notice of its own: a rank
// that sent its notice with a new TP size each time grew the request's
// early notices without bound.
func TestPullEarlyNoticesBoundedWhateverTPSizeClaimed(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-1 preq=p-1 tp=2")
	tc.run(t, "handshake D tp=2")
	const n = 5000
	for i := range n {
		tc.run(t, fmt.Sprintf("notif from=D/%d kind=done tid=t1 dreq=d-1 preq=p-1 tp=%d", i%2, 2+i))
	}
	e := tc.st.early["p-1"]
	if e == nil {
		t.Fatal("the early notices of p-1 were not kept")
	}
	if len(e.msgs) > 2 {
		t.Errorf("p-1 keeps %d early notices after %d from 2 consumer ranks, want at most one per rank (2)", len(e.msgs), n+1)
	}
	if got := tc.st.metrics.Snapshot().BadInput["done.tp_size"]; got != n-1 {
		t.Errorf(`bad_input{field="done.tp_size"} = %d, want %d (every notice naming a TP size other than its engine's)`, got, n-1)
	}
	// The request, when it arrives, waits for the rank whose notice of
	// the right TP size never came.
	if got := tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=30s"); got != "(nothing)" {
		t.Errorf("p-1 at its SendReq: %q, want held for consumer rank 1", got)
	}
	if got := tc.run(t, "notif from=D/1 kind=done tid=t1 dreq=d-1 preq=p-1 tp=2"); got != "outcome send p-1 done" {
		t.Errorf("p-1 after consumer rank 1's notice: %q, want done", got)
	}
}

// What a held pull request keeps of its consumers' completion notices is
// bounded too: a consumer rank that names ever new consumer requests for
// it (each counted on its own: a request read by two consumer requests is
// let go once neither reads) has all but the first maxPullReaders refused,
// counted, and not waited for.
func TestPullReadersBoundedPerRequest(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=30s")
	tc.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-0 preq=p-1 tp=2")
	tc.run(t, "handshake D tp=2")
	const n = 1000
	for i := 1; i < n; i++ {
		tc.run(t, fmt.Sprintf("notif from=D/0 kind=done tid=t1 dreq=d-%d preq=p-1 tp=2", i))
	}
	s := tc.st.sends.get("p-1")
	if s == nil {
		t.Fatal("p-1 ended before any consumer request's ranks all reported")
	}
	if got := len(s.pullSeen); got > maxPullReaders {
		t.Errorf("p-1 keeps %d notices after %d consumer requests' first ranks reported, want at most %d", got, n, maxPullReaders)
	}
	if got := tc.st.metrics.Snapshot().BadInput["done.readers"]; got != n-maxPullReaders {
		t.Errorf(`bad_input{field="done.readers"} = %d, want %d`, got, n-maxPullReaders)
	}
	// It ends once the consumer requests it keeps notices of all read it.
	var got []string
	for i := range maxPullReaders {
		got = append(got, tc.run(t, fmt.Sprintf("notif from=D/1 kind=done tid=t1 dreq=d-%d preq=p-1 tp=2", i)))
	}
	if want := "outcome send p-1 done"; got[len(got)-1] != want || slices.Contains(got[:len(got)-1], want) {
		t.Errorf("p-1 as its consumer requests' second ranks reported: %q, want done at the last", got)
	}
}

// The early notices of a request not held yet are bounded the same way:
// one per consumer rank of at most maxPullReaders consumer requests.
func TestPullEarlyReadersBounded(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-0 preq=p-1 tp=2")
	tc.run(t, "handshake D tp=2")
	const n = 1000
	for i := 1; i < n; i++ {
		tc.run(t, fmt.Sprintf("notif from=D/%d kind=done tid=t1 dreq=d-%d preq=p-1 tp=2", i%2, i))
	}
	e := tc.st.early["p-1"]
	if e == nil {
		t.Fatal("the early notices of p-1 were not kept")
	}
	if got := len(e.msgs); got > maxPullReaders {
		t.Errorf("p-1 keeps %d early notices of %d consumer requests, want at most %d", got, n, maxPullReaders)
	}
	if got := tc.st.metrics.Snapshot().BadInput["done.readers"]; got != n-maxPullReaders {
		t.Errorf(`bad_input{field="done.readers"} = %d, want %d`, got, n-maxPullReaders)
	}
}

// A consumer's completion notice that comes after its producer request
// ended (its lease lapsed, its engine aborted it, or another consumer
// request's notices ended it) is known for what it is: dropped and counted
// (done_after_end), not kept among the early notices for a request that
// will never come. Before, each such notice took a place there for
// RegistrationTTL: a consumer that read late again and again filled them
// (maxEarly), and the notices of requests still to come were dropped,
// their blocks held for their whole lease.
func TestPullNoticeAfterEndNotKeptEarly(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=30s")
	if got := tc.run(t, "advance 31s"); got != "outcome send p-1 expired (expired): lease expired" {
		t.Fatalf("p-1 at its lease: %q, want expired", got)
	}
	tc.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-1 preq=p-1 tp=1")
	if got := tc.run(t, "handshake D tp=1"); got != "(nothing)" {
		t.Errorf("p-1's late notice: %q, want nothing (one outcome, reported)", got)
	}
	// By transfer id alone too.
	tc.run(t, "notif from=D/0 kind=fail tid=t1 dreq=d-1 reason=late failkind=expired tp=1")
	if n := len(tc.st.early); n != 0 {
		t.Errorf("%d early notices kept after p-1 ended, want none", n)
	}
	if got := tc.st.metrics.Snapshot().Dropped["done_after_end"]; got != 2 {
		t.Errorf(`dropped{reason="done_after_end"} = %d, want 2`, got)
	}
	// A new request under the id, of another transfer, takes its own
	// consumer's notices, early or not.
	tc.run(t, "notif from=D/0 kind=done tid=t2 dreq=d-2 preq=p-1 tp=1")
	if got := tc.run(t, "step send=p-1 tid=t2 blocks=3 tokens=16 deadline=30s"); got != "outcome send p-1 done" {
		t.Errorf("the new p-1 after its consumer's early notice: %q, want done", got)
	}
}

// A consumer rank's failure notice that gives no reason (a peer's field
// left empty) fails the pull request all the same: it is never counted as
// its done notice. Before, an empty reason read as no failure, and the
// producer reported the request done without a READ.
func TestPullFailNoticeWithoutReasonFails(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=30s")
	tc.run(t, "notif from=D/0 kind=fail tid=t1 dreq=d-1 preq=p-1 tp=1")
	got := tc.run(t, "handshake D tp=1")
	if !strings.Contains(got, "outcome send p-1 failed") {
		t.Errorf("p-1 after its consumer's failure notice without a reason: %q, want failed", got)
	}
}

// A heartbeat from a consumer rank that already said it read the request
// (sent before its completion notice, delivered after it) does not extend
// the hold: that rank reads no more, and where the request's other
// consumer ranks are gone without a word, P would hold the blocks
// Lease·2/3 (20 s) longer for nobody. It is counted
// (heartbeat_after_done), and a rank that has not reported still
// extends the hold as ever. Before, the stale heartbeat extended it.
func TestPullHeartbeatAfterDoneDoesNotExtend(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=30s")
	tc.run(t, "notif from=D/0 kind=done tid=t1 dreq=d-1 preq=p-1 tp=2")
	tc.run(t, "handshake D tp=2")
	tc.run(t, "advance 15s")
	out := tc.run(t, "notif from=D/0 kind=heartbeat ids=t1,p-1,d-1 tp=2 reason="+hbAskHold)
	s := tc.st.sends.get("p-1")
	if s == nil {
		t.Fatal("p-1 ended with one of its two consumer ranks reported")
	}
	if want := traceEpoch.Add(30 * time.Second); !s.deadline.Equal(want) {
		t.Errorf("rank 0's heartbeat after its done notice moved p-1's hold to %v, want it left at %v", s.deadline.Sub(traceEpoch), want.Sub(traceEpoch))
	}
	if strings.Contains(out, "hold") {
		t.Errorf("rank 0's heartbeat after its done notice answered: %q", out)
	}
	if got := tc.st.metrics.Snapshot().Dropped["heartbeat_after_done"]; got != 1 {
		t.Errorf(`dropped{reason="heartbeat_after_done"} = %d, want 1`, got)
	}
	// Rank 1, which still reads, extends it (and is answered).
	out = tc.run(t, "notif from=D/1 kind=heartbeat ids=t1,p-1,d-1 tp=2 reason="+hbAskHold)
	if want := traceEpoch.Add(35 * time.Second); !s.deadline.Equal(want) || !strings.Contains(out, "notify D/1 hold ids=t1,p-1,d-1 hold=35s") {
		t.Errorf("rank 1's heartbeat at 15 s: hold to %v, printed %q; want 35s, answered", s.deadline.Sub(traceEpoch), out)
	}
	// Another consumer request of rank 0 (its own reader) extends it too.
	tc.run(t, "advance 1s")
	tc.run(t, "notif from=D/0 kind=heartbeat ids=t1,p-1,d-2 tp=2")
	if want := traceEpoch.Add(36 * time.Second); !s.deadline.Equal(want) {
		t.Errorf("d-2's heartbeat from rank 0 at 16 s: hold to %v, want 36s", s.deadline.Sub(traceEpoch))
	}
}
