package main

import (
	"context"
	"math/rand/v2"
	"slices"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// simReq is one request of a run. The router sets the workload fields
// before dispatch; the P engine's goroutine owns the p* fields and the D
// engine's the d* fields; the run reads them all after both engines
// stopped.
type simReq struct {
	n              int // index in the run; n+1 is the pattern's salt
	id, tid        string
	prompt, output int
	hit            int // tokens D holds in its prefix cache
	arrive         time.Time

	// P side.
	pReq                     *kvxfer.Request
	pIDs                     []topology.BlockID
	pAdmit, pStart, pEnd     time.Time
	pResult                  kvxfer.Result
	pGot                     bool
	pReason                  string
	params                   *kvxfer.TransferParams // pull: P's params for D, set before D gets the request
	dReq                     *kvxfer.Request
	dIDs                     []topology.BlockID // D's new blocks (past the hit)
	landed                   time.Time          // the KV complete on every D rank, as reported to D's engine
	dAdmit, kvAt, first, end time.Time
	dResult                  kvxfer.Result
	dGot                     bool
	dReason                  string
	generated                int
	verified                 chan error // D's byte check, run off the engine's loop
	bad                      error
}

// allocator is an engine's free block queue: allocation takes from the
// head, a finished request's blocks go to the tail in reverse order (the
// order vLLM frees them), so the order of ids drifts from fresh
// (consecutive) toward fragmented as requests end out of order.
type allocator struct {
	free []topology.BlockID
}

func newAllocator(n int, shuffled bool, rng *rand.Rand) *allocator {
	a := &allocator{free: make([]topology.BlockID, n)}
	for i := range a.free {
		a.free[i] = topology.BlockID(i)
	}
	if shuffled {
		rng.Shuffle(n, func(i, j int) { a.free[i], a.free[j] = a.free[j], a.free[i] })
	}
	return a
}

func (a *allocator) alloc(n int) []topology.BlockID {
	if n > len(a.free) {
		return nil
	}
	ids := slices.Clone(a.free[:n])
	a.free = a.free[n:]
	if cap(a.free) > 4*len(a.free)+1024 { // let the consumed head go
		a.free = slices.Clone(a.free)
	}
	return ids
}

func (a *allocator) release(ids []topology.BlockID) {
	for i := len(ids) - 1; i >= 0; i-- {
		a.free = append(a.free, ids[i])
	}
}

type rankFin struct {
	rank int
	f    kvxfer.Finished
	at   time.Time // when the rank's report reached the engine
}

// engine is a simulated engine: an attached simengine (TP ranks whose KV
// caches live in shared memory, their streams to a kvxferd, a
// kvxfer.Scheduler and an Aggregator), a block allocator and a step loop
// that sleeps for the time model's compute.
type engine struct {
	id      string
	tp      int
	se      *simengine.Engine // nil in the baseline: no kvxfer
	blocks  *allocator
	fin     chan rankFin
	inbox   chan *simReq
	kvReady chan *simReq // baseline, D: P's prefill ended
	wg      sync.WaitGroup

	// Loop state (the engine's goroutine).
	waiting  []*simReq
	byID     map[string]*simReq
	needStep bool // the scheduler staged metadata for the next step
	finBuf   []rankFin
	readyBuf []*simReq
	landed   map[string]time.Time // D: when the last rank's report of a request's KV arrived
	modelled time.Duration        // compute time the model asked for
	overrun  time.Duration        // how much longer the steps took
}

func newEngine(r *run, dm *daemontest.Proc, id string, tp int, e kvsim.Engine, layerwise bool, rng *rand.Rand) (*engine, error) {
	en := &engine{id: id, tp: tp, byID: map[string]*simReq{}, landed: map[string]time.Time{},
		fin: make(chan rankFin, 64*tp), inbox: make(chan *simReq, 4096), kvReady: make(chan *simReq, 4096),
		blocks: newAllocator(e.Blocks, r.shape.Frag, rng)}
	if r.mode == modeBaseline {
		return en, nil // no kvxfer: P tells D directly
	}
	se, err := simengine.Attach(simengine.Config{Dir: r.dir, Sock: dm.Sock, Peer: dm.Peer, ID: id, Model: &r.model, Engine: e,
		Mode: r.kvMode(), Layerwise: layerwise, Version: "kvxfer-pdsim"})
	if err != nil {
		return nil, err
	}
	en.se = se
	for rank, rs := range se.Streams {
		en.wg.Add(1)
		go func() {
			defer en.wg.Done()
			for f := range rs.Finished() {
				en.fin <- rankFin{rank, f, time.Now()}
			}
		}()
	}
	return en, nil
}

// step builds the scheduler's metadata and hands it to every rank.
func (en *engine) step() (uint64, error) {
	if en.se == nil {
		return 0, nil
	}
	meta := en.se.Sched.BuildMeta()
	en.needStep = false
	return meta.Step, en.se.Step(meta)
}

// fold adds one rank's finished set; it returns the engine-wide outcomes
// once every rank reported them.
func (en *engine) fold(rf rankFin) (*kvxfer.Finished, error) {
	out, err := en.se.Fold(rf.rank, &rf.f)
	if out != nil {
		for _, o := range out.Recving {
			en.landed[o.ReqID] = rf.at // reports fold in arrival order: this one completed it
		}
	}
	return out, err
}

// close says bye on every rank (kvxferd reports what is left and
// detaches) and removes the engine's shared memory.
func (en *engine) close() {
	if en.se == nil {
		return
	}
	quit := make(chan struct{})
	go func() { // the forwarders end with the streams
		for {
			select {
			case <-en.fin:
			case <-quit:
				return
			}
		}
	}()
	_ = en.se.Close()
	en.wg.Wait()
	close(quit)
}

func (en *engine) stepErrors() error {
	if en.se == nil {
		return nil
	}
	return en.se.StepError()
}

// sleepUntil waits for t or ctx.
func sleepUntil(ctx context.Context, t time.Time) error {
	d := time.Until(t)
	if d <= 0 {
		return ctx.Err()
	}
	tm := time.NewTimer(d)
	defer tm.Stop()
	select {
	case <-tm.C:
		return nil
	case <-ctx.Done():
		return ctx.Err()
	}
}

// lag records a step that the time model gave want and that took got.
func (en *engine) lag(want, got time.Duration) {
	en.modelled += want
	en.overrun += max(0, got-want)
}
