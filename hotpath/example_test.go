package hotpath_test

import (
	"fmt"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// P pushes a 3-block request into D (same TP, 8 KV heads, HND, head size
// 128, bf16, block 16, one layer). P's blocks 4, 5, 6 land in D's blocks
// 10, 11, 20: the first two are consecutive on both sides and coalesce
// into one descriptor, the third stands alone. The reference emits one
// descriptor per block.
func ExampleBuilder_AppendDescs() {
	layout := func(base uint64) *topology.Layout {
		return &topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 8, HeadSize: 128, ElemBytes: 2,
			KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
			Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: base,
				BlockLen: 2 * 8 * 16 * 128 * 2, NumBlocks: 64}}}
	}
	plan, err := topology.NewPlan(layout(0x1000_0000), layout(0x7000_0000), topology.PlanOptions{})
	if err != nil {
		panic(err)
	}
	req := &hotpath.Request{
		Src: []topology.Span{{IDs: []topology.BlockID{4, 5, 6}}},
		Dst: []topology.Span{{IDs: []topology.BlockID{10, 11, 20}}},
	}
	b, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
	if err != nil {
		panic(err)
	}
	descs, err := b.AppendDescs(nil, plan, req) // reuse the slice in steady state: descs[:0]
	if err != nil {
		panic(err)
	}
	for _, d := range descs {
		fmt.Printf("WRITE %#x -> %#x, %d bytes\n", d.Local, d.Remote, d.Len)
	}
	ref, _ := hotpath.AppendReference(nil, plan, req, hotpath.OpWrite)
	fmt.Println("reference:", len(ref), "descriptors")
	// Output:
	// WRITE 0x10040000 -> 0x700a0000, 131072 bytes
	// WRITE 0x10060000 -> 0x70140000, 65536 bytes
	// reference: 3 descriptors
}
