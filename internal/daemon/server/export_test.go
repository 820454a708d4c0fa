package server

import (
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// PublishForTest publishes a rank without a worker (handshake benchmarks).
func (s *Server) PublishForTest(info kvxfer.RankInfo) { _ = s.publish(info, nil, nil) }

// HandshakePayloadForTest is handshakePayload for external tests.
var HandshakePayloadForTest = handshakePayload

// SplitFinishedForTest is splitFinished for external tests.
var SplitFinishedForTest = splitFinished

// ClipForTest is clip for external tests.
var ClipForTest = clip

// FinishedBoundForTest is finishedBound for external tests.
var FinishedBoundForTest = finishedBound

// DroppedStepForTest is droppedStep for external tests.
var DroppedStepForTest = droppedStep

// DroppedErrsForTest is the error a rank of worker w sends for step,
// dropped with msg, whose step_ref finishes send.
func DroppedErrsForTest(w *kvxfer.Worker, step uint64, msg string, send []string) []*pb.StepError {
	r := &rank{worker: w, maxErr: 1 << 12}
	return r.droppedErrs(step, msg, &pb.StepRef{Step: step, SendRequestIds: send}, nil)
}

// SetSchedulerPIDForTest sets the pid that opened engine's scheduler, as
// if another process had.
func (s *Server) SetSchedulerPIDForTest(engine string, pid int32) {
	if ls, _ := s.sched.m.Load(engine); ls != nil {
		ls.pid = pid
	}
}

// SetCloseWaitForTest sets closeWait until the test ends.
func SetCloseWaitForTest(t interface{ Cleanup(func()) }, d time.Duration) {
	old := closeWait
	closeWait = d
	t.Cleanup(func() { closeWait = old })
}

// PublishedForTest returns the metadata engine's scheduler published as
// step (nil: none kept).
func (s *Server) PublishedForTest(engine string, step uint64) *pb.StepMeta {
	ls, _ := s.sched.m.Load(engine)
	if ls == nil {
		return nil
	}
	ls.pub.Lock()
	defer ls.pub.Unlock()
	return ls.pub.metas[step]
}

// PublishedStepsForTest returns the steps engine's scheduler keeps
// published.
func (s *Server) PublishedStepsForTest(engine string) []*pb.StepMeta {
	ls, _ := s.sched.m.Load(engine)
	if ls == nil {
		return nil
	}
	ls.pub.Lock()
	defer ls.pub.Unlock()
	var out []*pb.StepMeta
	for _, m := range ls.pub.metas {
		out = append(out, m)
	}
	return out
}

// SetMaxPublishedBytesForTest sets maxPublishedBytes until the test ends.
func SetMaxPublishedBytesForTest(t interface{ Cleanup(func()) }, n int) {
	old := maxPublishedBytes
	maxPublishedBytes = n
	t.Cleanup(func() { maxPublishedBytes = old })
}

// SpreadGenerationForTest is spreadGeneration for external tests.
func SpreadGenerationForTest(gens []uint64) uint64 {
	return spreadGeneration(len(gens), func(i int) uint64 { return gens[i] })
}
