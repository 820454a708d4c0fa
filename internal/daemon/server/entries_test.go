package server_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	"github.com/kvxfer/kvxfer/topology"
)

// helloEntries is a hello of engine id whose one region lies in the first
// of n shared-memory files (entries), each mapped by the daemon: two file
// descriptors and a mapping each, for the rank's life.
func helloEntries(t *testing.T, shmDir, id string, n int) stream.Hello {
	t.Helper()
	var mem []stream.Memory
	for i := range n {
		name := fmt.Sprintf("%s-%d", id, i)
		f, err := shm.Create(shmDir, name, 1<<16)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = f.Close() })
		mem = append(mem, stream.Memory{Path: filepath.Join(shmDir, name), Base: uint64(i+1) << 24, Size: 1 << 16})
	}
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 24, BlockLen: 256, NumBlocks: 64}}}
	return stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: l, CompatHash: "m", Memory: mem}
}

// The memory entries ranks hold mapped are bounded, per uid and in all:
// a rank whose hello would pass a budget is refused (ResourceExhausted,
// naming hello.memory and the flag), counted, and the ranks within it
// carry on; a rank's entries count until its stream ends. Before, one
// engine's hello of thousands of entries took two descriptors each (5,000
// took 10,004) and could leave every engine of the daemon without any.
func TestMemoryEntriesBounded(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) { c.MaxMemoryEntries, c.MaxMemoryEntriesPerUID = 5, 3 })
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	connect := func(h stream.Hello) (*stream.RankStream, error) {
		rs, err := c.Connect(ctx, h)
		if err == nil {
			go func() {
				for range rs.Finished() {
				}
			}()
		}
		return rs, err
	}
	refused := func(what string, err error, flag, reason string, n uint64) {
		t.Helper()
		if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "hello.memory") || !strings.Contains(err.Error(), flag) {
			t.Fatalf("%s: %v, want ResourceExhausted naming hello.memory and %s", what, err, flag)
		}
		if got := d.srv.Refusals()[reason]; got != n {
			t.Fatalf("%s: refusals %q = %d, want %d", what, reason, got, n)
		}
	}

	// Four entries: past the uid's three.
	_, err = connect(helloEntries(t, shmDir, "A", 4))
	refused("4 entries", err, "-max-memory-entries-per-uid", "memory_entries_per_uid", 1)
	// Two fit; two more would not; the first rank carries on.
	a, err := connect(helloEntries(t, shmDir, "B", 2))
	if err != nil {
		t.Fatalf("2 entries: %v", err)
	}
	_, err = connect(helloEntries(t, shmDir, "C", 2))
	refused("2 more entries", err, "-max-memory-entries-per-uid", "memory_entries_per_uid", 2)
	if err := a.Step(&kvxfer.StepMeta{Step: 1, SchedulerClock: time.Now()}); err != nil {
		t.Fatalf("the admitted rank's step: %v", err)
	}
	// Its entries count until its stream ends.
	if err := a.Close(ctx); err != nil {
		t.Fatal(err)
	}
	var b *stream.RankStream
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if b, err = connect(helloEntries(t, shmDir, fmt.Sprintf("D%d", time.Now().UnixNano()), 3)); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("3 entries after the 2 were given back: %v", err)
		}
	}
	defer b.Close(ctx)

	// The daemon's own bound: another uid's entries count too. Without a
	// second uid here, a daemon of 5 with a uid allowance of 5 shows it.
	d2 := startDaemonWith(t, shmDir, func(c *server.Config) { c.MaxMemoryEntries, c.MaxMemoryEntriesPerUID = 5, 5 })
	c2, err := stream.Dial("unix://" + d2.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	rs, err := c2.Connect(ctx, helloEntries(t, shmDir, "E", 4))
	if err != nil {
		t.Fatalf("4 of 5: %v", err)
	}
	go func() {
		for range rs.Finished() {
		}
	}()
	defer rs.Close(ctx)
	_, err = c2.Connect(ctx, helloEntries(t, shmDir, "F", 2))
	if status.Code(err) != codes.ResourceExhausted || !strings.Contains(err.Error(), "-max-memory-entries)") {
		t.Fatalf("2 more of 5: %v, want ResourceExhausted naming -max-memory-entries", err)
	}
	if got := d2.srv.Refusals()["memory_entries"]; got != 1 {
		t.Fatalf("refusals memory_entries = %d, want 1", got)
	}
}
