package server

import (
	"fmt"
	"slices"
	"testing"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// stepRefs remembers what each dropped step named, within maxNamedIDs:
// a repeat names only what was not named; a step whose ids did not fit
// names none on repeat; forgetting a step gives its room back.
func TestStepRefsNamedBound(t *testing.T) {
	var s stepRefs
	s.note(1, false)
	s.named(&pb.StepRef{Step: 1, RecvRequestIds: []string{"a"}, SendRequestIds: []string{"b"}}, &pb.StepMeta{Recv: []*pb.RecvRequest{{RequestId: "c"}}})
	got, whole := s.unnamed(&pb.StepRef{Step: 1, RecvRequestIds: []string{"a", "b", "c", "d"}, SendRequestIds: []string{"a", "b"}})
	if !whole || !slices.Equal(got.RecvRequestIds, []string{"b", "d"}) || !slices.Equal(got.SendRequestIds, []string{"a"}) {
		t.Errorf("repeat of step 1 names %q %q (whole %v), want recv b d, send a", got.RecvRequestIds, got.SendRequestIds, whole)
	}
	if got, _ := s.unnamed(&pb.StepRef{Step: 1, RecvRequestIds: []string{"d"}}); len(got.RecvRequestIds) != 0 {
		t.Errorf("second repeat names %q, want none (d named by the first)", got.RecvRequestIds)
	}
	big := make([]string, maxNamedIDs)
	for i := range big {
		big[i] = fmt.Sprint("r-", i)
	}
	s.note(2, false)
	s.named(&pb.StepRef{Step: 2, RecvRequestIds: big}, nil)
	if s.nids > maxNamedIDs {
		t.Errorf("%d ids remembered, want at most %d", s.nids, maxNamedIDs)
	}
	if got, whole := s.unnamed(&pb.StepRef{Step: 2, RecvRequestIds: []string{"r-1", "new"}}); whole || len(got.RecvRequestIds) != 0 {
		t.Errorf("repeat of step 2 (its ids did not fit) names %q (whole %v), want none, not whole", got.RecvRequestIds, whole)
	}
	n := s.nids
	s.forget(1)
	if s.nids >= n || s.nids < 0 {
		t.Errorf("after forgetting step 1: %d ids, want fewer than %d", s.nids, n)
	}
}

// Once stepRefs forgot its oldest steps, a step_ref for one of them (or
// for any step as old, unseen) is one it may have handled: forgotten.
func TestStepRefsForgotten(t *testing.T) {
	var s stepRefs
	if s.forgotten(0) || s.forgotten(1) {
		t.Error("forgotten before any step was forgotten")
	}
	for step := uint64(1); step <= 2*maxPublished+1; step++ {
		s.note(step, true)
	}
	if len(s.seen) > 2*maxPublished {
		t.Errorf("%d steps remembered, want at most %d", len(s.seen), 2*maxPublished)
	}
	top := uint64(2*maxPublished + 1)
	for _, c := range []struct {
		step uint64
		want bool
	}{{1, true}, {top - maxPublished, true}, {top - maxPublished + 1, false}, {top, false}, {top + 1, false}} {
		if got := s.forgotten(c.step); got != c.want {
			t.Errorf("forgotten(%d) = %v, want %v (newest %d)", c.step, got, c.want, top)
		}
	}
}
