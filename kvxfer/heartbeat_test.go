package kvxfer

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// hbRig is a push consumer's core waiting on n requests of producer P
// (ids the length vLLM's are), its handshake with P (2 ranks) done.
func hbRig(t *testing.T, n int) (*traceCore, []string) {
	tc := &traceCore{st: newTestCore(t, "D", ModePush, traceLayout(0, 1, 1<<20), traceEpoch), now: traceEpoch, fail: map[opKind]int{}, engine: "D"}
	meta := &StepMeta{SchedulerClock: tc.now}
	ids := make([]string, n)
	for i := range ids {
		ids[i] = fmt.Sprintf("chatcmpl-%032x-%08x", i, i)
		meta.Recv = append(meta.Recv, RecvReq{ReqID: ids[i], TransferID: fmt.Sprintf("%036x", i),
			Local: []topology.Span{{IDs: []topology.BlockID{topology.BlockID(i % 16)}}}, Deadline: tc.now.Add(time.Hour),
			Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: "p" + ids[i], TPSize: 2, PPSize: 1, Tokens: 16}})
	}
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	tc.drive(nil, "")
	tc.run(t, "handshake P tp=2")
	tc.st.Step(tc.now, input{kind: inTimers}) // starts the periodic work
	tc.drive(nil, "")
	return tc, ids
}

// tickHB lets one heartbeat period pass and carries out the core's ops,
// failing each heartbeat (first sends and retries) for which fail says
// so; it returns the heartbeats sent (retries included).
func (tc *traceCore) tickHB(t *testing.T, fail func(o *op) bool) []*msg {
	tc.now = tc.now.Add(tc.st.cfg.Lease / 6)
	tc.st.Step(tc.now, input{kind: inTimers})
	var sent []*msg
	carryOut(tc.st, nil, nil, func(_ int, o *op) error {
		if o.kind != opNotify {
			return nil
		}
		m, err := decodeMsg(o.msg)
		if err != nil {
			t.Fatalf("a notification that does not decode: %v", err)
		}
		if m.Kind != msgHeartbeat {
			return nil // probes: answered by nobody here
		}
		if len(o.msg) > 128<<10 {
			t.Errorf("a heartbeat of %d bytes, over 128 KiB", len(o.msg))
		}
		sent = append(sent, m)
		if fail(o) {
			return errors.New("injected heartbeat failure")
		}
		return nil
	})
	return sent
}

// Heartbeats are split by size, and together name every waiting request
// to every producer rank: 8,000 vLLM-style ids took one 1 MiB message,
// over the built-in backend's notification limit.
func TestHeartbeatsSplitBySize(t *testing.T) {
	tc, ids := hbRig(t, 8000)
	sent := tc.tickHB(t, func(*op) bool { return false })
	seen := map[string]int{}
	for _, m := range sent {
		for i := 2; i < len(m.IDs); i += 3 {
			seen[m.IDs[i]]++
		}
	}
	if len(sent) < 4 {
		t.Errorf("%d heartbeat messages for 8,000 requests to 2 ranks, want them split", len(sent))
	}
	for _, id := range ids {
		if seen[id] != 2 {
			t.Fatalf("request %s named in %d heartbeats, want 2 (one per producer rank)", id, seen[id])
		}
	}
	// The producer's side extends every request's lease from them.
	p := newTestCore(t, "P", ModePush, traceLayout(0, 1, 1<<20), traceEpoch)
	for i := range ids {
		p.Step(p.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: p.now,
			Send: []SendReq{{ReqID: "p" + ids[i], TransferID: fmt.Sprintf("%036x", i), Blocks: []topology.Span{{IDs: []topology.BlockID{1}}}, Tokens: 16, Deadline: p.now.Add(10 * time.Second)}}}}})
	}
	knowEngine(t, p, "D", 1)
	for _, m := range sent {
		m.Engine, m.TPRank, m.TPSize = "D", 0, 1
		p.Step(p.now, input{kind: inNotifs, notifs: []Notif{{From: "D/0", Msg: appendMsg(nil, m)}}})
	}
	for i := range ids {
		if s := p.sends.get("p" + ids[i]); s == nil || !s.deadline.After(p.now.Add(10*time.Second)) {
			t.Fatalf("producer request %d: lease not extended by the heartbeats", i)
		}
	}
}

// A heartbeat not delivered goes again at once; delivered then, nothing
// fails.
func TestHeartbeatRetried(t *testing.T) {
	tc, _ := hbRig(t, 10)
	failed := false
	sent := tc.tickHB(t, func(*op) bool {
		if !failed {
			failed = true
			return true
		}
		return false
	})
	if len(sent) != 3 {
		t.Errorf("%d heartbeats sent, want 3 (two ranks, one retried)", len(sent))
	}
	for range 4 {
		tc.tickHB(t, func(*op) bool { return false })
	}
	if n := len(tc.st.out.Recving); n != 0 {
		t.Errorf("%d outcomes after a heartbeat delivered on its retry, want none", n)
	}
}

// Heartbeats to a producer rank that keep failing fail the requests they
// name, clearly, before the producer's lease can lapse: not one extension
// silently lost.
func TestHeartbeatFailureFailsRequests(t *testing.T) {
	tc, ids := hbRig(t, 3)
	toRank1 := func(o *op) bool { return o.ref.tp == 1 }
	start := tc.now
	for i := 0; len(tc.st.out.Recving) == 0 && len(tc.st.recvs) > 0 && i < 20; i++ {
		for _, r := range tc.st.recvs {
			if r.decided {
				if lapse := r.hbFailSince.Add(tc.st.cfg.Lease * 2 / 3); tc.now.After(lapse) {
					t.Fatalf("decided at %v, after the producer's lease could lapse (%v)", tc.now.Sub(start), lapse.Sub(start))
				}
			}
		}
		if tc.tickHB(t, toRank1); len(tc.st.recvs) > 0 && tc.st.recvs[ids[0]].decided {
			break
		}
	}
	for _, id := range ids {
		r := tc.st.recvs[id]
		if r == nil || !r.decided {
			t.Fatalf("request %s not failed after its heartbeats kept failing", id)
		}
		if o := r.outcome; o.Result != ResultFailed || o.Kind != FailureNotification || !strings.Contains(o.Reason, "heartbeats to producer engine P") {
			t.Errorf("request %s: %+v, want failed (notification_failed) naming the producer", id, o)
		}
	}
}
