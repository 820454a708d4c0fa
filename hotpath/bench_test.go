package hotpath_test

import (
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/bench/shapes"
	"github.com/kvxfer/kvxfer/hotpath"
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
func BenchmarkAppendDescs(b *testing.B) {
	for _, s := range benchShapes(b) {
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

// writeDescs is the memory-write limit: n descriptors written with
// trivial arithmetic and no mapping logic, field by field into a slice
// grown once (the fastest store pattern measured; a composite-literal
// append is 1.7x slower on the reference machine).
//
//go:noinline
func writeDescs(dst []hotpath.Desc, n int, l uint64) []hotpath.Desc {
	a, r := uint64(1)<<44, uint64(2)<<44
	start := len(dst)
	dst = slices.Grow(dst, n)[:start+n]
	out := dst[start:]
	for i := range out {
		o := &out[i]
		o.Local, o.Remote, o.Len, o.LocalDev, o.RemoteDev = a, r, l, 0, 0
		a += l
		r += l
	}
	return dst
}

// BenchmarkBaseline writes as many descriptors as the optimised builder
// emits for the shape.
func BenchmarkBaseline(b *testing.B) {
	for _, s := range benchShapes(b) {
		b.Run(s.Name, func(b *testing.B) {
			opt, ref := counts(b, s)
			dst := make([]hotpath.Desc, 0, ref)
			b.ReportAllocs()
			for b.Loop() {
				dst = writeDescs(dst[:0], opt, 4096)
			}
			report(b, opt, opt)
		})
	}
}

// BenchmarkBaselineUncoalesced writes as many descriptors as the reference
// (one per unit per segment per region) emits for the shape: the bytes of
// the uncoalesced descriptor list.
func BenchmarkBaselineUncoalesced(b *testing.B) {
	for _, s := range benchShapes(b) {
		b.Run(s.Name, func(b *testing.B) {
			_, ref := counts(b, s)
			dst := make([]hotpath.Desc, 0, ref)
			b.ReportAllocs()
			for b.Loop() {
				dst = writeDescs(dst[:0], ref, 4096)
			}
			report(b, ref, ref)
		})
	}
}
