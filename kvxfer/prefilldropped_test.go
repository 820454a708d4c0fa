package kvxfer

import (
	"slices"
	"strings"
	"testing"
)

// dropped runs Worker.StepDropped's event on tc's core and returns the
// ids it ended and what the core printed.
func (tc *traceCore) dropped(ids ...string) ([]string, string) {
	var ended []string
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evInspect, fn: func(st *loopState) {
		ended = st.stepDropped(nil, ids, "step 2, which finished or aborted it, was dropped: not published")
	}}})
	return ended, strings.Join(tc.drive(nil, ""), "\n")
}

// A dropped step (Worker.StepDropped) that finished a layer-wise producer
// the rank holds prefilling (no lease: only its finish or abort ends it)
// ends it as a refused finish does: nothing more is written, its
// consumer is told it failed, and it fails once, after its WRITE in
// flight ended. A request of the step the rank does not hold is left to
// the caller (no outcome here), and so is one held from its finish (its
// lease ends it). Before, the worker never heard of the drop: the request
// prefilled for ever.
func TestLayerwiseDroppedFinishEndsPrefill(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	if got := add(tc.layer(1, 0)); !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q, want its WRITE", got)
	}
	ended, got := tc.dropped("p-1", "q-none", "p-1")
	add(got)
	if !slices.Equal(ended, []string{"p-1"}) {
		t.Errorf("StepDropped ended %q, want p-1 only (q-none is not held; p-1 once)", ended)
	}
	if got := add(tc.layer(1, 1)); strings.Contains(got, "post") {
		t.Errorf("a layer after the dropped finish: %q, want nothing more written", got)
	}
	if strings.Contains(strings.Join(*all, "\n"), "outcome send p-1") {
		t.Errorf("p-1 reported while its WRITE is in flight:\n%s", strings.Join(*all, "\n"))
	}
	add(tc.run(t, "ended xfer=1"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if n := count(out, "outcome send p-1"); n != 1 || !strings.Contains(out, "outcome send p-1 failed") || !strings.Contains(out, "step 2") {
		t.Errorf("outcomes of p-1: %d, want one, failed, naming step 2:\n%s", n, out)
	}
	if strings.Contains(out, "q-none") {
		t.Errorf("q-none (not held) got something:\n%s", out)
	}
	if strings.Contains(out, "notify D/0 done") || !strings.Contains(out, "notify D/0 fail") {
		t.Errorf("notices to D:\n%s\nwant a failure, no completion", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 || len(tc.st.handles) != 0 {
		t.Errorf("after it ended: %d requests held, layer steps %v, %d handles; want none", tc.st.sends.len(), tc.st.layerSteps, len(tc.st.handles))
	}
	// Named again (the engine's step_ref repeated): nothing more.
	if ended, got := tc.dropped("p-1"); len(ended) != 0 || got != "" {
		t.Errorf("dropped again: ended %q, %q; want nothing", ended, got)
	}
}

// One no consumer registered for yet fails at once; one the rank holds
// from its finish (no longer prefilling) is left to its lease, and
// returned too: its outcome is the rank's, so the dropped step's error
// must not name it (the engine, told twice, would free its blocks at the
// first while its WRITEs may still read them). Before, only the ones
// ended were returned.
func TestLayerwiseDroppedFinishLeavesOthers(t *testing.T) {
	tc := newLayers3Core(t)
	tc.prefill(1, "p-1")
	tc.prefill(1, "p-2")
	tc.layer(1, 0)
	if got := tc.run(t, "step send=p-2 blocks=1 tokens=16"); got != "(nothing)" {
		t.Fatalf("p-2's finish: %q, want nothing yet", got)
	}
	ended, got := tc.dropped("p-1", "p-2")
	if !slices.Equal(ended, []string{"p-1", "p-2"}) || count(got, "outcome send p-1 failed") != 1 || strings.Contains(got, "p-2") {
		t.Errorf("StepDropped returned %q, printed %q; want p-1 failed once, p-2 (held from its finish) untouched, both returned", ended, got)
	}
	if tc.st.sends.len() != 1 || tc.st.sends.get("p-2") == nil {
		t.Errorf("held after: %d requests, want p-2 alone", tc.st.sends.len())
	}
}

// A request its engine aborted that the rank still holds (its WRITE in
// flight) ends as aborted, an outcome the engine takes for no request of
// its own: a dropped step naming its id names a new request under it,
// which the rank does not hold, so StepDropped does not return it (the
// caller ends it; returned, it got no outcome at all).
func TestDroppedStepLeavesAbortedToCaller(t *testing.T) {
	tc := newLayers3Core(t)
	_, add := registeredMidPrefill(t, tc)
	if got := add(tc.layer(1, 0)); !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q, want its WRITE", got)
	}
	tc.run(t, "step abort=p-1 tid=t1")
	if s := tc.st.sends.get("p-1"); s == nil || !s.aborted {
		t.Fatalf("p-1 after its abort: %+v, want held, aborted (its WRITE in flight)", s)
	}
	if ended, got := tc.dropped("p-1"); len(ended) != 0 || strings.Contains(got, "outcome") {
		t.Errorf("StepDropped returned %q, printed %q; want nothing (the aborted one's outcome is not the new request's)", ended, got)
	}
}
