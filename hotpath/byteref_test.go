package hotpath_test

// An independent, deliberately naive byte-level model of where every byte
// of P's KV cache must land in D's, and a property test that holds the
// plans (topology.NewPlan) and every way of building descriptors from them
// (Builder.AppendDescs, Builder.AppendLayouts, Builder.AppendIndices with
// AppendPrepared, AppendReference; WRITE and READ) to it over random
// configurations.
//
// The model shares no arithmetic with topology or internal/kvsim: it walks
// D's request blocks token by token, derives each byte's meaning (layer,
// K or V, global head, token, byte of the vector; for MLA the token's
// latent byte; for Mamba the part and its global byte) from D's layout,
// then finds the P rank, region, block and offset that hold that meaning
// under the documented rules (SPEC §3-§6, topology's docs): a D head is
// supplied by the first connected P rank holding it (TargetRanks order), a
// replicated MLA block by the first connected P rank, a Mamba part byte by
// the P rank whose contiguous shard holds its global index; attention and
// MLA lists are anchored at their token starts and bounded by the
// request's tokens (the unit holding the last token may move whole);
// Mamba lists pair by the reference's count rule.
//
// P's memory is filled with tags that encode (P stage, P rank, region,
// byte offset), D's starts as zero, and descriptors are applied as copies
// of tags, so a byte from the wrong rank, layer, block or offset is named
// exactly, and every D byte's write count is kept: a byte written twice
// is two descriptors overlapping on D.
//
// The model also says which tokens D takes as loaded once the transfer
// ends (its list up to the request's tokens; of a sliding-window list the
// next token's window), and CheckCovered, the check both modes make
// before building, must pass exactly when every one of them lands: no
// block reported loaded that kept what it held, no good request refused.

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// brModel is the rank-independent shape of a model's KV cache.
type brModel struct {
	heads, headSize, elem int
	kinds                 []topology.Kind // per layer of one P stage (repeated per stage)
	window                int
	mlaPerTok             int
	conv                  []int64 // global (all-TP) bytes of each conv part
	ssm                   int64   // global bytes of the SSM state
	pad                   int64   // per-rank bytes after a Mamba page's state
	splitFA               bool    // full-attention layers in two groups
	stageLen              int     // layers per P stage (groups split alike on both sides)
	// pooled: HMA memory pooling, attention-only models: a full-attention
	// and a sliding-window group both list every region (each addresses
	// its own blocks of them: ids of group g are g·blocks/2 + 0..blocks/2).
	pooled bool
}

// brEngine is one engine's parallelism and cache configuration.
type brEngine struct {
	id, tp, pp      int
	logical, kernel int
	kvl             topology.KVLayout
	pack            topology.KVPacking
	blocks          int // logical blocks per region
	placement       int // 0 gaps, 1 back to back, 2 equal stride, 3 shuffled order
	devs            bool
	layers          int // total layers (all stages)
	layersPerStage  int
}

// brRank is one simulated rank: its layout, and per region a tag per byte
// and a write count per byte.
type brRank struct {
	lay    topology.Layout
	layer  []int // global layer of each region
	kv     []int // 0 K, 1 V (separate packing); 0 otherwise
	mem    [][]uint64
	writes [][]uint8
}

func brTag(pp, tp, region int, off int64) uint64 {
	return 1 + (uint64(pp)<<58 | uint64(tp)<<48 | uint64(region)<<36 | uint64(off))
}

func brDecode(tag uint64) string {
	if tag == 0 {
		return "untouched"
	}
	t := tag - 1
	return fmt.Sprintf("P pp%d tp%d region %d offset %d", t>>58, (t>>48)&0x3ff, (t>>36)&0xfff, t&(1<<36-1))
}

func brLocalHeads(heads, tp int) int {
	if tp >= heads {
		return 1
	}
	return heads / tp
}

// brHeldHeads returns the global heads rank r of tp holds, written out.
func brHeldHeads(heads, tp, r int) []int {
	if tp >= heads {
		// Replicated: tp/heads consecutive ranks share one head.
		return []int{r / (tp / heads)}
	}
	per := heads / tp
	out := make([]int, per)
	for i := range out {
		out[i] = r*per + i
	}
	return out
}

// brConnected returns the P ranks that D rank d exchanges with, in the
// order the spec lists them.
func brConnected(pTP, dTP, d int) []int {
	if pTP <= dTP {
		return []int{d / (dTP / pTP)}
	}
	a := pTP / dTP
	out := make([]int, a)
	for i := range out {
		out[i] = d*a + i
	}
	return out
}

// brCellOff is the byte offset of (local head h, token t, kv) in an
// attention block of the given geometry, written as the shape says:
// packed [H][N][2][D] / [N][H][2][D]; split [2][H][N][D] / [2][N][H][D];
// separate [H][N][D] / [N][H][D].
func brCellOff(kvl topology.KVLayout, pack topology.KVPacking, H, N int, vec int64, h, t, kv int) int64 {
	var hs, ts int64 // strides in vectors
	switch kvl {
	case topology.LayoutHND:
		hs, ts = int64(N), 1
	default:
		hs, ts = 1, int64(H)
	}
	switch pack {
	case topology.PackedKV:
		return ((int64(h)*hs+int64(t)*ts)*2 + int64(kv)) * vec
	case topology.SplitKV:
		return (int64(kv)*int64(H)*int64(N) + int64(h)*hs + int64(t)*ts) * vec
	}
	return (int64(h)*hs + int64(t)*ts) * vec
}

func brIsAttn(k topology.Kind) bool {
	return k == topology.KindFullAttention || k == topology.KindSlidingWindow
}

// brBuild builds every rank of an engine, [pp][tp]. Layer l of the model
// is stage l/perStage's; regions are per layer (two for separate packing);
// groups are per kind (full attention optionally split in two).
func brBuild(m *brModel, e *brEngine, rng *rand.Rand) [][]*brRank {
	out := make([][]*brRank, e.pp)
	per := len(m.kinds)
	e.layersPerStage = per
	kvPer := 1
	if e.pack == topology.SeparateKV {
		kvPer = 2
	}
	regionsOf := func(k topology.Kind) int {
		if brIsAttn(k) {
			return kvPer
		}
		return 1
	}
	stageRegions := 0
	for _, k := range m.kinds {
		stageRegions += regionsOf(k)
	}
	ppl := e.logical / e.kernel
	// One placement per stage, shared by its ranks (ranks differ in base).
	for pp := 0; pp < e.pp; pp++ {
		for tp := 0; tp < e.tp; tp++ {
			r := &brRank{}
			l := &r.lay
			*l = topology.Layout{TPRank: tp, TPSize: e.tp, PPRank: pp, PPSize: e.pp,
				TotalKVHeads: m.heads, HeadSize: m.headSize, ElemBytes: m.elem, KVLayout: e.kvl, Packing: e.pack,
				LogicalBlockSize: e.logical, KernelBlockSize: e.kernel, RegionOffset: pp * stageRegions}
			lh := brLocalHeads(m.heads, e.tp)
			type gkey struct {
				k   topology.Kind
				sub int
			}
			groupIdx := map[gkey]int{}
			faSeen := 0
			for li, k := range m.kinds {
				layer := pp*per + li
				for kv := 0; kv < regionsOf(k); kv++ {
					reg := topology.Region{Kind: k}
					switch k {
					case topology.KindFullAttention, topology.KindSlidingWindow:
						reg.BlockLen = int64(2/regionsOf(k)) * int64(lh*e.kernel*m.headSize*m.elem)
						reg.NumBlocks = e.blocks * ppl
						if k == topology.KindSlidingWindow {
							reg.Window = m.window
						}
					case topology.KindMLA:
						reg.BlockLen = int64(e.kernel * m.mlaPerTok)
						reg.NumBlocks = e.blocks * ppl
					case topology.KindMamba:
						var tot int64
						for _, c := range m.conv {
							reg.ConvBytes = append(reg.ConvBytes, c/int64(e.tp))
							tot += c / int64(e.tp)
						}
						reg.SSMBytes = m.ssm / int64(e.tp)
						reg.BlockLen = tot + reg.SSMBytes + m.pad
						reg.NumBlocks = e.blocks
					}
					sub := 0
					if k == topology.KindFullAttention && m.splitFA {
						sub = faSeen % 2
					}
					key := gkey{k, sub}
					gi, ok := groupIdx[key]
					if !ok {
						gi = len(l.Groups)
						groupIdx[key] = gi
						g := topology.Group{Kind: k}
						if k == topology.KindSlidingWindow {
							g.Window = m.window
						}
						l.Groups = append(l.Groups, g)
					}
					l.Groups[gi].Regions = append(l.Groups[gi].Regions, len(l.Regions))
					l.Regions = append(l.Regions, reg)
					r.layer = append(r.layer, layer)
					r.kv = append(r.kv, kv)
				}
				if k == topology.KindFullAttention {
					faSeen++
				}
				if m.stageLen > 0 && (li+1)%m.stageLen == 0 {
					faSeen = 0
				}
			}
			if m.pooled {
				all := make([]int, len(l.Regions))
				for i := range all {
					all[i] = i
				}
				l.Groups = []topology.Group{{Kind: topology.KindFullAttention, Regions: all},
					{Kind: topology.KindSlidingWindow, Window: m.window, Regions: slices.Clone(all)}}
			}
			brPlace(r, e, pp, tp, rng)
			out[pp] = append(out[pp], r)
		}
	}
	return out
}

// brPlace gives a rank's regions addresses and memory.
func brPlace(r *brRank, e *brEngine, pp, tp int, rng *rand.Rand) {
	l := &r.lay
	base := uint64(e.id)<<44 | uint64(pp)<<40 | uint64(tp)<<32 | 1<<20
	order := make([]int, len(l.Regions))
	for i := range order {
		order[i] = i
	}
	if e.placement == 3 {
		rng.Shuffle(len(order), func(i, j int) { order[i], order[j] = order[j], order[i] })
	}
	var stride uint64
	if e.placement == 2 {
		for i := range l.Regions {
			stride = max(stride, uint64(l.Regions[i].BlockLen)*uint64(l.Regions[i].NumBlocks))
		}
		stride += 64
	}
	off := uint64(0)
	for _, i := range order {
		reg := &l.Regions[i]
		size := uint64(reg.BlockLen) * uint64(reg.NumBlocks)
		reg.Base = base + off
		if e.devs {
			reg.DeviceID = int32(rng.IntN(2))
		}
		switch e.placement {
		case 0, 3:
			off += size + uint64(rng.IntN(3))*32
		case 1:
			off += size
		case 2:
			off += stride
		}
	}
	r.mem = make([][]uint64, len(l.Regions))
	r.writes = make([][]uint8, len(l.Regions))
	for i := range l.Regions {
		n := l.Regions[i].BlockLen * int64(l.Regions[i].NumBlocks)
		r.mem[i] = make([]uint64, n)
		r.writes[i] = make([]uint8, n)
	}
}

// resolve returns the region of r holding [addr, addr+n) on device dev.
func (r *brRank) resolve(addr, n uint64, dev int32) (int, int64, error) {
	for i := range r.lay.Regions {
		reg := &r.lay.Regions[i]
		end := reg.Base + uint64(reg.BlockLen)*uint64(reg.NumBlocks)
		if addr >= reg.Base && addr < end {
			if n > end-addr {
				return 0, 0, fmt.Errorf("[%#x, +%d) runs past the end of region %d [%#x, %#x)", addr, n, i, reg.Base, end)
			}
			if reg.DeviceID != dev {
				return 0, 0, fmt.Errorf("[%#x, +%d) in region %d on device %d, descriptor says %d", addr, n, i, reg.DeviceID, dev)
			}
			return i, int64(addr - reg.Base), nil
		}
	}
	return 0, 0, fmt.Errorf("[%#x, +%d) is in no region", addr, n)
}

// brCase is one random configuration and request.
type brCase struct {
	m        brModel
	p, d     brEngine
	tokens   int
	src, dst []topology.Span // per group
	maxRun   int64
	maxSegs  int
	desc     string
	spanFn   func(g topology.Group, e *brEngine, start, want, gi int) topology.Span
}

// brExpect is what one D byte must hold.
type brExpect struct {
	tag  uint64
	may  bool // the tail unit past the request's tokens: tag or untouched
	must bool
}

// expected computes, for D rank d, what every byte of every region must
// hold after the transfer (zero value: untouched).
func (c *brCase) expected(pr [][]*brRank, dr *brRank) [][]brExpect {
	d := dr.lay.TPRank
	m := &c.m
	out := make([][]brExpect, len(dr.lay.Regions))
	for i := range out {
		out[i] = make([]brExpect, len(dr.mem[i]))
	}
	conn := brConnected(c.p.tp, c.d.tp, d)
	pLH, dLH := brLocalHeads(m.heads, c.p.tp), brLocalHeads(m.heads, c.d.tp)
	vec := int64(m.headSize * m.elem)
	pPPL, dPPL := c.p.logical/c.p.kernel, c.d.logical/c.d.kernel
	unit := min(c.p.kernel, c.d.kernel)
	for g, grp := range dr.lay.Groups {
		ps, ds := c.src[g], c.dst[g]
		for _, j := range grp.Regions {
			dreg := &dr.lay.Regions[j]
			layer := dr.layer[j]
			stage := layer / c.p.layersPerStage
			// The P region of the same layer (and K or V).
			pRegion := -1
			p0 := pr[stage][0]
			for i := range p0.lay.Regions {
				if p0.layer[i] == layer && p0.kv[i] == dr.kv[j] {
					pRegion = i
				}
			}
			if pRegion < 0 {
				panic("no P region")
			}
			set := func(doff int64, pp, ptp int, poff int64, may bool) {
				e := &out[j][doff]
				if e.tag != 0 {
					panic(fmt.Sprintf("model maps D region %d offset %d twice", j, doff))
				}
				e.tag, e.may, e.must = brTag(pp, ptp, pRegion, poff), may, !may
			}
			if dreg.Kind == topology.KindMamba {
				np, nd := len(ps.IDs), len(ds.IDs)
				s0, n := 0, min(np, nd)
				if np == nd+1 {
					s0 = 1
				}
				for q := 0; q < n; q++ {
					dBlock, pBlock := int64(ds.IDs[q]), int64(ps.IDs[s0+q])
					parts := append(slices.Clone(m.conv), m.ssm)
					var dPart, pPart int64 // start of the part in a page
					for _, global := range parts {
						dSize, pSize := global/int64(c.d.tp), global/int64(c.p.tp)
						for jb := int64(0); jb < dSize; jb++ {
							gb := int64(d)*dSize + jb
							ptp := int(gb / pSize)
							if !slices.Contains(conn, ptp) {
								panic("mamba byte from an unconnected rank")
							}
							set(dBlock*dreg.BlockLen+dPart+jb, stage, ptp, pBlock*pr[stage][ptp].lay.Regions[pRegion].BlockLen+pPart+gb-int64(ptp)*pSize, false)
						}
						dPart += dSize
						pPart += pSize
					}
				}
				continue
			}
			pEnd := ps.Start + len(ps.IDs)*c.p.logical
			dEnd := ds.Start + len(ds.IDs)*c.d.logical
			lo, hi := max(ps.Start, ds.Start), min(pEnd, dEnd)
			mustHi, mayHi := hi, hi
			if c.tokens > 0 {
				mustHi = min(hi, c.tokens)
				mayHi = min(hi, (c.tokens+unit-1)/unit*unit)
			}
			for bi, id := range ds.IDs {
				for k := 0; k < dPPL; k++ {
					dkb := int64(id)*int64(dPPL) + int64(k)
					for t := 0; t < c.d.kernel; t++ {
						tok := ds.Start + (bi*dPPL+k)*c.d.kernel + t
						if tok < lo || tok >= mayHi {
							continue
						}
						may := tok >= mustHi
						rel := tok - ps.Start
						pid := int64(ps.IDs[rel/c.p.logical])
						inL := rel % c.p.logical
						pkb := pid*int64(pPPL) + int64(inL/c.p.kernel)
						pt := inL % c.p.kernel
						switch dreg.Kind {
						case topology.KindMLA:
							bpt := int64(m.mlaPerTok)
							src := conn[0]
							pBL := pr[stage][src].lay.Regions[pRegion].BlockLen
							for b := int64(0); b < bpt; b++ {
								set(dkb*dreg.BlockLen+int64(t)*bpt+b, stage, src, pkb*pBL+int64(pt)*bpt+b, may)
							}
						default:
							dHeads := brHeldHeads(m.heads, c.d.tp, d)
							kvs := []int{0, 1}
							if c.d.pack == topology.SeparateKV {
								kvs = []int{0}
							}
							for h, gh := range dHeads {
								src, ph := -1, -1
								for _, p := range conn {
									if at := slices.Index(brHeldHeads(m.heads, c.p.tp, p), gh); at >= 0 {
										src, ph = p, at
										break
									}
								}
								if src < 0 {
									panic("head with no source")
								}
								pBL := pr[stage][src].lay.Regions[pRegion].BlockLen
								for _, kv := range kvs {
									do := dkb*dreg.BlockLen + brCellOff(c.d.kvl, c.d.pack, dLH, c.d.kernel, vec, h, t, kv)
									po := pkb*pBL + brCellOff(c.p.kvl, c.p.pack, pLH, c.p.kernel, vec, ph, pt, kv)
									for b := int64(0); b < vec; b++ {
										set(do+b, stage, src, po+b, may)
									}
								}
							}
						}
					}
				}
			}
		}
	}
	return out
}

// brMethod is one way of building descriptors.
type brMethod int

const (
	brDescs brMethod = iota
	brLayouts
	brIndices
	brReference
	brMethods
)

func (m brMethod) String() string {
	return [...]string{"AppendDescs", "AppendLayouts", "AppendIndices", "AppendReference"}[m]
}

// brDescsFor returns the descriptors of one (P rank, D rank) pair in
// WRITE orientation (Local = source), built with method and op.
func brDescsFor(b *hotpath.Builder, method brMethod, op hotpath.Op, plan *topology.Plan, req *hotpath.Request) ([]hotpath.Desc, error) {
	var out []hotpath.Desc
	var err error
	switch method {
	case brDescs:
		out, err = b.AppendDescs(make([]hotpath.Desc, 1, 8), plan, req) // a prefix that must stay
		if err == nil {
			if out[0] != (hotpath.Desc{}) {
				return nil, fmt.Errorf("AppendDescs changed the slice's prefix")
			}
			out = out[1:]
		}
	case brLayouts:
		var lays hotpath.Layouts
		if err = b.AppendLayouts(&lays, plan, req); err == nil {
			out = lays.Expand(nil, lays.Spans)
		}
	case brIndices:
		var pairs []hotpath.IndexPair
		pairs, err = b.AppendIndices(nil, plan, req)
		if err == nil {
			src, e1 := hotpath.AppendPrepared(nil, plan, hotpath.SrcSide)
			dst, e2 := hotpath.AppendPrepared(nil, plan, hotpath.DstSide)
			if err = errors.Join(e1, e2); err != nil {
				return nil, err
			}
			local, remote := src, dst
			if op == hotpath.OpRead {
				local, remote = dst, src
			}
			for _, p := range pairs {
				if int(p.Local) >= len(local) || int(p.Remote) >= len(remote) || p.Local < 0 || p.Remote < 0 {
					return nil, fmt.Errorf("index pair %+v outside prepared lists of %d and %d", p, len(local), len(remote))
				}
				l, r := local[p.Local], remote[p.Remote]
				if l.Len != r.Len {
					return nil, fmt.Errorf("index pair %+v pairs entries of %d and %d bytes", p, l.Len, r.Len)
				}
				out = append(out, hotpath.Desc{Local: l.Addr, Remote: r.Addr, Len: l.Len, LocalDev: l.Dev, RemoteDev: r.Dev})
			}
		}
	case brReference:
		out, err = hotpath.AppendReference(nil, plan, req, op)
	}
	if err != nil {
		return nil, err
	}
	if op == hotpath.OpRead {
		for i := range out {
			d := &out[i]
			d.Local, d.Remote, d.LocalDev, d.RemoteDev = d.Remote, d.Local, d.RemoteDev, d.LocalDev
		}
	}
	return out, nil
}

// brIDs returns n distinct ids below limit: consecutive, shuffled, runs
// of 1..4 in shuffled order, or descending.
func brIDs(rng *rand.Rand, n, limit int) []topology.BlockID {
	if n > limit {
		panic("brIDs: n > limit")
	}
	ids := make([]topology.BlockID, 0, n)
	switch rng.IntN(4) {
	case 0:
		s := rng.IntN(limit - n + 1)
		for i := 0; i < n; i++ {
			ids = append(ids, topology.BlockID(s+i))
		}
	case 1:
		for _, v := range rng.Perm(limit)[:n] {
			ids = append(ids, topology.BlockID(v))
		}
	case 2:
		var chunks [][2]int
		for s := 0; s < limit; {
			l := min(1+rng.IntN(4), limit-s)
			chunks = append(chunks, [2]int{s, l})
			s += l
		}
		rng.Shuffle(len(chunks), func(i, j int) { chunks[i], chunks[j] = chunks[j], chunks[i] })
		for _, ch := range chunks {
			for i := 0; i < ch[1] && len(ids) < n; i++ {
				ids = append(ids, topology.BlockID(ch[0]+i))
			}
		}
	default:
		for i := 0; i < n; i++ {
			ids = append(ids, topology.BlockID(limit-1-i))
		}
	}
	return ids
}

func brPick[T any](rng *rand.Rand, vs ...T) T { return vs[rng.IntN(len(vs))] }

// brRandomCase draws a valid configuration and request.
func brRandomCase(rng *rand.Rand) *brCase {
	hnd, nhd := topology.LayoutHND, topology.LayoutNHD
	fa, swa, mla, mmb := topology.KindFullAttention, topology.KindSlidingWindow, topology.KindMLA, topology.KindMamba
	c := &brCase{}
	m := &c.m
	m.heads = brPick(rng, 1, 2, 4, 8, 16)
	m.headSize, m.elem = brPick(rng, 1, 2, 3, 4), brPick(rng, 1, 2)
	m.kinds = brPick(rng,
		[]topology.Kind{fa}, []topology.Kind{fa, fa}, []topology.Kind{fa, fa, fa}, []topology.Kind{fa, swa},
		[]topology.Kind{swa, fa, swa}, []topology.Kind{mla}, []topology.Kind{mla, mla}, []topology.Kind{fa, mla},
		[]topology.Kind{fa, mmb}, []topology.Kind{mmb, fa, mmb}, []topology.Kind{swa, fa, mmb}, []topology.Kind{mla, mmb},
		[]topology.Kind{fa, swa, mla, mmb, fa})
	m.splitFA = rng.IntN(3) == 0
	attnOnly := true
	for _, k := range m.kinds {
		attnOnly = attnOnly && brIsAttn(k)
	}
	m.pooled = attnOnly && rng.IntN(3) == 0
	m.stageLen = len(m.kinds)
	m.window = brPick(rng, 1, 7, 24, 40, 100)
	m.mlaPerTok = brPick(rng, 1, 3, 12)
	m.conv = brPick(rng, []int64{8 * 8}, []int64{48 * 8, 16 * 8, 16 * 8}, []int64{16, 32}, []int64{})
	m.ssm = brPick(rng, int64(64*8), 8, 0)
	if len(m.conv) == 0 && m.ssm == 0 {
		m.ssm = 16
	}
	m.pad = brPick(rng, int64(0), 0, 8, 5)
	c.p = brEngine{id: 1, tp: brPick(rng, 1, 2, 4, 8), pp: brPick(rng, 1, 1, 1, 2)}
	c.d = brEngine{id: 2, tp: brPick(rng, 1, 2, 4, 8), pp: 1}
	// Mamba shards need global sizes divisible by both TPs (8 covers them).
	for i := range m.conv {
		if m.conv[i]%8 != 0 {
			m.conv[i] = (m.conv[i]/8 + 1) * 8
		}
	}
	if m.ssm%8 != 0 {
		m.ssm = (m.ssm/8 + 1) * 8
	}
	// Kernel blocks: a unit times an integer ratio on one side; logical
	// blocks: 1, 2 or 4 kernel blocks.
	u, mul := brPick(rng, 1, 2, 3, 4, 8, 16), brPick(rng, 1, 1, 2, 3, 4)
	c.p.kernel, c.d.kernel = u, u
	if rng.IntN(2) == 0 {
		c.p.kernel *= mul
	} else {
		c.d.kernel *= mul
	}
	c.p.logical = c.p.kernel * brPick(rng, 1, 1, 2, 4)
	c.d.logical = c.d.kernel * brPick(rng, 1, 1, 2, 4)
	c.p.kvl, c.d.kvl = brPick(rng, hnd, nhd), brPick(rng, hnd, nhd)
	c.p.pack = brPick(rng, topology.PackedKV, topology.SplitKV, topology.SeparateKV)
	c.d.pack = c.p.pack
	if c.p.pack != topology.SeparateKV && rng.IntN(3) == 0 {
		c.d.pack = brPick(rng, topology.PackedKV, topology.SplitKV)
	}
	if rng.IntN(2) == 0 {
		c.d.kvl = c.p.kvl
	}
	c.maxSegs = 1 << 14
	c.p.placement, c.d.placement = rng.IntN(4), rng.IntN(4)
	c.p.devs, c.d.devs = rng.IntN(4) == 0, rng.IntN(4) == 0
	// Keep memory small: blocks per region.
	c.d.blocks = 3 + rng.IntN(8)
	c.p.blocks = max(3, (c.d.blocks*c.d.logical+c.p.logical-1)/c.p.logical) + rng.IntN(3)
	// Tokens and the two sides' spans.
	capTok := min(c.p.blocks*c.p.logical, c.d.blocks*c.d.logical)
	switch rng.IntN(6) {
	case 0:
		c.tokens = capTok
	case 1:
		c.tokens = 0
	default:
		c.tokens = 1 + rng.IntN(capTok)
	}
	if m.pooled {
		// Each of the two groups addresses its own half of the blocks.
		c.d.blocks, c.p.blocks = 2*c.d.blocks, 2*c.p.blocks
	}
	span := func(g topology.Group, e *brEngine, start, want, gi int) topology.Span {
		limit, off := e.blocks, 0
		if m.pooled {
			limit = e.blocks / 2
			off = gi * limit
		}
		n := 0
		if want > start {
			n = (want - start + e.logical - 1) / e.logical
		}
		n = min(n, limit)
		sp := topology.Span{Start: start, IDs: brIDs(rng, n, limit)}
		for i := range sp.IDs {
			sp.IDs[i] += topology.BlockID(off)
		}
		if g.Kind == swa {
			var drop int
			sp.IDs, drop = topology.ClipWindow(sp.IDs, g.Window, e.logical)
			sp.Start += drop * e.logical
		}
		return sp
	}
	c.maxRun = brPick(rng, int64(0), 0, 0, 1, 7, 64, 1000)
	c.desc = fmt.Sprintf("model heads %d head %d·%dB kinds %v splitFA %v pooled %v window %d mla %d conv %v ssm %d pad %d; "+
		"P tp%d pp%d L%d K%d %v/%v blocks %d place %d devs %v; D tp%d L%d K%d %v/%v blocks %d place %d devs %v; tokens %d maxRun %d",
		m.heads, m.headSize, m.elem, m.kinds, m.splitFA, m.pooled, m.window, m.mlaPerTok, m.conv, m.ssm, m.pad,
		c.p.tp, c.p.pp, c.p.logical, c.p.kernel, c.p.kvl, c.p.pack, c.p.blocks, c.p.placement, c.p.devs,
		c.d.tp, c.d.logical, c.d.kernel, c.d.kvl, c.d.pack, c.d.blocks, c.d.placement, c.d.devs, c.tokens, c.maxRun)
	// D's layers are every P stage's.
	c.d.layers = len(m.kinds) * c.p.pp
	// Spans are drawn once the groups are known (brSpans).
	c.spanFn = span
	return c
}

// brSpans draws the request's spans per group of D's layout: P holds
// [pStart, tokens) (a start past zero as after P's own clipping), D holds
// [hit, tokens) after a prefix hit; Mamba lists of counts that differ by
// at most one. A source list sometimes names a block twice, side by side.
func (c *brCase) brSpans(rng *rand.Rand, groups []topology.Group) {
	want := c.tokens
	if want == 0 {
		want = min(c.p.blocks*c.p.logical, c.d.blocks*c.d.logical) - rng.IntN(c.d.logical)
		if c.m.pooled {
			want = min(c.p.blocks/2*c.p.logical, c.d.blocks/2*c.d.logical) - rng.IntN(c.d.logical)
		}
	}
	for gi, g := range groups {
		if g.Kind == topology.KindMamba {
			np := rng.IntN(4)
			nd := min(max(np+rng.IntN(3)-1, 0), 3)
			c.src = append(c.src, topology.Span{IDs: brIDs(rng, np, c.p.blocks)})
			c.dst = append(c.dst, topology.Span{IDs: brIDs(rng, nd, c.d.blocks)})
			continue
		}
		pStart := 0
		if rng.IntN(5) == 0 {
			pStart = rng.IntN(2) * c.p.logical
		}
		hit := 0
		switch rng.IntN(5) {
		case 1, 2:
			hit = min(1+rng.IntN(3), want/c.d.logical) * c.d.logical
		case 3:
			hit = (want + c.d.logical - 1) / c.d.logical * c.d.logical
		}
		src := c.spanFn(g, &c.p, pStart, want, gi)
		if n := len(src.IDs); n >= 2 && rng.IntN(6) == 0 {
			// A source block named twice (kvxfer refuses such lists
			// before they get here; the builder pairs by position all
			// the same): its KV lands in both destination blocks, and
			// the repeat next to it must not merge into a run.
			i := rng.IntN(n - 1)
			src.IDs[i+1] = src.IDs[i]
		}
		c.src = append(c.src, src)
		c.dst = append(c.dst, c.spanFn(g, &c.d, hit, want, gi))
	}
}

func TestByteReferenceProperty(t *testing.T) {
	n := 1500
	if s := os.Getenv("KVXFER_BYTEREF_N"); s != "" {
		fmt.Sscan(s, &n)
	}
	if testing.Short() {
		n = 200
	}
	start := time.Now()
	seed := uint64(time.Now().UnixNano())
	if s := brSeedEnv(); s != 0 {
		seed = s
	}
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x6b7678))
	for i := 0; i < n; i++ {
		c := brRandomCase(rng)
		runByteReference(t, rng, c, i)
		if t.Failed() {
			t.Fatalf("case %d (seed %d): %s", i, seed, c.desc)
		}
	}
	t.Logf("%d cases in %v: %d descriptors, %d bytes that must move, %d tail bytes that may", n, time.Since(start), brStats.descs, brStats.must, brStats.may)
}

var brStats struct{ descs, must, may int }

func runByteReference(t *testing.T, rng *rand.Rand, c *brCase, i int) {
	t.Helper()
	pr := brBuild(&c.m, &c.p, rng)
	// D holds every stage's layers: a model of all of them.
	dm := c.m
	dm.kinds = nil
	for s := 0; s < c.p.pp; s++ {
		dm.kinds = append(dm.kinds, c.m.kinds...)
	}
	dr := brBuild(&dm, &c.d, rng)[0]
	c.d.layersPerStage = len(c.m.kinds) // for expected(): stage of a layer is layer / P's per-stage count
	c.p.layersPerStage = len(c.m.kinds)
	c.brSpans(rng, dr[0].lay.GroupList())
	c.desc += fmt.Sprintf("; src %v dst %v", c.src, c.dst)
	// Fill P with tags.
	for pp, stage := range pr {
		for tp, r := range stage {
			for ri := range r.mem {
				for o := range r.mem[ri] {
					r.mem[ri][o] = brTag(pp, tp, ri, int64(o))
				}
			}
		}
	}
	want := make([][][]brExpect, len(dr))
	for d := range dr {
		want[d] = c.expected(pr, dr[d])
	}
	req := &hotpath.Request{Tokens: c.tokens, Src: c.src, Dst: c.dst}
	method := brMethod(i % int(brMethods))
	op := hotpath.OpWrite
	if rng.IntN(2) == 0 {
		op = hotpath.OpRead
	}
	maxRun := c.maxRun
	if method == brIndices || method == brReference {
		maxRun = 0
	}
	b, err := hotpath.NewBuilder(hotpath.Options{Op: op, MaxRunBytes: maxRun})
	if err != nil {
		t.Fatal(err)
	}
	// covered[d] is CheckCovered's verdict on each plan into D rank d that
	// moves bytes.
	covered := make([][]error, len(dr))
	// Every connected (P rank, D rank) pair, as push or pull would pair them.
	for pp := range pr {
		for d := range dr {
			for _, p := range brConnected(c.p.tp, c.d.tp, d) {
				plan, err := topology.NewPlan(&pr[pp][p].lay, &dr[d].lay, topology.PlanOptions{MaxSegments: c.maxSegs})
				if err != nil {
					t.Errorf("NewPlan(P pp%d tp%d, D tp%d): %v", pp, p, d, err)
					return
				}
				if !plan.NotifyOnly {
					covered[d] = append(covered[d], hotpath.CheckCovered(plan, req))
				}
				descs, err := brDescsFor(b, method, op, plan, req)
				if err != nil {
					t.Errorf("%v %v (P pp%d tp%d -> D tp%d): %v", method, op, pp, p, d, err)
					return
				}
				if plan.NotifyOnly && len(descs) > 0 {
					t.Errorf("plan P pp%d tp%d -> D tp%d is notify-only but gives %d descriptors", pp, p, d, len(descs))
				}
				brStats.descs += len(descs)
				for k, ds := range descs {
					if ds.Len == 0 {
						t.Errorf("%v: descriptor %d is empty", method, k)
						return
					}
					si, so, err := pr[pp][p].resolve(ds.Local, ds.Len, ds.LocalDev)
					if err != nil {
						t.Errorf("%v %v P pp%d tp%d -> D tp%d descriptor %d source: %v", method, op, pp, p, d, k, err)
						return
					}
					di, do, err := dr[d].resolve(ds.Remote, ds.Len, ds.RemoteDev)
					if err != nil {
						t.Errorf("%v %v P pp%d tp%d -> D tp%d descriptor %d destination: %v", method, op, pp, p, d, k, err)
						return
					}
					copy(dr[d].mem[di][do:do+int64(ds.Len)], pr[pp][p].mem[si][so:so+int64(ds.Len)])
					w := dr[d].writes[di][do : do+int64(ds.Len)]
					for x := range w {
						if w[x] < 255 {
							w[x]++
						}
					}
				}
			}
		}
	}
	// CheckCovered (the check both modes make before a transfer whose
	// receiver takes its blocks as filled) against the model: it passes
	// exactly when every token the receiver takes is one the model says
	// must land.
	for d := range dr {
		want := c.brTakenWritten(dr[d], want[d])
		for _, err := range covered[d] {
			if (err == nil) != (want == "") {
				t.Errorf("D tp%d: CheckCovered = %v; the model: %s", d, err, cmp.Or(want, "every token D takes lands"))
				break
			}
		}
	}
	// Compare every byte of every D rank.
	var errs []string
	for d := range dr {
		for ri := range dr[d].mem {
			for o, got := range dr[d].mem[ri] {
				e, w := want[d][ri][o], dr[d].writes[ri][o]
				if e.must {
					brStats.must++
				} else if e.may {
					brStats.may++
				}
				var bad string
				switch {
				case e.must && (got != e.tag || w != 1):
					bad = fmt.Sprintf("holds %s written %d times, want %s written once", brDecode(got), w, brDecode(e.tag))
				case e.may && (got != e.tag && got != 0 || w > 1):
					bad = fmt.Sprintf("(tail unit) holds %s written %d times, want %s or untouched, at most once", brDecode(got), w, brDecode(e.tag))
				case !e.must && !e.may && (got != 0 || w != 0):
					bad = fmt.Sprintf("holds %s written %d times, want untouched", brDecode(got), w)
				}
				if bad != "" {
					reg := &dr[d].lay.Regions[ri]
					errs = append(errs, fmt.Sprintf("D tp%d region %d (%v, layer %d kv %d) block %d byte %d: %s",
						d, ri, reg.Kind, dr[d].layer[ri], dr[d].kv[ri], int64(o)/reg.BlockLen, int64(o)%reg.BlockLen, bad))
					if len(errs) >= 10 {
						break
					}
				}
			}
		}
	}
	if len(errs) > 0 {
		t.Errorf("%v %v (maxRun %d):\n%s", method, op, maxRun, strings.Join(errs, "\n"))
	}
}

// brTakenWritten returns "" when every token D rank dr takes as loaded
// once the transfer ends is one the model says must land (want), else the
// first that would not. D takes the tokens of its attention and MLA lists
// from their start up to the request's tokens (or its list's end when
// tokens is 0); of a sliding-window list only the next token's window
// (the Window-1 tokens before position tokens), which is all the next
// token attends to. A token lands when its first byte (head 0, K) must.
// Mamba state pairs by count and is not taken this way.
func (c *brCase) brTakenWritten(dr *brRank, want [][]brExpect) string {
	vec := int64(c.m.headSize * c.m.elem)
	dPPL := c.d.logical / c.d.kernel
	for g, grp := range dr.lay.Groups {
		if grp.Kind == topology.KindMamba || len(grp.Regions) == 0 {
			continue
		}
		ds := c.dst[g]
		last := ds.Start + len(ds.IDs)*c.d.logical
		if c.tokens > 0 {
			last = min(last, c.tokens)
		}
		from := ds.Start
		if grp.Kind == topology.KindSlidingWindow {
			from = max(from, last-grp.Window+1)
		}
		j := grp.Regions[0]
		reg := &dr.lay.Regions[j]
		for tok := from; tok < last; tok++ {
			rel := tok - ds.Start
			id := int64(ds.IDs[rel/c.d.logical])
			in := rel % c.d.logical
			kb := id*int64(dPPL) + int64(in/c.d.kernel)
			t := in % c.d.kernel
			off := kb*reg.BlockLen + int64(t)*int64(c.m.mlaPerTok)
			if reg.Kind != topology.KindMLA {
				off = kb*reg.BlockLen + brCellOff(c.d.kvl, c.d.pack, brLocalHeads(c.m.heads, c.d.tp), c.d.kernel, vec, 0, t, 0)
			}
			if !want[j][off].must {
				return fmt.Sprintf("group %d (%v) token %d (of %d..%d) would not land", g, grp.Kind, tok, from, last)
			}
		}
	}
	return ""
}

// brSeedEnv returns KVXFER_BYTEREF_SEED, to replay a failing run.
func brSeedEnv() uint64 {
	var s uint64
	fmt.Sscan(os.Getenv("KVXFER_BYTEREF_SEED"), &s)
	return s
}

// TestByteReferenceRefusals corrupts one thing of a random valid
// configuration or request at a time and checks that it is refused with an
// error of the right kind naming the field, and that nothing is emitted:
// no plan, and every way of building descriptors leaves its output as it
// was.
func TestByteReferenceRefusals(t *testing.T) {
	// A fixed seed: the test asserts every refusal kind was tried, which a
	// random draw may miss (KVXFER_BYTEREF_SEED tries others).
	seed := uint64(2)
	if s := brSeedEnv(); s != 0 {
		seed = s
	}
	t.Logf("seed %d", seed)
	rng := rand.New(rand.NewPCG(seed, 0x726566))
	clone := func(l *topology.Layout) *topology.Layout {
		c := *l
		c.Regions = slices.Clone(l.Regions)
		for i := range c.Regions {
			c.Regions[i].ConvBytes = slices.Clone(l.Regions[i].ConvBytes)
		}
		c.Groups = slices.Clone(l.Groups)
		for i := range c.Groups {
			c.Groups[i].Regions = slices.Clone(l.Groups[i].Regions)
		}
		return &c
	}
	type layoutBad struct {
		name   string
		is     error
		want   string
		mutate func(p, d *topology.Layout) bool // false: not applicable
	}
	// dLo, dHi bound the D regions the P stage pairs with (its
	// RegionOffset on).
	var dLo, dHi int
	var curD *topology.Layout
	regionOf := func(l *topology.Layout, pred func(*topology.Region) bool) int {
		var idx []int
		for i := range l.Regions {
			if l == curD && (i < dLo || i >= dHi) {
				continue
			}
			if pred(&l.Regions[i]) {
				idx = append(idx, i)
			}
		}
		if len(idx) == 0 {
			return -1
		}
		return idx[rng.IntN(len(idx))]
	}
	attn := func(r *topology.Region) bool { return brIsAttn(r.Kind) }
	bads := []layoutBad{
		{"TotalKVHeads differ", topology.ErrIncompatible, "TotalKVHeads", func(p, d *topology.Layout) bool {
			if regionOf(d, attn) < 0 {
				return false
			}
			// Same local heads on D (so D is valid), another total.
			d.TotalKVHeads *= 2
			d.TPSize *= 2
			d.TPRank *= 2
			return d.TPSize <= 4096
		}},
		{"HeadSize differs", topology.ErrInvalidLayout, "BlockLen", func(p, d *topology.Layout) bool {
			d.HeadSize++
			return regionOf(d, attn) >= 0
		}},
		{"attention BlockLen off by one", topology.ErrInvalidLayout, "BlockLen", func(p, d *topology.Layout) bool {
			i := regionOf(p, attn)
			if i < 0 {
				return false
			}
			p.Regions[i].BlockLen++
			return true
		}},
		{"MLA bytes per token differ", topology.ErrIncompatible, "BlockLen per token (MLA)", func(p, d *topology.Layout) bool {
			i := regionOf(d, func(r *topology.Region) bool { return r.Kind == topology.KindMLA })
			if i < 0 {
				return false
			}
			d.Regions[i].BlockLen += int64(d.KernelBlockSize)
			return true
		}},
		{"Mamba conv shard differs", topology.ErrIncompatible, "ConvBytes[0]·TPSize", func(p, d *topology.Layout) bool {
			i := regionOf(d, func(r *topology.Region) bool { return r.Kind == topology.KindMamba && len(r.ConvBytes) > 0 })
			if i < 0 {
				return false
			}
			d.Regions[i].ConvBytes[0]++
			d.Regions[i].BlockLen++
			return true
		}},
		{"Mamba SSM shard differs", topology.ErrIncompatible, "SSMBytes·TPSize", func(p, d *topology.Layout) bool {
			i := regionOf(p, func(r *topology.Region) bool { return r.Kind == topology.KindMamba })
			if i < 0 {
				return false
			}
			p.Regions[i].SSMBytes++
			p.Regions[i].BlockLen++
			return true
		}},
		{"kernel blocks that do not divide", topology.ErrIncompatible, "one must divide the other", func(p, d *topology.Layout) bool {
			if regionOf(d, func(r *topology.Region) bool { return r.Kind != topology.KindMamba }) < 0 {
				return false
			}
			// D's kernel block 3/2 of P's (P's even), D's layout rebuilt.
			if p.KernelBlockSize%2 != 0 {
				return false
			}
			k := p.KernelBlockSize * 3 / 2
			for i := range d.Regions {
				r := &d.Regions[i]
				if r.Kind != topology.KindMamba {
					r.BlockLen = r.BlockLen / int64(d.KernelBlockSize) * int64(k)
				}
			}
			d.KernelBlockSize, d.LogicalBlockSize = k, k
			return true
		}},
		{"TP sizes that do not divide", topology.ErrIncompatible, "TP", func(p, d *topology.Layout) bool {
			if regionOf(d, attn) >= 0 || regionOf(d, func(r *topology.Region) bool { return r.Kind == topology.KindMamba }) >= 0 {
				return false // keep D valid: MLA only
			}
			if p.TPSize != 2 && p.TPSize != 4 {
				return false
			}
			d.TPSize, d.TPRank = 3, 0
			return true
		}},
		{"sliding window differs", topology.ErrIncompatible, "Window", func(p, d *topology.Layout) bool {
			found := false
			for g := range d.Groups {
				if d.Groups[g].Kind == topology.KindSlidingWindow {
					d.Groups[g].Window++
					found = true
				}
			}
			for i := range d.Regions {
				if d.Regions[i].Kind == topology.KindSlidingWindow {
					d.Regions[i].Window++
				}
			}
			return found
		}},
		{"group kind differs", topology.ErrIncompatible, "Kind", func(p, d *topology.Layout) bool {
			for g := range d.Groups {
				if d.Groups[g].Kind == topology.KindFullAttention {
					d.Groups[g].Kind = topology.KindMLA
					return true
				}
			}
			return false
		}},
		{"a region fewer on D", topology.ErrIncompatible, "", func(p, d *topology.Layout) bool {
			if p.PPSize > 1 || len(d.Regions) < 2 {
				return false
			}
			last := len(d.Regions) - 1
			d.Regions = d.Regions[:last]
			for g := range d.Groups {
				d.Groups[g].Regions = slices.DeleteFunc(d.Groups[g].Regions, func(r int) bool { return r == last })
				if len(d.Groups[g].Regions) == 0 {
					return false
				}
			}
			return true
		}},
		{"D is a pipeline stage", topology.ErrUnsupported, "dst PPSize = 2", func(p, d *topology.Layout) bool {
			d.PPSize = 2
			return true
		}},
		{"ranks not connected", topology.ErrIncompatible, "not connected", func(p, d *topology.Layout) bool {
			if d.TPSize == 1 || p.TPSize == 1 && d.TPSize == 1 {
				return false
			}
			d.TPRank = (d.TPRank + 1) % d.TPSize
			// Still connected when P's rank feeds both (P TP < D TP).
			return !slices.Contains(brConnected(p.TPSize, d.TPSize, d.TPRank), p.TPRank)
		}},
	}
	tried := map[string]int{}
	for i := 0; i < 600; i++ {
		c := brRandomCase(rng)
		pr := brBuild(&c.m, &c.p, rng)
		dm := c.m
		dm.kinds = nil
		for s := 0; s < c.p.pp; s++ {
			dm.kinds = append(dm.kinds, c.m.kinds...)
		}
		dr := brBuild(&dm, &c.d, rng)[0]
		d := rng.IntN(c.d.tp)
		conn := brConnected(c.p.tp, c.d.tp, d)
		pp := rng.IntN(c.p.pp)
		pl, dl := clone(&pr[pp][conn[rng.IntN(len(conn))]].lay), clone(&dr[d].lay)
		curD, dLo, dHi = dl, pl.RegionOffset, pl.RegionOffset+len(pl.Regions)
		if _, err := topology.NewPlan(pl, dl, topology.PlanOptions{MaxSegments: 1 << 14}); err != nil {
			t.Fatalf("valid case refused: %v\n%s", err, c.desc)
		}
		bad := bads[rng.IntN(len(bads))]
		if !bad.mutate(pl, dl) {
			continue
		}
		tried[bad.name]++
		plan, err := topology.NewPlan(pl, dl, topology.PlanOptions{MaxSegments: 1 << 14})
		if err == nil || plan != nil {
			t.Fatalf("%s: NewPlan = %v, %v; want a refusal\n%s", bad.name, plan, err, c.desc)
		}
		if !errors.Is(err, bad.is) || !strings.Contains(err.Error(), bad.want) {
			t.Fatalf("%s: NewPlan error %q, want %v naming %q\n%s", bad.name, err, bad.is, bad.want, c.desc)
		}
	}
	// Requests: one bad field at a time, on every method.
	type reqBad struct {
		name   string
		want   string
		mutate func(c *brCase, groups []topology.Group) bool
	}
	pickGroup := func(groups []topology.Group, mamba bool) int {
		var idx []int
		for g := range groups {
			if (groups[g].Kind == topology.KindMamba) == mamba {
				idx = append(idx, g)
			}
		}
		if len(idx) == 0 {
			return -1
		}
		return idx[rng.IntN(len(idx))]
	}
	reqBads := []reqBad{
		{"src id past the region", "src group", func(c *brCase, groups []topology.Group) bool {
			g := rng.IntN(len(groups))
			if len(c.src[g].IDs) == 0 {
				return false
			}
			c.src[g].IDs[rng.IntN(len(c.src[g].IDs))] = topology.BlockID(c.p.blocks + rng.IntN(3))
			return true
		}},
		{"negative dst id", "dst group", func(c *brCase, groups []topology.Group) bool {
			g := rng.IntN(len(groups))
			if len(c.dst[g].IDs) == 0 {
				return false
			}
			c.dst[g].IDs[rng.IntN(len(c.dst[g].IDs))] = -1 - topology.BlockID(rng.IntN(1<<20))
			return true
		}},
		{"dst start off the block grid", "dst start", func(c *brCase, groups []topology.Group) bool {
			g := pickGroup(groups, false)
			if g < 0 || c.d.logical == 1 {
				return false
			}
			c.dst[g].Start += 1 + rng.IntN(c.d.logical-1)
			return true
		}},
		{"negative src start", "src start", func(c *brCase, groups []topology.Group) bool {
			g := pickGroup(groups, false)
			if g < 0 {
				return false
			}
			c.src[g].Start = -c.p.logical
			return true
		}},
		{"Mamba counts two apart", "differ by more than one", func(c *brCase, groups []topology.Group) bool {
			g := pickGroup(groups, true)
			if g < 0 || c.d.blocks < 3 {
				return false
			}
			c.src[g].IDs = nil
			c.dst[g].IDs = brIDs(rng, 2, c.d.blocks)
			return true
		}},
		{"negative tokens", "tokens = -", func(c *brCase, groups []topology.Group) bool {
			if pickGroup(groups, false) < 0 {
				return false
			}
			c.tokens = -1 - rng.IntN(100)
			return true
		}},
		{"a group missing", "groups: src", func(c *brCase, groups []topology.Group) bool {
			c.dst = c.dst[:len(c.dst)-1]
			return true
		}},
	}
	for i := 0; i < 600; i++ {
		c := brRandomCase(rng)
		pr := brBuild(&c.m, &c.p, rng)
		dm := c.m
		dm.kinds = nil
		for s := 0; s < c.p.pp; s++ {
			dm.kinds = append(dm.kinds, c.m.kinds...)
		}
		dr := brBuild(&dm, &c.d, rng)[0]
		groups := dr[0].lay.GroupList()
		c.brSpans(rng, groups)
		bad := reqBads[rng.IntN(len(reqBads))]
		if !bad.mutate(c, groups) {
			continue
		}
		tried[bad.name]++
		req := &hotpath.Request{Tokens: c.tokens, Src: c.src, Dst: c.dst}
		for d := range dr {
			for _, p := range brConnected(c.p.tp, c.d.tp, d) {
				plan, err := topology.NewPlan(&pr[0][p].lay, &dr[d].lay, topology.PlanOptions{MaxSegments: 1 << 14})
				if err != nil {
					t.Fatalf("valid case refused: %v\n%s", err, c.desc)
				}
				for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
					b, _ := hotpath.NewBuilder(hotpath.Options{Op: op})
					check := func(method string, err error, kept bool) {
						t.Helper()
						if err == nil || !errors.Is(err, hotpath.ErrInvalidRequest) && !strings.HasPrefix(bad.name, "a group") ||
							!strings.Contains(err.Error(), bad.want) {
							t.Fatalf("%s: %s %v (P tp%d -> D tp%d, notify-only %v) = %v, want ErrInvalidRequest naming %q\n%s\nsrc %v dst %v tokens %d",
								bad.name, method, op, p, d, plan.NotifyOnly, err, bad.want, c.desc, c.src, c.dst, c.tokens)
						}
						if !kept {
							t.Fatalf("%s: %s %v changed its output on error", bad.name, method, op)
						}
					}
					prefix := []hotpath.Desc{{Len: 9}}
					out, err := b.AppendDescs(prefix, plan, req)
					check("AppendDescs", err, len(out) == 1 && out[0].Len == 9)
					lays := hotpath.Layouts{Bases: []hotpath.BasePair{{}}, Entries: []hotpath.LayoutEntry{{}}, Spans: []hotpath.LayoutSpan{{}}}
					err = b.AppendLayouts(&lays, plan, req)
					check("AppendLayouts", err, len(lays.Bases) == 1 && len(lays.Entries) == 1 && len(lays.Spans) == 1)
					pairs, err := b.AppendIndices([]hotpath.IndexPair{{Local: 7}}, plan, req)
					check("AppendIndices", err, len(pairs) == 1 && pairs[0].Local == 7)
					ref, err := hotpath.AppendReference(prefix[:1], plan, req, op)
					check("AppendReference", err, len(ref) == 1)
				}
			}
		}
	}
	t.Logf("refusals tried: %v", tried)
	for _, b := range bads {
		if tried[b.name] == 0 {
			t.Errorf("layout refusal %q was never tried", b.name)
		}
	}
	for _, b := range reqBads {
		if tried[b.name] == 0 {
			t.Errorf("request refusal %q was never tried", b.name)
		}
	}
}
