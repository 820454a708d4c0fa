package kvsim

import "github.com/kvxfer/kvxfer/topology"

// Shorthands for the tests that build simulated models and engines (the
// hot path's tests and the fuzz targets of fuzz/).

// SmallEngine is an engine of 24 blocks per region with PP 1.
func SmallEngine(id, tp, logical, kernel int, layout topology.KVLayout, packing topology.KVPacking) Engine {
	return Engine{ID: id, TP: tp, PP: 1, LogicalBlock: logical, KernelBlock: kernel, Layout: layout, Packing: packing, Blocks: 24}
}

// SmallModel is a model with the given layers and KV heads (head size 4,
// 2-byte elements, a 40-token sliding window, small MLA and Mamba state).
func SmallModel(heads int, layers ...topology.Kind) Model {
	return Model{Kinds: layers, Window: 40, TotalKVHeads: heads, HeadSize: 4, ElemBytes: 2,
		MLABytesPerToken: 12, MambaConv: []int64{48, 16, 16}, MambaSSM: 64, MambaPad: 8}
}
