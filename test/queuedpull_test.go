package test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A pull consumer request queued on D past the producer's lease, over
// real daemons, on both backends: P (a 2 s lease; both daemons' worker
// lease 2 s, so D heartbeats every third of a second) finishes A in
// blocks X; D's engine takes A at its arrival (Scheduler.NewRequest) but
// allocates it only 4 s later (its queue was full). D's ranks heartbeat
// P for A from its arrival: P keeps its hold (and answers with it), so A
// is read then, done with A's own bytes, and P's A is done; neither
// daemon holds anything afterwards. Before, D's ranks heartbeat only
// requests allocated to them: A's lease lapsed while it waited, P ended
// it, and D's read of it expired (recomputed).
func TestQueuedPullKeepsTheProducersHold(t *testing.T) {
	for _, backend := range []string{"builtin", "nixl"} {
		t.Run(backend, func(t *testing.T) {
			if backend == "nixl" {
				skipWithoutNixl(t)
			}
			useBackend(t, backend)
			queuedPull(t)
		})
	}
}

func queuedPull(t *testing.T) {
	dir := world(t)
	pMetrics, dMetrics := freeAddr(t), freeAddr(t)
	lease := "-lease=" + latePullLease.String()
	p := startDaemon(t, dir, "P", "-metrics-listen", pMetrics, lease)
	d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics, lease)
	m := simModel
	P, err := simengine.Attach(simengine.Config{Dir: dir, Sock: p.Sock, Peer: p.Peer, ID: "P", Model: &m, Engine: simEngine(1, 1),
		Mode: kvxfer.ModePull, Version: "test", Lease: latePullLease})
	if err != nil {
		t.Fatal(err)
	}
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePull)
	defer D.Close()

	X := []topology.BlockID{0, 1}
	paramsA := finishPull(t, P, "p-a", "t-a", X)
	if paramsA.RemoteBlocksExpiry.IsZero() {
		t.Fatal("P's params for A carry no expiry")
	}
	prm := *paramsA
	req := &kvxfer.Request{ID: "d-a", PromptTokens: 32, Params: &prm}
	if err := D.Sched.NewRequest(req); err != nil {
		t.Fatal(err)
	}
	if err := D.Step(D.Sched.BuildMeta()); err != nil {
		t.Fatal(err)
	}
	// A waits in D's queue twice P's lease.
	wait := 2 * latePullLease
	if o, ok := outcomesOf(t, P, wait, "p-a")["p-a"]; ok {
		t.Fatalf("P ended A while D's request for it waited in D's queue (%v, P's lease %v): %+v", wait, latePullLease, o)
	}
	if late := time.Since(paramsA.RemoteBlocksExpiry); late < latePullLease {
		t.Fatalf("D's read of A is meant to come well after A's first expiry; it is %v after", late)
	}
	pOut := make(chan kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P, 10*time.Second, "p-a")["p-a"] }()
	ext, _ := D.Sched.MatchedTokens(req, 0)
	if err := D.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{{2, 3}}, External: ext}); err != nil {
		t.Fatal(err)
	}
	if err := D.Step(D.Sched.BuildMeta()); err != nil {
		t.Fatal(err)
	}
	if o := outcomesOf(t, D, 10*time.Second, "d-a")["d-a"]; o.Result != kvxfer.ResultDone {
		t.Errorf("D's read of A, allocated %v after its arrival: %+v, want done", wait, o)
	} else if err := D.Ranks[0].CheckRequest(kvsimReq("t-a", X, []topology.BlockID{2, 3}), 16, 16); err != nil {
		t.Errorf("D's read of A done with bytes not A's: %v", err)
	}
	if o := <-pOut; o.Result != kvxfer.ResultDone {
		t.Errorf("P's A: %+v, want done", o)
	}
	for id, o := range outcomesOf(t, D, 300*time.Millisecond, "none") {
		t.Errorf("D: %s reported again: %+v", id, o)
	}
	for id, o := range outcomesOf(t, P, 300*time.Millisecond, "none") {
		t.Errorf("P: %s reported again: %+v", id, o)
	}
	settled(t, "P's daemon", pMetrics, 1e9, 0)
	settled(t, "D's daemon", dMetrics, 1e9, 0)
}
