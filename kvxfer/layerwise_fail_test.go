package kvxfer

import (
	"fmt"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// layers3 is simLayout with three layers (one region each).
func layers3(tp, tpSize int, base uint64) topology.Layout {
	l := simLayout(tp, tpSize, base)
	r := l.Regions[len(l.Regions)-1]
	r.Base += simRegionGap
	l.Regions = append(l.Regions, r)
	return l
}

// newLayers3Core is a layer-wise push producer's core over layers3.
func newLayers3Core(t *testing.T) *traceCore { return newLayerwiseCoreOn(t, layers3(0, 1, 1<<20)) }

// hs3 answers the core's handshake with a one-rank engine laid out as
// layers3, of generation gen (its agent named after it).
func (tc *traceCore) hs3(engine string, gen uint64) string {
	h := &hsResult{engine: engine}
	agent := fmt.Sprintf("%s/0", engine)
	if gen > 1 {
		agent = fmt.Sprintf("%s.g%d/0", engine, gen)
	}
	h.res.Ranks = append(h.res.Ranks, RankInfo{EngineID: engine, CompatHash: "h", Layout: layers3(0, 1, 1<<30), Agent: []byte(agent)})
	h.names = append(h.names, PeerName(agent))
	h.loadErrs = append(h.loadErrs, nil)
	h.res.Generation = gen
	h.probe = gen > 1 // a restart is found by a probe (or a registry's word)
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
	return strings.Join(tc.drive(nil, ""), "\n")
}

// prefillN lists requests prefilled in step, each on its own block.
func (tc *traceCore) prefillN(step uint64, ids ...string) string {
	meta := &StepMeta{Step: step, SchedulerClock: tc.now}
	for i, id := range ids {
		meta.Prefill = append(meta.Prefill, SendReq{ReqID: id, Blocks: []topology.Span{{IDs: []topology.BlockID{topology.BlockID(i + 1)}}}, Tokens: 16})
	}
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	return strings.Join(tc.drive(nil, ""), "\n")
}

// count counts the lines of out that start with prefix.
func count(out, prefix string) int {
	n := 0
	for _, l := range strings.Split(out, "\n") {
		if strings.HasPrefix(strings.TrimSpace(l), prefix) {
			n++
		}
	}
	return n
}

// A layer's WRITE that fails while another layer's is still in flight
// dooms the consumer rank: no later layer is posted into its blocks (it
// gets a failure notice once nothing is in flight, and will hand them
// back), and the request ends in one failed outcome.
func TestLayerwiseWriteFailureStopsLaterLayers(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	if got := add(tc.layer(1, 0)); !strings.Contains(got, "post #1") {
		t.Fatalf("layer 0: %q", got)
	}
	if got := add(tc.layer(1, 1)); !strings.Contains(got, "post #2") {
		t.Fatalf("layer 1: %q", got)
	}
	if got := add(tc.run(t, "ended xfer=1 fail=boom")); strings.Contains(got, "post") || strings.Contains(got, "notify") {
		t.Fatalf("layer 0's WRITE failed with layer 1's in flight: %q, want nothing until layer 1's ends", got)
	}
	if got := add(tc.layer(1, 2)); strings.Contains(got, "post") {
		t.Errorf("layer 2 saved after layer 0's WRITE failed: %q, want no WRITE into the doomed rank", got)
	}
	add(tc.run(t, "ended xfer=2"))
	add(tc.run(t, "ended xfer=3"))
	add(tc.run(t, "step send=p-1 blocks=1 tokens=16"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if n := count(out, "outcome send p-1"); n != 1 || !strings.Contains(out, "outcome send p-1 failed") {
		t.Errorf("producer outcomes:\n%s\nwant exactly one, failed", out)
	}
	if n := count(out, "notify D/0 fail"); n != 1 {
		t.Errorf("failure notices to D:\n%s\nwant exactly one", out)
	}
	if strings.Contains(out, "notify D/0 done") {
		t.Errorf("completion notice after a failed layer:\n%s", out)
	}
}

// Two requests prefilled in one step, paired with two consumer requests:
// one consumer cancels mid-layers, the other's request is untouched by it:
// every layer goes to it, it completes; the cancelled one gets no later
// layer, and each ends in exactly one outcome. LayerSaved for a step that
// never was, a layer again, and a layer after the requests finished
// write nothing.
func TestLayerwiseSharedStepOneCancels(t *testing.T) {
	tc := newLayers3Core(t)
	tc.prefillN(4, "p-1", "p-2")
	tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5")
	tc.hs3("D", 1)
	tc.run(t, "notif from=D/0 kind=reg dreq=d-2 preq=p-2 spans=6")
	var all []string
	add := func(s string) string { all = append(all, s); return s }
	if got := add(tc.layer(4, 0)); count(got, "post #") != 2 {
		t.Fatalf("layer 0: %q, want a WRITE per request", got)
	}
	add(tc.run(t, "ended xfer=1"))
	add(tc.run(t, "ended xfer=2"))
	if got := add(tc.run(t, "notif from=D/0 kind=cancel dreq=d-1 preq=p-1 reason=gone")); got != "notify D/0 ack dreq=d-1 preq=p-1" {
		t.Fatalf("cancel: %q", got)
	}
	if got := add(tc.layer(99, 1)); got != "(nothing)" {
		t.Errorf("LayerSaved for a step that never was: %q, want nothing", got)
	}
	if got := add(tc.layer(4, 0)); got != "(nothing)" {
		t.Errorf("LayerSaved again for layer 0: %q, want nothing", got)
	}
	got := add(tc.layer(4, 2)) // out of order
	if count(got, "post #") != 1 || !strings.Contains(got, "preq=p-2") {
		t.Errorf("layer 2: %q, want one WRITE, p-2's", got)
	}
	add(tc.run(t, "ended xfer=3"))
	got = add(tc.layer(4, 1))
	if count(got, "post #") != 1 || !strings.Contains(got, "preq=p-2") {
		t.Errorf("layer 1: %q, want one WRITE, p-2's", got)
	}
	add(tc.run(t, "ended xfer=4"))
	add(tc.run(t, "step send=p-1 blocks=1 tokens=16"))
	add(tc.run(t, "step send=p-2 blocks=2 tokens=16"))
	for l := range 3 {
		if got := add(tc.layer(4, l)); got != "(nothing)" {
			t.Errorf("layer %d saved after the requests finished: %q, want nothing", l, got)
		}
	}
	add(tc.run(t, "advance 31s"))
	out := strings.Join(all, "\n")
	if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 failed (cancelled)") {
		t.Errorf("p-1's outcomes:\n%s\nwant one, failed (cancelled)", out)
	}
	if count(out, "outcome send p-2") != 1 || !strings.Contains(out, "outcome send p-2 done") {
		t.Errorf("p-2's outcomes:\n%s\nwant one, done", out)
	}
	if count(out, "notify D/0 done dreq=d-2") != 1 {
		t.Errorf("completion notices of d-2:\n%s\nwant one", out)
	}
	if len(tc.st.layerSteps) != 0 {
		t.Errorf("layerSteps after every request ended: %v, want empty", tc.st.layerSteps)
	}
}

// A producer request aborted by its engine mid-layers, a layer's WRITE
// in flight: its outcome (aborted) waits for that WRITE (fencing), the
// consumer is told once nothing can land, no later layer goes out.
func TestLayerwiseAbortMidLayers(t *testing.T) {
	for _, inflightLast := range []bool{false, true} {
		t.Run(fmt.Sprintf("last layer in flight %v", inflightLast), func(t *testing.T) {
			tc := newLayers3Core(t)
			all, add := registeredMidPrefill(t, tc)
			add(tc.layer(1, 0))
			if inflightLast {
				add(tc.layer(1, 1))
				add(tc.layer(1, 2))
			}
			if got := add(tc.run(t, "step abort=p-1")); strings.Contains(got, "outcome") || strings.Contains(got, "notify") {
				t.Fatalf("abort with WRITEs in flight: %q, want nothing until they end", got)
			}
			if got := add(tc.layer(1, 2)); strings.Contains(got, "post") {
				t.Errorf("layer saved after the abort: %q, want nothing", got)
			}
			for x := 1; x <= 3; x++ {
				add(tc.run(t, fmt.Sprintf("ended xfer=%d", x)))
			}
			add(tc.run(t, "advance 31s"))
			out := strings.Join(*all, "\n")
			if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 aborted") {
				t.Errorf("outcomes:\n%s\nwant one, aborted", out)
			}
			// Even with every layer landed, the WRITEs in flight at the
			// abort may have read freed blocks: the consumer is told it
			// failed, once, never that it completed.
			fails, dones := count(out, "notify D/0 fail"), count(out, "notify D/0 done")
			if fails != 1 || dones != 0 {
				t.Errorf("notices to D:\n%s\nwant exactly one, a failure", out)
			}
		})
	}
}

// The consumer engine restarts mid-layers (a new generation, new agents):
// no later layer of the request goes to the new incarnation (its blocks
// hold another request's KV by now), and the request fails once.
func TestLayerwiseConsumerRestartMidLayers(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	add(tc.layer(1, 0))
	add(tc.run(t, "ended xfer=1"))
	add(tc.hs3("D", 2))
	for l := 1; l < 3; l++ {
		if got := add(tc.layer(1, l)); strings.Contains(got, "post") {
			t.Errorf("layer %d after the consumer restarted: %q, want nothing written", l, got)
		}
	}
	add(tc.run(t, "step send=p-1 blocks=1 tokens=16"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 failed") {
		t.Errorf("outcomes:\n%s\nwant one, failed", out)
	}
}

// A prefilling request has no lease: it starts at its finish. A
// consumer's heartbeat meanwhile (it heartbeats every request it waits
// for) must not start one that lapses mid-prefill: every later layer is
// still written, and the request completes once its engine finishes it.
func TestLayerwiseHeartbeatDuringPrefillNoLease(t *testing.T) {
	tc := newLayers3Core(t)
	all, add := registeredMidPrefill(t, tc)
	add(tc.layer(1, 0))
	add(tc.run(t, "ended xfer=1"))
	add(tc.run(t, "notif from=D/0 kind=heartbeat ids=,p-1,d-1"))
	add(tc.run(t, "advance 21s")) // past the heartbeat's extension (Lease·2/3)
	if got := add(tc.layer(1, 1)); !strings.Contains(got, "post #2") {
		t.Errorf("layer 1 saved after a heartbeat's extension passed: %q, want its WRITE", got)
	}
	add(tc.layer(1, 2))
	add(tc.run(t, "ended xfer=2"))
	add(tc.run(t, "ended xfer=3"))
	add(tc.run(t, "step send=p-1 blocks=1 tokens=16"))
	add(tc.run(t, "advance 31s"))
	out := strings.Join(*all, "\n")
	if count(out, "outcome send p-1") != 1 || !strings.Contains(out, "outcome send p-1 done") {
		t.Errorf("outcomes:\n%s\nwant one, done", out)
	}
	if count(out, "notify D/0 done dreq=d-1") != 1 || strings.Contains(out, "notify D/0 fail") {
		t.Errorf("notices to D:\n%s\nwant one completion notice", out)
	}
}

// registeredMidPrefill puts p-1 in prefill on tc, registered by D's rank 0
// (its engine handshaken, generation 1), and returns the log of what the
// core printed and the function that adds to it.
func registeredMidPrefill(t *testing.T, tc *traceCore) (*[]string, func(string) string) {
	t.Helper()
	tc.prefill(1, "p-1")
	tc.run(t, "notif from=D/0 kind=reg dreq=d-1 preq=p-1 spans=5")
	tc.hs3("D", 1)
	all := new([]string)
	return all, func(s string) string { *all = append(*all, s); return s }
}
