package kvxfer_test

import (
	"log/slog"
	"math/rand/v2"
	"strings"
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

// A closing pull producer that still waits a second after its close
// began logs (Warn) what it waits for: each request it holds, when its
// lease ends, and the consumer engine, request and rank that last
// heartbeated it (or that none did), so that an operator whose engine
// cannot attach again until the close ends sees who holds it.
func TestPullCloseLogsWhatItWaitsFor(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		logs := &logRecorder{}
		x := newPair(t, kvxfer.ModePull, 1, 1, func(side string, c *kvxfer.WorkerConfig) {
			if side == "P" {
				c.Logger, c.CloseTimeout = slog.New(logs), 3*time.Second
			}
		})
		waiting, unheard := x.req("r1", 40, 0), x.req("r2", 40, 0)
		x.sendP(waiting, unheard)
		now := time.Now()
		rr := waiting.recv(x.mode, x.p, now.Add(time.Minute))
		// D's request waits in its engine's queue (heartbeating P) for
		// as long as P's close lasts.
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Await: []kvxfer.AwaitReq{{ReqID: rr.ReqID, TransferID: rr.TransferID, Remote: rr.Remote}}})
		x.settle()
		began := time.Now()
		if err := x.p.workers[0][0].Close(); err != nil {
			t.Fatal(err)
		}
		if took := time.Since(began); took < 3*time.Second {
			t.Fatalf("P's close took %v, want its CloseTimeout (3 s): D's request still waits", took)
		}
		var waits []map[string]string
		logs.mu.Lock()
		for _, r := range logs.recs {
			if strings.HasPrefix(r["msg"], "kvxfer: a closing worker") {
				waits = append(waits, r)
			}
		}
		logs.mu.Unlock()
		if len(waits) != 2 {
			t.Fatalf("%d logs of what the close waits for (%v), want 2: past its first second and at its timeout", len(waits), waits)
		}
		for _, w := range waits {
			if w["producer_requests"] != "2" || !strings.Contains(w["held"], `p-r1 (transfer "t-r1", lease ends in`) ||
				!strings.Contains(w["held"], `of engine "D" request "d-r1" rank 0/1, no consumer reported`) ||
				!strings.Contains(w["held"], "no consumer heartbeat, no consumer reported") {
				t.Errorf("log %v: want the 2 requests held, p-r1 last heartbeaten by D's d-r1 rank 0/1, p-r2 by none", w)
			}
		}
		if w := waits[0]; w["for"] != "1s" || w["msg"] != "kvxfer: a closing worker still waits" {
			t.Errorf("first log %q after %s, want 'still waits' after 1s", w["msg"], w["for"])
		}
		if w := waits[1]; w["for"] != "3s" || !strings.Contains(w["msg"], "fence timed out") {
			t.Errorf("second log %q after %s, want 'fence timed out' after 3s", w["msg"], w["for"])
		}
	})
}
