package server_test

import (
	"context"
	"errors"
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
	closed, returned, err := closeAfterDrain(t, 500*time.Millisecond)
	if err != nil {
		t.Fatalf("Close: %v", err)
	}
	if closed == 0 || closed > returned {
		t.Fatalf("Close returned before the rank's backend had closed (closed at %d, Close returned at %d)", closed, returned)
	}
}

// A rank that has still not let go past Close's wait makes Close say so
// (kvxfer_stop then fails, naming it): the engine must not free the
// memory it named. Before, Close logged it and returned nil, and
// kvxfer_stop said all was let go.
func TestCloseSaysRanksStillClosing(t *testing.T) {
	server.SetCloseWaitForTest(t, 100*time.Millisecond)
	closed, returned, err := closeAfterDrain(t, time.Second)
	if !errors.Is(err, server.ErrRanksStillClosing) {
		t.Fatalf("Close = %v with a rank still closing past the wait, want ErrRanksStillClosing", err)
	}
	if closed != 0 && closed <= returned {
		t.Fatalf("the rank's backend closed (at %d) before Close returned (%d): this test needs it still closing", closed, returned)
	}
}

// closeAfterDrain attaches a rank whose backend takes delay to close,
// shuts the server down past its drain (gRPC stopped by force, as
// kvxferd does) and returns when the backend closed (UnixNano, 0: not
// yet), when Close returned, and Close's error.
func closeAfterDrain(t *testing.T, delay time.Duration) (closedAt, returnedAt int64, err error) {
	t.Helper()
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
			return slowCloseBackend{Backend: b, delay: delay, closed: &closed}, nil
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
	done := make(chan error, 1)
	go func() { done <- srv.Close() }()
	select {
	case err = <-done:
	case <-time.After(20 * time.Second):
		t.Fatal("Close did not return in 20 s")
	}
	returned := time.Now().UnixNano()
	c := closed.Load()
	t.Cleanup(func() {
		// The rank's backend finishes closing before the test's end.
		for deadline := time.Now().Add(10 * time.Second); closed.Load() == 0 && time.Now().Before(deadline); time.Sleep(10 * time.Millisecond) {
		}
	})
	return c, returned, err
}
