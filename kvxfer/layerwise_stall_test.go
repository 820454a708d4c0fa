package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A layer-wise producer rank whose LayerSaved signals and finish never
// come (its engine stalled mid-prefill) does not hold its consumer past
// the consumer's deadline: D ends once, expired or failed, within it, and
// holds nothing; P's request, still its engine's, ends once its engine
// finishes it (one outcome, failed: its consumer gave up), holding nothing.
func TestLayerwiseStalledProducerConsumerEndsByDeadline(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, func(side string, c *kvxfer.WorkerConfig) { c.Layerwise = side == "P" })
		q := x.req("r1", 40, 0)
		x.recvD(q) // D's deadline: a minute
		now := time.Now()
		x.p.step(t, &kvxfer.StepMeta{Step: 7, SchedulerClock: now, Prefill: []kvxfer.SendReq{q.send(time.Time{})}})
		x.settle()
		if err := x.p.workers[0][0].LayerSaved(7, 0); err != nil {
			t.Fatal(err)
		}
		x.settle()
		for range 12 { // heartbeats go on meanwhile
			time.Sleep(10 * time.Second)
			x.settle()
		}
		got := x.recvResult(q)
		if len(got) != 1 || got[0].Result == kvxfer.ResultDone {
			t.Fatalf("D two minutes past a one-minute deadline, P stalled mid-layers: outcomes %+v, want one, not done", got)
		}
		if s := x.state(x.d); s.Recvs != 0 {
			t.Errorf("D still holds %d receives", s.Recvs)
		}
		if n := len(x.sendResult(q)); n != 0 {
			t.Errorf("P reported %d outcomes before its engine finished the request, want none", n)
		}
		x.p.step(t, &kvxfer.StepMeta{Step: 8, SchedulerClock: time.Now(), Send: []kvxfer.SendReq{q.send(time.Now().Add(30 * time.Second))}})
		time.Sleep(time.Minute)
		x.settle()
		if got := x.sendResult(q); len(got) != 1 || got[0].Result == kvxfer.ResultDone {
			t.Errorf("P outcomes %+v, want one, not done (its consumer gave up)", got)
		}
		if s := x.state(x.p); s.Sends+s.Matches+s.LayerSteps+s.Handles != 0 {
			t.Errorf("P still holds: %+v", s)
		}
	})
}
