package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A pull consumer's READ that never ends (the producer's data path stalls
// while its daemon still answers) does not keep the request from its one
// outcome past its deadline: the READ is given up (released, so nothing
// of it lands any more) and the request reports expired, its blocks
// invalid. Before, it waited for the READ for ever: no outcome on D, and
// once D stopped heartbeating the decided request, P's lease lapsed and
// its blocks went back while the READ could still read them.
func TestPullStalledReadEndsAtDeadline(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.Lease = 6 * time.Second })
		q := x.req("r1", 40, 0)
		x.sendP(q)
		x.settle()
		x.fab.Faults().Stall(x.p.agents[0][0].Name())
		x.recvD(q) // deadline: a minute
		time.Sleep(2 * time.Minute)
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultExpired, "deadline")
		// P is told once the READ was released, not left to its lease.
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultFailed, "consumer rank 0: producer did not complete before the deadline")
		if s := x.state(x.d); s.Recvs != 0 {
			t.Errorf("D still holds %d requests", s.Recvs)
		}
		x.fab.Faults().Unstall(x.p.agents[0][0].Name())
		time.Sleep(time.Minute)
		x.settle()
		if got := x.recvResult(q); len(got) != 1 {
			t.Errorf("D outcomes %+v, want one", got)
		}
		if got := x.sendResult(q); len(got) != 1 {
			t.Errorf("P outcomes %+v, want one", got)
		}
	})
}

// The class: a pull consumer request that failed (one producer rank's
// READ failed) while its READ from another rank stalls, with no deadline
// to end it, gives that READ up too: its outcome is failed whatever the
// READ does. Before, the request waited for the stalled READ for ever.
func TestPullFailedRequestGivesUpStalledRead(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 2, 1, nil)
		q := x.req("r1", 40, 0)
		x.sendP(q)
		x.settle()
		x.fab.Faults().Stall(x.p.agents[0][1].Name())
		x.fab.Faults().FailTransfers(1) // the READ from P rank 0
		now := time.Now()
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, x.p, time.Time{})}})
		time.Sleep(10 * time.Second)
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultFailed, "READ failed")
		if s := x.state(x.d); s.Recvs != 0 {
			t.Errorf("D still holds %d requests", s.Recvs)
		}
		for rank, w := range x.p.workers[0] {
			if s, _ := w.State(); s.Sends != 0 {
				t.Errorf("P rank %d still holds %d requests", rank, s.Sends)
			}
		}
		x.fab.Faults().Unstall(x.p.agents[0][1].Name())
		time.Sleep(time.Minute)
		x.settle()
		if got := x.recvResult(q); len(got) != 1 {
			t.Errorf("D outcomes %+v, want one", got)
		}
		if got := x.sendResult(q); len(got) != 2 {
			t.Errorf("P outcomes %+v, want one per rank", got)
		}
	})
}
