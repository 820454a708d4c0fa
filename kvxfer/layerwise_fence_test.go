package kvxfer_test

import (
	"bytes"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// Without data-plane grants (NIXL; here OpenDataPlane), a consumer whose
// producer engine changed generation (another of its ranks re-attached)
// must not report a request while a producer rank that did not change
// still has a layer's WRITE in flight into its blocks: the engine reuses
// them once the request reports, and the WRITE lands in them after. It
// waits for that rank's confirmation (its cancel's acknowledgement), as
// for any cancel.
func TestLayerwiseGenerationChangeFencesLiveRanks(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		// Rank 0's layer 0 goes out and stalls in flight.
		x, q, dAgent := layerInFlight(t, 0)
		// P's rank 1 re-attaches (a new agent, a new Worker: its old one
		// still runs): a new generation.
		a, err := x.fab.NewAgent("P/pp0/tp1-again")
		if err != nil {
			t.Fatal(err)
		}
		r1 := x.p.ranks[0][1]
		if _, err := a.Map(r1.Base, r1.Mem); err != nil {
			t.Fatal(err)
		}
		w1, err := kvxfer.NewWorker(kvxfer.WorkerConfig{EngineID: "P", Addr: "P:1", Mode: kvxfer.ModePush, Layout: r1.Layout, Backend: a,
			Resolver: x.dir, CompatHash: "model-x", Logger: quiet, Layerwise: true, OpenDataPlane: true})
		if err != nil {
			t.Fatal(err)
		}
		defer w1.Close()
		meta, err := a.LocalMetadata()
		if err != nil {
			t.Fatal(err)
		}
		if err := x.dir.Publish(kvxfer.RankInfo{EngineID: "P", CompatHash: "model-x", Layout: r1.Layout, Agent: meta}); err != nil {
			t.Fatal(err)
		}
		// D probes P and finds the change.
		time.Sleep(3 * time.Second)
		x.settle()
		res := x.recvResult(q)
		before := x.d.ranks[0][0].Snapshot()
		x.fab.Faults().Unstall(dAgent.Name())
		time.Sleep(5 * time.Second) // well inside FenceTimeout
		x.settle()
		after := x.d.ranks[0][0].Snapshot()
		if len(res) > 0 && !bytes.Equal(before, after) {
			t.Errorf("D reported %v while P rank 0's WRITE was in flight; the WRITE landed in D's blocks after that outcome", res)
		}
		if got := x.recvResult(q); len(got) != 1 || got[0].Result == kvxfer.ResultDone {
			t.Errorf("D outcomes %v, want exactly one, failed (no layer 1 was written)", got)
		}
	})
}

// A producer rank let go while its layer's WRITE is still in flight (a
// daemon unpublishes it, a new generation without it, before its
// Worker's close fenced its WRITEs) may still write: without grants the
// consumer does not report the request until nothing of it can land.
func TestLayerwiseRankLeftMidWriteFenced(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x, q, dAgent := layerInFlight(t, 1)
		// Rank 1's stream ends: unpublished, its Worker closing (its
		// WRITE still in flight).
		x.dir.Unpublish("P", 1, 0)
		closed := make(chan error, 1)
		go func() { closed <- x.p.workers[0][1].Close() }()
		time.Sleep(3 * time.Second) // D probes P and finds the change
		x.settle()
		res := x.recvResult(q)
		before := x.d.ranks[0][0].Snapshot()
		x.fab.Faults().Unstall(dAgent.Name())
		time.Sleep(time.Second)
		x.settle()
		if after := x.d.ranks[0][0].Snapshot(); len(res) > 0 && !bytes.Equal(before, after) {
			t.Errorf("D reported %v while P rank 1's WRITE was in flight; the WRITE landed in D's blocks after that outcome", res)
		}
		<-closed
		time.Sleep(3 * time.Minute) // past FenceTimeout
		x.settle()
		if got := x.recvResult(q); len(got) != 1 || got[0].Result == kvxfer.ResultDone {
			t.Errorf("D outcomes %v, want exactly one, failed", got)
		}
	})
}

// layerInFlight is a layer-wise push pair without grants (P TP 2, D TP 1)
// with request r1 prefilling on P, registered by D, and layer 0's WRITE
// from P's rank tp posted and stalled in flight (D's agent stalled).
func layerInFlight(t *testing.T, tp int) (*pair, *xreq, *kvxfertest.Agent) {
	t.Helper()
	x := newPair(t, kvxfer.ModePush, 2, 1, func(side string, c *kvxfer.WorkerConfig) {
		c.Layerwise = side == "P"
		c.OpenDataPlane = true
	})
	q := x.req("r1", 40, 0)
	x.recvD(q)
	x.p.step(t, &kvxfer.StepMeta{Step: 7, SchedulerClock: time.Now(), Prefill: []kvxfer.SendReq{q.send(time.Time{})}})
	x.settle()
	dAgent := x.d.agents[0][0]
	x.fab.Faults().Stall(dAgent.Name())
	if err := x.p.workers[0][tp].LayerSaved(7, 0); err != nil {
		t.Fatal(err)
	}
	x.settle()
	if x.posted() == 0 {
		t.Fatal("no WRITE posted after layer 0 was saved")
	}
	return x, q, dAgent
}
