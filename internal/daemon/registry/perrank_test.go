package registry_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
)

// rankEntry is the one-rank entry a per-rank server of the in-process
// placement publishes: rank tp of an engine of TP tpSize, at peer.
func rankEntry(engine, peer string, tp, tpSize int, gen uint64) registry.Entry {
	e := entry(engine, peer, gen)
	e.TPSize, e.Ranks = tpSize, []registry.Rank{{TP: tp, Peer: peer}}
	return e
}

// An engine whose ranks are served each by its own server (the in-process
// placement) has one entry per rank, each under its server's lease. A
// rank's server that restarts (a new generation on the same port, put
// before its old lease ended) is a rejoin of the engine, and a rank whose
// entry goes while the others stay (its server's lease ended) leaves the
// engine without that rank: each is a change, whichever rank's entry etcd
// created last. Before, only the entry created last was looked at: rank 0
// restarting or going while rank 1's entry was newer changed nothing, so
// nothing told D's ranks, and what waited on the engine waited out its own
// deadline.
func TestPerRankEntriesChange(t *testing.T) {
	etcd := etcdtest.Start(t)
	rec := newRecorder()
	v, err := registry.NewView(registry.ViewConfig{Client: dial(t, etcd.Endpoint()), OnChange: rec.on})
	if err != nil {
		t.Fatal(err)
	}
	defer v.Close()
	r0, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer r0.Close(context.Background())
	r1, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: dial(t, etcd.Endpoint()), TTL: 5 * time.Second})
	defer r1.Close(context.Background())
	if err := r0.Set([]registry.Entry{rankEntry("P", "127.0.0.1:7100", 0, 2, 10)}); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Join, "P", 10)
	if err := r1.Set([]registry.Entry{rankEntry("P", "127.0.0.1:7101", 1, 2, 20)}); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Generation, "P", 0) // rank 1 joined

	// Rank 0's server restarted: a new generation on the same key.
	if err := r0.Set([]registry.Entry{rankEntry("P", "127.0.0.1:7100", 0, 2, 11)}); err != nil {
		t.Fatal(err)
	}
	want(t, rec.next(t, 5*time.Second), registry.Generation, "P", 0)
	// (Set returns before its put, and a change may be seen twice: rank
	// 0's Close below must not cut that put short.)
	cli := dial(t, etcd.Endpoint())
	k := registry.Key("/kvxfer", "P", "127.0.0.1:7100")
	for deadline := time.Now().Add(5 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		res, err := cli.Get(context.Background(), k)
		if err == nil && len(res.Kvs) == 1 {
			if e, err := registry.Decode("/kvxfer", k, res.Kvs[0].Value); err == nil && e.Generation == 11 {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("rank 0's restarted entry (generation 11) not in etcd within 5 s")
		}
	}

	// Rank 0's server is gone; rank 1's stays: P has no rank 0.
	if err := r0.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	// Within three TTLs: Close deletes the entry at once, unless its
	// lease was just lost and Close cut the new grant short; then the
	// entry goes at its old lease's end (flaked in CI at 5 s).
	c := rec.next(t, 15*time.Second)
	for c.Kind == registry.Generation { // rank 0's restart, when a change before was seen twice
		c = rec.next(t, 15*time.Second)
	}
	want(t, c, registry.RankGone, "P", 0)
	if c.Entry.Peer() != "127.0.0.1:7100" || c.Entry.Ranks[0].TP != 0 {
		t.Errorf("RankGone's entry = %+v, want rank 0's at 127.0.0.1:7100", c.Entry)
	}
	if e, ok := v.Lookup("P"); !ok || e.Peer() != "127.0.0.1:7101" {
		t.Errorf("Lookup(P) = %s, %v; want rank 1's server", e.Peer(), ok)
	}
	_ = r1.Close(context.Background())
	// Within three TTLs, as for rank 0 above: Close deletes the entry at
	// once, unless its lease was just lost and Close cut the new grant
	// short; then it goes at its old lease's end (5 s, the wait's bound).
	want(t, rec.next(t, 15*time.Second), registry.Leave, "P", 0)
}

// An entry that lists a rank twice is not one a daemon writes (it
// publishes each rank it serves once): it is refused naming the second
// listing, as any other malformed entry. Before, it was taken in.
func TestDecodeRefusesARankListedTwice(t *testing.T) {
	k := registry.Key("/kvxfer", "P", "127.0.0.1:7001")
	b := []byte(`{"v":1,"engine_id":"P","role":"producer","mode":"push","tp_size":2,"pp_size":1,"ranks":[{"tp":1,"pp":0,"peer":"127.0.0.1:7001"},{"tp":1,"pp":0,"peer":"127.0.0.1:7001"}],"generation":1}`)
	_, err := registry.Decode("/kvxfer", k, b)
	var be *registry.BadEntryError
	if !errors.As(err, &be) || be.Field != "ranks[1]" || registry.Field(err) != "ranks[]" {
		t.Fatalf("Decode(rank tp 1 pp 0 twice) = %v, want a BadEntryError naming ranks[1]", err)
	}
	e := rankEntry("P", "127.0.0.1:7001", 1, 2, 1)
	e.Ranks = append(e.Ranks, e.Ranks[0])
	if _, err := e.Encode(k); !errors.As(err, &be) || be.Field != "ranks[1]" {
		t.Fatalf("Encode(rank tp 1 pp 0 twice) = %v, want a BadEntryError naming ranks[1]", err)
	}
}
