package kvxfer_test

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"slices"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

const (
	fa  = topology.KindFullAttention
	swa = topology.KindSlidingWindow
	mla = topology.KindMLA
)

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// simEngine is one simulated engine: kvsim ranks whose memory is mapped
// into fake backend agents, with one Worker per rank.
type simEngine struct {
	id       string
	eng      kvsim.Engine
	ranks    [][]*kvsim.Rank
	agents   [][]*kvxfertest.Agent
	workers  [][]*kvxfer.Worker
	backends []kvxfer.Backend
}

func startEngine(t *testing.T, fab *kvxfertest.Fabric, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, tweak func(*kvxfer.WorkerConfig)) *simEngine {
	t.Helper()
	return startEngineOn(t, dir, m, e, id, mode, tweak, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		a, err := fab.NewAgent(name)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := a.Map(r.Base, r.Mem); err != nil {
			t.Fatal(err)
		}
		return a, a
	})
}

// startNetEngine runs an engine's ranks on the built-in TCP backend
// (loopback; the in-process direct copy turned off).
func startNetEngine(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, tweak func(*kvxfer.WorkerConfig)) *simEngine {
	t.Helper()
	return startEngineOn(t, dir, m, e, id, mode, tweak, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		return tcpBackend(t, name, r, tcp.Config{DisableLocal: true, Conns: 2}), nil
	})
}

// tcpBackend is a built-in backend for rank r of a test engine (c with a
// unique name and the quiet logger), its memory mapped, closed at the
// test's end.
func tcpBackend(t *testing.T, name string, r *kvsim.Rank, c tcp.Config) *tcp.Backend {
	t.Helper()
	c.Name, c.Logger = fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), quiet
	b, err := tcp.New(c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.Close() })
	if err := b.Map(r.Base, r.Mem); err != nil {
		t.Fatal(err)
	}
	return b
}

// startNixlEngine runs an engine's ranks on NIXL (UCX), with the ranks'
// layouts at the real addresses of their memory; it skips when NIXL is
// not available.
func startNixlEngine(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, cost kvxfer.PostCost, tweak func(*kvxfer.WorkerConfig)) *simEngine {
	t.Helper()
	return startEngineOn(t, dir, m, e, id, mode, tweak, func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent) {
		b, err := nixl.New(nixl.Config{Name: fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), Params: kvxfertest.NixlParams(), PostCost: cost})
		if errors.Is(err, nixl.ErrUnavailable) {
			t.Skipf("NIXL is not available here: %v", err)
		}
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = b.Close() })
		r.Rebase(uint64(uintptr(unsafe.Pointer(&r.Mem[0]))))
		if err := b.Map(r.Base, r.Mem); err != nil {
			t.Fatal(err)
		}
		return b, nil
	})
}

func startEngineOn(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string, mode kvxfer.Mode, tweak func(*kvxfer.WorkerConfig),
	backend func(name string, r *kvsim.Rank) (kvxfer.Backend, *kvxfertest.Agent)) *simEngine {
	t.Helper()
	ranks, err := kvsim.Build(m, &e)
	if err != nil {
		t.Fatal(err)
	}
	se := &simEngine{id: id, eng: e, ranks: ranks}
	for pp, stage := range ranks {
		se.agents = append(se.agents, nil)
		se.workers = append(se.workers, nil)
		for tp, r := range stage {
			be, fake := backend(fmt.Sprintf("%s/pp%d/tp%d", id, pp, tp), r)
			se.backends = append(se.backends, be)
			cfg := kvxfer.WorkerConfig{EngineID: id, Addr: id + ":1", Mode: mode, Layout: r.Layout, Backend: be,
				Resolver: dir, CompatHash: "model-x", Logger: quiet}
			if tweak != nil {
				tweak(&cfg)
			}
			w, err := kvxfer.NewWorker(cfg)
			if err != nil {
				t.Fatal(err)
			}
			meta, err := be.LocalMetadata()
			if err != nil {
				t.Fatal(err)
			}
			if err := dir.Publish(kvxfer.RankInfo{EngineID: id, CompatHash: "model-x", Layout: r.Layout, Agent: meta}); err != nil {
				t.Fatal(err)
			}
			se.agents[pp] = append(se.agents[pp], fake)
			se.workers[pp] = append(se.workers[pp], w)
		}
	}
	return se
}

// step hands every rank the same meta, as engines may (Step never
// modifies it).
func (se *simEngine) step(t *testing.T, meta *kvxfer.StepMeta) {
	t.Helper()
	for _, stage := range se.workers {
		for _, w := range stage {
			if err := w.Step(meta); err != nil {
				t.Errorf("Step: %v", err)
			}
		}
	}
}

func (se *simEngine) close(t *testing.T) {
	t.Helper()
	for _, stage := range se.workers {
		for _, w := range stage {
			if err := w.Close(); err != nil {
				t.Errorf("Close: %v", err)
			}
		}
	}
}

// outcomes collects Finished from every rank into per-request outcome
// lists, failing the test on a second report of a request by one rank.
type outcomes struct {
	send, recv map[string][]kvxfer.Outcome // by request id, one entry per rank report
	invalid    []topology.BlockID
	seen       map[string]bool // rank/side/id
}

func newOutcomes() *outcomes {
	return &outcomes{send: map[string][]kvxfer.Outcome{}, recv: map[string][]kvxfer.Outcome{}, seen: map[string]bool{}}
}

func (o *outcomes) collect(t *testing.T, se *simEngine) {
	t.Helper()
	for pp, stage := range se.workers {
		for tp, w := range stage {
			f := w.Finished()
			for _, x := range f.Sending {
				k := fmt.Sprintf("%s/%d/%d/send/%s", se.id, pp, tp, x.ReqID)
				if o.seen[k] {
					t.Errorf("%s reported twice", k)
				}
				o.seen[k] = true
				o.send[x.ReqID] = append(o.send[x.ReqID], x)
			}
			for _, x := range f.Recving {
				k := fmt.Sprintf("%s/%d/%d/recv/%s", se.id, pp, tp, x.ReqID)
				if o.seen[k] {
					t.Errorf("%s reported twice", k)
				}
				o.seen[k] = true
				o.recv[x.ReqID] = append(o.recv[x.ReqID], x)
			}
			o.invalid = append(o.invalid, f.InvalidBlocks...)
		}
	}
}

// blockPool hands out distinct block ids per group, fresh or shuffled.
type blockPool struct{ free [][]topology.BlockID }

func newPool(rng *rand.Rand, groups, blocks int, fragment bool) *blockPool {
	p := &blockPool{}
	for range groups {
		ids := make([]topology.BlockID, blocks)
		for i := range ids {
			ids[i] = topology.BlockID(i)
		}
		if fragment {
			rng.Shuffle(len(ids), func(i, j int) { ids[i], ids[j] = ids[j], ids[i] })
		}
		p.free = append(p.free, ids)
	}
	return p
}

func (p *blockPool) take(g, n int) []topology.BlockID {
	if n > len(p.free[g]) {
		panic(fmt.Sprintf("block pool group %d: %d left, want %d", g, len(p.free[g]), n))
	}
	ids := slices.Clone(p.free[g][:n])
	p.free[g] = p.free[g][n:]
	return ids
}

// xreq is one request of a test: its spans on both engines.
type xreq struct {
	id     string
	tokens int
	hit    int
	sim    kvsim.Request
}

// makeRequest allocates the blocks of a request with tokens tokens and a
// D prefix hit of hit tokens, clipping sliding-window groups.
func makeRequest(id string, tokens, hit int, groups []topology.Group, pe, de kvsim.Engine, pp, dp *blockPool) *xreq {
	r := &xreq{id: id, tokens: tokens, hit: hit, sim: kvsim.Request{Tokens: tokens}}
	for g, grp := range groups {
		pn := (tokens + pe.LogicalBlock - 1) / pe.LogicalBlock
		dn := 0
		if tokens > hit {
			dn = (tokens - hit + de.LogicalBlock - 1) / de.LogicalBlock
		}
		ps := topology.Span{IDs: pp.take(g, pn)}
		ds := topology.Span{Start: hit, IDs: dp.take(g, dn)}
		if grp.Kind == swa {
			var drop int
			ps.IDs, drop = topology.ClipWindow(ps.IDs, grp.Window, pe.LogicalBlock)
			ps.Start += drop * pe.LogicalBlock
			ds.IDs, drop = topology.ClipWindow(ds.IDs, grp.Window, de.LogicalBlock)
			ds.Start += drop * de.LogicalBlock
		}
		r.sim.P = append(r.sim.P, ps)
		r.sim.D = append(r.sim.D, ds)
	}
	return r
}

func (r *xreq) recv(mode kvxfer.Mode, p *simEngine, deadline time.Time) kvxfer.RecvReq {
	rr := kvxfer.RecvReq{ReqID: "d-" + r.id, TransferID: "t-" + r.id, Local: r.sim.D, Deadline: deadline,
		Remote: kvxfer.RemoteRef{EngineID: p.id, Addr: p.id + ":1", ReqID: "p-" + r.id, TPSize: p.eng.TP, PPSize: p.eng.PP, Tokens: r.tokens}}
	if r.tokens <= r.hit {
		rr.Local = nil
	}
	if mode == kvxfer.ModePull {
		rr.Remote.Blocks = r.sim.P
	}
	return rr
}

func (r *xreq) send(deadline time.Time) kvxfer.SendReq {
	return kvxfer.SendReq{ReqID: "p-" + r.id, TransferID: "t-" + r.id, Deadline: deadline, Blocks: r.sim.P, Tokens: r.tokens}
}

func newFabricDir() (*kvxfertest.Fabric, *kvxfertest.Directory) {
	return kvxfertest.NewFabric(), kvxfertest.NewDirectory()
}
