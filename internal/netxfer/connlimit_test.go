package netxfer

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"sync"
	"testing"
	"time"
)

// idleConns dials n TCP connections to addr that never say anything, and
// returns how many of them the agent closed within wait (the others it
// holds, waiting for their authentication), closing them all before it
// returns.
func idleConns(t *testing.T, addr string, n int, wait time.Duration) (closed int) {
	t.Helper()
	conns := make([]net.Conn, 0, n)
	defer func() {
		for _, c := range conns {
			_ = c.Close()
		}
	}()
	for range n {
		c, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatalf("dial %s: %v", addr, err)
		}
		conns = append(conns, c)
	}
	var mu sync.Mutex
	var wg sync.WaitGroup
	deadline := time.Now().Add(wait)
	for _, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			_ = c.SetReadDeadline(deadline)
			_, err := c.Read(make([]byte, 1))
			if err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
				mu.Lock()
				closed++
				mu.Unlock()
			}
		}()
	}
	wg.Wait()
	return closed
}

// Connections to an agent's data port that do not authenticate are
// bounded from one address (MaxPendingPerAddr, default 64) and every
// incoming connection in all (MaxIncoming): one past a bound is closed as
// it is accepted and counted (Refused). Before, the data port took every
// connection anyone opened and held each for the authentication's 10 s
// (peerauth.DefaultTimeout): a client that opened them faster took every
// file descriptor of the process, an engine's own in the in-process
// placement. Authenticated peers still transfer once the idle ones went.
func TestDataPortConnsBounded(t *testing.T) {
	var mu sync.Mutex
	refused := map[string]int{}
	count := func(reason string) {
		mu.Lock()
		refused[reason]++
		mu.Unlock()
	}
	counted := func() map[string]int {
		mu.Lock()
		defer mu.Unlock()
		out := map[string]int{}
		for k, v := range refused {
			out[k] = v
		}
		return out
	}
	secret := "0123456789abcdef0123456789abcdef"
	mk := func(name string, cfg Config) (*Agent, []byte) {
		cfg.Name = fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64())
		cfg.DisableLocal, cfg.Auth, cfg.Refused = true, auth(t, secret), count
		ag, err := New(cfg)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ag.Close() })
		mem := make([]byte, 1<<16)
		if err := ag.Map(base, mem); err != nil {
			t.Fatal(err)
		}
		if err := ag.Register([]Region{{base, uint64(len(mem))}}); err != nil {
			t.Fatal(err)
		}
		return ag, mem
	}
	a, am := mk("a", Config{})
	b, bm := mk("b", Config{})
	if _, err := b.LoadPeer(a.Metadata()); err != nil {
		t.Fatal(err)
	}

	// The default per-address bound: 64 held, the rest closed at once.
	if got := idleConns(t, a.Addr(), 80, 3*time.Second); got != 16 {
		t.Fatalf("80 idle connections from one address: %d closed within 3 s, want 16 (64 held: MaxPendingPerAddr)", got)
	}
	if got := counted()["data_conns_per_addr"]; got != 16 {
		t.Errorf("refusals counted %v, want data_conns_per_addr 16", counted())
	}

	// A peer that authenticates still transfers (the idle ones closed:
	// wait for the agent to see them go).
	for i := range bm {
		bm[i] = byte(i*7 + 1)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		a.mu.Lock()
		n := a.mu.tcpIn
		a.mu.Unlock()
		if n == 0 || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	id, err := b.Post(Write, a.Name(), []Desc{{Local: base, Remote: base, Len: uint64(len(bm))}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, b, id); st != Done {
		t.Fatalf("write from an authenticated peer after the idle connections: %v, %v", st, err)
	}
	if !bytes.Equal(am, bm) {
		t.Fatal("the authenticated peer's bytes did not land")
	}

	// Every incoming connection in all: MaxIncoming.
	c, _ := mk("c", Config{MaxIncoming: 8})
	if got := idleConns(t, c.Addr(), 20, 3*time.Second); got != 12 {
		t.Fatalf("20 idle connections to an agent of MaxIncoming 8: %d closed within 3 s, want 12", got)
	}
	if got := counted()["data_conns"]; got != 12 {
		t.Errorf("refusals counted %v, want data_conns 12", counted())
	}
}
