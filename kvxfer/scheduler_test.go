package kvxfer

import (
	"reflect"
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

// SPEC §7.1, §8.2: N (N-1 with Mamba) minus the computed tokens, async.
func TestMatchedTokens(t *testing.T) {
	tests := []struct {
		name     string
		groups   []topology.Group
		params   *TransferParams
		prompt   int
		computed int
		n        int
		async    bool
	}{
		{"no params", nil, nil, 100, 0, 0, false},
		{"remote prefill", nil, pParams(ModePull), 100, 16, 84, true},
		{"mamba recomputes the last token", []topology.Group{{Kind: topology.KindFullAttention}, {Kind: topology.KindMamba}}, pParams(ModePull), 100, 16, 83, true},
		{"prompt shorter than a block", nil, pParams(ModePull), 8, 0, 8, true},
		{"all computed", nil, pParams(ModePull), 32, 32, 0, false},
		{"producer", nil, &TransferParams{DoRemoteDecode: true}, 100, 0, 0, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Groups = tc.groups })
			n, async := s.MatchedTokens(&Request{ID: "d-1", PromptTokens: tc.prompt, Params: tc.params}, tc.computed)
			if n != tc.n || async != tc.async {
				t.Errorf("MatchedTokens = %d, %v; want %d, %v", n, async, tc.n, tc.async)
			}
		})
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
	m := s.BuildMeta()
	if !reflect.DeepEqual(m.NotProcessed, []string{"p-1"}) || len(m.Send) != 0 {
		t.Errorf("NotProcessed = %v, Send = %v; want [p-1] and nothing", m.NotProcessed, m.Send)
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
	if err := p.AfterAlloc(turn2, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3, 4)}, External: 200}); err != nil {
		t.Fatal(err)
	}
	m := p.BuildMeta()
	if len(m.Recv) != 1 || !m.Recv[0].Deadline.Equal(params.RemoteBlocksExpiry) || len(m.InBatch) != 1 {
		t.Errorf("turn-2 meta = %+v, want one read bounded by D's expiry, in batch", m)
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
