package test

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// Two engines on one kvxferd over NIXL. P's memory file shrinks under
// the daemon's mapping (its engine truncated it) while a WRITE is due:
// the WRITE faults, UCX finds the connection between the two agents
// broken, and that request fails on both sides. P's file grows back, and
// the next requests between the same engines are done, byte for byte:
// the daemon made the connection again. Before, NIXL refused every later
// post and notification between the two agents for as long as the
// daemon ran (each request failed), and D's request whose failure notice
// could not be sent had no outcome until its deadline.
func TestNIXLConnectionMadeAgainAfterAFault(t *testing.T) {
	skipWithoutNixl(t)
	dir := world(t)
	metrics := freeAddr(t)
	d, err := daemontest.Start(dir, "d", "nixl", "-socket-mode", "0666", "-metrics-listen", metrics)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if err := d.Stop(); err != nil {
			t.Errorf("stop: %v", err)
		}
		if t.Failed() {
			b, _ := os.ReadFile(d.Log)
			t.Logf("log:\n%s", b)
		}
	})
	P := attachSim(t, dir, d.Sock, d.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	transferOnce(t, P, D, d.Peer, "first", []topology.BlockID{0, 1}, 10*time.Second, "before the fault")
	file := filepath.Join(dir, "P-tp0")
	st, err := os.Stat(file)
	if err != nil {
		t.Fatal(err)
	}
	ids := []topology.BlockID{2, 3}
	registerD(t, D, "d-fault", "t-fault", d.Peer, ids)
	finishP(t, P, "p-fault", "t-fault", ids)
	if err := os.Truncate(file, 0); err != nil {
		t.Fatal(err)
	}
	pOut := make(chan map[string]kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P, 10*time.Second, "p-fault") }()
	o, ok := outcomesOf(t, D, 10*time.Second, "d-fault")["d-fault"]
	if !ok || o.Result == kvxfer.ResultDone {
		t.Errorf("D's request out of the shrunk file: %+v (reported: %v), want failed within 10 s", o, ok)
	}
	if o := (<-pOut)["p-fault"]; o.Result == kvxfer.ResultDone {
		t.Errorf("P's request out of the shrunk file: %+v, want failed", o)
	}
	if err := os.Truncate(file, st.Size()); err != nil {
		t.Fatal(err)
	}
	for i, id := range []string{"after-1", "after-2"} {
		transferOnce(t, P, D, d.Peer, id, []topology.BlockID{topology.BlockID(4 + 2*i), topology.BlockID(5 + 2*i)}, 10*time.Second, "after the fault")
	}
	if n := metricsOf(t, metrics)["kvxfer_nixl_connections_remade_total"]; n < 1 {
		t.Errorf("kvxfer_nixl_connections_remade_total = %v, want at least 1", n)
	}
}

// daemonBackend is the backend of the daemons startDaemon and
// startDaemonIn start ("builtin" unless a test says otherwise:
// useBackend).
var daemonBackend = "builtin"

// useBackend has the daemons the test starts run backend.
func useBackend(t *testing.T, backend string) {
	old := daemonBackend
	daemonBackend = backend
	t.Cleanup(func() { daemonBackend = old })
}

// Recovery scenarios over NIXL whose requests were posted to a
// producer's gone agents (its daemon back at once, its engine crashed
// and attached again): NIXL says the peer's process exited, or that the
// peer disconnected, where the built-in backend's connection is refused.
// D handshakes again and the request is done, as over the built-in
// backend. Before, the request failed ("its process ... exited", "nixl:
// post transfer: status -2").
func TestNIXLPostToGoneAgentsHandshakesAgain(t *testing.T) {
	skipWithoutNixl(t)
	useBackend(t, "nixl")
	t.Run("push-producer-daemon-back-at-once", func(t *testing.T) { pushProducerBackAtOnce(t, 0) })
	t.Run("pull-read-of-crashed-hold", func(t *testing.T) { pullReadOfCrashedHold(t, true) })
}
