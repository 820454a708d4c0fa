package kvxfer

import (
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// bidirTurn1 runs a bidirectional consumer's first turn on a fresh D
// scheduler (groups as given) and returns the params it hands back for
// the producer's next turn: D holds its blocks, computed tokens of KV.
func bidirTurn1(t *testing.T, groups []topology.Group, blocks [][]topology.BlockID, computed int) *TransferParams {
	t.Helper()
	d, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional, c.Groups = true, groups })
	pp := pParams(ModePull)
	pp.RemoteNumTokens = d.PrefillTokens(40) // what the producer computed
	if len(groups) == 2 {
		pp.RemoteBlockIDs = append(pp.RemoteBlockIDs, topology.Span{IDs: ids(10)})
	}
	r := &Request{ID: "d-1", PromptTokens: 40, Params: pp}
	n, _ := d.MatchedTokens(r, 0)
	if err := d.AfterAlloc(r, Alloc{Blocks: blocks, External: n}); err != nil {
		t.Fatal(err)
	}
	delay, params, err := d.RequestFinished(r, FinishStopped, blocks, computed)
	if err != nil || !delay || params == nil || !params.DoRemoteDecode {
		t.Fatalf("D finish = %v, %+v, %v; want its blocks held for the next turn", delay, params, err)
	}
	return params
}

// Bidirectional turn 2 with a Mamba group: D's state block holds the
// recurrent state as of the RemoteNumTokens tokens D computed, and it
// cannot be rewound. A turn-2 prompt no longer than that (a regenerated
// or edited turn: the prompt is a prefix of what D computed) must not
// load it: P would take as loaded the prompt's tokens with a state that
// already holds tokens past them (or, with the whole prompt loaded,
// apply its last token a second time when the engine computes it).
// Before, MatchedTokens promised min(RemoteNumTokens, prompt) - computed
// tokens and AfterAlloc staged the read: the wrong state, reported loaded.
func TestBidirectionalTurn2MambaStateNotPastPrompt(t *testing.T) {
	blocks := [][]topology.BlockID{ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13), ids(20)}
	params := bidirTurn1(t, hybrid, blocks, 200)
	for _, tc := range []struct {
		prompt, n int
	}{
		{100, 0}, // the state is past the prompt
		{200, 0}, // the whole prompt: its last token would be applied twice
		{201, 200},
		{300, 200},
	} {
		p, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional, c.Groups = true, hybrid })
		pp := *params
		turn2 := &Request{ID: "p-2", PromptTokens: tc.prompt, Params: &pp}
		n, async := p.MatchedTokens(turn2, 0)
		if n != tc.n || async != (tc.n > 0) {
			t.Errorf("prompt %d: turn-2 MatchedTokens = %d, %v; want %d, %v", tc.prompt, n, async, tc.n, tc.n > 0)
		}
		// An engine that loads what the state does not hold anyway is
		// refused, naming the fields.
		if tc.n == 0 {
			err := p.AfterAlloc(turn2, Alloc{Blocks: [][]topology.BlockID{ids(31, 32, 33, 34, 35, 36, 37), ids(40)}, External: min(tc.prompt, 100)})
			if err == nil {
				t.Errorf("prompt %d: AfterAlloc loading %d tokens of a state as of token 200 = nil, want an error", tc.prompt, min(tc.prompt, 100))
			}
		}
	}
}

// Bidirectional turn 2 that reads nothing of what D holds (a full
// prefix hit on P, a read below the recompute threshold, or the request
// aborted before it was scheduled) tells D at once, as a first turn's
// consumer tells its producer, so that D frees the blocks it holds for
// this turn instead of holding them for DecoderBlocksTTL (480 s by
// default) that nobody will read. Before, nothing was staged: D's blocks
// stayed held for the whole TTL, once per such turn.
func TestBidirectionalTurn2ReleasesUnreadBlocks(t *testing.T) {
	blocks := [][]topology.BlockID{ids(1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)}
	params := bidirTurn1(t, nil, blocks, 200)
	for _, tc := range []struct {
		name     string
		computed int // P's prefix hit
		abort    bool
	}{
		{"full prefix hit", 208, false},
		{"below the recompute threshold", 160, false},
		{"aborted before it was scheduled", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, _ := newSched(t, ModePull, func(c *SchedulerConfig) { c.Bidirectional = true })
			pp := *params
			turn2 := &Request{ID: "p-2", PromptTokens: 300, Params: &pp}
			if tc.abort {
				if _, _, err := p.RequestFinished(turn2, FinishAborted, nil, 0); err != nil {
					t.Fatal(err)
				}
			} else {
				n, async := p.MatchedTokens(turn2, tc.computed)
				if n != 0 || async {
					t.Fatalf("MatchedTokens = %d, %v; want 0, false", n, async)
				}
				if err := p.AfterAlloc(turn2, Alloc{Blocks: [][]topology.BlockID{ids(31, 32, 33, 34, 35, 36, 37)}, Computed: tc.computed}); err != nil {
					t.Fatal(err)
				}
			}
			m := p.BuildMeta()
			if len(m.Recv) != 1 || len(m.Recv[0].Local) != 0 || m.Recv[0].Remote.EngineID != "E" || m.Recv[0].Remote.ReqID != "d-1" || m.Recv[0].Aborted != tc.abort {
				t.Fatalf("turn-2 meta Recv = %+v; want one empty receive of D's d-1 (aborted %v), so that D frees its blocks", m.Recv, tc.abort)
			}
			// Nothing waits for its outcome, and nothing is kept.
			if _, _, err := p.RequestFinished(turn2, FinishStopped, [][]topology.BlockID{ids(31)}, 300); err != nil && !tc.abort {
				t.Fatal(err)
			}
			if len(p.recving) != 0 || len(p.recvKeys) != 0 {
				t.Errorf("after the finish: recving %v, recvKeys %v; want none", p.recving, p.recvKeys)
			}
		})
	}
}
