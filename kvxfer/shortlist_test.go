package kvxfer_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
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
				shortRefused(t, x, good, bad, r, s, "short of the destination's 0..")
			})
		})
	}
}

// A sliding-window producer list that starts past the window of the
// consumer's next token (it lost blocks at its front) is refused where the
// transfer is built, in both modes: window lists were exempt from the
// start check, so the consumer's blocks before the short list kept what
// they held and were reported loaded, though the next token attends to
// them. Both sides fail; a good request beside it moves.
func TestShortWindowListRefused(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := &pair{t: t, mode: mode, fab: kvxfertest.NewFabric(), dir: kvxfertest.NewDirectory(), out: newOutcomes()}
				model := kvsim.Model{Kinds: []topology.Kind{swa, swa}, Window: 40, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
				pe, de := e2eEngine(1, 1, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
				x.p = startEngine(t, x.fab, x.dir, &model, pe, "P", mode, nil)
				x.d = startEngine(t, x.fab, x.dir, &model, de, "D", mode, nil)
				t.Cleanup(func() { x.d.close(t); x.p.close(t) })
				x.groups = x.d.ranks[0][0].Layout.GroupList()
				rng := rand.New(rand.NewPCG(1, 2))
				x.pp, x.dp = newPool(rng, len(x.groups), pe.Blocks, false), newPool(rng, len(x.groups), de.Blocks, false)
				now := time.Now()
				// 100 tokens, window 40: both lists clipped to their last 4
				// blocks (tokens 48..111); the next token attends to 61..99.
				good, bad := x.req("good", 100, 0), x.req("short", 100, 0)
				r, s := bad.recv(mode, x.p, now.Add(time.Minute)), bad.send(now.Add(30*time.Second))
				ps := s.Blocks[0]
				if ps.Start != 48 || len(ps.IDs) != 4 {
					t.Fatalf("the producer's window list %+v, want 4 blocks from token 48", ps)
				}
				// Its last two blocks only: tokens 80..111.
				short := []topology.Span{{Start: ps.Start + 32, IDs: ps.IDs[2:]}}
				s.Blocks = short
				if mode == kvxfer.ModePull {
					r.Remote.Blocks = short
				}
				shortRefused(t, x, good, bad, r, s, "short of the destination's 61..")
			})
		})
	}
}

// shortRefused steps request good beside bad, whose producer list (r for
// D in pull, s for P) was cut short, and checks that good moves, bad
// fails on both sides (D's reason containing reason, FailureSetup), the
// refusal is counted where the transfer is built, and neither side holds
// anything after.
func shortRefused(t *testing.T, x *pair, good, bad *xreq, r kvxfer.RecvReq, s kvxfer.SendReq, reason string) {
	t.Helper()
	now, mode := time.Now(), x.mode
	x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{good.recv(mode, x.p, now.Add(time.Minute)), r}})
	x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{good.send(now.Add(30 * time.Second)), s}})
	x.settle()
	wantResult(t, "good D", x.recvResult(good), kvxfer.ResultDone, "")
	wantResult(t, "good P", x.sendResult(good), kvxfer.ResultDone, "")
	wantResult(t, "short D", x.recvResult(bad), kvxfer.ResultFailed, reason)
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
}
