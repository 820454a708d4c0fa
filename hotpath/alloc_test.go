package hotpath_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/bench/shapes"
	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/invariants"
)

// TestAppendDescsZeroAllocs: after one warm-up call sizes the builder's
// scratch and the caller's slice, building descriptors allocates nothing,
// on every benchmark shape, for writes and reads, with and without a cap.
func TestAppendDescsZeroAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under -race")
	}
	if invariants.Enabled {
		t.Skip("-tags invariants cross-checks every call against the allocating reference")
	}
	all, err := shapes.All()
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range all {
		for _, opts := range []hotpath.Options{{Op: hotpath.OpWrite}, {Op: hotpath.OpRead, MaxRunBytes: 1 << 20}} {
			b, err := hotpath.NewBuilder(opts)
			if err != nil {
				t.Fatal(err)
			}
			dst, err := b.AppendDescs(nil, s.Plan, s.Req)
			if err != nil {
				t.Fatal(err)
			}
			idx, err := b.AppendIndices(nil, s.Plan, s.Req)
			if err != nil {
				t.Fatal(err)
			}
			allocs := testing.AllocsPerRun(5, func() {
				dst, _ = b.AppendDescs(dst[:0], s.Plan, s.Req)
				idx, _ = b.AppendIndices(idx[:0], s.Plan, s.Req)
			})
			if allocs != 0 {
				t.Errorf("%s %v: AppendDescs+AppendIndices allocated %.1f times per call, want 0", s.Name, opts.Op, allocs)
			}
		}
	}
}

// TestFreshOneDescPerRunPerRegion: on fresh (contiguous) ids the builder
// emits exactly one descriptor per run per region when a unit is a whole
// block on both sides (equal TP, MLA fan-out), and one per block per
// region under hetero TP, where a head slice is not contiguous with the
// next block's on the sliced side.
func TestFreshOneDescPerRunPerRegion(t *testing.T) {
	all, err := shapes.All()
	if err != nil {
		t.Fatal(err)
	}
	b, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	for _, s := range all {
		if s.Req.Src[0].IDs[1] != s.Req.Src[0].IDs[0]+1 { // fragmented
			continue
		}
		checked++
		got, err := b.AppendDescs(nil, s.Plan, s.Req)
		if err != nil {
			t.Fatal(err)
		}
		regions := len(s.Plan.Groups[0].Regions)
		want := regions // one run
		if !s.Plan.Groups[0].Regions[0].Whole {
			g := s.Plan.Groups[0]
			units := (s.Req.Tokens + g.UnitTokens - 1) / g.UnitTokens
			want = regions * units
		}
		if len(got) != want {
			t.Errorf("%s: %d descriptors, want %d", s.Name, len(got), want)
		}
	}
	if checked == 0 {
		t.Fatal("no fresh shapes")
	}
}
