package stream_test

import (
	"context"
	"errors"
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

// stuckWorker answers a worker stream's hello with ready, then reads
// nothing more until the stream ends: a daemon whose receiver is held up
// (it is, by design, while the engine leaves its outcomes unread).
type stuckWorker struct {
	pb.UnimplementedWorkerServiceServer
}

func (stuckWorker) Connect(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	if _, err := st.Recv(); err != nil {
		return err
	}
	if err := st.Send(&pb.ConnectResponse{Msg: &pb.ConnectResponse_Ready{Ready: &pb.Ready{}}}); err != nil {
		return err
	}
	<-st.Context().Done()
	return nil
}

// bigStep is a step of about 1 MiB of metadata: more than a stream's
// flow-control window.
func bigStep(n uint64) *kvxfer.StepMeta {
	m := &kvxfer.StepMeta{Step: n}
	ids := make([]topology.BlockID, 4096)
	for i := range 64 {
		m.Send = append(m.Send, kvxfer.SendReq{ReqID: "s-" + strconv.Itoa(i), Blocks: []topology.Span{{IDs: ids}}})
	}
	return m
}

// Close returns once its context ends, as its doc says, also when the
// stream's send side is full (the daemon reads no more of it): Close's bye
// waited in gRPC's flow control, or behind a Step waiting there, for ever,
// whatever its context said.
func TestCloseReturnsWhenSendBlocks(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		// A fixed window (no BDP growth): the daemon's side takes 64 KiB
		// unread, no more.
		rs := connectTo(ctx, t, stuckWorker{}, grpc.InitialWindowSize(1<<16), grpc.InitialConnWindowSize(1<<16))
		// Steps until one waits in flow control (the second or third).
		stepped := make(chan error, 1)
		go func() {
			for i := uint64(1); ; i++ {
				if err := rs.Step(bigStep(i)); err != nil {
					stepped <- err
					return
				}
			}
		}()
		// Let the steps fill the window (the loop above ends only when
		// the stream does).
		select {
		case err := <-stepped:
			t.Fatalf("Step = %v before the stream ended", err)
		case <-time.After(200 * time.Millisecond):
		}
		closeTimesOut(ctx, t, rs, "its bye waits to be sent on a stream nobody reads")
		select {
		case err := <-stepped:
			if err == nil {
				t.Error("Step on a closed stream = nil")
			}
		case <-ctx.Done():
			t.Fatal("Step still waiting to send after Close ended the stream")
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// Connect returns once its context ends also while it waits for the
// stream itself: a caller that waits for its daemon to come up
// (grpc.WaitForReady) was kept waiting for ever when it did not, whatever
// Connect's context said (the stream was opened under a context of its
// own).
func TestConnectHonorsContextWaitingForReady(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		sock := filepath.Join(t.TempDir(), "none.sock") // no daemon serves it
		c, err := stream.Dial("unix://"+sock, grpc.WithDefaultCallOptions(grpc.WaitForReady(true)))
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		got := make(chan error, 1)
		go func() {
			ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
			defer cancel()
			_, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: topology.Layout{TPSize: 1, PPSize: 1}})
			got <- err
		}()
		select {
		case err := <-got:
			if !errors.Is(err, context.DeadlineExceeded) {
				t.Errorf("Connect = %v, want its context's deadline", err)
			}
		case <-time.After(15 * time.Second):
			t.Fatal("Connect did not return after its context ended (it waits for a daemon that never comes)")
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// closeTimesOut closes rs under a 50 ms context while something of it is
// stuck (stuck says what): Close must return its context's error when
// that context ends, before ctx does.
func closeTimesOut(ctx context.Context, t *testing.T, rs *stream.RankStream, stuck string) {
	t.Helper()
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
		t.Fatalf("Close did not return after its context ended (%s)", stuck)
	}
}
