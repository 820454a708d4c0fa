package server_test

import (
	"context"
	"net"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/topology"
)

// slowCloseBackend is a backend whose Close takes a while (a transfer
// waited for, a NIXL agent torn down), noting when it returned.
type slowCloseBackend struct {
	server.Backend
	delay  time.Duration
	closed *atomic.Int64 // UnixNano when Close returned
}

func (b slowCloseBackend) Close() error {
	time.Sleep(b.delay)
	err := b.Backend.Close()
	b.closed.Store(time.Now().UnixNano())
	return err
}

// Shutting down past the drain (an engine's stream still attached when
// -drain-timeout ran out) force-stops gRPC, which does not wait for the
// streams' handlers: Close must, since until a rank detached its Worker
// and backend may still touch the memory the engine named (libkvxfer's
// kvxfer_stop promises none is touched after it returns, and the engine
// then frees it). Before, Close returned while the rank's backend was
// still closing.
func TestCloseWaitsForRanks(t *testing.T) {
	var closed atomic.Int64
	shmDir := t.TempDir()
	pl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer pl.Close()
	sock := filepath.Join(t.TempDir(), "kvxferd.sock")
	unix, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv, err := server.New(server.Config{PeerAddr: pl.Addr().String(), ShmDir: shmDir, Logger: quiet,
		NewBackend: func(string, *topology.Layout, bool) (server.Backend, error) {
			b, err := tcp.New(tcp.Config{Logger: quiet, Conns: 1, DisableLocal: true})
			if err != nil {
				return nil, err
			}
			return slowCloseBackend{Backend: b, delay: 500 * time.Millisecond, closed: &closed}, nil
		}})
	if err != nil {
		t.Fatal(err)
	}
	g := grpc.NewServer(grpc.Creds(server.EngineCredentials()))
	srv.RegisterEngine(g)
	go func() { _ = g.Serve(unix) }()
	d := &daemon{srv: srv, g: g, sock: sock, peerAddr: pl.Addr().String()}
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}
	e := kvsim.Engine{ID: 1, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 16}
	attach(t, d, shmDir, "E", &model, e, kvxfer.ModePush)

	// kvxferd's shutdown past its drain: Drain gives up, gRPC is stopped
	// by force, the server closed.
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if err := srv.Drain(ctx); err == nil {
		t.Fatal("Drain ended with a rank attached: this test needs one still attached")
	}
	g.Stop()
	done := make(chan struct{})
	go func() { _ = srv.Close(); close(done) }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Close did not return in 20 s")
	}
	returned := time.Now().UnixNano()
	if c := closed.Load(); c == 0 || c > returned {
		t.Fatalf("Close returned before the rank's backend had closed (closed at %d, Close returned at %d)", c, returned)
	}
}
