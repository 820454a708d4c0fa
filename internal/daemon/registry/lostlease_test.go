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

// etcd is down for longer than the TTL (its data kept): the registrar
// finds its lease lost, and meanwhile an engine it served leaves. etcd
// restored the lease at its restart (and renewed it), so the engine's
// entry, put under it, would stay there another TTL once the registrar
// had registered again under a new lease: a stale address that peers
// resolve the engine to and routers send to. The registrar revokes the
// lease it lost once it is registered again: by then the entry is gone.
func TestLostLeaseRevokedOnceRegisteredAgain(t *testing.T) {
	etcd := etcdtest.Start(t)
	const ttl = 3 * time.Second
	reg := prometheus.NewRegistry()
	r, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: ttl, Metrics: registry.NewMetrics(reg)})
	defer r.Close(context.Background())
	_ = r.Set([]registry.Entry{entry("E", "127.0.0.1:7001", 1), entry("F", "127.0.0.1:7001", 1)})
	waitRegistered(t, reg, 1, 10*time.Second)
	etcd.Kill()
	waitRegistered(t, reg, 0, 20*time.Second) // the lease lost, seen a TTL after the last answer
	_ = r.Set([]registry.Entry{entry("F", "127.0.0.1:7001", 1)})
	time.Sleep(ttl) // an outage of some length: etcd's restart renews the lease it restores
	etcd.Restart()
	waitRegistered(t, reg, 1, 20*time.Second)
	cl := dial(t, etcd.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cl.Get(ctx, registry.EnginesPrefix("/kvxfer"), clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, kv := range resp.Kvs {
		keys = append(keys, string(kv.Key))
	}
	if len(keys) != 1 || keys[0] != registry.Key("/kvxfer", "F", "127.0.0.1:7001") {
		t.Fatalf("entries once registered again = %q; want F's alone (E left while etcd was down)", keys)
	}
}

func waitRegistered(t *testing.T, reg *prometheus.Registry, want float64, d time.Duration) {
	t.Helper()
	for deadline := time.Now().Add(d); registered(t, reg) != want; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("kvxfer_registry_registered not %v within %v", want, d)
		}
	}
}
