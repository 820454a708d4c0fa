package server_test

import (
	"context"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// slowRelease is the built-in backend whose first Deregister (the end of
// a Worker's Close, after its fence) waits for the test: the rank is still
// being let go meanwhile.
type slowRelease struct {
	*tcp.Backend
	entered chan struct{}
	release chan struct{}
	once    *sync.Once
}

func (b slowRelease) Deregister(r []kvxfer.MemRegion) error {
	first := false
	b.once.Do(func() { first = true })
	if first {
		close(b.entered)
		<-b.release
	}
	return b.Backend.Deregister(r)
}

// A rank whose stream broke (no bye) is let go by the daemon: its Worker's
// close fences what still moves the engine's bytes (up to CloseTimeout),
// then its memory goes. Until that ended, a hello for the same rank is
// refused (AlreadyExists): an engine takes a rank attached again as the
// daemon's word that nothing of the old one moves any more (the vLLM
// connector hands the old rank's blocks back to vLLM then). Before, the
// rank was unpublished first, and a new hello attached while the old
// Worker still fenced.
func TestRankAttachesAgainOnlyOnceLetGo(t *testing.T) {
	shmDir := t.TempDir()
	entered, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	defer func() {
		select {
		case <-release:
		default:
			close(release)
		}
	}()
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.NewBackend = func(string, *topology.Layout, bool) (server.Backend, error) {
			b, err := tcp.New(tcp.Config{Logger: quiet, Conns: 2, DisableLocal: true})
			if err != nil {
				return nil, err
			}
			return slowRelease{Backend: b, entered: entered, release: release, once: &once}, nil
		}
	})
	good := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	mp, err := shm.Create(shmDir, "ok", 1024)
	if err != nil {
		t.Fatal(err)
	}
	defer mp.Close()
	hello := &pb.WorkerHello{EngineId: "E", Mode: pb.Mode_MODE_PUSH, Layout: stream.LayoutToProto(&good), CompatHash: "m",
		Memory: []*pb.SharedMemory{{Path: filepath.Join(shmDir, "ok"), Base: 1 << 20, Size: 1024}}}
	cc, err := grpc.NewClient("unix://"+d.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	connect := func(ctx context.Context) (pb.WorkerService_ConnectClient, error) {
		st, err := pb.NewWorkerServiceClient(cc).Connect(ctx)
		if err != nil {
			return nil, err
		}
		if err := st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}}); err != nil {
			return nil, err
		}
		m, err := st.Recv()
		if err != nil {
			return nil, err
		}
		if m.GetReady() == nil {
			t.Fatalf("hello answered with %T", m.Msg)
		}
		return st, nil
	}
	ctx1, cancel1 := context.WithCancel(context.Background())
	if _, err := connect(ctx1); err != nil {
		t.Fatal(err)
	}
	cancel1() // the stream breaks: no bye
	select {
	case <-entered:
	case <-time.After(10 * time.Second):
		t.Fatal("the old rank's release never began")
	}
	// The old Worker is still being let go.
	ctx2, cancel2 := context.WithTimeout(context.Background(), 5*time.Second)
	st, err := connect(ctx2)
	if err == nil {
		_ = st.CloseSend()
		cancel2()
		t.Fatal("a hello for the rank attached while the daemon still let its old stream's Worker go")
	}
	cancel2()
	if status.Code(err) != codes.AlreadyExists {
		t.Errorf("hello while the old rank is let go: %v, want AlreadyExists", err)
	}
	close(release)
	// Let go: the rank attaches again.
	deadline := time.Now().Add(10 * time.Second)
	for {
		ctx3, cancel3 := context.WithTimeout(context.Background(), 5*time.Second)
		st, err := connect(ctx3)
		if err == nil {
			_ = st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Bye{Bye: &pb.Bye{}}})
			_ = st.CloseSend()
			for {
				if _, err := st.Recv(); err != nil {
					break
				}
			}
			cancel3()
			break
		}
		cancel3()
		if status.Code(err) != codes.AlreadyExists || time.Now().After(deadline) {
			t.Fatalf("hello once the old rank was let go: %v", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
