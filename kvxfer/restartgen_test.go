package kvxfer_test

import (
	"context"
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// genBackends are the data planes the producer-generation tests run on:
// NIXL (no data-plane grants; skipped where NIXL cannot load), and the
// built-in backend without grants (OpenDataPlane) and with them.
var genBackends = []struct {
	name  string
	start func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine
}{
	{"nixl", func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine {
		return startNixlEngine(t, dir, m, e, id, kvxfer.ModePull, kvxfer.PostCost{}, func(c *kvxfer.WorkerConfig) { c.CloseTimeout = time.Second })
	}},
	{"builtin-no-grants", func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine {
		return startNetEngine(t, dir, m, e, id, kvxfer.ModePull, func(c *kvxfer.WorkerConfig) { c.OpenDataPlane, c.CloseTimeout = true, time.Second })
	}},
	{"builtin-grants", func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine {
		return startNetEngine(t, dir, m, e, id, kvxfer.ModePull, func(c *kvxfer.WorkerConfig) { c.CloseTimeout = time.Second })
	}},
}

// generationOf is engine id's generation as a handshake reports it: what
// its Scheduler stamps on its params (SchedulerConfig.Generation).
func generationOf(t *testing.T, dir *kvxfertest.Directory, id string) uint64 {
	t.Helper()
	res, err := dir.Handshake(context.Background(), id, "")
	if err != nil {
		t.Fatal(err)
	}
	return res.Generation
}

// An idle pull consumer's first request after its producer restarted (new
// agents, a new generation), whose params the restarted producer issued
// (they carry its generation), is done: the consumer sees the params'
// generation differ from its loaded handshake's and handshakes again
// before reading. Before, without data-plane grants (NIXL), it READ from
// the gone agents, handshook again, and then failed (peer_gone, "not
// read"): nothing told its params from the old producer's.
func TestPullFirstRequestAfterProducerRestart(t *testing.T) {
	for _, b := range genBackends {
		for _, wait := range []time.Duration{0, 1100 * time.Millisecond} {
			name := b.name
			if wait == 0 {
				name += "/at-once"
			}
			t.Run(name, func(t *testing.T) {
				model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
				dir := kvxfertest.NewDirectory()
				d := b.start(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D")
				defer d.close(t)
				rng := rand.New(rand.NewPCG(21, 22))
				run := func(p *simEngine, id string) kvxfer.Outcome {
					t.Helper()
					groups := d.ranks[0][0].Layout.GroupList()
					q := makeRequest(id, 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
					p.ranks[0][0].Fill(q.sim.P)
					now := time.Now()
					p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
					rr := q.recv(kvxfer.ModePull, p, now.Add(time.Minute))
					rr.Remote.Generation = generationOf(t, dir, "P")
					d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{rr}})
					o := awaitOutcomes(t, 1, d).recv["d-"+id]
					if len(o) != 1 {
						t.Fatalf("D outcomes %+v", o)
					}
					if o[0].Result == kvxfer.ResultDone {
						if err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
							t.Fatal(err)
						}
						awaitOutcomes(t, 1, p) // P's hold ends too
					}
					return o[0]
				}
				p := b.start(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P")
				if o := run(p, "before"); o.Result != kvxfer.ResultDone {
					t.Fatalf("before the restart: %+v", o)
				}
				stopProducer(t, p)
				p2 := b.start(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P")
				defer p2.close(t)
				time.Sleep(wait)
				if o := run(p2, "after"); o.Result != kvxfer.ResultDone {
					t.Fatalf("the first request after the producer restarted, its params the new producer's: %+v, want done", o)
				}
			})
		}
	}
}

// A pull request whose params the producer issued before it restarted
// (they carry the old generation) fails cleanly (peer_gone) and never
// reads the blocks they name from the restarted producer, which holds
// another request's KV in them, even when the consumer already loaded the
// new generation (a fresh handshake: nothing fails to get through). Before,
// without grants, such a request was read and reported done with the
// other request's KV.
func TestPullOldGenerationParamsNotRead(t *testing.T) {
	for _, b := range genBackends {
		t.Run(b.name, func(t *testing.T) {
			model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
			dir := kvxfertest.NewDirectory()
			d := b.start(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D")
			defer d.close(t)
			p := b.start(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P")
			groups := d.ranks[0][0].Layout.GroupList()
			dPool := func() *blockPool { return newPool(rand.New(rand.NewPCG(3, 4)), len(groups), 96, true) }
			pPool := func() *blockPool { return newPool(rand.New(rand.NewPCG(1, 2)), len(groups), 96, true) } // the same blocks each time
			// P holds request a; its params (of P's first generation) go to
			// D late.
			now := time.Now()
			qa := makeRequest("a", 40, 0, groups, p.eng, d.eng, pPool(), dPool())
			p.ranks[0][0].Fill(qa.sim.P)
			p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{qa.send(now.Add(time.Minute))}})
			ra := qa.recv(kvxfer.ModePull, p, now.Add(time.Minute))
			ra.Remote.Generation = generationOf(t, dir, "P")
			time.Sleep(100 * time.Millisecond)
			stopProducer(t, p)
			// The producer restarts; its engine holds request z (the same
			// ids, a's transfer id) in a's blocks.
			p2 := b.start(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P")
			defer p2.close(t)
			gen2 := generationOf(t, dir, "P")
			if gen2 == ra.Remote.Generation {
				t.Fatalf("the restarted producer has the old generation %d", gen2)
			}
			// D loads the new generation with a request of its own first.
			now = time.Now()
			q0 := makeRequest("0", 40, 0, groups, p2.eng, d.eng, newPool(rand.New(rand.NewPCG(5, 6)), len(groups), 96, true),
				newPool(rand.New(rand.NewPCG(7, 8)), len(groups), 96, true))
			p2.ranks[0][0].Fill(q0.sim.P)
			p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q0.send(now.Add(time.Minute))}})
			r0 := q0.recv(kvxfer.ModePull, p2, now.Add(time.Minute))
			r0.Remote.Generation = gen2
			d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r0}})
			if o := awaitOutcomes(t, 2, p2, d).recv["d-0"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
				t.Fatalf("a request to the restarted producer: %+v, want done", o)
			}
			qz := makeRequest("a", 40, 0, groups, p2.eng, d.eng, pPool(), dPool())
			qz.sim.Salt = 777
			p2.ranks[0][0].FillSalt(qz.sim.P, 777)
			p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{qz.send(now.Add(time.Minute))}})
			d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{ra}})
			wantNotRead(t, d, qa, "generation") // its params are of the producer's old generation
		})
	}
}
