package kvxfer_test

import (
	"context"
	"fmt"
	"log/slog"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// pair is a P and a D engine for focused worker tests.
type pair struct {
	t      *testing.T
	mode   kvxfer.Mode
	fab    *kvxfertest.Fabric
	dir    *kvxfertest.Directory
	p, d   *simEngine
	pp, dp *blockPool
	groups []topology.Group
	out    *outcomes
}

func newPair(t *testing.T, mode kvxfer.Mode, ptp, dtp int, tweak func(side string, c *kvxfer.WorkerConfig)) *pair {
	t.Helper()
	return newPairOf(t, mode, e2eEngine(1, ptp, 1, 16, 16), e2eEngine(2, dtp, 1, 16, 16), tweak)
}

// newPairOf is newPair with the engines given.
func newPairOf(t *testing.T, mode kvxfer.Mode, pe, de kvsim.Engine, tweak func(side string, c *kvxfer.WorkerConfig)) *pair {
	t.Helper()
	x := &pair{t: t, mode: mode, fab: kvxfertest.NewFabric(), dir: kvxfertest.NewDirectory(), out: newOutcomes()}
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	tw := func(side string) func(*kvxfer.WorkerConfig) {
		return func(c *kvxfer.WorkerConfig) {
			if tweak != nil {
				tweak(side, c)
			}
		}
	}
	x.p = startEngine(t, x.fab, x.dir, &model, pe, "P", mode, tw("P"))
	x.d = startEngine(t, x.fab, x.dir, &model, de, "D", mode, tw("D"))
	t.Cleanup(func() { x.d.close(t); x.p.close(t) })
	x.groups = x.d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(1, 2))
	x.pp = newPool(rng, len(x.groups), pe.Blocks, false)
	x.dp = newPool(rng, len(x.groups), de.Blocks, false)
	return x
}

// pGen is the producer's generation, as a handshake reports it.
func (x *pair) pGen() uint64 {
	x.t.Helper()
	res, err := x.dir.Handshake(context.Background(), "P", "")
	if err != nil {
		x.t.Fatal(err)
	}
	return res.Generation
}

func (x *pair) req(id string, tokens, hit int) *xreq {
	q := makeRequest(id, tokens, hit, x.groups, x.p.eng, x.d.eng, x.pp, x.dp)
	for _, stage := range x.p.ranks {
		for _, r := range stage {
			r.Fill(q.sim.P)
		}
	}
	return q
}

func (x *pair) sendP(qs ...*xreq) {
	now := time.Now()
	m := &kvxfer.StepMeta{SchedulerClock: now}
	for _, q := range qs {
		m.Send = append(m.Send, q.send(now.Add(30*time.Second)))
	}
	x.p.step(x.t, m)
}

func (x *pair) recvD(qs ...*xreq) {
	now := time.Now()
	m := &kvxfer.StepMeta{SchedulerClock: now}
	for _, q := range qs {
		m.Recv = append(m.Recv, q.recv(x.mode, x.p, now.Add(time.Minute)))
	}
	x.d.step(x.t, m)
}

// settle lets every goroutine run to a standstill and collects outcomes.
func (x *pair) settle() {
	synctest.Wait()
	x.out.collect(x.t, x.p)
	x.out.collect(x.t, x.d)
}

func (x *pair) sendResult(q *xreq) []kvxfer.Outcome { return x.out.send["p-"+q.id] }
func (x *pair) recvResult(q *xreq) []kvxfer.Outcome { return x.out.recv["d-"+q.id] }

func (x *pair) posted() int {
	n := 0
	for _, side := range []*simEngine{x.p, x.d} {
		for _, stage := range side.agents {
			for _, a := range stage {
				n += a.Posted()
			}
		}
	}
	return n
}

func (x *pair) state(se *simEngine) kvxfer.WorkerState {
	x.t.Helper()
	s, err := se.workers[0][0].State()
	if err != nil {
		x.t.Fatal(err)
	}
	return s
}

func wantResult(t *testing.T, what string, got []kvxfer.Outcome, want kvxfer.Result, reason string) {
	t.Helper()
	if len(got) != 1 || got[0].Result != want || !strings.Contains(got[0].Reason, reason) {
		t.Errorf("%s outcomes = %+v, want one %v with reason containing %q", what, got, want, reason)
		return
	}
	failed := want == kvxfer.ResultFailed || want == kvxfer.ResultExpired
	if k := got[0].Kind; failed != (k != kvxfer.FailureNone) {
		t.Errorf("%s outcome %+v: a %v outcome with failure kind %v", what, got[0], want, k)
	}
}

// wantKind checks the failure kind of a request's one outcome.
func wantKind(t *testing.T, what string, got []kvxfer.Outcome, want kvxfer.FailureKind) {
	t.Helper()
	if len(got) != 1 || got[0].Kind != want {
		t.Errorf("%s outcomes = %+v, want one of failure kind %v", what, got, want)
	}
}

func inSynctest(t *testing.T, f func(t *testing.T)) {
	t.Helper()
	synctest.Test(t, f)
}

// SPEC §12 push 7: the registration arrives after P finished: one WRITE
// fires and the blocks are consumed.
func TestPushRegistrationAfterFinishedBlocksFiresOnce(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.sendP(q)
		x.settle()
		if n := x.posted(); n != 0 {
			t.Fatalf("posted %d transfers before D registered, want 0", n)
		}
		x.recvD(q)
		x.settle()
		if n := x.posted(); n != 1 {
			t.Errorf("posted %d transfers, want 1", n)
		}
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		if s := x.state(x.p); s.Sends+s.PendingRegs+s.Matches+s.Handles != 0 {
			t.Errorf("P state after the transfer = %+v, want nothing held", s)
		}
		st := x.p.workers[0][0].Metrics().Snapshot()
		blocks := uint64(len(q.sim.P[0].IDs) * len(q.sim.P))
		if st.Transfers != 1 || st.TotalBlocks != blocks || st.TotalDescriptors == 0 || st.TotalBytes == 0 ||
			st.Outcomes[kvxfer.RoleProducer][kvxfer.ResultDone] != 1 || st.HandshakeSeconds.Count != 1 {
			t.Errorf("P stats = %+v, want one transfer of %d blocks, one done outcome, one handshake", st, blocks)
		}
	})
}

// SPEC §12 push 8 and 11: the registration arrives first and is stashed;
// P's finished blocks then match it.
func TestPushRegistrationBeforeFinishedBlocksIsStashed(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.settle()
		if s := x.state(x.p); s.PendingRegs != 1 || x.posted() != 0 {
			t.Fatalf("P state = %+v, posted %d; want one stashed registration and no transfer", s, x.posted())
		}
		x.sendP(q)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		if err := x.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
			t.Error(err)
		}
	})
}

// SPEC §12 push 9, 27 and DESIGN principle 6: matching by transfer id,
// else by id, else by the suffix-stripped base id. D names P's request
// (dPReq, the id P's engine returned) or names none, and then its own id
// (dID) stands for it, as in the reference, where each engine suffixed
// the request's id at random: only that pairing, or a named id without a
// suffix, strips suffixes; a full id D named is never another request.
func TestPushMatching(t *testing.T) {
	tests := []struct {
		name             string
		pID, pTID        string
		dID, dPReq, dTID string
		match            bool
	}{
		{name: "transfer id", pID: "p-1", pTID: "t-9", dPReq: "other", dTID: "t-9", match: true},
		{name: "transfer id differs", pID: "p-1", pTID: "t-9", dPReq: "p-1", dTID: "t-8", match: false},
		{name: "exact id", pID: "req-1", dPReq: "req-1", match: true},
		{name: "random suffix stripped", pID: "req-1-0badf00d", dID: "req-1-DEADBEEF", match: true},
		{name: "named base id", pID: "req-1-0badf00d", dPReq: "req-1", match: true},
		{name: "named id on an unsuffixed request", pID: "req-1", dPReq: "req-1-DEADBEEF", match: true},
		{name: "named full id is another request", pID: "req-0000000a", dPReq: "req-0000000b", match: false},
		{name: "base ids differ", pID: "req-1-0badf00d", dID: "req-2-0badf00d", match: false},
		{name: "named base ids differ", pID: "req-1-0badf00d", dPReq: "req-2-0badf00d", match: false},
		{name: "suffix too short is not stripped", pID: "req-1-0bad", dID: "req-1-beef", match: false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, kvxfer.ModePush, 1, 1, nil)
				q := x.req("r", 40, 0)
				now := time.Now()
				s := q.send(now.Add(30 * time.Second))
				s.ReqID, s.TransferID = tc.pID, tc.pTID
				r := q.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
				r.Remote.ReqID, r.TransferID = tc.dPReq, tc.dTID
				if tc.dID != "" {
					r.ReqID = tc.dID
				}
				x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
				x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s}})
				x.settle()
				if got := x.posted() == 1; got != tc.match {
					t.Errorf("matched = %v (posted %d), want %v", got, x.posted(), tc.match)
				}
			})
		})
	}
}

// SPEC §12 push 13: while the handshake with D is pending nothing is
// written; once it completes the WRITE goes out.
func TestPushDefersUntilHandshakeReady(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		release := x.dir.Hold("D")
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.sendP(q)
		x.settle()
		if x.posted() != 0 || len(x.sendResult(q)) != 0 {
			t.Fatalf("posted %d transfers while the handshake is pending, want 0", x.posted())
		}
		release()
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
	})
}

// A consumer that cannot handshake with its producer fails the request
// at once, with its blocks marked invalid, instead of waiting out a
// deadline.
func TestConsumerHandshakeFailureFailsAtOnce(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, mode, 1, 1, nil)
				x.dir.FailHandshakes("P", 1)
				q := x.req("r1", 40, 0)
				x.sendP(q)
				x.recvD(q)
				x.settle()
				wantResult(t, "D", x.recvResult(q), kvxfer.ResultFailed, "handshake")
				wantKind(t, "D", x.recvResult(q), kvxfer.FailureHandshake)
				if len(x.out.invalid) != len(q.sim.D[0].IDs) {
					t.Errorf("invalid blocks = %v, want D's group-0 blocks %v", x.out.invalid, q.sim.D[0].IDs)
				}
			})
		})
	}
}

// A request fails on a failed handshake only if that handshake began once
// it was waiting: one that came in while a handshake begun earlier was
// still out (a dial begun during a partition that has healed since) gets
// an attempt of its own, and is done; the one that started the failed
// handshake fails. On the producer's side likewise for a registration.
func TestRequestAfterHandshakeBeganGetsItsOwnAttempt(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, mode, 1, 1, nil)
				release := x.dir.Hold("P")
				x.dir.FailHandshakes("P", 1)
				q1, q2 := x.req("r1", 40, 0), x.req("r2", 40, 0)
				x.sendP(q1, q2)
				x.recvD(q1)
				x.settle()
				time.Sleep(10 * time.Millisecond)
				x.recvD(q2) // the handshake q1 started is still out
				x.settle()
				release()
				x.settle()
				wantResult(t, "D r1", x.recvResult(q1), kvxfer.ResultFailed, "handshake")
				wantResult(t, "D r2", x.recvResult(q2), kvxfer.ResultDone, "")
			})
		})
		// Just after a failed handshake, a new request is not failed on
		// it either: it has an attempt of its own.
		t.Run(mode.String()+"/after", func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, mode, 1, 1, nil)
				x.dir.FailHandshakes("P", 1)
				q1, q2 := x.req("r1", 40, 0), x.req("r2", 40, 0)
				x.sendP(q1, q2)
				x.recvD(q1)
				x.settle()
				wantResult(t, "D r1", x.recvResult(q1), kvxfer.ResultFailed, "handshake")
				time.Sleep(10 * time.Millisecond)
				x.recvD(q2)
				x.settle()
				wantResult(t, "D r2", x.recvResult(q2), kvxfer.ResultDone, "")
			})
		})
	}
}

// SPEC §14: a full prefix hit or an abort before schedule in push mode
// tells P at once, so P frees its blocks instead of waiting for its lease.
func TestPushNothingToReceiveReleasesProducer(t *testing.T) {
	for _, abort := range []bool{false, true} {
		t.Run(fmt.Sprintf("aborted=%v", abort), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, kvxfer.ModePush, 2, 1, nil)
				q := x.req("r1", 40, 48) // D already holds every token
				x.sendP(q)
				now := time.Now()
				r := q.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
				r.Aborted = abort
				x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
				x.settle()
				want := kvxfer.ResultDone
				if abort {
					want = kvxfer.ResultAborted
				}
				wantResult(t, "D", x.recvResult(q), want, "")
				if got := x.sendResult(q); len(got) != 2 || got[0].Result != kvxfer.ResultDone || got[1].Result != kvxfer.ResultDone {
					t.Errorf("P outcomes = %+v, want done on both ranks before the lease", got)
				}
				if x.posted() != 0 {
					t.Errorf("posted %d transfers, want 0", x.posted())
				}
			})
		})
	}
}

// SPEC §14: a failed WRITE is reported as a send failure on P, and D is
// told at once (it fails with its blocks marked invalid, long before its
// deadline).
func TestFailedWriteReportedOnBothSides(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.settle()
		x.fab.Faults().FailTransfers(1)
		start := time.Now()
		x.sendP(q)
		time.Sleep(10 * time.Millisecond)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultFailed, "WRITE failed")
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultFailed, "WRITE failed")
		wantKind(t, "P", x.sendResult(q), kvxfer.FailureTransfer)
		wantKind(t, "D", x.recvResult(q), kvxfer.FailureTransfer) // P's notice says so
		if el := time.Since(start); el > time.Second {
			t.Errorf("D learned of the failure after %v, want at once", el)
		}
		if len(x.out.invalid) == 0 {
			t.Error("no invalid blocks reported for the failed receive")
		}
	})
}

// A failure notice the backend could not send (a NIXL connection being
// made again after it broke) is sent again at the next heartbeat tick: D
// learns of P's failed WRITE within seconds, by P's word, not at its
// deadline a minute on. Before, the notice was logged and lost.
func TestLostFailureNoticeSentAgain(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.settle()
		x.fab.Faults().FailTransfers(1)
		x.fab.Faults().FailNotify(1) // the notice of that failure
		start := time.Now()
		x.sendP(q)
		time.Sleep(10 * time.Millisecond)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultFailed, "WRITE failed")
		if got := x.recvResult(q); len(got) != 0 {
			t.Fatalf("D reported %+v though P's notice failed", got)
		}
		for i := 0; i < 20 && len(x.recvResult(q)) == 0; i++ {
			time.Sleep(time.Second)
			x.settle()
		}
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultFailed, "WRITE failed")
		wantKind(t, "D", x.recvResult(q), kvxfer.FailureTransfer)
		if el := time.Since(start); el > 10*time.Second {
			t.Errorf("D learned of the failure after %v, want within a heartbeat interval (5 s)", el)
		}
		if s := x.state(x.p); s.Sends != 0 {
			t.Errorf("P still holds %d requests", s.Sends)
		}
	})
}

// SPEC §9 and §14: expiry goes by deadline, not insertion order: an
// earlier request with a later deadline does not hold back a later one
// that expires first.
func TestLeaseExpiryByDeadline(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, nil)
		a, b := x.req("a", 40, 0), x.req("b", 40, 0)
		now := time.Now()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{a.send(now.Add(time.Hour)), b.send(now.Add(5 * time.Second))}})
		time.Sleep(6 * time.Second)
		x.settle()
		wantResult(t, "P b", x.sendResult(b), kvxfer.ResultExpired, "lease")
		if got := x.sendResult(a); len(got) != 0 {
			t.Errorf("P a = %+v, want still held", got)
		}
	})
}

// SPEC §9: deadlines are rebased from the scheduler clock to the worker
// clock, so a skewed scheduler clock does not expire leases early.
func TestLeaseRebasedToWorkerClock(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, nil)
		q := x.req("a", 40, 0)
		sched := time.Now().Add(-10000 * time.Second) // a skewed scheduler clock
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: sched, Send: []kvxfer.SendReq{q.send(sched.Add(480 * time.Second))}})
		time.Sleep(470 * time.Second)
		x.settle()
		if got := x.sendResult(q); len(got) != 0 {
			t.Fatalf("P = %+v after 470 s of a 480 s lease, want still held", got)
		}
		time.Sleep(20 * time.Second)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultExpired, "lease")
		wantKind(t, "P", x.sendResult(q), kvxfer.FailureExpired)
	})
}

// SPEC §9: a consumer's heartbeats, sent from its own goroutine, keep the
// producer's lease alive while a READ waits on a stalled producer.
func TestHeartbeatsExtendLease(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.Lease = 6 * time.Second })
		q := x.req("r1", 40, 0)
		now := time.Now()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(6 * time.Second))}})
		x.fab.Faults().Stall(x.p.agents[0][0].Name())
		x.recvD(q)
		time.Sleep(40 * time.Second)
		x.settle()
		if got := x.sendResult(q); len(got) != 0 {
			t.Fatalf("P = %+v after 40 s with heartbeats, want still held", got)
		}
		x.fab.Faults().Unstall(x.p.agents[0][0].Name())
		time.Sleep(time.Second)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
	})
}

// A push consumer whose deadline passes while P's WRITE is in flight
// cancels, and reports only once P confirms the WRITE ended (fencing): the
// blocks are never reported free while a WRITE into them may land.
func TestConsumerDeadlineWaitsForInFlightWrite(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.recvD(q) // deadline in one minute
		x.settle()
		x.fab.Faults().Stall(x.d.agents[0][0].Name())
		x.sendP(q)
		time.Sleep(70 * time.Second)
		x.settle()
		if got := x.recvResult(q); len(got) != 0 {
			t.Fatalf("D reported %+v while a WRITE into its blocks was in flight", got)
		}
		x.fab.Faults().Unstall(x.d.agents[0][0].Name())
		time.Sleep(10 * time.Millisecond)
		x.settle()
		got := x.recvResult(q)
		if len(got) != 1 {
			t.Fatalf("D outcomes = %+v, want one", got)
		}
		if in := x.p.agents[0][0].InFlight(); in != 0 {
			t.Errorf("%d WRITEs still in flight after D reported", in)
		}
	})
}

// A producer abort after D registered tells D at once.
func TestProducerAbortFailsConsumerAtOnce(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.settle()
		x.p.step(t, &kvxfer.StepMeta{NotProcessed: []string{"p-r1"}})
		time.Sleep(10 * time.Millisecond)
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultFailed, "aborted")
		if s := x.state(x.p); s.PendingRegs != 0 {
			t.Errorf("P keeps %d registrations of an aborted request", s.PendingRegs)
		}
	})
}

// Every malformed entry of a step is refused: Step's error names its
// request, field and value; it is counted by field; and its request ends
// in exactly one failed outcome whose reason names the field and value
// (issue 23: it used to be dropped with no outcome, leaving the engine
// waiting). The good entries of the same step carry on. An entry that
// names no request has nothing to fail, a malformed duplicate of a held
// request does not end it, and a malformed layer-wise prefill entry leaves
// its request to its SendReq.
func TestStepInvalidEntriesFail(t *testing.T) {
	type entry struct {
		name  string
		mode  kvxfer.Mode
		side  string // "D" (a RecvReq), "P" (a SendReq) or "prefill"
		id    string // the request id ("" for none)
		bad   func(r *kvxfer.RecvReq, s *kvxfer.SendReq)
		field string // the BadInput label
		want  string // in Step's error and the outcome's reason
		// outcome: the request fails (else it has no outcome).
		outcome bool
	}
	cases := []entry{
		{"recv req_id", kvxfer.ModePush, "D", "", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.ReqID = "" }, "recv_req.req_id", "RecvReq.ReqID is empty", false},
		{"recv engine", kvxfer.ModePush, "D", "d-engine", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.EngineID = "" }, "recv_req.remote.engine_id", "Remote.EngineID is empty", true},
		{"recv tp size", kvxfer.ModePush, "D", "d-tp", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.TPSize = -1 }, "recv_req.remote.tp_size", "Remote.TPSize = -1, want 0..4096", true},
		{"recv pp size", kvxfer.ModePush, "D", "d-pp", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.PPSize = -2 }, "recv_req.remote.pp_size", "Remote.PPSize = -2, want 0..4096", true},
		// Sizes no producer has: each a list of producer ranks to tell
		// (and a notice each) had the request ended before its handshake.
		{"recv tp size huge", kvxfer.ModePush, "D", "d-tp-huge", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.TPSize = 1 << 20 }, "recv_req.remote.tp_size", "Remote.TPSize = 1048576, want 0..4096", true},
		{"recv pp size huge", kvxfer.ModePull, "D", "d-pp-huge", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.PPSize = 1 << 20 }, "recv_req.remote.pp_size", "Remote.PPSize = 1048576, want 0..4096", true},
		{"recv ranks", kvxfer.ModePush, "D", "d-ranks", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.TPSize, r.Remote.PPSize = 64, 128 }, "recv_req.remote.pp_size", "Remote.TPSize*PPSize = 64*128, want at most 4096 producer ranks", true},
		{"recv local groups", kvxfer.ModePush, "D", "d-groups", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Local = append(slices.Clip(r.Local), r.Local[0]) }, "recv_req.local", "Local has 2 block groups, want 1", true},
		{"recv local start", kvxfer.ModePush, "D", "d-start", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) {
			r.Local = []topology.Span{{Start: -1, IDs: []topology.BlockID{1}}}
		}, "recv_req.local", "Local group 0 Start = -1, want >= 0", true},
		{"recv local block", kvxfer.ModePush, "D", "d-block", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) {
			r.Local = []topology.Span{{IDs: []topology.BlockID{1, 1 << 20}}}
		}, "recv_req.local", "Local group 0 block 1 = 1048576, want in [0, ", true},
		{"recv remote tokens (pull)", kvxfer.ModePull, "D", "d-tokens", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.Tokens = -4 }, "recv_req.remote.tokens", "Remote.Tokens = -4, want >= 0", true},
		{"recv remote tokens (push)", kvxfer.ModePush, "D", "d-tokens", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.Tokens = -5 }, "recv_req.remote.tokens", "Remote.Tokens = -5, want >= 0", true},
		{"recv remote blocks (pull)", kvxfer.ModePull, "D", "d-remote", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.Remote.Blocks = nil }, "recv_req.remote.blocks", "Remote.Blocks has 0 groups, Local 1", true},
		{"recv duplicate of a held request", kvxfer.ModePush, "D", "d-good", func(r *kvxfer.RecvReq, _ *kvxfer.SendReq) { r.ReqID, r.Remote.EngineID = "d-good", "" }, "recv_req.remote.engine_id", "Remote.EngineID is empty", false},
		{"send req_id", kvxfer.ModePush, "P", "", func(_ *kvxfer.RecvReq, s *kvxfer.SendReq) { s.ReqID = "" }, "send_req.req_id", "SendReq.ReqID is empty", false},
		{"send tokens", kvxfer.ModePush, "P", "p-tokens", func(_ *kvxfer.RecvReq, s *kvxfer.SendReq) { s.Tokens = -3 }, "send_req.tokens", "Tokens = -3, want >= 0", true},
		{"send block groups", kvxfer.ModePush, "P", "p-groups", func(_ *kvxfer.RecvReq, s *kvxfer.SendReq) { s.Blocks = append(slices.Clip(s.Blocks), s.Blocks[0]) }, "send_req.blocks", "Blocks has 2 block groups, want 1", true},
		{"send block start", kvxfer.ModePush, "P", "p-start", func(_ *kvxfer.RecvReq, s *kvxfer.SendReq) { s.Blocks = []topology.Span{{Start: -16}} }, "send_req.blocks", "Blocks group 0 Start = -16, want >= 0", true},
		{"send block", kvxfer.ModePush, "P", "p-block", func(_ *kvxfer.RecvReq, s *kvxfer.SendReq) { s.Blocks = []topology.Span{{IDs: []topology.BlockID{-1}}} }, "send_req.blocks", "Blocks group 0 block 0 = -1, want in [0, ", true},
		{"send in pull", kvxfer.ModePull, "P", "p-pull", func(_ *kvxfer.RecvReq, s *kvxfer.SendReq) { s.Tokens = -1 }, "send_req.tokens", "Tokens = -1, want >= 0", true},
		{"prefill block", kvxfer.ModePush, "prefill", "p-prefill", func(_ *kvxfer.RecvReq, s *kvxfer.SendReq) {
			s.Blocks = []topology.Span{{IDs: []topology.BlockID{1 << 20}}}
		}, "prefill.blocks", "Blocks group 0 block 0 = 1048576, want in [0, ", false},
	}
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, mode, 1, 1, nil)
				if len(x.groups) != 1 {
					t.Fatalf("the pair has %d cache groups, want 1 (the cases assume it)", len(x.groups))
				}
				now := time.Now()
				good := x.req("good", 40, 0)
				dm := &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{good.recv(mode, x.p, now.Add(time.Minute))}}
				pm := &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{good.send(now.Add(30 * time.Second))}}
				var mine []entry
				for i, c := range cases {
					if c.mode != mode {
						continue
					}
					mine = append(mine, c)
					q := x.req(fmt.Sprintf("bad%d", i), 40, 0)
					r, s := q.recv(mode, x.p, now.Add(time.Minute)), q.send(now.Add(30*time.Second))
					r.ReqID, s.ReqID = c.id, c.id
					c.bad(&r, &s)
					switch c.side {
					case "D":
						dm.Recv = append(dm.Recv, r)
					case "P":
						pm.Send = append(pm.Send, s)
					case "prefill":
						pm.Prefill = append(pm.Prefill, s)
					}
				}
				var errs string
				for _, step := range []struct {
					w *kvxfer.Worker
					m *kvxfer.StepMeta
				}{{x.d.workers[0][0], dm}, {x.p.workers[0][0], pm}} {
					if err := step.w.Step(step.m); err != nil {
						errs += err.Error() + "\n"
					}
				}
				x.settle()
				// The good request beside the bad entries moved.
				wantResult(t, "good D", x.recvResult(good), kvxfer.ResultDone, "")
				wantResult(t, "good P", x.sendResult(good), kvxfer.ResultDone, "")
				for _, c := range mine {
					if !strings.Contains(errs, c.want) || c.id != "" && !strings.Contains(errs, fmt.Sprintf("%q", c.id)) {
						t.Errorf("%s: Step errors %q, want one naming %q and %q", c.name, errs, c.id, c.want)
					}
					w := x.d.workers[0][0]
					if c.side != "D" {
						w = x.p.workers[0][0]
					}
					if got := w.Metrics().Snapshot().BadInput[c.field]; got == 0 {
						t.Errorf("%s: BadInput[%q] = 0, want it counted", c.name, c.field)
					}
					if c.id == "d-good" {
						continue // the held request's one outcome: checked above
					}
					got := x.out.recv[c.id]
					if c.side != "D" {
						got = x.out.send[c.id]
					}
					if !c.outcome {
						if len(got) != 0 {
							t.Errorf("%s: outcomes %+v, want none", c.name, got)
						}
						continue
					}
					wantResult(t, c.name, got, kvxfer.ResultFailed, c.want)
					wantKind(t, c.name, got, kvxfer.FailureSetup)
				}
				if got := x.out.recv[""]; len(got) != 0 {
					t.Errorf("outcomes for an entry with no request id: %+v, want none", got)
				}
				if slices.Contains(x.out.invalid, 1<<20) {
					t.Errorf("invalid blocks %v include an id out of the rank's range", x.out.invalid)
				}
				for _, se := range []*simEngine{x.p, x.d} {
					if s := x.state(se); s.Sends+s.Recvs+s.PendingRegs+s.Matches != 0 {
						t.Errorf("%s holds %+v after every request ended", se.id, s)
					}
				}
			})
		})
	}
}

// Malformed or unknown peer messages are dropped without a panic, and the
// request in progress carries on.
func TestMalformedPeerMessagesDropped(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		evil, err := x.fab.NewAgent("evil")
		if err != nil {
			t.Fatal(err)
		}
		meta, _ := x.p.agents[0][0].LocalMetadata()
		peer, err := evil.LoadPeer(meta)
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range [][]byte{nil, {'K'}, {'K', 1, 99}, []byte("PUSH_REG:{}"), {'K', 1, 1, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff}} {
			if err := evil.Notify(peer, m); err != nil {
				t.Fatal(err)
			}
		}
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.sendP(q)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		if got := x.p.workers[0][0].Metrics().Snapshot().Dropped["malformed"]; got != 5 {
			t.Errorf("malformed messages counted = %d, want 5", got)
		}
	})
}

// Engine handshakes are evicted after EngineTTL of inactivity (SPEC §10),
// and kept when the TTL is disabled.
func TestEngineTTL(t *testing.T) {
	for _, ttl := range []time.Duration{time.Minute, -1} {
		t.Run(fmt.Sprint(ttl), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, kvxfer.ModePush, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.EngineTTL = ttl })
				q := x.req("r1", 40, 0)
				x.recvD(q)
				x.sendP(q)
				x.settle()
				if s := x.state(x.p); s.Engines != 1 {
					t.Fatalf("P engines = %d after a transfer, want 1", s.Engines)
				}
				time.Sleep(10 * time.Minute)
				x.settle()
				want := 0
				if ttl < 0 {
					want = 1
				}
				if s := x.state(x.p); s.Engines != want {
					t.Errorf("P engines = %d after 10 idle minutes, want %d", s.Engines, want)
				}
			})
		})
	}
}

// A duplicated registration is idempotent: one WRITE, no leak (SPEC §12
// push 30, §14 duplicate registrations).
func TestDuplicateRegistrationIdempotent(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.fab.Faults().DuplicateNotifs(1)
		x.recvD(q)
		x.settle()
		x.sendP(q)
		x.settle()
		if x.posted() != 1 {
			t.Errorf("posted %d, want 1", x.posted())
		}
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		if s := x.state(x.p); s.PendingRegs+s.Matches+s.Sends != 0 {
			t.Errorf("P state = %+v, want nothing held", s)
		}
		// A late duplicate after the match is dropped, not stashed.
		x.recvD(x.req("r2", 40, 0))
		x.settle()
	})
}

// Layer-wise push: each layer's WRITE goes out as soon as the layer is
// reported saved, before the request finishes; the completion follows the
// last layer.
func TestLayerwisePushWritesEachLayerWhenSaved(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, func(side string, c *kvxfer.WorkerConfig) { c.Layerwise = side == "P" })
		q := x.req("r1", 40, 0)
		x.recvD(q)
		now := time.Now()
		x.p.step(t, &kvxfer.StepMeta{Step: 7, SchedulerClock: now, Prefill: []kvxfer.SendReq{q.send(time.Time{})}})
		x.settle()
		if x.posted() != 0 {
			t.Fatalf("posted %d before any layer was saved", x.posted())
		}
		if err := x.p.workers[0][0].LayerSaved(7, 0); err != nil {
			t.Fatal(err)
		}
		x.settle()
		if x.posted() != 1 {
			t.Fatalf("posted %d after layer 0 was saved, want 1", x.posted())
		}
		if len(x.recvResult(q)) != 0 {
			t.Fatal("D done after one of two layers")
		}
		if err := x.p.workers[0][0].LayerSaved(7, 1); err != nil {
			t.Fatal(err)
		}
		x.settle()
		if x.posted() != 2 {
			t.Fatalf("posted %d after both layers, want 2", x.posted())
		}
		x.p.step(t, &kvxfer.StepMeta{Step: 8, SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(30 * time.Second))}})
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		if err := x.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
			t.Error(err)
		}
	})
}

// An idle worker does not poll: its loop does not run while nothing
// happens (the wake channel is one slot, so no wake-up is lost either).
func TestIdleWorkerDoesNotPoll(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.EngineTTL = -1; c.RegistrationTTL = time.Minute })
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.sendP(q)
		time.Sleep(2 * time.Minute) // tombstones swept
		x.settle()
		before := x.state(x.p).Wakeups
		time.Sleep(time.Hour)
		x.settle()
		// State itself wakes the loop once per call.
		if after := x.state(x.p).Wakeups; after != before+1 {
			t.Errorf("idle P loop ran %d times in an hour, want 0", after-before-1)
		}
	})
}

// No lost wake-up: many goroutines hand the worker steps at once; every
// request is seen and ends.
func TestNoLostWakeup(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		const n = 64
		qs := make([]*xreq, n)
		for i := range qs {
			qs[i] = x.req(fmt.Sprint("r", i), 16, 0)
		}
		done := make(chan struct{})
		for i := range qs {
			go func() {
				x.recvD(qs[i])
				x.sendP(qs[i])
				done <- struct{}{}
			}()
		}
		for range qs {
			<-done
		}
		x.settle()
		for _, q := range qs {
			wantResult(t, "D "+q.id, x.recvResult(q), kvxfer.ResultDone, "")
			wantResult(t, "P "+q.id, x.sendResult(q), kvxfer.ResultDone, "")
		}
	})
}

// An idle worker still evicts engines when their TTL passes, with one
// wake-up, not by polling.
func TestEngineTTLWhileIdle(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.EngineTTL = 2 * time.Hour })
		q := x.req("r1", 40, 0)
		x.sendP(q)
		x.recvD(q)
		x.settle()
		if s := x.state(x.d); s.Engines != 1 {
			t.Fatalf("D engines = %d, want 1", s.Engines)
		}
		time.Sleep(3 * time.Hour)
		x.settle()
		if s := x.state(x.d); s.Engines != 0 || s.Wakeups > 20 {
			t.Errorf("D state after 3 idle hours = %+v, want no engine and a handful of wake-ups", s)
		}
	})
}

// SPEC §14: a registration that arrives late (after its request matched
// and finished) is dropped by its tombstone; it never fuzzily matches a
// later request with the same base id.
func TestLateDuplicateRegistrationNeverMatchesLater(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		now := time.Now()
		old := x.req("old", 40, 0)
		s := old.send(now.Add(30 * time.Second))
		s.ReqID, s.TransferID = "req-1-aaaaaaaa", ""
		r := old.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
		r.ReqID, r.TransferID, r.Remote.ReqID = "req-1-11111111", "", "req-1-aaaaaaaa"
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s}})
		x.settle()
		if got := x.out.send["req-1-aaaaaaaa"]; len(got) != 1 || got[0].Result != kvxfer.ResultDone {
			t.Fatalf("old request P outcomes = %+v, want one done", got)
		}
		// The same registration arrives again from D, late (a
		// retransmission).
		replay := x.d.agents[0][0]
		meta, _ := x.p.agents[0][0].LocalMetadata()
		peer, err := replay.LoadPeer(meta)
		if err != nil {
			t.Fatal(err)
		}
		if err := replay.Notify(peer, kvxfer.AppendRegMsg("D", 0, 1, "", "req-1-11111111", "req-1-aaaaaaaa", r.Local)); err != nil {
			t.Fatal(err)
		}
		x.settle()
		if s := x.state(x.p); s.PendingRegs != 0 {
			t.Fatalf("P stashed the late duplicate: %+v", s)
		}
		// A new P request with the same base id waits for its own D.
		newer := x.req("new", 40, 0)
		ns := newer.send(time.Now().Add(30 * time.Second))
		ns.ReqID, ns.TransferID = "req-1-bbbbbbbb", ""
		posted := x.posted()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), Send: []kvxfer.SendReq{ns}})
		x.settle()
		if s := x.state(x.p); s.Matches != 0 || s.Sends != 1 || x.posted() != posted {
			t.Errorf("P state = %+v after a new request with the old base id, want it unmatched", s)
		}
		nr := newer.recv(kvxfer.ModePush, x.p, time.Now().Add(time.Minute))
		nr.ReqID, nr.TransferID, nr.Remote.ReqID = "req-1-22222222", "", "req-1-bbbbbbbb"
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), Recv: []kvxfer.RecvReq{nr}})
		x.settle()
		if x.posted() != posted+1 {
			t.Errorf("new request posted %d WRITEs, want 1", x.posted()-posted)
		}
		if err := x.d.ranks[0][0].CheckRequest(&newer.sim, 16, 16); err != nil {
			t.Error(err)
		}
	})
}

// Bidirectional pull, turn 2 (SPEC §8): D holds its blocks under a TTL and
// P reads them back; P declines a read that could not end before D's
// expiry (less than expiryMargin, 250 ms, left), and says so. One with 3 s
// left is read (the reference declined it with its 5 s margin at the
// start; ours is at the read's end: one still in flight then is given
// up).
func TestPullSecondTurnExpiryMargin(t *testing.T) {
	for _, left := range []time.Duration{time.Minute, 3 * time.Second, 200 * time.Millisecond} {
		t.Run(left.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				// Roles swap for turn 2: engine "D" of the pair produces.
				x := newPair(t, kvxfer.ModePull, 1, 1, nil)
				q := x.req("t2", 40, 0)
				now := time.Now()
				exp := now.Add(left)
				x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(exp)}})
				r := q.recv(kvxfer.ModePull, x.p, time.Time{})
				r.Remote.Expiry, r.Remote.Generation = exp, x.pGen() // (read without the hold check, whose heartbeat extends the hold)
				x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
				time.Sleep(10 * time.Millisecond)
				x.settle()
				if left > time.Second {
					wantResult(t, "reader", x.recvResult(q), kvxfer.ResultDone, "")
					wantResult(t, "holder", x.sendResult(q), kvxfer.ResultDone, "")
					return
				}
				wantResult(t, "reader", x.recvResult(q), kvxfer.ResultExpired, "expire")
				// The holder is told at once and frees its blocks.
				wantResult(t, "holder", x.sendResult(q), kvxfer.ResultFailed, "expire")
				if x.posted() != 0 {
					t.Errorf("posted %d READs past the margin, want 0", x.posted())
				}
			})
		})
	}
}

// A lost completion notice is recovered: D's cancel at its deadline is
// answered with the notice again, and the request ends done (its bytes
// did land) instead of failed.
func TestLostCompletionRecoveredAtDeadline(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.settle()
		x.fab.Faults().DropNotifs(1) // the WRITE's completion notice
		x.sendP(q)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		if got := x.recvResult(q); len(got) != 0 {
			t.Fatalf("D = %+v without its notice", got)
		}
		time.Sleep(2 * time.Minute) // past D's one-minute deadline
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		if err := x.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
			t.Error(err)
		}
	})
}

// SPEC §2: a peer with another compatibility hash is refused; the refusing
// side fails the request at once and tells the peer, which fails its side
// at once too instead of waiting for its lease.
func TestIncompatiblePeerRefusedAndTold(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, mode, 1, 1, func(side string, c *kvxfer.WorkerConfig) {
					if side == "D" {
						c.CompatHash = "model-y"
					}
				})
				q := x.req("r1", 40, 0)
				x.sendP(q)
				x.recvD(q)
				time.Sleep(10 * time.Millisecond)
				x.settle()
				wantResult(t, "D", x.recvResult(q), kvxfer.ResultFailed, "compatibility hash")
				wantResult(t, "P", x.sendResult(q), kvxfer.ResultFailed, "compatibility hash")
				// Where the layouts agree the refusal says so: what
				// differs is outside them.
				wantResult(t, "D", x.recvResult(q), kvxfer.ResultFailed, "the layouts agree")
				wantKind(t, "D", x.recvResult(q), kvxfer.FailureIncompatible)
				if x.posted() != 0 {
					t.Errorf("posted %d transfers to an incompatible peer", x.posted())
				}
			})
		})
	}
}

// forge returns an agent that can send raw peer messages to rank 0 of se.
func (x *pair) forge(se *simEngine) func(b []byte) {
	x.t.Helper()
	a, err := x.fab.NewAgent(fmt.Sprintf("forger-%s-%d", se.id, x.posted()))
	if err != nil {
		x.t.Fatal(err)
	}
	meta, _ := se.agents[0][0].LocalMetadata()
	peer, err := a.LoadPeer(meta)
	if err != nil {
		x.t.Fatal(err)
	}
	return func(b []byte) {
		if err := a.Notify(peer, b); err != nil {
			x.t.Fatal(err)
		}
	}
}

// SPEC §12 push 33 and connector 8: a completion notice for a request the
// rank does not know is counted and skipped.
func TestUnknownCompletionSkipped(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, mode, 1, 1, nil)
				target, from := x.d, x.p
				if mode == kvxfer.ModePull {
					target, from = x.p, x.d
				}
				// From the engine's own agent: a forged one is refused
				// (TestForgedIdentityRefused).
				meta, _ := target.agents[0][0].LocalMetadata()
				peer, err := from.agents[0][0].LoadPeer(meta)
				if err != nil {
					t.Fatal(err)
				}
				if err := from.agents[0][0].Notify(peer, kvxfer.AppendDoneMsg(from.id, 0, 1, "t-nope", "d-nope", "p-nope")); err != nil {
					t.Fatal(err)
				}
				time.Sleep(10 * time.Minute) // a pull notice waits for its request a while
				x.settle()
				dropped := target.workers[0][0].Metrics().Snapshot().Dropped
				if dropped["done_unknown_request"] != 1 {
					t.Errorf("dropped = %v, want one done_unknown_request", dropped)
				}
				if s := x.state(target); s.Recvs+s.Sends+s.Early != 0 {
					t.Errorf("state = %+v, want nothing created", s)
				}
			})
		})
	}
}

// SPEC §12 push 34: empty metadata is a no-op.
func TestEmptyStepIsNoop(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		w := x.p.workers[0][0]
		if err := w.Step(nil); err != nil {
			t.Fatal(err)
		}
		if err := w.Step(&kvxfer.StepMeta{}); err != nil {
			t.Fatal(err)
		}
		x.settle()
		if s := x.state(x.p); s != (kvxfer.WorkerState{Wakeups: s.Wakeups}) {
			t.Errorf("state after empty steps = %+v, want nothing", s)
		}
	})
}

// A registration whose blocks do not fit the consumer's layout is refused:
// P fails the request for that rank and tells D, counts the bad input, and
// other requests carry on.
func TestMalformedRegistrationRejected(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		bad := x.req("bad", 40, 0)
		good := x.req("good", 40, 0)
		x.recvD(good)
		// D's registration for "bad" with block ids past D's cache, sent
		// from D's own agent (a buggy D: a forger's would not count).
		huge := []topology.Span{{IDs: []topology.BlockID{1 << 30}}}
		da := x.d.agents[0][0]
		meta, _ := x.p.agents[0][0].LocalMetadata()
		peer, err := da.LoadPeer(meta)
		if err != nil {
			t.Fatal(err)
		}
		if err := da.Notify(peer, kvxfer.AppendRegMsg("D", 0, 1, "t-bad", "d-bad", "p-bad", huge)); err != nil {
			t.Fatal(err)
		}
		x.sendP(bad, good)
		x.settle()
		wantResult(t, "P bad", x.sendResult(bad), kvxfer.ResultFailed, "registration rejected")
		wantKind(t, "P bad", x.sendResult(bad), kvxfer.FailureSetup)
		wantResult(t, "P good", x.sendResult(good), kvxfer.ResultDone, "")
		wantResult(t, "D good", x.recvResult(good), kvxfer.ResultDone, "")
		if got := x.p.workers[0][0].Metrics().Snapshot().BadInput["reg.spans"]; got != 1 {
			t.Errorf("bad registrations counted = %d, want 1", got)
		}
	})
}

// SPEC §12 connector 24: Close fails what is open, releases its transfers,
// deregisters its memory, stops its goroutines (synctest would report a
// leak), and is idempotent; calls after Close return ErrClosed.
func TestCloseReleasesEverything(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x, _ := stalledWrite(t, nil)
		w := x.p.workers[0][0]
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatalf("second Close: %v", err)
		}
		f := w.Finished()
		if len(f.Sending) != 1 || f.Sending[0].Result != kvxfer.ResultFailed || f.Sending[0].Kind != kvxfer.FailureClosed ||
			!strings.Contains(f.Sending[0].Reason, "closed") {
			t.Errorf("Finished after Close = %+v, want p-r1 failed: worker closed", f)
		}
		if err := w.Step(&kvxfer.StepMeta{}); err != kvxfer.ErrClosed {
			t.Errorf("Step after Close = %v, want ErrClosed", err)
		}
		if _, err := w.State(); err != kvxfer.ErrClosed {
			t.Errorf("State after Close = %v, want ErrClosed", err)
		}
		// Its memory is deregistered: a transfer into it fails the bounds check.
		if err := x.p.agents[0][0].Deregister([]kvxfer.MemRegion{{Addr: x.p.ranks[0][0].Layout.Regions[0].Base}}); err == nil {
			t.Error("region still registered after Close")
		}
		x.fab.Faults().Unstall(x.d.agents[0][0].Name())
	})
}

// Pull: the consumer may read and report before the producer's engine
// hands the producer its request (the params reach D first); the notice
// is kept and counted when the request arrives.
func TestPullCompletionBeforeProducerHoldsRequest(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 2, 1, nil)
		q := x.req("r1", 40, 0)
		// Its params carry the producer's generation: read at once (params
		// without one wait for the producer to hold the request:
		// holdcheck.go).
		now := time.Now()
		r := q.recv(x.mode, x.p, now.Add(time.Minute))
		r.Remote.Generation = x.pGen()
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		if s := x.state(x.p); s.Early != 1 {
			t.Fatalf("P state = %+v, want the early notice kept", s)
		}
		x.sendP(q)
		x.settle()
		if got := x.sendResult(q); len(got) != 2 || got[0].Result != kvxfer.ResultDone || got[1].Result != kvxfer.ResultDone {
			t.Errorf("P outcomes = %+v, want done on both ranks at once", got)
		}
	})
}

// logRecorder keeps the attributes of every log record.
type logRecorder struct {
	mu   sync.Mutex
	recs []map[string]string
}

func (l *logRecorder) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecorder) WithAttrs([]slog.Attr) slog.Handler       { return l }
func (l *logRecorder) WithGroup(string) slog.Handler            { return l }
func (l *logRecorder) Handle(_ context.Context, r slog.Record) error {
	m := map[string]string{"msg": r.Message}
	r.Attrs(func(a slog.Attr) bool { m[a.Key] = a.Value.String(); return true })
	l.mu.Lock()
	l.recs = append(l.recs, m)
	l.mu.Unlock()
	return nil
}

func (l *logRecorder) find(typ string) map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, r := range l.recs {
		if r["failure_type"] == typ {
			return r
		}
	}
	return nil
}

// SPEC §10: failures are logged with their type and the request's context.
func TestFailureLogging(t *testing.T) {
	tests := []struct {
		name  string
		mode  kvxfer.Mode
		fault func(x *pair)
		side  string
		typ   string
		hit   int
	}{
		{"transfer_failed push", kvxfer.ModePush, func(x *pair) { x.fab.Faults().FailTransfers(1) }, "P", "transfer_failed", 0},
		{"transfer_failed pull", kvxfer.ModePull, func(x *pair) { x.fab.Faults().FailTransfers(1) }, "D", "transfer_failed", 0},
		{"handshake_failed", kvxfer.ModePush, func(x *pair) { x.dir.FailHandshakes("P", 1) }, "D", "handshake_failed", 0},
		{"push_reg_notif_failed", kvxfer.ModePush, func(x *pair) { x.fab.Faults().FailNotify(1) }, "D", "push_reg_notif_failed", 0},
		{"notification_failed", kvxfer.ModePull, func(x *pair) { x.fab.Faults().FailNotify(1) }, "D", "notification_failed", 48},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				logs := &logRecorder{}
				x := newPair(t, tc.mode, 1, 1, func(side string, c *kvxfer.WorkerConfig) {
					if side == tc.side {
						c.Logger = slog.New(logs)
					}
				})
				q := x.req("r1", 40, tc.hit)
				tc.fault(x)
				x.sendP(q)
				x.recvD(q)
				time.Sleep(10 * time.Millisecond)
				x.settle()
				r := logs.find(tc.typ)
				if r == nil {
					t.Fatalf("no log record with failure_type %s in %v", tc.typ, logs.recs)
				}
				if r["msg"] != "kvxfer: transfer failure" {
					t.Errorf("record = %v, want message %q", r, "kvxfer: transfer failure")
				}
			})
		})
	}
}

// Pre-connect: a worker handshakes with configured peers at start.
func TestPreconnect(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
		q := startEngine(t, x.fab, x.dir, &model, e2eEngine(3, 1, 1, 16, 16), "Q", kvxfer.ModePush, func(c *kvxfer.WorkerConfig) {
			c.Preconnect = []kvxfer.PeerRef{{EngineID: "D", Addr: "D:1"}}
		})
		defer q.close(t)
		x.settle()
		if s := x.state(q); s.Engines != 1 {
			t.Errorf("Q engines after start = %d, want the pre-connected D", s.Engines)
		}
		if st := q.workers[0][0].Metrics().Snapshot(); st.HandshakeSeconds.Count != 1 || st.HandshakeFailures != 0 {
			t.Errorf("handshakes ok/failed = %d/%d, want 1/0", st.HandshakeSeconds.Count, st.HandshakeFailures)
		}
	})
}

// awaitRecorder is a Backend that records what the Worker says through
// Awaiter.
type awaitRecorder struct {
	kvxfer.Backend
	mu    sync.Mutex
	calls []bool
}

func (a *awaitRecorder) Awaiting(on bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	a.calls = append(a.calls, on)
}

func (a *awaitRecorder) said() []bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return slices.Clone(a.calls)
}

// A Worker tells an Awaiter backend (NIXL, which only polls for
// notifications) when it starts awaiting its peers' messages — D once it
// holds a request whose KV is to be written, P once it holds a request —
// and when it stops, once nothing is left; the calls pair up.
func TestWorkerTellsAwaiter(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		rec := map[string]*awaitRecorder{}
		x := newPair(t, kvxfer.ModePush, 1, 1, func(side string, c *kvxfer.WorkerConfig) {
			r := &awaitRecorder{Backend: c.Backend}
			rec[side], c.Backend = r, r
		})
		x.settle()
		if got := rec["D"].said(); len(got) != 0 {
			t.Fatalf("D said %v before holding anything", got)
		}
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.settle()
		if got := rec["D"].said(); !slices.Equal(got, []bool{true}) {
			t.Fatalf("D said %v while awaiting P's WRITE, want [true]", got)
		}
		x.sendP(q)
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		time.Sleep(10 * time.Minute) // every tombstone and timer runs out
		x.settle()
		for _, side := range []string{"P", "D"} {
			if got := rec[side].said(); !slices.Equal(got, []bool{true, false}) {
				t.Errorf("%s said %v, want [true false]: awaiting while it held the request, then not", side, got)
			}
		}
	})
}

// A Step accepted just before Close (Step returned nil) still ends in an
// outcome: the loop may see the close before it took the step's events,
// and they must join the state before shutdown fails what is open.
func TestCloseRacingStepLosesNoOutcome(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		w := x.d.workers[0][0]
		now := time.Now()
		if err := kvxfer.RaceStepWithClose(w, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(x.mode, x.p, now.Add(time.Minute))}}); err != nil {
			t.Fatal(err)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		f := w.Finished()
		if len(f.Recving) != 1 || f.Recving[0].Result != kvxfer.ResultFailed || !strings.Contains(f.Recving[0].Reason, "closed") {
			t.Errorf("Finished after a Step racing Close = %+v, want the request failed: worker closed", f)
		}
	})
}

// A pull consumer request waiting on a rank (StepMeta.Await) whose
// receive a dropped step named (the caller ends it: RecvsHeld leaves it
// out of those the worker holds) is heartbeaten no more: the receive that
// was to take over from the wait never comes. Before, the wait outlived
// its request, its heartbeats extending P's hold (and P's answers the
// wait's estimate of it) for as long as the rank lived.
func TestRecvsHeldEndsWaitOfADroppedReceive(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.sendP(q)
		now := time.Now()
		rr := q.recv(x.mode, x.p, now.Add(time.Minute))
		w := x.d.workers[0][0]
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Await: []kvxfer.AwaitReq{{ReqID: rr.ReqID, TransferID: rr.TransferID, Remote: rr.Remote}}})
		x.settle()
		if got := kvxfer.Waiting(w); !slices.Equal(got, []string{"d-r1"}) {
			t.Fatalf("D waits on %v, want d-r1", got)
		}
		held, err := w.RecvsHeld([]string{"d-r1"})
		if err != nil || len(held) != 0 {
			t.Fatalf("RecvsHeld = %v, %v; want none held", held, err)
		}
		if got := kvxfer.Waiting(w); len(got) != 0 {
			t.Errorf("D waits on %v after a dropped step named d-r1's receive (its caller ends it), want none", got)
		}
	})
}
