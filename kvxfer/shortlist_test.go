package kvxfer_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A producer's block list that holds fewer tokens than the producer says
// it holds (Tokens, the params' RemoteNumTokens) is refused where the
// transfer is built, in both modes: the transfer moves only what both
// lists hold, so the consumer's blocks past the short list would keep
// what they held and be reported loaded. Both sides fail the request
// (FailureSetup, naming the lists' tokens), the refusal is counted, and
// a good request beside it moves. A producer that says nothing of the
// tokens it holds (Tokens 0) must hold the consumer's whole list.
func TestShortProducerListRefused(t *testing.T) {
	for _, tc := range []struct {
		mode   kvxfer.Mode
		tokens int
	}{{kvxfer.ModePush, 40}, {kvxfer.ModePull, 40}, {kvxfer.ModePush, 0}, {kvxfer.ModePull, 0}} {
		mode := tc.mode
		t.Run(fmt.Sprintf("%s/tokens=%d", mode, tc.tokens), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, mode, 1, 1, nil)
				if len(x.groups) != 1 {
					t.Fatalf("the pair has %d cache groups, want 1", len(x.groups))
				}
				now := time.Now()
				good, bad := x.req("good", 40, 0), x.req("short", 40, 0)
				r, s := bad.recv(mode, x.p, now.Add(time.Minute)), bad.send(now.Add(30*time.Second))
				if len(s.Blocks[0].IDs) < 2 || s.Tokens != 40 {
					t.Fatalf("the producer's request: %d blocks for %d tokens, want 2 or more for 40", len(s.Blocks[0].IDs), s.Tokens)
				}
				// Its first block only, for 40 tokens.
				short := []topology.Span{{Start: s.Blocks[0].Start, IDs: s.Blocks[0].IDs[:1]}}
				s.Blocks, s.Tokens = short, tc.tokens
				if mode == kvxfer.ModePull {
					r.Remote.Blocks, r.Remote.Tokens = short, tc.tokens
				}
				x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{good.recv(mode, x.p, now.Add(time.Minute)), r}})
				x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{good.send(now.Add(30 * time.Second)), s}})
				x.settle()
				wantResult(t, "good D", x.recvResult(good), kvxfer.ResultDone, "")
				wantResult(t, "good P", x.sendResult(good), kvxfer.ResultDone, "")
				wantResult(t, "short D", x.recvResult(bad), kvxfer.ResultFailed, "short of the destination's 0..")
				wantKind(t, "short D", x.recvResult(bad), kvxfer.FailureSetup)
				wantResult(t, "short P", x.sendResult(bad), kvxfer.ResultFailed, "")
				w, field := x.p.workers[0][0], "send_req.blocks"
				if mode == kvxfer.ModePull {
					w, field = x.d.workers[0][0], "recv_req.remote.blocks"
				}
				if got := w.Metrics().Snapshot().BadInput[field]; got != 1 {
					t.Errorf("BadInput[%q] = %d, want 1", field, got)
				}
				for _, se := range []*simEngine{x.p, x.d} {
					if st := x.state(se); st.Sends+st.Recvs+st.PendingRegs+st.Matches != 0 {
						t.Errorf("%s holds %+v after every request ended", se.id, st)
					}
				}
			})
		})
	}
}
