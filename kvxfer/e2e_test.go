package kvxfer_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

type e2eCase struct {
	name      string
	model     kvsim.Model
	p, d      kvsim.Engine
	fragment  bool
	layerwise bool
	tcp       bool // the built-in backend over loopback TCP, in real time
	nixl      bool // NIXL (UCX), in real time
	// gpu: the built-in backend's same-host path with every rank's
	// memory as GPU memory (heldGPU): push WRITEs go as layouts.
	gpu      bool
	prepared bool // NIXL with prepared descriptor lists (indices only per transfer)
	// post, with prepared: which posts the NIXL backend's cost model
	// (kvxfer.PostCoster) picks: "model" its default, per request;
	// "prepared" or "onthefly" every one.
	post string
}

func e2eEngine(id, tp, pp, logical, kernel int) kvsim.Engine {
	return kvsim.Engine{ID: id, TP: tp, PP: pp, LogicalBlock: logical, KernelBlock: kernel,
		Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 96}
}

func e2eCases() []e2eCase {
	attn := kvsim.Model{Kinds: []topology.Kind{fa, fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	mlaM := kvsim.Model{Kinds: []topology.Kind{mla, mla}, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, MLABytesPerToken: 12}
	hybrid := kvsim.Model{Kinds: []topology.Kind{fa, swa, fa, swa}, Window: 40, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	return []e2eCase{
		{name: "tp1-1", model: attn, p: e2eEngine(1, 1, 1, 16, 16), d: e2eEngine(2, 1, 1, 16, 16)},
		{name: "tp2-1", model: attn, p: e2eEngine(1, 2, 1, 16, 16), d: e2eEngine(2, 1, 1, 16, 16), fragment: true},
		{name: "tp1-2", model: attn, p: e2eEngine(1, 1, 1, 16, 16), d: e2eEngine(2, 2, 1, 16, 16)},
		{name: "tp4-2", model: attn, p: e2eEngine(1, 4, 1, 16, 16), d: e2eEngine(2, 2, 1, 16, 16), fragment: true},
		{name: "mla1-2", model: mlaM, p: e2eEngine(1, 1, 1, 16, 16), d: e2eEngine(2, 2, 1, 16, 16)},
		{name: "block16-32", model: attn, p: e2eEngine(1, 1, 1, 16, 16), d: e2eEngine(2, 1, 1, 32, 32), fragment: true},
		{name: "hybrid-swa", model: hybrid, p: e2eEngine(1, 2, 1, 16, 16), d: e2eEngine(2, 1, 1, 16, 16), fragment: true},
		{name: "pp2-producer", model: attn, p: e2eEngine(1, 1, 2, 16, 16), d: e2eEngine(2, 1, 1, 16, 16)},
	}
}

// TestEndToEnd moves the KV of many requests from a P engine to a D engine
// through Workers over the fake backend, in push and pull, and checks
// every byte of D's KV cache and exactly one outcome per request per rank.
func TestEndToEnd(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, c := range e2eCases() {
			t.Run(mode.String()+"/"+c.name, func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) { runE2E(t, c, mode) })
			})
		}
	}
	for _, c := range e2eCases() {
		c.layerwise = true
		t.Run("layerwise/"+c.name, func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { runE2E(t, c, kvxfer.ModePush) })
		})
	}
}

// TestEndToEndTCP runs the same transfers over the built-in backend on
// loopback TCP, in real time: real sockets, several connections per peer,
// the zero-copy send and receive paths.
func TestEndToEndTCP(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, c := range e2eCases() {
			c.tcp = true
			t.Run(mode.String()+"/"+c.name, func(t *testing.T) { runE2E(t, c, mode) })
		}
	}
	c := e2eCases()[1]
	c.tcp, c.layerwise = true, true
	t.Run("layerwise/"+c.name, func(t *testing.T) { runE2E(t, c, kvxfer.ModePush) })
}

// TestEndToEndSameHostGPU runs the transfers over the built-in backend's
// same-host path with the ranks' memory as GPU memory (a stand-in GPU
// whose batches copy as a kernel would): a push WRITE or a pull READ goes
// as layouts (one base pair per layer, an entry per run of blocks,
// admitted by the grants or holds as layouts, staged as they are), every
// byte checked.
func TestEndToEndSameHostGPU(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, c := range e2eCases() {
			c.gpu = true
			t.Run(mode.String()+"/"+c.name, func(t *testing.T) { runE2E(t, c, mode) })
		}
	}
}

// TestEndToEndNixl runs the transfers through NIXL (UCX) when it is
// installed (pip install nixl-cu12); it skips otherwise. With prepared
// lists, the backend's cost model picks each request's kind of post;
// models that always pick one kind check that both move the right bytes.
func TestEndToEndNixl(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, post := range []string{"plain", "model", "prepared", "onthefly"} {
			for _, c := range e2eCases() {
				c.nixl, c.prepared, c.post = true, post != "plain", post
				t.Run(fmt.Sprintf("%v/%s/%s", mode, post, c.name), func(t *testing.T) { runE2E(t, c, mode) })
			}
		}
	}
}

// e2ePostCost is the NIXL backends' post cost model for a case's post.
func e2ePostCost(post string) kvxfer.PostCost {
	switch post {
	case "prepared":
		return kvxfer.PostCost{Fixed: time.Hour}
	case "onthefly":
		return kvxfer.PostCost{PreparedFixed: time.Hour}
	}
	return kvxfer.PostCost{}
}

func runE2E(t *testing.T, c e2eCase, mode kvxfer.Mode) {
	fab := kvxfertest.NewFabric()
	dir := kvxfertest.NewDirectory()
	settle := synctest.Wait
	var p, d *simEngine
	if c.nixl {
		settle = func() { time.Sleep(2 * time.Millisecond) }
		p = startNixlEngine(t, dir, &c.model, c.p, "P", mode, e2ePostCost(c.post), func(cfg *kvxfer.WorkerConfig) { cfg.Layerwise, cfg.Prepared = c.layerwise, c.prepared })
		d = startNixlEngine(t, dir, &c.model, c.d, "D", mode, e2ePostCost(c.post), func(cfg *kvxfer.WorkerConfig) { cfg.Prepared = c.prepared })
	} else if c.gpu {
		settle = func() { time.Sleep(2 * time.Millisecond) }
		g := &heldGPU{release: make(chan struct{})}
		on := func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
			return gpuBackend(t, name, r, g), nil
		}
		p = startEngineOn(t, dir, &c.model, c.p, "P", mode, nil, on)
		d = startEngineOn(t, dir, &c.model, c.d, "D", mode, nil, on)
		defer func() {
			var parts uint64
			for _, be := range d.backends {
				parts += be.(*tcp.Backend).LayoutParts()
			}
			if mode == kvxfer.ModePull {
				parts = 0
				for _, be := range p.backends { // READs are served by P
					parts += be.(*tcp.Backend).LayoutParts()
				}
			}
			if layouts := g.layoutsStaged(); parts == 0 || layouts == 0 {
				t.Errorf("%v over GPU memory: %d layout parts, %d layouts staged; want its transfers as layouts", mode, parts, layouts)
			}
		}()
	} else if c.tcp {
		settle = func() { time.Sleep(2 * time.Millisecond) }
		p = startNetEngine(t, dir, &c.model, c.p, "P", mode, func(cfg *kvxfer.WorkerConfig) { cfg.Layerwise = c.layerwise })
		d = startNetEngine(t, dir, &c.model, c.d, "D", mode, nil)
	} else {
		p = startEngine(t, fab, dir, &c.model, c.p, "P", mode, func(cfg *kvxfer.WorkerConfig) { cfg.Layerwise = c.layerwise })
		d = startEngine(t, fab, dir, &c.model, c.d, "D", mode, nil)
	}
	defer d.close(t)
	defer p.close(t)

	rng := rand.New(rand.NewPCG(7, uint64(len(c.name))))
	groups := d.ranks[0][0].Layout.GroupList()
	pp := newPool(rng, len(groups), c.p.Blocks, c.fragment)
	dp := newPool(rng, len(groups), c.d.Blocks, c.fragment)
	const n = 16
	var reqs []*xreq
	for i := range n {
		tokens := 1 + rng.IntN(70)
		hit := 0
		switch i % 4 {
		case 1: // partial prefix hit on D, block aligned
			hit = (tokens / 2) / c.d.LogicalBlock * c.d.LogicalBlock
		case 3: // full prefix hit: nothing to move
			hit = (tokens + c.d.LogicalBlock - 1) / c.d.LogicalBlock * c.d.LogicalBlock
		}
		reqs = append(reqs, makeRequest(string(rune('a'+i)), tokens, hit, groups, c.p, c.d, pp, dp))
	}
	for _, stage := range p.ranks {
		for _, r := range stage {
			r.Scramble(uint64(r.Layout.TPRank + 10*r.Layout.PPRank + 1))
			for _, q := range reqs {
				r.Fill(q.sim.P)
			}
		}
	}
	var before [][]byte
	for _, r := range d.ranks[0] {
		r.Scramble(uint64(100 + r.Layout.TPRank))
		before = append(before, r.Snapshot())
	}

	now := time.Now()
	// Half the requests reach D first, half P first (push matches in
	// either order).
	var pm, dm kvxfer.StepMeta
	pm.SchedulerClock, dm.SchedulerClock = now, now
	for _, q := range reqs {
		dm.Recv = append(dm.Recv, q.recv(mode, p, now.Add(time.Minute)))
	}
	for _, q := range reqs {
		pm.Send = append(pm.Send, q.send(now.Add(30*time.Second)))
	}
	if c.layerwise {
		// The prefill step lists every request; layers are reported
		// saved one by one, then the requests finish.
		p.step(t, &kvxfer.StepMeta{Step: 1, SchedulerClock: now, Prefill: pm.Send[:n/2]})
		d.step(t, &dm)
		settle()
		p.step(t, &kvxfer.StepMeta{Step: 2, SchedulerClock: now, Prefill: pm.Send[n/2:]})
		for step := uint64(1); step <= 2; step++ {
			for _, stage := range p.workers {
				for _, w := range stage {
					l := w.Layout()
					for layer := range layersOf(l) {
						if err := w.LayerSaved(step, layer); err != nil {
							t.Fatal(err)
						}
						settle()
					}
				}
			}
		}
		p.step(t, &kvxfer.StepMeta{Step: 3, SchedulerClock: now, Send: pm.Send})
	} else {
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: pm.Send[:n/2]})
		d.step(t, &dm)
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: pm.Send[n/2:]})
	}

	out := newOutcomes()
	rounds := 200
	if c.tcp || c.nixl || c.gpu {
		rounds = 5000 // 10 s of real time at most
	}
	for range rounds {
		settle()
		out.collect(t, p)
		out.collect(t, d)
		if len(out.seen) == expectedReports(reqs, p, d, &dm) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got, want := len(out.seen), expectedReports(reqs, p, d, &dm); got != want {
		t.Fatalf("%d outcome reports, want %d: %v", got, want, out.seen)
	}
	for _, q := range reqs {
		for _, o := range out.send["p-"+q.id] {
			if o.Result != kvxfer.ResultDone {
				t.Errorf("P outcome of %s = %v (%s), want done", q.id, o.Result, o.Reason)
			}
		}
		for _, o := range out.recv["d-"+q.id] {
			if o.Result != kvxfer.ResultDone {
				t.Errorf("D outcome of %s = %v (%s), want done", q.id, o.Result, o.Reason)
			}
		}
	}
	if c.prepared && c.post != "model" {
		n := 0
		for _, be := range append(slices.Clone(p.backends), d.backends...) {
			n += be.(*nixl.Backend).PreparedLists()
		}
		if c.post == "prepared" && n == 0 {
			t.Error("every post prepared, yet no prepared list was made")
		}
		if c.post == "onthefly" && n != 0 {
			t.Errorf("every post on the fly, yet %d prepared lists were made", n)
		}
	}
	// Each D rank hears one completion notice per producer rank: a second
	// one means a producer WRITEs twice (the second could land after D
	// handed its blocks back). In push, no WRITE is refused by the grants.
	for _, stage := range d.workers {
		for _, w := range stage {
			s := w.Metrics().Snapshot()
			for _, k := range []string{"done_duplicate", "done_unknown_request"} {
				if s.Dropped[k] != 0 {
					t.Errorf("D rank %d dropped %d notices as %s", w.Layout().TPRank, s.Dropped[k], k)
				}
			}
			if mode == kvxfer.ModePush && len(s.RefusedAccess) > 0 {
				t.Errorf("D rank %d refused WRITEs: %v", w.Layout().TPRank, s.RefusedAccess)
			}
		}
	}
	var sims []*kvsim.Request
	for _, q := range reqs {
		if q.tokens > q.hit {
			sims = append(sims, &q.sim)
		}
	}
	for i, r := range d.ranks[0] {
		if err := r.CheckValues(before[i], sims, c.p.KernelBlock, c.p.LogicalBlock); err != nil {
			t.Errorf("D rank %d: %v", i, err)
		}
	}
}

// expectedReports counts one outcome per request per rank on each side.
func expectedReports(reqs []*xreq, p, d *simEngine, dm *kvxfer.StepMeta) int {
	pr := len(p.workers) * len(p.workers[0])
	dr := len(d.workers) * len(d.workers[0])
	return len(reqs)*pr + len(dm.Recv)*dr
}

// layersOf returns the layers a rank holds (packed or split K/V: one
// region per layer).
func layersOf(l *topology.Layout) map[int]bool {
	out := map[int]bool{}
	for i := range l.Regions {
		out[l.RegionOffset+i] = true
	}
	return out
}
