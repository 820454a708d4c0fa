package stream_test

import (
	"context"
	"errors"
	"net"
	"path/filepath"
	"runtime"
	"strconv"
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

// Close returns once its context ends, as its doc says, when the engine
// left more finished sets unread than the stream buffers: the stream's
// reader, blocked handing one more to Finished, ignored the end of the
// stream, and Close waited for it for ever (and its goroutine leaked).
func TestCloseReturnsWithFinishedUnread(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "w.sock")
		l, err := net.Listen("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		g := grpc.NewServer()
		pb.RegisterWorkerServiceServer(g, &floodWorker{n: 200})
		go func() { _ = g.Serve(l) }()
		t.Cleanup(g.Stop)
		c, err := stream.Dial("unix://" + sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Close() })
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		l1 := topology.Layout{TPSize: 1, PPSize: 1}
		rs, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: l1})
		if err != nil {
			t.Fatal(err)
		}
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
		closed := make(chan error, 1)
		go func() {
			cctx, ccancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer ccancel()
			closed <- rs.Close(cctx)
		}()
		select {
		case err := <-closed:
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Close = %v, want its context's deadline", err)
			}
		case <-ctx.Done():
			t.Fatal("Close did not return after its context ended (its reader waits to hand a finished set nobody reads)")
		}
		if err := rs.Err(); err == nil {
			t.Error("Err() = nil after finished sets were left undelivered, want why")
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}
