package test

import (
	"fmt"
	"io"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// P's daemon, the process that posts P's WRITEs, is SIGKILLed while D's
// push requests wait on it, on the same host. D's requests each end once,
// failed (peer_gone) naming producer engine P, well within D's fence
// timeout (2 x its 30 s lease: 60 s), and their blocks are free: a new P
// daemon transfers into the same blocks. Over NIXL, D sees P's agent's
// process exited (its pidfd) and fences it without the confirmation the
// dead process cannot send. Before, over NIXL, D waited the whole fence
// timeout (no outcome within 20 s); over the built-in backend revoking
// the grants fenced at once already.
func TestPushProducerWriterKilled(t *testing.T) {
	t.Run("builtin", func(t *testing.T) { pushProducerWriterKilled(t) })
	t.Run("nixl", func(t *testing.T) {
		skipWithoutNixl(t)
		useBackend(t, "nixl")
		pushProducerWriterKilled(t)
	})
}

func pushProducerWriterKilled(t *testing.T) {
	dir := world(t)
	pAddr, pMetrics, dMetrics := freeAddr(t), freeAddr(t), freeAddr(t)
	p := startDaemon(t, dir, "P", "-peer-listen", pAddr, "-metrics-listen", pMetrics)
	d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics, "-peer-timeout", "2s")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	transferOnce(t, P, D, p.Peer, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the kill")
	blocks := func(i int) []topology.BlockID {
		return []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}
	}
	var dIDs []string
	for i := range 3 {
		id := fmt.Sprintf("k%d", i)
		registerD(t, D, "d-"+id, "t-"+id, p.Peer, blocks(i))
		dIDs = append(dIDs, "d-"+id)
	}
	regsReachP(t, 3, 10*time.Second, scrapeOf(t, pMetrics))
	_ = p.Kill()
	killed := time.Now()
	P.Close()
	const within = 20 * time.Second // the fence timeout is 60 s
	got := outcomesOf(t, D, within, dIDs...)
	endedOnce(t, "D", got, dIDs, within)
	for _, id := range dIDs {
		if o, ok := got[id]; ok && (o.Kind != kvxfer.FailurePeerGone || !strings.Contains(o.Reason, "producer engine P")) {
			t.Errorf("%s: %+v, want failed (peer_gone) naming producer engine P", id, o)
		}
	}
	t.Logf("D's requests ended %v after P's daemon was killed", time.Since(killed).Round(time.Millisecond))
	if again := outcomesOf(t, D, 500*time.Millisecond, dIDs...); len(again) > 0 {
		t.Errorf("D reported again: %v", again)
	}
	if daemonBackend == "nixl" {
		if m := rawMetrics(t, dMetrics); !strings.Contains(m, `reason="fence_writer_exited"`) {
			t.Error("D's metrics count no kvxfer_dropped_messages_total{reason=\"fence_writer_exited\"}")
		}
	}
	p2 := startDaemon(t, dir, "P2", "-peer-listen", pAddr)
	P2 := attachAgain(t, dir, p2, "P", 1, kvxfer.ModePush)
	defer P2.Close()
	for i := range 3 {
		transferOnce(t, P2, D, p2.Peer, fmt.Sprintf("new%d", i), blocks(i), 10*time.Second, "in the ended requests' blocks")
	}
	settled(t, "D's daemon", dMetrics, 1e9, 0)
}

// P's daemon is frozen (SIGSTOP), alive, while D's push requests wait on
// it over NIXL: D gives P up as gone after its peer timeout (1 s), but a
// frozen process may still WRITE once it thaws, and NIXL has no grants to
// refuse it: D keeps the blocks until the fence times out (2 x its 3 s
// lease: 6 s), not earlier, and the reason says so.
func TestPushProducerWriterFrozenWaitsForFence(t *testing.T) {
	skipWithoutNixl(t)
	useBackend(t, "nixl")
	dir := world(t)
	pMetrics := freeAddr(t)
	p := startDaemon(t, dir, "P", "-metrics-listen", pMetrics)
	d := startDaemon(t, dir, "D", "-peer-timeout", "1s", "-lease", "3s")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	transferOnce(t, P, D, p.Peer, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the freeze")
	var dIDs []string
	for i := range 3 {
		id := fmt.Sprintf("f%d", i)
		registerD(t, D, "d-"+id, "t-"+id, p.Peer, []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)})
		dIDs = append(dIDs, "d-"+id)
	}
	regsReachP(t, 3, 10*time.Second, scrapeOf(t, pMetrics))
	if err := p.Freeze(); err != nil {
		t.Fatal(err)
	}
	frozen := time.Now()
	defer func() { _ = p.Signal(syscall.SIGCONT) }()
	// Given up as gone after 1 s; the fence times out at 1 s + 6 s.
	if early := outcomesOf(t, D, 4*time.Second, dIDs...); len(early) > 0 {
		t.Fatalf("D reported %v within %v of P's freeze, before its fence timed out: a thawed P could still WRITE into those blocks",
			early, time.Since(frozen).Round(time.Millisecond))
	}
	got := outcomesOf(t, D, 20*time.Second, dIDs...)
	endedOnce(t, "D", got, dIDs, 20*time.Second)
	for _, id := range dIDs {
		if o, ok := got[id]; ok && !strings.Contains(o.Reason, "fence timed out") {
			t.Errorf("%s: %+v, want its reason to say the fence timed out", id, o)
		}
	}
	t.Logf("D's requests ended %v after P's daemon was frozen", time.Since(frozen).Round(time.Millisecond))
}

func rawMetrics(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("scrape %s: %v", addr, err)
	}
	return string(b)
}
