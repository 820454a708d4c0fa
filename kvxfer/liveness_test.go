package kvxfer_test

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// livePair: a push P and D on the built-in backend, D watching P with a
// short PeerTimeout, and one D request registered with P that P has not
// finished (it waits on P).
func livePair(t *testing.T, timeout time.Duration) (dir *kvxfertest.Directory, p, d *simEngine, q *xreq) {
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	dir = kvxfertest.NewDirectory()
	p = startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil)
	d = startNetEngine(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePush, func(c *kvxfer.WorkerConfig) {
		c.PeerTimeout, c.FenceTimeout = timeout, max(2*timeout, time.Second) // negative: probes off
		if timeout < 0 {
			// Probes off: what waits on the producer ends only by an
			// event or a request's own handshake, "at once"; a fence left
			// to time out would take a minute, far past any such bound.
			c.FenceTimeout = time.Minute
		}
	})
	t.Cleanup(func() { d.close(t) })
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(5, 6))
	q = makeRequest("a", 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p, now.Add(time.Hour))}})
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(2 * time.Millisecond) {
		if s, _ := p.workers[0][0].State(); s.PendingRegs == 1 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("P never got D's registration")
		}
	}
	return dir, p, d, q
}

// A producer that stops answering (its daemon gone: handshakes fail, its
// agents silent) fails what waits on it within PeerTimeout and a probe,
// naming it: with the built-in backend's grants at once (its grants are
// revoked, and refuse a late WRITE even into blocks the engine registers
// again with the same producer: TestPeerGoneWithGrantsRefusesLateWrites).
func TestPeerGoneFailsWaitingRequests(t *testing.T) {
	// 2 s: the bound below leaves a loaded machine 5 s past a correct
	// run's (timeout and a probe); at 500 ms it left 2 s.
	const timeout = 2 * time.Second
	dir, p, d, _ := livePair(t, timeout)
	p.close(t)
	dir.FailHandshakes("P", 1<<20)
	gone := time.Now()
	out := awaitOutcomes(t, 1, d)
	took := time.Since(gone)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone ||
		!strings.Contains(o[0].Reason, "producer engine P") || !strings.Contains(o[0].Reason, "gone") {
		t.Fatalf("D outcome %+v, want failed: producer engine P is gone", o)
	}
	if limit := timeout + timeout/5 + 2*timeout + time.Second; took > limit {
		t.Errorf("D's request ended %v after P went silent, want within %v", took, limit)
	}
	if s, _ := d.workers[0][0].State(); s.Recvs != 0 {
		t.Errorf("D still holds %d requests", s.Recvs)
	}
}

// A producer that restarts under the same engine id (new agents, a new
// generation) fails the requests registered with its old agents at the
// next probe, well before PeerTimeout, and a new request goes to the new
// agents and is done.
func TestPeerRestartFailsOldRequests(t *testing.T) {
	// 15 s: probes every 3 s, and "well before PeerTimeout" (half of it)
	// leaves a loaded machine 4.5 s past the next probe; at 5 s it left
	// 1.5 s.
	const timeout = 15 * time.Second
	dir, p, d, _ := livePair(t, timeout)
	p.close(t)
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	p2 := startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil)
	defer p2.close(t)
	back := time.Now()
	out := awaitOutcomes(t, 1, d)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, "restarted") {
		t.Fatalf("D outcome %+v, want failed: producer restarted", o)
	}
	if took := time.Since(back); took > timeout/2 {
		t.Errorf("the old request ended %v after P came back, want at the next probe (%v)", took, timeout/5)
	}
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(7, 8))
	q := makeRequest("b", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p2.ranks[0][0].Fill(q.sim.P)
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p2, now.Add(time.Minute))}})
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	out = awaitOutcomes(t, 2, p2, d)
	if o := out.recv["d-b"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("new request: D outcome %+v, want done", o)
	}
	if err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
		t.Fatal(err)
	}
}

// A producer restarts (new agents, a new generation) while the consumer
// has nothing waiting on it, so no probe notices: the consumer's next
// request finds its handshake stale (its registration or READ cannot reach
// the old agent), handshakes again and goes through, instead of failing.
// So it does in pull when the producer is back within handshakeRetry of
// the consumer's handshake (at-once): the READ finds the old agent's
// connection closed (EOF, a broken pipe), which says the agent is gone
// however fresh the handshake (before, the request failed: "connection
// ... lost: EOF"). (A push registration written into such a connection
// before it is seen closed cannot tell: that request fails once the new
// generation is loaded; test/recovery_test.go's daemons, SIGKILLed, close
// theirs at once.)
func TestIdleConsumerMeetsRestartedProducer(t *testing.T) {
	for _, c := range []struct {
		mode kvxfer.Mode
		wait time.Duration
	}{{kvxfer.ModePush, 1100 * time.Millisecond}, {kvxfer.ModePull, 1100 * time.Millisecond}, {kvxfer.ModePull, 0}} {
		mode, name := c.mode, c.mode.String()
		if c.wait == 0 {
			name += "/at-once"
		}
		t.Run(name, func(t *testing.T) {
			model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
			dir := kvxfertest.NewDirectory()
			d := startNetEngine(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", mode, nil)
			defer d.close(t)
			rng := rand.New(rand.NewPCG(9, 10))
			run := func(p *simEngine, id string) kvxfer.Outcome {
				t.Helper()
				groups := d.ranks[0][0].Layout.GroupList()
				q := makeRequest(id, 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
				p.ranks[0][0].Fill(q.sim.P)
				now := time.Now()
				p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
				d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(mode, p, now.Add(time.Minute))}})
				out := awaitOutcomes(t, 2, p, d)
				o := out.recv["d-"+id]
				if len(o) != 1 {
					t.Fatalf("D outcomes %+v", o)
				}
				if o[0].Result == kvxfer.ResultDone {
					if err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
						t.Fatal(err)
					}
				}
				return o[0]
			}
			p := startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", mode, nil)
			if o := run(p, "before"); o.Result != kvxfer.ResultDone {
				t.Fatalf("before the restart: %+v", o)
			}
			p.close(t)
			for _, b := range p.backends {
				_ = b.Close() // the old agents are gone
			}
			p2 := startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", mode, nil)
			defer p2.close(t)
			time.Sleep(c.wait) // 1.1 s: D's handshake is past handshakeRetry
			if o := run(p2, "after"); o.Result != kvxfer.ResultDone {
				t.Fatalf("the first request after the producer restarted: %+v, want done", o)
			}
		})
	}
}

// A producer restarts (new agents, a new generation) while a consumer
// request waits on its old agents, with probes off, and the consumer's
// next request finds the old agents gone and handshakes again: loading
// the new generation fails the waiting request at once (peer_gone,
// "restarted"), as a probe's answer would, and the new request is done.
// Before, only a probe's answer failed what waited on changed ranks: the
// request's own handshake loaded the new agents silently, later probes
// found the generation unchanged, and the waiting request had no outcome
// until its registration's deadline.
func TestRestartFoundByARequestFailsWaitingOnes(t *testing.T) {
	dir, p, d, _ := livePair(t, -1)
	for _, b := range p.backends {
		_ = b.Close() // the old agents are gone
	}
	p.close(t)
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	p2 := startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil)
	defer p2.close(t)
	time.Sleep(1100 * time.Millisecond) // D's handshake is past handshakeRetry
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(11, 12))
	q := makeRequest("b", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
	p2.ranks[0][0].Fill(q.sim.P)
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p2, now.Add(time.Minute))}})
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
	out := awaitOutcomes(t, 3, p2, d)
	if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, "restarted") {
		t.Errorf("the request waiting on the old agents: D outcome %+v, want failed: producer restarted", o)
	}
	if o := out.recv["d-b"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("new request: D outcome %+v, want done", o)
	}
	if err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
		t.Fatal(err)
	}
}

// Without data-plane grants (NIXL; here the built-in backend with
// OpenDataPlane), a pull consumer request whose params come from a
// producer that then restarted, and whose READ therefore finds the old
// agent gone, is not read from the new producer after the new handshake:
// nothing would refuse a READ of the blocks its params name, which the
// new producer holds for another request. Before, the request handshook
// again, READ those blocks and was reported done with the other
// request's KV. So it is, with grants, for a request naming neither its
// producer request nor its transfer (grants tell holds apart by those).
func TestPullRetryAcrossRestartReadsNoOtherRequest(t *testing.T) {
	t.Run("no-grants", func(t *testing.T) { pullRetryAcrossRestart(t, true) })
	t.Run("grants-nothing-named", func(t *testing.T) { pullRetryAcrossRestart(t, false) })
}

func pullRetryAcrossRestart(t *testing.T, openPlane bool) {
	start := func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine {
		return startNetEngine(t, dir, m, e, id, kvxfer.ModePull, func(c *kvxfer.WorkerConfig) { c.OpenDataPlane, c.CloseTimeout = openPlane, time.Second })
	}
	unnamed := func(rr kvxfer.RecvReq) kvxfer.RecvReq {
		if !openPlane {
			rr.TransferID, rr.Remote.ReqID = "", ""
		}
		return rr
	}
	unnamedSend := func(sr kvxfer.SendReq) kvxfer.SendReq {
		if !openPlane {
			sr.TransferID = ""
		}
		return sr
	}
	dir, p, d, dPool, pPool := holdPair(t, start)
	defer d.close(t)
	// P holds request a; its params go to D, which reads them late.
	qa := holdThenStop(t, p, d, dPool, pPool, unnamedSend)
	// The producer restarts; its engine holds request z in a's blocks.
	p2 := restartHolding(t, start, dir, d, dPool, pPool, unnamedSend)
	defer p2.close(t)
	time.Sleep(1100 * time.Millisecond) // D's handshake is past handshakeRetry
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{unnamed(qa.recv(kvxfer.ModePull, p2, now.Add(time.Minute)))}})
	wantNotRead(t, d, qa, "restarted")
}

// stopProducer closes producer p and its backends: its agents are gone, as
// a restarted process's are.
func stopProducer(t *testing.T, p *simEngine) {
	t.Helper()
	p.close(t)
	for _, b := range p.backends {
		_ = b.Close()
	}
}

// wantNotRead checks consumer d's one outcome of request q, whose params
// name blocks its restarted producer holds for another request now: failed
// (peer_gone), its reason containing why, never done.
func wantNotRead(t *testing.T, d *simEngine, q *xreq, why string) {
	t.Helper()
	checkNotRead(t, d, awaitOutcomes(t, 1, d).recv["d-"+q.id], q, why)
}

// checkNotRead checks o, consumer d's outcomes of request q, as
// wantNotRead does.
func checkNotRead(t *testing.T, d *simEngine, o []kvxfer.Outcome, q *xreq, why string) {
	t.Helper()
	id := "d-" + q.id
	if len(o) != 1 {
		t.Fatalf("D outcomes of %s: %+v", id, o)
	}
	if o[0].Result == kvxfer.ResultDone {
		err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16)
		t.Fatalf("%s done after its producer restarted (its own bytes: %v): KV read out of blocks the restarted producer holds for another request", id, err)
	}
	if o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, why) {
		t.Errorf("%s: %+v, want failed (peer_gone), the reason naming %q", id, o[0], why)
	}
}

// Without data-plane grants (NIXL; here the built-in backend with
// OpenDataPlane), a pull consumer request whose params carry no producer
// generation, and that comes in while the consumer is handshaking again
// with its producer (which died and came back: a request found the old
// agent gone, or a probe the generation changed), is not read from the
// generation that handshake finds: the params were issued while the
// consumer knew the producer at the old one, and nothing refuses a READ
// of the blocks they name, which the restarted producer holds for
// another request. So it is for one that came in while the handshake had
// failed (nothing answered for the producer yet). Before, the request's
// handshake was its first, so nothing checked the generation: it was read
// and reported done with the other request's KV (found by the in-process
// fault soak over NIXL, pull).
func TestPullArrivingDuringRehandshakeReadsNoOtherRequest(t *testing.T) {
	t.Run("pending", func(t *testing.T) { pullArrivingDuringRehandshake(t, false) })
	t.Run("failed", func(t *testing.T) { pullArrivingDuringRehandshake(t, true) })
}

func pullArrivingDuringRehandshake(t *testing.T, failFirst bool) {
	start := func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine {
		return startNetEngine(t, dir, m, e, id, kvxfer.ModePull, func(c *kvxfer.WorkerConfig) { c.OpenDataPlane, c.CloseTimeout = true, time.Second })
	}
	dir, p, d, dPool, pPool := holdPair(t, start)
	defer d.close(t)
	groups := d.ranks[0][0].Layout.GroupList()
	// P holds request a; its params are on their way to D.
	qa := holdThenStop(t, p, d, dPool, pPool, asIs)
	now := time.Now()
	release := func() {}
	if failFirst {
		dir.Remove("P") // nothing answers for P: D's handshakes fail
	} else {
		release = dir.Hold("P") // D's next handshake waits
	}
	// D's next request finds P's agent gone and handshakes again.
	qx := makeRequest("x", 40, 0, groups, p.eng, d.eng, newPool(rand.New(rand.NewPCG(7, 8)), len(groups), 96, true), dPool)
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{qx.recv(kvxfer.ModePull, p, now.Add(time.Minute))}})
	if failFirst {
		if o := awaitOutcomes(t, 1, d).recv["d-x"]; len(o) != 1 || o[0].Result != kvxfer.ResultFailed {
			t.Fatalf("a request to the stopped producer: %+v, want failed", o)
		}
	}
	// The producer restarts; its engine holds request z in a's blocks.
	p2 := restartHolding(t, start, dir, d, dPool, pPool, asIs)
	defer p2.close(t)
	now = time.Now()
	time.Sleep(200 * time.Millisecond) // D's handshake is out (held), or failed
	// a's params reach D only now, naming no generation.
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{qa.recv(kvxfer.ModePull, p2, now.Add(time.Minute))}})
	time.Sleep(100 * time.Millisecond)
	release()
	if failFirst {
		wantNotRead(t, d, qa, "restarted")
		return
	}
	out := awaitOutcomes(t, 2, d) // x's, failed too, and a's
	checkNotRead(t, d, out.recv["d-a"], qa, "restarted")
}
