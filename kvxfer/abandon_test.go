package kvxfer_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// slowRelease is a backend whose Release of a transfer still in flight
// returns only once let is closed, as NIXL's does (it waits for the bytes
// still moving, up to 30 s for a peer that hung).
type slowRelease struct {
	kvxfer.Backend
	entered  chan struct{} // closed when a Release starts waiting
	let      chan struct{}
	once     sync.Once
	returned atomic.Bool // a waiting Release returned
}

func (s *slowRelease) Release(id kvxfer.XferID) error {
	if st, err := s.Backend.State(id); err == nil && st == kvxfer.XferInProgress {
		s.once.Do(func() { close(s.entered) })
		<-s.let
		s.returned.Store(true)
	}
	return s.Backend.Release(id)
}

// abandoning is a pull consumer D, with producers P and Q, whose READ of
// a from P is being released: P stalled with the READ in flight, then
// restarted, and the release waits for let.
type abandoning struct {
	d, q  *simEngine
	slow  *slowRelease
	let   func()
	a, b  *xreq
	start time.Time
}

func startAbandoning(t *testing.T, tweak func(*kvxfer.WorkerConfig)) *abandoning {
	t.Helper()
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	fake := func(suffix string, wrap func(*kvxfertest.Agent) kvxfer.Backend) func(string, *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		return func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
			a, err := fab.NewAgent(name + suffix)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := a.Map(r.Base, r.Mem); err != nil {
				t.Fatal(err)
			}
			if wrap != nil {
				return wrap(a), a
			}
			return a, a
		}
	}
	x := &abandoning{slow: &slowRelease{entered: make(chan struct{}), let: make(chan struct{})}}
	var letOnce sync.Once
	x.let = func() { letOnce.Do(func() { close(x.slow.let) }) }
	// P, restarted, still holds a when the test ends: its close waits
	// for a's consumer no longer than a second.
	p := startEngine(t, fab, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePull,
		func(c *kvxfer.WorkerConfig) { c.CloseTimeout = time.Second })
	x.q = startEngine(t, fab, dir, &model, e2eEngine(3, 1, 1, 16, 16), "Q", kvxfer.ModePull, nil)
	x.d = startEngineOn(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePull, tweak,
		fake("", func(a *kvxfertest.Agent) kvxfer.Backend { x.slow.Backend = a; return x.slow }))
	t.Cleanup(func() { x.let(); x.d.close(t); x.q.close(t); p.close(t) })

	groups := x.d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(7, 8))
	dPool := newPool(rng, len(groups), 96, true)
	x.a = makeRequest("a", 40, 0, groups, p.eng, x.d.eng, newPool(rng, len(groups), 96, true), dPool)
	x.b = makeRequest("b", 40, 0, groups, x.q.eng, x.d.eng, newPool(rng, len(groups), 96, true), dPool)
	p.ranks[0][0].Fill(x.a.sim.P)
	x.q.ranks[0][0].Fill(x.b.sim.P)
	x.start = time.Now()

	// D's READ of a from P stays in flight: P is stalled.
	fab.Faults().Stall(p.agents[0][0].Name())
	p.step(t, &kvxfer.StepMeta{SchedulerClock: x.start, Send: []kvxfer.SendReq{x.a.send(x.start.Add(time.Hour))}})
	x.d.step(t, &kvxfer.StepMeta{SchedulerClock: x.start, Recv: []kvxfer.RecvReq{x.a.recv(kvxfer.ModePull, p, x.start.Add(time.Hour))}})
	for deadline := time.Now().Add(10 * time.Second); x.d.agents[0][0].InFlight() == 0; time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("D never posted its READ of a")
		}
	}

	// P restarts: D gives up the READ and releases it, which waits.
	p2 := startEngineOn(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePull, nil, fake("-2", nil))
	t.Cleanup(func() { p2.close(t) })
	res, err := dir.Handshake(context.Background(), "P", "")
	if err != nil {
		t.Fatal(err)
	}
	if err := x.d.workers[0][0].PeerGeneration("P", res.Generation); err != nil {
		t.Fatal(err)
	}
	select {
	case <-x.slow.entered:
	case <-time.After(10 * time.Second):
		t.Fatal("D never released its READ of a after P restarted")
	}
	return x
}

// awaitRecv collects D's outcomes into out until request id has one, for
// up to 10 s.
func awaitRecv(t *testing.T, out *outcomes, d *simEngine, id string) []kvxfer.Outcome {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); len(out.recv[id]) == 0 && time.Now().Before(deadline); time.Sleep(2 * time.Millisecond) {
		out.collect(t, d)
	}
	return out.recv[id]
}

// A consumer that gives up a READ in flight (its producer restarted) goes
// on with its other requests while the backend releases that READ, which
// may take long (NIXL waits for its bytes, up to 30 s for a hung peer):
// the loop stalled for all of it, and every other request of the rank
// with it. The request of the abandoned READ reports once the release
// returned, not before: its blocks go back to the engine only when no byte
// of the READ can land in them any more.
func TestAbandonedReadReleaseDoesNotStallTheRank(t *testing.T) {
	x := startAbandoning(t, nil)

	// Meanwhile b, from Q, goes through, bytes and all.
	x.q.step(t, &kvxfer.StepMeta{SchedulerClock: x.start, Send: []kvxfer.SendReq{x.b.send(x.start.Add(time.Hour))}})
	x.d.step(t, &kvxfer.StepMeta{SchedulerClock: x.start, Recv: []kvxfer.RecvReq{x.b.recv(kvxfer.ModePull, x.q, x.start.Add(time.Hour))}})
	out := newOutcomes()
	if got := awaitRecv(t, out, x.d, "d-b"); len(got) != 1 || got[0].Result != kvxfer.ResultDone {
		t.Fatalf("D's b while the READ of a was being released: outcomes %+v, want done (the rank's loop waited for the release)", got)
	}
	if err := x.d.ranks[0][0].CheckRequest(&x.b.sim, 16, 16); err != nil {
		t.Fatalf("b's bytes: %v", err)
	}
	if got := out.recv["d-a"]; len(got) != 0 {
		t.Fatalf("D reported a (%+v) while its READ was still being released: its blocks could still change", got)
	}
	if s, err := x.d.workers[0][0].State(); err != nil || s.Releasing != 1 {
		t.Errorf("D while releasing: %+v (%v), want one transfer releasing", s, err)
	}

	// Once released, a fails, once, naming the restart.
	x.let()
	got := awaitRecv(t, out, x.d, "d-a")
	if len(got) != 1 || got[0].Result != kvxfer.ResultFailed || got[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(got[0].Reason, "restarted") {
		t.Fatalf("D's a: outcomes %+v, want one failed: producer restarted", got)
	}
	if !x.slow.returned.Load() {
		t.Fatal("a reported before its READ's release returned")
	}
	if s, err := x.d.workers[0][0].State(); err != nil || s.Handles != 0 || s.Releasing != 0 || s.Recvs != 0 {
		t.Errorf("D after both requests: %+v (%v), want no handles or requests held", s, err)
	}
}

// A Worker closed while a READ it gave up is still being released
// returns from Close only once that release has, even past its
// CloseTimeout, and the READ's request reports then, once: Close's
// promise is that nothing of the rank's touches the engine's memory after
// it returns, and a request's that its blocks are the engine's again.
func TestCloseWaitsForAbandonedRelease(t *testing.T) {
	const closeTimeout = 50 * time.Millisecond
	x := startAbandoning(t, func(c *kvxfer.WorkerConfig) { c.CloseTimeout = closeTimeout })
	closed := make(chan error, 1)
	go func() { closed <- x.d.workers[0][0].Close() }()
	select {
	case err := <-closed:
		t.Fatalf("Close returned (%v) while a READ it gave up was still being released", err)
	case <-time.After(6 * closeTimeout):
	}
	out := newOutcomes()
	out.collect(t, x.d)
	if got := out.recv["d-a"]; len(got) != 0 {
		t.Fatalf("a reported (%+v) while its READ was still being released", got)
	}
	x.let()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Close did not return after the release did")
	}
	if got := awaitRecv(t, out, x.d, "d-a"); len(got) != 1 || got[0].Result != kvxfer.ResultFailed {
		t.Fatalf("a after Close: outcomes %+v, want one failed", got)
	}
}
