package hotpath_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// CheckDistinct finds a block named twice in a group, whatever the list's
// length (pairwise, bitmap, or sorted copy for ids past the bitmap), names
// the group, both positions and the id, leaves negative ids to the range
// check, keeps nothing between calls (a later list with the same ids
// passes), and allocates nothing in steady state.
func TestCheckDistinct(t *testing.T) {
	b, err := hotpath.NewBuilder(hotpath.Options{Op: hotpath.OpRead})
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(7, 8))
	for _, n := range []int{2, 5, 16, 17, 100, 3000} {
		for _, hi := range []int{n, 1 << 20, 1<<31 - 1} {
			// n distinct ids in [0, hi).
			seen := map[topology.BlockID]bool{}
			var ids []topology.BlockID
			for len(ids) < n {
				id := topology.BlockID(rng.IntN(hi))
				if !seen[id] {
					seen[id] = true
					ids = append(ids, id)
				}
			}
			spans := []topology.Span{{IDs: []topology.BlockID{3, 4}}, {Start: 32, IDs: ids}}
			for range 2 { // twice: nothing is left marked
				if err := b.CheckDistinct(spans, "remote"); err != nil {
					t.Fatalf("n %d hi %d: distinct ids refused: %v", n, hi, err)
				}
			}
			i := rng.IntN(n - 1)
			j := i + 1 + rng.IntN(n-1-i)
			dup := append([]topology.BlockID(nil), ids...)
			dup[j] = dup[i]
			spans[1].IDs = dup
			err := b.CheckDistinct(spans, "remote")
			want := fmt.Sprintf("remote group 1 block %d: id %d, the same block as block %d", j, dup[i], i)
			if !errors.Is(err, hotpath.ErrInvalidRequest) || !strings.Contains(err.Error(), want) {
				t.Fatalf("n %d hi %d: CheckDistinct = %v, want ErrInvalidRequest naming %q", n, hi, err, want)
			}
			// The refusal left nothing marked either.
			spans[1].IDs = ids
			if err := b.CheckDistinct(spans, "remote"); err != nil {
				t.Fatalf("n %d hi %d: distinct ids refused after a refusal: %v", n, hi, err)
			}
			if allocs := testing.AllocsPerRun(5, func() { _ = b.CheckDistinct(spans, "remote") }); allocs != 0 {
				t.Errorf("n %d hi %d: CheckDistinct allocates %v times per call", n, hi, allocs)
			}
		}
	}
	// Negative ids are the range check's: never reported as repeats, and
	// never index the bitmap.
	neg := make([]topology.BlockID, 40)
	for i := range neg {
		neg[i] = -1
	}
	if err := b.CheckDistinct([]topology.Span{{IDs: neg}, {IDs: neg[:3]}}, "src"); err != nil {
		t.Errorf("negative ids: %v, want them left to the range check", err)
	}
}
