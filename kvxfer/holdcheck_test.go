package kvxfer_test

import (
	"math/rand/v2"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// genStart starts a pull engine on a data plane of genBackends.
type genStart = func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine

// noGrants are genBackends' data planes without grants: NIXL (skipped
// where it cannot load) and the built-in backend with OpenDataPlane.
var noGrants = genBackends[:2]

// openPlane starts a pull engine on the built-in backend without grants.
var openPlane genStart = genBackends[1].start

// pairModel is the model of holdPair's engines.
var pairModel = kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}

// holdPair: a pull P and D started by start (a data plane without
// grants), D's handshake with P loaded by a first request.
func holdPair(t *testing.T, start genStart) (dir *kvxfertest.Directory, p, d *simEngine, dPool *blockPool, pPool func() *blockPool) {
	t.Helper()
	model := pairModel
	dir = kvxfertest.NewDirectory()
	d = start(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D")
	p = start(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P")
	groups := d.ranks[0][0].Layout.GroupList()
	dPool = newPool(rand.New(rand.NewPCG(3, 4)), len(groups), 96, true)
	pPool = func() *blockPool { return newPool(rand.New(rand.NewPCG(1, 2)), len(groups), 96, true) } // the same blocks each time
	now := time.Now()
	q0 := makeRequest("0", 40, 0, groups, p.eng, d.eng, newPool(rand.New(rand.NewPCG(5, 6)), len(groups), 96, true), dPool)
	p.ranks[0][0].Fill(q0.sim.P)
	p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q0.send(now.Add(time.Minute))}})
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q0.recv(kvxfer.ModePull, p, now.Add(time.Minute))}})
	if o := awaitOutcomes(t, 2, p, d).recv["d-0"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("first request: %+v", o)
	}
	if err := d.ranks[0][0].CheckRequest(&q0.sim, 16, 16); err != nil {
		t.Fatal(err)
	}
	return dir, p, d, dPool, pPool
}

// holdThenStop: holdPair's producer p holds request a (sent through
// send), whose params are on their way to D (delayed), and stops as a
// crashed process does.
func holdThenStop(t *testing.T, p, d *simEngine, dPool *blockPool, pPool func() *blockPool, send func(kvxfer.SendReq) kvxfer.SendReq) *xreq {
	t.Helper()
	qa := makeRequest("a", 40, 0, d.ranks[0][0].Layout.GroupList(), p.eng, d.eng, pPool(), dPool)
	p.ranks[0][0].Fill(qa.sim.P)
	now := time.Now()
	p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{send(qa.send(now.Add(time.Minute)))}})
	time.Sleep(100 * time.Millisecond)
	stopProducer(t, p)
	return qa
}

// restartHolding restarts holdPair's producer (start, dir): its engine
// holds request z (salted 777, sent through send) in the blocks a held.
func restartHolding(t *testing.T, start genStart, dir *kvxfertest.Directory, d *simEngine, dPool *blockPool, pPool func() *blockPool, send func(kvxfer.SendReq) kvxfer.SendReq) *simEngine {
	t.Helper()
	model := pairModel
	p2 := start(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P")
	qz := makeRequest("z", 40, 0, d.ranks[0][0].Layout.GroupList(), p2.eng, d.eng, pPool(), dPool)
	qz.sim.Salt = 777
	p2.ranks[0][0].FillSalt(qz.sim.P, 777)
	now := time.Now()
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{send(qz.send(now.Add(time.Minute)))}})
	return p2
}

// loadNewGeneration has consumer d load restarted producer p2's
// generation: D's request x (the new producer's) finds the old agent
// gone, and is failed by the generation rules (its params carry none),
// the new producer told (TestPullNotReadByGenerationTellsProducer). It
// returns the source of the pools of the requests that follow.
func loadNewGeneration(t *testing.T, p2, d *simEngine, dPool *blockPool) *rand.Rand {
	t.Helper()
	groups := d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(7, 8))
	qx := makeRequest("x", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), dPool)
	p2.ranks[0][0].Fill(qx.sim.P)
	now := time.Now()
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{qx.send(now.Add(time.Minute))}})
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{qx.recv(kvxfer.ModePull, p2, now.Add(time.Minute))}})
	wantTold(t, awaitOutcomes(t, 2, d, p2), "x", "restarted")
	return rng
}

// asIs sends a request as it is.
func asIs(r kvxfer.SendReq) kvxfer.SendReq { return r }

// Without data-plane grants (NIXL; here the built-in backend with
// OpenDataPlane), pull params carrying no producer generation and
// naming their producer request, issued by a producer that then
// restarted, that reach a consumer rank only after it loaded the new
// generation (another request found the old agent gone), are not read:
// the new producer does not hold that request, and its blocks hold
// another request's KV. Before, nothing told them from the new
// producer's own params (the rank knew only the new generation when
// they came in): the request was reported done with the other
// request's KV.
func TestPullStaleParamsAfterNewGenerationReadsNoOtherRequest(t *testing.T) {
	for _, b := range noGrants {
		t.Run(b.name, func(t *testing.T) { pullStaleParamsAfterNewGeneration(t, b.start) })
	}
}

func pullStaleParamsAfterNewGeneration(t *testing.T, start genStart) {
	dir, p, d, dPool, pPool := holdPair(t, start)
	defer d.close(t)
	groups := d.ranks[0][0].Layout.GroupList()
	qa := holdThenStop(t, p, d, dPool, pPool, asIs)
	p2 := restartHolding(t, start, dir, d, dPool, pPool, asIs)
	defer p2.close(t)
	now := time.Now()
	rng := loadNewGeneration(t, p2, d, dPool)
	// Request y of the new producer, params without a generation, is
	// read: the new producer holds it.
	qy := makeRequest("y", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), dPool)
	p2.ranks[0][0].Fill(qy.sim.P)
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{qy.send(now.Add(time.Minute))}})
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{qy.recv(kvxfer.ModePull, p2, now.Add(time.Minute))}})
	if o := awaitOutcomes(t, 2, d, p2).recv["d-y"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("the new producer's request: %+v, want done", o)
	}
	if err := d.ranks[0][0].CheckRequest(&qy.sim, 16, 16); err != nil {
		t.Fatal(err)
	}
	// a's params reach D only now, naming no generation.
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{qa.recv(kvxfer.ModePull, p2, now.Add(time.Minute))}})
	wantNotRead(t, d, qa, "does not hold this request")
	if s, _ := d.workers[0][0].State(); s.Recvs != 0 {
		t.Errorf("D still holds %d requests", s.Recvs)
	}
}

// Pull params without a producer generation, of a live producer that
// holds the request, are read once the producer says it holds it: at
// once, or when the producer's worker applies the step that holds it
// only after the consumer's request came in (its blocks filled only
// then, here). Before, the READ went at once: over no grants, it read
// the blocks before the producer held them.
func TestPullHoldCheckReadsHeldRequest(t *testing.T) {
	for _, c := range []struct {
		b    string
		late bool
	}{{"nixl", false}, {"builtin-no-grants", false}, {"builtin-no-grants", true}} {
		name, late := c.b+"/held", c.late
		if late {
			name = c.b + "/step-after-request"
		}
		start := noGrants[0].start
		if c.b != "nixl" {
			start = openPlane
		}
		t.Run(name, func(t *testing.T) {
			_, p, d, dPool, pPool := holdPair(t, start)
			defer d.close(t)
			defer p.close(t)
			groups := d.ranks[0][0].Layout.GroupList()
			q := makeRequest("a", 40, 0, groups, p.eng, d.eng, pPool(), dPool)
			now := time.Now()
			if !late {
				p.ranks[0][0].Fill(q.sim.P)
				p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
			}
			d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, p, now.Add(time.Minute))}})
			if late {
				time.Sleep(150 * time.Millisecond) // D asked at least once, unanswered
				p.ranks[0][0].Fill(q.sim.P)
				p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
			}
			out := awaitOutcomes(t, 2, p, d)
			if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
				t.Fatalf("D outcome %+v, want done", o)
			}
			if o := out.send["p-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
				t.Fatalf("P outcome %+v, want done", o)
			}
			if err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// A request whose hold check is out when it ends (its deadline passes,
// or its Worker closes) has one outcome, that one, and leaves nothing
// behind: the check's later timer and answers find nothing to do.
// Before, with no check, a request whose producer never held it was
// read at once and reported done with whatever its blocks held.
func TestPullHoldCheckEndsOnce(t *testing.T) {
	for _, c := range []string{"deadline", "close"} {
		t.Run(c, func(t *testing.T) {
			_, p, d, dPool, pPool := holdPair(t, openPlane)
			defer p.close(t)
			groups := d.ranks[0][0].Layout.GroupList()
			q := makeRequest("a", 40, 0, groups, p.eng, d.eng, pPool(), dPool)
			now := time.Now()
			deadline := now.Add(time.Minute)
			if c == "deadline" {
				deadline = now.Add(300 * time.Millisecond) // inside the check's bound
			}
			// P never holds it.
			d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, p, deadline)}})
			want, kind := kvxfer.ResultExpired, kvxfer.FailureExpired
			if c == "close" {
				time.Sleep(100 * time.Millisecond) // the check is out
				want, kind = kvxfer.ResultFailed, kvxfer.FailureClosed
				d.close(t)
			} else {
				defer d.close(t)
			}
			out := awaitOutcomes(t, 1, d)
			if o := out.recv["d-a"]; len(o) != 1 || o[0].Result != want || o[0].Kind != kind {
				t.Fatalf("D outcome %+v, want %v (%v)", o, want, kind)
			}
			time.Sleep(1500 * time.Millisecond) // past the check's bound
			late := newOutcomes()
			late.collect(t, d)
			if len(late.seen) != 0 {
				t.Fatalf("a second outcome: %v", late.seen)
			}
			if c == "deadline" {
				if s, _ := d.workers[0][0].State(); s.Recvs != 0 || s.Timers != 0 {
					t.Errorf("D still holds %d requests, %d live timers", s.Recvs, s.Timers)
				}
			}
		})
	}
}

// A producer answering for the request only past the check's bound
// (its step never applied in time) had the request fail, naming the
// producer and its generation.
func TestPullHoldCheckFailsUnheld(t *testing.T) {
	_, p, d, dPool, pPool := holdPair(t, openPlane)
	defer d.close(t)
	defer p.close(t)
	groups := d.ranks[0][0].Layout.GroupList()
	q := makeRequest("a", 40, 0, groups, p.eng, d.eng, pPool(), dPool)
	now := time.Now()
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, p, now.Add(time.Minute))}})
	o := awaitOutcomes(t, 1, d).recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone ||
		!strings.Contains(o[0].Reason, "producer engine P") || !strings.Contains(o[0].Reason, "generation") || !strings.Contains(o[0].Reason, "does not hold this request") {
		t.Fatalf("D outcome %+v, want failed (peer_gone): the producer does not hold it", o)
	}
	if s := d.workers[0][0].Metrics().Snapshot(); s.Dropped["pull_params_not_held"] != 1 {
		t.Errorf("dropped %v, want pull_params_not_held 1", s.Dropped)
	}
}

// Without data-plane grants, pull params carrying no producer generation,
// issued by a producer that then restarted, are not read from the new
// producer when it holds a request under the very same names (the router
// retried it with its old transfer and request ids) in other blocks: the
// blocks the params name hold another request's KV. The consumer's hold
// question names the params' blocks, and a producer lists a request only
// if it holds it in those. Nor does the failed check's notice end the
// new producer's request under those names: its own params are read.
// Before, the new producer listed the request by its names, and the
// consumer read the old params' blocks: done with another request's KV.
func TestPullHoldCheckSameNamesOtherBlocks(t *testing.T) {
	for _, b := range noGrants {
		t.Run(b.name, func(t *testing.T) { pullHoldCheckSameNamesOtherBlocks(t, b.start) })
	}
}

func pullHoldCheckSameNamesOtherBlocks(t *testing.T, start genStart) {
	dir, p, d, dPool, pPool := holdPair(t, start)
	defer d.close(t)
	groups := d.ranks[0][0].Layout.GroupList()
	qa := holdThenStop(t, p, d, dPool, pPool, asIs)
	p2 := restartHolding(t, start, dir, d, dPool, pPool, asIs) // z in a's blocks
	defer p2.close(t)
	now := time.Now()
	rng := loadNewGeneration(t, p2, d, dPool)
	// The new producer holds a request under a's names (p-a, t-a) in
	// other blocks.
	qa2 := makeRequest("a", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), dPool)
	qa2.sim.Salt = 555
	p2.ranks[0][0].FillSalt(qa2.sim.P, 555)
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{qa2.send(now.Add(time.Minute))}})
	// The old producer's params of a reach D only now, naming no
	// generation.
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{qa.recv(kvxfer.ModePull, p2, now.Add(time.Minute))}})
	wantNotRead(t, d, qa, "does not hold this request")
	// The new producer's own params of its request under those names
	// are read, its request not ended by the failed check's notice.
	rr := qa2.recv(kvxfer.ModePull, p2, now.Add(time.Minute))
	rr.ReqID = "d-a2" // (D's own id: a new request)
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{rr}})
	out := awaitOutcomes(t, 2, d, p2)
	if o := out.recv["d-a2"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("D outcome of the new producer's request: %+v, want done", o)
	}
	if o := out.send["p-a"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Fatalf("P outcome of its request: %+v, want done", o)
	}
	if err := d.ranks[0][0].CheckRequest(&qa2.sim, 16, 16); err != nil {
		t.Fatal(err)
	}
	dropped := p2.workers[0][0].Metrics().Snapshot().Dropped
	if dropped["hold_other_blocks"] == 0 || dropped["notice_other_blocks"] != 1 {
		t.Errorf("P dropped %v, want hold_other_blocks > 0 and notice_other_blocks 1", dropped)
	}
}

// A pull consumer whose Worker closes (its engine crashed or said bye)
// with a request it has not read yet (here its hold check is out) tells
// the request's producer ranks: the producer fails its side at once, its
// blocks free, instead of holding them for its whole lease. Before, it
// was told nothing and held them for the lease (a minute here; 30 s by
// default), and a producer engine that went meanwhile had its next
// incarnation refused until the close's fence timed out (10 s: the
// daemon soak's crashed P engines, attaching again 10 s later).
func TestPullConsumerCloseFreesProducerHold(t *testing.T) {
	for _, b := range []string{"nixl", "builtin-no-grants"} {
		t.Run(b, func(t *testing.T) {
			start := noGrants[0].start
			if b != "nixl" {
				start = openPlane
			}
			_, p, d, dPool, pPool := holdPair(t, start)
			defer p.close(t)
			groups := d.ranks[0][0].Layout.GroupList()
			q := makeRequest("a", 40, 0, groups, p.eng, d.eng, pPool(), dPool)
			now := time.Now()
			lease := now.Add(time.Minute)
			p.ranks[0][0].Fill(q.sim.P)
			p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(lease)}})
			// P holds it; D takes it in and closes at once, its hold
			// check out (or, rarely, its READ already under way: it then
			// tells P when the READ ends, as before).
			d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, p, lease)}})
			d.close(t)
			out := newOutcomes()
			for until := time.Now().Add(10 * time.Second); len(out.send["p-a"]) == 0 && time.Now().Before(until); time.Sleep(5 * time.Millisecond) {
				out.collect(t, p)
			}
			if o := out.send["p-a"]; len(o) != 1 {
				t.Fatalf("P outcome %+v 10 s after its consumer closed, want one (its lease ends in a minute)", o)
			}
			if s, _ := p.workers[0][0].State(); s.Sends != 0 {
				t.Errorf("P still holds %d requests", s.Sends)
			}
		})
	}
}

// A consumer's hold question that reaches the producer before the
// producer's engine hands it the request (the params beat the engine's
// step) is answered as the request arrives, not at the consumer's next
// ask: the request is read with no time passing. Before, the producer
// dropped the question, and the consumer learned it held the request
// only at its next ask, 50 ms later (and more, 1 s in all, for later
// ones); tests that stepped the consumer before the producer and did not
// let time pass flaked on which came first.
func TestPullHoldAskBeforeRequestAnsweredOnArrival(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, nil)
		now := time.Now()
		q := x.req("a", 40, 0)
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePull, x.p, now.Add(time.Minute))}})
		synctest.Wait() // D asked; P does not hold it yet
		if got := x.recvResult(q); len(got) != 0 {
			t.Fatalf("D outcome %+v before P holds the request", got)
		}
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(30 * time.Second))}})
		x.settle()
		if d := time.Since(now); d != 0 {
			t.Errorf("%v passed, want none", d)
		}
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		if err := x.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
			t.Fatal(err)
		}
	})
}
