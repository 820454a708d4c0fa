package kvxfer

import (
	"fmt"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

type clock struct{ t time.Time }

func (c *clock) now() time.Time                    { return c.t }
func (c *clock) advance(d time.Duration)           { c.t = c.t.Add(d) }
func ids(v ...topology.BlockID) []topology.BlockID { return v }

func newSched(t *testing.T, mode Mode, mut func(*SchedulerConfig)) (*Scheduler, *clock) {
	t.Helper()
	c := &clock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	cfg := SchedulerConfig{EngineID: "E", Addr: "e:1", Mode: mode, TPSize: 2, LogicalBlockSize: 16, Now: c.now}
	if mut != nil {
		mut(&cfg)
	}
	s, err := NewScheduler(cfg)
	if err != nil {
		t.Fatal(err)
	}
	return s, c
}

// pParams are the params a consumer gets from the router.
func pParams(mode Mode) *TransferParams {
	return &TransferParams{TransferID: "t1", DoRemotePrefill: true, RemoteEngineID: "P", RemoteAddr: "p:1",
		RemoteRequestID: "p-1", RemoteTPSize: 4, RemoteNumTokens: 40, Mode: mode,
		RemoteBlockIDs: []topology.Span{{IDs: ids(7, 8, 9)}}}
}

func TestNewSchedulerValidates(t *testing.T) {
	tests := []struct {
		name string
		mut  func(*SchedulerConfig)
		want string
	}{
		{"no engine", func(c *SchedulerConfig) { c.EngineID = "" }, "EngineID"},
		{"no addr", func(c *SchedulerConfig) { c.Addr = "" }, "Addr"},
		{"bad mode", func(c *SchedulerConfig) { c.Mode = 9 }, "Mode = 9"},
		{"no block size", func(c *SchedulerConfig) { c.LogicalBlockSize = 0 }, "LogicalBlockSize = 0"},
		{"bidirectional push", func(c *SchedulerConfig) { c.Mode, c.Bidirectional = ModePush, true }, "Bidirectional"},
		{"window", func(c *SchedulerConfig) { c.Groups = []topology.Group{{Kind: topology.KindSlidingWindow}} }, "Groups[0].Window = 0"},
		{"negative lease", func(c *SchedulerConfig) { c.Lease = -1 }, "Lease"},
		{"negative backoff", func(c *SchedulerConfig) { c.PrefillBackoff = -1 }, "PrefillBackoff = -1"},
		{"layerwise pull", func(c *SchedulerConfig) { c.Mode, c.Layerwise = ModePull, true }, "Layerwise is not supported in pull mode"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cfg := SchedulerConfig{EngineID: "E", Addr: "e:1", Mode: ModePull, LogicalBlockSize: 16}
			tc.mut(&cfg)
			if _, err := NewScheduler(cfg); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("NewScheduler error = %v, want one naming %q", err, tc.want)
			}
		})
	}
}

var hybrid = []topology.Group{{Kind: topology.KindFullAttention}, {Kind: topology.KindMamba}}

// SPEC §7.1, §8.2: PrefillTokens(N) minus the computed tokens, async.
func TestMatchedTokens(t *testing.T) {
	tests := []struct {
		name     string
		groups   []topology.Group
		backoff  int
		params   *TransferParams
		prompt   int
		computed int
		n        int
		async    bool
	}{
		{"no params", nil, 0, nil, 100, 0, 0, false},
		{"remote prefill", nil, 0, pParams(ModePull), 100, 16, 84, true},
		{"mamba recomputes the last token", hybrid, 0, pParams(ModePull), 100, 16, 83, true},
		{"mtp lookahead 3 recomputes 2", nil, 2, pParams(ModePull), 64, 0, 62, true},
		{"mtp beside mamba: the larger backoff", hybrid, 2, pParams(ModePull), 64, 16, 46, true},
		{"mamba, one-token prompt: loaded whole", hybrid, 0, pParams(ModePull), 1, 0, 1, true},
		{"backoff 2, two-token prompt: loaded whole", nil, 2, pParams(ModePull), 2, 0, 2, true},
		{"backoff 2, three-token prompt", nil, 2, pParams(ModePull), 3, 0, 1, true},
		{"prompt shorter than a block", nil, 0, pParams(ModePull), 8, 0, 8, true},
		{"all computed", nil, 0, pParams(ModePull), 32, 32, 0, false},
		{"mamba, all but the last computed", hybrid, 0, pParams(ModePull), 32, 31, 0, false},
		{"producer", nil, 0, &TransferParams{DoRemoteDecode: true}, 100, 0, 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Groups, c.PrefillBackoff = tc.groups, tc.backoff })
			n, async := s.MatchedTokens(&Request{ID: "d-1", PromptTokens: tc.prompt, Params: tc.params}, tc.computed)
			if n != tc.n || async != tc.async {
				t.Errorf("MatchedTokens = %d, %v; want %d, %v", n, async, tc.n, tc.async)
			}
		})
	}
}

// PrefillTokens is vLLM 0.32 NixlConnector's count of the prompt tokens a
// producer computes and a consumer loads: the prompt less the backoff
// (at least 1 with a Mamba group, the larger of the two), or the whole
// prompt when it is no longer than the backoff.
func TestPrefillTokens(t *testing.T) {
	tests := []struct {
		name    string
		groups  []topology.Group
		backoff int
		prompt  int
		want    int
	}{
		{"full attention", nil, 0, 64, 64},
		{"mamba", hybrid, 0, 64, 63},
		{"mamba, backoff 1 given too", hybrid, 1, 64, 63},
		{"mtp lookahead 3", nil, 2, 64, 62},
		{"mtp lookahead 3 beside mamba", hybrid, 2, 64, 62},
		{"mamba, one token", hybrid, 0, 1, 1},
		{"mtp, prompt equal to the backoff", nil, 2, 2, 2},
		{"mtp, prompt one past the backoff", nil, 2, 3, 1},
		{"empty prompt", hybrid, 2, 0, 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Groups, c.PrefillBackoff = tc.groups, tc.backoff })
			if got := s.PrefillTokens(tc.prompt); got != tc.want {
				t.Errorf("PrefillTokens(%d) = %d, want %d", tc.prompt, got, tc.want)
			}
		})
	}
}

// A producer that trims its prompt to PrefillTokens returns as
// RemoteNumTokens exactly what its consumer's MatchedTokens loads, so the
// consumer computes the backoff tokens itself on state that holds none of
// them; with no blocks to hold it returns 0 tokens, as the reference does.
func TestProducerTokensMatchConsumer(t *testing.T) {
	for _, tc := range []struct {
		name    string
		groups  []topology.Group
		backoff int
		loads   int // of a 64-token prompt
	}{{"full attention", nil, 0, 64}, {"hybrid", hybrid, 0, 63}, {"mtp lookahead 3", nil, 2, 62}} {
		for _, mode := range []Mode{ModePush, ModePull} {
			t.Run(tc.name+"/"+mode.String(), func(t *testing.T) {
				mut := func(c *SchedulerConfig) { c.Groups, c.PrefillBackoff = tc.groups, tc.backoff }
				p, _ := newSched(t, mode, mut)
				d, _ := newSched(t, mode, mut)
				const prompt = 64
				computed := p.PrefillTokens(prompt) // what P's engine computes
				blocks := make([][]topology.BlockID, len(p.cfg.Groups))
				for g := range blocks {
					blocks[g] = ids(1, 2, 3, 4)
				}
				delay, params, err := p.RequestFinished(&Request{ID: "p-1", PromptTokens: computed,
					Params: &TransferParams{TransferID: "t1", DoRemoteDecode: true}}, FinishLengthCapped, blocks, computed)
				if err != nil || !delay {
					t.Fatalf("RequestFinished = %v, %v; want delay", delay, err)
				}
				n, async := d.MatchedTokens(&Request{ID: "d-1", PromptTokens: prompt, Params: params}, 0)
				if n != params.RemoteNumTokens || !async {
					t.Errorf("consumer MatchedTokens = %d, %v; want the producer's RemoteNumTokens %d, true", n, async, params.RemoteNumTokens)
				}
				if n != tc.loads {
					t.Errorf("MatchedTokens = %d, want %d", n, tc.loads)
				}
				empty := make([][]topology.BlockID, len(p.cfg.Groups))
				delay, params, err = p.RequestFinished(&Request{ID: "p-2", PromptTokens: computed,
					Params: &TransferParams{DoRemoteDecode: true}}, FinishLengthCapped, empty, computed)
				if err != nil || delay || params == nil || params.RemoteNumTokens != 0 {
					t.Errorf("RequestFinished without blocks = %v, %+v, %v; want no delay and RemoteNumTokens 0", delay, params, err)
				}
			})
		}
	}
}

// SPEC §12 push 1: a consumer's allocation stages its registration with
// D's id, the producer's coordinates and blocks, arms the watchdog, and
// consumes do_remote_prefill.
func TestPushConsumerAfterAllocStagesRegistration(t *testing.T) {
	s, c := newSched(t, ModePush, nil)
	r := &Request{ID: "d-1", PromptTokens: 40, Params: pParams(ModePush)}
	if err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(3, 4)}, Computed: 16, External: 24}); err != nil {
		t.Fatal(err)
	}
	if r.Params.DoRemotePrefill || r.Params.RemoteBlockIDs != nil {
		t.Errorf("params after alloc = %+v, want do_remote_prefill and remote blocks consumed", r.Params)
	}
	if !s.HasPendingWork() || s.Watching() != 1 {
		t.Errorf("pending %v, watching %d; want staged work and one watchdog", s.HasPendingWork(), s.Watching())
	}
	m := s.BuildMeta()
	want := []RecvReq{{ReqID: "d-1", TransferID: "t1", Local: []topology.Span{{Start: 16, IDs: ids(3, 4)}},
		Remote:   RemoteRef{EngineID: "P", Addr: "p:1", ReqID: "p-1", TPSize: 4, PPSize: 1, Tokens: 40},
		Tokens:   40, // Computed 16 + External 24
		Deadline: c.t.Add(480 * time.Second)}}
	if !reflect.DeepEqual(m.Recv, want) {
		t.Errorf("Recv = %+v, want %+v", m.Recv, want)
	}
}

// SPEC §14: a full prefix hit in push still tells the producer (an empty
// receive), where the reference stays silent.
func TestPushFullPrefixHitStagesEmptyReceive(t *testing.T) {
	s, _ := newSched(t, ModePush, nil)
	r := &Request{ID: "d-1", PromptTokens: 32, Params: pParams(ModePush)}
	if err := s.AfterAlloc(r, Alloc{Computed: 32}); err != nil {
		t.Fatal(err)
	}
	m := s.BuildMeta()
	if len(m.Recv) != 1 || m.Recv[0].Local != nil || m.Recv[0].Aborted || s.Watching() != 0 {
		t.Errorf("Recv = %+v (watching %d), want one empty receive and no watchdog", m.Recv, s.Watching())
	}
}

// SPEC §8 and §14: an abort before schedule stages an empty, aborted
// receive in pull and in push, with the producer's id.
func TestAbortBeforeScheduleStagesEmptyReceive(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newSched(t, mode, nil)
			r := &Request{ID: "d-1", Params: pParams(mode)}
			delay, params, err := s.RequestFinished(r, FinishAborted, nil, 0)
			if delay || params != nil || err != nil || r.Params.DoRemotePrefill {
				t.Fatalf("RequestFinished = %v, %v, %v (prefill %v); want false, nil, nil and the flag consumed", delay, params, err, r.Params.DoRemotePrefill)
			}
			m := s.BuildMeta()
			if len(m.Recv) != 1 || !m.Recv[0].Aborted || m.Recv[0].Local != nil || m.Recv[0].Remote.ReqID != "p-1" {
				t.Errorf("Recv = %+v, want one aborted empty receive naming p-1", m.Recv)
			}
		})
	}
}

// SPEC §12 push 2, 3, 4, 5: a producer's normal finish holds its blocks
// under a lease and returns the params; the build drains staging but keeps
// the hold; finished_sending releases it.
func TestProducerFinishLeaseLifecycle(t *testing.T) {
	for _, mode := range []Mode{ModePush, ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			s, c := newSched(t, mode, func(c *SchedulerConfig) { c.PPSize = 2 })
			r := &Request{ID: "p-1", Params: &TransferParams{TransferID: "t1", DoRemoteDecode: true}}
			if s.HasPendingWork() {
				t.Fatal("pending work before anything happened")
			}
			delay, params, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1, 2, 3)}, 40)
			if err != nil || !delay {
				t.Fatalf("RequestFinished = %v, %v; want delay", delay, err)
			}
			want := &TransferParams{TransferID: "t1", DoRemotePrefill: true, RemoteEngineID: "E", RemoteAddr: "e:1", RemoteRequestID: "p-1",
				RemoteBlockIDs: []topology.Span{{IDs: ids(1, 2, 3)}}, RemoteTPSize: 2, RemotePPSize: 2, RemoteNumTokens: 40, Mode: mode}
			if mode == ModePull {
				// The hold's expiry, unless heartbeats extend it: a
				// consumer's READ must end before it.
				want.RemoteBlocksExpiry = c.t.Add(30 * time.Second)
			}
			if !reflect.DeepEqual(params, want) {
				t.Errorf("params = %+v, want %+v", params, want)
			}
			m := s.BuildMeta()
			if len(m.Send) != 1 || !m.Send[0].Deadline.Equal(c.t.Add(30*time.Second)) || m.Send[0].Tokens != 40 {
				t.Errorf("Send = %+v, want one lease of 30 s for 40 tokens", m.Send)
			}
			if again := s.BuildMeta(); len(again.Send) != 0 {
				t.Errorf("second build Send = %+v, want drained", again.Send)
			}
			if !s.HasPendingWork() || s.Held() != 1 {
				t.Errorf("after build: pending %v, held %d; want the hold kept", s.HasPendingWork(), s.Held())
			}
			s.Update(&Finished{Sending: []Outcome{{ReqID: "p-1", Result: ResultDone}}})
			if s.HasPendingWork() || s.Held() != 0 {
				t.Errorf("after finished_sending: pending %v, held %d; want nothing", s.HasPendingWork(), s.Held())
			}
		})
	}
}

// SPEC §12 push 22, 23 and §8.1: abnormal finishes go to NotProcessed;
// empty blocks arm no lease.
func TestProducerFinishEdgeCases(t *testing.T) {
	s, _ := newSched(t, ModePush, nil)
	r := &Request{ID: "p-1", Params: &TransferParams{DoRemoteDecode: true}}
	if delay, params, _ := s.RequestFinished(r, FinishAborted, [][]topology.BlockID{ids(1)}, 16); delay || params != nil {
		t.Errorf("aborted finish = %v, %+v; want false, nil", delay, params)
	}
	r2 := &Request{ID: "p-2", Params: &TransferParams{DoRemoteDecode: true}}
	delay, params, _ := s.RequestFinished(r2, FinishLengthCapped, [][]topology.BlockID{nil}, 0)
	if delay || params == nil || s.Held() != 0 {
		t.Errorf("empty finish = %v, %+v, held %d; want false, params, no lease", delay, params, s.Held())
	}
	// The staged abort is work for the workers: an idle engine must step
	// once more to send it (they hold p-1's blocks, and push consumers
	// registered for it wait on it).
	if !s.HasPendingWork() {
		t.Errorf("HasPendingWork = false with p-1's abort staged; want true until it is built")
	}
	m := s.BuildMeta()
	if !reflect.DeepEqual(m.NotProcessed, []string{"p-1"}) || len(m.Send) != 0 {
		t.Errorf("NotProcessed = %v, Send = %v; want [p-1] and nothing", m.NotProcessed, m.Send)
	}
	if s.HasPendingWork() {
		t.Errorf("HasPendingWork = true after the build; want false")
	}
	if delay, params, err := s.RequestFinished(&Request{ID: "x"}, FinishStopped, nil, 0); delay || params != nil || err != nil {
		t.Errorf("finish without params = %v, %v, %v; want a no-op", delay, params, err)
	}
}

// SPEC §12 push 6, §14: the watchdog pops expired deadlines by deadline,
// not insertion order, and emits nothing.
func TestRegistrationWatchdogByDeadline(t *testing.T) {
	s, c := newSched(t, ModePush, func(c *SchedulerConfig) { c.RegistrationTimeout = time.Hour })
	a := &Request{ID: "d-a", Params: pParams(ModePush)}
	_ = s.AfterAlloc(a, Alloc{Blocks: [][]topology.BlockID{ids(1)}, External: 16})
	s.cfg.RegistrationTimeout = time.Minute
	b := &Request{ID: "d-b", Params: pParams(ModePush)}
	b.Params.TransferID = "t2"
	_ = s.AfterAlloc(b, Alloc{Blocks: [][]topology.BlockID{ids(2)}, External: 16})
	s.BuildMeta()
	c.advance(2 * time.Minute)
	m := s.BuildMeta()
	if s.Watching() != 1 || s.Counters().WatchdogExpired != 1 || len(m.Recv) != 0 {
		t.Errorf("watching %d, expired %d, Recv %v; want a's watchdog left, b's expired, nothing emitted", s.Watching(), s.Counters().WatchdogExpired, m.Recv)
	}
	s.Update(&Finished{Recving: []Outcome{{ReqID: "d-a", Result: ResultDone}}})
	if s.Watching() != 0 {
		t.Errorf("watching %d after finished_recving, want 0", s.Watching())
	}
}

// SPEC §12 push 20, 21, 24 and bad params.
func TestAfterAllocNegative(t *testing.T) {
	s, _ := newSched(t, ModePush, nil)
	if err := s.AfterAlloc(&Request{ID: "x"}, Alloc{External: 16}); err != nil || s.HasPendingWork() {
		t.Errorf("no params: %v, pending %v; want a no-op", err, s.HasPendingWork())
	}
	bad := pParams(ModePush)
	bad.RemoteEngineID = ""
	err := s.AfterAlloc(&Request{ID: "y", Params: bad}, Alloc{Blocks: [][]topology.BlockID{ids(1)}, External: 16})
	if err == nil || !strings.Contains(err.Error(), "RemoteEngineID") || s.Counters().BadParams != 1 || s.HasPendingWork() {
		t.Errorf("missing engine: %v (bad %d); want an error naming RemoteEngineID, counted, nothing staged", err, s.Counters().BadParams)
	}
	err = s.AfterAlloc(&Request{ID: "z", Params: pParams(ModePush)}, Alloc{Blocks: [][]topology.BlockID{ids(1), ids(2)}, External: 16})
	if err == nil || !strings.Contains(err.Error(), "2 block groups, want 1") {
		t.Errorf("group mismatch error = %v", err)
	}
	s.Update(&Finished{Sending: []Outcome{{ReqID: "nope"}}})
	if s.Counters().UnknownUpdates != 1 {
		t.Errorf("unknown update counted %d times, want 1", s.Counters().UnknownUpdates)
	}
}

// Sliding-window groups keep their window; the span starts at the first
// kept token.
func TestClippingSetsSpanStart(t *testing.T) {
	s, _ := newSched(t, ModePull, func(c *SchedulerConfig) {
		c.Groups = []topology.Group{{Kind: topology.KindFullAttention}, {Kind: topology.KindSlidingWindow, Window: 32}}
	})
	blocks := [][]topology.BlockID{ids(1, 2, 3, 4, 5, 6), ids(11, 12, 13, 14, 15, 16)}
	_, params, err := s.RequestFinished(&Request{ID: "p", Params: &TransferParams{DoRemoteDecode: true}}, FinishStopped, blocks, 96)
	if err != nil {
		t.Fatal(err)
	}
	want := []topology.Span{{IDs: ids(1, 2, 3, 4, 5, 6)}, {Start: 48, IDs: ids(14, 15, 16)}}
	if !reflect.DeepEqual(params.RemoteBlockIDs, want) {
		t.Errorf("RemoteBlockIDs = %+v, want %+v", params.RemoteBlockIDs, want)
	}
}

// SPEC §8 bidirectional: D holds its blocks for the TTL and returns them;
// turn 2 on P reads them unless below the recompute threshold.
func TestBidirectionalTurns(t *testing.T) {
	d, c := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional = true })
	r := &Request{ID: "d-1", PromptTokens: 40, Params: pParams(ModePull)}
	if err := d.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(5, 6, 7)}, External: 40}); err != nil {
		t.Fatal(err)
	}
	delay, params, err := d.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(5, 6, 7, 8)}, 200)
	if err != nil || !delay || !params.DoRemoteDecode || !params.RemoteBlocksExpiry.Equal(c.t.Add(480*time.Second)) {
		t.Fatalf("D finish = %v, %+v, %v; want held for 480 s with do_remote_decode", delay, params, err)
	}
	p, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional = true })
	turn2 := &Request{ID: "p-2", PromptTokens: 300, Params: params}
	if n, async := p.MatchedTokens(turn2, 0); n != 200 || !async {
		t.Errorf("turn-2 MatchedTokens = %d, %v; want 200, true", n, async)
	}
	if n, async := p.MatchedTokens(turn2, 100); n != 100 || !async {
		t.Errorf("turn-2 MatchedTokens after 100 = %d, %v; want 100, true", n, async)
	}
	if n, _ := p.MatchedTokens(turn2, 150); n != 0 || p.Counters().Recomputed != 1 {
		t.Errorf("turn-2 below the threshold = %d (recomputed %d); want 0 and counted", n, p.Counters().Recomputed)
	}
	if err := p.AfterAlloc(turn2, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)}, External: 200}); err != nil {
		t.Fatal(err)
	}
	m := p.BuildMeta()
	// D's expiry is on D's clock: it travels as Remote.Expiry, which the
	// worker moves onto its own clock by the handshake's offset, and not
	// as Deadline, which is on this scheduler's clock
	// (TestBidirectionalTurn2PeerClockBehind).
	if len(m.Recv) != 1 || !m.Recv[0].Remote.Expiry.Equal(params.RemoteBlocksExpiry) || !m.Recv[0].Deadline.IsZero() || len(m.InBatch) != 1 {
		t.Errorf("turn-2 meta = %+v, want one read bounded by D's expiry (Remote.Expiry, no Deadline), in batch", m)
	}
}

// SPEC §11: host-buffer saves of new blocks, until the prefill is done.
func TestHostBufferSaveStaging(t *testing.T) {
	s, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.HostBuffer = true })
	r := &Request{ID: "p-1", PromptTokens: 48, Params: &TransferParams{DoRemoteDecode: true}}
	_ = s.AfterAlloc(r, Alloc{})
	s.Scheduled(r, [][]topology.BlockID{ids(1, 2)}, 0, 32)
	s.Scheduled(r, [][]topology.BlockID{ids(3)}, 32, 16)
	s.Scheduled(r, [][]topology.BlockID{ids(4)}, 48, 1) // decoding: no longer saved
	m := s.BuildMeta()
	want := []SaveReq{{ReqID: "p-1", Blocks: [][]topology.BlockID{ids(1, 2)}}, {ReqID: "p-1", Blocks: [][]topology.BlockID{ids(3)}}}
	if !reflect.DeepEqual(m.Save, want) {
		t.Errorf("Save = %+v, want %+v", m.Save, want)
	}
}

// Layer-wise push: Prefill lists a producer request in the metadata of
// the step that completes its prompt, with its blocks clipped as
// RequestFinished clips them, once.
func TestPrefillLayerwise(t *testing.T) {
	groups := []topology.Group{{Kind: topology.KindFullAttention}, {Kind: topology.KindSlidingWindow, Window: 32}}
	blocks := [][]topology.BlockID{ids(1, 2, 3, 4, 5, 6), ids(11, 12, 13, 14, 15, 16)}
	clipped := []topology.Span{{IDs: ids(1, 2, 3, 4, 5, 6)}, {Start: 48, IDs: ids(14, 15, 16)}}
	producer := func(id string) *Request {
		return &Request{ID: id, PromptTokens: 96, Params: &TransferParams{TransferID: "t-" + id, DoRemoteDecode: true}}
	}
	tests := []struct {
		name   string
		mode   Mode
		off    bool // Layerwise off
		r      *Request
		blocks [][]topology.BlockID
		// (computed, scheduled) of each step
		steps [][2]int
		// the Prefill of each step's BuildMeta
		want [][]SendReq
	}{
		{name: "one step completes the prompt", mode: ModePush, r: producer("p-1"), blocks: blocks,
			steps: [][2]int{{0, 96}, {96, 1}},
			want:  [][]SendReq{{{ReqID: "p-1", TransferID: "t-p-1", Blocks: clipped, Tokens: 96}}, nil}},
		{name: "chunked prefill: listed in the last chunk's step only", mode: ModePush, r: producer("p-1"), blocks: blocks,
			steps: [][2]int{{0, 32}, {32, 32}, {64, 32}, {96, 1}},
			want:  [][]SendReq{nil, nil, {{ReqID: "p-1", TransferID: "t-p-1", Blocks: clipped, Tokens: 96}}, nil}},
		{name: "prefix hit counts as computed", mode: ModePush, r: producer("p-1"), blocks: blocks,
			steps: [][2]int{{64, 31}, {64, 32}},
			want:  [][]SendReq{nil, {{ReqID: "p-1", TransferID: "t-p-1", Blocks: clipped, Tokens: 96}}}},
		{name: "not layer-wise", mode: ModePush, off: true, r: producer("p-1"), blocks: blocks,
			steps: [][2]int{{0, 96}}, want: [][]SendReq{nil}},
		{name: "consumer request", mode: ModePush, r: &Request{ID: "d-1", PromptTokens: 96, Params: pParams(ModePush)}, blocks: blocks,
			steps: [][2]int{{0, 96}}, want: [][]SendReq{nil}},
		{name: "no params", mode: ModePush, r: &Request{ID: "x", PromptTokens: 96}, blocks: blocks,
			steps: [][2]int{{0, 96}}, want: [][]SendReq{nil}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, tc.mode, func(c *SchedulerConfig) { c.Groups, c.Layerwise = groups, !tc.off })
			for i, st := range tc.steps {
				if err := s.Prefill(tc.r, tc.blocks, st[0], st[1]); err != nil {
					t.Fatalf("step %d: Prefill(%d, %d) = %v", i, st[0], st[1], err)
				}
				if got := s.BuildMeta().Prefill; !reflect.DeepEqual(got, tc.want[i]) {
					t.Errorf("step %d (computed %d, scheduled %d): Prefill = %+v, want %+v", i, st[0], st[1], got, tc.want[i])
				}
			}
			if s.HasPendingWork() {
				t.Errorf("pending work after the builds, want none")
			}
		})
	}
}

func TestPrefillDuplicatesAndOrder(t *testing.T) {
	s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Layerwise = true })
	b, a := &Request{ID: "p-b", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true}},
		&Request{ID: "p-a", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true}}
	for _, r := range []*Request{b, a, b} { // b twice in one step
		if err := s.Prefill(r, [][]topology.BlockID{ids(1)}, 0, 16); err != nil {
			t.Fatal(err)
		}
	}
	if !s.HasPendingWork() {
		t.Errorf("staged prefill is not pending work")
	}
	m := s.BuildMeta()
	if len(m.Prefill) != 2 || m.Prefill[0].ReqID != "p-a" || m.Prefill[1].ReqID != "p-b" {
		t.Errorf("Prefill = %+v, want p-a and p-b once each, sorted", m.Prefill)
	}
	// A later step (the engine reschedules it: preemption) lists it no more.
	_ = s.Prefill(a, [][]topology.BlockID{ids(1)}, 0, 16)
	if m := s.BuildMeta(); len(m.Prefill) != 0 {
		t.Errorf("Prefill after a request was listed = %+v, want nothing", m.Prefill)
	}
	// Once finished, the id may be used again.
	if _, _, err := s.RequestFinished(a, FinishStopped, [][]topology.BlockID{ids(1)}, 16); err != nil {
		t.Fatal(err)
	}
	_ = s.Prefill(a, [][]topology.BlockID{ids(2)}, 0, 16)
	if m := s.BuildMeta(); len(m.Prefill) != 1 || len(m.Send) != 1 {
		t.Errorf("after finish and reuse: Prefill %+v, Send %+v; want one each", m.Prefill, m.Send)
	}
	if s.Counters().BadParams != 0 {
		t.Errorf("BadParams = %d, want 0", s.Counters().BadParams)
	}
}

func TestPrefillBadInput(t *testing.T) {
	s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Layerwise = true })
	r := &Request{ID: "p-1", PromptTokens: 32, Params: &TransferParams{DoRemoteDecode: true}}
	tests := []struct {
		name                string
		blocks              [][]topology.BlockID
		computed, scheduled int
		want                string
	}{
		{"group count", [][]topology.BlockID{ids(1), ids(2)}, 0, 32, "blocks has 2 groups, want 1"},
		{"no groups", nil, 0, 32, "blocks has 0 groups, want 1"},
		{"negative computed", [][]topology.BlockID{ids(1)}, -1, 32, "computed/scheduled = -1/32"},
		{"negative scheduled", [][]topology.BlockID{ids(1)}, 0, -5, "computed/scheduled = 0/-5"},
		// Their sum wrapped around and read as a step short of the prompt:
		// the call was a silent no-op.
		{"sum overflows", [][]topology.BlockID{ids(1)}, math.MaxInt, 1, fmt.Sprintf("computed + scheduled = %d + 1 overflows", math.MaxInt)},
	}
	for i, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := s.Prefill(r, tc.blocks, tc.computed, tc.scheduled)
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), `"p-1"`) {
				t.Errorf("Prefill(%v, %d, %d) = %v, want an error naming the request and %q", tc.blocks, tc.computed, tc.scheduled, err, tc.want)
			}
			if got := s.Counters().BadParams; got != uint64(i+1) {
				t.Errorf("BadParams = %d, want %d", got, i+1)
			}
		})
	}
	if m := s.BuildMeta(); len(m.Prefill) != 0 {
		t.Errorf("Prefill after bad input = %+v, want nothing staged", m.Prefill)
	}
	// Bad input still lets a good call through afterwards.
	if err := s.Prefill(r, [][]topology.BlockID{ids(1, 2)}, 0, 32); err != nil {
		t.Fatal(err)
	}
	if m := s.BuildMeta(); len(m.Prefill) != 1 {
		t.Errorf("Prefill = %+v, want the request", m.Prefill)
	}
}

func TestBaseRequestID(t *testing.T) {
	tests := map[string]string{
		"req-1-0badf00d": "req-1", "req-1-DEADBEEF": "req-1", "req-1": "req-1", "req-1-0bad": "req-1-0bad",
		"-0badf00d": "", "req-1-0badf00g": "req-1-0badf00g", "req-1x0badf00d": "req-1x0badf00d", "": "",
	}
	for in, want := range tests {
		if got := BaseRequestID(in); got != want {
			t.Errorf("BaseRequestID(%q) = %q, want %q", in, got, want)
		}
	}
}

// Update knows every receive the scheduler staged, pull ones included:
// only outcomes of requests it never saw count as unknown.
func TestUpdateKnowsPullReceives(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		s, _ := newSched(t, mode, nil)
		for _, id := range []string{"d-1", "d-2"} {
			r := &Request{ID: id, PromptTokens: 40, Params: pParams(mode)}
			r.Params.TransferID = "t-" + id // one transfer each
			if err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: 40}); err != nil {
				t.Fatal(err)
			}
		}
		if m := s.BuildMeta(); len(m.Recv) != 2 {
			t.Fatalf("%v: %d receives staged, want 2", mode, len(m.Recv))
		}
		s.Update(&Finished{Recving: []Outcome{{ReqID: "d-1", Result: ResultDone}, {ReqID: "d-2", Result: ResultFailed}}})
		if n := s.Counters().UnknownUpdates; n != 0 {
			t.Errorf("%v: %d unknown updates for receives the scheduler staged, want 0", mode, n)
		}
		// Each outcome is known once; a second report, or an id never
		// staged, is unknown.
		s.Update(&Finished{Recving: []Outcome{{ReqID: "d-1"}, {ReqID: "never"}}})
		if n := s.Counters().UnknownUpdates; n != 2 {
			t.Errorf("%v: unknown updates = %d, want 2", mode, n)
		}
		if s.Watching() != 0 {
			t.Errorf("%v: watching %d after the outcomes, want 0", mode, s.Watching())
		}
	}
}

// A request that finishes abnormally (aborted) after its prefill was staged and
// before the step's metadata is built is not listed in Prefill: its
// blocks are freed, and no SendReq follows to end it on the workers.
func TestPrefillDroppedWhenFinishedBeforeBuild(t *testing.T) {
	for _, status := range []FinishStatus{FinishAborted, FinishError} {
		t.Run(status.String(), func(t *testing.T) {
			s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Layerwise = true })
			keep := &Request{ID: "p-keep", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true}}
			r := &Request{ID: "p-1", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true}}
			for _, q := range []*Request{keep, r} {
				if err := s.Prefill(q, [][]topology.BlockID{ids(1)}, 0, 16); err != nil {
					t.Fatal(err)
				}
			}
			if _, _, err := s.RequestFinished(r, status, [][]topology.BlockID{ids(1)}, 16); err != nil {
				t.Fatal(err)
			}
			m := s.BuildMeta()
			if len(m.Prefill) != 1 || m.Prefill[0].ReqID != "p-keep" {
				t.Errorf("Prefill = %+v, want only p-keep (p-1 finished before the build)", m.Prefill)
			}
		})
	}
}

// A layer-wise producer request that finishes abnormally and is then
// prefilled again before the build (its engine preempted it after its
// prefill step, freeing its blocks, and scheduled it again at once) is
// listed in NotProcessed (the old request) and in Prefill (the new one,
// from its new blocks): the worker ends the one and holds the other.
func TestPrefillAgainAfterAbortListsBoth(t *testing.T) {
	s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Layerwise = true })
	r := &Request{ID: "p-1", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true, TransferID: "t1"}}
	if err := s.Prefill(r, [][]topology.BlockID{ids(1)}, 0, 16); err != nil {
		t.Fatal(err)
	}
	if m := s.BuildMeta(); len(m.Prefill) != 1 {
		t.Fatalf("first build: Prefill = %+v, want p-1", m.Prefill)
	}
	if _, _, err := s.RequestFinished(r, FinishAborted, [][]topology.BlockID{ids(1)}, 16); err != nil {
		t.Fatal(err)
	}
	if err := s.Prefill(r, [][]topology.BlockID{ids(2)}, 0, 16); err != nil {
		t.Fatal(err)
	}
	m := s.BuildMeta()
	if !slices.Equal(m.NotProcessed, []string{"p-1"}) || m.NotProcessedTransferIDs["p-1"] != "t1" {
		t.Errorf("NotProcessed = %v (%v), want p-1 (t1)", m.NotProcessed, m.NotProcessedTransferIDs)
	}
	if len(m.Prefill) != 1 || m.Prefill[0].ReqID != "p-1" || len(m.Prefill[0].Blocks) != 1 || !slices.Equal(m.Prefill[0].Blocks[0].IDs, ids(2)) {
		t.Errorf("Prefill = %+v, want p-1 from block 2", m.Prefill)
	}
}

// A producer request that finishes under the id of one still holding its
// blocks for a transfer (no outcome for it yet) is refused with an error
// naming the id, counted, and holds nothing: staged, the workers dropped
// it as a duplicate, it never reported, and the old request's outcome
// ended it. Once the old one's outcome is in, the id is free again.
func TestRequestFinishedUnderHeldIDRefused(t *testing.T) {
	s, _ := newSched(t, ModePush, nil)
	r := &Request{ID: "p-1", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true, TransferID: "t1"}}
	if delay, _, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1)}, 16); err != nil || !delay {
		t.Fatalf("first: delay %v, err %v", delay, err)
	}
	s.BuildMeta()
	again := &Request{ID: "p-1", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true, TransferID: "t2"}}
	bad := s.Counters().BadParams
	delay, prm, err := s.RequestFinished(again, FinishStopped, [][]topology.BlockID{ids(2)}, 16)
	if err == nil || !strings.Contains(err.Error(), `"p-1"`) || delay || prm != nil {
		t.Errorf("under a held id: delay %v, params %v, err %v; want refused, naming the id", delay, prm, err)
	}
	if s.Counters().BadParams != bad+1 {
		t.Errorf("BadParams = %d, want %d", s.Counters().BadParams, bad+1)
	}
	if m := s.BuildMeta(); len(m.Send) != 0 {
		t.Errorf("Send = %+v, want nothing staged", m.Send)
	}
	s.Update(&Finished{Sending: []Outcome{{ReqID: "p-1", Result: ResultDone}}})
	if delay, _, err := s.RequestFinished(again, FinishStopped, [][]topology.BlockID{ids(2)}, 16); err != nil || !delay {
		t.Errorf("after the old request's outcome: delay %v, err %v; want held", delay, err)
	}
}

// A pull hold whose request's params carry no transfer id gets one of its
// own in the params its consumer reads with, and the hold is staged under
// it: each hold of a producer request id another (its consumer's READs,
// completion notices and heartbeats tell the holds apart), and another
// scheduler's (a restarted engine) never the same. A router's transfer id
// is kept as it is; push holds, whose consumers get their transfer id
// from the router, get none. Before, the pull hold had none, and the
// earlier consumer of a producer request id used again counted for the
// new request (TestPullIDReusedWithoutTransferID).
func TestPullHoldNamedByTransferID(t *testing.T) {
	finish := func(s *Scheduler, tid string) (*TransferParams, SendReq) {
		t.Helper()
		r := &Request{ID: "p-1", Params: &TransferParams{TransferID: tid, DoRemoteDecode: true}}
		delay, params, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1, 2)}, 32)
		if err != nil || !delay {
			t.Fatalf("RequestFinished = %v, %v; want delay", delay, err)
		}
		m := s.BuildMeta()
		if len(m.Send) != 1 {
			t.Fatalf("Send = %+v, want one hold", m.Send)
		}
		s.Update(&Finished{Sending: []Outcome{{ReqID: "p-1", Result: ResultExpired, Kind: FailureExpired}}})
		return params, m.Send[0]
	}
	s, _ := newSched(t, ModePull, nil)
	seen := map[string]bool{}
	for i := range 3 {
		params, send := finish(s, "")
		if params.TransferID == "" || send.TransferID != params.TransferID || seen[params.TransferID] {
			t.Errorf("hold %d: params name transfer id %q, the hold %q (earlier holds %v); want one of its own, the same in both",
				i, params.TransferID, send.TransferID, seen)
		}
		seen[params.TransferID] = true
	}
	other, _ := newSched(t, ModePull, nil)
	if params, _ := finish(other, ""); seen[params.TransferID] {
		t.Errorf("another scheduler's hold is named %q, as one of the first's", params.TransferID)
	}
	if params, send := finish(s, "t-router"); params.TransferID != "t-router" || send.TransferID != "t-router" {
		t.Errorf("router's transfer id: params %q, hold %q; want t-router", params.TransferID, send.TransferID)
	}
	push, _ := newSched(t, ModePush, nil)
	if params, send := finish(push, ""); params.TransferID != "" || send.TransferID != "" {
		t.Errorf("push: params %q, hold %q; want no transfer id (the consumer's comes from the router)", params.TransferID, send.TransferID)
	}
}
