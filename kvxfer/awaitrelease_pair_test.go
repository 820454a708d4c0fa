package kvxfer_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A pull consumer request waiting in its engine's queue (StepMeta.Await)
// is heartbeaten at its producer, each heartbeat extending the
// producer's hold by its Lease·2/3. However it ends while it waits, the
// producer is told at once and its request ends then, not when the
// extension runs out. Before, only a receive (an empty one's release, or
// a receive's own end) told it: a wait that ended in the queue left the
// producer holding its blocks. No time passes here unless said.
func TestWaitEndReleasesItsProducer(t *testing.T) {
	cases := []struct {
		name   string
		tweak  func(side string, c *kvxfer.WorkerConfig)
		end    func(t *testing.T, x *pair, rr kvxfer.RecvReq)
		result kvxfer.Result
		reason string
	}{
		{name: "AwaitEnd", end: func(t *testing.T, x *pair, rr kvxfer.RecvReq) {
			x.d.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), AwaitEnd: []string{rr.ReqID}})
		}, result: kvxfer.ResultFailed, reason: "waited in its engine's queue"},
		{name: "RecvsHeld", end: func(t *testing.T, x *pair, rr kvxfer.RecvReq) {
			if held, err := x.d.workers[0][0].RecvsHeld([]string{rr.ReqID}); err != nil || len(held) != 0 {
				t.Fatalf("RecvsHeld = %v, %v; want none held", held, err)
			}
		}, result: kvxfer.ResultFailed, reason: "step was dropped"},
		{name: "Close", end: func(t *testing.T, x *pair, rr kvxfer.RecvReq) {
			if err := x.d.workers[0][0].Close(); err != nil {
				t.Fatal(err)
			}
		}, result: kvxfer.ResultFailed, reason: "worker closed"},
		{name: "RefusedReceive", tweak: func(side string, c *kvxfer.WorkerConfig) {
			if side == "D" {
				c.MaxRequests = 1
			}
		}, end: func(t *testing.T, x *pair, rr kvxfer.RecvReq) {
			// Its receive comes with another's that takes the rank's
			// one place: it is refused, and its wait ends with it.
			other := x.req("r2", 40, 0)
			now := time.Now()
			x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{other.recv(x.mode, x.p, now.Add(time.Minute)), rr}})
		}, result: kvxfer.ResultFailed, reason: "consumer rank 0"},
		{name: "EmptyReceiveSameStep", end: func(t *testing.T, x *pair, rr kvxfer.RecvReq) {
			// Aborted in the queue (Scheduler.RequestFinished): its
			// AwaitEnd and its empty receive come in one step. The
			// receive's release tells the producer (done), once.
			rr.Local, rr.Aborted = nil, true
			x.d.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), AwaitEnd: []string{rr.ReqID}, Recv: []kvxfer.RecvReq{rr}})
		}, result: kvxfer.ResultDone},
		{name: "RegistrationTTL", tweak: func(side string, c *kvxfer.WorkerConfig) {
			if side == "D" {
				c.RegistrationTTL = 2 * time.Second
			} else {
				c.Lease = time.Hour // each heartbeat extends the hold by 40 min
			}
		}, end: func(t *testing.T, x *pair, rr kvxfer.RecvReq) {
			// Past D's RegistrationTTL (and its next heartbeat round,
			// D's Lease/6), well inside P's request's own 30 s.
			time.Sleep(10 * time.Second)
		}, result: kvxfer.ResultFailed, reason: "RegistrationTTL"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, kvxfer.ModePull, 1, 1, tc.tweak)
				q := x.req("r1", 40, 0)
				x.sendP(q)
				now := time.Now()
				rr := q.recv(x.mode, x.p, now.Add(time.Minute))
				x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Await: []kvxfer.AwaitReq{{ReqID: rr.ReqID, TransferID: rr.TransferID, Remote: rr.Remote}}})
				x.settle()
				if got := x.sendResult(q); len(got) != 0 {
					t.Fatalf("P ended %+v while D's request waited", got)
				}
				tc.end(t, x, rr)
				x.settle()
				wantResult(t, "P", x.sendResult(q), tc.result, tc.reason)
			})
		})
	}
}

// A consumer rank heartbeats every rank of its producer, but reads from,
// and so tells of a request's end, only those it reads from: with a
// producer of more ranks than the consumer, the ranks another consumer
// rank reads are told by that one. Before, each consumer rank told every
// producer rank its heartbeats reached, and the ranks it does not read
// from refused the notice as bad input (done.tp_rank), one warning per
// request and rank.
func TestWaitEndTellsOnlyTheRanksItReads(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 4, 2, nil)
		q := x.req("r1", 40, 0)
		x.sendP(q)
		now := time.Now()
		rr := q.recv(x.mode, x.p, now.Add(time.Minute))
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Await: []kvxfer.AwaitReq{{ReqID: rr.ReqID, TransferID: rr.TransferID, Remote: rr.Remote}}})
		x.settle()
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), AwaitEnd: []string{rr.ReqID}})
		x.settle()
		if got := x.sendResult(q); len(got) != 4 {
			t.Errorf("P outcomes %+v, want one per rank (4)", got)
		} else {
			for _, o := range got {
				if o.Result != kvxfer.ResultFailed || !strings.Contains(o.Reason, "waited in its engine's queue") {
					t.Errorf("P outcome %+v, want failed: waited in its engine's queue", o)
				}
			}
		}
		for tp, w := range x.p.workers[0] {
			if n := w.Metrics().Snapshot().BadInput["done.tp_rank"]; n != 0 {
				t.Errorf("P rank %d: bad_input{field=\"done.tp_rank\"} = %d, want 0", tp, n)
			}
		}
	})
}
