package kvxfer_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A pull producer closed (its engine's stream lost, or the daemon
// stopping) while a consumer's READ of a request it holds is in flight:
// the request reports, and its blocks go back to the engine, only once
// the consumer said its READ ended (within CloseTimeout), and the consumer
// gets the bytes. Before, the close reported the request failed at once
// while the READ still read the blocks (an engine that reads its outcomes
// could reuse them under it, and the backend's agent was destroyed under
// the READ: with NIXL over TCP, a crash, README).
func TestPullCloseWaitsForReadInFlight(t *testing.T) {
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	p := startEngine(t, fab, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePull,
		func(c *kvxfer.WorkerConfig) { c.CloseTimeout = 2 * time.Second })
	d := startEngine(t, fab, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePull, nil)
	t.Cleanup(func() { fab.Faults().Unstall(p.agents[0][0].Name()); d.close(t); p.close(t) })

	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(9, 10))
	a := makeRequest("a", 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	b := makeRequest("b", 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p.ranks[0][0].Fill(a.sim.P)
	p.ranks[0][0].Fill(b.sim.P)
	start := time.Now()

	// a: D's READ is in flight (P's data path stalled). b: held, and
	// no consumer ever reads it.
	fab.Faults().Stall(p.agents[0][0].Name())
	p.step(t, &kvxfer.StepMeta{SchedulerClock: start, Send: []kvxfer.SendReq{a.send(start.Add(time.Hour)), b.send(start.Add(time.Hour))}})
	d.step(t, &kvxfer.StepMeta{SchedulerClock: start, Recv: []kvxfer.RecvReq{a.recv(kvxfer.ModePull, p, start.Add(time.Hour))}})
	for deadline := time.Now().Add(10 * time.Second); d.agents[0][0].InFlight() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("D never posted its READ of a")
		}
	}

	closed := make(chan error, 1)
	go func() { closed <- p.workers[0][0].Close() }()
	time.Sleep(200 * time.Millisecond)
	out := newOutcomes()
	out.collect(t, p)
	if got := out.send["p-a"]; len(got) != 0 {
		t.Fatalf("P reported a (%+v) while D's READ of its blocks was in flight", got)
	}
	select {
	case err := <-closed:
		t.Fatalf("P's Close returned (%v) while D's READ of its blocks was in flight", err)
	default:
	}

	fab.Faults().Unstall(p.agents[0][0].Name())
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(15 * time.Second):
		t.Fatal("P's Close did not return within its CloseTimeout")
	}
	out.collect(t, p)
	if got := out.send["p-a"]; len(got) != 1 || got[0].Result != kvxfer.ResultDone {
		t.Fatalf("P's a after the READ ended: outcomes %+v, want one done", got)
	}
	if got := out.send["p-b"]; len(got) != 1 || got[0].Result != kvxfer.ResultFailed || got[0].Kind != kvxfer.FailureClosed {
		t.Fatalf("P's b, never read: outcomes %+v, want one failed (worker closed)", got)
	}
	if got := awaitRecv(t, out, d, "d-a"); len(got) != 1 || got[0].Result != kvxfer.ResultDone {
		t.Fatalf("D's a: outcomes %+v, want one done", got)
	}
	if err := d.ranks[0][0].CheckRequest(&a.sim, 16, 16); err != nil {
		t.Fatalf("a's bytes: %v", err)
	}
}
