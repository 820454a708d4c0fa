package kvxfer

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// Two live producer engines share an id at two addresses (P:1, P:2). A
// pull consumer request names P:1: the engine is handshaken there and
// the hold check asks P:1's agent, which extends its hold by its own
// Lease·2/3 (20 s with the default lease, whatever the request's lease).
// A request that came in after names P:2: the engine moves there, and
// the first fails as naming it elsewhere. The agent it asked is told that
// the request ended (never the agent at P:2, which holds nothing of it).
// Before, nothing told it: P:1 held its blocks until that extension ran
// out, past the request's own lease (TestTwoProducersShareAnID/nixl
// failed on a loaded machine: "p-c1 did not end within 10 s").
func TestRequestFailedElsewhereReleasesTheAgentItAsked(t *testing.T) {
	c := newNoticeCore(t)
	recv := func(id, addr string, block topology.BlockID) Finished {
		t.Helper()
		return c.step(&StepMeta{Recv: []RecvReq{c.recvOf(id, addr, block)}})
	}

	recv("d-1", "P:1", 1)
	c.handshakeAt("P:1", 1, "P1/0")
	if !c.sentAbout("P1/0", msgHeartbeat, "d-1") {
		t.Fatalf("sent %+v, want d-1's hold check asking P1/0", c.notes)
	}
	c.notes = nil
	c.now = c.now.Add(time.Millisecond)
	recv("d-2", "P:2", 2)
	out := c.handshakeAt("P:2", 2, "P2/0")
	var failed bool
	for _, o := range out.Recving {
		failed = failed || o.ReqID == "d-1" && o.Result == ResultFailed
	}
	if !failed {
		t.Fatalf("reported %+v, want d-1 failed as naming its engine elsewhere", out.Recving)
	}
	told := 0
	for _, s := range c.notes {
		if !s.names("d-1") {
			continue
		}
		switch {
		case s.peer == "P1/0" && (s.m.Kind == msgFail || s.m.Kind == msgDone) && s.m.PReq == "p-d-1" && s.m.TransferID == "t-d-1":
			told++
		case s.peer == "P1/0":
			t.Errorf("P1/0 sent %+v about d-1 after it ended, want only the notice of its end", s.m)
		default:
			t.Errorf("%s sent %+v about d-1, want nothing sent to the engine at the other address", s.peer, s.m)
		}
	}
	if told != 1 {
		t.Errorf("P1/0, which d-1's hold check asked (extending its hold there), was told of d-1's end %d times, want once", told)
	}
}
