package registry_test

import (
	"context"
	"io"
	"net"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
)

// cutProxy forwards loopback TCP to etcd; cut drops every connection
// and refuses new ones until heal (a partition between one client and
// etcd, the others still reaching it).
type cutProxy struct {
	ln     net.Listener
	to     string
	mu     sync.Mutex
	cut    bool
	conns  map[net.Conn]bool
	wg     sync.WaitGroup
	closed bool
}

func newCutProxy(t *testing.T, to string) *cutProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &cutProxy{ln: ln, to: to, conns: map[net.Conn]bool{}}
	p.wg.Add(1)
	go p.serve()
	t.Cleanup(p.close)
	return p
}

func (p *cutProxy) addr() string { return p.ln.Addr().String() }

func (p *cutProxy) serve() {
	defer p.wg.Done()
	for {
		c, err := p.ln.Accept()
		if err != nil {
			return
		}
		p.mu.Lock()
		if p.cut || p.closed {
			p.mu.Unlock()
			c.Close()
			continue
		}
		up, err := net.DialTimeout("tcp", p.to, time.Second)
		if err != nil {
			p.mu.Unlock()
			c.Close()
			continue
		}
		p.conns[c], p.conns[up] = true, true
		p.mu.Unlock()
		p.wg.Add(2)
		go func() { defer p.wg.Done(); _, _ = io.Copy(up, c); up.Close(); c.Close() }()
		go func() { defer p.wg.Done(); _, _ = io.Copy(c, up); up.Close(); c.Close() }()
	}
}

func (p *cutProxy) setCut(cut bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cut = cut
	if cut {
		for c := range p.conns {
			c.Close()
		}
		clear(p.conns)
	}
}

func (p *cutProxy) close() {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.setCut(true)
	p.ln.Close()
	p.wg.Wait()
}

// A view cut off etcd while the registry changes and etcd compacts its
// history past the view's watch: once it reaches etcd again, its watch
// (resumed at a compacted revision) lists again, and the view holds what
// etcd holds: an engine that left meanwhile is a Leave, one that joined a
// Join. The view keeps its last view while cut off.
func TestCompactedWatchListsAgain(t *testing.T) {
	etcd := etcdtest.Start(t)
	px := newCutProxy(t, etcd.Endpoint())
	rec := newRecorder()
	m := registry.NewMetrics(nil)
	v, err := registry.NewView(registry.ViewConfig{Client: dial(t, px.addr()), OnChange: rec.on, Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	cl := dial(t, etcd.Endpoint())
	gone, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer gone.Close(context.Background())
	_ = gone.Set([]registry.Entry{entry("G", "127.0.0.1:7001", 1)})
	want(t, rec.next(t, 5*time.Second), registry.Join, "G", 1)

	px.setCut(true)
	_ = gone.Close(context.Background())
	joined, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer joined.Close(context.Background())
	_ = joined.Set([]registry.Entry{entry("J", "127.0.0.1:7002", 1)})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var rev int64
	for rev == 0 && ctx.Err() == nil { // J is in etcd
		resp, err := cl.Get(ctx, registry.EnginesPrefix("/kvxfer")+"J/", clientv3.WithPrefix())
		if err == nil && len(resp.Kvs) == 1 {
			rev = resp.Header.Revision
		}
	}
	for i := range 5 { // history past J, then compacted away
		if _, err := cl.Put(ctx, "/other/x", string(rune('a'+i))); err != nil {
			t.Fatal(err)
		}
	}
	resp, err := cl.Put(ctx, "/other/x", "z")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cl.Compact(ctx, resp.Header.Revision, clientv3.WithCompactPhysical()); err != nil {
		t.Fatal(err)
	}
	if _, ok := v.Lookup("G"); !ok {
		t.Fatal("Lookup(G) failed while cut off: the last view must stay")
	}
	px.setCut(false)
	got := map[registry.ChangeKind]string{}
	for range 2 {
		c := rec.next(t, 20*time.Second)
		got[c.Kind] = c.Engine
	}
	if got[registry.Leave] != "G" || got[registry.Join] != "J" {
		t.Fatalf("changes after the partition healed: %v, want G's leave and J's join", got)
	}
}

// A malformed entry is counted and logged once, not again at each list:
// a view lists again whenever its watch cannot resume (etcd back after a
// compaction, or with other data), and each list counted every malformed
// value afresh, so kvxfer_registry_bad_entries_total grew (and the log
// warned) with no new bad entry. The same key put again with a bad value
// is a new one, counted.
func TestBadEntryCountedOncePerValue(t *testing.T) {
	etcd := etcdtest.Start(t)
	px := newCutProxy(t, etcd.Endpoint())
	rec := newRecorder()
	reg := prometheus.NewRegistry()
	v, err := registry.NewView(registry.ViewConfig{Client: dial(t, px.addr()), OnChange: rec.on, Metrics: registry.NewMetrics(reg)})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	cl := dial(t, etcd.Endpoint())
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	put := func(k, val string) int64 {
		resp, err := cl.Put(ctx, k, val)
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	put("/kvxfer/engines/X/127.0.0.1:1", "not json")
	put("/kvxfer/engines/A/127.0.0.1:2", `{"v":1,"engine_id":"A","role":"producer","mode":"push","tp_size":1,"pp_size":1,"ranks":[{"peer":"127.0.0.1:2"}],"generation":1}`)
	want(t, rec.next(t, 5*time.Second), registry.Join, "A", 1)
	if n := badEntries(t, reg); n != 1 {
		t.Fatalf("bad entries counted = %v, want 1", n)
	}

	px.setCut(true)
	put("/kvxfer/engines/B/127.0.0.1:3", `{"v":1,"engine_id":"B","role":"producer","mode":"push","tp_size":1,"pp_size":1,"ranks":[{"peer":"127.0.0.1:3"}],"generation":1}`)
	rev := put("/other/x", "y")
	if _, err := cl.Compact(ctx, rev, clientv3.WithCompactPhysical()); err != nil {
		t.Fatal(err)
	}
	px.setCut(false)
	want(t, rec.next(t, 20*time.Second), registry.Join, "B", 1) // listed again
	if n := badEntries(t, reg); n != 1 {
		t.Fatalf("bad entries counted = %v after a list that found the same malformed value, want 1", n)
	}
	put("/kvxfer/engines/X/127.0.0.1:1", "still not json")
	for deadline := time.Now().Add(10 * time.Second); badEntries(t, reg) != 2; time.Sleep(20 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("bad entries counted = %v after a new malformed value, want 2", badEntries(t, reg))
		}
	}
}

func badEntries(t *testing.T, reg *prometheus.Registry) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() == "kvxfer_registry_bad_entries_total" {
			for _, m := range mf.GetMetric() {
				n += m.GetCounter().GetValue()
			}
		}
	}
	return n
}
