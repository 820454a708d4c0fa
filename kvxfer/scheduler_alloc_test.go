package kvxfer

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// A consumer with a full prefix hit gets an empty receive, whose outcome
// the engine never waits for (vLLM reports no finished_recving for a
// request it did not park in WAITING_FOR_REMOTE_KVS; the vLLM connector
// drops it). Once the request has finished, the scheduler must hold
// nothing for it: before, every full prefix hit left an entry in the
// receive table for as long as the scheduler lived.
func TestFullPrefixHitLeavesNothingBehind(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newSched(t, mode, nil)
			for i := range 100 {
				r := &Request{ID: "d-" + string(rune('a'+i%26)) + string(rune('a'+i/26)), PromptTokens: 32, Params: pParams(mode)}
				if err := s.AfterAlloc(r, Alloc{Computed: 32}); err != nil {
					t.Fatal(err)
				}
				m := s.BuildMeta()
				if len(m.Recv) != 1 || m.Recv[0].Local != nil {
					t.Fatalf("Recv = %+v, want one empty receive", m.Recv)
				}
				if _, _, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1, 2)}, 33); err != nil {
					t.Fatal(err)
				}
			}
			if n := len(s.recving) + len(s.processed) + len(s.watch) + len(s.held); n != 0 {
				t.Errorf("after 100 finished full-prefix-hit requests the scheduler tracks %d entries (recving %d), want 0",
					n, len(s.recving))
			}
			// A Go engine that hands every outcome on anyway is not
			// counted as reporting an unknown request.
			r := &Request{ID: "d-late", PromptTokens: 32, Params: pParams(mode)}
			_ = s.AfterAlloc(r, Alloc{Computed: 32})
			s.BuildMeta()
			s.Update(&Finished{Recving: []Outcome{{ReqID: "d-late", Result: ResultDone}}})
			if _, _, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1, 2)}, 33); err != nil {
				t.Fatal(err)
			}
			if n := s.Counters().UnknownUpdates; n != 0 || len(s.recving) != 0 {
				t.Errorf("unknown updates %d, recving %d; want 0, 0", n, len(s.recving))
			}
		})
	}
}

// External tokens with no block to land them in: the engine said tokens
// come from the producer, but the scheduler staged an empty receive (the
// full-prefix-hit form), which the worker reports done at once without
// moving a byte: the engine then computed on KV that never arrived. It is
// bad input, refused with an error naming the fields, counted, and
// nothing is staged.
func TestAfterAllocExternalWithoutBlocks(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newSched(t, mode, nil)
			for _, blocks := range [][][]topology.BlockID{{nil}, {{}}} {
				r := &Request{ID: "d-1", PromptTokens: 40, Params: pParams(mode)}
				err := s.AfterAlloc(r, Alloc{Blocks: blocks, External: 40})
				if err == nil || !strings.Contains(err.Error(), "External") || !strings.Contains(err.Error(), `"d-1"`) {
					t.Errorf("AfterAlloc(no blocks, 40 external) = %v, want an error naming the request and External", err)
				}
				if m := s.BuildMeta(); len(m.Recv) != 0 {
					t.Errorf("Recv = %+v, want nothing staged", m.Recv)
				}
			}
			if s.Counters().BadParams != 2 {
				t.Errorf("BadParams = %d, want 2", s.Counters().BadParams)
			}
		})
	}
}

// Blocks that hold fewer tokens than the engine takes from the producer:
// the transfer fills what the blocks hold and reports done, and the engine
// computes on tokens it never got. Refused, naming the fields.
func TestAfterAllocBlocksShortOfExternal(t *testing.T) {
	groups := []topology.Group{{Kind: topology.KindFullAttention}, {Kind: topology.KindSlidingWindow, Window: 16}, {Kind: topology.KindMamba}}
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newSched(t, mode, func(c *SchedulerConfig) { c.Groups = groups })
			p := pParams(mode)
			p.RemoteBlockIDs = []topology.Span{{IDs: ids(7, 8, 9)}, {IDs: ids(8, 9)}, {IDs: ids(3)}}
			r := &Request{ID: "d-1", PromptTokens: 48, Params: p}
			// 32 tokens computed, 16 external, but the full-attention list
			// past the hit is empty.
			err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{nil, ids(4), ids(5)}, Computed: 32, External: 16})
			if err == nil || !strings.Contains(err.Error(), "External") {
				t.Errorf("AfterAlloc = %v, want an error naming External", err)
			}
			// 40 external tokens in two 16-token blocks.
			err = s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(1, 2), ids(1, 2), ids(5)}, External: 40})
			if err == nil || !strings.Contains(err.Error(), "External") {
				t.Errorf("AfterAlloc = %v, want an error naming External", err)
			}
			if m := s.BuildMeta(); len(m.Recv) != 0 {
				t.Errorf("Recv = %+v, want nothing staged", m.Recv)
			}
			// Exactly enough (a partly filled last block) is fine.
			if err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3), ids(1, 2, 3), ids(5)}, External: 40}); err != nil {
				t.Errorf("AfterAlloc with 3 blocks for 40 tokens = %v", err)
			}
		})
	}
}

// Pull: the producer's params say it holds RemoteNumTokens tokens; a
// consumer that takes more (its prompt less its backoff is longer than
// what P computed: P and D disagree on the backoff, or the params are
// bad) would read what P holds, be told the read is done, and compute on
// the tokens past it that never came. Refused at AfterAlloc, naming the
// fields.
func TestPullConsumerTakesMoreThanProducerHolds(t *testing.T) {
	s, _ := newSched(t, ModePull, nil)
	p := pParams(ModePull) // P holds 40 tokens in 3 blocks
	r := &Request{ID: "d-1", PromptTokens: 48, Params: p}
	n, async := s.MatchedTokens(r, 0)
	if !async || n != 48 {
		t.Fatalf("MatchedTokens = %d, %v", n, async)
	}
	err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: n})
	if err == nil || !strings.Contains(err.Error(), "RemoteNumTokens") {
		t.Errorf("AfterAlloc(48 external, P holds 40) = %v, want an error naming RemoteNumTokens", err)
	}
	if m := s.BuildMeta(); len(m.Recv) != 0 {
		t.Errorf("Recv = %+v, want nothing staged", m.Recv)
	}
	if s.Counters().BadParams != 1 {
		t.Errorf("BadParams = %d, want 1", s.Counters().BadParams)
	}
	// What P holds exactly is fine, after a prefix hit too.
	r2 := &Request{ID: "d-2", PromptTokens: 40, Params: pParams(ModePull)}
	if err := s.AfterAlloc(r2, Alloc{Blocks: [][]topology.BlockID{ids(2, 3)}, Computed: 16, External: 24}); err != nil {
		t.Errorf("AfterAlloc(16 computed + 24 external, P holds 40) = %v", err)
	}
}

// Bidirectional turn 2 on P: MatchedTokens must not promise an
// asynchronous load that AfterAlloc will not stage (the engine parks the
// request for a receive that never comes, for ever): with a host buffer
// (AfterAlloc never reads back), and for a request asked again after its
// read was staged (preempted and rescheduled).
func TestBidirectionalTurn2NeverPromisesWhatItWillNotStage(t *testing.T) {
	d, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional = true })
	r := &Request{ID: "d-1", PromptTokens: 200, Params: pParams(ModePull)}
	blocks := [][]topology.BlockID{ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)}
	if err := d.AfterAlloc(r, Alloc{Blocks: blocks, External: 40}); err != nil {
		t.Fatal(err)
	}
	_, params, err := d.RequestFinished(r, FinishStopped, blocks, 200)
	if err != nil || params == nil {
		t.Fatal(params, err)
	}
	for _, hostBuffer := range []bool{false, true} {
		p, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional, c.HostBuffer = true, hostBuffer })
		pp := *params
		turn2 := &Request{ID: "p-2", PromptTokens: 300, Params: &pp}
		for ask := range 2 { // asked again after a preemption
			n, async := p.MatchedTokens(turn2, 0)
			if err := p.AfterAlloc(turn2, Alloc{Blocks: blocks, External: n}); err != nil {
				t.Fatal(err)
			}
			m := p.BuildMeta()
			if async != (len(m.Recv) == 1) {
				t.Errorf("host buffer %v, ask %d: MatchedTokens = %d, %v but %d receives staged", hostBuffer, ask, n, async, len(m.Recv))
			}
		}
	}
}

// Push registrations whose receive ended are dropped from the watchdog's
// heap too, not only when their deadline passes: with a long registration
// timeout the heap grew by one entry per request for the whole timeout.
func TestWatchdogHeapBounded(t *testing.T) {
	s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.RegistrationTimeout = 24 * time.Hour })
	for i := range 1000 {
		id := "d-" + strings.Repeat("x", i%7) + string(rune('a'+i%26)) + string(rune('a'+(i/26)%26)) + string(rune('a'+i/676))
		r := &Request{ID: id, PromptTokens: 16, Params: pParams(ModePush)}
		if err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(1)}, External: 16}); err != nil {
			t.Fatal(err)
		}
		s.BuildMeta()
		s.Update(&Finished{Recving: []Outcome{{ReqID: id, Result: ResultDone}}})
		if _, _, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1)}, 17); err != nil {
			t.Fatal(err)
		}
	}
	if s.Watching() != 0 || len(s.watchQ) > 64 {
		t.Errorf("watching %d, watchdog heap %d entries after 1000 finished receives; want 0 and a small heap", s.Watching(), len(s.watchQ))
	}
}

// Engine values out of range are refused naming the field: a negative
// prefix hit or external count at AfterAlloc, a negative or misaligned
// computed count (the span would start off a block), a negative computed
// count at RequestFinished (P would hand D a negative RemoteNumTokens and
// hold its blocks for a transfer that cannot be planned).
func TestSchedulerRefusesOutOfRangeCounts(t *testing.T) {
	for _, mode := range []Mode{ModePull, ModePush} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newSched(t, mode, nil)
			for _, tc := range []struct {
				a    Alloc
				want string
			}{
				{Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, Computed: -16, External: 40}, "Computed = -16"},
				{Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, Computed: 8, External: 32}, "Computed = 8"},
				{Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: -1}, "External = -1"},
			} {
				r := &Request{ID: "d-1", PromptTokens: 40, Params: pParams(mode)}
				if err := s.AfterAlloc(r, tc.a); err == nil || !strings.Contains(err.Error(), tc.want) {
					t.Errorf("AfterAlloc(%+v) = %v, want an error naming %q", tc.a, err, tc.want)
				}
			}
			if m := s.BuildMeta(); len(m.Recv) != 0 {
				t.Errorf("Recv = %+v, want nothing staged", m.Recv)
			}
			r := &Request{ID: "p-1", PromptTokens: 40, Params: &TransferParams{DoRemoteDecode: true}}
			delay, params, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1, 2, 3)}, -5)
			if err == nil || !strings.Contains(err.Error(), "computed = -5") || delay || params != nil || s.Held() != 0 {
				t.Errorf("RequestFinished(computed -5) = %v, %+v, %v (held %d); want an error naming computed, nothing held", delay, params, err, s.Held())
			}
		})
	}
}
