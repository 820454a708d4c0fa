package kvxfer_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A registry says the producer is gone (its lease ended): what waits on
// it fails at once, with probes off (negative PeerTimeout), naming it.
func TestPeerGoneEventFailsAtOnce(t *testing.T) {
	_, p, d, _ := livePair(t, -1)
	p.close(t)
	gone := time.Now()
	if err := d.workers[0][0].PeerGone("P", "its registry lease ended"); err != nil {
		t.Fatal(err)
	}
	if err := d.workers[0][0].PeerGone("nobody", "unknown engines are ignored"); err != nil {
		t.Fatal(err)
	}
	out := awaitOutcomes(t, 1, d)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone ||
		!strings.Contains(o[0].Reason, "producer engine P") || !strings.Contains(o[0].Reason, "lease ended") {
		t.Fatalf("D outcome %+v, want failed: producer engine P is gone, its lease ended", o)
	}
	if took := time.Since(gone); took > time.Second {
		t.Errorf("D's request ended %v after PeerGone, want at once", took)
	}
}

// A registry says the producer has a new generation (it restarted): with
// probes off, the consumer asks it at once and fails what waited on its
// old agents; a new request goes to the new ones.
func TestPeerGenerationEventIsARejoin(t *testing.T) {
	dir, p, d, _ := livePair(t, -1)
	p.close(t)
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	p2 := startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil)
	defer p2.close(t)
	res, err := dir.Handshake(context.Background(), "P", "")
	if err != nil {
		t.Fatal(err)
	}
	back := time.Now()
	if err := d.workers[0][0].PeerGeneration("P", res.Generation); err != nil {
		t.Fatal(err)
	}
	out := awaitOutcomes(t, 1, d)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, "restarted") {
		t.Fatalf("D outcome %+v, want failed: producer restarted", o)
	}
	if took := time.Since(back); took > time.Second {
		t.Errorf("the old request ended %v after PeerGeneration, want at once", took)
	}
}

// A registry's PeerGeneration that comes while a question to the engine is
// out (a probe to its old, dead address, which fails) is not dropped: the
// engine is asked again once that answer is in, and the rejoin is seen.
// The 5-minute fleet churn found consumers registering with a dead agent
// because the event came during such a probe.
func TestPeerGenerationDuringAProbeIsKept(t *testing.T) {
	dir, p, d, _ := livePair(t, -1)
	p.close(t)
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	p2 := startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil)
	defer p2.close(t)
	res, err := dir.Handshake(context.Background(), "P", "")
	if err != nil {
		t.Fatal(err)
	}
	release := dir.Hold("P")
	dir.FailHandshakes("P", 1) // the question out: the old address, dead
	if err := d.workers[0][0].PeerGeneration("P", res.Generation+1); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond) // the first question is out, held
	if err := d.workers[0][0].PeerGeneration("P", res.Generation); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	release()
	out := awaitOutcomes(t, 1, d)
	o := out.recv["d-a"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, "restarted") {
		t.Fatalf("D outcome %+v, want failed: producer restarted", o)
	}
}
