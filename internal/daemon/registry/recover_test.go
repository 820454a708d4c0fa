package registry_test

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

// etcd restarts on an empty data directory (a member without persistent
// storage, or a restored backup): its revision starts again from 1. The
// view's watch resumed at its old revision, which the new store has not
// reached, so it heard nothing: it kept an engine whose daemon died
// meanwhile (a dead address to route to) and never saw one that joined.
// It must notice that etcd's revision went back and list again.
func TestEtcdLostItsDataListsAgain(t *testing.T) {
	etcd := etcdtest.Start(t)
	before := runtime.NumGoroutine()
	func() {
		rec := newRecorder()
		vcl, pcl, qcl := dial(t, etcd.Endpoint()), dial(t, etcd.Endpoint()), dial(t, etcd.Endpoint())
		defer vcl.Close()
		defer pcl.Close()
		defer qcl.Close()
		v, err := registry.NewView(registry.ViewConfig{Client: vcl, OnChange: rec.on})
		if err != nil {
			t.Fatal(err)
		}
		defer v.Close()
		p, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: pcl, TTL: 3 * time.Second})
		defer p.Close(context.Background())
		// Revisions well past what the new store reaches in this test.
		for g := uint64(1); g <= 20; g++ {
			if err := p.Set([]registry.Entry{entry("P", "127.0.0.1:7001", g)}); err != nil {
				t.Fatal(err)
			}
			rec.next(t, 5*time.Second)
		}
		dcl := dial(t, etcd.Endpoint())
		defer dcl.Close()
		dead, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dcl, TTL: 3 * time.Second})
		defer dead.Close(context.Background())
		_ = dead.Set([]registry.Entry{entry("S", "127.0.0.1:7009", 1)})
		want(t, rec.next(t, 5*time.Second), registry.Join, "S", 1)

		etcd.Kill()
		dcl.Close() // S's daemon dies while etcd is down
		if err := os.RemoveAll(filepath.Join(etcd.Dir(), "data")); err != nil {
			t.Fatal(err)
		}
		etcd.Restart()
		q, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: qcl, TTL: 3 * time.Second})
		defer q.Close(context.Background())
		if err := q.Set([]registry.Entry{entry("Q", "127.0.0.1:7002", 1)}); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(15 * time.Second); ; time.Sleep(50 * time.Millisecond) {
			_, hasQ := v.Lookup("Q")
			_, hasS := v.Lookup("S")
			_, hasP := v.Lookup("P")
			if hasQ && !hasS && hasP {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("15 s after etcd came back empty: Q in the view %v (want true), S %v (want false: its daemon died), P %v (want true: registered again)",
					hasQ, hasS, hasP)
			}
		}
	}()
	leakcheck.Check(t, before, 0, 10*time.Second)
}

// A full view refuses new keys; once room is made (an engine left), a
// key it refused must come in: its registrar puts it once per lease, so
// no watch event would bring it again, and the engine would stay out of
// the view (no router sends to it, its leave is never seen) while it is
// registered.
func TestFullViewTakesARefusedEntryWhenRoomIsMade(t *testing.T) {
	etcd := etcdtest.Start(t)
	rec := newRecorder()
	v, err := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint()), OnChange: rec.on, MaxEntries: 1})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	a, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 3 * time.Second})
	defer a.Close(context.Background())
	_ = a.Set([]registry.Entry{entry("A", "127.0.0.1:7001", 1)})
	want(t, rec.next(t, 5*time.Second), registry.Join, "A", 1)
	b, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 3 * time.Second})
	defer b.Close(context.Background())
	_ = b.Set([]registry.Entry{entry("B", "127.0.0.1:7002", 1)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for { // B is in etcd (and refused by the view)
		if _, ok, err := v.LookupNow(ctx, "B"); ok || err != nil {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	if _, ok := v.Lookup("B"); ok {
		t.Fatal("B is in a view of at most 1 entry that holds A")
	}
	_ = a.Close(context.Background())
	want(t, rec.next(t, 9*time.Second), registry.Leave, "A", 1) // three TTLs: a lease just lost goes at its end
	want(t, rec.next(t, 10*time.Second), registry.Join, "B", 1) // within progressEvery of the last list
}

// A full view counts each key it leaves out once, and says how many it
// leaves out now. Before, each listing of a full view counted its whole
// overflow again (a limited listing does not name the keys it leaves
// out), and each value put again over a refused key counted once more:
// kvxfer_registry_refused_total grew with every leave that made room and
// every read-back, with no new key refused.
func TestFullViewCountsEachRefusedKeyOnce(t *testing.T) {
	etcd := etcdtest.Start(t)
	cl := dial(t, etcd.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	put := func(engine string, gen uint64) {
		t.Helper()
		peer := "127.0.0.1:7001"
		k := registry.Key("/kvxfer", engine, peer)
		e := entry(engine, peer, gen)
		val, err := e.Encode(k)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cl.Put(ctx, k, string(val)); err != nil {
			t.Fatal(err)
		}
	}
	for _, e := range []string{"A", "B", "C", "D"} {
		put(e, 1)
	}
	reg := prometheus.NewRegistry()
	rec := newRecorder()
	v, err := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint()), OnChange: rec.on, MaxEntries: 2, Metrics: registry.NewMetrics(reg)})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	want(t, rec.next(t, 5*time.Second), registry.Join, "A", 1)
	want(t, rec.next(t, 5*time.Second), registry.Join, "B", 1)
	check := func(when string, total, now float64) {
		t.Helper()
		if got := metric(t, reg, "kvxfer_registry_refused_total"); got != total {
			t.Errorf("%s: kvxfer_registry_refused_total = %v, want %v (each key left out once)", when, got, total)
		}
		if got := metric(t, reg, "kvxfer_registry_refused_entries"); got != now {
			t.Errorf("%s: kvxfer_registry_refused_entries = %v, want %v", when, got, now)
		}
	}
	check("listed", 2, 2)

	put("C", 2) // a value put again over a refused key (a new generation)
	put("Z", 1) // a key put while full: a new refusal
	for deadline := time.Now().Add(10 * time.Second); metric(t, reg, "kvxfer_registry_refused_entries") != 3 &&
		metric(t, reg, "kvxfer_registry_refused_total") <= 3; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("Z's refusal not seen within 10 s")
		}
	}
	check("C put again, Z put", 3, 3)

	// A leave makes room: the view lists again, takes C in, and leaves
	// D and Z out, as before.
	if _, err := cl.Delete(ctx, registry.Key("/kvxfer", "A", "127.0.0.1:7001")); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Leave, "A", 1)
	want(t, rec.next(t, 10*time.Second), registry.Join, "C", 2) // within progressEvery of the last list
	check("listed again", 3, 2)

	// Z goes while refused; B goes, D comes in: nothing is left out.
	if _, err := cl.Delete(ctx, registry.Key("/kvxfer", "Z", "127.0.0.1:7001")); err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Delete(ctx, registry.Key("/kvxfer", "B", "127.0.0.1:7001")); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Leave, "B", 1)
	want(t, rec.next(t, 10*time.Second), registry.Join, "D", 1)
	check("all in", 3, 0)
}

// metric sums the samples of the counter or gauge name in reg.
func metric(t *testing.T, reg *prometheus.Registry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue() + m.GetGauge().GetValue()
			}
		}
	}
	return n
}
