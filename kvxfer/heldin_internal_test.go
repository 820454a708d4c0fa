package kvxfer

import (
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// A message kept for later (compact) is told about the same requests as
// it was before: its digest stands for its blocks, group by group.
func TestHeldInSameCompacted(t *testing.T) {
	held := &sendReq{req: SendReq{Blocks: []topology.Span{{IDs: []topology.BlockID{3, 4, 5}}, {Start: 32, IDs: []topology.BlockID{9, 8}}}}}
	cases := []struct {
		name  string
		spans []topology.Span
		want  bool
	}{
		{"same", []topology.Span{{IDs: []topology.BlockID{3, 4, 5}}, {Start: 32, IDs: []topology.BlockID{9, 8}}}, true},
		{"one group named", []topology.Span{{IDs: []topology.BlockID{3, 4, 5}}}, true},
		{"other group only", []topology.Span{{}, {IDs: []topology.BlockID{9, 8}}}, true},
		{"none named", []topology.Span{{}, {}}, true},
		{"other blocks", []topology.Span{{IDs: []topology.BlockID{3, 4, 6}}}, false},
		{"other order", []topology.Span{{IDs: []topology.BlockID{3, 5, 4}}}, false},
		{"fewer", []topology.Span{{IDs: []topology.BlockID{3, 4}}}, false},
		{"ids moved between groups", []topology.Span{{IDs: []topology.BlockID{3, 4, 5, 9}}, {IDs: []topology.BlockID{8}}}, false},
		{"group it lacks", []topology.Span{{}, {}, {IDs: []topology.BlockID{1}}}, false},
	}
	for _, c := range cases {
		m := &msg{Spans: c.spans}
		if got := heldIn(m, held); got != c.want {
			t.Errorf("%s: heldIn = %v, want %v", c.name, got, c.want)
		}
		m.compact()
		if m.Spans != nil {
			t.Errorf("%s: compact kept the spans", c.name)
		}
		if got := heldIn(m, held); got != c.want {
			t.Errorf("%s: heldIn of the compacted message = %v, want %v", c.name, got, c.want)
		}
	}
}
