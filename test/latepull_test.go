package test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A pull consumer late past the producer's lease, over real daemons, on
// both backends: P (a 2 s lease) finishes request A in blocks X and hands
// its params to D; D does not read them yet (its request waits in its
// engine's queue: no heartbeat extends the hold); A's lease lapses, and P
// gives blocks X to request B, other bytes. D's read of A then must not
// report A loaded with B's KV: it ends once, not done. B ends as usual,
// and D's read of B is done with B's bytes; neither daemon holds anything
// afterwards. And a read of A well within the lease is done with A's own
// bytes.
//
// Over NIXL no grant refuses a READ of blocks P freed and reused: before,
// plain pull params carried no expiry, D posted the READ of A's blocks,
// got B's KV and reported A done. The built-in backend's grants, which
// name the request, refused it: A failed ("no grant for the memory")
// after D's READ retries, about 5 s, where it now expires at once.
func TestLatePullNeverLoadsAnotherRequestsKV(t *testing.T) {
	for _, backend := range []string{"builtin", "nixl"} {
		t.Run(backend, func(t *testing.T) {
			if backend == "nixl" {
				skipWithoutNixl(t)
			}
			useBackend(t, backend)
			t.Run("read-in-time", latePull(false))
			t.Run("read-after-the-lease", latePull(true))
		})
	}
}

// latePullLease is the producer's lease in latePull (and queuedPull's
// daemons'): 4 s, short enough for a test to wait it out, long enough
// that a daemon slowed by load neither misses it for a read "in time"
// nor lets it lapse between heartbeats (every lease/6). At 2 s a stall
// of a second or two on a loaded machine was all either took.
const latePullLease = 4 * time.Second

// latePull returns the scenario with D's read of A past A's lease (late),
// or at once, well within it.
func latePull(late bool) func(t *testing.T) {
	return func(t *testing.T) {
		dir := world(t)
		pMetrics, dMetrics := freeAddr(t), freeAddr(t)
		p := startDaemon(t, dir, "P", "-metrics-listen", pMetrics)
		d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics)
		m := simModel
		P, err := simengine.Attach(simengine.Config{Dir: dir, Sock: p.Sock, Peer: p.Peer, ID: "P", Model: &m, Engine: simEngine(1, 1),
			Mode: kvxfer.ModePull, Version: "test", Lease: latePullLease})
		if err != nil {
			t.Fatal(err)
		}
		defer P.Close()
		D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePull)
		defer D.Close()
		// D's handshake with P is done before A: D's read of A is one
		// READ away.
		pullOnce(t, P, D, "warm", []topology.BlockID{14, 15}, 10*time.Second, "the warm-up")

		X := []topology.BlockID{0, 1}
		paramsA := finishPull(t, P, "p-a", "t-a", X)
		if paramsA.RemoteBlocksExpiry.IsZero() {
			t.Log("P's params for A carry no expiry")
		}
		if !late {
			pOut := make(chan kvxfer.Outcome, 1)
			go func() { pOut <- outcomesOf(t, P, 10*time.Second, "p-a")["p-a"] }()
			readPull(t, D, "d-a", paramsA, []topology.BlockID{2, 3})
			if o := outcomesOf(t, D, 10*time.Second, "d-a")["d-a"]; o.Result != kvxfer.ResultDone {
				t.Errorf("D's read of A within P's %v lease: %+v, want done", latePullLease, o)
			} else if err := D.Ranks[0].CheckRequest(kvsimReq("t-a", X, []topology.BlockID{2, 3}), 16, 16); err != nil {
				t.Errorf("D's read of A within the lease done with bytes not A's: %v", err)
			}
			if o := <-pOut; o.Result != kvxfer.ResultDone {
				t.Errorf("P's A: %+v, want done", o)
			}
		} else {
			// A's lease lapses with D's read not begun: P ends A, and its
			// engine gives blocks X to B.
			if o, ok := outcomesOf(t, P, latePullLease+5*time.Second, "p-a")["p-a"]; !ok || o.Result == kvxfer.ResultDone {
				t.Fatalf("P's A, its lease lapsed unread: %+v (reported: %v), want an outcome, not done", o, ok)
			}
			paramsB := finishPull(t, P, "p-b", "t-b", X)
			time.Sleep(100 * time.Millisecond) // P's rank holds B
			if late := time.Since(paramsA.RemoteBlocksExpiry); !paramsA.RemoteBlocksExpiry.IsZero() && late < 0 {
				t.Fatalf("D's read of A is meant to come after A's expiry; it is %v before", -late)
			}
			// D reads A (late) and B (in time) back to back: B's read
			// waits on nothing A's takes.
			pOut := make(chan kvxfer.Outcome, 1)
			go func() { pOut <- outcomesOf(t, P, 10*time.Second, "p-b")["p-b"] }()
			readPull(t, D, "d-a", paramsA, []topology.BlockID{2, 3})
			readPull(t, D, "d-b", paramsB, []topology.BlockID{4, 5})
			got := outcomesOf(t, D, 10*time.Second, "d-a", "d-b")
			o, ok := got["d-a"]
			switch {
			case !ok:
				t.Errorf("D's late read of A: no outcome within 10 s")
			case o.Result == kvxfer.ResultDone:
				t.Errorf("D's read of A after its %v lease lapsed and P reused its blocks for B: %+v, want not done", latePullLease, o)
			case o.Kind == kvxfer.FailureNone:
				t.Errorf("D's late read of A: %+v names no failure kind", o)
			}
			if D.Ranks[0].CheckRequest(kvsimReq("t-b", X, []topology.BlockID{2, 3}), 16, 16) == nil {
				t.Errorf("D's late read of A (%+v) landed B's KV in A's blocks", o)
			}
			t.Logf("D's late read of A: %+v", o)
			if o := got["d-b"]; o.Result != kvxfer.ResultDone {
				t.Errorf("D's read of B: %+v, want done", o)
			} else if err := D.Ranks[0].CheckRequest(kvsimReq("t-b", X, []topology.BlockID{4, 5}), 16, 16); err != nil {
				t.Errorf("D's read of B done with bytes not B's: %v", err)
			}
			if o := <-pOut; o.Result != kvxfer.ResultDone {
				t.Errorf("P's B: %+v, want done", o)
			}
		}
		// No outcome comes twice (outcomesOf fails the test on one), and
		// neither daemon holds a request or a transfer.
		for id, o := range outcomesOf(t, D, 300*time.Millisecond, "none") {
			t.Errorf("D: %s reported again: %+v", id, o)
		}
		for id, o := range outcomesOf(t, P, 300*time.Millisecond, "none") {
			t.Errorf("P: %s reported again: %+v", id, o)
		}
		settled(t, "P's daemon", pMetrics, 1e9, 0)
		settled(t, "D's daemon", dMetrics, 1e9, 0)
	}
}
