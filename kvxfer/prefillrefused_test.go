package kvxfer

import (
	"strings"
	"testing"
)

// A layer-wise producer prefilling on a rank (held with no lease: its
// finish or abort ends it) whose finish the rank refuses as malformed
// (Worker.Step's validation: its blocks past the rank's memory, say) ends
// there, once, failed (the engine, told the entry was refused, waits for
// its outcome to free its blocks, as for any refused entry; an aborted
// outcome it takes as a stale one): nothing more is written and its
// consumer is told it failed. Before, the refusal was dropped as a duplicate of the held
// request, which then prefilled for ever: no outcome, a MaxRequests slot
// lost, its consumer waiting out its deadline.
func TestLayerwiseRefusedFinishEndsPrefill(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	if got := add(tc.layer(1, 0)); !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q, want its WRITE", got)
	}
	// The finish, refused by the rank's validation.
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{Step: 2, SchedulerClock: tc.now},
		bad: []rejected{{role: RoleProducer, id: "p-1", reason: "send_req.blocks: block 99 past the region's 8"}}}})
	add(strings.Join(tc.drive(nil, ""), "\n"))
	if got := add(tc.layer(1, 1)); strings.Contains(got, "post") {
		t.Errorf("a layer after the refused finish: %q, want nothing more written", got)
	}
	add(tc.run(t, "ended xfer=1"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if n := count(out, "outcome send p-1"); n != 1 || !strings.Contains(out, "outcome send p-1 failed") {
		t.Errorf("outcomes of p-1: %d, want one, failed (the engine waits for it to free the blocks; an abort's it takes as stale):\n%s", n, out)
	}
	if strings.Contains(out, "notify D/0 done") || !strings.Contains(out, "notify D/0 fail") {
		t.Errorf("notices to D:\n%s\nwant a failure, no completion", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 || len(tc.st.handles) != 0 {
		t.Errorf("after it ended: %d requests held, layer steps %v, %d handles; want none", tc.st.sends.len(), tc.st.layerSteps, len(tc.st.handles))
	}
}

// The same, for one no consumer registered for yet: it fails at once, and
// a registration that comes for it later is told so.
func TestLayerwiseRefusedFinishEndsUnpairedPrefill(t *testing.T) {
	tc := newLayers3Core(t)
	tc.prefill(1, "p-1")
	tc.layer(1, 0)
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{Step: 2, SchedulerClock: tc.now},
		bad: []rejected{{role: RoleProducer, id: "p-1", reason: "send_req.blocks: block 99 past the region's 8"}}}})
	got := strings.Join(tc.drive(nil, ""), "\n")
	if count(got, "outcome send p-1 failed") != 1 {
		t.Errorf("refused finish: %q, want p-1 failed, once", got)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 {
		t.Errorf("after it ended: %d requests held, layer steps %v; want none", tc.st.sends.len(), tc.st.layerSteps)
	}
	tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5")
	if got := tc.hs3("D", 1); !strings.Contains(got, "notify D/0 fail") {
		t.Errorf("a registration after it failed: %q, want it told", got)
	}
}
