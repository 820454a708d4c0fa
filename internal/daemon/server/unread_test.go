package server_test

import (
	"context"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// An engine that stops reading its rank's stream and goes on sending
// steps is held by the stream's flow control: the daemon stops taking its
// steps once sending their outcomes waits for the engine, instead of
// taking every step and keeping every outcome for it. On the old code the
// rank took all 200 steps (40 MB) and went on making their 40,000 failed
// outcomes (1 KB ids each), kept for an engine that read nothing, and
// would have gone on for as long as the engine sent.
func TestUnreadStreamHoldsTheEngine(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runUnreadStream(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runUnreadStream(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemon(t, shmDir)
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	mp, err := shm.Create(shmDir, "kv", 1024)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mp.Close() })
	cc, err := grpc.NewClient("unix://"+d.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cc.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	st, err := pb.NewWorkerServiceClient(cc).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	hello := &pb.WorkerHello{EngineId: "E", Mode: pb.Mode_MODE_PUSH, Layout: stream.LayoutToProto(&l), CompatHash: "m",
		Memory: []*pb.SharedMemory{{Path: filepath.Join(shmDir, "kv"), Base: 1 << 20, Size: 1024}}}
	if err := st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}}); err != nil {
		t.Fatal(err)
	}
	if m, err := st.Recv(); err != nil || m.GetReady() == nil {
		t.Fatalf("after hello: %v, %v; want ready", m, err)
	}
	w := d.srv.Workers()["E"][0]
	// Each step: 200 receives from a producer nobody answers (each fails
	// on its handshake: an outcome, no step error), 1 KB ids: 200 KB. The
	// engine reads nothing from here on. 200 steps are 40 MB, more than
	// the stream's windows hold (16 MB at most each way).
	const steps, per = 200, 200
	pad := strings.Repeat("x", 1000)
	var sent atomic.Int64
	go func() {
		for s := range steps {
			rs := make([]*pb.RecvRequest, per)
			for i := range rs {
				rs[i] = &pb.RecvRequest{RequestId: pad + strconv.Itoa(s*per+i), Local: []*pb.Span{{BlockIds: []int32{int32(i % 4)}}},
					Remote: &pb.RemoteRef{EngineId: "P", Addr: "127.0.0.1:1", TpSize: 1}}
			}
			if err := st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: uint64(s + 1), Recv: rs}}}); err != nil {
				return // the stream ended (the test's end)
			}
			sent.Add(1)
		}
	}()
	// Wait until the engine's sends stop for a second, or all went.
	tick := time.NewTicker(50 * time.Millisecond)
	defer tick.Stop()
	last, still := int64(-1), 0
	for still < 20 && sent.Load() < steps {
		select {
		case <-ctx.Done():
			t.Fatal("the engine's sends neither ended nor stopped")
		case <-tick.C:
		}
		if n := sent.Load(); n == last {
			still++
		} else {
			last, still = n, 0
		}
	}
	outcomes := w.Metrics().Snapshot().Outcomes[kvxfer.RoleConsumer]
	var n uint64
	for _, v := range outcomes {
		n += v
	}
	if sent.Load() == steps {
		t.Errorf("the rank took all %d steps (%d outcomes made so far) from an engine that reads nothing, want its sends held", steps, n)
	}
	cancel() // the engine hangs up: its blocked send returns
}
