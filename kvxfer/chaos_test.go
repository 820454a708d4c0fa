package kvxfer_test

import (
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strconv"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// TestChaos runs thousands of requests through P and D workers while the
// fabric fails transfers, handshakes and notifications, drops, delays,
// duplicates and reorders notifications, and stalls peers. It asserts:
//   - exactly one outcome per request per rank per side;
//   - fencing: a block is scribbled over the moment its side reports it
//     free, and no transfer may touch it afterwards (a late WRITE into a
//     freed D block, or a late READ of a freed P block, is caught by the
//     checks below);
//   - every D rank of a request reported done holds exactly P's bytes;
//   - no registration, lease, handle or match is left once all requests
//     ended.
func TestChaos(t *testing.T) {
	n := 700
	switch {
	case testing.Short():
		n = 150
	case raceEnabled:
		n = 250 // 2,000 requests over the cases, at a tenth of the speed
	}
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, tp := range [][2]int{{2, 1}, {1, 2}} {
			for _, rate := range []int{12, 60} {
				name := fmt.Sprintf("%v/P%d-D%d/faults-1-in-%d", mode, tp[0], tp[1], rate)
				t.Run(name, func(t *testing.T) {
					synctest.Test(t, func(t *testing.T) {
						runChaos(t, mode, false, tp[0], tp[1], n, rate, uint64(tp[0]*10+tp[1]+rate)+chaosSeed)
					})
				})
			}
			if mode == kvxfer.ModePush {
				name := fmt.Sprintf("layerwise/P%d-D%d/faults-1-in-20", tp[0], tp[1])
				t.Run(name, func(t *testing.T) {
					synctest.Test(t, func(t *testing.T) { runChaos(t, mode, true, tp[0], tp[1], n, 20, uint64(tp[0]*10+tp[1]+7)+chaosSeed) })
				})
			}
		}
	}
}

// TestChaosConfigs is TestChaos (push, pull and layer-wise push, faults
// injected) over randomized configurations of the byte sweep
// (sweepRandomCase but Mamba): P and D TP up to 8, a pipelined producer,
// block sizes and kernel blocks that differ either way, HND and NHD,
// packed, split and separate K/V, MLA and sliding windows. TestChaos
// covers one attention model, TP 2 to 1 and 1 to 2, equal blocks: the
// fences (no transfer into a freed D block or out of a freed P block)
// and the bytes of every request done are checked here where a
// request's blocks map onto the other engine's unevenly.
func TestChaosConfigs(t *testing.T) {
	n, seed := sweepSize(t, 8, 3)
	rng := rand.New(rand.NewPCG(seed, 0xc4a05))
	for i := range n {
		c := sweepRandomCase(rng)
		for slices.Contains(c.model.Kinds, topology.KindMamba) {
			c = sweepRandomCase(rng)
		}
		caseSeed := rng.Uint64()
		rate := pick(rng, 12, 60)
		reqs := 150
		if raceEnabled {
			reqs = 60
		}
		if !t.Run(strconv.Itoa(i), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { runChaosOn(t, c, reqs, rate, caseSeed) })
		}) {
			t.Fatalf("case %d (seed %d): %s, faults 1 in %d", i, seed, c, rate)
		}
	}
}

// TestChaosNet is TestChaosConfigs in real time over the built-in backend
// (loopback TCP) or NIXL (prepared lists; skipped where it is not
// installed), without injected faults: aborts, missing consumers and
// expiries, a quarter of the requests with a P lease or D deadline of
// 0.05-3 ms, so that many end while their transfer is under way. The fake
// fabric moves bytes at once; these backends complete, cancel and fence
// transfers as they do in production (with the push consumer's fence
// turned off, 8 cases over NIXL caught a WRITE landing in a D block after
// its request was reported ended).
func TestChaosNet(t *testing.T) {
	n, seed := sweepSize(t, 2, 1)
	rng := rand.New(rand.NewPCG(seed, 0xc4a06))
	for i := range n {
		c := sweepRandomCase(rng)
		for slices.Contains(c.model.Kinds, topology.KindMamba) {
			c = sweepRandomCase(rng)
		}
		c.backend = pick(rng, "tcp", "nixl")
		caseSeed := rng.Uint64()
		if !t.Run(strconv.Itoa(i), func(t *testing.T) { runChaosOn(t, c, 80, 0, caseSeed) }) {
			t.Fatalf("case %d (seed %d): %s", i, seed, c)
		}
	}
}

type chaosReq struct {
	x         *xreq
	tP, tD    int  // steps at which P finishes (layer-wise: prefills) and D allocates
	tFin      int  // layer-wise: step at which P finishes
	pAbort    bool // P aborts after scheduling (NotProcessed)
	dAbort    bool // D aborts before schedule (empty Aborted RecvReq)
	dMissing  bool // D never shows up: P's lease must expire
	pReports  int
	dReports  int
	pFreed    bool
	dFreed    bool
	pEntered  bool
	dEntered  bool
	pOutcomes []kvxfer.Result
	dOutcomes []kvxfer.Result
	// lease and wait: P's lease and D's deadline from the step that
	// hands the request over.
	lease, wait time.Duration
}

const sentinel = 0xA5

var noFaults = os.Getenv("CHAOS_NOFAULTS") != ""

// chaosSeed shifts every run's seed (CHAOS_SEED=n), for sweeps.
var chaosSeed, _ = strconv.ParseUint(os.Getenv("CHAOS_SEED"), 10, 64)

func runChaos(t *testing.T, mode kvxfer.Mode, layerwise bool, ptp, dtp, n, rate int, seed uint64) {
	c := &sweepCase{model: kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2},
		p: e2eEngine(1, ptp, 1, 16, 16), d: e2eEngine(2, dtp, 1, 16, 16), mode: mode, layerwise: layerwise}
	runChaosOn(t, c, n, rate, seed)
}

// runChaosOn is runChaos for a sweep case's model and engines (its n and
// blocks are not used: 160 blocks a region). Its backend is the fake
// fabric, faults injected (in a synctest bubble), or, "tcp" or "nixl", the
// built-in backend over loopback TCP or NIXL (prepared lists) in real
// time, without injected faults (aborts, missing consumers and expiries
// still come, some of them while a transfer may be under way), its times
// a tenth.
func runChaosOn(t *testing.T, c *sweepCase, n, rate int, seed uint64) {
	mode, layerwise := c.mode, c.layerwise
	rng := rand.New(rand.NewPCG(seed, 99))
	fab := kvxfertest.NewFabric()
	dir := kvxfertest.NewDirectory()
	model, pe, de := c.model, c.p, c.d
	pe.Blocks, de.Blocks = 160, 160
	real := c.backend != ""
	scale, settle := time.Duration(1), synctest.Wait
	if real {
		scale, settle = 10, func() {}
	}
	tweak := func(cfg *kvxfer.WorkerConfig) {
		cfg.Layerwise = layerwise
		cfg.Lease = 6 * time.Second / scale
		cfg.RegistrationTTL = 30 * time.Second / scale
		cfg.EngineTTL = time.Minute / scale
		cfg.MaxSegments = 1 << 14
		if c.firstLayer != nil && cfg.EngineID == "P" {
			cfg.FirstLayer = c.firstLayer(cfg.Layout.PPRank)
		}
	}
	start := func(e kvsim.Engine, id string) *simEngine {
		switch c.backend {
		case "tcp":
			return startNetEngine(t, dir, &model, e, id, mode, tweak)
		case "nixl":
			return startNixlEngine(t, dir, &model, e, id, mode, kvxfer.PostCost{}, func(cfg *kvxfer.WorkerConfig) {
				tweak(cfg)
				cfg.Prepared = true
			})
		}
		return startEngine(t, fab, dir, &model, e, id, mode, tweak)
	}
	p := start(pe, "P")
	d := start(de, "D")
	defer d.close(t)
	defer p.close(t)
	groups := d.ranks[0][0].Layout.GroupList()
	pp := newPool(rng, len(groups), pe.Blocks, true)
	dp := newPool(rng, len(groups), de.Blocks, true)
	for _, stage := range p.ranks {
		for _, r := range stage {
			r.Scramble(1)
		}
	}
	for _, r := range d.ranks[0] {
		for i := range r.Mem {
			r.Mem[i] = sentinel
		}
	}
	prank, drank := pe.TP*pe.PP, de.TP

	reqs := map[string]*chaosReq{}
	var order []*chaosReq
	step := 10 * time.Millisecond / scale
	next := 0
	stallUntil := map[kvxfer.PeerName]int{}
	var dAgents []*kvxfertest.Agent
	dAgents = append(dAgents, d.agents[0]...)
	var pAgents []*kvxfertest.Agent
	for _, stage := range p.agents {
		pAgents = append(pAgents, stage...)
	}

	free := func(se *simEngine, pool *blockPool, spans []topology.Span) {
		for g, s := range spans {
			for _, id := range s.IDs {
				for _, stage := range se.ranks {
					for _, r := range stage {
						scribble(r, g, id)
					}
				}
				pool.free[g] = append(pool.free[g], id)
			}
		}
	}

	collect := func() {
		for _, side := range []*simEngine{p, d} {
			for pi, stage := range side.workers {
				for ti, w := range stage {
					f := w.Finished()
					for _, o := range f.Sending {
						q := reqs[o.ReqID[2:]]
						if q == nil || side != p {
							t.Fatalf("unexpected send outcome %+v from %s/%d/%d", o, side.id, pi, ti)
						}
						q.pReports++
						q.pOutcomes = append(q.pOutcomes, o.Result)
						if q.pReports > prank {
							t.Fatalf("request %s: %d producer reports from %d ranks", q.x.id, q.pReports, prank)
						}
						if q.pReports == prank {
							free(p, pp, q.x.sim.P)
							q.pFreed = true
						}
					}
					for _, o := range f.Recving {
						q := reqs[o.ReqID[2:]]
						if q == nil || side != d {
							t.Fatalf("unexpected recv outcome %+v from %s/%d/%d", o, side.id, pi, ti)
						}
						q.dReports++
						q.dOutcomes = append(q.dOutcomes, o.Result)
						if q.dReports > drank {
							t.Fatalf("request %s: %d consumer reports from %d ranks", q.x.id, q.dReports, drank)
						}
						if q.dReports == drank {
							allDone := !slices.ContainsFunc(q.dOutcomes, func(r kvxfer.Result) bool { return r != kvxfer.ResultDone })
							if allDone && q.x.tokens > q.x.hit && !q.dAbort {
								for i, r := range d.ranks[0] {
									if err := r.CheckRequest(&q.x.sim, pe.KernelBlock, pe.LogicalBlock); err != nil {
										t.Errorf("request %s done on D rank %d with wrong bytes: %v", q.x.id, i, err)
									}
								}
							}
							free(d, dp, q.x.sim.D)
							q.dFreed = true
						}
					}
				}
			}
		}
	}

	for k := 0; ; k++ {
		// New arrivals while blocks last.
		for next < n && poolsHave(pp, 12) && poolsHave(dp, 12) && rng.IntN(3) == 0 {
			id := fmt.Sprintf("%04x-%08x", next, rng.Uint32())
			tokens := 1 + rng.IntN(60)
			hit := 0
			switch rng.IntN(6) {
			case 0:
				hit = (tokens / 2) / de.LogicalBlock * de.LogicalBlock
			case 1:
				hit = (tokens + de.LogicalBlock - 1) / de.LogicalBlock * de.LogicalBlock
			}
			pFree, dFree := slices.Clone(pp.free), slices.Clone(dp.free)
			x := makeRequest(id, tokens, hit, groups, pe, de, pp, dp)
			// Blocks a sliding window dropped go back to the pools.
			unclip(pp, pFree, x.sim.P)
			unclip(dp, dFree, x.sim.D)
			// Each request's KV is its own (a salt), so bytes of another
			// request landing in its blocks (a READ of a P block freed and
			// taken by a later request) are caught.
			x.sim.Salt = next + 1
			for g, sp := range x.sim.D {
				for _, b := range sp.IDs {
					for i, r := range d.ranks[0] {
						if !holdsSentinel(r, g, b) {
							t.Fatalf("D rank %d block %d of group %d was written after it was freed", i, b, g)
						}
					}
				}
			}
			for _, stage := range p.ranks {
				for _, r := range stage {
					r.FillSalt(x.sim.P, x.sim.Salt)
				}
			}
			q := &chaosReq{x: x, tP: k + rng.IntN(40), tD: k + rng.IntN(40), lease: 6 * time.Second / scale, wait: 20 * time.Second / scale}
			if real && rng.IntN(4) == 0 {
				// Ends while its transfer may be under way, in real time:
				// P's lease, or D's deadline.
				short := time.Duration(50+rng.IntN(3000)) * time.Microsecond
				if rng.IntN(2) == 0 {
					q.lease = short
				} else {
					q.wait = short
				}
			}
			q.tFin = q.tP + 1 + rng.IntN(3)
			switch rng.IntN(20) {
			case 0:
				q.pAbort = true
			case 1:
				q.dAbort = true
			case 2:
				q.dMissing = true
			}
			if mode == kvxfer.ModePull {
				// Pull D learns of a request from P's finished params.
				q.tD = q.tP + 1 + rng.IntN(40)
				q.dMissing = q.dMissing || q.pAbort
			}
			reqs[id] = q
			order = append(order, q)
			next++
		}
		// Faults.
		f := fab.Faults()
		faultRange := rate
		if noFaults {
			faultRange = 1 << 20
		}
		if real {
			faultRange = 1 << 30
		}
		switch rng.IntN(faultRange) {
		case 0:
			f.FailTransfers(1)
		case 1:
			f.DropNotifs(1)
		case 2:
			f.DelayNotifs(1)
		case 3:
			f.DuplicateNotifs(1)
		case 4:
			f.ReorderNotifs(1)
		case 5:
			f.FailNotify(1)
		case 6:
			if rng.IntN(10) == 0 {
				f.FailHandshake(1)
			}
		case 7:
			all := append(slices.Clone(dAgents), pAgents...)
			a := all[rng.IntN(len(all))]
			if _, ok := stallUntil[a.Name()]; !ok {
				f.Stall(a.Name())
				stallUntil[a.Name()] = k + 1 + rng.IntN(60)
			}
		}
		if rng.IntN(8) == 0 {
			f.DeliverDelayed()
		}
		for name, until := range stallUntil {
			if k >= until {
				f.Unstall(name)
				delete(stallUntil, name)
			}
		}
		// Steps: P and D schedulers' metadata for this step.
		now := time.Now()
		var pm, dm kvxfer.StepMeta
		pm.SchedulerClock, dm.SchedulerClock = now, now
		pm.Step = uint64(k + 1)
		for _, q := range order {
			if layerwise {
				if q.tP == k {
					pm.Prefill = append(pm.Prefill, q.x.send(time.Time{}))
					q.pEntered = true
				}
				if q.tFin == k {
					if q.pAbort {
						pm.NotProcessed = append(pm.NotProcessed, "p-"+q.x.id)
					} else {
						pm.Send = append(pm.Send, q.x.send(now.Add(q.lease)))
					}
				}
			} else if q.tP == k {
				if q.pAbort {
					pm.NotProcessed = append(pm.NotProcessed, "p-"+q.x.id)
					// The request never held blocks in kvxfer: free now.
					free(p, pp, q.x.sim.P)
					q.pFreed = true
				} else {
					pm.Send = append(pm.Send, q.x.send(now.Add(q.lease)))
					q.pEntered = true
				}
			}
			if q.tD == k {
				if q.dMissing {
					free(d, dp, q.x.sim.D)
					q.dFreed = true
					continue
				}
				rr := q.x.recv(mode, p, now.Add(q.wait))
				if q.dAbort {
					rr.Local, rr.Aborted = nil, true
				}
				dm.Recv = append(dm.Recv, rr)
				q.dEntered = true
			}
		}
		p.step(t, &pm)
		d.step(t, &dm)
		if layerwise && len(pm.Prefill) > 0 {
			for pi, stage := range p.workers {
				for ti, w := range stage {
					// The rank's layers (under SeparateKV a layer has two
					// regions).
					for _, layer := range slices.Compact(slices.Sorted(slices.Values(p.ranks[pi][ti].Layer))) {
						if err := w.LayerSaved(pm.Step, layer); err != nil {
							t.Fatal(err)
						}
					}
				}
			}
		}
		time.Sleep(step)
		settle()
		collect()
		if next == n && k > 0 && allEnded(order) {
			break
		}
		if k > 200000 {
			t.Fatalf("requests did not end")
		}
	}
	// Quiesce: lift every stall, deliver every held notification, let
	// everything that could still move move, then check the fences.
	for name := range stallUntil {
		fab.Faults().Unstall(name)
	}
	fab.Faults().DeliverDelayed()
	if real {
		// Every request ended; what is still under way lands within
		// this, or is a transfer after its fence.
		time.Sleep(500 * time.Millisecond)
	} else {
		time.Sleep(time.Minute)
	}
	settle()
	collect()
	for _, q := range order {
		if q.pEntered && q.pReports != prank {
			t.Errorf("request %s: %d producer reports, want %d", q.x.id, q.pReports, prank)
		}
		if q.dEntered && q.dReports != drank {
			t.Errorf("request %s: %d consumer reports, want %d", q.x.id, q.dReports, drank)
		}
	}
	// Every D block is free now: each must hold the sentinel it got when
	// its request ended, so no WRITE landed after its fence.
	for i, r := range d.ranks[0] {
		for o, v := range r.Mem {
			if v != sentinel {
				t.Errorf("D rank %d byte at offset %d = %#x after every request ended: a transfer landed after its fence", i, o, v)
				break
			}
		}
	}
	// Nothing left but caches (in real time: within a minute / scale).
	held := func(report bool) bool {
		any := false
		for _, side := range []*simEngine{p, d} {
			for _, stage := range side.workers {
				for _, w := range stage {
					st, err := w.State()
					if err != nil {
						t.Fatal(err)
					}
					st.Engines, st.Tombstones, st.Wakeups = 0, 0, 0
					if st != (kvxfer.WorkerState{}) {
						any = true
						if report {
							t.Errorf("%s worker holds state after every request ended: %+v", side.id, st)
						}
					}
				}
			}
		}
		return any
	}
	if real {
		for end := time.Now().Add(time.Minute / scale); held(false) && time.Now().Before(end); {
			time.Sleep(10 * time.Millisecond)
		}
	} else {
		time.Sleep(time.Minute)
		settle()
	}
	held(true)
	counts := map[string]int{}
	for _, q := range order {
		for _, r := range q.pOutcomes {
			counts["P "+r.String()]++
		}
		for _, r := range q.dOutcomes {
			counts["D "+r.String()]++
		}
	}
	t.Logf("%d requests; outcomes %v", len(order), counts)
}

// poolsHave reports whether every group of p has more than n free blocks.
func poolsHave(p *blockPool, n int) bool {
	for _, f := range p.free {
		if len(f) <= n {
			return false
		}
	}
	return true
}

// unclip returns to p the blocks it handed out since its free lists were
// was (taken from their front) that spans do not hold.
func unclip(p *blockPool, was [][]topology.BlockID, spans []topology.Span) {
	for g, s := range spans {
		for _, id := range was[g][:len(was[g])-len(p.free[g])] {
			if !slices.Contains(s.IDs, id) {
				p.free[g] = append(p.free[g], id)
			}
		}
	}
}

func allEnded(order []*chaosReq) bool {
	for _, q := range order {
		if !q.pFreed || !q.dFreed {
			return false
		}
	}
	return true
}

// blockRange returns the byte ranges of logical block id of group g on r.
func blockRanges(r *kvsim.Rank, g int, id topology.BlockID) [][2]uint64 {
	l := &r.Layout
	var out [][2]uint64
	for _, ri := range l.GroupList()[g].Regions {
		reg := &l.Regions[ri]
		ppl := uint64(l.PagesPerBlock())
		if reg.Kind == topology.KindMamba {
			ppl = 1
		}
		start := reg.Base + uint64(id)*ppl*uint64(reg.BlockLen)
		out = append(out, [2]uint64{start, ppl * uint64(reg.BlockLen)})
	}
	return out
}

func scribble(r *kvsim.Rank, g int, id topology.BlockID) {
	for _, br := range blockRanges(r, g, id) {
		b, _, err := r.Resolve(br[0], br[1])
		if err != nil {
			panic(err)
		}
		for i := range b {
			b[i] = sentinel
		}
	}
}

func holdsSentinel(r *kvsim.Rank, g int, id topology.BlockID) bool {
	for _, br := range blockRanges(r, g, id) {
		b, _, err := r.Resolve(br[0], br[1])
		if err != nil {
			panic(err)
		}
		for _, v := range b {
			if v != sentinel {
				return false
			}
		}
	}
	return true
}
