package kvxfer

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// skewTurn2 plays a bidirectional pull's turn 2 across two hosts whose
// clocks differ by skew (D's clock minus P's): D's Scheduler ends turn 1
// holding its blocks for its DecoderBlocksTTL (480 s) and returns their
// expiry on its clock; P's Scheduler stages the read of them, and P's
// worker core, whose handshake with D measured the skew, is stepped with
// that metadata. It returns the core, after the read was posted or
// refused, and what the step and handshake printed.
func skewTurn2(t *testing.T, skew time.Duration) (*traceCore, string) {
	t.Helper()
	d, dc := newSched(t, ModePull, func(c *SchedulerConfig) {
		c.Generation = gen1 // its params carry its generation (the trace handshake's)
		c.Bidirectional, c.TPSize, c.EngineID, c.Addr = true, 1, "D", "D:1"
	})
	dc.t = traceEpoch.Add(skew)
	r := &Request{ID: "d-1", PromptTokens: 40, Params: pParams(ModePull)}
	if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(5, 6, 7)}, External: 40}); err != nil {
		t.Fatal(err)
	}
	hold, params, err := d.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(5, 6, 7, 8)}, 64)
	if err != nil || !hold || params.RemoteBlocksExpiry.IsZero() {
		t.Fatalf("D turn 1 finish = %v, %+v, %v; want its blocks held with an expiry", hold, params, err)
	}

	p, pc := newSched(t, ModePull, func(c *SchedulerConfig) {
		c.Generation = gen1 // its params carry its generation (the trace handshake's)
		c.Bidirectional, c.TPSize, c.EngineID, c.Addr = true, 1, "P", "P:1"
	})
	pc.t = traceEpoch
	turn2 := &Request{ID: "p-2", PromptTokens: 80, Params: params}
	if n, async := p.MatchedTokens(turn2, 0); n != 64 || !async {
		t.Fatalf("turn-2 MatchedTokens = %d, %v; want 64, true", n, async)
	}
	if err := p.AfterAlloc(turn2, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3, 4, 9)}, External: 64}); err != nil {
		t.Fatal(err)
	}
	meta := p.BuildMeta()
	if len(meta.Recv) != 1 {
		t.Fatalf("turn-2 meta = %+v, want one read", meta)
	}

	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=P tp=0/1")
	tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
	out := tc.drive(nil, "")
	out = append(out, tc.run(t, "handshake D tp=1 offset="+skew.String()))
	return tc, strings.Join(out, "\n")
}

// D's clock behind P's by more than D's hold: D still holds its blocks
// for 480 s of real time, and P reads them. Before, P's worker rebased
// D's expiry (on D's clock) as if it were on P's own scheduler clock and
// gave the read up at once, 600 s early.
func TestBidirectionalTurn2PeerClockBehind(t *testing.T) {
	tc, out := skewTurn2(t, -600*time.Second)
	if !strings.Contains(out, "post #1 read D/0") {
		t.Fatalf("turn 2 with D's clock 600 s behind:\n%s\nwant the read posted (D holds its blocks for 480 s more)", out)
	}
	if got := tc.run(t, "advance 1s"); strings.Contains(got, "abandon") || strings.Contains(got, "outcome") {
		t.Fatalf("1 s into a 480 s hold: %q, want the read still in flight", got)
	}
	if got := tc.run(t, "ended xfer=1"); !strings.Contains(got, "outcome recv p-2 done") {
		t.Errorf("read ended: %q, want p-2 done", got)
	}
}

// D's clock ahead of P's: D's hold ends 480 s of real time after turn 1,
// whatever its clock says, and P's read still in flight then is given up
// as it is without skew. Before, P's deadline was D's expiry taken as a
// time on P's own clock: 600 s past the hold. (P's heartbeats, sent while
// the read is in flight, extend D's hold, so without a partition D did
// not free the blocks under the read; the bound was wrong all the same.)
func TestBidirectionalTurn2PeerClockAhead(t *testing.T) {
	tc, out := skewTurn2(t, 600*time.Second)
	if !strings.Contains(out, "post #1 read D/0") {
		t.Fatalf("turn 2 with D's clock 600 s ahead:\n%s\nwant the read posted", out)
	}
	for range 47 { // liveness probes of D answered as they come
		got := tc.run(t, "advance 10s")
		if strings.Contains(got, "probe D") {
			got = tc.run(t, "handshake D tp=1 probe=true offset=10m0s")
		}
		if strings.Contains(got, "abandon") || strings.Contains(got, "outcome") {
			t.Fatalf("at %v of a 480 s hold: %q, want the read still in flight", tc.now.Sub(traceEpoch), got)
		}
	}
	got := tc.run(t, "advance 11s") // past D's real expiry
	got += "\n" + tc.run(t, "advance 1s")
	if !strings.Contains(got, "abandon #1") || !strings.Contains(got, "outcome recv p-2 expired") {
		t.Errorf("past D's real expiry (480 s) with the read in flight:\n%s\nwant the read abandoned and p-2 expired", got)
	}
}

// A plain pull consumer whose request reaches its rank after the
// producer's lease lapsed (it waited in its engine's queue, or its
// handshake was slow: its heartbeats begin with its read) reads nothing:
// the producer may have freed the blocks and given them to another
// request, and a backend without grants (NIXL) would READ that request's
// KV and report it loaded. Before, plain pull params carried no expiry,
// and the READ was posted 31 s into a 30 s lease.
func TestPullReadAfterLeaseLapsed(t *testing.T) {
	p, pc := newSched(t, ModePull, func(c *SchedulerConfig) {
		c.Generation = gen1 // its params carry its generation (the trace handshake's)
		c.TPSize, c.EngineID, c.Addr = 1, "P", "P:1"
	})
	pc.t = traceEpoch
	hold, params, err := p.RequestFinished(&Request{ID: "p-1", PromptTokens: 80, Params: &TransferParams{DoRemoteDecode: true}},
		FinishLengthCapped, [][]topology.BlockID{ids(1, 2, 3, 4, 5)}, 80)
	if err != nil || !hold || !params.RemoteBlocksExpiry.Equal(traceEpoch.Add(30*time.Second)) {
		t.Fatalf("P finish = %v, %+v, %v; want its blocks held, the lease's end in the params", hold, params, err)
	}
	for _, tc := range []struct {
		after time.Duration
		want  string
	}{{time.Second, "post #1 read P/0"}, {29*time.Second + 800*time.Millisecond, "outcome recv d-1 expired"}, {31 * time.Second, "outcome recv d-1 expired"}} {
		d, dc := newSched(t, ModePull, func(c *SchedulerConfig) { c.TPSize, c.EngineID, c.Addr = 1, "D", "D:1" })
		dc.t = traceEpoch
		prm := *params
		r := &Request{ID: "d-1", PromptTokens: 80, Params: &prm}
		n, async := d.MatchedTokens(r, 0)
		if n == 0 || !async {
			t.Fatalf("MatchedTokens = %d, %v; want the producer's tokens, async", n, async)
		}
		if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(5, 6, 7, 8, 9, 10)}, External: n}); err != nil {
			t.Fatal(err)
		}
		meta := d.BuildMeta()
		core := &traceCore{now: traceEpoch.Add(tc.after), fail: map[opKind]int{}}
		core.run(t, "core mode=pull engine=D tp=0/1")
		core.st.Step(core.now, input{kind: inEvent, ev: &event{kind: evStep, meta: meta}})
		out := strings.Join(append(core.drive(nil, ""), core.run(t, "handshake P tp=1")), "\n")
		if !strings.Contains(out, tc.want) || tc.want != "post #1 read P/0" && strings.Contains(out, "post") {
			t.Errorf("read %v after P's finish (30 s lease):\n%s\nwant %q", tc.after, out, tc.want)
		}
	}
}

// A pull consumer bounds its READs by the producer's expiry through the
// clock offset its handshake measured; the producer's clock may be
// stepped since (NTP correcting it), and the engine, in use all along, is
// not handshaken again. Its liveness probes are handshakes, timed as the
// first: the offset they measure is the one later READs go by. Before,
// the first handshake's offset stayed: P's clock 2 s behind D's then and
// set right since, a request P holds for 100 ms more was read as if it
// held it 2.1 s more: its READ, posted, could read the blocks P freed and
// gave to another request (NIXL has no grant to refuse it).
func TestPullExpiryByTheLatestOffset(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=D tp=0/1")
	recv := func(id string, blocks []topology.BlockID, expiry time.Time) string {
		rr := RecvReq{ReqID: "d-" + id, TransferID: "t-" + id, Local: []topology.Span{{IDs: blocks}},
			Remote: RemoteRef{EngineID: "P", Addr: "P:1", Generation: 1, ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16 * len(blocks),
				Blocks: []topology.Span{{IDs: blocks}}, Expiry: expiry}}
		tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: tc.now, Recv: []RecvReq{rr}}}})
		return strings.Join(tc.drive(nil, ""), "\n")
	}
	// d-1: P held it from 2 s before our epoch on its clock, 2 s behind
	// ours: 30 s from our epoch. Its READ stays in flight (P is watched).
	out := recv("1", ids(1, 2), traceEpoch.Add(28*time.Second))
	out += "\n" + tc.run(t, "handshake P tp=1 offset=-2s")
	if !strings.Contains(out, "post #1 read P/0") {
		t.Fatalf("d-1, 30 s of P's hold left:\n%s\nwant its READ posted", out)
	}
	probed := false
	for range 10 {
		if got := tc.run(t, "advance 1s"); strings.Contains(got, "probe P") {
			// P's clock was set right meanwhile: the probe finds it on time.
			tc.run(t, "handshake P tp=1 probe=true offset=0s")
			probed = true
			break
		}
	}
	if !probed {
		t.Fatal("no probe of P within 10 s of d-1's READ")
	}
	// d-2: P holds it 100 ms more (its clock and ours agree now): within
	// expiryMargin of it, nothing is read.
	out = recv("2", ids(3, 4), tc.now.Add(100*time.Millisecond))
	if !strings.Contains(out, "outcome recv d-2 expired") || strings.Contains(out, "post") {
		t.Errorf("d-2, 100 ms of P's hold left (by the probe's offset, 0; the handshake's said -2 s):\n%s\nwant it expired, nothing read", out)
	}
}

// A pull READ whose completion the core handles at or past the read's
// deadline (the producer's expiry less expiryMargin), before the
// deadline's timer ran (the driver handed the completion in first): the
// READ was in flight past the point it had to end by, when the producer
// may have freed and reused its blocks, and is given up as the timer
// would have, never reported done. Before, it was done. One that failed
// so carried no notice: its producer rank is told (before, it was not:
// it held the blocks for its lease).
func TestPullReadEndedPastItsDeadlineIsExpired(t *testing.T) {
	for _, tc := range []struct {
		at    time.Duration // when the READ's completion is handled
		ended string        // how
		want  []string
	}{
		{29 * time.Second, "ended xfer=1", []string{"outcome recv d-1 done"}},
		{29*time.Second + 800*time.Millisecond, "ended xfer=1", []string{"outcome recv d-1 expired"}},
		{29*time.Second + 800*time.Millisecond, "ended xfer=1 fail=link-down", []string{"notify P/0 fail tid=t-1 dreq=d-1 preq=p-1", "outcome recv d-1 expired"}},
	} {
		c := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
		c.run(t, "core mode=pull engine=D tp=0/1")
		rr := RecvReq{ReqID: "d-1", TransferID: "t-1", Local: []topology.Span{{IDs: ids(1, 2)}},
			Remote: RemoteRef{EngineID: "P", Addr: "P:1", Generation: 1, ReqID: "p-1", TPSize: 1, PPSize: 1, Tokens: 32,
				Blocks: []topology.Span{{IDs: ids(1, 2)}}, Expiry: traceEpoch.Add(30 * time.Second)}}
		c.st.Step(c.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: c.now, Recv: []RecvReq{rr}}}})
		out := strings.Join(c.drive(nil, ""), "\n") + "\n" + c.run(t, "handshake P tp=1")
		if !strings.Contains(out, "post #1 read P/0") {
			t.Fatalf("d-1, 30 s of P's hold left:\n%s\nwant its READ posted", out)
		}
		c.now = traceEpoch.Add(tc.at) // no timer run since
		got := c.run(t, tc.ended)
		for _, want := range tc.want {
			if !strings.Contains(got, want) {
				t.Errorf("READ %s, handled %v into P's 30 s hold:\n%s\nwant %q", tc.ended, tc.at, got, want)
			}
		}
	}
}

// A pull consumer idle on a producer engine (no request: no liveness
// probe measures its clock) for longer than offsetMaxAge has the offset
// measured again before its next READ bounded by the producer's expiry:
// P's clock 2 s behind D's at the handshake and set right during the
// gap, a request P holds 100 ms more is not read (expired), where the
// old offset put 2.1 s of hold before it. And a READ soon after a
// measure goes at once. Before, the handshake's offset stayed until a
// probe, which an idle engine never gets: the READ was posted, and could
// read blocks P freed and gave to another request (over NIXL).
func TestPullOffsetMeasuredAgainAfterAnIdleGap(t *testing.T) {
	tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
	tc.run(t, "core mode=pull engine=D tp=0/1")
	recv := func(id string, blocks []topology.BlockID, expiry time.Time) string {
		rr := RecvReq{ReqID: "d-" + id, TransferID: "t-" + id, Local: []topology.Span{{IDs: blocks}},
			Remote: RemoteRef{EngineID: "P", Addr: "P:1", Generation: 1, ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16 * len(blocks),
				Blocks: []topology.Span{{IDs: blocks}}, Expiry: expiry}}
		tc.st.Step(tc.now, input{kind: inEvent, ev: &event{kind: evStep, meta: &StepMeta{SchedulerClock: tc.now, Recv: []RecvReq{rr}}}})
		return strings.Join(tc.drive(nil, ""), "\n")
	}
	out := recv("1", ids(1, 2), traceEpoch.Add(28*time.Second))
	out += "\n" + tc.run(t, "handshake P tp=1 offset=-2s")
	if !strings.Contains(out, "post #1 read P/0") {
		t.Fatalf("d-1, 30 s of P's hold left:\n%s\nwant its READ posted", out)
	}
	if out := tc.run(t, "ended xfer=1"); !strings.Contains(out, "outcome recv d-1 done") {
		t.Fatalf("d-1's READ ended: %s", out)
	}
	// Idle 60 s: nothing waits on P, nothing probes it.
	for range 6 {
		if got := tc.run(t, "advance 10s"); strings.Contains(got, "probe") {
			t.Fatalf("an idle engine probed: %s", got)
		}
	}
	out = recv("2", ids(3, 4), tc.now.Add(100*time.Millisecond))
	if !strings.Contains(out, "probe P at") || strings.Contains(out, "post") {
		t.Fatalf("d-2, 60 s after P's clock was last measured:\n%s\nwant a probe first, nothing read", out)
	}
	out = tc.run(t, "handshake P tp=1 probe=true offset=0s")
	if !strings.Contains(out, "outcome recv d-2 expired") || strings.Contains(out, "post") {
		t.Errorf("d-2, 100 ms of P's hold left (by the probe's offset, 0; the handshake's said -2 s):\n%s\nwant it expired, nothing read", out)
	}
	// Measured just now: the next READ goes at once.
	out = recv("3", ids(5, 6), tc.now.Add(20*time.Second))
	if strings.Contains(out, "probe") || !strings.Contains(out, "post #2 read P/0") {
		t.Errorf("d-3, P's clock measured just before:\n%s\nwant its READ posted at once", out)
	}
}

// gen1 is the generation a trace handshake answers by default: a
// producer scheduler's params carrying it are read without the hold
// check (holdcheck.go), as a real producer's are.
func gen1() uint64 { return 1 }
