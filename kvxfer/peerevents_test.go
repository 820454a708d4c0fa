package kvxfer_test

import (
	"context"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// A registry says the producer is gone (its lease ended): what waits on
// it fails at once, with probes off (negative PeerTimeout), naming it.
func TestPeerGoneEventFailsAtOnce(t *testing.T) {
	_, p, d, _ := livePair(t, -1)
	p.close(t)
	gone := time.Now()
	if err := d.workers[0][0].PeerGone("P", "its registry lease ended"); err != nil {
		t.Fatal(err)
	}
	if err := d.workers[0][0].PeerGone("nobody", "unknown engines are ignored"); err != nil {
		t.Fatal(err)
	}
	out := awaitOutcomes(t, 1, d)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone ||
		!strings.Contains(o[0].Reason, "producer engine P") || !strings.Contains(o[0].Reason, "lease ended") {
		t.Fatalf("D outcome %+v, want failed: producer engine P is gone, its lease ended", o)
	}
	if took := time.Since(gone); took > 10*time.Second { // at once: against FenceTimeout (a minute, livePair) and no probes
		t.Errorf("D's request ended %v after PeerGone, want at once", took)
	}
}

// restartedProducer is livePair with probes off (d-a waiting on P) whose
// producer then restarts: a new P, at generation res.Generation, that D
// has not heard of yet.
func restartedProducer(t *testing.T) (dir *kvxfertest.Directory, d, p2 *simEngine, res kvxfer.HandshakeResult) {
	t.Helper()
	dir, p, d, _ := livePair(t, -1)
	p.close(t)
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	p2 = startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil)
	t.Cleanup(func() { p2.close(t) })
	res, err := dir.Handshake(context.Background(), "P", "")
	if err != nil {
		t.Fatal(err)
	}
	return dir, d, p2, res
}

// A registry says the producer has a new generation (it restarted): with
// probes off, the consumer asks it at once and fails what waited on its
// old agents; a new request goes to the new ones.
func TestPeerGenerationEventIsARejoin(t *testing.T) {
	_, d, _, res := restartedProducer(t)
	back := time.Now()
	if err := d.workers[0][0].PeerGeneration("P", res.Generation); err != nil {
		t.Fatal(err)
	}
	out := awaitOutcomes(t, 1, d)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, "restarted") {
		t.Fatalf("D outcome %+v, want failed: producer restarted", o)
	}
	if took := time.Since(back); took > 10*time.Second { // at once: against FenceTimeout (a minute, livePair) and no probes
		t.Errorf("the old request ended %v after PeerGeneration, want at once", took)
	}
}

// A registry's PeerGeneration that comes while a question to the engine is
// out (a probe to its old, dead address, which fails) is not dropped: the
// engine is asked again once that answer is in, and the rejoin is seen.
// The 5-minute fleet churn found consumers registering with a dead agent
// because the event came during such a probe.
func TestPeerGenerationDuringAProbeIsKept(t *testing.T) {
	dir, d, _, res := restartedProducer(t)
	release := dir.Hold("P")
	dir.FailHandshakes("P", 1) // the question out: the old address, dead
	if err := d.workers[0][0].PeerGeneration("P", res.Generation+1); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // the first question is out, held
	if err := d.workers[0][0].PeerGeneration("P", res.Generation); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	release()
	out := awaitOutcomes(t, 1, d)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, "restarted") {
		t.Fatalf("D outcome %+v, want failed: producer restarted", o)
	}
}

// After a registry's PeerGeneration, while the engine's daemon is being
// asked, a new request waits for the answer instead of registering with
// the agents the registry says are past: here the old producer is gone,
// its successor serves the new request, which is done (before, it went
// to the old agent and failed push_reg_notif_failed).
func TestNewRequestWaitsForTheRegistrysRejoin(t *testing.T) {
	dir, d, p2, res := restartedProducer(t)
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(7, 8))
	q := makeRequest("b", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	for _, stage := range p2.ranks {
		for _, r := range stage {
			r.Fill(q.sim.P)
		}
	}
	now := time.Now()
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	release := dir.Hold("P")
	if err := d.workers[0][0].PeerGeneration("P", res.Generation); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // the question is out, held
	d.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p2, now.Add(time.Minute))}})
	time.Sleep(50 * time.Millisecond)
	release()
	out := awaitOutcomes(t, 2, d)
	if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultFailed || !strings.Contains(o[0].Reason, "restarted") {
		t.Errorf("the old request: %+v, want failed: producer restarted", o)
	}
	if o := out.recv["d-b"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Errorf("the new request: %+v, want done by the producer's successor", o)
	}
}

// The registry's view can report one restart's Generation change twice,
// or label a change with another entry's generation (a per-rank engine's
// change carries the engine's current entry, which another rank's server
// may own, and a per-rank handshake's generation is none of its entries').
// Neither fences anything: PeerGeneration only asks the producer, and its
// answer decides. Here, after the rejoin, a request registered with the
// new agents and waiting for its WRITE sees the same generation again and
// a mislabelled one, and is done with its bytes; the old request is
// reported once.
func TestPeerGenerationRepeatedFencesNothing(t *testing.T) {
	_, d, p2, res := restartedProducer(t)
	if err := d.workers[0][0].PeerGeneration("P", res.Generation); err != nil {
		t.Fatal(err)
	}
	out := awaitOutcomes(t, 1, d)
	if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultFailed {
		t.Fatalf("D outcome %+v, want failed: producer restarted", o)
	}
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(13, 14))
	q := makeRequest("b", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p2.ranks[0][0].Fill(q.sim.P)
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p2, now.Add(time.Minute))}})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		if s, _ := p2.workers[0][0].State(); s.PendingRegs == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("P never got D's registration of the new request")
		}
	}
	for _, gen := range []uint64{res.Generation, res.Generation, res.Generation + 7} {
		if err := d.workers[0][0].PeerGeneration("P", gen); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(200 * time.Millisecond) // the questions they ask are answered
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	out2 := awaitOutcomes(t, 2, p2, d)
	if o := out2.recv["d-b"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("the new request after repeated PeerGenerations: D outcome %+v, want done", o)
	}
	if err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
		t.Fatal(err)
	}
	if len(out2.recv["d-a"]) != 0 {
		t.Errorf("d-a reported again: %+v", out2.recv["d-a"])
	}
}
