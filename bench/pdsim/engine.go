package main

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/shm"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
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
}

// engine is a simulated engine: TP ranks whose KV caches live in shared
// memory attached to a kvxferd, a kvxfer.Scheduler, an Aggregator, a
// block allocator and a step loop that sleeps for the time model's
// compute.
type engine struct {
	id      string
	run     *run
	tp      int
	ranks   []*kvsim.Rank
	streams []*stream.RankStream
	maps    []*shm.Mapping
	client  *stream.Client
	sched   *kvxfer.Scheduler
	agg     *kvxfer.Aggregator
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
	modelled time.Duration // compute time the model asked for
	overrun  time.Duration // how much longer the steps took
}

func newEngine(r *run, dm *daemon.Proc, id string, tp int, e kvsim.Engine, layerwise bool, rng *rand.Rand) (*engine, error) {
	ranks, err := kvsim.Build(&r.model, &e)
	if err != nil {
		return nil, err
	}
	en := &engine{id: id, run: r, tp: tp, ranks: ranks[0], byID: map[string]*simReq{},
		fin: make(chan rankFin, 64*tp), inbox: make(chan *simReq, 4096), kvReady: make(chan *simReq, 4096),
		blocks: newAllocator(e.Blocks, r.shape.Frag, rng)}
	if r.mode == modeBaseline {
		return en, nil // no kvxfer: P tells D directly
	}
	if en.client, err = stream.Dial("unix://" + dm.Sock); err != nil {
		return en, err
	}
	hash := kvxfer.CompatHash(kvxfer.CompatFactors{EngineVersion: "kvxfer-pdsim", Model: "pdsim", Dtype: "bf16",
		NumKVHeads: r.model.TotalKVHeads, HeadSize: r.model.HeadSize, NumHiddenLayers: len(r.model.Kinds), Mode: r.kvMode()})
	for rank, kr := range en.ranks {
		name := fmt.Sprintf("%s-tp%d", id, rank)
		mp, err := shm.Create(r.dir, name, uint64(len(kr.Mem)))
		if err != nil {
			return en, err
		}
		en.maps = append(en.maps, mp)
		kr.Mem = mp.Bytes
		kr.Scramble(uint64(rank + 1))
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		rs, err := en.client.Connect(ctx, stream.Hello{EngineID: id, Mode: r.kvMode(), Layout: kr.Layout, CompatHash: hash, Layerwise: layerwise,
			Memory: []stream.Memory{{Path: filepath.Join(r.dir, name), Base: kr.Base, Size: uint64(len(kr.Mem))}}})
		cancel()
		if err != nil {
			return en, fmt.Errorf("attach %s rank %d: %w", id, rank, err)
		}
		en.streams = append(en.streams, rs)
		en.wg.Add(1)
		go func() {
			defer en.wg.Done()
			for f := range rs.Finished() {
				en.fin <- rankFin{rank, f}
			}
		}()
	}
	if en.sched, err = kvxfer.NewScheduler(kvxfer.SchedulerConfig{EngineID: id, Addr: dm.Peer, Mode: r.kvMode(), TPSize: tp,
		LogicalBlockSize: r.block, Groups: en.ranks[0].Layout.GroupList()}); err != nil {
		return en, err
	}
	en.agg, err = kvxfer.NewAggregator(tp)
	return en, err
}

// step builds the scheduler's metadata (plus prefill, for layer-wise
// push) and hands it to every rank.
func (en *engine) step(prefill []kvxfer.SendReq) (uint64, error) {
	if en.sched == nil {
		return 0, nil
	}
	meta := en.sched.BuildMeta()
	meta.Prefill = prefill
	en.needStep = false
	for i, rs := range en.streams {
		if err := rs.Step(meta); err != nil {
			return 0, fmt.Errorf("%s rank %d: step: %w", en.id, i, err)
		}
	}
	return meta.Step, nil
}

// layerSaved reports a layer saved on every rank.
func (en *engine) layerSaved(step uint64, layer int) error {
	for i, rs := range en.streams {
		if err := rs.LayerSaved(step, layer); err != nil {
			return fmt.Errorf("%s rank %d: layer saved: %w", en.id, i, err)
		}
	}
	return nil
}

// fold adds one rank's finished set; it returns the engine-wide outcomes
// once every rank reported them.
func (en *engine) fold(rf rankFin) (*kvxfer.Finished, error) {
	out, err := en.agg.Add(rf.rank, &rf.f)
	if err != nil || out == nil {
		return nil, err
	}
	en.sched.Update(out)
	return out, nil
}

func (en *engine) stepErrors() error {
	for i, rs := range en.streams {
		select {
		case msg := <-rs.StepErrors():
			return fmt.Errorf("%s rank %d: step rejected: %s", en.id, i, msg)
		default:
		}
	}
	return nil
}

// close says bye on every rank (kvxferd reports what is left and
// detaches) and removes the engine's shared memory.
func (en *engine) close() {
	for _, rs := range en.streams {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		_ = rs.Close(ctx)
		cancel()
	}
	go func() { // the forwarders end with the streams
		for range en.fin {
		}
	}()
	en.wg.Wait()
	close(en.fin)
	if en.client != nil {
		_ = en.client.Close()
	}
	for _, m := range en.maps {
		_ = os.Remove(m.Path)
		_ = m.Close()
	}
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

func (en *engine) lagFraction() float64 {
	if en.modelled <= 0 {
		return 0
	}
	return float64(en.overrun) / float64(en.modelled)
}
