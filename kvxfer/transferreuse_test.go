package kvxfer_test

import (
	"fmt"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A push pair completes; the router then sends a new pair under the same
// consumer request id, transfer id and producer request id (a router that
// reuses its transfer ids, with request ids used again). The producer's
// tombstone of the first pair names the new registration exactly as it
// names a copy of the old one: the registration must not be dropped (the
// consumer then waited for its deadline, cancelled, and the producer
// answered the cancel with the first transfer's completion notice: D
// reported blocks loaded that nothing wrote). It fails at once, naming
// the transfer id, and the consumer's request ends once, failed.
func TestTransferIDReusedAfterDoneFailsNotAnsweredByTheOldOne(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		first := x.req("first", 40, 0)
		x.recvD(first)
		x.sendP(first)
		x.settle()
		wantResult(t, "P's first", x.sendResult(first), kvxfer.ResultDone, "")
		wantResult(t, "D's first", x.recvResult(first), kvxfer.ResultDone, "")
		x.out = newOutcomes()
		posted := x.posted()
		second := x.req("second", 40, 0)
		now := time.Now()
		r2 := second.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
		r2.ReqID, r2.TransferID, r2.Remote.ReqID = "d-first", "t-first", "p-first"
		s2 := second.send(now.Add(30 * time.Second))
		s2.ReqID, s2.TransferID = "p-first", "t-first"
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r2}})
		x.settle()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s2}})
		x.settle()
		time.Sleep(2 * time.Minute) // past D's deadline and P's lease
		x.settle()
		got := x.out.recv["d-first"]
		if len(got) == 1 && got[0].Result == kvxfer.ResultDone {
			if err := x.d.ranks[0][0].CheckRequest(&second.sim, 16, 16); err != nil {
				t.Fatalf("D's second request reported done, its blocks hold: %v (WRITEs posted for it: %d)", err, x.posted()-posted)
			}
		}
		wantResult(t, "D's second", got, kvxfer.ResultFailed, `"t-first"`)
		if len(x.out.send["p-first"]) != 1 {
			t.Errorf("P's second outcomes = %+v, want one", x.out.send["p-first"])
		}
	})
}

// reuse is a transfer-reuse scenario: a pair under ids d-first, t-first
// and p-first completes; second is the next request, to be sent under the
// same three ids.
type reuse struct {
	x      *pair
	second *xreq
}

func newReuse(t *testing.T, mode kvxfer.Mode, tweak func(side string, c *kvxfer.WorkerConfig)) *reuse {
	t.Helper()
	x := newPair(t, mode, 1, 1, tweak)
	first := x.req("first", 40, 0)
	x.recvD(first)
	x.sendP(first)
	x.settle()
	wantResult(t, "P's first", x.sendResult(first), kvxfer.ResultDone, "")
	wantResult(t, "D's first", x.recvResult(first), kvxfer.ResultDone, "")
	if err := x.d.ranks[0][0].CheckRequest(&first.sim, 16, 16); err != nil {
		t.Fatalf("D's first request: %v", err)
	}
	x.out = newOutcomes()
	// The second request's KV differs from the first one's: a byte of
	// the first's in its blocks is caught.
	second := x.req("second", 40, 0)
	second.sim.Salt = 5
	for _, stage := range x.p.ranks {
		for _, r := range stage {
			r.FillSalt(second.sim.P, second.sim.Salt)
		}
	}
	return &reuse{x: x, second: second}
}

// stepD hands D the second request under the first one's ids.
func (u *reuse) stepD(t *testing.T) {
	t.Helper()
	now := time.Now()
	r2 := u.second.recv(u.x.mode, u.x.p, now.Add(time.Minute))
	r2.ReqID, r2.TransferID, r2.Remote.ReqID = "d-first", "t-first", "p-first"
	u.x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r2}})
	u.x.settle()
}

// stepP hands P the second request under the first one's ids, with a
// lease of an hour: it must not be what ends the request.
func (u *reuse) stepP(t *testing.T) {
	t.Helper()
	now := time.Now()
	s2 := u.second.send(now.Add(time.Hour))
	s2.ReqID, s2.TransferID = "p-first", "t-first"
	u.x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s2}})
	u.x.settle()
}

// A consumer rank refuses, at its engine's intake, a request under the
// consumer id, transfer id and producer request of one it finished
// (within RegistrationTTL): a producer cannot tell its registration from
// the finished one's (one without the producer's own check answered its
// cancel with the finished transfer's completion notice: blocks reported
// loaded that nothing wrote). The refusal names the field and value, is
// counted, sends the producer no registration, and ends the request
// once, failed (its engine recomputes). The producer's request under
// those ids ends at once too, its blocks back to its engine long before
// its lease of an hour (no time passes in this test). A later request
// under the consumer id with a transfer id of its own moves as usual.
func TestConsumerRefusesAFinishedTransferReusedAtIntake(t *testing.T) {
	for _, pFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("producer_first=%v", pFirst), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				u := newReuse(t, kvxfer.ModePush, nil)
				x := u.x
				regsBefore := x.p.workers[0][0].Metrics().Snapshot().Dropped["reg_after_finish"]
				if pFirst {
					u.stepP(t)
				}
				u.stepD(t)
				if !pFirst {
					u.stepP(t)
				}
				wantResult(t, "D's second", x.out.recv["d-first"], kvxfer.ResultFailed, `recv_req.transfer_id "t-first"`)
				if n := x.d.workers[0][0].Metrics().Snapshot().BadInput["recv_req.transfer_id"]; n != 1 {
					t.Errorf(`D's BadInput["recv_req.transfer_id"] = %d, want 1`, n)
				}
				if n := x.p.workers[0][0].Metrics().Snapshot().Dropped["reg_after_finish"] - regsBefore; n != 0 {
					t.Errorf("P got %d registrations of the refused request, want none", n)
				}
				wantResult(t, "P's second (lease an hour away)", x.out.send["p-first"], kvxfer.ResultFailed, "t-first")
				if s := x.held(x.p); s.Sends != 0 || s.Matches != 0 {
					t.Errorf("P holds %+v after its second request ended", s)
				}
				if s := x.held(x.d); s.Recvs != 0 {
					t.Errorf("D holds %+v after its second request ended", s)
				}

				// The consumer id again, with a transfer of its own: moved.
				x.out = newOutcomes()
				third := x.req("third", 40, 0)
				now := time.Now()
				r3 := third.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
				r3.ReqID = "d-first"
				x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r3}})
				x.sendP(third)
				x.settle()
				wantResult(t, "P's third", x.sendResult(third), kvxfer.ResultDone, "")
				wantResult(t, "D's third (under d-first)", x.out.recv["d-first"], kvxfer.ResultDone, "")
				if err := x.d.ranks[0][0].CheckRequest(&third.sim, 16, 16); err != nil {
					t.Errorf("D's third request: %v", err)
				}
			})
		})
	}
}

// The producer's side of a reused transfer, where the consumer no longer
// remembers the finished one (its RegistrationTTL is shorter: it
// registers): the producer fails the registration (naming the transfer
// id), and its own request under those ids, held before the registration
// came or arriving after it, ends at once, failed: no consumer can be
// written through it any more. Before, it held its blocks until its
// lease (an hour here; no time passes in this test).
func TestProducerRequestOfAReusedTransferEndsAtOnce(t *testing.T) {
	for _, pFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("producer_first=%v", pFirst), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				u := newReuse(t, kvxfer.ModePush, func(side string, c *kvxfer.WorkerConfig) {
					if side == "D" {
						c.RegistrationTTL = time.Second
					}
				})
				x := u.x
				time.Sleep(2 * time.Second) // past D's memory of the first, not P's
				x.settle()
				if pFirst {
					u.stepP(t)
				}
				u.stepD(t)
				if !pFirst {
					u.stepP(t)
				}
				wantResult(t, "D's second", x.out.recv["d-first"], kvxfer.ResultFailed, `"t-first"`)
				wantResult(t, "P's second (lease an hour away)", x.out.send["p-first"], kvxfer.ResultFailed, `"t-first"`)
				if s := x.held(x.p); s.Sends != 0 || s.Matches != 0 {
					t.Errorf("P holds %+v after its second request ended", s)
				}
			})
		})
	}
}

// Pull: the next pair under the ids of a finished one. D reads the second
// request's blocks (not the first one's), with a READ, and both sides
// end once: done, with the second request's bytes; or failed (D
// recomputes). Never done without the bytes.
func TestPullTransferReusedReadsItsOwnBlocks(t *testing.T) {
	for _, pFirst := range []bool{false, true} {
		t.Run(fmt.Sprintf("producer_first=%v", pFirst), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				u := newReuse(t, kvxfer.ModePull, nil)
				x := u.x
				posted := x.posted()
				if pFirst {
					u.stepP(t)
				}
				u.stepD(t)
				if !pFirst {
					u.stepP(t)
				}
				time.Sleep(10 * time.Second) // READ retries, none near the lease
				x.settle()
				got := x.out.recv["d-first"]
				if len(got) != 1 {
					t.Fatalf("D's second outcomes = %+v, want one", got)
				}
				if got[0].Result == kvxfer.ResultDone {
					if err := x.d.ranks[0][0].CheckRequest(&u.second.sim, 16, 16); err != nil {
						t.Fatalf("D's second request reported done, its blocks hold: %v (READs posted for it: %d)", err, x.posted()-posted)
					}
				}
				if p := x.out.send["p-first"]; len(p) != 1 {
					t.Errorf("P's second outcomes = %+v, want one (its lease is an hour away)", p)
				}
				t.Logf("D: %+v; P: %+v", got, x.out.send["p-first"])
			})
		})
	}
}

// lateDone is a backend whose sender learns that a transfer ended only
// once let: the bytes land and the receiver has the notification, while
// the sender's polls still say in progress (the window between a
// consumer acting on a WRITE's notification and its producer seeing the
// WRITE done).
type lateDone struct {
	kvxfer.Backend
	mu   sync.Mutex
	hold bool
}

func (b *lateDone) State(id kvxfer.XferID) (kvxfer.XferState, error) {
	s, err := b.Backend.State(id)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.hold && s == kvxfer.XferDone {
		return kvxfer.XferInProgress, nil
	}
	return s, err
}

func (b *lateDone) let() {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.hold = false
}

// The window before the producer tombstones a pair: the consumer acts on
// the WRITE's notification (its request done, its engine reuses the ids
// at once) while the producer has not yet seen its WRITE end, so it still
// holds the pair when the new request's registration arrives. A consumer
// that remembers the finished transfer refuses the new request itself
// (TestConsumerRefusesAFinishedTransferReusedAtIntake); this one does not
// (its RegistrationTTL passed, as for a consumer without that check, or
// one past its bound). The registration must not be dropped as a
// duplicate of the held pair's: the new request then waited for its
// deadline, cancelled, and the producer, its pair tombstoned by then,
// answered the cancel with the finished transfer's completion notice (D
// reported blocks loaded that nothing wrote). It fails, naming the
// transfer id, and the producer's request of that transfer fails too,
// long before its lease of an hour.
func TestTransferReusedBeforeTheProducerSawItsWriteEnd(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		gate := &lateDone{hold: true}
		x := newPair(t, kvxfer.ModePush, 1, 1, func(side string, c *kvxfer.WorkerConfig) {
			switch side {
			case "P":
				gate.Backend, c.Backend = c.Backend, gate
			case "D":
				c.RegistrationTTL = time.Second
			}
		})
		first := x.req("first", 40, 0)
		x.recvD(first)
		x.sendP(first)
		x.settle()
		wantResult(t, "D's first", x.recvResult(first), kvxfer.ResultDone, "")
		if got := x.sendResult(first); len(got) != 0 {
			t.Fatalf("P's first ended before its WRITE was seen to: %+v", got)
		}
		time.Sleep(2 * time.Second) // past D's memory of the first
		x.settle()
		x.out = newOutcomes()
		u := &reuse{x: x, second: x.req("second", 40, 0)}
		posted := x.posted()
		u.stepD(t)
		gate.let()
		time.Sleep(time.Millisecond) // P's next poll
		x.settle()
		wantResult(t, "P's first", x.out.send["p-first"], kvxfer.ResultDone, "")
		if len(x.out.recv["d-first"]) == 0 {
			t.Errorf("D's second has no outcome once P's first ended, want it failed then")
		}
		time.Sleep(2 * time.Minute) // past D's deadline for the second
		x.settle()
		got := x.out.recv["d-first"]
		if len(got) == 1 && got[0].Result == kvxfer.ResultDone {
			if err := x.d.ranks[0][0].CheckRequest(&u.second.sim, 16, 16); err != nil {
				t.Fatalf("D's second request reported done, its blocks hold: %v (WRITEs posted for it: %d)", err, x.posted()-posted)
			}
		}
		wantResult(t, "D's second", got, kvxfer.ResultFailed, `"t-first"`)
		if got[0].Reason == "" || !strings.Contains(got[0].Reason, "completed already") {
			t.Errorf("D's second failed as %q, want the producer's word that the transfer completed already (not its own deadline)", got[0].Reason)
		}
		// P's engine hands over its next request under the id once the
		// first one ended.
		x.out = newOutcomes()
		u.stepP(t)
		wantResult(t, "P's second (lease an hour away)", x.out.send["p-first"], kvxfer.ResultFailed, `"t-first"`)
		if s := x.held(x.p); s.Sends != 0 || s.Matches != 0 || s.PendingRegs != 0 {
			t.Errorf("P holds %+v after both its requests ended", s)
		}
	})
}
