package hotpath_test

import (
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/bench/shapes"
	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

func benchShapes(b *testing.B) []*shapes.Shape {
	b.Helper()
	all, err := shapes.All()
	if err != nil {
		b.Fatal(err)
	}
	return all
}

// counts returns the optimised and the reference (uncoalesced) descriptor
// counts of a shape.
func counts(tb testing.TB, s *shapes.Shape) (opt, ref int) {
	tb.Helper()
	bl, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
	if err != nil {
		tb.Fatal(err)
	}
	o, err := bl.AppendDescs(nil, s.Plan, s.Req)
	if err != nil {
		tb.Fatal(err)
	}
	r, err := hotpath.AppendReference(nil, s.Plan, s.Req, hotpath.OpWrite)
	if err != nil {
		tb.Fatal(err)
	}
	return len(o), len(r)
}

func report(b *testing.B, descs, units int) {
	per := float64(b.Elapsed().Nanoseconds()) / float64(b.N)
	b.ReportMetric(per/float64(descs), "ns/desc")
	b.ReportMetric(float64(descs), "descs/op")
	b.ReportMetric(float64(units), "units/op")
	b.ReportMetric(float64(units)/float64(descs), "coalesce")
}

// BenchmarkAppendDescs measures the optimised builder on every shape.
func BenchmarkAppendDescs(b *testing.B) { benchAppendDescs(b, benchShapes(b)) }

// benchAppendDescs times Builder.AppendDescs on each shape.
func benchAppendDescs(b *testing.B, list []*shapes.Shape) {
	for _, s := range list {
		b.Run(s.Name, func(b *testing.B) {
			opt, ref := counts(b, s)
			bl, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
			if err != nil {
				b.Fatal(err)
			}
			dst := make([]hotpath.Desc, 0, ref)
			b.SetBytes(s.Bytes)
			b.ReportAllocs()
			for b.Loop() {
				dst, err = bl.AppendDescs(dst[:0], s.Plan, s.Req)
				if err != nil {
					b.Fatal(err)
				}
			}
			report(b, opt, ref)
		})
	}
}

// BenchmarkReference measures the plain reference builder (allocating,
// uncoalesced), for scale.
func BenchmarkReference(b *testing.B) {
	for _, s := range benchShapes(b) {
		b.Run(s.Name, func(b *testing.B) {
			_, ref := counts(b, s)
			dst := make([]hotpath.Desc, 0, ref)
			var err error
			b.ReportAllocs()
			for b.Loop() {
				dst, err = hotpath.AppendReference(dst[:0], s.Plan, s.Req, hotpath.OpWrite)
				if err != nil {
					b.Fatal(err)
				}
			}
			report(b, ref, ref)
		})
	}
}

// BenchmarkBaseline writes as many descriptors as the optimised builder
// emits for the shape.
func BenchmarkBaseline(b *testing.B) {
	benchBaseline(b, func(opt, _ int) int { return opt })
}

// BenchmarkBaselineUncoalesced writes as many descriptors as the reference
// (one per unit per segment per region) emits for the shape: the bytes of
// the uncoalesced descriptor list.
func BenchmarkBaselineUncoalesced(b *testing.B) {
	benchBaseline(b, func(_, ref int) int { return ref })
}

// benchBaseline times shapes.WriteBaseline for the descriptor count that
// count picks from (optimised, reference) on every shape.
func benchBaseline(b *testing.B, count func(opt, ref int) int) {
	for _, s := range benchShapes(b) {
		b.Run(s.Name, func(b *testing.B) {
			n := count(counts(b, s))
			dst := make([]hotpath.Desc, 0, n)
			b.ReportAllocs()
			for b.Loop() {
				dst = shapes.WriteBaseline(dst[:0], n, 4096)
			}
			report(b, n, n)
		})
	}
}

// scattered returns a copy of a shape whose regions lie at uneven gaps on
// both sides (each layer allocated on its own), so no region pair repeats
// the one before it at the same step as the one before that.
func scattered(b *testing.B, s *shapes.Shape) *shapes.Shape {
	b.Helper()
	out := *s
	move := func(l *topology.Layout) *topology.Layout {
		c := *l
		c.Regions = slices.Clone(l.Regions)
		for i := range c.Regions {
			c.Regions[i].Base += uint64(i*i) << 12
		}
		return &c
	}
	out.Src, out.Dst = move(s.Src), move(s.Dst)
	p, err := topology.NewPlan(out.Src, out.Dst, topology.PlanOptions{})
	if err != nil {
		b.Fatal(err)
	}
	out.Plan = p
	return &out
}

// BenchmarkScattered is BenchmarkAppendDescs with every region at its own
// gap (scattered): no region pair repeats another in memory twice.
func BenchmarkScattered(b *testing.B) {
	var ss []*shapes.Shape
	for _, s := range benchShapes(b) {
		ss = append(ss, scattered(b, s))
	}
	benchAppendDescs(b, ss)
}

// BenchmarkAppendLayouts measures Builder.AppendLayouts (a base pair per
// region pair, an entry per descriptor of a stretch's first) on every
// shape, scattered as BenchmarkScattered's; ns per descriptor the
// layouts stand for, to compare with AppendDescs'.
func BenchmarkAppendLayouts(b *testing.B) {
	for _, s := range benchShapes(b) {
		s := scattered(b, s)
		b.Run(s.Name, func(b *testing.B) {
			bl, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
			if err != nil {
				b.Fatal(err)
			}
			var lays hotpath.Layouts
			if err := bl.AppendLayouts(&lays, s.Plan, s.Req); err != nil {
				b.Fatal(err)
			}
			pieces, _ := lays.Pieces(lays.Spans)
			b.ReportAllocs()
			for b.Loop() {
				lays.Reset()
				if err := bl.AppendLayouts(&lays, s.Plan, s.Req); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(max(pieces, 1)), "ns/desc")
			b.ReportMetric(float64(len(lays.Bases)+len(lays.Entries)), "words/op")
		})
	}
}

// BenchmarkAppendIndices measures Builder.AppendIndices (prepared lists:
// one index pair per reference descriptor) on every shape; ns per pair.
func BenchmarkAppendIndices(b *testing.B) {
	for _, s := range benchShapes(b) {
		b.Run(s.Name, func(b *testing.B) {
			bl, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
			if err != nil {
				b.Fatal(err)
			}
			dst, err := bl.AppendIndices(nil, s.Plan, s.Req)
			if err != nil {
				b.Fatal(err)
			}
			pairs := len(dst)
			b.ReportAllocs()
			for b.Loop() {
				if dst, err = bl.AppendIndices(dst[:0], s.Plan, s.Req); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(pairs), "ns/pair")
			b.ReportMetric(float64(pairs), "pairs/op")
		})
	}
}
