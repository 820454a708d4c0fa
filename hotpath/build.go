package hotpath

import (
	"errors"
	"fmt"
	"slices"

	"github.com/kvxfer/kvxfer/internal/invariants"
	"github.com/kvxfer/kvxfer/topology"
)

// Desc is one transfer descriptor pair: Len bytes at Local in this
// process's registered memory and at Remote in the peer's.
type Desc struct {
	Local, Remote       uint64
	Len                 uint64
	LocalDev, RemoteDev int32
}

// Op is the direction of a transfer from the poster's point of view.
type Op uint8

const (
	// OpWrite is posted by the source (P in push mode): local = source.
	OpWrite Op = iota + 1
	// OpRead is posted by the destination (D in pull mode): local =
	// destination.
	OpRead
)

func (o Op) String() string {
	switch o {
	case OpWrite:
		return "WRITE"
	case OpRead:
		return "READ"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Request is one request's blocks on both sides, per cache group, in the
// order of the plan's groups.
type Request struct {
	// Tokens is the number of KV tokens the source holds for the request
	// (the reference's remote_num_tokens); 0 means no bound beyond the
	// lists themselves.
	Tokens int
	Src    []topology.Span
	Dst    []topology.Span
}

// ErrInvalidRequest wraps every error about a request's block ids.
var ErrInvalidRequest = errors.New("hotpath: invalid request")

// Options configure a Builder. The zero value is not valid: Op is required.
type Options struct {
	Op Op
	// MaxRunBytes caps the bytes a coalesced descriptor may cover; 0 means
	// no cap. A single unit larger than the cap is never split.
	MaxRunBytes int64
}

// run is a maximal stretch of unit pairs consecutive on both sides, in
// fine-grained positions (kernel block · units + unit).
type run struct {
	s, d, n int64
}

// Builder turns plans and requests into descriptor lists. It keeps scratch
// memory between calls, so steady-state calls allocate nothing beyond
// growth of the caller's slice.
//
// A Builder is not safe for concurrent use: keep one per writer goroutine.
type Builder struct {
	opts Options
	runs []run
	// flat holds the current group's runs split into single units; it is
	// filled lazily (flatOK) when runs are short, so fragmented requests
	// take a loop without per-run setup.
	flat   []run
	flatOK bool
	units  int64 // units in runs
	maxRun int64 // longest run
	// spans are the current group's runs (or single units) scaled to byte
	// offsets for the multipliers in spansKey, reused by every region of
	// the group with the same geometry.
	spans    []span
	spansKey spanKey
	spansOK  bool
	// idxS and idxD are the current group's index pairs relative to a
	// region pair's first entries, for regions of idxSegs segments
	// (AppendIndices): every region of the group adds its bases to them.
	idxS, idxD []int32
	// scratch holds one region pair's descriptors (AppendLayouts).
	scratch []Desc
	// dups is CheckDistinct's scratch.
	dups Dups
}

// span is a run (or unit) in bytes: offsets from each region's base and a
// length.
type span struct{ s, d, n uint64 }

type spanKey struct {
	flat             bool
	sMul, dMul, nMul uint64
}

// NewBuilder returns a Builder. It fails on an invalid Op or a negative cap.
func NewBuilder(opts Options) (*Builder, error) {
	if opts.Op != OpWrite && opts.Op != OpRead {
		return nil, fmt.Errorf("hotpath: Options.Op = %v, want OpWrite or OpRead", opts.Op)
	}
	if opts.MaxRunBytes < 0 {
		return nil, fmt.Errorf("hotpath: Options.MaxRunBytes = %d, want >= 0", opts.MaxRunBytes)
	}
	return &Builder{opts: opts, runs: make([]run, 0, 64)}, nil
}

// AppendDescs appends the descriptors that move req's KV under plan p to
// dst and returns the extended slice. Descriptors are region-major within
// each group; adjacent units contiguous on both sides are merged into one
// descriptor, never across regions and never beyond MaxRunBytes.
//
// On error dst is returned truncated to its original length.
func (b *Builder) AppendDescs(dst []Desc, p *topology.Plan, req *Request) ([]Desc, error) {
	if len(req.Src) != len(p.Groups) || len(req.Dst) != len(p.Groups) {
		return dst, fmt.Errorf("%w: groups: src %d, dst %d, plan %d", ErrInvalidRequest, len(req.Src), len(req.Dst), len(p.Groups))
	}
	start := len(dst)
	for g := range p.Groups {
		gp := &p.Groups[g]
		// A group with nothing to move (this source only notifies) still
		// has its ids and starts checked: bad input is never silently
		// accepted on one rank and refused on another.
		if err := b.groupRuns(gp, req, g); err != nil {
			return dst[:start], err
		}
		if len(b.runs) == 0 || len(gp.Regions) == 0 {
			continue
		}
		// Grow once per group for the worst case (no merging), so the
		// region loops never grow the slice.
		dst = slices.Grow(dst, gp.MaxDescs(len(b.runs), int(b.units)))
		for r := 0; r < len(gp.Regions); r++ {
			rp := &gp.Regions[r]
			start := len(dst)
			switch {
			case b.opts.MaxRunBytes == 0 && len(rp.Segs) == 1 && (rp.Whole || gp.SrcUnits == 1 && gp.DstUnits == 1):
				// The region pairs after this one with its geometry at
				// steps of their own (each repeated once) take the same
				// spans: one call writes them all.
				e := r
				for n, _, _ := rp.Repeats(); n == 1; n, _, _ = gp.Regions[e].Repeats() {
					e++
				}
				dst = b.appendSpans(dst, gp.Regions[r:e+1])
				start = len(dst) - len(b.spans)
				r, rp = e, &gp.Regions[e]
			case rp.Whole:
				dst = b.appendWhole(dst, rp)
			default:
				dst = b.appendSegs(dst, gp, rp)
			}
			// Region pairs that repeat this one in memory get its
			// descriptors shifted (appendRepeats).
			if n, _, _ := rp.Repeats(); n > 1 {
				dst, r = appendRepeats(dst, start, gp.Regions, r)
			}
		}
	}
	if invariants.Enabled {
		checkAgainstReference(dst[start:], p, req, b.opts)
	}
	if b.opts.Op == OpRead {
		out := dst[start:]
		for i := range out {
			d := &out[i]
			d.Local, d.Remote = d.Remote, d.Local
			d.LocalDev, d.RemoteDev = d.RemoteDev, d.LocalDev
		}
	}
	return dst, nil
}

// groupRuns sets the Builder's runs (and their unit count and longest
// run) to group g of req under gp, resetting what it derived from the
// previous group's.
func (b *Builder) groupRuns(gp *topology.GroupPlan, req *Request, g int) error {
	var err error
	b.runs, err = appendRuns(b.runs[:0], gp, req.Src[g], req.Dst[g], req.Tokens, g)
	b.flatOK, b.spansOK = false, false
	b.units, b.maxRun = 0, 0
	for _, r := range b.runs {
		b.units += r.n
		b.maxRun = max(b.maxRun, r.n)
	}
	return err
}

// CheckCovered checks that req's source lists hold every token its
// destination lists would take as moved under p (topology's Covers, per
// group): a receiver takes its blocks as filled once the transfer ends,
// and the pairing alone moves only what both lists hold.
func CheckCovered(p *topology.Plan, req *Request) error {
	if len(req.Src) != len(p.Groups) || len(req.Dst) != len(p.Groups) {
		return nil // the builder refuses these, naming the counts
	}
	for g := range p.Groups {
		if err := p.Groups[g].Covers(req.Src[g], req.Dst[g], req.Tokens); err != nil {
			return fmt.Errorf("%w: group %d: %w", ErrInvalidRequest, g, err)
		}
	}
	return nil
}

// CheckDistinct checks that no group of spans names one block twice. A
// destination block named twice would take two source blocks' KV (one of
// them lost, the transfer reported complete); a source block named twice
// would send one block's KV for two. side names the lists in the error
// ("src" or "dst"), which gives the group, the positions and the id.
// Negative ids are left to the builder's range check. Steady-state calls
// allocate nothing.
func (b *Builder) CheckDistinct(spans []topology.Span, side string) error {
	for g := range spans {
		if i, j := b.dups.Repeated(spans[g].IDs); i >= 0 {
			ids := spans[g].IDs
			return fmt.Errorf("%w: %s group %d block %d: id %d, the same block as block %d (want distinct blocks)",
				ErrInvalidRequest, side, g, j, ids[j], i)
		}
	}
	return nil
}

// checkIDs bounds-checks every id of a list.
func checkIDs(ids []topology.BlockID, limit topology.BlockID, side string, g int) error {
	for i, id := range ids {
		if uint32(id) >= uint32(limit) {
			return fmt.Errorf("%w: %s group %d block %d: id %d, want 0..%d", ErrInvalidRequest, side, g, i, id, limit-1)
		}
	}
	return nil
}

// appendRuns pairs the units of one group and compresses them into runs.
func appendRuns(runs []run, gp *topology.GroupPlan, src, dst topology.Span, tokens, g int) ([]run, error) {
	if err := checkIDs(src.IDs, gp.SrcLimit, "src", g); err != nil {
		return runs, err
	}
	if err := checkIDs(dst.IDs, gp.DstLimit, "dst", g); err != nil {
		return runs, err
	}
	s0, d0, n, err := gp.Align(src, dst, tokens)
	if err != nil {
		return runs, fmt.Errorf("%w: group %d: %w", ErrInvalidRequest, g, err)
	}
	if n == 0 {
		return runs, nil
	}
	perS, perD := gp.SrcPPL*gp.SrcUnits, gp.DstPPL*gp.DstUnits
	sIDs, dIDs := src.IDs, dst.IDs
	// Walk both lists a chunk at a time: a chunk ends where either side
	// reaches the end of a logical block. Divisions happen once.
	ls, rs := s0/perS, s0%perS
	ld, rd := d0/perD, d0%perD
	if perS == 1 && perD == 1 {
		// One unit per logical block on both sides (the common case):
		// runs extend while both ids step by one.
		sIDs, dIDs = sIDs[ls:ls+n], dIDs[ld:ld+n]
		i := 0
		for i < n {
			fs, fd := int64(sIDs[i]), int64(dIDs[i])
			j := i + 1
			for j < n && int64(sIDs[j]) == fs+int64(j-i) && int64(dIDs[j]) == fd+int64(j-i) {
				j++
			}
			// j stopped where contiguity broke, so this run is maximal.
			runs = append(runs, run{fs, fd, int64(j - i)})
			i = j
		}
		return runs, nil
	}
	for k := 0; k < n; {
		take := min(perS-rs, perD-rd, n-k)
		fs := int64(sIDs[ls])*int64(perS) + int64(rs)
		fd := int64(dIDs[ld])*int64(perD) + int64(rd)
		if m := len(runs); m > 0 && runs[m-1].s+runs[m-1].n == fs && runs[m-1].d+runs[m-1].n == fd {
			runs[m-1].n += int64(take)
		} else {
			runs = append(runs, run{fs, fd, int64(take)})
		}
		k += take
		if rs += take; rs == perS {
			rs, ls = 0, ls+1
		}
		if rd += take; rd == perD {
			rd, ld = 0, ld+1
		}
	}
	return runs, nil
}

// appendSpans emits one-segment regions of one geometry (rs, region pairs
// that differ only in their bases) without a run cap: a whole region gets
// one descriptor per run; any other region (one unit per kernel block on
// both sides) one per unit, since a segment shorter than its block on one
// side never merges (see appendSegs). Runs are scaled to bytes once per
// group and geometry, so each region costs one add per address: close to
// writing the descriptors with no mapping logic at all.
func (b *Builder) appendSpans(dst []Desc, rs []topology.RegionPlan) []Desc {
	rp := &rs[0]
	sg := rp.Segs[0]
	n := uint64(sg.Len)
	key := spanKey{flat: !rp.Whole, sMul: uint64(rp.SrcBlockLen), dMul: uint64(rp.DstBlockLen), nMul: n}
	if rp.Whole {
		key.sMul, key.dMul = n, n
	}
	if !b.spansOK || b.spansKey != key {
		src := b.runs
		if key.flat {
			src = b.flatRuns(b.units)
		}
		b.spans = slices.Grow(b.spans[:0], len(src))[:len(src)]
		for i, r := range src {
			b.spans[i] = span{uint64(r.s) * key.sMul, uint64(r.d) * key.dMul, uint64(r.n) * key.nMul}
		}
		b.spansKey, b.spansOK = key, true
	}
	spans := b.spans
	sOff, dOff := uint64(sg.SrcOff), uint64(sg.DstOff)
	start := len(dst)
	dst = dst[:start+len(spans)*len(rs)] // AppendDescs grew dst exactly for uncapped regions
	out := dst[start:]
	for j := range rs {
		writeSpans(out[:len(spans)], spans, rs[j].SrcBase+sOff, rs[j].DstBase+dOff, rp)
		out = out[len(spans):]
	}
	return dst
}

// writeSpans writes one region's descriptors: spans shifted by the
// region's bases, on rp's devices. A leaf of its own: inlined in
// appendSpans' region loop, the loop's values went to the stack. The
// devices are read from rp, whose two adjacent fields the compiler loads
// and stores as one word (as two arguments they took two stores per
// descriptor, 13% slower).
//
//go:noinline
func writeSpans(out []Desc, spans []span, sBase, dBase uint64, rp *topology.RegionPlan) {
	sDev, dDev := rp.SrcDev, rp.DstDev
	out = out[:len(spans)]
	for i := range spans {
		sp, o := &spans[i], &out[i]
		o.Local, o.Remote, o.Len, o.LocalDev, o.RemoteDev = sBase+sp.s, dBase+sp.d, sp.n, sDev, dDev
	}
}

// appendRepeats appends the descriptors of the region pairs that repeat
// rs[r] in memory (topology.RegionPlan.Repeats) at least twice, given
// rs[r]'s at dst[start:], and returns the extended slice and the index of
// the last region pair it emitted. A stretch of repeats at one step is
// rs[r]'s descriptors shifted by a step per region, written by one flat
// loop (shiftCopy); a stretch at another step that follows (the repeats
// of the stretch's last pair) shifts the last copy again.
//
// A region pair repeated once (the next one lies at a step of its own,
// as when every layer is allocated on its own) is left to be built: on
// BenchmarkScattered, shifting each region's descriptors from the one
// before took 3% more time than building them region by region (geomean;
// up to 1.15x), and copying each from the first of the stretch 7% more
// (up to 1.27x). Likely causes: shifted, each region's loads wait on the
// stores of the region before, a chain through memory; copied from the
// first, the loads of 4 KiB regions alias the pending stores. AppendDescs
// hands such a stretch to one appendSpans call instead.
func appendRepeats(dst []Desc, start int, rs []topology.RegionPlan, r int) ([]Desc, int) {
	k := len(dst) - start
	copies := 0
	for i := r; ; {
		n, _, _ := rs[i].Repeats()
		if n < 2 {
			break
		}
		copies += n
		i += n
	}
	if k == 0 {
		return dst, r + copies
	}
	dst = slices.Grow(dst, copies*k) // a no-op unless a capped region used more than planned
	dst = dst[:len(dst)+copies*k]
	out := dst[start:]
	for {
		n, sStep, dStep := rs[r].Repeats()
		if n < 2 {
			return dst, r
		}
		if k == 1 {
			stepOne(out[:n+1], sStep, dStep)
		} else {
			shiftCopy(out[:(n+1)*k], k, sStep, dStep)
		}
		out = out[n*k:]
		r += n
	}
}

// shiftCopy fills out[k:] with copies of out[:k], each a step further than
// the one before. Every descriptor is one k (or a multiple of k) places
// before it shifted by as many steps, so all copies take one flat loop
// with no per-region work.
//
// The distance is at least farCopy descriptors once out is long enough:
// on the development machine (Intel Xeon, family 6 model 207), copying
// the descriptor stored 24 to 32 places before (96 to 128 stores back,
// about when a store leaves the store buffer) measured up to 1.8x slower
// than copying one 64 or more places back, which reads settled L1; closer
// ones are forwarded from the store buffer and fast.
func shiftCopy(out []Desc, k int, sStep, dStep uint64) {
	if k < farCopy && len(out) > farCopy+k {
		m := (farCopy + k - 1) / k
		copyBack(out[:m*k], k, sStep, dStep)
		k, sStep, dStep = m*k, uint64(m)*sStep, uint64(m)*dStep
	}
	copyBack(out, k, sStep, dStep)
}

// farCopy is the least distance shiftCopy copies over (see there).
const farCopy = 64

// copyBack sets out[i] to out[i-k] shifted by (sStep, dStep) for every i
// from k on, in order (repeated regions share their devices). A leaf of
// its own: inlined in appendShifted, the live result slice pushed the
// loop's values out of registers (up to 15% slower).
//
//go:noinline
func copyBack(out []Desc, k int, sStep, dStep uint64) {
	next := out[k:]
	prev := out[:len(next)]
	for i := range next {
		p, o := &prev[i], &next[i]
		o.Local, o.Remote, o.Len, o.LocalDev, o.RemoteDev = p.Local+sStep, p.Remote+dStep, p.Len, p.LocalDev, p.RemoteDev
	}
}

// stepOne is shiftCopy for one descriptor per region (coalesced fresh
// ids): it steps the descriptor in registers rather than reloading the
// one just stored.
//
//go:noinline
func stepOne(out []Desc, sStep, dStep uint64) {
	l, r, n, lDev, rDev := out[0].Local, out[0].Remote, out[0].Len, out[0].LocalDev, out[0].RemoteDev
	next := out[1:]
	for i := range next {
		l, r = l+sStep, r+dStep
		o := &next[i]
		o.Local, o.Remote, o.Len, o.LocalDev, o.RemoteDev = l, r, n, lDev, rDev
	}
}

// appendWhole emits one descriptor per run (split by the cap) for a region
// whose units move whole.
func (b *Builder) appendWhole(dst []Desc, rp *topology.RegionPlan) []Desc {
	unit := uint64(rp.Segs[0].Len)
	sBase, dBase, sDev, dDev := rp.SrcBase, rp.DstBase, rp.SrcDev, rp.DstDev
	if b.opts.MaxRunBytes <= 0 || uint64(b.opts.MaxRunBytes) >= unit*uint64(b.maxRun) {
		// No cap in reach: exactly one descriptor per run.
		start := len(dst)
		dst = slices.Grow(dst, len(b.runs))[:start+len(b.runs)] // grown by AppendDescs unless a capped region used more
		out := dst[start:]
		for i, r := range b.runs {
			o := &out[i]
			o.Local, o.Remote, o.Len = sBase+uint64(r.s)*unit, dBase+uint64(r.d)*unit, uint64(r.n)*unit
			o.LocalDev, o.RemoteDev = sDev, dDev
		}
		return dst
	}
	maxUnits := max(1, uint64(b.opts.MaxRunBytes)/unit)
	for _, r := range b.runs {
		s, d, n := uint64(r.s), uint64(r.d), uint64(r.n)
		for n > 0 {
			k := min(n, maxUnits)
			dst = append(dst, Desc{})
			o := &dst[len(dst)-1]
			o.Local, o.Remote, o.Len = sBase+s*unit, dBase+d*unit, k*unit
			o.LocalDev, o.RemoteDev = sDev, dDev
			s, d, n = s+k, d+k, n-k
		}
	}
	return dst
}

// flatRuns returns the current runs split into single units, building the
// list once per group.
func (b *Builder) flatRuns(units int64) []run {
	if b.flatOK {
		return b.flat
	}
	b.flat = slices.Grow(b.flat[:0], int(units))
	for _, r := range b.runs {
		for i := int64(0); i < r.n; i++ {
			b.flat = append(b.flat, run{r.s + i, r.d + i, 1})
		}
	}
	b.flatOK = true
	return b.flat
}

// appendSegs emits every segment of every unit, merging a segment into the
// previous descriptor of the same region when both sides are contiguous.
//
// The open descriptor lives in registers and is stored when the next one
// starts: one store per emitted descriptor, no reload to merge. Fields are
// stored one by one: a composite literal store measured 1.7x slower
// (bench/RESULTS.md).
func (b *Builder) appendSegs(dst []Desc, gp *topology.GroupPlan, rp *topology.RegionPlan) []Desc {
	maxLen := uint64(1) << 63
	if b.opts.MaxRunBytes > 0 {
		maxLen = uint64(b.opts.MaxRunBytes)
	}
	units := b.units
	segs := rp.Segs
	start := len(dst)
	dst = slices.Grow(dst, int(units)*len(segs)) // a no-op unless a capped region used more than planned
	out := dst[start : start+int(units)*len(segs)]
	w := 0 // descriptors written into out
	var ol, or, on uint64
	open := false
	sDev, dDev := rp.SrcDev, rp.DstDev
	emit := func(l, ra, n uint64) {
		if open && ol+on == l && or+on == ra && on+n <= maxLen {
			on += n
			return
		}
		if open {
			o := &out[w]
			o.Local, o.Remote, o.Len, o.LocalDev, o.RemoteDev = ol, or, on, sDev, dDev
			w++
		}
		ol, or, on, open = l, ra, n, true
	}
	su, du := int64(gp.SrcUnits), int64(gp.DstUnits)
	sBlock, dBlock := uint64(rp.SrcBlockLen), uint64(rp.DstBlockLen)
	if su == 1 && du == 1 && len(segs) == 1 {
		// One unit per kernel block and one segment per unit that is not
		// the whole block on at least one side (a head slice under hetero
		// TP). Two such segments can never be contiguous on that side
		// (their distance is a multiple of its block length, larger than
		// the segment), so nothing merges: write one descriptor per unit.
		sg := segs[0]
		sBase, dBase, n := rp.SrcBase+uint64(sg.SrcOff), rp.DstBase+uint64(sg.DstOff), uint64(sg.Len)
		// Loop over single units (the flattened runs, built once per
		// group): independent stores per unit measured faster than
		// stepping addresses along a run (fresh 70b_bs16/tp8to4/8192:
		// 85 µs -> 63 µs).
		flat := b.flatRuns(units)
		out = out[:len(flat)]
		for i, r := range flat {
			o := &out[i]
			o.Local, o.Remote, o.Len = sBase+uint64(r.s)*sBlock, dBase+uint64(r.d)*dBlock, n
			o.LocalDev, o.RemoteDev = sDev, dDev
		}
		return dst[:start+len(flat)]
	}
	sStride, dStride := uint64(rp.SrcSlotStride), uint64(rp.DstSlotStride)
	for _, r := range b.runs {
		sk, sj := r.s/su, r.s%su // kernel block and unit within it
		dk, dj := r.d/du, r.d%du
		sa := rp.SrcBase + uint64(sk)*sBlock + uint64(sj)*sStride
		da := rp.DstBase + uint64(dk)*dBlock + uint64(dj)*dStride
		for i := int64(0); i < r.n; i++ {
			for _, sg := range segs {
				emit(sa+uint64(sg.SrcOff), da+uint64(sg.DstOff), uint64(sg.Len))
			}
			// Step to the next unit on each side.
			if sj++; sj == su {
				sj, sk = 0, sk+1
				sa = rp.SrcBase + uint64(sk)*sBlock
			} else {
				sa += sStride
			}
			if dj++; dj == du {
				dj, dk = 0, dk+1
				da = rp.DstBase + uint64(dk)*dBlock
			} else {
				da += dStride
			}
		}
	}
	if open {
		o := &out[w]
		o.Local, o.Remote, o.Len, o.LocalDev, o.RemoteDev = ol, or, on, sDev, dDev
		w++
	}
	return dst[:start+w]
}
