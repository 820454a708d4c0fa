package hotpath

import (
	"fmt"
	"math"

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
	var sBase, dBase int64
	for g := range p.Groups {
		gp := &p.Groups[g]
		var err error
		b.runs, err = appendRuns(b.runs[:0], gp, req.Src[g], req.Dst[g], req.Tokens, g)
		b.flatOK, b.spansOK = false, false
		if err != nil {
			return dst[:start], err
		}
		for r := range gp.Regions {
			rp := &gp.Regions[r]
			nseg := int64(len(rp.Segs))
			for _, rn := range b.runs {
				for i := int64(0); i < rn.n; i++ {
					si := sBase + (rn.s+i)*nseg
					di := dBase + (rn.d+i)*nseg
					for k := int64(0); k < nseg; k++ {
						dst = append(dst, IndexPair{Local: int32(si + k), Remote: int32(di + k)})
					}
				}
			}
			sBase += regionEntries(gp, rp, SrcSide)
			dBase += regionEntries(gp, rp, DstSide)
		}
	}
	if sBase > math.MaxInt32 || dBase > math.MaxInt32 {
		return dst[:start], fmt.Errorf("hotpath: prepared lists of %d and %d entries exceed %d", sBase, dBase, math.MaxInt32)
	}
	if b.opts.Op == OpRead {
		out := dst[start:]
		for i := range out {
			out[i].Local, out[i].Remote = out[i].Remote, out[i].Local
		}
	}
	return dst, nil
}
