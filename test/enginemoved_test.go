package test

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A producer engine comes back under its id at another address (its pod
// rescheduled on another host, its daemon on another port), right after
// D's handshake with it at the old one: D's first request that names the
// new address is done with its own bytes, in both modes and over both
// backends. Before, D's ranks knew the engine by its id alone and kept its
// old address until a handshake there failed: the first requests after
// the move went to the gone daemon and failed.
func TestProducerBackAtAnotherAddress(t *testing.T) {
	eachBackendAndMode(t, producerMoved)
}

// eachBackendAndMode runs f over both backends, in push and in pull.
func eachBackendAndMode(t *testing.T, f func(t *testing.T, mode kvxfer.Mode)) {
	for _, backend := range []string{"builtin", "nixl"} {
		t.Run(backend, func(t *testing.T) {
			if backend == "nixl" {
				skipWithoutNixl(t)
			}
			useBackend(t, backend)
			for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
				t.Run(mode.String(), func(t *testing.T) { f(t, mode) })
			}
		})
	}
}

func producerMoved(t *testing.T, mode kvxfer.Mode) {
	dir := world(t)
	dMetrics := freeAddr(t)
	p := startDaemon(t, dir, "P")
	d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics)
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, mode)
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, mode)
	defer D.Close()
	ids := []topology.BlockID{2, 3}
	if mode == kvxfer.ModePush {
		transferOnce(t, P, D, p.Peer, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the move")
	} else {
		pullOnce(t, P, D, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the move")
	}
	P.Close()
	p2 := startDaemon(t, dir, "P2") // while the old one holds its port: another address
	_ = p.Kill()
	if p2.Peer == p.Peer {
		t.Fatalf("P's daemon came back at its old address %s", p.Peer)
	}
	_ = os.Remove(filepath.Join(dir, "P-tp0"))
	P2 := attachSim(t, dir, p2.Sock, p2.Peer, "P", 1, mode)
	defer P2.Close()
	if mode == kvxfer.ModePush {
		transferOnce(t, P2, D, p2.Peer, "moved", ids, 10*time.Second, "P's first request at its new address")
	} else {
		pullOnce(t, P2, D, "moved", ids, 10*time.Second, "P's first request at its new address")
	}
	for id, o := range outcomesOf(t, D, 300*time.Millisecond, "none") {
		t.Errorf("D: %s reported again: %+v", id, o)
	}
}

// Two live producer engines share an id (a deployment that gives every
// replica the same engine id), at two addresses, and hold pull requests
// in the very same block ids with different KV. D reads them by turns:
// one at a time, each is read from the engine its params name and done
// with its own bytes; two at once, naming both engines, each ends once
// and none is done with the other engine's bytes. Over NIXL nothing but
// the engine's address and generation tells the two holds apart.
func TestTwoProducersShareAnID(t *testing.T) {
	for _, backend := range []string{"builtin", "nixl"} {
		t.Run(backend, func(t *testing.T) {
			if backend == "nixl" {
				skipWithoutNixl(t)
			}
			useBackend(t, backend)
			twoProducersOneID(t)
		})
	}
}

func twoProducersOneID(t *testing.T) {
	dir := world(t)
	p1, p2 := startDaemon(t, dir, "P1"), startDaemon(t, dir, "P2")
	dMetrics := freeAddr(t)
	d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics)
	// A short lease: a hold D does not read ends soon (within the 10 s
	// waited for below). 4 s, not 2: each turn's read, a handshake with
	// the other address first, must come within it, and a loaded machine
	// could take 2 s for that.
	attachP := func(dir string, p *daemontest.Proc) *simengine.Engine {
		m := simModel
		e, err := simengine.Attach(simengine.Config{Dir: dir, Sock: p.Sock, Peer: p.Peer, ID: "P", Model: &m, Engine: simEngine(1, 1),
			Mode: kvxfer.ModePull, Version: "test", Lease: 4 * time.Second})
		if err != nil {
			t.Fatal(err)
		}
		return e
	}
	P1 := attachP(dir, p1)
	defer P1.Close()
	// The second engine named P keeps its memory file apart.
	sub := filepath.Join(dir, "p2")
	if err := os.Mkdir(sub, 0o1777); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(sub, 0o1777); err != nil {
		t.Fatal(err)
	}
	P2 := attachP(sub, p2)
	defer P2.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePull)
	defer D.Close()
	X := []topology.BlockID{0, 1}
	// One at a time, by turns: each from the engine its params name.
	for i, P := range []*simengine.Engine{P1, P2, P1, P2} {
		id := fmt.Sprintf("turn%d", i)
		pullOnce(t, P, D, id, X, 10*time.Second, fmt.Sprintf("turn %d (engine P of daemon %d)", i, 1+i%2))
	}
	// Named back where it just left: the shared id is counted as bad
	// input (and logged as an error naming both addresses).
	if n := metricsOf(t, dMetrics)["kvxfer_bad_input_total"]; n < 1 {
		t.Errorf("D's kvxfer_bad_input_total = %v after P flip-flopped between two addresses, want the shared id counted", n)
	}
	// Both at once: P1 and P2 hold a request each in blocks X.
	params1 := finishPull(t, P1, "p-c1", "t-c1", X)
	params2 := finishPull(t, P2, "p-c2", "t-c2", X)
	Y := map[string][]topology.BlockID{"d-c1": {4, 5}, "d-c2": {6, 7}}
	readPull(t, D, "d-c1", params1, Y["d-c1"])
	readPull(t, D, "d-c2", params2, Y["d-c2"])
	got := outcomesOf(t, D, 15*time.Second, "d-c1", "d-c2")
	for id, tid := range map[string]string{"d-c1": "t-c1", "d-c2": "t-c2"} {
		o, ok := got[id]
		switch {
		case !ok:
			t.Errorf("D's %s: no outcome within 15 s", id)
		case o.Result == kvxfer.ResultDone:
			if err := D.Ranks[0].CheckRequest(kvsimReq(tid, X, Y[id]), 16, 16); err != nil {
				t.Errorf("D's %s done with bytes not its own (the other engine's?): %v", id, err)
			}
		}
		t.Logf("D's %s: %+v", id, o)
	}
	for id, o := range outcomesOf(t, D, 300*time.Millisecond, "none") {
		t.Errorf("D: %s reported again: %+v", id, o)
	}
	// Each engine's hold ends once: read, or its lease lapsed.
	for i, P := range []*simengine.Engine{P1, P2} {
		id := fmt.Sprintf("p-c%d", i+1)
		if _, ok := outcomesOf(t, P, 10*time.Second, id)[id]; !ok {
			t.Errorf("engine P of daemon %d: %s did not end within 10 s", i+1, id)
		}
	}
}

// A consumer engine comes back under its id at another address: the
// producer's first request for it is done on both sides, its bytes its
// own, in both modes and over both backends.
func TestConsumerBackAtAnotherAddress(t *testing.T) {
	eachBackendAndMode(t, consumerMoved)
}

func consumerMoved(t *testing.T, mode kvxfer.Mode) {
	dir := world(t)
	p := startDaemon(t, dir, "P")
	d := startDaemon(t, dir, "D")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, mode)
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, mode)
	once := func(D *simengine.Engine, id string, ids []topology.BlockID, when string) {
		t.Helper()
		if mode == kvxfer.ModePush {
			transferOnce(t, P, D, p.Peer, id, ids, 10*time.Second, when)
		} else {
			pullOnce(t, P, D, id, ids, 10*time.Second, when)
		}
	}
	once(D, "warm", []topology.BlockID{14, 15}, "before the move")
	D.Close()
	d2 := startDaemon(t, dir, "D2") // while the old one holds its port: another address
	_ = d.Kill()
	if d2.Peer == d.Peer {
		t.Fatalf("D's daemon came back at its old address %s", d.Peer)
	}
	_ = os.Remove(filepath.Join(dir, "D-tp0"))
	D2 := attachSim(t, dir, d2.Sock, d2.Peer, "D", 2, mode)
	defer D2.Close()
	once(D2, "moved", []topology.BlockID{2, 3}, "D's first request at its new address")
	for id, o := range outcomesOf(t, P, 300*time.Millisecond, "none") {
		t.Errorf("P: %s reported again: %+v", id, o)
	}
}
