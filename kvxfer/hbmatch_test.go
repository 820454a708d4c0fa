package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A consumer's heartbeat finds the producer request it is for as its
// completion notice does (pullSendFor): by transfer id, else by the
// producer request id it names. A producer request held without the
// transfer id the consumer names (its engine's params lacked it) was
// never extended: its lease lapsed and its blocks went back while the
// consumer still waited to READ them.
func TestHeartbeatFindsRequestByIDWithoutTransferID(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.Lease = 6 * time.Second })
		q := x.req("r1", 40, 0)
		now := time.Now()
		s := q.send(now.Add(6 * time.Second))
		s.TransferID = ""
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s}})
		x.fab.Faults().Stall(x.p.agents[0][0].Name())
		x.recvD(q) // names transfer id t-r1
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
