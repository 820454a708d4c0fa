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
