package kvxfer

import (
	"strconv"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// preemptStep is a step in which the engine ends the layer-wise producer
// request id it held (preempted after its prefill: its blocks were freed)
// and prefills it again into block blk: NotProcessed and Prefill name the
// same id, the old request and the new one.
func (tc *traceCore) preemptStep(step uint64, id string, blk topology.BlockID) string {
	meta := &StepMeta{Step: step, SchedulerClock: tc.now, NotProcessed: []string{id},
		Prefill: []SendReq{{ReqID: id, Blocks: []topology.Span{{IDs: []topology.BlockID{blk}}}, Tokens: 16}}}
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	return strings.Join(tc.drive(nil, ""), "\n")
}

// heldBlocks is the blocks the core holds for producer request id, and
// whether it holds it prefilling.
func heldBlocks(tc *traceCore, id string) ([]topology.BlockID, bool, bool) {
	s := tc.st.sends.get(id)
	if s == nil {
		return nil, false, false
	}
	var ids []topology.BlockID
	for _, sp := range s.req.Blocks {
		ids = append(ids, sp.IDs...)
	}
	return ids, s.prefill, true
}

// A layer-wise producer its engine preempted after its prefill step and
// prefilled again in the next (the step's metadata ends the old request
// and lists the new one's prefill) is held again, from its new blocks: a
// consumer that registers only then, before the request's finish reaches
// P, gets its layers as they are saved, not a failure for the old
// request's abort (the new prefill was dropped, and the registration
// failed with "producer aborted").
func TestLayerwisePreemptedAndPrefilledAgain(t *testing.T) {
	tc := newLayers3Core(t)
	tc.prefill(1, "p-1")
	out := tc.preemptStep(2, "p-1", 2)
	if n := count(out, "outcome send p-1 aborted"); n != 1 {
		t.Errorf("the step that ends p-1 and prefills it again: %q, want the old request's one aborted outcome", out)
	}
	blocks, prefill, held := heldBlocks(tc, "p-1")
	if !held || !prefill || len(blocks) != 1 || blocks[0] != 2 {
		t.Fatalf("after the step: p-1 held %v, prefilling %v, blocks %v; want held, prefilling, from block 2", held, prefill, blocks)
	}
	tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5")
	if got := tc.hs3("D", 1); strings.Contains(got, "fail") {
		t.Fatalf("registration after the preemption: %q, want it paired with the new request", got)
	}
	if got := tc.layer(1, 0); strings.Contains(got, "post") {
		t.Errorf("a layer of the old prefill step: %q, want nothing written (its blocks are freed)", got)
	}
	for l := range 3 {
		got := tc.layer(2, l)
		if !strings.Contains(got, "post") {
			t.Fatalf("layer %d of the new prefill: %q, want its WRITE", l, got)
		}
		tc.run(t, "ended xfer="+strconv.Itoa(l+1))
	}
	got := tc.run(t, "step send=p-1 blocks=2 tokens=16")
	if strings.Contains(got, "post") {
		t.Errorf("finish: %q, want nothing more written", got)
	}
	if !strings.Contains(got, "outcome send p-1 done") {
		t.Errorf("finish: %q, want p-1 done", got)
	}
}

// writingWhenPreempted is a layer-wise producer core whose p-1, paired with
// D's d-1, has its layer 0's WRITE in flight (post #1) when its engine
// preempts it (p-1 ended, prefilled again into block 2).
func writingWhenPreempted(t *testing.T) (*traceCore, string) {
	t.Helper()
	tc := newLayers3Core(t)
	tc.prefill(1, "p-1")
	tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5")
	tc.hs3("D", 1)
	if got := tc.layer(1, 0); !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q, want its WRITE", got)
	}
	return tc, tc.preemptStep(2, "p-1", 2)
}

// A layer-wise producer preempted with a layer's WRITE in flight waits for
// it (the WRITE still reads its blocks) before it is forgotten. The new
// request its engine hands over meanwhile under the same id (its prefill
// again, then its finish) is not a duplicate to drop: it is held once the
// old one drains, and ends in an outcome of its own. Dropped, it never
// ended, and its engine held its blocks for good.
func TestLayerwisePreemptedWhileWriting(t *testing.T) {
	tc, got := writingWhenPreempted(t)
	all := []string{got}
	add := func(s string) string { all = append(all, s); return s }
	if strings.Contains(got, "outcome") || strings.Contains(got, "post") {
		t.Errorf("preempted with a WRITE in flight: %q, want nothing until it ends", got)
	}
	if got := add(tc.layer(2, 0)); strings.Contains(got, "post") {
		t.Errorf("a layer of the new prefill while the old request drains: %q, want nothing written", got)
	}
	if got := add(tc.run(t, "step send=p-1 blocks=2 tokens=16 deadline=30s")); strings.Contains(got, "post") {
		t.Errorf("the new request's finish while the old one drains: %q, want nothing written yet", got)
	}
	got = add(tc.run(t, "ended xfer=1"))
	if n := count(got, "outcome send p-1 aborted"); n != 1 {
		t.Errorf("the old request's WRITE ended: %q, want its one aborted outcome", got)
	}
	if !strings.Contains(got, "notify D/0 fail") {
		t.Errorf("the old request's WRITE ended: %q, want its consumer told", got)
	}
	blocks, prefill, held := heldBlocks(tc, "p-1")
	if !held || prefill || len(blocks) != 1 || blocks[0] != 2 {
		t.Fatalf("after the old request drained: p-1 held %v, prefilling %v, blocks %v; want the new request held from block 2",
			held, prefill, blocks)
	}
	// Nobody registers for the new request: it ends at its lease, once.
	add(tc.run(t, "advance 31s"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(all, "\n")
	if n := count(out, "outcome send p-1"); n != 2 {
		t.Errorf("outcomes:\n%s\nwant two: the old request's and the new one's", out)
	}
	if !strings.Contains(out, "outcome send p-1 expired") {
		t.Errorf("outcomes:\n%s\nwant the new request expired at its lease", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 {
		t.Errorf("after both ended: %d requests held, layer steps %v; want none", tc.st.sends.len(), tc.st.layerSteps)
	}
}

// The new request waiting for an aborted one under its id to drain is
// aborted too: it ends at once, in one outcome, and is never held.
func TestLayerwisePreemptedThenAbortedWhileWriting(t *testing.T) {
	tc, got := writingWhenPreempted(t)
	all := []string{got}
	add := func(s string) string { all = append(all, s); return s }
	got = add(tc.run(t, "step abort=p-1"))
	if n := count(got, "outcome send p-1 aborted"); n != 1 {
		t.Errorf("the waiting request aborted: %q, want its one aborted outcome now", got)
	}
	add(tc.run(t, "ended xfer=1"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(all, "\n")
	if n := count(out, "outcome send p-1"); n != 2 {
		t.Errorf("outcomes:\n%s\nwant two aborted ones: the new request's and the old one's", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 {
		t.Errorf("after both ended: %d requests held, layer steps %v; want none", tc.st.sends.len(), tc.st.layerSteps)
	}
}

// The Worker closes while an aborted layer-wise producer drains its WRITE
// and a new request under its id waits for it: the new one fails at once
// (nothing new is held once the Worker closes), the aborted one ends as
// aborted at the close's fence timeout, each in one outcome, and nothing
// is held after (the new one, held at the old one's end, kept the close
// waiting).
func TestCloseWithANewRequestWaitingForAnAbortedOne(t *testing.T) {
	for _, now := range []bool{false, true} {
		tc, _ := writingWhenPreempted(t)
		tc.run(t, "step send=p-1 blocks=2 tokens=16")
		var all []string
		add := func(s string) string { all = append(all, s); return s }
		tc.st.Step(tc.now, input{kind: inClose})
		add(strings.Join(tc.drive(nil, ""), "\n"))
		if !now {
			add(tc.run(t, "ended xfer=1"))
		}
		tc.st.Step(tc.now, input{kind: inCloseNow})
		add(strings.Join(tc.drive(nil, ""), "\n"))
		out := strings.Join(all, "\n")
		if count(out, "outcome send p-1 failed") != 1 || count(out, "outcome send p-1 aborted") != 1 || count(out, "outcome send p-1") != 2 {
			t.Errorf("close (WRITE ended first: %v):\n%s\nwant the new request failed and the aborted one aborted, once each", !now, out)
		}
		if tc.st.sends.len() != 0 || tc.st.closeWaits() {
			t.Errorf("after the close: %d requests held (waits %v), want none", tc.st.sends.len(), tc.st.closeWaits())
		}
	}
}

// The core breaks (a contained panic) while an aborted producer drains
// and a new request under its id waits for it: each ends in one outcome,
// the aborted one as aborted, the new one failed.
func TestAbandonWithANewRequestWaitingForAnAbortedOne(t *testing.T) {
	tc, _ := writingWhenPreempted(t)
	tc.run(t, "step send=p-1 blocks=2 tokens=16")
	tc.st.abandon("core broke", nil)
	var got []string
	for _, o := range tc.st.out.Sending {
		got = append(got, o.ReqID+" "+o.Result.String())
	}
	if len(got) != 2 || got[0] != "p-1 aborted" || got[1] != "p-1 failed" {
		t.Errorf("outcomes %v, want [p-1 aborted, p-1 failed]: the aborted request's and the new one's", got)
	}
}
