package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// Push: D uses a request id again once its request finished (an engine
// whose request ids are not made unique, vLLM's
// VLLM_DISABLE_REQUEST_ID_RANDOMIZATION): the new request, another
// transfer id, is a new transfer. P's tombstone of the first one must
// neither drop the new registration (D would wait for its deadline) nor,
// when D then gives up, answer D's cancel with the first transfer's
// completion notice (D would report the request done with nothing landed).
func TestReusedConsumerRequestIDIsANewTransfer(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		first := x.req("a", 40, 0)
		x.recvD(first)
		x.sendP(first)
		x.settle()
		wantResult(t, "first D", x.recvResult(first), kvxfer.ResultDone, "")
		wantResult(t, "first P", x.sendResult(first), kvxfer.ResultDone, "")
		// D's id "d-a" again, for another request and transfer: the first
		// ended, so a report for the id is a new one.
		x.out.seen = map[string]bool{}
		second := x.req("b", 40, 0)
		now := time.Now()
		r := second.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
		r.ReqID = "d-a"
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
		x.sendP(second)
		time.Sleep(2 * time.Minute) // past D's deadline, were the registration dropped
		x.settle()
		got := x.out.recv["d-a"]
		if len(got) != 2 || got[1].Result != kvxfer.ResultDone {
			t.Fatalf("D outcomes for d-a = %+v, want the second done too", got)
		}
		wantResult(t, "second P", x.sendResult(second), kvxfer.ResultDone, "")
		if err := x.d.ranks[0][0].CheckRequest(&second.sim, 16, 16); err != nil {
			t.Errorf("the second request's KV on D: %v", err)
		}
	})
}
