package registry_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
)

// An entry deleted by hand (etcdctl del), or overwritten by a value put
// without a lease (a malformed one, say), while its registrar lives is put
// again within a TTL or so. Before, the registrar put each entry once per
// lease: the engine stayed out of every view (its requests by id refused,
// no router sending to it) for as long as its daemon lived, and a value
// put over it without a lease outlived the daemon. A key a daemon started
// since on the same address holds under its own lease is left to it.
func TestRegistrarPutsBackAnEntryDeletedOrOverwrittenByHand(t *testing.T) {
	etcd := etcdtest.Start(t)
	const peer = "127.0.0.1:7001"
	k := registry.Key("/kvxfer", "P", peer)
	rec := newRecorder()
	m := registry.NewMetrics(nil)
	v, _ := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint()), OnChange: rec.on, Metrics: m})
	defer v.Close()
	r, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 2 * time.Second})
	defer r.Close(context.Background())
	_ = r.Set([]registry.Entry{entry("P", peer, 1)})
	want(t, rec.next(t, 5*time.Second), registry.Join, "P", 1)
	cl := dial(t, etcd.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()

	if _, err := cl.Delete(ctx, k); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Leave, "P", 1)
	want(t, rec.next(t, 6*time.Second), registry.Join, "P", 1) // within a TTL's check and slack

	if _, err := cl.Put(ctx, k, `{"v":1,"engine_id":"P"}`); err != nil { // no lease, malformed
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Leave, "P", 1) // refused by the view
	want(t, rec.next(t, 6*time.Second), registry.Join, "P", 1)
	resp, err := cl.Get(ctx, k)
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("P's entry after the repair = %+v, %v; want one under the registrar's lease", resp, err)
	}

	// Another daemon now on P's address takes the key under its lease:
	// the first one's check leaves it alone.
	cur, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 2 * time.Second})
	defer cur.Close(context.Background())
	_ = cur.Set([]registry.Entry{entry("P", peer, 2)})
	want(t, rec.next(t, 5*time.Second), registry.Generation, "P", 2)
	select {
	case c := <-rec.ch:
		t.Fatalf("change %v %s gen %d: the first registrar took back a key the second holds under its own lease", c.Kind, c.Engine, c.Entry.Generation)
	case <-time.After(5 * time.Second): // two checks and more
	}
	if e, ok := v.Lookup("P"); !ok || e.Generation != 2 {
		t.Fatalf("Lookup(P) = %+v, %v; want generation 2", e, ok)
	}
}
