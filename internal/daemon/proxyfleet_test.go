package daemon

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/proxy"
)

// The proxy routes only to engines every rank of which is served, and
// hands D rank 0's server (the base of the per-rank port scheme) for an
// engine whose ranks are served each by its own server (the in-process
// placement: one entry per rank, each under its own lease). Before, it
// routed to such an engine after a rank's server was gone (every
// transfer of it then failed), and handed D the address of whichever
// rank's entry etcd created last: rank 1's, from which D's ranks counted
// the wrong ports.
func TestProxyFleetRoutesWholeEngines(t *testing.T) {
	const ttl = 5 * time.Second // the registrars' leases
	etcd := etcdtest.Start(t)
	dial := func() registry.ClientConfig { return registry.ClientConfig{Endpoints: etcd.Endpoint()} }
	cl, err := registry.Dial(dial())
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	v, err := registry.NewView(registry.ViewConfig{Client: cl})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	f := viewFleet{v: v}
	rank := func(tp int, peer string) registry.Entry {
		return registry.Entry{EngineID: "P", Role: registry.RoleProducer, Mode: "push", CompatHash: "h", TPSize: 2, PPSize: 1,
			Ranks: []registry.Rank{{TP: tp, Peer: peer}}, Generation: uint64(10 + tp), URL: "http://127.0.0.1:8100"}
	}
	regs := make([]*registry.Registrar, 2)
	for i := range regs {
		c, err := registry.Dial(dial())
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		regs[i], err = registry.NewRegistrar(registry.RegistrarConfig{Client: c, TTL: ttl})
		if err != nil {
			t.Fatal(err)
		}
		defer regs[i].Close(context.Background())
	}
	// waitFor polls the fleet until cond holds, within three TTLs: a
	// registrar's Close deletes its entry at once, unless its lease was
	// just lost and Close cut the new grant short; then the entry goes at
	// the old lease's end, a TTL later (5 s, this wait's bound before).
	waitFor := func(what string, cond func([]proxy.Instance) bool) []proxy.Instance {
		t.Helper()
		const within = 3 * ttl
		for deadline := time.Now().Add(within); ; time.Sleep(10 * time.Millisecond) {
			in := f.Instances()
			if cond(in) {
				return in
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s: instances %+v after %v (engines in the view: %+v)", what, in, within, v.Engines())
			}
		}
	}
	none := func(in []proxy.Instance) bool { return len(in) == 0 }

	// Rank 1 alone: P is not routable yet.
	if err := regs[1].Set([]registry.Entry{rank(1, "127.0.0.1:7101")}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); len(v.Engines()) == 0; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("rank 1's entry not in the view after 5 s")
		}
	}
	if in := f.Instances(); len(in) != 0 {
		t.Fatalf("instances with rank 0 unserved: %+v, want none", in)
	}
	// Both ranks: P is routable at rank 0's server, whichever entry is
	// newer.
	if err := regs[0].Set([]registry.Entry{rank(0, "127.0.0.1:7100")}); err != nil {
		t.Fatal(err)
	}
	in := waitFor("both ranks served", func(in []proxy.Instance) bool { return len(in) == 1 })
	if in[0].Engine != "P" || in[0].KVHost != "127.0.0.1" || in[0].KVPort != 7100 || in[0].TP != 2 {
		t.Errorf("instance %+v, want engine P at rank 0's 127.0.0.1:7100, TP 2", in[0])
	}
	// Rank 1's server restarted (its entry now the one etcd created
	// last): still rank 0's server.
	if err := regs[1].Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor("rank 1 gone", none)
	c, err := registry.Dial(dial())
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	regs[1], err = registry.NewRegistrar(registry.RegistrarConfig{Client: c, TTL: ttl})
	if err != nil {
		t.Fatal(err)
	}
	defer regs[1].Close(context.Background())
	if err := regs[1].Set([]registry.Entry{rank(1, "127.0.0.1:7101")}); err != nil {
		t.Fatal(err)
	}
	in = waitFor("rank 1 back", func(in []proxy.Instance) bool { return len(in) == 1 })
	if e, _ := v.Lookup("P"); e.Peer() != "127.0.0.1:7101" {
		t.Fatalf("the current entry is %+v, want rank 1's (created last)", e)
	}
	if in[0].KVPort != 7100 {
		t.Errorf("instance after rank 1's server restarted: %+v, want P at rank 0's port 7100", in[0])
	}
	// Rank 0's server is gone: P is no longer routed to, though rank 1's
	// entry stays.
	if err := regs[0].Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	waitFor("rank 0 gone", none)
	if len(v.Engines()) != 1 {
		t.Errorf("engines in the view: %+v, want P by rank 1's entry", v.Engines())
	}
}
