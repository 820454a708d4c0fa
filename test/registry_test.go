package test

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// attachByID is attachSim for an engine whose transfer params may name
// a producer by its id alone (its daemon runs with -etcd).
func attachByID(t *testing.T, dir, sock, peer, id string, eng int, mode kvxfer.Mode) *simengine.Engine {
	t.Helper()
	m := simModel
	e, err := simengine.Attach(simengine.Config{Dir: dir, Sock: sock, Peer: peer, ID: id, Model: &m, Engine: simEngine(eng, 1),
		Mode: mode, Version: "test", ResolveByID: true})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// inView waits until the registry lists engine at generation other than
// not (0: any), and returns its entry.
func inView(t *testing.T, ep, engine string, not uint64, within time.Duration) registry.Entry {
	t.Helper()
	cl, err := registry.Dial(registry.ClientConfig{Endpoints: ep})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	for deadline := time.Now().Add(within); time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		resp, err := cl.Get(ctx, registry.EnginesPrefix("/kvxfer")+engine+"/", clientv3.WithPrefix())
		cancel()
		if err != nil {
			continue
		}
		for _, kv := range resp.Kvs {
			if e, err := registry.Decode("/kvxfer", string(kv.Key), kv.Value); err == nil && e.Generation != not {
				return e
			}
		}
	}
	t.Fatalf("engine %s (generation other than %d) not in the registry within %v", engine, not, within)
	return registry.Entry{}
}

// A fleet on etcd: D's daemon resolves P by its id (no address in the
// params), and with D's probes off (-peer-timeout -1s) learns of P's
// death from the registry alone: P's daemon SIGKILLed, every D request
// waiting on it ends peer_gone once P's lease (the default, 5 s) ends.
// P comes back (a new generation, a rejoin) and serves the next request.
// The times are logged (bench/RESULTS.md).
func TestRegistryProducerKilledAndRejoins(t *testing.T) {
	etcd := etcdtest.Start(t)
	dir := world(t)
	pAddr, pMetrics := freeAddr(t), freeAddr(t)
	p := startDaemon(t, dir, "P", "-peer-listen", pAddr, "-etcd", etcd.Endpoint(), "-etcd-role", "producer", "-metrics-listen", pMetrics)
	d := startDaemon(t, dir, "D", "-etcd", etcd.Endpoint(), "-etcd-role", "consumer", "-peer-timeout", "-1s")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	D := attachByID(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	gen := inView(t, etcd.Endpoint(), "P", 0, 10*time.Second).Generation
	transferOnce(t, P, D, "", "first", []topology.BlockID{0, 1}, 10*time.Second, "P resolved through the registry")

	var dIDs []string
	for i := range 3 {
		id := fmt.Sprintf("w%d", i)
		registerD(t, D, "d-"+id, "t-"+id, "", []topology.BlockID{topology.BlockID(2 + 2*i), topology.BlockID(3 + 2*i)})
		dIDs = append(dIDs, "d-"+id)
	}
	regsReachP(t, 3, 10*time.Second, scrapeOf(t, pMetrics))
	_ = p.Kill()
	killed := time.Now()
	P.Close()
	got := outcomesOf(t, D, 15*time.Second, dIDs...)
	took := time.Since(killed)
	for _, id := range dIDs {
		o, ok := got[id]
		if !ok {
			t.Fatalf("%s: no outcome 15 s after P's daemon was killed (probes off: only the registry can tell)", id)
		}
		if o.Result != kvxfer.ResultFailed || o.Kind != kvxfer.FailurePeerGone || !strings.Contains(o.Reason, "registry") {
			t.Errorf("%s: %+v, want failed (peer_gone) naming the registry", id, o)
		}
	}
	t.Logf("producer SIGKILLed, probes off, lease TTL 5s: D's %d waiting requests ended %v after the kill", len(dIDs), took.Round(time.Millisecond))

	p = startDaemon(t, dir, "P2", "-peer-listen", pAddr, "-etcd", etcd.Endpoint(), "-etcd-role", "producer")
	P = attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	back := time.Now()
	inView(t, etcd.Endpoint(), "P", gen, 10*time.Second)
	transferOnce(t, P, D, "", "rejoined", []topology.BlockID{10, 11}, 10*time.Second, "after P rejoined")
	t.Logf("P rejoined (new generation): a request through the registry was done %v after its engine attached", time.Since(back).Round(time.Millisecond))
}

// A forged registry entry (engine X at a daemon that does not share the
// fleet's secret: anyone's) cannot redirect D's KV: the handshake with it
// is refused, D's request fails, nothing moves.
func TestRegistryForgedEntryRefusedAtHandshake(t *testing.T) {
	etcd := etcdtest.Start(t)
	dir := world(t)
	rogue := startDaemon(t, dir, "rogue", "-insecure-peers")
	R := attachSim(t, dir, rogue.Sock, rogue.Peer, "X", 1, kvxfer.ModePush)
	defer R.Close()
	d := startDaemon(t, dir, "D", "-etcd", etcd.Endpoint())
	D := attachByID(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	cl, err := registry.Dial(registry.ClientConfig{Endpoints: etcd.Endpoint()})
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	e := registry.Entry{EngineID: "X", Role: registry.RoleProducer, Mode: "push", TPSize: 1, PPSize: 1,
		Ranks: []registry.Rank{{Peer: rogue.Peer}}, Generation: 1}
	key := registry.Key("/kvxfer", "X", rogue.Peer)
	v, err := e.Encode(key)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, err := cl.Put(ctx, key, string(v)); err != nil {
		t.Fatal(err)
	}
	time.Sleep(500 * time.Millisecond) // D's view has it
	req := &kvxfer.Request{ID: "d-x", PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: "t-x", DoRemotePrefill: true,
		RemoteEngineID: "X", RemoteTPSize: 1}}
	ext, _ := D.Sched.MatchedTokens(req, 0)
	if err := D.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{{0, 1}}, External: ext}); err != nil {
		t.Fatal(err)
	}
	if err := D.Step(D.Sched.BuildMeta()); err != nil {
		t.Fatal(err)
	}
	o, ok := outcomesOf(t, D, 15*time.Second, "d-x")["d-x"]
	if !ok || o.Result != kvxfer.ResultFailed || !strings.Contains(o.Reason, "handshake") {
		t.Fatalf("D's request for the forged engine: %+v (reported %v), want failed at the handshake", o, ok)
	}
	t.Logf("forged entry: %s: %s", o.Kind, o.Reason)
}

// etcd goes down and comes back: nothing in flight breaks. D resolves P
// from its last view meanwhile, the daemons count and log their failed
// calls to etcd, and once etcd is back they are registered again and
// requests resolved by id carry on.
func TestRegistryEtcdDownKeepsServing(t *testing.T) {
	etcd := etcdtest.Start(t)
	dir := world(t)
	pMetrics, dMetrics := freeAddr(t), freeAddr(t)
	p := startDaemon(t, dir, "P", "-etcd", etcd.Endpoint(), "-etcd-ttl", "2s", "-metrics-listen", pMetrics)
	d := startDaemon(t, dir, "D", "-etcd", etcd.Endpoint(), "-etcd-ttl", "2s", "-metrics-listen", dMetrics)
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	D := attachByID(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	inView(t, etcd.Endpoint(), "P", 0, 10*time.Second)
	transferOnce(t, P, D, "", "before", []topology.BlockID{0, 1}, 10*time.Second, "etcd up")
	etcd.Kill()
	transferOnce(t, P, D, "", "down", []topology.BlockID{2, 3}, 10*time.Second, "etcd down: D's last view")
	// Past the TTL: P's daemon finds its lease lost (no keepalive answered
	// for a TTL, seen within the client's half-second checks). Waited for,
	// within three TTLs and slack, not slept for: 3 s left half a second
	// past that on an idle machine.
	for deadline := time.Now().Add(3*2*time.Second + 5*time.Second); ; time.Sleep(50 * time.Millisecond) {
		m := metricsOf(t, pMetrics)
		if m["kvxfer_registry_errors_total"] > 0 && m["kvxfer_registry_registered"] == 0 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("P's daemon with etcd down for 11 s: errors %v, registered %v; want errors counted, not registered",
				m["kvxfer_registry_errors_total"], m["kvxfer_registry_registered"])
		}
	}
	transferOnce(t, P, D, "", "down-long", []topology.BlockID{4, 5}, 10*time.Second, "etcd down for longer than the TTL")
	etcd.Restart()
	for deadline := time.Now().Add(10 * time.Second); metricsOf(t, pMetrics)["kvxfer_registry_registered"] != 1; time.Sleep(50 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("P's daemon not registered again 10 s after etcd came back")
		}
	}
	inView(t, etcd.Endpoint(), "P", 0, 10*time.Second)
	transferOnce(t, P, D, "", "after", []topology.BlockID{6, 7}, 10*time.Second, "etcd back")
}

// An engine whose entry cannot be published (its id has a space: no key
// may hold it) costs only its own entry: the daemon's other engines are
// published, and their changes too, and the refused one is logged and
// counted by field. Before, the daemon published all of its entries or
// none: one such engine kept every other engine it served out of the
// registry (or, attached after them, froze their entries at what they
// were).
func TestRegistryUnpublishableEngineSparesTheOthers(t *testing.T) {
	etcd := etcdtest.Start(t)
	dir := world(t)
	pMetrics := freeAddr(t)
	p := startDaemon(t, dir, "P", "-etcd", etcd.Endpoint(), "-etcd-role", "producer", "-metrics-listen", pMetrics)
	B := attachSim(t, dir, p.Sock, p.Peer, "bad id", 3, kvxfer.ModePush)
	defer B.Close()
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	gen := inView(t, etcd.Endpoint(), "P", 0, 10*time.Second).Generation
	if m := metricsOf(t, pMetrics); m["kvxfer_registry_bad_entries_total"] == 0 {
		t.Errorf("kvxfer_registry_bad_entries_total = %v, want the refused engine counted", m["kvxfer_registry_bad_entries_total"])
	}
	// P re-attaches: its new generation is published.
	P.Close()
	P = attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	inView(t, etcd.Endpoint(), "P", gen, 10*time.Second)
}
