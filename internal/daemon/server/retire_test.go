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
