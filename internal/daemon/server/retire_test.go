package server

import (
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A scheduler retired (replaced or closed) while one of its Steps is in
// flight may still publish that step: the publish must not close the wake
// channel retire closed, and a rank waiting on the retired one is woken
// to look the engine's scheduler up again.
func TestRetiredSchedulerPublishes(t *testing.T) {
	s, err := kvxfer.NewScheduler(kvxfer.SchedulerConfig{EngineID: "E", Addr: "127.0.0.1:1", Mode: kvxfer.ModePush, LogicalBlockSize: 16})
	if err != nil {
		t.Fatal(err)
	}
	ls := &lockedScheduler{s: s}
	ls.pub.metas = map[uint64]*pb.StepMeta{}
	ls.pub.changed = make(chan struct{})
	woken := ls.pub.changed
	ls.retire()
	ls.retire() // twice: once
	select {
	case <-woken:
	default:
		t.Fatal("retire did not wake the ranks waiting on the scheduler")
	}
	ls.mu.Lock()
	err = ls.publish(1)
	ls.mu.Unlock()
	if err != nil || ls.pub.metas[1] == nil {
		t.Errorf("publish(1) after retire = %v, metas %v; want step 1 published", err, ls.pub.metas)
	}
}

// The steps of a scheduler replaced by its own engine process (prev) are
// kept only as long as one scheduler would have kept them: the new one's
// and the old ones' together within maxPublished (and the bytes' bound),
// oldest first; a predecessor left with none goes with those before it.
// A new scheduler numbering from below the old one's last lets the old
// steps go (a step_ref would be ambiguous).
func TestReplacedSchedulerStepsBounded(t *testing.T) {
	mk := func() *lockedScheduler {
		s, err := kvxfer.NewScheduler(kvxfer.SchedulerConfig{EngineID: "E", Addr: "127.0.0.1:1", Mode: kvxfer.ModePush, LogicalBlockSize: 16})
		if err != nil {
			t.Fatal(err)
		}
		ls := &lockedScheduler{s: s}
		ls.pub.metas = map[uint64]*pb.StepMeta{}
		ls.pub.changed = make(chan struct{})
		return ls
	}
	pub := func(ls *lockedScheduler, from, to uint64) {
		t.Helper()
		ls.mu.Lock()
		defer ls.mu.Unlock()
		for s := from; s <= to; s++ {
			if err := ls.publish(s); err != nil {
				t.Fatal(err)
			}
		}
	}
	a := mk()
	pub(a, 1, 10)
	b := mk()
	b.prev.Store(a)
	a.retire()
	pub(b, 11, 11)
	c := mk()
	c.prev.Store(b)
	b.retire()
	c.trimPrev()
	for _, s := range []uint64{1, 10, 11} {
		if c.fromPrev(s) == nil {
			t.Errorf("step %d of a predecessor not readable from the newest scheduler", s)
		}
	}
	pub(c, 12, 12+maxPublished-7) // 1029 in all: a's five oldest must go
	if c.fromPrev(5) != nil || c.fromPrev(6) == nil || c.fromPrev(11) == nil {
		t.Errorf("after %d more steps: step 5 kept %v, 6 kept %v, 11 kept %v; want 5 gone, 6 and 11 kept",
			maxPublished-6, c.fromPrev(5) != nil, c.fromPrev(6) != nil, c.fromPrev(11) != nil)
	}
	pub(c, 12+maxPublished-6, 12+maxPublished+10)
	if c.fromPrev(11) != nil || b.prev.Load() != nil || c.prev.Load() != nil {
		t.Errorf("after %d steps of the newest: its predecessors still kept (b.prev %v, c.prev %v)", maxPublished+11, b.prev.Load() != nil, c.prev.Load() != nil)
	}
	// Renumbered from below: the old steps go.
	d := mk()
	pub(d, 1, 1)
	e := mk()
	e.prev.Store(d)
	pub(e, 1, 1)
	if e.prev.Load() != nil {
		t.Error("a scheduler numbering from 1 again still reads its predecessor's steps")
	}
}
