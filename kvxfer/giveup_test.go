package kvxfer

import (
	"io"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// newLayerwiseCore is a layer-wise push producer's core alone, driven as
// the trace scripts drive theirs.
func newLayerwiseCore(t *testing.T) *traceCore {
	return newLayerwiseCoreOn(t, traceLayout(0, 1, 1<<20))
}

// newLayerwiseCoreOn is a layer-wise push producer's core over layout.
func newLayerwiseCoreOn(t *testing.T, layout topology.Layout) *traceCore {
	t.Helper()
	now := traceEpoch
	w, err := newWorker(WorkerConfig{EngineID: "P", Addr: "P:1", Mode: ModePush, Layerwise: true, Layout: layout,
		CompatHash: "h", Backend: panicBackend{}, Resolver: noResolver{}, Lease: 30 * time.Second,
		Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), Metrics: NewMetrics()})
	if err != nil {
		t.Fatal(err)
	}
	w.st.init(w)
	w.st.now = now
	return &traceCore{st: &w.st, now: now, fail: map[opKind]int{}, engine: "P"}
}

func (tc *traceCore) prefill(step uint64, id string) string {
	meta := &StepMeta{Step: step, SchedulerClock: tc.now,
		Prefill: []SendReq{{ReqID: id, Blocks: []topology.Span{{IDs: []topology.BlockID{1}}}, Tokens: 16}}}
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	return strings.Join(tc.drive(nil, ""), "\n")
}

// A consumer's give-up reaches a layer-wise producer request whatever the
// order: one that comes while the request prefills, or before it was
// scheduled, fails it when its engine finishes the prefill (a request
// reports once its engine's scheduler holds it), never leaving it to
// wait for its lease; and nothing is written meanwhile.
func TestGiveUpReachesLayerwisePrefill(t *testing.T) {
	const cancel = "notif from=D/0 kind=cancel dreq=d-3 preq=p-3 reason=incompatible"
	for _, before := range []bool{false, true} {
		tc := newLayerwiseCore(t)
		if before {
			tc.cancel(t, cancel)
		}
		if got := tc.prefill(1, "p-3"); got != "" {
			t.Fatalf("prefill: %q, want nothing", got)
		}
		if !before {
			tc.cancel(t, cancel)
		}
		if n := len(tc.st.out.Sending); n != 0 {
			t.Fatalf("before the engine finished the prefill: %d outcomes, want none yet", n)
		}
		// A registration that comes late for it is not written, and told.
		if got := tc.run(t, "notif from=D/0 kind=reg dreq=d-3 preq=p-3 spans=5"); strings.Contains(got, "post") || !strings.Contains(got, "notify D/0 fail") {
			t.Fatalf("late registration: %s", got)
		}
		want := "outcome send p-3 failed (cancelled): consumer gave up: incompatible"
		if got := tc.run(t, "step send=p-3 blocks=1 tokens=16"); got != want {
			t.Errorf("give-up before prefill %v: at finish %q, want %q", before, got, want)
		}
		if n := tc.st.sends.len(); n != 0 {
			t.Errorf("give-up before prefill %v: %d producer requests held after the outcome", before, n)
		}
	}
}

// An engine's abort of a layer-wise request whose pairing failed while it
// prefilled ends it once, as aborted.
func TestAbortDoomedPrefill(t *testing.T) {
	tc := newLayerwiseCore(t)
	tc.prefill(1, "p-3")
	tc.cancel(t, "notif from=D/0 kind=cancel dreq=d-3 preq=p-3 reason=incompatible")
	want := "outcome send p-3 aborted: producer aborted"
	if got := tc.run(t, "step abort=p-3"); got != want {
		t.Errorf("abort: %q, want %q", got, want)
	}
	if n := tc.st.sends.len(); n != 0 {
		t.Errorf("%d producer requests held after the outcome", n)
	}
}

// cancel delivers a consumer's cancel and answers the handshake it asks
// for: the acknowledgement must follow.
func (tc *traceCore) cancel(t *testing.T, line string) {
	t.Helper()
	got := tc.run(t, line)
	if got == "handshake D at D:1" {
		got = tc.run(t, "handshake D tp=1")
	}
	if got != "notify D/0 ack dreq=d-3 preq=p-3" {
		t.Fatalf("cancel: %q, want its acknowledgement", got)
	}
}
