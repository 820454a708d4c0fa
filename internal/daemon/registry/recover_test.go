package registry_test

import (
	"context"
	"os"
	"path/filepath"
	"runtime"
	"testing"
	"time"

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
