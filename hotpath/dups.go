package hotpath

import (
	"slices"

	"github.com/kvxfer/kvxfer/topology"
)

// maxSeenBits bounds Dups's bitmap (2 MiB): a list holding a
// larger id is checked on a sorted copy instead.
const maxSeenBits = 1 << 24

// Dups finds a block named twice in a list: the scratch it keeps (a
// bitmap of ids, all clear between calls, and a sorted copy for lists of
// very large ids) is reused, so steady-state calls allocate nothing. The
// zero value is ready; it is not safe for concurrent use.
type Dups struct {
	seen   []uint64
	sorted []topology.BlockID
}

// Repeated returns the positions i < j of the first id of ids that
// repeats an earlier one (-1, -1: none); negative ids are not compared.
// Short lists are compared pairwise, longer ones marked in a bitmap of
// ids (or, past maxSeenBits, checked on a sorted copy).
func (d *Dups) Repeated(ids []topology.BlockID) (int, int) {
	if len(ids) <= 16 {
		for j := 1; j < len(ids); j++ {
			for i := range j {
				if ids[i] == ids[j] && ids[i] >= 0 {
					return i, j
				}
			}
		}
		return -1, -1
	}
	var hi topology.BlockID
	for _, id := range ids {
		hi = max(hi, id)
	}
	if int64(hi) >= maxSeenBits {
		// Too large for the bitmap: sort a copy, then find the first
		// repeat's positions.
		d.sorted = append(d.sorted[:0], ids...)
		slices.Sort(d.sorted)
		for k := 1; k < len(d.sorted); k++ {
			if v := d.sorted[k]; v == d.sorted[k-1] && v >= 0 {
				i := slices.Index(ids, v)
				return i, i + 1 + slices.Index(ids[i+1:], v)
			}
		}
		return -1, -1
	}
	if words := int(hi)/64 + 1; len(d.seen) < words {
		d.seen = slices.Grow(d.seen[:0], words)[:words]
		clear(d.seen)
	}
	seen := d.seen
	at := -1
	for j, id := range ids {
		if id < 0 {
			continue
		}
		w, bit := id/64, uint64(1)<<(id%64)
		if seen[w]&bit != 0 {
			at = j
			break
		}
		seen[w] |= bit
	}
	end := len(ids)
	if at >= 0 {
		end = at
	}
	for _, id := range ids[:end] {
		if id >= 0 {
			seen[id/64] = 0
		}
	}
	if at < 0 {
		return -1, -1
	}
	return slices.Index(ids, ids[at]), at
}
