package server_test

import (
	"context"
	"path/filepath"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	"github.com/kvxfer/kvxfer/topology"
)

// Memory entries whose engine addresses overlap: a region lies in the
// second (larger) one, but starts inside the first too. The daemon must
// relocate it into the entry that holds it, not the first one that holds
// its start (where it would run past that entry's mapping).
func TestHelloOverlappingMemoryEntries(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemon(t, shmDir)
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	small, err := shm.Create(shmDir, "small", 4096)
	if err != nil {
		t.Fatal(err)
	}
	defer small.Close()
	big, err := shm.Create(shmDir, "big", 1<<16)
	if err != nil {
		t.Fatal(err)
	}
	defer big.Close()
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 64}}}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: l, CompatHash: "m", Memory: []stream.Memory{
		{Path: filepath.Join(shmDir, "small"), Base: 1 << 20, Size: 4096},
		{Path: filepath.Join(shmDir, "big"), Base: 1 << 20, Size: 1 << 16}}})
	if err != nil {
		t.Fatalf("hello with the region inside hello.memory[1]: %v", err)
	}
	go func() {
		for range rs.Finished() {
		}
	}()
	_ = rs.Close(ctx)
}
