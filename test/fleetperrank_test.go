package test

import (
	"context"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/internal/testport"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// portRun returns the first of n consecutive loopback ports nothing
// listens on now, below the ephemeral range.
func portRun(t *testing.T, n int) int {
	t.Helper()
	return testport.Run(t, n)
}

// startPerRank runs one kvxferd per rank of a TP-tp engine, the in-process
// placement's scheme: rank i's server on -rank-port-base + i, each in the
// registry on its own.
func startPerRank(t *testing.T, dir, name string, base, tp int, extra ...string) []*daemontest.Proc {
	t.Helper()
	var ps []*daemontest.Proc
	for i := range tp {
		ps = append(ps, startRank(t, dir, name, base, i, extra...))
	}
	return ps
}

func startRank(t *testing.T, dir, name string, base, rank int, extra ...string) *daemontest.Proc {
	t.Helper()
	args := append([]string{"-peer-listen", fmt.Sprintf("127.0.0.1:%d", base+rank), "-rank-port-base", strconv.Itoa(base)}, extra...)
	return startDaemon(t, dir, fmt.Sprintf("%s-rank%d-%d", name, rank, time.Now().UnixNano()), args...)
}

// attachPerRank attaches a TP-len(ps) push producer, rank i to ps[i].
func attachPerRank(t *testing.T, dir string, ps []*daemontest.Proc, id string) *simengine.Engine {
	t.Helper()
	m := simModel
	var socks []string
	for _, p := range ps {
		socks = append(socks, p.Sock)
	}
	e, err := simengine.Attach(simengine.Config{Dir: dir, RankSocks: socks, Peer: ps[0].Peer, ID: id, Model: &m, Engine: simEngine(1, len(ps)),
		Mode: kvxfer.ModePush, Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// entriesOf waits until the registry holds n entries of engine, none of
// the generations in not, and returns them.
func entriesOf(t *testing.T, ep, engine string, n int, not map[uint64]bool, within time.Duration) []registry.Entry {
	t.Helper()
	cl, err := registry.Dial(registry.ClientConfig{Endpoints: ep})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	var got []registry.Entry
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := cl.Get(ctx, registry.EnginesPrefix("/kvxfer")+engine+"/", clientv3.WithPrefix())
		cancel()
		if err != nil {
			continue
		}
		got = got[:0]
		for _, kv := range resp.Kvs {
			if e, err := registry.Decode("/kvxfer", string(kv.Key), kv.Value); err == nil && !not[e.Generation] {
				got = append(got, e)
			}
		}
		if len(got) == n && len(resp.Kvs) == n {
			return got
		}
	}
	t.Fatalf("engine %s: %d entries in the registry (%+v), want %d within %v", engine, len(got), got, n, within)
	return nil
}

// registerPerRank is registerD for a producer of TP 2 named by its id
// alone.
func registerPerRank(t *testing.T, D *simengine.Engine, id, tid string, ids []topology.BlockID) {
	t.Helper()
	req := &kvxfer.Request{ID: id, PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: tid, DoRemotePrefill: true,
		RemoteEngineID: "P", RemoteTPSize: 2}}
	ext, _ := D.Sched.MatchedTokens(req, 0)
	if err := D.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}, External: ext}); err != nil {
		t.Fatal(err)
	}
	if err := D.Step(D.Sched.BuildMeta()); err != nil {
		t.Fatal(err)
	}
}

// transferPerRank moves one request's KV from the per-rank producer P to
// D, found through the registry, and checks both outcomes and the bytes.
func transferPerRank(t *testing.T, P, D *simengine.Engine, id string, ids []topology.BlockID, when string) {
	t.Helper()
	tid := "t-" + id
	registerPerRank(t, D, "d-"+id, tid, ids)
	for _, r := range P.Ranks[1:] {
		r.FillSalt([]topology.Span{{IDs: ids}}, salt(tid))
	}
	finishP(t, P, "p-"+id, tid, ids) // fills rank 0
	pOut := make(chan kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P, 15*time.Second, "p-"+id)["p-"+id] }()
	if o := outcomesOf(t, D, 15*time.Second, "d-"+id)["d-"+id]; o.Result != kvxfer.ResultDone {
		t.Fatalf("%s: D's request %+v, want done", when, o)
	}
	wantBytes(t, D, tid, ids)
	if o := <-pOut; o.Result != kvxfer.ResultDone {
		t.Errorf("%s: P's request %+v, want done", when, o)
	}
}

// A producer in the in-process placement: its two ranks served each by
// its own server (-rank-port-base), each publishing its own one-rank
// entry. D names P by its id alone and finds both ranks through the
// registry. With D's probes off (-peer-timeout -1s), P's rank 0 server is
// SIGKILLed while D's requests wait on P: once its lease ends, each ends
// peer_gone naming the registry, though rank 1's entry stays (and was
// the one etcd created last). Before, the registry looked at an engine's
// entry created last alone: the rank-0 entry going changed nothing, and
// D's requests waited on a rank that was gone. P then comes back (a new
// generation for each rank) and the next request is done.
func TestRegistryPerRankProducer(t *testing.T) {
	etcd := etcdtest.Start(t)
	ep := etcd.Endpoint()
	dir := world(t)
	base := portRun(t, 2)
	flags := []string{"-etcd", ep, "-etcd-role", "producer", "-etcd-ttl", "2s"}
	pMetrics := []string{freeAddr(t), freeAddr(t)}
	var ps []*daemontest.Proc
	for i, m := range pMetrics {
		ps = append(ps, startRank(t, dir, "P", base, i, append(slices.Clip(flags), "-metrics-listen", m)...))
	}
	d := startDaemon(t, dir, "D", "-etcd", ep, "-etcd-role", "consumer", "-peer-timeout", "-1s")
	P := attachPerRank(t, dir, ps, "P")
	D := attachByID(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	old := map[uint64]bool{}
	for _, e := range entriesOf(t, ep, "P", 2, nil, 10*time.Second) {
		old[e.Generation] = true
		if len(e.Ranks) != 1 || e.TPSize != 2 {
			t.Fatalf("a per-rank server's entry %+v, want one rank of TP 2", e)
		}
	}
	transferPerRank(t, P, D, "first", []topology.BlockID{0, 1}, "P's ranks resolved through the registry")

	var dIDs []string
	for i := range 3 {
		id := fmt.Sprintf("w%d", i)
		registerPerRank(t, D, "d-"+id, "t-"+id, []topology.BlockID{topology.BlockID(2 + 2*i), topology.BlockID(3 + 2*i)})
		dIDs = append(dIDs, "d-"+id)
	}
	regsReachP(t, 3, 10*time.Second, scrapeOf(t, pMetrics[0])) // rank 0's, which the kill must find there
	_ = ps[0].Kill()
	killed := time.Now()
	got := outcomesOf(t, D, 15*time.Second, dIDs...)
	for _, id := range dIDs {
		o, ok := got[id]
		if !ok {
			t.Fatalf("%s: no outcome 15 s after P's rank 0 server was killed (probes off: only the registry can tell)", id)
		}
		if o.Result != kvxfer.ResultFailed || o.Kind != kvxfer.FailurePeerGone || !strings.Contains(o.Reason, "registry") {
			t.Errorf("%s: %+v, want failed (peer_gone) naming the registry", id, o)
		}
	}
	t.Logf("P's rank 0 server SIGKILLed, probes off, lease TTL 2s: D's %d waiting requests ended %v after the kill", len(dIDs), time.Since(killed).Round(time.Millisecond))
	P.Close()

	// P comes back: rank 0's server on its port again, the engine
	// attached anew (each rank a new generation).
	_ = ps[1].Kill()
	ps = startPerRank(t, dir, "P2", base, 2, flags...)
	P = attachPerRank(t, dir, ps, "P")
	defer P.Close()
	entriesOf(t, ep, "P", 2, old, 10*time.Second)
	transferPerRank(t, P, D, "rejoined", []topology.BlockID{10, 11}, "after P came back")
}
