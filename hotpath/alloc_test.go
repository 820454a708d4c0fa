package hotpath_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/bench/shapes"
	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/invariants"
)

// TestAppendDescsZeroAllocs: after one warm-up call sizes the builder's
// scratch and the caller's slices, building descriptors and prepared-list
// indices allocates nothing, on every benchmark shape, for writes and for
// capped reads.
func TestAppendDescsZeroAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under -race")
	}
	if invariants.Enabled {
		t.Skip("-tags invariants cross-checks every call against the allocating reference")
	}
	all, err := shapes.All()
	if err != nil {
		t.Fatalf("shapes.All() error: %v", err)
	}
	opts := []struct {
		name string
		opts hotpath.Options
	}{
		{"write", hotpath.Options{Op: hotpath.OpWrite}},
		{"read_capped_1MiB", hotpath.Options{Op: hotpath.OpRead, MaxRunBytes: 1 << 20}},
	}
	for _, s := range all {
		for _, o := range opts {
			t.Run(s.Name+"/"+o.name, func(t *testing.T) {
				b, err := hotpath.NewBuilder(o.opts)
				if err != nil {
					t.Fatalf("NewBuilder(%+v) error: %v", o.opts, err)
				}
				dst, err := b.AppendDescs(nil, s.Plan, s.Req)
				if err != nil {
					t.Fatalf("AppendDescs(nil) error: %v", err)
				}
				idx, err := b.AppendIndices(nil, s.Plan, s.Req)
				if err != nil {
					t.Fatalf("AppendIndices(nil) error: %v", err)
				}
				var lays hotpath.Layouts
				if err := b.AppendLayouts(&lays, s.Plan, s.Req); err != nil {
					t.Fatalf("AppendLayouts error: %v", err)
				}
				var callErr error
				allocs := testing.AllocsPerRun(5, func() {
					if dst, callErr = b.AppendDescs(dst[:0], s.Plan, s.Req); callErr != nil {
						return
					}
					if idx, callErr = b.AppendIndices(idx[:0], s.Plan, s.Req); callErr != nil {
						return
					}
					lays.Reset()
					callErr = b.AppendLayouts(&lays, s.Plan, s.Req)
				})
				if callErr != nil {
					t.Fatalf("steady-state call error: %v", callErr)
				}
				if allocs != 0 {
					t.Errorf("AppendDescs+AppendIndices+AppendLayouts(reused slices) = %.1f allocs per call, want 0", allocs)
				}
			})
		}
	}
}

// TestFreshOneDescPerRunPerRegion: on fresh (consecutive) ids the request
// is one run, and the builder emits exactly one descriptor per region where
// a unit is a whole block on both sides (equal TP, MLA fan-out). Under a TP
// mismatch (HND) the source's head slice is not contiguous with the next
// block's, so nothing can merge: one descriptor per kernel block per
// region, the reference's count.
func TestFreshOneDescPerRunPerRegion(t *testing.T) {
	all, err := shapes.All()
	if err != nil {
		t.Fatalf("shapes.All() error: %v", err)
	}
	checked := 0
	for _, s := range all {
		if s.Fragmented {
			continue
		}
		checked++
		t.Run(s.Name, func(t *testing.T) {
			b, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpWrite})
			if err != nil {
				t.Fatalf("NewBuilder error: %v", err)
			}
			got, err := b.AppendDescs(nil, s.Plan, s.Req)
			if err != nil {
				t.Fatalf("AppendDescs error: %v", err)
			}
			g := s.Plan.Groups[0]
			want := len(g.Regions) // one run
			if !g.Regions[0].Whole {
				units := (s.Tokens + g.UnitTokens - 1) / g.UnitTokens
				want = len(g.Regions) * units
			}
			if len(got) != want {
				t.Errorf("len(AppendDescs(%s)) = %d, want %d (%d regions, whole units %v)",
					s.Name, len(got), want, len(g.Regions), g.Regions[0].Whole)
			}
		})
	}
	if checked == 0 {
		t.Fatal("shapes.All() has no fresh shapes")
	}
}
