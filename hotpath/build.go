package hotpath

import (
	"errors"
	"fmt"

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
		if len(gp.Regions) == 0 {
			continue
		}
		var err error
		b.runs, err = appendRuns(b.runs[:0], gp, req.Src[g], req.Dst[g], req.Tokens, g)
		if err != nil {
			return dst[:start], err
		}
		if len(b.runs) == 0 {
			continue
		}
		for r := range gp.Regions {
			rp := &gp.Regions[r]
			if rp.Whole {
				dst = b.appendWhole(dst, rp)
			} else {
				dst = b.appendSegs(dst, gp, rp)
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
	perS, perD := gp.SrcPPL*gp.SrcUnits, gp.DstPPL*gp.DstUnits
	sIDs, dIDs := src.IDs, dst.IDs
	for k := 0; k < n; {
		us, ud := s0+k, d0+k
		ls, ld := us/perS, ud/perD
		rs, rd := us-ls*perS, ud-ld*perD
		take := min(perS-rs, perD-rd, n-k)
		fs := int64(sIDs[ls])*int64(perS) + int64(rs)
		fd := int64(dIDs[ld])*int64(perD) + int64(rd)
		if m := len(runs); m > 0 && runs[m-1].s+runs[m-1].n == fs && runs[m-1].d+runs[m-1].n == fd {
			runs[m-1].n += int64(take)
		} else {
			runs = append(runs, run{fs, fd, int64(take)})
		}
		k += take
	}
	return runs, nil
}

// appendWhole emits one descriptor per run (split by the cap) for a region
// whose units move whole.
func (b *Builder) appendWhole(dst []Desc, rp *topology.RegionPlan) []Desc {
	unit := rp.Segs[0].Len
	maxUnits := int64(1) << 62
	if b.opts.MaxRunBytes > 0 {
		maxUnits = max(1, b.opts.MaxRunBytes/unit)
	}
	for _, r := range b.runs {
		s, d, n := r.s, r.d, r.n
		for n > 0 {
			k := min(n, maxUnits)
			dst = append(dst, Desc{
				Local:    rp.SrcBase + uint64(s*unit),
				Remote:   rp.DstBase + uint64(d*unit),
				Len:      uint64(k * unit),
				LocalDev: rp.SrcDev, RemoteDev: rp.DstDev,
			})
			s, d, n = s+k, d+k, n-k
		}
	}
	return dst
}

// appendSegs emits every segment of every unit, merging a segment into the
// previous descriptor of the same region when both sides are contiguous.
func (b *Builder) appendSegs(dst []Desc, gp *topology.GroupPlan, rp *topology.RegionPlan) []Desc {
	regionStart := len(dst)
	maxLen := uint64(1) << 63
	if b.opts.MaxRunBytes > 0 {
		maxLen = uint64(b.opts.MaxRunBytes)
	}
	su, du := int64(gp.SrcUnits), int64(gp.DstUnits)
	segs := rp.Segs
	for _, r := range b.runs {
		sk, sj := r.s/su, r.s%su // kernel block and unit within it
		dk, dj := r.d/du, r.d%du
		for i := int64(0); i < r.n; i++ {
			sa := rp.SrcBase + uint64(sk*rp.SrcBlockLen+sj*rp.SrcSlotStride)
			da := rp.DstBase + uint64(dk*rp.DstBlockLen+dj*rp.DstSlotStride)
			for _, sg := range segs {
				l, ra := sa+uint64(sg.SrcOff), da+uint64(sg.DstOff)
				if m := len(dst); m > regionStart {
					last := &dst[m-1]
					if last.Local+last.Len == l && last.Remote+last.Len == ra && last.Len+uint64(sg.Len) <= maxLen {
						last.Len += uint64(sg.Len)
						continue
					}
				}
				dst = append(dst, Desc{Local: l, Remote: ra, Len: uint64(sg.Len), LocalDev: rp.SrcDev, RemoteDev: rp.DstDev})
			}
			if sj++; sj == su {
				sj, sk = 0, sk+1
			}
			if dj++; dj == du {
				dj, dk = 0, dk+1
			}
		}
	}
	return dst
}
