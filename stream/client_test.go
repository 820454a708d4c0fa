package stream_test

import (
	"context"
	"net"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// floodWorker answers a worker stream's hello with ready, then sends n
// Finished messages of one outcome each, and ends the stream at the bye.
type floodWorker struct {
	pb.UnimplementedWorkerServiceServer
	n int
}

func (f *floodWorker) Connect(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	if _, err := st.Recv(); err != nil {
		return err
	}
	if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Ready{Ready: &pb.Ready{}}}); err != nil {
		return err
	}
	for i := range f.n {
		o := &pb.Outcome{RequestId: "r-" + strconv.Itoa(i), Result: pb.Outcome_RESULT_DONE}
		if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Finished{Finished: &pb.Finished{Recving: []*pb.Outcome{o}}}}); err != nil {
			return err
		}
	}
	for {
		m, err := st.Recv()
		if err != nil || m.GetBye() != nil {
			return nil
		}
	}
}

// connectTo serves w (a stand-in daemon's WorkerService) on a unix socket
// for the test's life and connects one rank stream to it.
func connectTo(ctx context.Context, t *testing.T, w pb.WorkerServiceServer, opts ...grpc.ServerOption) *stream.RankStream {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "w.sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(opts...)
	pb.RegisterWorkerServiceServer(g, w)
	go func() { _ = g.Serve(l) }()
	t.Cleanup(g.Stop)
	c, err := stream.Dial("unix://" + sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	rs, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: topology.Layout{TPSize: 1, PPSize: 1}})
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

// Close returns once its context ends, as its doc says, when the engine
// left more finished sets unread than the stream buffers: the stream's
// reader, blocked handing one more to Finished, ignored the end of the
// stream, and Close waited for it for ever (and its goroutine leaked).
func TestCloseReturnsWithFinishedUnread(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		rs := connectTo(ctx, t, &floodWorker{n: 200})
		// Nobody reads Finished; wait until the stream's buffer is full.
		tick := time.NewTicker(time.Millisecond)
		defer tick.Stop()
		for len(rs.Finished()) < cap(rs.Finished()) {
			select {
			case <-ctx.Done():
				t.Fatalf("%d finished sets buffered, want %d", len(rs.Finished()), cap(rs.Finished()))
			case <-tick.C:
			}
		}
		closeTimesOut(ctx, t, rs, "its reader waits to hand a finished set nobody reads")
		if err := rs.Err(); err == nil {
			t.Error("Err() = nil after finished sets were left undelivered, want why")
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// badOutcomeWorker answers hello with ready, then sends a finished set
// holding an outcome whose result this client does not know, and reports
// on ended when the stream ended (its Recv failed: the client hung up).
type badOutcomeWorker struct {
	pb.UnimplementedWorkerServiceServer
	ended chan error
}

func (b *badOutcomeWorker) Connect(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	if _, err := st.Recv(); err != nil {
		return err
	}
	if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Ready{Ready: &pb.Ready{}}}); err != nil {
		return err
	}
	o := &pb.Outcome{RequestId: "r-1", Result: 9}
	if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Finished{Finished: &pb.Finished{Recving: []*pb.Outcome{o}}}}); err != nil {
		return err
	}
	for {
		if _, err := st.Recv(); err != nil {
			b.ended <- err
			return nil
		}
	}
}

// A stream whose reader stops on a message it cannot read hangs up: the
// daemon ends the rank (failing and fencing what it holds) and the
// engine's next Step fails. The old reader only stopped: Finished closed,
// but the stream stayed open, the daemon went on taking the engine's steps
// (Step returned nil) and sending outcomes nobody would read.
func TestStreamHangsUpWhenItStopsReading(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		w := &badOutcomeWorker{ended: make(chan error, 1)}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		rs := connectTo(ctx, t, w)
		for range rs.Finished() {
		}
		if err := rs.Err(); err == nil || !strings.Contains(err.Error(), "finished.recving[0].result") {
			t.Errorf("Err() = %v, want it naming finished.recving[0].result", err)
		}
		select {
		case <-w.ended:
		case <-ctx.Done():
			t.Fatal("the stream stayed open after its reader stopped: the daemon would go on taking steps whose outcomes nobody reads")
		}
		if err := rs.Step(&kvxfer.StepMeta{Step: 1}); err == nil {
			t.Error("Step after the stream hung up = nil, want an error")
		}
		_ = rs.Close(ctx)
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}
