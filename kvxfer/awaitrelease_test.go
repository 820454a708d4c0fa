package kvxfer

import (
	"errors"
	"slices"
	"testing"
	"time"
)

// A pull consumer request waits in its engine's queue (StepMeta.Await),
// heartbeaten at its producer's agent P1/0 at P:1, which extends its hold
// there by its Lease·2/3. Another request moves the engine to P:2; the
// first's receive then comes, naming P:1, and fails as naming its engine
// elsewhere, never asking anyone itself. The agent its wait's heartbeats
// reached is told it ended: the receive took the wait's asked agents over
// (takeWait). Before, the receive's end told only the agents it asked
// itself: none, and P1/0 held the blocks for the whole extension.
func TestReceiveTakesOverTheAgentsItsWaitAsked(t *testing.T) {
	c := newNoticeCore(t)
	q1 := c.recvOf("d-1", "P:1", 1)
	c.step(&StepMeta{Await: []AwaitReq{{ReqID: q1.ReqID, TransferID: q1.TransferID, Remote: q1.Remote}}})
	c.handshakeAt("P:1", 1, "P1/0")
	if !c.sentAbout("P1/0", msgHeartbeat, "d-1") {
		t.Fatalf("sent %+v, want d-1's wait heartbeaten at P1/0", c.notes)
	}
	c.notes = nil
	c.now = c.now.Add(time.Millisecond)
	c.step(&StepMeta{Recv: []RecvReq{c.recvOf("d-2", "P:2", 2)}})
	c.handshakeAt("P:2", 2, "P2/0")
	out := c.step(&StepMeta{Recv: []RecvReq{q1}})
	failed := false
	for _, o := range out.Recving {
		failed = failed || o.ReqID == "d-1" && o.Result == ResultFailed
	}
	if !failed {
		t.Fatalf("reported %+v, want d-1 failed as naming its engine elsewhere", out.Recving)
	}
	told := 0
	for _, s := range c.notes {
		if s.names("d-1") && s.peer == "P1/0" && s.m.Kind == msgFail && s.m.PReq == "p-d-1" && s.m.TransferID == "t-d-1" {
			told++
		}
	}
	if told != 1 {
		t.Errorf("P1/0, which d-1's wait heartbeated (extending its hold there), was told of d-1's end %d times, want once (sent %+v)", told, c.notes)
	}
}

// A heartbeat not delivered is sent once more, after the completions of
// its batch were handled: a request it names that ended meanwhile (its
// end's notice queued before the retry) is left out of it, so nothing this
// rank sends after that notice extends the producer's hold of it again.
// Before, the retry went as built, after the notice, naming the ended
// request (the producer, if it had not ended its request at the notice,
// held it another Lease·2/3).
func TestHeartbeatRetryLeavesOutEndedRequests(t *testing.T) {
	c := newNoticeCore(t)
	await := func(id string) AwaitReq {
		q := c.recvOf(id, "P:1", 0)
		return AwaitReq{ReqID: q.ReqID, TransferID: q.TransferID, Remote: q.Remote}
	}
	c.step(&StepMeta{Await: []AwaitReq{await("d-1"), await("d-2")}})
	c.handshakeAt("P:1", 1, "P1/0")
	var beats []op
	for _, s := range c.notes {
		if s.op.notice == noticeHeartbeat {
			beats = append(beats, s.op)
		}
	}
	if len(beats) != 1 || len(beats[0].m.IDs) != 6 {
		t.Fatalf("heartbeats %+v, want one naming d-1 and d-2", beats)
	}
	hb := beats[0]
	// d-1 ends (its AwaitEnd); then the heartbeat's completion says it
	// was not delivered.
	c.notes = nil
	c.step(&StepMeta{AwaitEnd: []string{"d-1"}})
	c.run(input{kind: inOpsDone, ops: []op{hb}, errs: []error{errors.New("not delivered")}})
	ended := false
	for _, s := range c.notes {
		m := s.m
		switch {
		case m.Kind == msgFail && m.DReq == "d-1":
			ended = true
		case m.Kind == msgHeartbeat:
			if slices.Contains(m.IDs, "d-1") {
				t.Errorf("sent a heartbeat %v naming d-1 after it ended (its notice sent: %v)", m.IDs, ended)
			}
			if !slices.Contains(m.IDs, "d-2") {
				t.Errorf("sent a heartbeat %v, want d-2, still waiting, in its retry", m.IDs)
			}
		}
	}
	if !ended {
		t.Errorf("sent %+v, want d-1's end told", c.notes)
	}
}
