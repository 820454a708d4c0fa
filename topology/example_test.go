package topology_test

import (
	"fmt"

	"github.com/kvxfer/kvxfer/topology"
)

// A P engine with TP 2 sends to a D engine with TP 1: 8 KV heads, HND,
// head size 128, bf16, block 16. P rank 1 holds heads 4-7; they land in
// the second half of D's block.
func ExampleNewPlan() {
	rank := func(tp, r int) *topology.Layout {
		l := &topology.Layout{TPRank: r, TPSize: tp, PPSize: 1, TotalKVHeads: 8, HeadSize: 128, ElemBytes: 2,
			KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16}
		l.Regions = []topology.Region{{Kind: topology.KindFullAttention, Base: 0x1000_0000,
			BlockLen: int64(2 * 8 / tp * 16 * 128 * 2), NumBlocks: 1024}}
		return l
	}
	src, dst := rank(2, 1), rank(1, 0)
	if err := topology.CheckCompatible(src, dst); err != nil {
		panic(err)
	}
	slices, _ := topology.AttentionSlices(nil, 8, 2, 1, 0)
	fmt.Printf("D rank 0 gets %+v\n", slices)
	plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
	if err != nil {
		panic(err)
	}
	for _, s := range plan.Groups[0].Regions[0].Segs {
		fmt.Printf("per block: P +%d -> D +%d, %d bytes\n", s.SrcOff, s.DstOff, s.Len)
	}
	// Output:
	// D rank 0 gets [{SrcRank:0 SrcHead:0 DstHead:0 Heads:4} {SrcRank:1 SrcHead:0 DstHead:4 Heads:4}]
	// per block: P +0 -> D +32768, 32768 bytes
}
