package kvxfer

import (
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// A layer-wise producer whose listing the workers took in (they hold it
// prefilling, with no lease: its finish or abort ends it) always ends on
// them, whatever its finish: one that stages no SendReq (preempted after
// its prefill step and then stopped by that step's output, as vLLM's
// asynchronous scheduling does, its blocks freed: no blocks; or a finish
// refused as bad input) is named in NotProcessed. Before, nothing was
// staged: each worker held it prefilling for ever (a slot of MaxRequests
// lost, its consumer waiting for its deadline).
func TestSchedulerListedProducerAlwaysEnds(t *testing.T) {
	blocks := func(b topology.BlockID) [][]topology.BlockID { return [][]topology.BlockID{ids(b)} }
	for _, tc := range []struct {
		name    string
		preempt bool
		blocks  [][]topology.BlockID
		tokens  int
	}{
		{"preempted then stopped without blocks", true, [][]topology.BlockID{nil}, 16},
		{"stopped without blocks", false, [][]topology.BlockID{nil}, 16},
		{"finish refused (computed)", false, blocks(1), -1},
		{"finish refused (groups)", true, nil, 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Layerwise = true })
			r := &Request{ID: "p-1", PromptTokens: 16, Params: &TransferParams{TransferID: "t1", DoRemoteDecode: true}}
			if err := s.Prefill(r, blocks(1), 0, 16); err != nil {
				t.Fatal(err)
			}
			if m := s.BuildMeta(); len(m.Prefill) != 1 {
				t.Fatalf("step: %+v, want p-1 listed", m)
			}
			if tc.preempt {
				if _, _, err := s.RequestFinished(r, FinishPreempted, nil, 0); err != nil {
					t.Fatal(err)
				}
				if m := s.BuildMeta(); len(m.Preempted) != 1 {
					t.Fatalf("step: %+v, want p-1 named preempted", m)
				}
			}
			delay, _, _ := s.RequestFinished(r, FinishStopped, tc.blocks, tc.tokens)
			m := s.BuildMeta()
			ended := len(m.Send) == 1 && m.Send[0].ReqID == "p-1" || len(m.NotProcessed) == 1 && m.NotProcessed[0] == "p-1"
			if !ended {
				t.Errorf("finish step: Send %+v, NotProcessed %v; want p-1 ended on the workers that hold it", m.Send, m.NotProcessed)
			}
			if len(m.NotProcessed) == 1 && m.NotProcessedTransferIDs["p-1"] != "t1" {
				t.Errorf("NotProcessedTransferIDs = %v, want p-1's t1", m.NotProcessedTransferIDs)
			}
			if delay && len(m.Send) != 1 {
				t.Errorf("blocks held (delay) with no SendReq staged")
			}
		})
	}
}

// An abandoned listing's abort must not end an earlier request under its
// id that still holds its blocks for its transfer: with no transfer id to
// tell them apart, the finish refused as a duplicate stages nothing.
func TestSchedulerListedProducerDuplicateSparesHolder(t *testing.T) {
	s, _ := newSched(t, ModePush, func(c *SchedulerConfig) { c.Layerwise = true })
	r := &Request{ID: "p-1", PromptTokens: 16, Params: &TransferParams{DoRemoteDecode: true}}
	b := [][]topology.BlockID{ids(1)}
	if delay, _, err := s.RequestFinished(r, FinishStopped, b, 16); err != nil || !delay {
		t.Fatalf("first finish: %v, %v", delay, err)
	}
	s.BuildMeta()
	if err := s.Prefill(r, b, 0, 16); err != nil {
		t.Fatal(err)
	}
	if m := s.BuildMeta(); len(m.Prefill) != 1 {
		t.Fatalf("step: %+v, want p-1 listed", m)
	}
	if _, _, err := s.RequestFinished(r, FinishStopped, b, 16); err == nil {
		t.Fatal("a finish under the id of a request holding its blocks: no error")
	}
	if m := s.BuildMeta(); len(m.NotProcessed)+len(m.Send) != 0 {
		t.Errorf("step: %+v, want nothing staged (an abort would end the holder)", m)
	}
}
