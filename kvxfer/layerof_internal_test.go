package kvxfer

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// TestDefaultLayerOfSeparateKVHybrid: with K and V in regions of their own
// (SeparateKV), an MLA or Mamba layer still has one region. The default
// LayerOf halved every region index, so in [MLA, attention K, attention V]
// the attention layer's K region counted as layer 0 (the MLA layer's): a
// layer-wise producer told layer 0 was saved WRITEs layer 1's K before the
// engine computed it, and D gets stale K.
func TestDefaultLayerOfSeparateKVHybrid(t *testing.T) {
	attn := int64(2 * 16 * 4 * 2) // heads · tokens · head size · bytes, one of K or V
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2,
		KVLayout: topology.LayoutHND, Packing: topology.SeparateKV, LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []topology.Region{
			{Kind: topology.KindMLA, Base: 1 << 20, BlockLen: 16 * 8, NumBlocks: 8},
			{Kind: topology.KindFullAttention, Base: 2 << 20, BlockLen: attn, NumBlocks: 8},
			{Kind: topology.KindFullAttention, Base: 3 << 20, BlockLen: attn, NumBlocks: 8},
			{Kind: topology.KindMLA, Base: 4 << 20, BlockLen: 16 * 8, NumBlocks: 8},
		},
		Groups: []topology.Group{{Kind: topology.KindMLA, Regions: []int{0, 3}}, {Kind: topology.KindFullAttention, Regions: []int{1, 2}}},
	}
	c := WorkerConfig{EngineID: "P", Addr: "P:1", Mode: ModePush, Layout: l, Backend: panicBackend{}, Resolver: noResolver{},
		Lease: 30 * time.Second, Layerwise: true}
	if err := c.fill(); err != nil {
		t.Fatal(err)
	}
	want := []int{0, 1, 1, 2} // MLA layer 0; layer 1's K and V; MLA layer 2
	for r, w := range want {
		if got := c.LayerOf(r); got != w {
			t.Errorf("default LayerOf(%d) = %d, want %d (regions: MLA, K, V, MLA)", r, got, w)
		}
	}
	// Packed and uniform separate layouts keep their rule.
	l.Packing = topology.PackedKV
	for i := 1; i <= 2; i++ {
		l.Regions[i].BlockLen = 2 * attn
	}
	c = WorkerConfig{EngineID: "P", Addr: "P:1", Mode: ModePush, Layout: l, Backend: panicBackend{}, Resolver: noResolver{}, Lease: 30 * time.Second}
	if err := c.fill(); err != nil {
		t.Fatal(err)
	}
	for r := range 4 {
		if got := c.LayerOf(r); got != r {
			t.Errorf("packed: default LayerOf(%d) = %d, want %d", r, got, r)
		}
	}
}
