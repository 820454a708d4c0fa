package server_test

import (
	"context"
	"fmt"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	"github.com/kvxfer/kvxfer/topology"
)

// A hello whose max_message_bytes is below what kvxferd can keep its
// messages within (16 KiB, half of 32 KiB) is refused, naming the field and
// its value, and counted (bad_hello). On the old code it was taken: the
// daemon answered with a limit above the engine's and then sent messages
// the engine's client could not receive, which ended the stream and lost
// every outcome of the rank.
func TestHelloMaxMessageTooSmall(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		d := startDaemon(t, shmDir)
		model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}
		ranks, err := kvsim.Build(&model, &kvsim.Engine{ID: 1, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16,
			Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8})
		if err != nil {
			t.Fatal(err)
		}
		r := ranks[0][0]
		mp, err := shm.Create(shmDir, "small", uint64(len(r.Mem)))
		if err != nil {
			t.Fatal(err)
		}
		defer mp.Close()
		c, err := stream.Dial("unix://" + d.sock)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		connect := func(limit uint32) (*stream.RankStream, error) {
			return c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: r.Layout, CompatHash: "m", MaxMessageBytes: limit,
				Memory: []stream.Memory{{Path: filepath.Join(shmDir, "small"), Base: r.Base, Size: uint64(len(r.Mem))}}})
		}
		for _, limit := range []uint32{1, 1024, 32<<10 - 1} {
			bad := d.srv.Refusals()["bad_hello"]
			rs, err := connect(limit)
			if err == nil {
				_ = rs.Close(ctx)
			}
			if want := fmt.Sprintf("hello.max_message_bytes = %d", limit); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), want) {
				t.Errorf("Connect(max_message_bytes %d) = %v, want InvalidArgument naming %q", limit, err, want)
			}
			if n := d.srv.Refusals()["bad_hello"]; n != bad+1 {
				t.Errorf("max_message_bytes %d: bad_hello refusals %d, want %d", limit, n, bad+1)
			}
		}
		// The least it takes.
		rs, err := connect(32 << 10)
		if err != nil {
			t.Fatal(err)
		}
		if err := rs.Close(ctx); err != nil {
			t.Error(err)
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}
