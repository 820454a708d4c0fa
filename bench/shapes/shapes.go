// Package shapes builds the realistic model shapes that kvxfer's
// descriptor benchmarks run on: a 70B-class model (80 layers, 8 KV heads,
// head size 128, bf16) at block 16 and at logical 128 / kernel 64, and an
// MLA model (61 layers, a 576-element bf16 latent = 1152 bytes per token,
// block 64, replicated), with prompts of 512, 2048 and 8192 tokens, and
// fresh (consecutive ids from a seeded random start) or fragmented
// (shuffled distinct ids, seeded) block ids. TP pairs: 4 -> 4, 8 -> 4 and
// 2 -> 8 for the 70B model; 1 -> 1 and the 1 -> 2 fan-out for MLA.
//
// Layouts are built directly: addresses are numbers, no memory is
// allocated for the KV cache; every region has room for 65536 tokens.
// Both sides are HND with K and V packed. For heterogeneous TP the pair
// is source rank 0 to destination rank 0 (every rank pair of a TP
// mismatch has the same geometry: one head slice per block). One request
// per shape, one cache group.
package shapes

import (
	"fmt"
	"math/rand/v2"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// Shape is one benchmark case: a plan between two ranks and a request.
type Shape struct {
	Name     string
	Src, Dst *topology.Layout
	Plan     *topology.Plan
	Req      *hotpath.Request
	// Tokens is the prompt length; Fragmented is set when the block ids
	// are shuffled rather than consecutive.
	Tokens     int
	Fragmented bool
	// Bytes is the number of bytes the request moves.
	Bytes int64
}

type model struct {
	name                     string
	layers                   int
	kind                     topology.Kind
	heads, headSize, elem    int
	mlaBytesPerToken         int
	logicalBlock, kernelBlck int
}

// poolTokens sizes every region for this many tokens, so fragmented ids
// have room to scatter.
const poolTokens = 1 << 16

func layout(m model, tp, rank int, base uint64) *topology.Layout {
	l := &topology.Layout{
		TPRank: rank, TPSize: tp, PPSize: 1,
		TotalKVHeads: m.heads, HeadSize: m.headSize, ElemBytes: m.elem,
		KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: m.logicalBlock, KernelBlockSize: m.kernelBlck,
	}
	blocks := poolTokens / m.kernelBlck
	var blockLen int64
	if m.kind == topology.KindMLA {
		blockLen = int64(m.kernelBlck * m.mlaBytesPerToken)
	} else {
		blockLen = 2 * int64(l.LocalHeads()*m.kernelBlck*m.headSize*m.elem)
	}
	addr := base
	for i := 0; i < m.layers; i++ {
		l.Regions = append(l.Regions, topology.Region{Kind: m.kind, Base: addr, BlockLen: blockLen, NumBlocks: blocks})
		addr += uint64(blockLen)*uint64(blocks) + 4096
	}
	return l
}

func ids(rng *rand.Rand, n, limit int, fragmented bool) []topology.BlockID {
	out := make([]topology.BlockID, n)
	if fragmented {
		perm := rng.Perm(limit)
		for i := range out {
			out[i] = topology.BlockID(perm[i])
		}
		return out
	}
	start := rng.IntN(limit - n)
	for i := range out {
		out[i] = topology.BlockID(start + i)
	}
	return out
}

// All returns every benchmark shape, in a fixed order, with seeded ids.
func All() ([]*Shape, error) {
	llama := func(name string, logical, kernel int) model {
		return model{name: name, layers: 80, kind: topology.KindFullAttention, heads: 8, headSize: 128, elem: 2,
			logicalBlock: logical, kernelBlck: kernel}
	}
	models := []struct {
		m   model
		tps [][2]int
	}{
		{llama("70b_bs16", 16, 16), [][2]int{{4, 4}, {8, 4}, {2, 8}}},
		{llama("70b_bs128k64", 128, 64), [][2]int{{4, 4}, {8, 4}, {2, 8}}},
		{model{name: "mla61_bs64", layers: 61, kind: topology.KindMLA, heads: 1, headSize: 576, elem: 2,
			mlaBytesPerToken: 1152, logicalBlock: 64, kernelBlck: 64}, [][2]int{{1, 1}, {1, 2}}},
	}
	var out []*Shape
	for _, md := range models {
		for _, tp := range md.tps {
			src := layout(md.m, tp[0], 0, 1<<44)
			dst := layout(md.m, tp[1], 0, 2<<44)
			plan, err := topology.NewPlan(src, dst, topology.PlanOptions{})
			if err != nil {
				return nil, fmt.Errorf("%s tp %d->%d: %w", md.m.name, tp[0], tp[1], err)
			}
			for _, tokens := range []int{512, 2048, 8192} {
				for _, frag := range []bool{false, true} {
					rng := rand.New(rand.NewPCG(uint64(tokens), uint64(tp[0]*16+tp[1])))
					n := (tokens + md.m.logicalBlock - 1) / md.m.logicalBlock
					limit := poolTokens / md.m.logicalBlock
					req := &hotpath.Request{Tokens: tokens,
						Src: []topology.Span{{IDs: ids(rng, n, limit, frag)}},
						Dst: []topology.Span{{IDs: ids(rng, n, limit, frag)}}}
					kind := "fresh"
					if frag {
						kind = "frag"
					}
					s := &Shape{
						Name: fmt.Sprintf("%s/tp%dto%d/%dtok/%s", md.m.name, tp[0], tp[1], tokens, kind),
						Src:  src, Dst: dst, Plan: plan, Req: req,
						Tokens: tokens, Fragmented: frag,
					}
					for _, g := range plan.Groups {
						for _, r := range g.Regions {
							s.Bytes += r.UnitBytes * int64(tokens/g.UnitTokens)
						}
					}
					out = append(out, s)
				}
			}
		}
	}
	return out, nil
}

// WriteBaseline is the memory-write limit the builder is measured against:
// it appends n descriptors with trivial arithmetic (addresses step by l) and
// no mapping logic, field by field (the fastest store pattern measured; a
// composite-literal store goes through the stack and is 1.7x slower). dst
// must have room for n more descriptors: growing it is the caller's job, as
// it is for the builder, whose benchmarks reuse one slice.
//
// The loop's speed depends on where it lands in the code: on the reference
// machine (AMD EPYC, Zen 3) the same eight instructions take 0.75 ns per
// descriptor when the loop spans two 32-byte fetch windows and 0.96 ns when
// it spans three. This form puts it in two (check with
// `go tool objdump -s WriteBaseline`); an earlier form that grew dst itself
// put it in three and made the baseline about 28% slower than the limit.
//
//go:noinline
func WriteBaseline(dst []hotpath.Desc, n int, l uint64) []hotpath.Desc {
	a, r := uint64(1)<<44, uint64(2)<<44
	start := len(dst)
	dst = dst[:start+n]
	out := dst[start:]
	for i := range out {
		o := &out[i]
		o.Local, o.Remote, o.Len, o.LocalDev, o.RemoteDev = a, r, l, 0, 0
		a += l
		r += l
	}
	return dst
}
