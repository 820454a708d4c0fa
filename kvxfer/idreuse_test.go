package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A push consumer reuses a request id for another transfer once the first
// request under it ended (an abort before it was scheduled, whose release
// waits at the producer for a producer request not there yet). The new
// registration is the new request's own: it is neither dropped as a
// duplicate of the old one nor added to it, its KV lands and both sides
// report it done; the old transfer's producer request, arriving later,
// fails at once instead of being held for its lease or written into the
// blocks the consumer has given to the new request.
func TestConsumerIDReusedForAnotherTransfer(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		now := time.Now()
		first, second := x.req("first", 40, 0), x.req("second", 40, 0)
		r1 := first.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
		r1.Local, r1.Aborted = nil, true
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r1}})
		x.settle()
		wantResult(t, "D's first", x.recvResult(first), kvxfer.ResultAborted, "")
		x.out = newOutcomes() // the id is reported again, for its new request
		// The same consumer request id, another transfer.
		r2 := second.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
		r2.ReqID = r1.ReqID
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r2}})
		x.settle()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{second.send(now.Add(30 * time.Second))}})
		x.settle()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{first.send(now.Add(30 * time.Second))}})
		x.settle()
		wantResult(t, "P's second", x.sendResult(second), kvxfer.ResultDone, "")
		if err := x.d.ranks[0][0].CheckRequest(&second.sim, 16, 16); err != nil {
			t.Errorf("the second request's KV: %v", err)
		}
		wantResult(t, "D's second", x.out.recv[r1.ReqID], kvxfer.ResultDone, "")
		wantResult(t, "P's first", x.sendResult(first), kvxfer.ResultFailed, "registered again for another transfer")
		if got := x.p.workers[0][0].Metrics().Snapshot().Dropped["reg_superseded"]; got != 1 {
			t.Errorf("Dropped[reg_superseded] = %d, want 1", got)
		}
	})
}

// While the producer still holds the transfer a consumer request id was
// paired with (a layer-wise request still prefilling, its consumer rank
// gone), a registration under that id for another transfer is refused at
// once (reg_id_in_use): it neither joins the held request's ranks nor
// waits out its deadline.
func TestConsumerIDInUseRefused(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, func(side string, c *kvxfer.WorkerConfig) { c.Layerwise = side == "P" })
		now := time.Now()
		first, second := x.req("first", 40, 0), x.req("second", 40, 0)
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{first.recv(kvxfer.ModePush, x.p, now.Add(time.Second))}})
		x.p.step(t, &kvxfer.StepMeta{Step: 7, SchedulerClock: now, Prefill: []kvxfer.SendReq{first.send(time.Time{})}})
		x.settle()
		time.Sleep(2 * time.Second) // D gives the first request up; P still prefills it
		x.settle()
		wantResult(t, "D's first", x.recvResult(first), kvxfer.ResultExpired, "")
		x.out = newOutcomes()
		r2 := second.recv(kvxfer.ModePush, x.p, time.Now().Add(time.Minute))
		r2.ReqID = "d-first"
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), Recv: []kvxfer.RecvReq{r2}})
		x.settle()
		wantResult(t, "D's second", x.out.recv["d-first"], kvxfer.ResultFailed, "still paired here with transfer")
		if got := x.p.workers[0][0].Metrics().Snapshot().Dropped["reg_id_in_use"]; got != 1 {
			t.Errorf("Dropped[reg_id_in_use] = %d, want 1", got)
		}
	})
}
