package hotpath

import (
	"fmt"
	"math"
	"slices"

	"github.com/kvxfer/kvxfer/topology"
)

// Entry is one entry of a prepared descriptor list (a backend's
// pre-registered dlist, such as NIXL's prep_xfer_dlist).
type Entry struct {
	Addr, Len uint64
	Dev       int32
}

// IndexPair pairs an entry of the local prepared list with an entry of the
// remote one; a backend with prepared lists transfers pairs positionally.
type IndexPair struct {
	Local, Remote int32
}

// IndexRuns returns the number of maximal runs of pairs whose local and
// remote indices both go up by one from each pair to the next. It is a
// lower bound on the descriptors AppendDescs gives for the same request
// (AppendDescs merges only pieces contiguous on both sides, and those are
// neighbours in both prepared lists), so a caller choosing between a
// prepared post and an on-the-fly one can often decide from the pairs
// alone, without building descriptors.
func IndexRuns(pairs []IndexPair) int {
	if len(pairs) == 0 {
		return 0
	}
	n := 1
	for k := 1; k < len(pairs); k++ {
		p, q := pairs[k-1], pairs[k]
		if q.Local != p.Local+1 || q.Remote != p.Remote+1 {
			n++
		}
	}
	return n
}

// Side selects one side of a plan.
type Side uint8

const (
	// SrcSide is the source (P) side of a plan.
	SrcSide Side = iota + 1
	// DstSide is the destination (D) side.
	DstSide
)

// PreparedLen returns the number of entries of a side's prepared list for
// plan p: for every group's region pair, every block, every unit of a
// block, every segment.
func PreparedLen(p *topology.Plan, side Side) int64 {
	var n int64
	for g := range p.Groups {
		gp := &p.Groups[g]
		for r := range gp.Regions {
			n += regionEntries(gp, &gp.Regions[r], side)
		}
	}
	return n
}

func regionEntries(gp *topology.GroupPlan, rp *topology.RegionPlan, side Side) int64 {
	if side == SrcSide {
		return int64(rp.SrcNumBlocks) * int64(gp.SrcUnits) * int64(len(rp.Segs))
	}
	return int64(rp.DstNumBlocks) * int64(gp.DstUnits) * int64(len(rp.Segs))
}

// AppendPrepared appends the prepared descriptor list of one side of plan
// p: group-major, then region pair, block, unit, segment. Indices from
// Builder.AppendIndices point into this list. Build it once per plan.
func AppendPrepared(dst []Entry, p *topology.Plan, side Side) ([]Entry, error) {
	if side != SrcSide && side != DstSide {
		return dst, fmt.Errorf("hotpath: side = %d, want SrcSide or DstSide", side)
	}
	if n := PreparedLen(p, side); n > math.MaxInt32 {
		return dst, fmt.Errorf("hotpath: prepared list of %d entries exceeds %d", n, math.MaxInt32)
	}
	for g := range p.Groups {
		gp := &p.Groups[g]
		for r := range gp.Regions {
			rp := &gp.Regions[r]
			base, blockLen, stride, blocks, units, dev := rp.SrcBase, rp.SrcBlockLen, rp.SrcSlotStride, rp.SrcNumBlocks, gp.SrcUnits, rp.SrcDev
			if side == DstSide {
				base, blockLen, stride, blocks, units, dev = rp.DstBase, rp.DstBlockLen, rp.DstSlotStride, rp.DstNumBlocks, gp.DstUnits, rp.DstDev
			}
			for b := 0; b < blocks; b++ {
				for u := 0; u < units; u++ {
					a := base + uint64(int64(b)*blockLen+int64(u)*stride)
					for _, sg := range rp.Segs {
						off := sg.SrcOff
						if side == DstSide {
							off = sg.DstOff
						}
						dst = append(dst, Entry{Addr: a + uint64(off), Len: uint64(sg.Len), Dev: dev})
					}
				}
			}
		}
	}
	return dst, nil
}

// AppendIndices appends, for req under plan p, the pairs of indices into
// the local and remote prepared lists (AppendPrepared of each side): one
// pair per segment per unit, uncoalesced, since prepared entries are fixed.
// Local is the source side for OpWrite and the destination side for OpRead.
//
// On error dst is returned truncated to its original length.
func (b *Builder) AppendIndices(dst []IndexPair, p *topology.Plan, req *Request) ([]IndexPair, error) {
	if len(req.Src) != len(p.Groups) || len(req.Dst) != len(p.Groups) {
		return dst, fmt.Errorf("%w: groups: src %d, dst %d, plan %d", ErrInvalidRequest, len(req.Src), len(req.Dst), len(p.Groups))
	}
	start := len(dst)
	read := b.opts.Op == OpRead
	var sBase, dBase int64
	for g := range p.Groups {
		gp := &p.Groups[g]
		if err := b.groupRuns(gp, req, g); err != nil {
			return dst[:start], err
		}
		// Size the group's pairs once, then write them in place: no
		// append per pair. The pairs of one region pair are the same
		// relative indices for every region with as many segments (the
		// runs' units, segment by segment), plus the region's bases.
		units, segs := b.units, int64(0)
		for r := range gp.Regions {
			segs += int64(len(gp.Regions[r].Segs))
		}
		n := len(dst)
		dst = slices.Grow(dst, int(units*segs))[:n+int(units*segs)]
		out := dst[n:]
		j, expanded := 0, int64(-1)
		if units >= 8*int64(len(b.runs)) {
			// Long runs: each is one stretch of consecutive indices.
			for r := range gp.Regions {
				rp := &gp.Regions[r]
				j = b.runIndices(out, j, rp, sBase, dBase, read)
				sBase += regionEntries(gp, rp, SrcSide)
				dBase += regionEntries(gp, rp, DstSide)
			}
			continue
		}
		for r := range gp.Regions {
			rp := &gp.Regions[r]
			if nseg := int64(len(rp.Segs)); nseg != expanded {
				b.expandIndices(nseg)
				expanded = nseg
			}
			sb, db := int32(sBase), int32(dBase)
			rs, rd := b.idxS, b.idxD
			w := out[j : j+len(rs) : j+len(rs)]
			rd = rd[:len(w)]
			if read {
				for i := range w {
					w[i] = IndexPair{Local: db + rd[i], Remote: sb + rs[i]}
				}
			} else {
				for i := range w {
					w[i] = IndexPair{Local: sb + rs[i], Remote: db + rd[i]}
				}
			}
			j += len(w)
			sBase += regionEntries(gp, rp, SrcSide)
			dBase += regionEntries(gp, rp, DstSide)
		}
	}
	if sBase > math.MaxInt32 || dBase > math.MaxInt32 {
		return dst[:start], fmt.Errorf("hotpath: prepared lists of %d and %d entries exceed %d", sBase, dBase, math.MaxInt32)
	}
	return dst, nil
}

// expandIndices fills idxS and idxD with the group's runs as index pairs
// relative to a region pair of nseg segments: unit u of a run starting at
// s covers entries (s+u)·nseg … (s+u)·nseg+nseg-1, consecutive on both
// sides along the run.
func (b *Builder) expandIndices(nseg int64) {
	b.idxS, b.idxD = b.idxS[:0], b.idxD[:0]
	for _, rn := range b.runs {
		s, d := rn.s*nseg, rn.d*nseg
		for i := range rn.n * nseg {
			b.idxS = append(b.idxS, int32(s+i))
			b.idxD = append(b.idxD, int32(d+i))
		}
	}
}

// runIndices writes the pairs of region pair rp (its first entries at
// sBase and dBase) run by run into out from j, and returns the new j.
func (b *Builder) runIndices(out []IndexPair, j int, rp *topology.RegionPlan, sBase, dBase int64, read bool) int {
	nseg := int64(len(rp.Segs))
	for _, rn := range b.runs {
		si, di := int32(sBase+rn.s*nseg), int32(dBase+rn.d*nseg)
		m := int(rn.n * nseg) // consecutive on both sides
		w := out[j : j+m : j+m]
		if read {
			si, di = di, si
		}
		for i := range w {
			w[i] = IndexPair{Local: si + int32(i), Remote: di + int32(i)}
		}
		j += m
	}
	return j
}
