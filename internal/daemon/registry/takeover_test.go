package registry_test

import (
	"context"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
)

// registered reads kvxfer_registry_registered from reg.
func registered(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() == "kvxfer_registry_registered" {
			return mf.GetMetric()[0].GetGauge().GetValue()
		}
	}
	t.Fatal("no kvxfer_registry_registered")
	return 0
}

// A daemon restarted on the same address (same key) puts its engine's
// entry under its own lease while the old one still runs down (a graceful
// stop draining): the old one's engine detaching then must not delete the
// entry the new one put. Before, the registrar deleted its keys whatever
// lease held them: the engine was gone from the registry (a Leave at every
// peer, its requests by id refused) while its daemon, which had put the
// entry once, believed it published.
func TestRegistrarDeletesOnlyItsOwnEntries(t *testing.T) {
	etcd := etcdtest.Start(t)
	const peer = "127.0.0.1:7001"
	oldReg := prometheus.NewRegistry()
	old, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second, Metrics: registry.NewMetrics(oldReg)})
	defer old.Close(context.Background())
	if err := old.Set([]registry.Entry{entry("P", peer, 1)}); err != nil {
		t.Fatal(err)
	}
	rec := newRecorder()
	v, _ := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint()), OnChange: rec.on})
	defer v.Close()
	want(t, rec.next(t, 5*time.Second), registry.Join, "P", 1)
	cur, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer cur.Close(context.Background())
	if err := cur.Set([]registry.Entry{entry("P", peer, 2)}); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Generation, "P", 2)

	// The old daemon's engine detaches: it publishes nothing more.
	if err := old.Set(nil); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); registered(t, oldReg) != 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the old registrar did not sync its empty set within 10 s")
		}
	}
	cl := dial(t, etcd.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cl.Get(ctx, registry.Key("/kvxfer", "P", peer))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 {
		t.Fatal("P's entry, put by the daemon now at its address, was deleted by the one that was there before")
	}
	if e, err := registry.Decode("/kvxfer", string(resp.Kvs[0].Key), resp.Kvs[0].Value); err != nil || e.Generation != 2 {
		t.Fatalf("P's entry = %+v, %v; want generation 2", e, err)
	}
	// Its lease ending (a revoke) leaves it too.
	if err := old.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	if resp, err := cl.Get(ctx, registry.Key("/kvxfer", "P", peer), clientv3.WithCountOnly()); err != nil || resp.Count != 1 {
		t.Fatalf("after the old registrar closed: %v entries, %v; want P's", resp.Count, err)
	}
	if e, ok := v.Lookup("P"); !ok || e.Generation != 2 {
		t.Fatalf("Lookup(P) = %+v, %v; want generation 2", e, ok)
	}
}

// A daemon draining on an address and the daemon that replaced it there
// (the same key): the old one loses its lease (cut off etcd for a TTL)
// while the new one has put its entry. Registered again, the old one
// must not put its entry back over the new one's: peers would resolve
// the engine to the daemon that is leaving, and its read-back would then
// keep it there. Before, registering again put every entry whatever held
// its key. An entry first published takes over (the new daemon's, over
// the old one's live lease), and one absent is put back, as before.
func TestDrainingDaemonLeavesItsReplacementsEntry(t *testing.T) {
	etcd := etcdtest.Start(t)
	const peer = "127.0.0.1:7001"
	k := registry.Key("/kvxfer", "P", peer)
	px := newCutProxy(t, etcd.Endpoint())
	oldReg := prometheus.NewRegistry()
	old, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, px.addr()), TTL: 2 * time.Second, Metrics: registry.NewMetrics(oldReg)})
	defer old.Close(context.Background())
	_ = old.Set([]registry.Entry{entry("P", peer, 1)})
	rec := newRecorder()
	v, _ := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint()), OnChange: rec.on})
	defer v.Close()
	want(t, rec.next(t, 5*time.Second), registry.Join, "P", 1)

	px.setCut(true) // the old daemon is cut off etcd: its lease runs out
	cur, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 2 * time.Second})
	defer cur.Close(context.Background())
	_ = cur.Set([]registry.Entry{entry("P", peer, 2)})
	want(t, rec.next(t, 5*time.Second), registry.Generation, "P", 2)
	waitRegistered(t, oldReg, 0, 10*time.Second) // its lease found lost
	px.setCut(false)
	waitRegistered(t, oldReg, 1, 20*time.Second) // registered again

	cl := dial(t, etcd.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := cl.Get(ctx, k)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("P's entry: %+v, %v", resp, err)
	}
	if e, err := registry.Decode("/kvxfer", k, resp.Kvs[0].Value); err != nil || e.Generation != 2 {
		t.Fatalf("P's entry once the old daemon registered again = %+v, %v; want the replacement's, generation 2", e, err)
	}
	select {
	case c := <-rec.ch:
		t.Fatalf("change %v %s gen %d: the old daemon took back the key its replacement holds", c.Kind, c.Engine, c.Entry.Generation)
	case <-time.After(5 * time.Second): // two read-backs and more
	}
	if e, ok := v.Lookup("P"); !ok || e.Generation != 2 {
		t.Fatalf("Lookup(P) = %+v, %v; want generation 2", e, ok)
	}
}
