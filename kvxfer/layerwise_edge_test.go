package kvxfer

import (
	"fmt"
	"strings"
	"testing"
)

// newLayersCore is a layer-wise push producer's core over simLayout's two
// layers (rank tp of tpSize), driven as the trace scripts drive theirs.
func newLayersCore(t *testing.T, tp, tpSize int) *traceCore {
	return newLayerwiseCoreOn(t, simLayout(tp, tpSize, 1<<20))
}

// hsLayers answers the core's handshake with engine of n ranks laid out
// as simLayout.
func (tc *traceCore) hsLayers(engine string, n int) string {
	h := &hsResult{engine: engine}
	for r := range n {
		agent := fmt.Sprintf("%s/%d", engine, r)
		h.res.Ranks = append(h.res.Ranks, RankInfo{EngineID: engine, CompatHash: "h", Layout: simLayout(r, n, 1<<30), Agent: []byte(agent)})
		h.names = append(h.names, PeerName(agent))
		h.loadErrs = append(h.loadErrs, nil)
	}
	h.res.Generation = 1
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	return strings.Join(tc.drive(nil, ""), "\n")
}

func (tc *traceCore) layer(step uint64, layer int) string {
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evLayer, step: step, layer: layer}})
	out := strings.Join(tc.drive(nil, ""), "\n")
	if out == "" {
		return "(nothing)"
	}
	return out
}

// A consumer that cancels while a layer's WRITE is in flight gets its
// acknowledgement once that WRITE ends, and no layer is written into its
// blocks after its cancel: it gave them up.
func TestLayerwiseCancelMidLayerWritesNoMore(t *testing.T) {
	tc := newLayersCore(t, 0, 1)
	tc.prefill(1, "p-1")
	if got := tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5"); got != "handshake D at D:1" {
		t.Fatalf("registration: %q", got)
	}
	t.Log(tc.hsLayers("D", 1))
	got := tc.layer(1, 0)
	if !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q, want its WRITE", got)
	}
	// D cancels while layer 0 lands.
	if got := tc.run(t, "notif from=D/0 kind=cancel dreq=d-1 preq=p-1 reason=gone"); got != "(nothing)" {
		t.Fatalf("cancel with a WRITE in flight: %q, want nothing until it ends", got)
	}
	// Layer 1 is saved meanwhile: nothing may go to D any more.
	if got := tc.layer(1, 1); strings.Contains(got, "post") {
		t.Fatalf("layer 1 saved after the cancel: %q, want no WRITE", got)
	}
	got = tc.run(t, "ended xfer=1")
	if strings.Contains(got, "post") {
		t.Errorf("after the cancel, layer 0 ended: %q: a layer was written after the consumer cancelled", got)
	}
	if !strings.Contains(got, "ack") {
		t.Errorf("layer 0 ended after the cancel: %q, want the cancel acknowledged", got)
	}
	got = tc.run(t, "step send=p-1 blocks=1 tokens=16")
	if strings.Contains(got, "post") || !strings.Contains(got, "outcome send p-1 failed") {
		t.Errorf("finish: %q, want one failed outcome and no WRITE", got)
	}
}

// A consumer rank that cancelled a layer-wise request and registers it
// again (its engine handed the request over once more, with new blocks:
// after a preemption, say) while the producer still prefills it is told
// at once that the producer gave that pairing up, as it is once the
// request finished (its tombstone), instead of waiting out its deadline;
// and nothing is written into either registration's blocks.
func TestLayerwiseReRegistrationAfterCancelAnswered(t *testing.T) {
	tc := newLayersCore(t, 0, 1)
	tc.prefill(1, "p-1")
	tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5")
	tc.hsLayers("D", 1)
	if got := tc.layer(1, 0); !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q", got)
	}
	tc.run(t, "ended xfer=1")
	if got := tc.run(t, "notif from=D/0 kind=cancel dreq=d-1 preq=p-1 reason=gone"); got != "notify D/0 ack dreq=d-1 preq=p-1" {
		t.Fatalf("cancel: %q", got)
	}
	before := tc.st.metrics.Snapshot().Dropped["reg_after_finish"]
	got := tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=7")
	if !strings.Contains(got, "notify D/0 fail dreq=d-1 preq=p-1") {
		t.Errorf("registration again after the cancel, while the producer prefills: %q, want the consumer rank told at once", got)
	}
	if n := tc.st.metrics.Snapshot().Dropped["reg_after_finish"]; n != before+1 {
		t.Errorf("reg_after_finish dropped = %d, want %d", n, before+1)
	}
	if got := tc.layer(1, 1); strings.Contains(got, "post") {
		t.Errorf("layer 1: %q, want nothing written", got)
	}
	if got := tc.run(t, "step send=p-1 blocks=1 tokens=16"); got != "outcome send p-1 failed (cancelled): consumer rank 0 cancelled: gone" {
		t.Errorf("finish: %q", got)
	}
}

// A layer-wise prefill entry past WorkerConfig.MaxRequests is refused, and
// its request ends in exactly one outcome: once, when its engine finishes
// it (its SendReq: a request reports once its engine's scheduler holds
// it), not once at the prefill and again at the finish.
func TestLayerwisePrefillOverLimitOneOutcome(t *testing.T) {
	tc := newLayersCore(t, 0, 1)
	tc.st.cfg.MaxRequests = 1
	tc.prefill(1, "p-1")
	var outs []string
	for _, line := range []string{"", "step send=p-2 blocks=2 tokens=16", "step send=p-1 blocks=1 tokens=16", "advance 31s"} {
		var got string
		if line == "" {
			got = tc.prefill(2, "p-2")
		} else {
			got = tc.run(t, line)
		}
		for _, l := range strings.Split(got, "\n") {
			if strings.HasPrefix(l, "outcome send p-2") {
				outs = append(outs, line+": "+l)
			}
		}
		if line == "" && len(outs) > 0 {
			t.Errorf("prefill past the limit reported at once (%q), before its engine finished it", outs)
		}
	}
	if len(outs) != 1 {
		t.Errorf("request p-2 (its prefill entry past MaxRequests): %d producer outcomes, want exactly 1: %q", len(outs), outs)
	}
}
