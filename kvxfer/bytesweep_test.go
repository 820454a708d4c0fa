package kvxfer_test

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// sweepCase is one randomized configuration of the byte sweep.
type sweepCase struct {
	model     kvsim.Model
	p, d      kvsim.Engine
	mode      kvxfer.Mode
	layerwise bool
	n         int // requests
	// backend: "" the fake fabric (synctest); "tcp" the built-in backend
	// over loopback TCP; "gpu" its same-host path over a stand-in GPU
	// (layouts); the last two in real time.
	backend string
	// firstLayer, when set, gives P's WorkerConfig.FirstLayer per stage.
	firstLayer func(pp int) int
	// lists, when set, changes request i's block lists after they are
	// made (more blocks than its tokens need, ids at a region's end...),
	// taking any further blocks from the pools.
	lists func(rng *rand.Rand, i int, q *xreq, groups []topology.Group, pp, dp *blockPool)
	// contiguous hands out block ids in order, starting a few blocks
	// before the region's end (then wrapping to 0), so consecutive
	// requests' blocks are adjacent on both engines (runs that coalesce
	// must stop at a request's end) and the first ones reach the region's
	// last block.
	contiguous bool
	// maxRun is the Workers' MaxRunBytes (0: no cap).
	maxRun int64
}

func (c *sweepCase) String() string {
	e := func(x kvsim.Engine) string {
		return fmt.Sprintf("tp%d pp%d L%d K%d %v/%v", x.TP, x.PP, x.LogicalBlock, x.KernelBlock, x.Layout, x.Packing)
	}
	return fmt.Sprintf("%s %v layerwise=%v kinds %v heads %d head %d·%dB mla %d; P %s; D %s; %d requests",
		c.backend, c.mode, c.layerwise, c.model.Kinds, c.model.TotalKVHeads, c.model.HeadSize, c.model.ElemBytes, c.model.MLABytesPerToken,
		e(c.p), e(c.d), c.n)
}

func pick[T any](rng *rand.Rand, xs ...T) T { return xs[rng.IntN(len(xs))] }

func sweepRandomCase(rng *rand.Rand) *sweepCase {
	c := &sweepCase{n: 4 + rng.IntN(10)}
	c.mode = pick(rng, kvxfer.ModePush, kvxfer.ModePull)
	c.layerwise = c.mode == kvxfer.ModePush && rng.IntN(4) == 0
	c.model = kvsim.Model{TotalKVHeads: pick(rng, 1, 2, 4, 8), HeadSize: pick(rng, 2, 4, 8), ElemBytes: pick(rng, 1, 2)}
	switch rng.IntN(5) {
	case 4: // hybrid: attention and Mamba state layers
		c.model.Kinds = []topology.Kind{fa, topology.KindMamba, fa, topology.KindMamba}
		c.model.MambaConv = []int64{64, 32}[:1+rng.IntN(2)]
		c.model.MambaSSM = pick(rng, int64(128), int64(256))
		c.model.MambaPad = pick(rng, int64(0), int64(8))
	case 0:
		c.model.Kinds = []topology.Kind{mla, mla}
		c.model.MLABytesPerToken = pick(rng, 4, 12)
	case 1:
		c.model.Kinds = []topology.Kind{fa, swa, fa, swa}
		c.model.Window = pick(rng, 16, 40, 70)
	default:
		c.model.Kinds = []topology.Kind{fa, fa, fa}[:1+rng.IntN(3)]
	}
	eng := func(id int) kvsim.Engine {
		logical := pick(rng, 16, 32, 64)
		kernel := logical
		if rng.IntN(3) == 0 {
			kernel = logical / pick(rng, 2, 4)
		}
		e := kvsim.Engine{ID: id, TP: pick(rng, 1, 2, 4, 8), PP: 1, LogicalBlock: logical, KernelBlock: kernel,
			Layout: topology.LayoutHND, Packing: topology.PackedKV}
		if rng.IntN(4) == 0 {
			e.Layout = topology.LayoutNHD
		}
		e.Packing = pick(rng, topology.PackedKV, topology.PackedKV, topology.SplitKV, topology.SeparateKV)
		return e
	}
	c.p, c.d = eng(1), eng(2)
	// Separate K and V regions on one side only is refused (the region
	// counts differ): a refusal, not what this sweep checks.
	if (c.p.Packing == topology.SeparateKV) != (c.d.Packing == topology.SeparateKV) {
		c.d.Packing = c.p.Packing
	}
	if rng.IntN(5) == 0 && len(c.model.Kinds) >= 2 {
		c.p.PP = 2
		// kvsim gives each stage len(Kinds)/PP layers.
		per := len(c.model.Kinds) / 2
		c.firstLayer = func(pp int) int { return pp * per }
	}
	// Enough blocks for every request at the smallest block size.
	c.p.Blocks = c.n*(200/c.p.LogicalBlock+1) + 4
	c.d.Blocks = c.n*(200/c.d.LogicalBlock+1) + 4
	return c
}

// TestByteSweep moves the KV of many concurrent requests through Workers
// over randomized configurations (P and D TP in 1..8, heads fewer than a
// TP size, block sizes and kernel blocks that differ either way, HND and
// NHD, packed, split and separate K/V, MLA, sliding windows, a pipelined
// producer, push, pull and layer-wise push) with scattered block ids,
// partial last blocks and partial and full prefix hits on D. Every
// request's KV carries its own salt, so a byte that lands in another
// request's block is caught; every D byte is checked (kvsim's semantic
// model: the transferred ones against the pattern, the rest against their
// value before).
func TestByteSweep(t *testing.T) {
	n, seed := sweepSize(t, 60, 15)
	rng := rand.New(rand.NewPCG(seed, 0x5eed))
	for i := range n {
		c := sweepRandomCase(rng)
		caseSeed := rng.Uint64()
		ok := t.Run(strconv.Itoa(i), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { runSweep(t, c, caseSeed) })
		})
		if !ok {
			t.Fatalf("case %d (seed %d): %s", i, seed, c)
		}
	}
}

// sweepSize is how many cases a sweep runs (n, short under -short,
// $KVXFER_SWEEP_N) and its seed (the time, or $KVXFER_SWEEP_SEED to replay
// a run), logged.
func sweepSize(t *testing.T, n, short int) (int, uint64) {
	if testing.Short() {
		n = short
	}
	seed := uint64(time.Now().UnixNano())
	if s := os.Getenv("KVXFER_SWEEP_SEED"); s != "" {
		seed, _ = strconv.ParseUint(s, 10, 64)
	}
	if s := os.Getenv("KVXFER_SWEEP_N"); s != "" {
		n, _ = strconv.Atoi(s)
	}
	t.Logf("seed %d (KVXFER_SWEEP_SEED replays it)", seed)
	return n, seed
}

// TestByteSweepNixl is TestByteSweep through NIXL (UCX) when it is
// installed (it skips otherwise): plain posts, and prepared descriptor
// lists with each kind of post (a prepared post names its units by index
// pairs, not by the coalesced descriptors), over the same random
// configurations, half of them with TestByteSweepLists' block lists.
// TestEndToEndNixl covers eight fixed HND packed configurations only.
func TestByteSweepNixl(t *testing.T) {
	n, seed := sweepSize(t, 12, 4)
	rng := rand.New(rand.NewPCG(seed, 0x6e69786c))
	for i := range n {
		c := sweepRandomCase(rng)
		if rng.IntN(2) == 0 {
			c.p.Blocks += 3 * c.n
			c.d.Blocks += 3 * c.n
			c.lists = sweepLists
			c.contiguous = rng.IntN(2) == 0
		}
		c.backend = pick(rng, "nixl", "nixl-model", "nixl-prepared", "nixl-onthefly")
		caseSeed := rng.Uint64()
		if !t.Run(strconv.Itoa(i), func(t *testing.T) { runSweep(t, c, caseSeed) }) {
			t.Fatalf("case %d (seed %d): %s", i, seed, c)
		}
	}
}

// TestByteSweepNet is TestByteSweep over the built-in backend: loopback
// TCP (the zero-copy send and receive paths) and the same-host path over
// a stand-in GPU (transfers as layouts), in real time, fewer cases.
func TestByteSweepNet(t *testing.T) {
	n, seed := sweepSize(t, 12, 4)
	rng := rand.New(rand.NewPCG(seed, 0x6e6574))
	for i := range n {
		c := sweepRandomCase(rng)
		c.backend = pick(rng, "tcp", "gpu")
		caseSeed := rng.Uint64()
		if !t.Run(strconv.Itoa(i), func(t *testing.T) { runSweep(t, c, caseSeed) }) {
			t.Fatalf("case %d (seed %d): %s", i, seed, c)
		}
	}
}

func runSweep(t *testing.T, c *sweepCase, seed uint64) {
	fab, dir := newFabricDir()
	settle := synctest.Wait
	start := func(m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, tweak func(*kvxfer.WorkerConfig)) *simEngine {
		return startEngine(t, fab, dir, m, e, id, mode, tweak)
	}
	var memMu sync.Locker = new(sync.Mutex)
	switch c.backend {
	case "tcp":
		settle = func() { time.Sleep(time.Millisecond) }
		start = func(m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, tweak func(*kvxfer.WorkerConfig)) *simEngine {
			return startNetEngine(t, dir, m, e, id, mode, tweak)
		}
	case "nixl", "nixl-model", "nixl-prepared", "nixl-onthefly":
		// NIXL (UCX), in real time; with prepared descriptor lists but
		// for "nixl", its cost model picking each post's kind or every
		// post of one kind (e2ePostCost).
		settle = func() { time.Sleep(time.Millisecond) }
		post, _ := strings.CutPrefix(c.backend, "nixl-")
		start = func(m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, tweak func(*kvxfer.WorkerConfig)) *simEngine {
			return startNixlEngine(t, dir, m, e, id, mode, e2ePostCost(post), func(cfg *kvxfer.WorkerConfig) {
				tweak(cfg)
				cfg.Prepared = c.backend != "nixl"
			})
		}
	case "gpu":
		settle = func() { time.Sleep(time.Millisecond) }
		g := &heldGPU{release: make(chan struct{})}
		// The stand-in GPU's copies run under its lock: P's layers are
		// computed under it too, which the race detector needs to see
		// them ordered (it does not see the unix socket that orders them).
		memMu = &g.mu
		start = func(m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, tweak func(*kvxfer.WorkerConfig)) *simEngine {
			return startEngineOn(t, dir, m, e, id, mode, tweak, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
				return gpuBackend(t, name, r, g), nil
			})
		}
	}
	big := func(cfg *kvxfer.WorkerConfig) {
		cfg.MaxSegments = 1 << 14
		cfg.MaxRunBytes = c.maxRun
		cfg.Layerwise = c.layerwise
		if c.firstLayer != nil && cfg.EngineID == "P" {
			cfg.FirstLayer = c.firstLayer(cfg.Layout.PPRank)
		}
	}
	p := start(&c.model, c.p, "P", c.mode, big)
	d := start(&c.model, c.d, "D", c.mode, big)
	defer d.close(t)
	defer p.close(t)

	rng := rand.New(rand.NewPCG(seed, 1))
	groups := d.ranks[0][0].Layout.GroupList()
	pp := newPool(rng, len(groups), c.p.Blocks, !c.contiguous)
	dp := newPool(rng, len(groups), c.d.Blocks, !c.contiguous)
	if c.contiguous {
		// Start a few blocks before each region's end and wrap around:
		// the first requests hold the region's last blocks.
		for _, pool := range []*blockPool{pp, dp} {
			for g, ids := range pool.free {
				k := len(ids) - 1 - rng.IntN(min(8, len(ids)))
				pool.free[g] = append(ids[k:], ids[:k]...)
			}
		}
	}
	var reqs []*xreq
	for i := range c.n {
		tokens := 1 + rng.IntN(200)
		hit := 0
		switch rng.IntN(5) {
		case 1, 2: // partial prefix hit on D, on D's block grid
			hit = rng.IntN(tokens) / c.d.LogicalBlock * c.d.LogicalBlock
		case 3: // full prefix hit: nothing moves
			hit = (tokens + c.d.LogicalBlock - 1) / c.d.LogicalBlock * c.d.LogicalBlock
		}
		q := makeRequest(fmt.Sprintf("r%d", i), tokens, hit, groups, c.p, c.d, pp, dp)
		q.sim.Salt = i + 1
		if c.lists != nil {
			c.lists(rng, i, q, groups, pp, dp)
		}
		for g, grp := range groups {
			if grp.Kind == topology.KindMamba {
				// A state block: the last one (the exchange's clipping).
				q.sim.P[g].IDs = topology.ClipMamba(q.sim.P[g].IDs, 0, false)
				q.sim.D[g] = topology.Span{IDs: topology.ClipMamba(q.sim.D[g].IDs, 0, false)}
			}
		}
		reqs = append(reqs, q)
	}
	// full is each P rank's memory once every layer is computed. Layer-
	// wise, a layer's regions get their KV only when the layer is
	// reported saved, so a WRITE of a layer before it is saved lands
	// stale bytes and is caught.
	full := map[*kvsim.Rank][]byte{}
	for _, stage := range p.ranks {
		for _, r := range stage {
			r.Scramble(uint64(r.Layout.TPRank + 10*r.Layout.PPRank + 1))
			stale := r.Snapshot()
			for _, q := range reqs {
				r.FillSalt(q.sim.P, q.sim.Salt)
			}
			full[r] = r.Snapshot()
			if c.layerwise {
				copy(r.Mem, stale)
			}
		}
	}
	// computeLayer gives the layer's blocks that still hold stale bytes
	// their KV; blocks computed at an earlier step are left alone (their
	// WRITEs may be reading them).
	computeLayer := func(r *kvsim.Rank, layer int) {
		for i, l := range r.Layer {
			if l == layer {
				reg := &r.Layout.Regions[i]
				bl := int(reg.BlockLen)
				for b, o := 0, int(reg.Base-r.Base); b < reg.NumBlocks; b, o = b+1, o+bl {
					if !bytes.Equal(r.Mem[o:o+bl], full[r][o:o+bl]) {
						memMu.Lock()
						copy(r.Mem[o:o+bl], full[r][o:o+bl])
						memMu.Unlock()
					}
				}
			}
		}
	}
	before := map[*kvsim.Rank][]byte{}
	for _, stage := range d.ranks {
		for _, r := range stage {
			r.Scramble(uint64(100 + r.Layout.TPRank + 10*r.Layout.PPRank))
			before[r] = r.Snapshot()
		}
	}
	now := time.Now()
	var pm, dm kvxfer.StepMeta
	pm.SchedulerClock, dm.SchedulerClock = now, now
	for _, q := range reqs {
		dm.Recv = append(dm.Recv, q.recv(c.mode, p, now.Add(time.Minute)))
		pm.Send = append(pm.Send, q.send(now.Add(30*time.Second)))
	}
	half := len(reqs) / 2
	if c.layerwise {
		p.step(t, &kvxfer.StepMeta{Step: 1, SchedulerClock: now, Prefill: pm.Send[:half]})
		d.step(t, &dm)
		settle()
		p.step(t, &kvxfer.StepMeta{Step: 2, SchedulerClock: now, Prefill: pm.Send[half:]})
		for step := uint64(1); step <= 2; step++ {
			for pi, stage := range p.workers {
				for ti, w := range stage {
					r := p.ranks[pi][ti]
					layers := slices.Compact(slices.Sorted(slices.Values(r.Layer)))
					for _, layer := range layers {
						computeLayer(r, layer)
						if err := w.LayerSaved(step, layer); err != nil {
							t.Errorf("P pp%d tp%d: %v", pi, ti, err)
						}
						settle()
					}
				}
			}
		}
		p.step(t, &kvxfer.StepMeta{Step: 3, SchedulerClock: now, Send: pm.Send})
	} else {
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: pm.Send[:half]})
		d.step(t, &dm)
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: pm.Send[half:]})
	}
	out := newOutcomes()
	want := expectedReports(reqs, p, d, &dm)
	rounds := 200
	if c.backend != "" {
		rounds = 4000
	}
	for range rounds {
		settle()
		out.collect(t, p)
		out.collect(t, d)
		if len(out.seen) == want {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got := len(out.seen); got != want {
		t.Fatalf("%d outcome reports, want %d: %v", got, want, out.seen)
	}
	bad := 0
	for _, q := range reqs {
		for _, o := range append(out.send["p-"+q.id], out.recv["d-"+q.id]...) {
			if o.Result != kvxfer.ResultDone && bad < 3 {
				bad++
				t.Errorf("outcome of %s = %v (%s), want done", o.ReqID, o.Result, o.Reason)
			}
		}
	}
	var sims []*kvsim.Request
	for _, q := range reqs {
		if q.tokens > q.hit {
			sims = append(sims, &q.sim)
		}
	}
	for _, stage := range d.ranks {
		for _, r := range stage {
			if err := r.CheckValues(before[r], sims, c.p.KernelBlock, c.p.LogicalBlock); err != nil {
				t.Errorf("D rank pp %d tp %d: %v", r.Layout.PPRank, r.Layout.TPRank, err)
			}
		}
	}
}

// TestLayerwiseLaterStageSeparateKV is layer-wise push from the second
// pipeline stage of a model whose first stage holds a layer of one region
// (MLA here; Mamba alike) under SeparateKV, where every attention layer
// has two regions: the second stage holds layers 2 (MLA) and 3 (K and V),
// regions 3..5 of the model. The default layer numbering halved the
// region offset, so it took the stage for layers 1 and 2: LayerSaved(2)
// WROTE layer 3's K and V before the engine computed them (D got stale
// bytes, reported done) and LayerSaved(3) was refused. The stage's first
// layer cannot be derived from its region offset there, so a Worker
// without WorkerConfig.FirstLayer is refused, naming it; with it, every
// byte lands.
func TestLayerwiseLaterStageSeparateKV(t *testing.T) {
	eng := func(id, pp int) kvsim.Engine {
		return kvsim.Engine{ID: id, TP: 1, PP: pp, LogicalBlock: 16, KernelBlock: 16,
			Layout: topology.LayoutHND, Packing: topology.SeparateKV, Blocks: 64}
	}
	c := &sweepCase{
		model: kvsim.Model{Kinds: []topology.Kind{mla, fa, mla, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2, MLABytesPerToken: 8},
		p:     eng(1, 2), d: eng(2, 1), mode: kvxfer.ModePush, layerwise: true, n: 4,
	}
	ranks, err := kvsim.Build(&c.model, &c.p)
	if err != nil {
		t.Fatal(err)
	}
	dir := kvxfertest.NewDirectory()
	a, err := kvxfertest.NewFabric().NewAgent("P")
	if err != nil {
		t.Fatal(err)
	}
	_, err = kvxfer.NewWorker(kvxfer.WorkerConfig{EngineID: "P", Mode: kvxfer.ModePush, Layout: ranks[1][0].Layout,
		Backend: a, Resolver: dir, Layerwise: true, Logger: quiet})
	if err == nil || !strings.Contains(err.Error(), "WorkerConfig.FirstLayer = 0") || !strings.Contains(err.Error(), "RegionOffset = 3") {
		t.Fatalf("NewWorker of a layer-wise later stage under SeparateKV without FirstLayer: %v; want a refusal naming FirstLayer and RegionOffset = 3", err)
	}
	c.firstLayer = func(pp int) int { return ranks[pp][0].Layer[0] }
	synctest.Test(t, func(t *testing.T) { runSweep(t, c, 1) })
}
