package main

import "testing"

// The library holds at most maxDirects streams for the process: past it
// kvxfer_stream_open refuses, and a release makes room again.
func TestStreamTableBounded(t *testing.T) {
	old := maxDirects
	maxDirects = 3
	t.Cleanup(func() { maxDirects = old })
	if _, code, err := start(`{"insecure_peers": true, "log_level": "error"}`); err != nil {
		t.Fatalf("start: %d %v", code, err)
	}
	t.Cleanup(func() { _ = stop() })
	a, b, c := kvxferGoStreamOpen(nil, 0), kvxferGoStreamOpen(nil, 0), kvxferGoStreamOpen(nil, 0)
	if a == 0 || b == 0 || c == 0 {
		t.Fatalf("3 opens within the bound of 3: ids %d %d %d", a, b, c)
	}
	if id := kvxferGoStreamOpen(nil, 0); id != 0 {
		t.Fatalf("a 4th stream past the bound of 3: id %d", id)
	}
	kvxferGoStreamRelease(a)
	d := kvxferGoStreamOpen(nil, 0)
	if d == 0 {
		t.Fatal("no room after a release")
	}
	kvxferGoStreamRelease(b)
	kvxferGoStreamRelease(c)
	kvxferGoStreamRelease(d)
	directs.Lock()
	defer directs.Unlock()
	if len(directs.m) != 0 {
		t.Fatalf("%d streams held after every release", len(directs.m))
	}
}

// A server that stopped by itself (a listener gone: the daemon's watcher
// stops it, as Stop here) is not the running one: kvxfer_start starts a
// new one instead of handing out the dead server's endpoint (or refusing
// another configuration as if it ran), and streams are not opened on it.
func TestStartAfterServerStoppedByItself(t *testing.T) {
	cfg := `{"insecure_peers": true, "log_level": "error"}`
	ep, code, err := start(cfg)
	if err != nil {
		t.Fatalf("start: %d %v", code, err)
	}
	t.Cleanup(func() { _ = stop() })
	running.Lock()
	p := running.p
	running.Unlock()
	_ = p.Stop() // what the watcher does when a listener stops by itself
	if id := kvxferGoStreamOpen(nil, 0); id != 0 {
		kvxferGoStreamRelease(id)
		t.Error("a stream opened on a server that stopped")
	}
	ep2, code, err := start(cfg)
	if err != nil || ep2 == ep {
		t.Fatalf("start after the server stopped by itself: %q, %d %v; want a new server (the old one was at %q)", ep2, code, err, ep)
	}
	if _, code, err := start(`{"insecure_peers": true, "log_level": "warn"}`); code != statusStarted {
		t.Fatalf("another configuration while the new one runs: %d %v, want statusStarted", code, err)
	}
}
