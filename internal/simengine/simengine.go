// Package simengine attaches a simulated inference engine to a kvxferd:
// one kvsim rank per TP rank, its KV cache a shared-memory file the
// daemon maps, a kvxfer.v1 stream per rank, and the engine-side
// kvxfer.Scheduler and Aggregator. The demo (cmd/kvxfer-demo) and the P/D
// simulator (bench/pdsim) build their engines on it; what they do with
// the engine (step loops, allocators, verification) is theirs.
package simengine

import (
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
)

// Config is one engine to attach.
type Config struct {
	// Dir holds the ranks' shared-memory files (named <ID>-tp<rank>).
	Dir string
	// Sock is the kvxferd's engine socket (a unix socket path); Peer the
	// address of its Peer service, which D hands to P in push mode.
	Sock, Peer string
	// ID is the engine id, unique among the engines a daemon serves.
	ID     string
	Model  *kvsim.Model
	Engine kvsim.Engine
	Mode   kvxfer.Mode
	// Layerwise makes a push producer WRITE each layer as it is saved.
	Layerwise bool
	// Version is the engine version that goes into the compatibility
	// hash; both ends of a transfer must agree on it.
	Version string
	// ResolveByID lets transfer params name a producer without an
	// address (its daemon's -etcd registry finds it).
	ResolveByID bool
	// RankSocks, when set, holds one engine socket per rank: rank i
	// attaches to RankSocks[i] instead of Sock (the in-process placement,
	// where each rank's server is its own, on -rank-port-base + i).
	RankSocks []string
	// Lease is how long the engine's scheduler has a producer hold a
	// finished request's blocks for its consumer (0: the scheduler's
	// default, 30 s).
	Lease time.Duration
}

// Engine is an attached engine. Its fields are for the engine's own loop;
// Step, LayerSaved and StepError may be called from one goroutine at a
// time.
type Engine struct {
	ID      string
	Ranks   []*kvsim.Rank
	Streams []*stream.RankStream
	Sched   *kvxfer.Scheduler
	agg     *kvxfer.Aggregator
	maps    []*shm.Mapping
	clients []*stream.Client
}

// attachTimeout bounds each rank's Connect (hello and handshake with the
// daemon).
const attachTimeout = 20 * time.Second

// Attach builds the engine's ranks, puts each rank's KV cache in a
// shared-memory file filled with a scrambled pattern, and connects every
// rank to the daemon. On error everything attached so far is closed.
func Attach(cfg Config) (*Engine, error) {
	ranks, err := kvsim.Build(cfg.Model, &cfg.Engine)
	if err != nil {
		return nil, err
	}
	if len(ranks) != 1 {
		return nil, fmt.Errorf("engine %s: pipeline parallel size %d, want 1", cfg.ID, len(ranks))
	}
	e := &Engine{ID: cfg.ID, Ranks: ranks[0]}
	if err := e.attach(&cfg); err != nil {
		e.Close()
		return nil, err
	}
	return e, nil
}

func (e *Engine) attach(cfg *Config) error {
	var err error
	if cfg.RankSocks != nil && len(cfg.RankSocks) != len(e.Ranks) {
		return fmt.Errorf("engine %s: %d rank sockets for %d ranks", cfg.ID, len(cfg.RankSocks), len(e.Ranks))
	}
	m := cfg.Model
	hash := kvxfer.CompatHash(kvxfer.CompatFactors{EngineVersion: cfg.Version, Model: "kvxfer-sim", Dtype: "bf16",
		NumKVHeads: m.TotalKVHeads, HeadSize: m.HeadSize, NumHiddenLayers: len(m.Kinds), Mode: cfg.Mode})
	for rank, kr := range e.Ranks {
		name := fmt.Sprintf("%s-tp%d", cfg.ID, rank)
		mp, err := shm.Create(cfg.Dir, name, uint64(len(kr.Mem)))
		if err != nil {
			return err
		}
		e.maps = append(e.maps, mp)
		kr.Mem = mp.Bytes
		kr.Scramble(uint64(rank + 1))
		sock := cfg.Sock
		if cfg.RankSocks != nil {
			sock = cfg.RankSocks[rank]
		}
		if rank == 0 || cfg.RankSocks != nil {
			c, err := stream.Dial("unix://" + sock)
			if err != nil {
				return err
			}
			e.clients = append(e.clients, c)
		}
		ctx, cancel := context.WithTimeout(context.Background(), attachTimeout)
		rs, err := e.clients[len(e.clients)-1].Connect(ctx, stream.Hello{EngineID: cfg.ID, Mode: cfg.Mode, Layout: kr.Layout, CompatHash: hash,
			Layerwise: cfg.Layerwise, Memory: []stream.Memory{{Path: filepath.Join(cfg.Dir, name), Base: kr.Base, Size: uint64(len(kr.Mem))}}})
		cancel()
		if err != nil {
			return fmt.Errorf("attach %s rank %d: %w", cfg.ID, rank, err)
		}
		e.Streams = append(e.Streams, rs)
	}
	if e.Sched, err = kvxfer.NewScheduler(kvxfer.SchedulerConfig{EngineID: cfg.ID, Addr: cfg.Peer, Mode: cfg.Mode, Layerwise: cfg.Layerwise, ResolveByID: cfg.ResolveByID, Lease: cfg.Lease,
		TPSize: cfg.Engine.TP, LogicalBlockSize: cfg.Engine.LogicalBlock, Groups: e.Ranks[0].Layout.GroupList()}); err != nil {
		return err
	}
	e.agg, err = kvxfer.NewAggregator(cfg.Engine.TP)
	return err
}

// Step hands the step's metadata to every rank.
func (e *Engine) Step(meta *kvxfer.StepMeta) error {
	for i, rs := range e.Streams {
		if err := rs.Step(meta); err != nil {
			return fmt.Errorf("%s rank %d: step: %w", e.ID, i, err)
		}
	}
	return nil
}

// LayerSaved reports a layer of a step saved on every rank.
func (e *Engine) LayerSaved(step uint64, layer int) error {
	for i, rs := range e.Streams {
		if err := rs.LayerSaved(step, layer); err != nil {
			return fmt.Errorf("%s rank %d: layer saved: %w", e.ID, i, err)
		}
	}
	return nil
}

// StepError returns the first step a daemon rejected since the last call
// (an engine bug: the metadata did not validate), or nil.
func (e *Engine) StepError() error {
	for i, rs := range e.Streams {
		select {
		case msg := <-rs.StepErrors():
			return fmt.Errorf("%s rank %d: step rejected: %s", e.ID, i, msg)
		default:
		}
	}
	return nil
}

// Fold adds one rank's finished sets and returns the engine-wide outcomes
// once every rank reported them (nil until then), after handing them to
// the scheduler.
func (e *Engine) Fold(rank int, f *kvxfer.Finished) (*kvxfer.Finished, error) {
	out, err := e.agg.Add(rank, f)
	if err != nil || out == nil {
		return nil, err
	}
	e.Sched.Update(out)
	return out, nil
}

// Crash drops every rank's stream without a bye, as an engine process
// that dies does (its connections close at once), and unmaps its memory
// files, which stay: the daemon still maps them until it has let the
// ranks go, and an engine that restarts removes them first.
func (e *Engine) Crash() error {
	var errs []error
	for _, c := range e.clients {
		if err := c.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, m := range e.maps {
		if err := m.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Close says bye on every rank at once, as an engine's rank processes
// do (the daemon reports what is left and detaches it; those last
// reports are discarded), closes the connection and removes the shared
// memory. The ranks' Finished channels are closed when it returns. (One
// rank after another, a pull producer's TP 2 engine took twice as long
// to go: each rank's bye waits for what its consumers still read.)
func (e *Engine) Close() error {
	errs := make([]error, len(e.Streams))
	var wg sync.WaitGroup
	for i, rs := range e.Streams {
		go func() {
			for range rs.Finished() {
			}
		}()
		wg.Add(1)
		go func() {
			defer wg.Done()
			ctx, cancel := context.WithTimeout(context.Background(), attachTimeout)
			defer cancel()
			errs[i] = rs.Close(ctx)
		}()
	}
	wg.Wait()
	for _, c := range e.clients {
		if err := c.Close(); err != nil {
			errs = append(errs, err)
		}
	}
	for _, m := range e.maps {
		if err := m.Remove(); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}
