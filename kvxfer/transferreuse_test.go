package kvxfer_test

import (
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
