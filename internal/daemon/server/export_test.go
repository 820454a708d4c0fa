package server

import (
	"context"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"

	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
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

// crashedStream is a direct stream whose engine sends msgs and dies as
// the last is received: its context ends before Recv returns it, as a
// gRPC stream's does when the engine's connection closes right after a
// message reached the daemon.
type crashedStream struct {
	*DirectStream
	ctx    context.Context
	cancel context.CancelFunc
	msgs   []*pb.ConnectRequest
}

func (c *crashedStream) Context() context.Context { return c.ctx }

func (c *crashedStream) Recv() (*pb.ConnectRequest, error) {
	if len(c.msgs) == 0 {
		<-c.ctx.Done()
		return nil, status.FromContextError(c.ctx.Err()).Err()
	}
	m := c.msgs[0]
	c.msgs = c.msgs[1:]
	if len(c.msgs) == 0 {
		c.cancel()
	}
	return m, nil
}

// ServeCrashedForTest serves Connect to an engine in this process that
// sends msgs (a hello first) and dies as the last one is received, and
// returns once the stream ended.
func (s *Server) ServeCrashedForTest(msgs []*pb.ConnectRequest) error {
	dctx, dcancel := context.WithCancel(peer.NewContext(s.life, &peer.Peer{Addr: directAddr{}, AuthInfo: ownStreamAuth()}))
	defer dcancel()
	d := &DirectStream{ctx: dctx, cancel: dcancel, in: make(chan *pb.ConnectRequest), out: make(chan []byte, directOut),
		ended: make(chan struct{}), limits: s.limits, wakeTake: make(chan struct{}, 1), wakePut: make(chan struct{}, 1)}
	ctx, cancel := context.WithCancel(dctx)
	defer cancel()
	return s.Connect(&crashedStream{DirectStream: d, ctx: ctx, cancel: cancel, msgs: msgs})
}
