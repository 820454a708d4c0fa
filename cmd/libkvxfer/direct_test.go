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
