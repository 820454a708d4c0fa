package kvxfer

import (
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// Params a producer of the other mode returned (a router mixing push and
// pull engines) are refused where they are staged, naming the field and
// both modes, and counted; nothing is staged. (The producer of the other
// mode would hold its blocks for its lease and the transfer would fail at
// the handshake instead.)
func TestAfterAllocRefusesParamsOfAnotherMode(t *testing.T) {
	for _, mode := range []Mode{ModePush, ModePull} {
		other := ModePull
		if mode == ModePull {
			other = ModePush
		}
		s, _ := newSched(t, mode, nil)
		r := &Request{ID: "d-1", PromptTokens: 40, Params: pParams(other)}
		err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: 40})
		if err == nil || !strings.Contains(err.Error(), "Mode = "+other.String()) || s.Counters().BadParams != 1 {
			t.Errorf("%v consumer, %v params: AfterAlloc = %v (bad %d); want an error naming Mode = %v, counted",
				mode, other, err, s.Counters().BadParams, other)
		}
		if m := s.BuildMeta(); len(m.Recv) != 0 {
			t.Errorf("%v consumer, %v params: staged %+v, want nothing", mode, other, m.Recv)
		}
	}
}

// MatchedTokens never promises an asynchronous load of params AfterAlloc
// will refuse whatever is allocated (the engine would keep the request
// waiting for a receive that is never staged, with its blocks): the
// request is computed locally instead, its DoRemotePrefill consumed so
// that nothing else acts on the params, and the refusal is counted once.
func TestMatchedTokensRefusesUnusableParams(t *testing.T) {
	tests := []struct {
		name string
		mode Mode
		mut  func(*TransferParams)
	}{
		{"no engine", ModePush, func(p *TransferParams) { p.RemoteEngineID = "" }},
		{"no addr", ModePull, func(p *TransferParams) { p.RemoteAddr = "" }},
		{"no ids", ModePush, func(p *TransferParams) { p.RemoteRequestID, p.TransferID = "", "" }},
		{"negative tp", ModePull, func(p *TransferParams) { p.RemoteTPSize = -1 }},
		{"pull without blocks", ModePull, func(p *TransferParams) { p.RemoteBlockIDs = nil }},
		{"other mode", ModePull, func(p *TransferParams) { p.Mode = ModePush }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, tc.mode, nil)
			p := pParams(tc.mode)
			tc.mut(p)
			r := &Request{ID: "d-1", PromptTokens: 40, Params: p}
			if n, async := s.MatchedTokens(r, 0); n != 0 || async {
				t.Fatalf("MatchedTokens = %d, %v; want 0, false", n, async)
			}
			if p.DoRemotePrefill || s.Counters().BadParams != 1 {
				t.Errorf("DoRemotePrefill %v, bad %d; want consumed, counted once", p.DoRemotePrefill, s.Counters().BadParams)
			}
			// vLLM goes on with update_state_after_alloc (0 external
			// tokens) and, at the end, request_finished.
			if err := s.AfterAlloc(r, Alloc{}); err != nil {
				t.Errorf("AfterAlloc after the refusal: %v", err)
			}
			if _, _, err := s.RequestFinished(r, FinishStopped, [][]topology.BlockID{ids(1)}, 40); err != nil {
				t.Errorf("RequestFinished after the refusal: %v", err)
			}
			if m := s.BuildMeta(); len(m.Recv) != 0 || s.Counters().BadParams != 1 {
				t.Errorf("staged %+v, bad %d; want nothing staged, counted once", m.Recv, s.Counters().BadParams)
			}
		})
	}
}

// A receive is staged once: the same request allocated again while its
// receive is in flight, or a second request carrying the params of a
// transfer another request of this engine is receiving (kv_transfer_params
// replayed), is refused naming the request or transfer, and counted. Two
// receives of one producer request would each count toward the producer's
// release (pull P counts one completion per consumer rank): the first to
// finish frees the blocks the other is still reading.
func TestReplayedReceiveRefused(t *testing.T) {
	for _, mode := range []Mode{ModePush, ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newSched(t, mode, nil)
			alloc := Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: 40}
			if err := s.AfterAlloc(&Request{ID: "d-1", PromptTokens: 40, Params: pParams(mode)}, alloc); err != nil {
				t.Fatal(err)
			}
			err := s.AfterAlloc(&Request{ID: "d-1", PromptTokens: 40, Params: pParams(mode)}, alloc)
			if err == nil || !strings.Contains(err.Error(), `"d-1"`) || !strings.Contains(err.Error(), "already") || s.Counters().BadParams != 1 {
				t.Errorf("same request again: %v (bad %d); want refused, counted", err, s.Counters().BadParams)
			}
			err = s.AfterAlloc(&Request{ID: "d-2", PromptTokens: 40, Params: pParams(mode)}, alloc)
			if err == nil || !strings.Contains(err.Error(), `TransferID = "t1"`) || s.Counters().BadParams != 2 {
				t.Errorf("same transfer id, other request: %v (bad %d); want refused naming TransferID, counted", err, s.Counters().BadParams)
			}
			noTID := pParams(mode)
			noTID.TransferID = ""
			if err := s.AfterAlloc(&Request{ID: "d-3", PromptTokens: 40, Params: noTID}, alloc); err != nil {
				t.Fatal(err)
			}
			noTID2 := pParams(mode)
			noTID2.TransferID = ""
			err = s.AfterAlloc(&Request{ID: "d-4", PromptTokens: 40, Params: noTID2}, alloc)
			if err == nil || !strings.Contains(err.Error(), `RemoteRequestID = "p-1"`) || s.Counters().BadParams != 3 {
				t.Errorf("same remote request, no transfer id: %v (bad %d); want refused naming RemoteRequestID, counted", err, s.Counters().BadParams)
			}
			m := s.BuildMeta()
			if len(m.Recv) != 2 || m.Recv[0].ReqID != "d-1" || m.Recv[1].ReqID != "d-3" {
				t.Fatalf("staged %+v, want d-1 and d-3 once each", m.Recv)
			}
			// Once the first receive ended, its transfer is free again
			// (the engine's own retry of a failed load).
			s.Update(&Finished{Recving: []Outcome{{ReqID: "d-1", Result: ResultFailed}}})
			if err := s.AfterAlloc(&Request{ID: "d-5", PromptTokens: 40, Params: pParams(mode)}, alloc); err != nil {
				t.Errorf("after the first receive ended: %v", err)
			}
		})
	}
}

// The map of live transfers is bounded by the live receives: full prefix
// hits forgotten at finish and receives reported leave nothing behind.
func TestReplayIndexBounded(t *testing.T) {
	s, _ := newSched(t, ModePull, nil)
	for i := 0; i < 100; i++ {
		p := pParams(ModePull)
		p.TransferID = string(rune('a'+i%26)) + strings.Repeat("x", i)
		r := &Request{ID: p.TransferID, PromptTokens: 40, Params: p}
		ext := 40
		if i%2 == 0 {
			ext = 0
		}
		if err := s.AfterAlloc(r, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: ext}); err != nil {
			t.Fatal(err)
		}
		if i%2 == 0 {
			if _, _, err := s.RequestFinished(r, FinishStopped, nil, 0); err != nil {
				t.Fatal(err)
			}
		} else {
			s.Update(&Finished{Recving: []Outcome{{ReqID: r.ID, Result: ResultDone}}})
		}
	}
	if len(s.recving) != 0 || len(s.recvKeys) != 0 {
		t.Errorf("recving %d, recvKeys %d; want both empty", len(s.recving), len(s.recvKeys))
	}
}

// In push the producer WRITEs what it holds (RemoteNumTokens, when its
// params say): a consumer registering for more would take the rest as
// loaded. Refused as pull refuses it.
func TestPushConsumerTakesMoreThanProducerHolds(t *testing.T) {
	s, _ := newSched(t, ModePush, nil)
	p := pParams(ModePush) // P holds 40 tokens
	err := s.AfterAlloc(&Request{ID: "d-1", PromptTokens: 48, Params: p}, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: 48})
	if err == nil || !strings.Contains(err.Error(), "RemoteNumTokens = 40") || s.Counters().BadParams != 1 {
		t.Errorf("AfterAlloc(48 external, P holds 40) = %v (bad %d); want an error naming RemoteNumTokens, counted", err, s.Counters().BadParams)
	}
	if m := s.BuildMeta(); len(m.Recv) != 0 {
		t.Errorf("Recv = %+v, want nothing staged", m.Recv)
	}
	// Params without a count (a router that sends D the request before P
	// finished) are not bounded.
	p = pParams(ModePush)
	p.RemoteNumTokens, p.TransferID = 0, "t2"
	if err := s.AfterAlloc(&Request{ID: "d-2", PromptTokens: 48, Params: p}, Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: 48}); err != nil {
		t.Errorf("AfterAlloc without RemoteNumTokens = %v", err)
	}
}

// A request aborted before it was scheduled tells its producer at once
// that it reads nothing, and the producer frees its blocks: not while
// another request of this engine is receiving that very transfer (params
// replayed), whose blocks would be freed under it. Refused and counted.
func TestAbortOfReplayedParamsReleasesNothing(t *testing.T) {
	for _, mode := range []Mode{ModePush, ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			s, _ := newSched(t, mode, nil)
			if err := s.AfterAlloc(&Request{ID: "d-1", PromptTokens: 40, Params: pParams(mode)},
				Alloc{Blocks: [][]topology.BlockID{ids(1, 2, 3)}, External: 40}); err != nil {
				t.Fatal(err)
			}
			s.BuildMeta()
			delay, params, err := s.RequestFinished(&Request{ID: "d-2", PromptTokens: 40, Params: pParams(mode)}, FinishAborted, nil, 0)
			if delay || params != nil || err == nil || !strings.Contains(err.Error(), `TransferID = "t1"`) || s.Counters().BadParams != 1 {
				t.Errorf("abort of replayed params = %v, %v, %v (bad %d); want refused naming TransferID, counted", delay, params, err, s.Counters().BadParams)
			}
			if m := s.BuildMeta(); len(m.Recv) != 0 {
				t.Errorf("staged %+v, want nothing (d-1 is still receiving t1)", m.Recv)
			}
			// Its own abort (before its receive was staged) still releases.
			if _, _, err := s.RequestFinished(&Request{ID: "d-3", PromptTokens: 40, Params: func() *TransferParams {
				p := pParams(mode)
				p.TransferID = "t3"
				return p
			}()}, FinishAborted, nil, 0); err != nil {
				t.Fatal(err)
			}
			if m := s.BuildMeta(); len(m.Recv) != 1 || !m.Recv[0].Aborted || m.Recv[0].ReqID != "d-3" {
				t.Errorf("staged %+v, want d-3's aborted receive", m.Recv)
			}
		})
	}
}

// Bidirectional turn 2 on P: params of D's first turn that cannot be
// read back (a coordinate missing, the other mode) are not promised as an
// asynchronous load AfterAlloc then refuses (the request would wait for
// a receive never staged): P computes the turn itself, refused once,
// counted once, however often the engine asks.
func TestBidirectionalTurn2UnusableParams(t *testing.T) {
	for _, tc := range []struct {
		name string
		mut  func(*TransferParams)
	}{
		{"no engine", func(p *TransferParams) { p.RemoteEngineID = "" }},
		{"no addr", func(p *TransferParams) { p.RemoteAddr = "" }},
		{"other mode", func(p *TransferParams) { p.Mode = ModePush }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional = true })
			params := &TransferParams{DoRemoteDecode: true, RemoteEngineID: "D", RemoteAddr: "d:1", RemoteRequestID: "d-1",
				RemoteBlockIDs: []topology.Span{{IDs: ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)}}, RemoteNumTokens: 200, Mode: ModePull}
			tc.mut(params)
			turn2 := &Request{ID: "p-2", PromptTokens: 300, Params: params}
			blocks := [][]topology.BlockID{ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19)}
			for ask := range 2 {
				n, async := p.MatchedTokens(turn2, 0)
				if n != 0 || async {
					t.Errorf("ask %d: MatchedTokens = %d, %v; want 0, false", ask, n, async)
				}
				if err := p.AfterAlloc(turn2, Alloc{Blocks: blocks, External: n}); err != nil {
					t.Errorf("ask %d: AfterAlloc = %v", ask, err)
				}
			}
			if m := p.BuildMeta(); len(m.Recv) != 0 || p.Counters().BadParams != 1 {
				t.Errorf("staged %+v, bad %d; want nothing staged, counted once", m.Recv, p.Counters().BadParams)
			}
		})
	}
}
