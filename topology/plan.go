package topology

import (
	"fmt"
	"slices"
)

// DefaultMaxSegments is the default bound on the descriptors one unit (one
// block pair) may need. Exact placement of a layout that scatters a block's
// bytes (NHD with a TP mismatch: one descriptor per token; HND↔NHD: one per
// cell) multiplies the descriptor count; past this bound a plan is refused
// rather than posting hundreds of descriptors per block.
const DefaultMaxSegments = 128

// PlanOptions tune NewPlan. The zero value is valid.
type PlanOptions struct {
	// MaxSegments bounds the segments (descriptors) per unit; 0 means
	// DefaultMaxSegments.
	MaxSegments int
}

// SegmentsError is NewPlan's refusal of a combination whose exact
// placement needs more than PlanOptions.MaxSegments descriptors per unit
// (a block's bytes are scattered: HND on one side and NHD on the other,
// or NHD with a TP mismatch). It matches ErrUnsupported.
type SegmentsError struct {
	// Region is the destination region that needs too many segments.
	Region int
	// Max is the bound that was exceeded; UnitTokens the unit's tokens.
	Max, UnitTokens int
	msg             string
}

func (e *SegmentsError) Error() string { return e.msg }

// Unwrap returns ErrUnsupported.
func (e *SegmentsError) Unwrap() error { return ErrUnsupported }

// Segment is one contiguous byte range that moves for every unit: SrcOff
// and DstOff are relative to the unit's start on each side.
type Segment struct {
	SrcOff, DstOff, Len int64
}

// RegionPlan is how one source region lands in one destination region.
//
// A unit is UnitTokens tokens of one group (for Mamba: one logical block).
// Unit k of a kernel block b on the source starts at
// SrcBase + b·SrcBlockLen + k·SrcSlotStride, likewise on the destination,
// and every segment moves from unit+SrcOff to unit+DstOff.
type RegionPlan struct {
	Src, Dst                     int // indices into the layouts' Regions
	SrcBase, DstBase             uint64
	SrcDev, DstDev               int32
	SrcBlockLen, DstBlockLen     int64
	SrcNumBlocks, DstNumBlocks   int
	SrcSlotStride, DstSlotStride int64
	Segs                         []Segment
	// Whole is set when a unit moves as one segment covering the whole
	// unit on both sides, so consecutive units are contiguous on a side
	// exactly when their fine-grained positions are consecutive.
	Whole bool
	// UnitBytes is the sum of the segment lengths.
	UnitBytes int64

	// repeat, repeatSrc and repeatDst are what Repeats reports; NewPlan
	// sets them.
	repeat               int
	repeatSrc, repeatDst uint64
}

// Repeats reports the region pairs right after r in its group that are
// copies of r shifted in memory: for k = 1..n, region pair k after r has
// every field of r except Src, Dst and the bases, and its bases are
// SrcBase + k·srcStep and DstBase + k·dstStep (mod 2^64). Regions
// allocated as one tensor per side (equal sizes, equally spaced) repeat
// the first region of their group this way. A unit's segments land in a
// copy at the same offsets as in r, so any descriptor list built for r
// carries over to the k-th copy by adding k·srcStep and k·dstStep to its
// addresses.
//
// NewPlan computes it for every region pair; a RegionPlan not made by
// NewPlan reports n = 0.
func (r *RegionPlan) Repeats() (n int, srcStep, dstStep uint64) {
	return r.repeat, r.repeatSrc, r.repeatDst
}

// SameShape reports whether a and b differ at most in their region
// indices and bases (what makes one the repeat of the other).
func (a *RegionPlan) SameShape(b *RegionPlan) bool {
	return a.SrcDev == b.SrcDev && a.DstDev == b.DstDev &&
		a.SrcBlockLen == b.SrcBlockLen && a.DstBlockLen == b.DstBlockLen &&
		a.SrcNumBlocks == b.SrcNumBlocks && a.DstNumBlocks == b.DstNumBlocks &&
		a.SrcSlotStride == b.SrcSlotStride && a.DstSlotStride == b.DstSlotStride &&
		a.Whole == b.Whole && a.UnitBytes == b.UnitBytes && slices.Equal(a.Segs, b.Segs)
}

// setRepeats computes Repeats for every region pair of rs, from the last
// one back: a pair repeated by its successor at the successor's own step
// has one more repeat than the successor.
func setRepeats(rs []RegionPlan) {
	for i := len(rs) - 2; i >= 0; i-- {
		a, b := &rs[i], &rs[i+1]
		if !a.SameShape(b) {
			continue
		}
		ss, ds := b.SrcBase-a.SrcBase, b.DstBase-a.DstBase
		a.repeat, a.repeatSrc, a.repeatDst = 1, ss, ds
		if b.repeat > 0 && b.repeatSrc == ss && b.repeatDst == ds {
			a.repeat += b.repeat
		}
	}
}

// GroupPlan is the plan of one cache group.
type GroupPlan struct {
	Kind   Kind
	Window int
	// UnitTokens is the tokens per unit (the smaller kernel block size);
	// 0 for Mamba groups, which pair whole logical blocks.
	UnitTokens int
	// SrcPPL and DstPPL are kernel blocks per logical block (1 for Mamba).
	SrcPPL, DstPPL int
	// SrcUnits and DstUnits are units per kernel block (1 for Mamba).
	SrcUnits, DstUnits int
	// SrcBlockTokens and DstBlockTokens are the logical block sizes.
	SrcBlockTokens, DstBlockTokens int
	// SrcLimit and DstLimit bound the logical block ids (exclusive).
	SrcLimit, DstLimit BlockID
	// Regions are the region pairs with something to move; empty when the
	// source is notify-only for this group.
	Regions []RegionPlan

	// sized is set by NewPlan: wholeRegions counts the regions with Whole
	// set, unitSegs sums len(Segs) over the others (see MaxDescs).
	sized                  bool
	wholeRegions, unitSegs int
}

// MaxDescs bounds the descriptors of one request of the group that pairs
// units unit pairs in runs runs (maximal stretches of unit pairs
// consecutive on both sides) without a byte cap on merging: one descriptor
// per run for every Whole region, one per segment per unit for any other.
func (g *GroupPlan) MaxDescs(runs, units int) int {
	if g.sized {
		return g.wholeRegions*runs + g.unitSegs*units
	}
	n := 0
	for r := range g.Regions {
		if g.Regions[r].Whole {
			n += runs
		} else {
			n += units * len(g.Regions[r].Segs)
		}
	}
	return n
}

// Plan is how the KV of one source rank (P) lands in one destination rank
// (D). It is immutable after NewPlan and safe for concurrent use.
type Plan struct {
	SrcTPRank, SrcPPRank, DstTPRank int
	Groups                          []GroupPlan
	// NotifyOnly is set when no byte moves from this source rank to this
	// destination rank (a GQA duplicate or a non-source MLA rank): the
	// source still owes the destination a completion notification.
	NotifyOnly bool
	// MaxUnitSegments is the largest segment count of any region pair.
	MaxUnitSegments int
}

// side is the geometry of one side of an attention region pair.
type side struct {
	layout  KVLayout
	packing KVPacking
	heads   int   // local heads
	tokens  int   // kernel block size
	cell    int64 // bytes of one head's K (or V) vector
}

func sideOf(l *Layout) side {
	return side{l.KVLayout, l.Packing, l.LocalHeads(), l.KernelBlockSize, int64(l.HeadSize) * int64(l.ElemBytes)}
}

// off is the byte offset of (local head h, token t, kv) inside a block.
func (s *side) off(h, t, kv int) int64 {
	var cellIdx int64
	if s.layout == LayoutHND {
		cellIdx = int64(h)*int64(s.tokens) + int64(t)
	} else {
		cellIdx = int64(t)*int64(s.heads) + int64(h)
	}
	switch s.packing {
	case PackedKV:
		return (cellIdx*2 + int64(kv)) * s.cell
	case SplitKV:
		return int64(kv)*int64(s.heads)*int64(s.tokens)*s.cell + cellIdx*s.cell
	}
	return cellIdx * s.cell
}

// NewPlan checks that src and dst are compatible and computes how src's
// KV lands in dst's blocks. It fails when the two ranks are not connected
// (see TargetRanks) or when exact placement needs more than
// opts.MaxSegments descriptors per unit.
//
// NewPlan allocates; compute plans once per (peer, rank) pair and reuse
// them (hotpath.Registry does).
func NewPlan(src, dst *Layout, opts PlanOptions) (*Plan, error) {
	if err := CheckCompatible(src, dst); err != nil {
		return nil, err
	}
	maxSeg := opts.MaxSegments
	if maxSeg == 0 {
		maxSeg = DefaultMaxSegments
	}
	if maxSeg < 0 {
		return nil, fmt.Errorf("%w: PlanOptions.MaxSegments = %d, want >= 0", ErrInvalidLayout, maxSeg)
	}
	peers, err := TargetRanks(nil, dst.TPSize, src.TPSize, dst.TPRank)
	if err != nil {
		return nil, err
	}
	if !contains(peers, src.TPRank) {
		return nil, fmt.Errorf("%w: src TP rank %d is not connected to dst TP rank %d (TP %d -> %d connects it to %v)",
			ErrIncompatible, src.TPRank, dst.TPRank, src.TPSize, dst.TPSize, peers)
	}
	var slice HeadSlice
	if src.hasAttention() {
		slices, err := AttentionSlices(nil, src.TotalKVHeads, src.TPSize, dst.TPSize, dst.TPRank)
		if err != nil {
			return nil, err
		}
		for _, s := range slices {
			if s.SrcRank == src.TPRank {
				slice = s
			}
		}
	}
	p := &Plan{SrcTPRank: src.TPRank, SrcPPRank: src.PPRank, DstTPRank: dst.TPRank, NotifyOnly: true}
	sg, dg := src.GroupList(), dst.GroupList()
	for g := range sg {
		gp := GroupPlan{Kind: sg[g].Kind, Window: sg[g].Window,
			SrcBlockTokens: src.LogicalBlockSize, DstBlockTokens: dst.LogicalBlockSize}
		if gp.Kind == KindMamba {
			gp.SrcPPL, gp.DstPPL, gp.SrcUnits, gp.DstUnits = 1, 1, 1, 1
		} else {
			gp.UnitTokens, gp.SrcUnits, gp.DstUnits, err = BlockSizeRatio(src.KernelBlockSize, dst.KernelBlockSize)
			if err != nil {
				return nil, err
			}
			gp.SrcPPL, gp.DstPPL = src.PagesPerBlock(), dst.PagesPerBlock()
		}
		gp.SrcLimit = groupLimit(src, sg[g].Regions, gp.SrcPPL)
		gp.DstLimit = groupLimit(dst, dg[g].Regions, gp.DstPPL)
		for _, i := range sg[g].Regions {
			rp, err := regionPlan(src, dst, i, src.RegionOffset+i, &gp, slice, peers[0], maxSeg)
			if err != nil {
				return nil, err
			}
			if len(rp.Segs) == 0 {
				continue
			}
			gp.Regions = append(gp.Regions, rp)
			p.NotifyOnly = false
			p.MaxUnitSegments = max(p.MaxUnitSegments, len(rp.Segs))
			if rp.Whole {
				gp.wholeRegions++
			} else {
				gp.unitSegs += len(rp.Segs)
			}
		}
		gp.sized = true
		setRepeats(gp.Regions)
		p.Groups = append(p.Groups, gp)
	}
	return p, nil
}

func groupLimit(l *Layout, regions []int, ppl int) BlockID {
	n := 1 << 30
	for _, r := range regions {
		n = min(n, l.Regions[r].NumBlocks)
	}
	return BlockID(n / ppl)
}

// segBuilder merges segments produced in source order.
type segBuilder struct {
	segs []Segment
	max  int
	over bool
}

func (b *segBuilder) add(src, dst, n int64) {
	if k := len(b.segs); k > 0 {
		last := &b.segs[k-1]
		if last.SrcOff+last.Len == src && last.DstOff+last.Len == dst {
			last.Len += n
			return
		}
	}
	if len(b.segs) == b.max {
		b.over = true
		return
	}
	b.segs = append(b.segs, Segment{src, dst, n})
}

func regionPlan(src, dst *Layout, i, j int, gp *GroupPlan, slice HeadSlice, firstPeer, maxSeg int) (RegionPlan, error) {
	rs, rd := &src.Regions[i], &dst.Regions[j]
	rp := RegionPlan{Src: i, Dst: j, SrcBase: rs.Base, DstBase: rd.Base, SrcDev: rs.DeviceID, DstDev: rd.DeviceID,
		SrcBlockLen: rs.BlockLen, DstBlockLen: rd.BlockLen, SrcNumBlocks: rs.NumBlocks, DstNumBlocks: rd.NumBlocks}
	b := segBuilder{max: maxSeg}
	switch rs.Kind {
	case KindFullAttention, KindSlidingWindow:
		if slice.Heads == 0 {
			return rp, nil
		}
		s, d := sideOf(src), sideOf(dst)
		m := gp.UnitTokens
		rp.SrcSlotStride = s.off(0, m, 0) - s.off(0, 0, 0)
		rp.DstSlotStride = d.off(0, m, 0) - d.off(0, 0, 0)
		nkv := 2
		if s.packing == SeparateKV {
			nkv = 1
		}
		// Enumerate cells in source byte order so that merging adjacent
		// cells yields segments sorted by source offset, without sorting.
		dims := [3]int{nkv, slice.Heads, m} // kv, head, token
		var order [3]int                    // outermost first
		switch {
		case s.packing == SplitKV && s.layout == LayoutHND:
			order = [3]int{0, 1, 2}
		case s.packing == SplitKV:
			order = [3]int{0, 2, 1}
		case s.layout == LayoutHND:
			order = [3]int{1, 2, 0}
		default:
			order = [3]int{2, 1, 0}
		}
		var idx [3]int
		for a := 0; a < dims[order[0]] && !b.over; a++ {
			idx[order[0]] = a
			for c := 0; c < dims[order[1]] && !b.over; c++ {
				idx[order[1]] = c
				for e := 0; e < dims[order[2]] && !b.over; e++ {
					idx[order[2]] = e
					kv, h, t := idx[0], idx[1], idx[2]
					b.add(s.off(slice.SrcHead+h, t, kv), d.off(slice.DstHead+h, t, kv), s.cell)
				}
			}
		}
	case KindMLA:
		if src.TPRank != firstPeer {
			return rp, nil
		}
		cell := rs.BlockLen / int64(src.KernelBlockSize)
		n := int64(gp.UnitTokens) * cell
		rp.SrcSlotStride, rp.DstSlotStride = n, n
		b.add(0, 0, n)
	case KindMamba:
		var so, do int64
		parts := len(rs.ConvBytes) + 1
		for k := 0; k < parts; k++ {
			ss, ds := rs.SSMBytes, rd.SSMBytes
			if k < len(rs.ConvBytes) {
				ss, ds = rs.ConvBytes[k], rd.ConvBytes[k]
			}
			// Global byte ranges of this part held by each rank.
			s0, d0 := int64(src.TPRank)*ss, int64(dst.TPRank)*ds
			lo, hi := max(s0, d0), min(s0+ss, d0+ds)
			if lo < hi {
				b.add(so+lo-s0, do+lo-d0, hi-lo)
			}
			so += ss
			do += ds
		}
	}
	if b.over {
		return rp, &SegmentsError{Region: j, Max: maxSeg, UnitTokens: gp.UnitTokens, msg: fmt.Sprintf(
			"%v: region %d needs more than %d descriptors per %d-token unit "+
				"(src %s/%s TP %d block %d -> dst %s/%s TP %d block %d); raise PlanOptions.MaxSegments or use HND on both sides",
			ErrUnsupported, j, maxSeg, gp.UnitTokens, src.KVLayout, src.Packing, src.TPSize, src.KernelBlockSize,
			dst.KVLayout, dst.Packing, dst.TPSize, dst.KernelBlockSize)}
	}
	rp.Segs = b.segs
	for _, sg := range rp.Segs {
		rp.UnitBytes += sg.Len
	}
	rp.Whole = len(rp.Segs) == 1 && rp.Segs[0].SrcOff == 0 && rp.Segs[0].DstOff == 0 &&
		rp.Segs[0].Len*int64(gp.SrcUnits) == rs.BlockLen && rp.Segs[0].Len*int64(gp.DstUnits) == rd.BlockLen
	if rp.Whole {
		rp.SrcSlotStride, rp.DstSlotStride = rp.Segs[0].Len, rp.Segs[0].Len
	}
	return rp, nil
}

// maxStart bounds token starts so unit arithmetic cannot overflow.
const maxStart = 1 << 40

// Align pairs the units of one group for one request: it returns the
// first source unit, the first destination unit and the number of unit
// pairs. Units are numbered along each side's list: unit u of a list is
// token range Start+u·UnitTokens of it.
//
// Attention and MLA lists are anchored at their token starts, so a prefix
// hit on D, a clipped window or a partly filled last block of either block
// size pairs exactly the tokens both lists hold; tokens > 0 stops at the
// unit holding token tokens-1 (0: no bound). Mamba lists pair by
// TrimSSM's rule.
func (g *GroupPlan) Align(src, dst Span, tokens int) (s0, d0, n int, err error) {
	if g.Kind == KindMamba {
		return TrimSSM(len(src.IDs), len(dst.IDs))
	}
	if err := checkStart("src", src.Start, g.SrcBlockTokens); err != nil {
		return 0, 0, 0, err
	}
	if err := checkStart("dst", dst.Start, g.DstBlockTokens); err != nil {
		return 0, 0, 0, err
	}
	if tokens < 0 || tokens > maxStart {
		return 0, 0, 0, fmt.Errorf("%w: tokens = %d, want 0..%d", ErrInvalidBlocks, tokens, maxStart)
	}
	m := g.UnitTokens
	sEnd := src.Start + len(src.IDs)*g.SrcPPL*g.SrcUnits*m
	dEnd := dst.Start + len(dst.IDs)*g.DstPPL*g.DstUnits*m
	lo, hi := max(src.Start, dst.Start), min(sEnd, dEnd)
	if tokens > 0 {
		hi = min(hi, (tokens+m-1)/m*m)
	}
	if hi <= lo {
		return 0, 0, 0, nil
	}
	return (lo - src.Start) / m, (lo - dst.Start) / m, (hi - lo) / m, nil
}

// Covers checks that src holds every token of dst that a transfer of
// tokens tokens (tokens > 0: the source says it holds that many) would
// take as moved: dst's tokens from its start up to the end of its list or
// to tokens, whichever comes first. Align pairs what both lists hold; a
// receiver that takes its whole list as filled needs this too, or the
// blocks past a short source list keep what they held. A window's lists
// start where each side's clipping put them, so a sliding-window source
// need hold only the window of the token after the last one dst takes
// (tokens, or the end of dst's list when tokens is 0): the Window-1
// tokens before it. Mamba state pairs by TrimSSM's rule and is not
// checked here. tokens = 0 (the source says nothing of what it holds)
// bounds nothing: the source must then hold the destination's whole list.
func (g *GroupPlan) Covers(src, dst Span, tokens int) error {
	if g.Kind == KindMamba {
		return nil
	}
	m := g.UnitTokens
	sEnd := src.Start + len(src.IDs)*g.SrcPPL*g.SrcUnits*m
	dEnd := dst.Start + len(dst.IDs)*g.DstPPL*g.DstUnits*m
	// dst takes tokens from..last as filled: up to the end of its list
	// or the source's tokens, of a window's list only the next token's
	// window (the token at last attends to the Window-1 before it).
	last := dEnd
	if tokens > 0 {
		last = min(dEnd, tokens, maxStart)
	}
	from := dst.Start
	if g.Kind == KindSlidingWindow {
		from = max(from, last-g.Window+1)
	}
	if last <= from {
		return nil
	}
	if sEnd < last || src.Start > from {
		return fmt.Errorf("%w: the source's blocks hold tokens %d..%d, short of the destination's %d..%d (the source holds %d tokens)",
			ErrInvalidBlocks, src.Start, sEnd, from, last, tokens)
	}
	return nil
}

func checkStart(name string, start, blockTokens int) error {
	if start < 0 || start > maxStart || start%blockTokens != 0 {
		return fmt.Errorf("%w: %s start = %d, want a multiple of the logical block size %d in 0..%d",
			ErrInvalidBlocks, name, start, blockTokens, maxStart)
	}
	return nil
}

// UnitBlock returns the kernel block and the unit within it of unit u of
// a side's list: ids are logical, ppl kernel blocks per logical block,
// units units per kernel block. The caller keeps u in range.
func UnitBlock(ids []BlockID, u, ppl, units int) (kernel BlockID, unit int) {
	perLogical := ppl * units
	l := u / perLogical
	r := u - l*perLogical
	return ids[l]*BlockID(ppl) + BlockID(r/units), r % units
}
