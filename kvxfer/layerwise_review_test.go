package kvxfer

import (
	"strings"
	"testing"
)

// A LayerSaved that no request of its step takes (the step listed none on
// this rank, is not taken in yet, or its requests ended) is legitimate
// input, not bad input, and loses nothing: it is counted under a reason
// of its own (dropped "layer_saved_unknown_step"), so an engine that
// signals for steps it never sent, or ahead of them, shows. A layer
// signalled before its step is written at the request's finish: every
// layer reaches the consumer, once, and the request ends once, done.
// Before, such a signal was ignored without a trace.
func TestLayerSavedUnknownStepCountedNothingLost(t *testing.T) {
	tc := newLayers3Core(t)
	dropped := func() uint64 { return tc.st.metrics.Snapshot().Dropped["layer_saved_unknown_step"] }
	bad := func() int {
		n := 0
		for _, v := range tc.st.metrics.Snapshot().BadInput {
			n += int(v)
		}
		return n
	}
	var all []string
	add := func(s string) string { all = append(all, s); return s }
	// Layer 0 of step 1 before step 1 is taken in; a step never sent.
	if got := add(tc.layer(1, 0)); strings.Contains(got, "post") {
		t.Fatalf("a layer before its step: %q, want nothing written", got)
	}
	add(tc.layer(9, 2))
	if n := dropped(); n != 2 {
		t.Errorf("layer_saved_unknown_step = %d after two signals no request took, want 2", n)
	}
	add(tc.prefill(1, "p-1"))
	add(tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5"))
	add(tc.hs3("D", 1))
	for l := 1; l < 3; l++ {
		if got := add(tc.layer(1, l)); !strings.Contains(got, "post") {
			t.Fatalf("layer %d of the prefill step: %q, want its WRITE", l, got)
		}
	}
	// A duplicate of a layer posted already writes nothing again.
	if got := add(tc.layer(1, 1)); strings.Contains(got, "post") {
		t.Errorf("layer 1 again: %q, want nothing written twice", got)
	}
	add(tc.run(t, "ended xfer=1"))
	add(tc.run(t, "ended xfer=2"))
	// The finish writes the layer signalled before its step.
	if got := add(tc.run(t, "step send=p-1 blocks=1 tokens=16")); !strings.Contains(got, "post #3") {
		t.Fatalf("finish: %q, want layer 0 (saved before its step) written", got)
	}
	add(tc.run(t, "ended xfer=3"))
	// After the finish, a late signal for the step is taken by nobody.
	add(tc.layer(1, 2))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(all, "\n")
	if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 done") {
		t.Errorf("outcomes:\n%s\nwant one, done", out)
	}
	if count(out, "notify D/0 done dreq=d-1") != 1 || strings.Contains(out, "notify D/0 fail") {
		t.Errorf("notices to D:\n%s\nwant one completion notice", out)
	}
	if n := dropped(); n != 3 {
		t.Errorf("layer_saved_unknown_step = %d, want 3 (before its step, a step never sent, after the finish)", n)
	}
	if n := bad(); n != 0 {
		t.Errorf("bad input counted %d times, want none: %v", n, tc.st.metrics.Snapshot().BadInput)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 {
		t.Errorf("after the outcome: %d requests held, layer steps %v; want none", tc.st.sends.len(), tc.st.layerSteps)
	}
}
