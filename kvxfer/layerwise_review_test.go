package kvxfer

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
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

// preemptedStep is a step whose metadata says the engine preempted the
// layer-wise producers ids (StepMeta.Preempted) and, if blk is not 0,
// lists id's prefill again into block blk.
func (tc *traceCore) preemptedStep(step uint64, ids []string, id string, blk topology.BlockID) string {
	meta := &StepMeta{Step: step, SchedulerClock: tc.now, Preempted: ids}
	if blk != 0 {
		meta.Prefill = []SendReq{{ReqID: id, Blocks: []topology.Span{{IDs: []topology.BlockID{blk}}}, Tokens: 16}}
	}
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	out := strings.Join(tc.drive(nil, ""), "\n")
	if out == "" {
		return "(nothing)"
	}
	return out
}

// A preempted layer-wise producer with a layer's WRITE of its first
// attempt in flight writes nothing from its freed blocks, and nothing of
// its second attempt until that WRITE ended (it could land after, over a
// fresh layer); then every layer goes again, from the new blocks, and the
// completion notice follows the last: one outcome, done; nothing held.
func TestLayerwisePreemptedWaitsForFirstAttempt(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	if got := add(tc.layer(1, 0)); !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q, want its WRITE", got)
	}
	if got := add(tc.preemptedStep(2, []string{"p-1"}, "", 0)); strings.Contains(got, "outcome") || strings.Contains(got, "notify") {
		t.Fatalf("preempted: %q, want no outcome and nothing told to D", got)
	}
	if got := add(tc.layer(1, 1)); strings.Contains(got, "post") {
		t.Errorf("a layer of the first attempt after the preemption: %q, want nothing written from freed blocks", got)
	}
	add(tc.preemptedStep(3, nil, "p-1", 2))
	for l := range 3 {
		if got := add(tc.layer(3, l)); strings.Contains(got, "post") {
			t.Errorf("layer %d of the second attempt with the first's WRITE in flight: %q, want nothing yet", l, got)
		}
	}
	got := add(tc.run(t, "ended xfer=1"))
	if n := count(got, "post"); n != 1 || !strings.Contains(got, "post #2") {
		t.Errorf("the first attempt's WRITE ended: %q, want the second's saved layers posted (one WRITE)", got)
	}
	add(tc.run(t, "ended xfer=2"))
	add(tc.run(t, "step send=p-1 blocks=2 tokens=16"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 done") {
		t.Errorf("outcomes:\n%s\nwant one, done", out)
	}
	if count(out, "notify D/0 done dreq=d-1") != 1 || strings.Contains(out, "notify D/0 fail") {
		t.Errorf("notices to D:\n%s\nwant one completion notice", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 || len(tc.st.handles) != 0 {
		t.Errorf("after the outcome: %d requests held, layer steps %v, %d handles; want none", tc.st.sends.len(), tc.st.layerSteps, len(tc.st.handles))
	}
}

// A preempted layer-wise producer its engine then aborts (it never
// resumes) ends once, aborted, once its first attempt's WRITE ended; its
// consumer is told it failed; nothing more is written. One finished
// without a new prefill entry is written from its finish's blocks. A
// preemption of a request the rank does not hold prefilling is counted
// (dropped "preempted_not_prefilling") and changes nothing.
func TestLayerwisePreemptedThenAbortedOrFinished(t *testing.T) {
	t.Run("aborted", func(t *testing.T) {
		tc := newLayers3Core(t)
		all, add := registeredMidPrefill(t, tc)
		add(tc.layer(1, 0))
		add(tc.preemptedStep(2, []string{"p-1"}, "", 0))
		if got := add(tc.run(t, "step abort=p-1")); strings.Contains(got, "outcome") {
			t.Errorf("aborted with a WRITE in flight: %q, want no outcome yet", got)
		}
		add(tc.run(t, "ended xfer=1"))
		add(tc.run(t, "advance 31s"))
		out := strings.Join(*all, "\n")
		if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 aborted") {
			t.Errorf("outcomes:\n%s\nwant one, aborted", out)
		}
		if count(out, "notify D/0 fail") != 1 || strings.Contains(out, "notify D/0 done") || count(out, "post") != 1 {
			t.Errorf("to D:\n%s\nwant one failure notice, one WRITE (layer 0's)", out)
		}
		if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 {
			t.Errorf("%d requests held, layer steps %v; want none", tc.st.sends.len(), tc.st.layerSteps)
		}
	})
	t.Run("finished", func(t *testing.T) {
		tc := newLayers3Core(t)
		all, add := registeredMidPrefill(t, tc)
		add(tc.layer(1, 0))
		add(tc.run(t, "ended xfer=1"))
		add(tc.preemptedStep(2, []string{"p-1", "p-9"}, "", 0))
		if n := tc.st.metrics.Snapshot().Dropped["preempted_not_prefilling"]; n != 1 {
			t.Errorf("preempted_not_prefilling = %d, want 1 (p-9)", n)
		}
		if got := add(tc.run(t, "step send=p-1 blocks=3 tokens=16")); count(got, "post") != 1 {
			t.Errorf("finished after its preemption: %q, want every layer written (one WRITE)", got)
		}
		add(tc.run(t, "ended xfer=2"))
		out := strings.Join(*all, "\n")
		if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 done") {
			t.Errorf("outcomes:\n%s\nwant one, done", out)
		}
		if s := tc.st.sends.get("p-1"); s != nil {
			t.Errorf("p-1 still held: %+v", s)
		}
	})
}

// The Scheduler's side of a preemption (FinishPreempted): a listing not
// built yet is dropped (no worker heard of it) and nothing is named; one
// built is named once in the next step's Preempted; either way the
// request is listed anew by its next Prefill, and its finish is a normal
// one (it holds its blocks, once). A request never listed names nothing.
func TestSchedulerPreempted(t *testing.T) {
	s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Layerwise = true })
	r := &Request{ID: "p-1", PromptTokens: 16, Params: &TransferParams{TransferID: "t1", DoRemoteDecode: true}}
	blocks := func(b topology.BlockID) [][]topology.BlockID { return [][]topology.BlockID{ids(b)} }
	pre := func() {
		t.Helper()
		if delay, params, err := s.RequestFinished(r, FinishPreempted, nil, 0); delay || params != nil || err != nil {
			t.Fatalf("RequestFinished(preempted) = %v, %v, %v; want no delay, no params, no error", delay, params, err)
		}
	}
	// Not listed at all: nothing.
	pre()
	if m := s.BuildMeta(); len(m.Preempted)+len(m.NotProcessed)+len(m.Prefill) != 0 {
		t.Fatalf("preempted before any Prefill: %+v, want an empty step", m)
	}
	// Listed, preempted before the step was built: dropped, unnamed.
	if err := s.Prefill(r, blocks(1), 0, 16); err != nil {
		t.Fatal(err)
	}
	pre()
	if m := s.BuildMeta(); len(m.Preempted)+len(m.Prefill) != 0 {
		t.Fatalf("preempted before its listing was built: %+v, want neither listed nor named", m)
	}
	// Listed and built, then preempted: named once; listed anew after.
	if err := s.Prefill(r, blocks(2), 0, 16); err != nil {
		t.Fatal(err)
	}
	if m := s.BuildMeta(); len(m.Prefill) != 1 {
		t.Fatalf("step: %+v, want p-1 listed", m)
	}
	pre()
	pre() // a repeat does not name it twice
	if !s.HasPendingWork() {
		t.Error("a preemption staged is pending work")
	}
	if err := s.Prefill(r, blocks(3), 0, 16); err != nil {
		t.Fatal(err)
	}
	m := s.BuildMeta()
	if len(m.Preempted) != 1 || m.Preempted[0] != "p-1" || len(m.Prefill) != 1 || m.Prefill[0].Blocks[0].IDs[0] != 3 || len(m.NotProcessed) != 0 {
		t.Fatalf("step: Preempted %v, Prefill %+v, NotProcessed %v; want p-1 named once and listed anew from block 3", m.Preempted, m.Prefill, m.NotProcessed)
	}
	delay, params, err := s.RequestFinished(r, FinishStopped, blocks(3), 16)
	if err != nil || !delay || params == nil {
		t.Fatalf("finish = %v, %v, %v; want its blocks held", delay, params, err)
	}
	if m := s.BuildMeta(); len(m.Send) != 1 || len(m.Preempted) != 0 {
		t.Fatalf("finish step: %+v, want its SendReq alone", m)
	}
}

// A layer-wise producer aborted with its layers' WRITEs in flight (every
// layer posted) never tells its consumer it completed: its engine freed
// its blocks before the abort reached the rank, so a WRITE still in flight
// may have read another request's KV from them. The consumer is told it
// failed (it recomputes), once; the producer ends once, aborted. Before,
// the last WRITE's end sent the completion notice (pushLayerDone) and the
// consumer decoded from whatever the WRITEs read.
func TestLayerwiseAbortedInFlightNeverDone(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	for l := range 3 {
		add(tc.layer(1, l))
	}
	add(tc.run(t, "step abort=p-1"))
	for x := 1; x <= 3; x++ {
		add(tc.run(t, fmt.Sprintf("ended xfer=%d", x)))
	}
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if n := count(out, "notify D/0 done"); n != 0 {
		t.Errorf("to D:\n%s\nwant no completion notice for an aborted producer", out)
	}
	if n := count(out, "notify D/0 fail"); n != 1 {
		t.Errorf("to D:\n%s\nwant one failure notice", out)
	}
	if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 aborted") {
		t.Errorf("outcomes:\n%s\nwant one, aborted", out)
	}
}

// A layer-wise request whose finish names other blocks than its prefill
// entry did (its engine moved it, a preemption it did not tell) has every
// layer written again from the finish's blocks once the prefill's WRITEs
// ended: the layers written from the prefill's blocks may hold another
// request's KV by then. Its consumer is told it completed once, after
// that. Blocks added at the end (tokens decoded since) are no move.
// Before, the finish wrote nothing more and told the consumer it completed.
func TestLayerwiseFinishFromMovedBlocksRewrites(t *testing.T) {
	for _, tc := range []struct {
		finish string
		moved  bool
	}{{"blocks=2", true}, {"blocks=1,4", false}} {
		t.Run(tc.finish, func(t *testing.T) {
			c := newLayers3Core(t)
			all, add := registeredMidPrefill(t, c)
			for l := range 3 {
				add(c.layer(1, l))
			}
			add(c.run(t, "ended xfer=1"))
			add(c.run(t, "ended xfer=2"))
			got := add(c.run(t, "step send=p-1 "+tc.finish+" tokens=16"))
			if strings.Contains(got, "post") || strings.Contains(got, "notify") {
				t.Errorf("finish with a WRITE of the prefill in flight: %q, want nothing until it ends", got)
			}
			got = add(c.run(t, "ended xfer=3"))
			if tc.moved != strings.Contains(got, "post #4") {
				t.Errorf("the prefill's last WRITE ended: %q, want every layer written again: %v", got, tc.moved)
			}
			if tc.moved {
				add(c.run(t, "ended xfer=4"))
			}
			out := strings.Join(*all, "\n")
			if count(out, "notify D/0 done") != 1 || count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 done") {
				t.Errorf("log:\n%s\nwant one completion notice and one outcome, done", out)
			}
		})
	}
}

// The consumer gives up (its deadline passed) while its producer is
// preempted with a layer's WRITE in flight: its cancel is acknowledged
// once that WRITE ended, and nothing of the second attempt is written
// into the blocks it gave up; the producer ends once, failed, at its
// finish, and holds nothing.
func TestLayerwisePreemptedConsumerGivesUp(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	add(tc.layer(1, 0))
	add(tc.preemptedStep(2, []string{"p-1"}, "", 0))
	if got := add(tc.run(t, "notif from=D/0 kind=cancel dreq=d-1 preq=p-1 reason=deadline")); strings.Contains(got, "ack") {
		t.Errorf("cancel with the first attempt's WRITE in flight: %q, want no ack yet", got)
	}
	if got := add(tc.run(t, "ended xfer=1")); !strings.Contains(got, "notify D/0 ack") {
		t.Errorf("the WRITE ended: %q, want the cancel acknowledged", got)
	}
	add(tc.preemptedStep(3, nil, "p-1", 2))
	for l := range 3 {
		add(tc.layer(3, l))
	}
	add(tc.run(t, "step send=p-1 blocks=2 tokens=16"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if n := count(out, "post"); n != 1 {
		t.Errorf("log:\n%s\nwant one WRITE (the first attempt's layer 0), none after the cancel", out)
	}
	if strings.Contains(out, "notify D/0 done") {
		t.Errorf("log:\n%s\nwant no completion notice", out)
	}
	if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 failed") {
		t.Errorf("outcomes:\n%s\nwant one, failed", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 || len(tc.st.handles) != 0 {
		t.Errorf("%d requests held, layer steps %v, %d handles; want none", tc.st.sends.len(), tc.st.layerSteps, len(tc.st.handles))
	}
}

// Preempted and prefilled again in the same step, then preempted again
// with a WRITE of its second attempt in flight and prefilled a third time:
// each attempt waits for the previous one's WRITEs, only the last one's
// layers complete the transfer, one completion notice, one outcome, done.
func TestLayerwisePreemptedTwice(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	add(tc.layer(1, 0))
	add(tc.run(t, "ended xfer=1"))
	add(tc.preemptedStep(2, []string{"p-1"}, "p-1", 2)) // same step
	if got := add(tc.layer(2, 0)); !strings.Contains(got, "post #2") {
		t.Fatalf("layer 0 of the second attempt (nothing in flight): %q, want its WRITE", got)
	}
	add(tc.preemptedStep(3, []string{"p-1"}, "", 0))
	add(tc.preemptedStep(4, nil, "p-1", 3))
	for l := range 3 {
		if got := add(tc.layer(4, l)); strings.Contains(got, "post") {
			t.Errorf("layer %d of the third attempt, the second's WRITE in flight: %q, want nothing yet", l, got)
		}
	}
	if got := add(tc.layer(2, 1)); strings.Contains(got, "post") {
		t.Errorf("a late layer of the second attempt: %q, want nothing", got)
	}
	if got := add(tc.run(t, "ended xfer=2")); !strings.Contains(got, "post #3") {
		t.Errorf("the second attempt's WRITE ended: %q, want the third's layers", got)
	}
	add(tc.run(t, "ended xfer=3"))
	add(tc.run(t, "step send=p-1 blocks=3 tokens=16"))
	out := strings.Join(*all, "\n")
	if count(out, "notify D/0 done") != 1 || count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 done") {
		t.Errorf("log:\n%s\nwant one completion notice, one outcome, done", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 {
		t.Errorf("%d requests held, layer steps %v; want none", tc.st.sends.len(), tc.st.layerSteps)
	}
}

// A preempted producer paired with two consumer ranks, one of which
// cancels with the first attempt's WRITE into it in flight: once that
// WRITE ends (the last one in flight), the other rank gets every layer of
// the second attempt and its completion notice. Before this was
// guarded, the cancelled rank's WRITE ending did not end the wait, and
// the other rank got nothing until the lease ran out (an earlier version
// of this change).
func TestLayerwisePreemptedOneRankCancelsOtherCompletes(t *testing.T) {
	tc := newLayersCore(t, 0, 1)
	tc.prefill(1, "p-1")
	var all []string
	add := func(s string) string { all = append(all, s); return s }
	add(tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5 tp=2"))
	add(tc.run(t, "notif from=D/1 kind=reg dreq=d-1 preq=p-1 spans=5 tp=2"))
	add(tc.hsLayers("D", 2))
	if got := add(tc.layer(1, 0)); count(got, "post #") != 2 {
		t.Fatalf("layer 0: %q, want a WRITE per consumer rank", got)
	}
	add(tc.run(t, "ended xfer=2"))
	add(tc.preemptedStep(2, []string{"p-1"}, "", 0))
	add(tc.run(t, "notif from=D/0 kind=cancel dreq=d-1 preq=p-1 reason=gone tp=2"))
	add(tc.preemptedStep(3, nil, "p-1", 4))
	add(tc.layer(3, 0))
	add(tc.layer(3, 1))
	add(tc.run(t, "step send=p-1 blocks=4 tokens=16"))
	got := add(tc.run(t, "ended xfer=1"))
	if !strings.Contains(got, "post #3") || !strings.Contains(got, "D/1") {
		t.Errorf("the last WRITE of the first attempt ended: %q, want the second attempt written to D/1", got)
	}
	add(tc.run(t, "ended xfer=3"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(all, "\n")
	if count(out, "notify D/1 done") != 1 || strings.Contains(out, "notify D/0 done") {
		t.Errorf("log:\n%s\nwant one completion notice, to D/1", out)
	}
	if count(out, "outcome send p-1") != 1 {
		t.Errorf("log:\n%s\nwant one outcome", out)
	}
	if tc.st.sends.len() != 0 || len(tc.st.layerSteps) != 0 {
		t.Errorf("%d requests held, layer steps %v; want none", tc.st.sends.len(), tc.st.layerSteps)
	}
}
