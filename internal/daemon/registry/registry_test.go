package registry_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

func dial(t *testing.T, ep string) *clientv3.Client {
	t.Helper()
	cl, err := registry.Dial(registry.ClientConfig{Endpoints: ep})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cl.Close() })
	return cl
}

func entry(engine, peer string, gen uint64) registry.Entry {
	return registry.Entry{EngineID: engine, Role: registry.RoleProducer, Mode: "push", CompatHash: "h", TPSize: 1, PPSize: 1,
		Ranks: []registry.Rank{{Peer: peer}}, Generation: gen, URL: "http://127.0.0.1:8100"}
}

// recorder collects a view's changes.
type recorder struct {
	mu  sync.Mutex
	got []registry.Change
	ch  chan registry.Change
}

func newRecorder() *recorder { return &recorder{ch: make(chan registry.Change, 1024)} }

func (r *recorder) on(c registry.Change) {
	r.mu.Lock()
	r.got = append(r.got, c)
	r.mu.Unlock()
	r.ch <- c
}

// next waits for the next change, within d.
func (r *recorder) next(t *testing.T, d time.Duration) registry.Change {
	t.Helper()
	select {
	case c := <-r.ch:
		return c
	case <-time.After(d):
		t.Fatalf("no registry change within %v", d)
		return registry.Change{}
	}
}

func want(t *testing.T, c registry.Change, kind registry.ChangeKind, engine string, gen uint64) {
	t.Helper()
	if c.Kind != kind || c.Engine != engine || (gen != 0 && c.Entry.Generation != gen) {
		t.Fatalf("change = %v %s gen %d, want %v %s gen %d", c.Kind, c.Engine, c.Entry.Generation, kind, engine, gen)
	}
}

// Join, rejoin by generation, clean leave, and a lease that ends when
// its holder stops keeping it alive (a killed process): each is seen by
// a view as one change, the lease's end within its TTL and a second.
func TestJoinRejoinLeaveExpire(t *testing.T) {
	etcd := etcdtest.Start(t)
	before := runtime.NumGoroutine() // etcd's waiter included
	func() {
		rec := newRecorder()
		vcl, rcl := dial(t, etcd.Endpoint()), dial(t, etcd.Endpoint())
		defer vcl.Close()
		defer rcl.Close()
		v, err := registry.NewView(registry.ViewConfig{Client: vcl, OnChange: rec.on})
		if err != nil {
			t.Fatal(err)
		}
		defer v.Close()
		r, err := registry.NewRegistrar(registry.RegistrarConfig{Client: rcl, TTL: 2 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		if err := r.Set([]registry.Entry{entry("P", "127.0.0.1:7001", 1)}); err != nil {
			t.Fatal(err)
		}
		want(t, rec.next(t, 5*time.Second), registry.Join, "P", 1)
		if e, ok := v.Lookup("P"); !ok || e.Peer() != "127.0.0.1:7001" {
			t.Fatalf("Lookup(P) = %+v, %v", e, ok)
		}
		_ = r.Set([]registry.Entry{entry("P", "127.0.0.1:7001", 2)})
		want(t, rec.next(t, 5*time.Second), registry.Generation, "P", 2)
		if err := r.Close(context.Background()); err != nil {
			t.Fatal(err)
		}
		// Within three TTLs: a lease just lost as Close came goes at its end.
		want(t, rec.next(t, 6*time.Second), registry.Leave, "P", 2)

		// A process that dies: its lease is granted and kept alive by a
		// client that is then closed without revoking.
		dead := dial(t, etcd.Endpoint())
		defer dead.Close()
		r2, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dead, TTL: 2 * time.Second})
		_ = r2.Set([]registry.Entry{entry("Q", "127.0.0.1:7002", 7)})
		want(t, rec.next(t, 5*time.Second), registry.Join, "Q", 7)
		dead.Close() // keepalives stop now
		died := time.Now()
		want(t, rec.next(t, 10*time.Second), registry.Leave, "Q", 7)
		took := time.Since(died)
		t.Logf("a lease of 2 s ended %v after its keepalives stopped", took.Round(time.Millisecond))
		// Within the 2 s TTL, etcd's lessor's round (500 ms) and slack for
		// a loaded machine (its revoke goes through raft), yet short of
		// the default TTL (5 s): a lease granted at that, not at the
		// registrar's TTL, is caught.
		if took > 4*time.Second+500*time.Millisecond {
			t.Errorf("lease end seen %v after the keepalives stopped, want within the TTL (2 s, not the default %v) and slack", took, registry.DefaultTTL)
		}
		_ = r2.Close(context.Background())
		if got := v.Engines(); len(got) != 0 {
			t.Errorf("Engines() = %+v, want none", got)
		}
	}()
	leakcheck.Check(t, before, 0, 10*time.Second)
}

// etcd is killed and restarted (same data): the view keeps its last view
// meanwhile, the registrar retries, and both carry on once etcd is back;
// an engine that registers while etcd is down appears once it is back.
func TestEtcdKilledAndRestarted(t *testing.T) {
	etcd := etcdtest.Start(t)
	rec := newRecorder()
	m := registry.NewMetrics(nil)
	v, _ := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint()), OnChange: rec.on, Metrics: m})
	defer v.Close()
	r, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second, Metrics: m})
	defer r.Close(context.Background())
	_ = r.Set([]registry.Entry{entry("P", "127.0.0.1:7001", 1)})
	want(t, rec.next(t, 5*time.Second), registry.Join, "P", 1)
	etcd.Kill()
	// While etcd is down: the view answers from what it saw; a new entry
	// waits.
	if _, ok := v.Lookup("P"); !ok {
		t.Fatal("Lookup(P) failed while etcd is down: the last view must stay")
	}
	_ = r.Set([]registry.Entry{entry("P", "127.0.0.1:7001", 1), entry("D", "127.0.0.1:7001", 3)})
	time.Sleep(1500 * time.Millisecond)
	select {
	case c := <-rec.ch:
		t.Fatalf("change %v %s while etcd was down", c.Kind, c.Engine)
	default:
	}
	etcd.Restart()
	back := time.Now()
	want(t, rec.next(t, 10*time.Second), registry.Join, "D", 3)
	t.Logf("an entry set while etcd was down appeared %v after etcd came back", time.Since(back).Round(time.Millisecond))
	if _, ok := v.Lookup("P"); !ok {
		t.Error("P is gone after etcd's restart")
	}
}

// Malformed and inconsistent entries are refused with an error naming
// the field and the value, counted by field; the rest of the view is
// unaffected.
func TestBadEntriesRefused(t *testing.T) {
	etcd := etcdtest.Start(t)
	cl := dial(t, etcd.Endpoint())
	rec := newRecorder()
	v, _ := registry.NewView(registry.ViewConfig{Client: cl, OnChange: rec.on})
	defer v.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	put := func(k, val string) {
		if _, err := cl.Put(ctx, k, val); err != nil {
			t.Fatal(err)
		}
	}
	put("/kvxfer/engines/X/127.0.0.1:1", "not json")
	put("/kvxfer/engines/Y/127.0.0.1:1", `{"v":1,"engine_id":"Z","role":"producer","mode":"push","tp_size":1,"pp_size":1,"ranks":[{"peer":"127.0.0.1:1"}],"generation":1}`)
	put("/kvxfer/engines/W/127.0.0.1:1", `{"v":1,"engine_id":"W","role":"producer","mode":"push","tp_size":1,"pp_size":1,"ranks":[{"peer":"127.0.0.1:1"}],"generation":1}`)
	want(t, rec.next(t, 5*time.Second), registry.Join, "W", 1)
	if got := v.Engines(); len(got) != 1 {
		t.Errorf("Engines() = %+v, want W only", got)
	}
}

func TestDecode(t *testing.T) {
	good := entry("P", "127.0.0.1:7001", 1)
	key := registry.Key("/kvxfer", "P", "127.0.0.1:7001")
	for _, tc := range []struct {
		name  string
		edit  func(*registry.Entry)
		field string
	}{
		{name: "good"},
		{name: "no generation", edit: func(e *registry.Entry) { e.Generation = 0 }, field: "generation"},
		{name: "bad role", edit: func(e *registry.Entry) { e.Role = "kv_both" }, field: "role"},
		{name: "bad mode", edit: func(e *registry.Entry) { e.Mode = "sideways" }, field: "mode"},
		{name: "tp rank past tp size", edit: func(e *registry.Entry) { e.Ranks[0].TP = 1 }, field: "ranks[0].tp"},
		{name: "bad peer", edit: func(e *registry.Entry) { e.Ranks[0].Peer = "nowhere" }, field: "ranks[0].peer"},
		{name: "peer not the key's", edit: func(e *registry.Entry) { e.Ranks[0].Peer = "127.0.0.1:9" }, field: "ranks[0].peer"},
		{name: "url with credentials", edit: func(e *registry.Entry) { e.URL = "http://u:p@h:1" }, field: "url"},
		{name: "tp size 0", edit: func(e *registry.Entry) { e.TPSize = 0 }, field: "tp_size"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := good
			e.Ranks = append([]registry.Rank(nil), good.Ranks...)
			e.V = registry.Version
			if tc.edit != nil {
				tc.edit(&e)
			}
			b := []byte(fmt.Sprintf(`{"v":1,"engine_id":%q,"role":%q,"mode":%q,"compat_hash":"h","tp_size":%d,"pp_size":1,"ranks":[{"tp":%d,"pp":0,"peer":%q}],"generation":%d,"url":%q}`,
				e.EngineID, e.Role, e.Mode, e.TPSize, e.Ranks[0].TP, e.Ranks[0].Peer, e.Generation, e.URL))
			_, err := registry.Decode("/kvxfer", key, b)
			if tc.field == "" {
				if err != nil {
					t.Fatalf("Decode = %v, want nil", err)
				}
				return
			}
			var be *registry.BadEntryError
			if !errors.As(err, &be) || be.Field != tc.field || !errors.Is(err, registry.ErrBadEntry) {
				t.Fatalf("Decode = %v, want a BadEntryError naming %s", err, tc.field)
			}
		})
	}
}

// An engine that moves from one daemon to another (its old daemon died:
// its entry stays until the lease ends) is found at its new address at
// once, even when the new daemon's generation is lower: generations of
// two daemons start from their own clocks and do not compare, the
// entry's creation in etcd does. The fleet churn found D handshaking the
// dead address for the lease's length.
func TestLookupFollowsTheNewestEntry(t *testing.T) {
	etcd := etcdtest.Start(t)
	rec := newRecorder()
	vcl := dial(t, etcd.Endpoint())
	v, err := registry.NewView(registry.ViewConfig{Client: vcl, OnChange: rec.on})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	old, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer old.Close(context.Background())
	if err := old.Set([]registry.Entry{entry("P", "127.0.0.1:7001", 900)}); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Join, "P", 900)
	moved, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer moved.Close(context.Background())
	if err := moved.Set([]registry.Entry{entry("P", "127.0.0.1:7002", 5)}); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Generation, "P", 5)
	if e, ok := v.Lookup("P"); !ok || e.Peer() != "127.0.0.1:7002" {
		t.Fatalf("Lookup(P) = %s, %v; want the entry created last, 127.0.0.1:7002", e.Peer(), ok)
	}
	// Its old entry going (the old lease ends) changes nothing.
	_ = old.Close(context.Background())
	time.Sleep(300 * time.Millisecond)
	if e, ok := v.Lookup("P"); !ok || e.Peer() != "127.0.0.1:7002" {
		t.Fatalf("after the old entry went: Lookup(P) = %s, %v", e.Peer(), ok)
	}
}

// LookupNow finds an engine the view has not seen yet (its watch lags,
// here stopped) by asking etcd, as the view would decode it; an engine
// etcd has no entry for, or no key could name, is not found.
func TestLookupNowSeesWhatTheViewHasNot(t *testing.T) {
	etcd := etcdtest.Start(t)
	v, err := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint())})
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); !v.Synced(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the view did not list etcd within 10 s")
		}
	}
	v.Close() // its view stays as it is: nothing of what follows reaches it
	r, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer r.Close(context.Background())
	if err := r.Set([]registry.Entry{entry("P", "127.0.0.1:7003", 7)}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var e registry.Entry
	var ok bool
	for ; !ok && err == nil && ctx.Err() == nil; time.Sleep(10 * time.Millisecond) { // the registrar puts it in the background
		e, ok, err = v.LookupNow(ctx, "P")
	}
	if err != nil || !ok || e.Peer() != "127.0.0.1:7003" || e.Generation != 7 {
		t.Fatalf("LookupNow(P) = %s gen %d, %v, %v; want 127.0.0.1:7003 gen 7", e.Peer(), e.Generation, ok, err)
	}
	if _, ok := v.Lookup("P"); ok {
		t.Fatal("Lookup(P) found it: the view was meant to lag")
	}
	for _, id := range []string{"Q", "P/127.0.0.1:7003", "", "a b"} {
		if e, ok, err := v.LookupNow(ctx, id); ok || err != nil {
			t.Errorf("LookupNow(%q) = %s, %v, %v; want not found", id, e.Peer(), ok, err)
		}
	}
}

// An entry's peer is what resolvers dial and routers hand on as
// remote_host: one that is not a host name or IP and a port of digits
// (what the resolver's checkPeerAddr accepts) is refused at Decode, named
// and counted, not taken in as an engine's current address.
func TestDecodeRefusesPeersThatAreNotHostPort(t *testing.T) {
	for _, peer := range []string{"[unix:/run/kvxfer.sock]:7001", "bad host:7001", "h:+7001", "h\x00:7001", "h\n:7001", "[no:t-an-ip]:7001"} {
		k := registry.Key("/kvxfer", "P", peer)
		jp, _ := json.Marshal(peer)
		b := []byte(fmt.Sprintf(`{"v":1,"engine_id":"P","role":"producer","mode":"push","tp_size":1,"pp_size":1,"ranks":[{"peer":%s}],"generation":1}`, jp))
		_, err := registry.Decode("/kvxfer", k, b)
		var be *registry.BadEntryError
		if !errors.As(err, &be) || be.Field != "ranks[0].peer" {
			t.Errorf("Decode(peer %q) = %v, want a BadEntryError naming ranks[0].peer", peer, err)
		}
	}
	for _, peer := range []string{"127.0.0.1:7001", "[::1]:7001", "kv-0.pod_a.example:7001"} {
		k := registry.Key("/kvxfer", "P", peer)
		jp, _ := json.Marshal(peer)
		b := []byte(fmt.Sprintf(`{"v":1,"engine_id":"P","role":"producer","mode":"push","tp_size":1,"pp_size":1,"ranks":[{"peer":%s}],"generation":1}`, jp))
		if _, err := registry.Decode("/kvxfer", k, b); err != nil {
			t.Errorf("Decode(peer %q) = %v, want nil", peer, err)
		}
	}
}

// A value is one entry's JSON object and nothing more: bytes after it (a
// second object, a writer's leftovers) are refused, named and counted,
// not ignored. Before, the decoder read the first object and took it.
func TestDecodeRefusesDataAfterTheObject(t *testing.T) {
	k := registry.Key("/kvxfer", "P", "127.0.0.1:7001")
	entry := `{"v":1,"engine_id":"P","role":"producer","mode":"push","tp_size":1,"pp_size":1,"ranks":[{"peer":"127.0.0.1:7001"}],"generation":1}`
	if _, err := registry.Decode("/kvxfer", k, []byte(entry+" \n")); err != nil {
		t.Fatalf("the entry with trailing space: %v, want nil", err)
	}
	for _, tail := range []string{"garbage", `{"v":1}`, "]", "1"} {
		_, err := registry.Decode("/kvxfer", k, []byte(entry+tail))
		var be *registry.BadEntryError
		if !errors.As(err, &be) || be.Field != "value" {
			t.Errorf("Decode(entry + %q) = %v, want a BadEntryError naming value", tail, err)
		}
	}
}
