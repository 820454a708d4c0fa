package hotpath

import (
	"fmt"
	"slices"

	"github.com/kvxfer/kvxfer/internal/invariants"
	"github.com/kvxfer/kvxfer/topology"
)

// Layouts are a request's descriptors in factored form: region pairs of
// one shape (topology.RegionPlan.SameShape: a KV cache's layers) take the
// same descriptors relative to their bases, so a stretch of them is one
// layout: its base pairs, and the descriptors of its first region pair as
// entries (offsets from the bases). A transfer of L layers of n scattered
// blocks is L bases and n entries rather than L·n descriptors: a backend
// that moves layouts as they are (the built-in backend's same-host GPU
// path: one kernel launch computes every piece's addresses) never walks
// the pieces on the CPU.
//
// Expanded (each entry at each base, layout by layout, base by base, in
// order), the layouts are exactly AppendDescs' descriptors.
type Layouts struct {
	Bases   []BasePair
	Entries []LayoutEntry
	// Spans are the layouts: Spans[i] takes Bases[B0:B1] and
	// Entries[E0:E1].
	Spans []LayoutSpan
}

// BasePair is a layout's pair of base addresses (and devices).
type BasePair struct {
	Local, Remote       uint64
	LocalDev, RemoteDev int32
}

// LayoutEntry is a descriptor of a layout at offsets from each base
// pair.
type LayoutEntry struct{ Local, Remote, Len uint64 }

// LayoutSpan is one layout of a Layouts.
type LayoutSpan struct{ B0, B1, E0, E1 int }

// Reset empties l, keeping its memory.
func (l *Layouts) Reset() {
	l.Bases, l.Entries, l.Spans = l.Bases[:0], l.Entries[:0], l.Spans[:0]
}

// Pieces returns how many descriptors the layouts of spans stand for and
// their bytes.
func (l *Layouts) Pieces(spans []LayoutSpan) (n int, bytes int64) {
	for _, s := range spans {
		var eb int64
		for _, e := range l.Entries[s.E0:s.E1] {
			eb += int64(e.Len)
		}
		n += (s.B1 - s.B0) * (s.E1 - s.E0)
		bytes += int64(s.B1-s.B0) * eb
	}
	return n, bytes
}

// Expand appends the descriptors the layouts of spans stand for.
func (l *Layouts) Expand(dst []Desc, spans []LayoutSpan) []Desc {
	for _, s := range spans {
		for _, b := range l.Bases[s.B0:s.B1] {
			for _, e := range l.Entries[s.E0:s.E1] {
				dst = append(dst, Desc{Local: b.Local + e.Local, Remote: b.Remote + e.Remote, Len: e.Len,
					LocalDev: b.LocalDev, RemoteDev: b.RemoteDev})
			}
		}
	}
	return dst
}

// AppendLayouts appends the layouts that move req's KV under plan p to
// dst (the same bytes, paired the same way, as AppendDescs; see Layouts).
// Steady-state calls allocate nothing beyond growth of dst. On error dst
// is left as it was.
func (b *Builder) AppendLayouts(dst *Layouts, p *topology.Plan, req *Request) error {
	if len(req.Src) != len(p.Groups) || len(req.Dst) != len(p.Groups) {
		return fmt.Errorf("%w: groups: src %d, dst %d, plan %d", ErrInvalidRequest, len(req.Src), len(req.Dst), len(p.Groups))
	}
	nb, ne, ns := len(dst.Bases), len(dst.Entries), len(dst.Spans)
	read := b.opts.Op == OpRead
	for g := range p.Groups {
		gp := &p.Groups[g]
		if err := b.groupRuns(gp, req, g); err != nil {
			dst.Bases, dst.Entries, dst.Spans = dst.Bases[:nb], dst.Entries[:ne], dst.Spans[:ns]
			return err
		}
		if len(b.runs) == 0 || len(gp.Regions) == 0 {
			continue
		}
		for r := 0; r < len(gp.Regions); {
			// A stretch of region pairs of r's shape: one layout.
			rp := &gp.Regions[r]
			e := r + 1
			for e < len(gp.Regions) && gp.Regions[e].SameShape(rp) {
				e++
			}
			b.scratch = slices.Grow(b.scratch[:0], gp.MaxDescs(len(b.runs), int(b.units)))
			switch {
			case b.opts.MaxRunBytes == 0 && len(rp.Segs) == 1 && (rp.Whole || gp.SrcUnits == 1 && gp.DstUnits == 1):
				b.scratch = b.appendSpans(b.scratch, gp.Regions[r:r+1])
			case rp.Whole:
				b.scratch = b.appendWhole(b.scratch, rp)
			default:
				b.scratch = b.appendSegs(b.scratch, gp, rp)
			}
			if len(b.scratch) > 0 {
				e0 := len(dst.Entries)
				for _, d := range b.scratch {
					le := LayoutEntry{Local: d.Local - rp.SrcBase, Remote: d.Remote - rp.DstBase, Len: d.Len}
					if read {
						le.Local, le.Remote = le.Remote, le.Local
					}
					dst.Entries = append(dst.Entries, le)
				}
				b0 := len(dst.Bases)
				for i := r; i < e; i++ {
					q := &gp.Regions[i]
					bp := BasePair{Local: q.SrcBase, Remote: q.DstBase, LocalDev: q.SrcDev, RemoteDev: q.DstDev}
					if read {
						bp.Local, bp.Remote, bp.LocalDev, bp.RemoteDev = bp.Remote, bp.Local, bp.RemoteDev, bp.LocalDev
					}
					dst.Bases = append(dst.Bases, bp)
				}
				dst.Spans = append(dst.Spans, LayoutSpan{B0: b0, B1: len(dst.Bases), E0: e0, E1: len(dst.Entries)})
			}
			r = e
		}
	}
	if invariants.Enabled {
		if err := b.verifyLayouts(dst, ns, p, req); err != nil {
			panic(err.Error())
		}
	}
	return nil
}

// verifyLayouts returns an error unless the layouts of dst from span ns
// expand to what AppendDescs gives for p and req.
func (b *Builder) verifyLayouts(dst *Layouts, ns int, p *topology.Plan, req *Request) error {
	other := &Builder{opts: b.opts}
	want, err := other.AppendDescs(nil, p, req)
	if err != nil {
		return fmt.Errorf("hotpath invariant: AppendLayouts succeeded where AppendDescs failed: %v", err)
	}
	got := dst.Expand(nil, dst.Spans[ns:])
	if !slices.Equal(got, want) {
		return fmt.Errorf("hotpath invariant: the layouts expand to %d descriptors, AppendDescs gives %d", len(got), len(want))
	}
	return nil
}
