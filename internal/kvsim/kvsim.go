// Package kvsim builds simulated engines — layouts backed by real byte
// arenas — fills a prefill engine's KV with a pattern keyed by (region,
// token, head, K or V, byte), runs descriptor lists through a plain byte
// copier, and checks every byte of a decode engine's KV cache: the
// transferred ones against the pattern, every other one against its value
// before the transfer, and that no byte was written twice.
//
// Its address arithmetic is written independently of topology's, so a
// test that passes here checks the mapping, not a copy of it.
package kvsim

import (
	"fmt"

	"github.com/kvxfer/kvxfer/topology"
)

// Model is the rank-independent shape of a model's KV cache.
type Model struct {
	// Kinds gives each layer's kind; a sliding-window layer uses Window.
	Kinds  []topology.Kind
	Window int
	// Attention geometry.
	TotalKVHeads, HeadSize, ElemBytes int
	// MLABytesPerToken is the latent's bytes per token (MLA layers).
	MLABytesPerToken int
	// MambaConv and MambaSSM are the global (all-TP) byte sizes of the
	// conv parts and the SSM state of a Mamba page.
	MambaConv []int64
	MambaSSM  int64
	// MambaPad is extra per-rank bytes at the end of a Mamba page.
	MambaPad int64
}

// Engine is one engine's parallelism and cache configuration.
type Engine struct {
	TP, PP                    int
	LogicalBlock, KernelBlock int
	Layout                    topology.KVLayout
	Packing                   topology.KVPacking
	// Blocks is the number of logical blocks per region.
	Blocks int
	// ID distinguishes engines in the address space (1..255).
	ID int
}

// Rank is one simulated rank: a layout whose regions live in Mem.
type Rank struct {
	Layout topology.Layout
	Base   uint64
	Mem    []byte
	// Layer and KV give, for each region, its global layer and (for
	// SeparateKV) whether it holds K (0) or V (1).
	Layer, KV []int
	// writes counts how many times each byte was written by Copy.
	writes []uint8
}

// Build returns the ranks of an engine, indexed [pp][tp]. Layers are split
// evenly over PP stages (the last stage takes the remainder).
func Build(m *Model, e *Engine) ([][]*Rank, error) {
	if e.PP <= 0 || e.TP <= 0 || e.ID <= 0 || e.ID > 255 {
		return nil, fmt.Errorf("kvsim: engine TP %d PP %d ID %d", e.TP, e.PP, e.ID)
	}
	out := make([][]*Rank, e.PP)
	per := len(m.Kinds) / e.PP
	for pp := 0; pp < e.PP; pp++ {
		first, last := pp*per, (pp+1)*per
		if pp == e.PP-1 {
			last = len(m.Kinds)
		}
		for tp := 0; tp < e.TP; tp++ {
			r, err := buildRank(m, e, pp, tp, first, last)
			if err != nil {
				return nil, err
			}
			out[pp] = append(out[pp], r)
		}
	}
	return out, nil
}

func buildRank(m *Model, e *Engine, pp, tp, first, last int) (*Rank, error) {
	ppl := e.LogicalBlock / max(e.KernelBlock, 1)
	r := &Rank{Base: uint64(e.ID)<<44 | uint64(pp)<<36 | uint64(tp)<<28 | 1<<20}
	l := &r.Layout
	*l = topology.Layout{
		TPRank: tp, TPSize: e.TP, PPRank: pp, PPSize: e.PP,
		TotalKVHeads: m.TotalKVHeads, HeadSize: m.HeadSize, ElemBytes: m.ElemBytes,
		KVLayout: e.Layout, Packing: e.Packing,
		LogicalBlockSize: e.LogicalBlock, KernelBlockSize: e.KernelBlock,
	}
	// Region offset counts the regions of earlier layers.
	kvPer := 1
	if e.Packing == topology.SeparateKV {
		kvPer = 2
	}
	for layer := 0; layer < first; layer++ {
		if isAttn(m.Kinds[layer]) {
			l.RegionOffset += kvPer
		} else {
			l.RegionOffset++
		}
	}
	heads := m.TotalKVHeads / e.TP
	if e.TP >= m.TotalKVHeads {
		heads = 1
	}
	var off uint64
	groupOf := map[topology.Kind]int{}
	for layer := first; layer < last; layer++ {
		k := m.Kinds[layer]
		n := 1
		if isAttn(k) {
			n = kvPer
		}
		for kv := 0; kv < n; kv++ {
			reg := topology.Region{Kind: k, Base: r.Base + off}
			switch k {
			case topology.KindFullAttention, topology.KindSlidingWindow:
				reg.BlockLen = int64(2/kvPer) * int64(heads*e.KernelBlock*m.HeadSize*m.ElemBytes)
				reg.NumBlocks = e.Blocks * ppl
				if k == topology.KindSlidingWindow {
					reg.Window = m.Window
				}
			case topology.KindMLA:
				reg.BlockLen = int64(e.KernelBlock * m.MLABytesPerToken)
				reg.NumBlocks = e.Blocks * ppl
			case topology.KindMamba:
				var total int64
				for _, c := range m.MambaConv {
					reg.ConvBytes = append(reg.ConvBytes, c/int64(e.TP))
					total += c / int64(e.TP)
				}
				reg.SSMBytes = m.MambaSSM / int64(e.TP)
				reg.BlockLen = total + reg.SSMBytes + m.MambaPad
				reg.NumBlocks = e.Blocks
			}
			// Leave a guard gap between regions so a stray write past a
			// region's end lands in memory the checker watches.
			off += uint64(reg.BlockLen)*uint64(reg.NumBlocks) + 64
			gi, ok := groupOf[k]
			if !ok {
				gi = len(l.Groups)
				groupOf[k] = gi
				g := topology.Group{Kind: k}
				if k == topology.KindSlidingWindow {
					g.Window = m.Window
				}
				l.Groups = append(l.Groups, g)
			}
			l.Groups[gi].Regions = append(l.Groups[gi].Regions, len(l.Regions))
			l.Regions = append(l.Regions, reg)
			r.Layer = append(r.Layer, layer)
			r.KV = append(r.KV, kv)
		}
	}
	r.Mem = make([]byte, off)
	r.writes = make([]uint8, off)
	return r, nil
}

func isAttn(k topology.Kind) bool {
	return k == topology.KindFullAttention || k == topology.KindSlidingWindow
}

// Value is the pattern byte of byte j of the (token, head, kv) vector of
// a layer. MLA layers use head 0, kv 0; Mamba layers use token = the
// state's pair index, head = part, j = the byte's global index in the part.
func Value(layer, token, head, kv, j int) byte {
	return byteOf(vecSeed(layer, token, head, kv), j)
}

// vecSeed hashes a vector's key; byteOf derives its bytes from it, so a
// whole vector costs one hash.
func vecSeed(layer, token, head, kv int) uint64 {
	x := uint64(layer)*0x9E3779B97F4A7C15 ^ uint64(token)*0xBF58476D1CE4E5B9 ^
		uint64(head)*0x94D049BB133111EB ^ uint64(kv)*0xD6E8FEB86659FD93
	x ^= x >> 31
	x *= 0x7FB5D329728EA185
	x ^= x >> 27
	return x
}

func byteOf(seed uint64, j int) byte {
	x := seed ^ uint64(j)*0xA0761D6478BD642F
	x ^= x >> 29
	x *= 0xBF58476D1CE4E5B9
	return byte(x >> 56)
}

// Scramble fills a rank's memory with pseudo-random bytes from seed and
// resets its write counters.
func (r *Rank) Scramble(seed uint64) {
	x := seed | 1
	for i := range r.Mem {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		r.Mem[i] = byte(x)
		r.writes[i] = 0
	}
}

// Resolve returns the bytes at [addr, addr+n) of the rank's memory, or an
// error when the range is not inside it.
func (r *Rank) Resolve(addr, n uint64) ([]byte, []uint8, error) {
	if addr < r.Base || addr-r.Base > uint64(len(r.Mem)) || n > uint64(len(r.Mem))-(addr-r.Base) {
		return nil, nil, fmt.Errorf("kvsim: range [%#x, +%d) outside rank memory [%#x, +%d)", addr, n, r.Base, len(r.Mem))
	}
	o := addr - r.Base
	return r.Mem[o : o+n], r.writes[o : o+n], nil
}

// Writes returns how many times Copy wrote the byte at offset o of Mem.
func (r *Rank) Writes(o int) int { return int(r.writes[o]) }

// Copy copies n bytes from src at sa to dst at da, counting the writes.
func Copy(dst *Rank, da uint64, src *Rank, sa uint64, n uint64) error {
	s, _, err := src.Resolve(sa, n)
	if err != nil {
		return fmt.Errorf("source: %w", err)
	}
	d, w, err := dst.Resolve(da, n)
	if err != nil {
		return fmt.Errorf("destination: %w", err)
	}
	copy(d, s)
	for i := range w {
		if w[i] < 255 {
			w[i]++
		}
	}
	return nil
}

// Rebase moves the rank's address space so Base is base (a real address
// of Mem, for backends that use addresses as they are): every region base
// shifts by the same amount.
func (r *Rank) Rebase(base uint64) {
	for i := range r.Layout.Regions {
		r.Layout.Regions[i].Base = r.Layout.Regions[i].Base - r.Base + base
	}
	r.Base = base
}
