package netxfer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"
)

// TestLoadPeerMovedWithConnections: a peer loaded again under its name
// with other metadata (its process restarted elsewhere) while this agent
// holds connections to it has them failed, and the agent goes on: the
// old peer's connections are failed without the agent's lock held (each
// fails its parts under that lock), so LoadPeer returns, and the agent
// serves the peer at its new place.
func TestLoadPeerMovedWithConnections(t *testing.T) {
	const size = 1 << 16
	var stuck atomic.Bool // a is deadlocked: Close would hang too
	mk := func(name string) (*Agent, []byte) {
		ag, err := New(Config{Name: fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), DisableLocal: true, Conns: 2})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			if !stuck.Load() {
				_ = ag.Close()
			}
		})
		mem := make([]byte, size)
		if err := ag.Map(base, mem); err != nil {
			t.Fatal(err)
		}
		if err := ag.Register([]Region{{base, size}}); err != nil {
			t.Fatal(err)
		}
		return ag, mem
	}
	a, am := mk("a")
	b, bm := mk("b")
	if _, err := a.LoadPeer(b.Metadata()); err != nil {
		t.Fatal(err)
	}
	fill(am, 5)
	// A WRITE, so that a holds connections to b.
	id, err := a.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Done {
		t.Fatalf("WRITE before the reload: %v, %v", st, err)
	}
	if err := a.Release(id); err != nil {
		t.Fatal(err)
	}
	// b's name now names an agent at another address.
	loaded := make(chan error, 1)
	go func() {
		_, err := a.LoadPeer([]byte(metaPrefix + b.Name() + "\n127.0.0.1:1"))
		loaded <- err
	}()
	select {
	case err := <-loaded:
		if err != nil {
			t.Fatalf("LoadPeer(moved) = %v", err)
		}
	case <-time.After(10 * time.Second):
		stuck.Store(true)
		t.Fatal("LoadPeer of a peer that moved, with connections to it open, did not return in 10 s (the agent deadlocked)")
	}
	// Back at its place: the agent serves it, every byte.
	if _, err := a.LoadPeer(b.Metadata()); err != nil {
		t.Fatal(err)
	}
	id, err = a.Post(Write, b.Name(), []Desc{{Local: base + 8192, Remote: base + 8192, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Done {
		t.Fatalf("WRITE after the reload: %v, %v", st, err)
	}
	if !bytes.Equal(bm[:4096], am[:4096]) || !bytes.Equal(bm[8192:12288], am[8192:12288]) {
		t.Fatal("the WRITEs landed wrong bytes")
	}
}
