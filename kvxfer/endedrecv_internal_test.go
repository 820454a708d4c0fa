package kvxfer

import (
	"fmt"
	"testing"
	"time"
)

// What a push consumer rank remembers of its ended requests (to refuse
// one that reuses a finished transfer: reusedTransfer) is bounded by
// count (maxEnded, the oldest forgotten first) and by time
// (RegistrationTTL, swept at each tick and not trusted past it before
// then), and an id that ended again is remembered as its latest request.
func TestEndedConsumerRequestsBounded(t *testing.T) {
	now := time.Unix(1000, 0)
	st := newTestCore(t, "D", ModePush, traceLayout(0, 1, 1<<20), now)
	end := func(id, tid string) {
		st.rememberEnded(&recvReq{req: RecvReq{ReqID: id, TransferID: tid, Remote: RemoteRef{EngineID: "P", ReqID: "p-" + id}}, sent: true})
	}
	for i := range maxEnded + 10 {
		end(fmt.Sprintf("d-%d", i), fmt.Sprintf("t-%d", i))
	}
	if st.ended.len() != maxEnded || len(st.ended.q) != maxEnded {
		t.Fatalf("after %d ended: %d remembered, %d queued, want %d", maxEnded+10, st.ended.len(), len(st.ended.q), maxEnded)
	}
	if _, _, ok := st.ended.get("d-9"); ok {
		t.Errorf("d-9, among the oldest, still remembered past the bound")
	}
	if _, _, ok := st.ended.get("d-10"); !ok {
		t.Errorf("d-10 forgotten within the bound")
	}
	// d-10 ends again under another transfer: remembered as that one, and
	// not forgotten when its first entry leaves the queue.
	st.now = now.Add(time.Second)
	end("d-10", "t-again")
	st.ended.forgetOldest() // d-10's first entry
	if e, _, _ := st.ended.get("d-10"); e.tid != "t-again" {
		t.Errorf("d-10 remembered as %+v, want its latest transfer t-again", e)
	}
	// Past RegistrationTTL: not trusted, then swept.
	st.now = now.Add(st.cfg.RegistrationTTL + 2*time.Second)
	in := &RecvReq{ReqID: "d-11", TransferID: "t-11", Remote: RemoteRef{EngineID: "P", ReqID: "p-d-11"}}
	if st.reusedTransfer(in) {
		t.Errorf("a request ended past RegistrationTTL refused its transfer's reuse")
	}
	st.ended.sweep(st.now, st.cfg.RegistrationTTL)
	if st.ended.len() != 0 || len(st.ended.q) != 0 {
		t.Errorf("past RegistrationTTL: %d remembered, %d queued, want none", st.ended.len(), len(st.ended.q))
	}
}

// A key put again at the same instant is remembered as its latest put:
// forgetting its first put, the oldest, forgets nothing of it. Before,
// entries were told apart by their time, and the first put's going took
// the key with it.
func TestRecentRePutAtOneInstant(t *testing.T) {
	var r recent[int]
	at := time.Unix(1000, 0)
	r.put("a", at, 1, 3)
	r.put("a", at, 2, 3)
	if n := r.put("b", at, 3, 3); n != 0 {
		t.Fatalf("put within the bound forgot %d", n)
	}
	if n := r.put("c", at, 4, 3); n != 0 { // forgets a's first put: a is still remembered
		t.Errorf("put past the bound forgot %d remembered entries, want 0 (only a's first put went)", n)
	}
	if v, _, ok := r.get("a"); !ok || v != 2 {
		t.Errorf("a: %d, remembered %v; want 2, remembered", v, ok)
	}
	if n := r.put("d", at, 5, 3); n != 1 || r.len() != 3 {
		t.Errorf("the next put forgot %d (a's latest), %d remembered; want 1, 3", n, r.len())
	}
	if _, _, ok := r.get("a"); ok {
		t.Errorf("a still remembered once its latest put was the oldest and went")
	}
}
