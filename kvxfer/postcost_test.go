package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

func TestPostCostPrepared(t *testing.T) {
	// A post of the NIXL backend's default kind on this machine: posting
	// dominates, so only a request that coalesces (almost) nothing goes
	// prepared.
	nixlLike := kvxfer.PostCost{Fixed: 23 * time.Microsecond, PerDesc: 2040 * time.Nanosecond,
		PreparedFixed: 21300 * time.Nanosecond, PerPair: 2020 * time.Nanosecond}
	// Cheap posting (RDMA-like): creation dominates, and a prepared entry
	// costs half a descriptor.
	cheap := kvxfer.PostCost{Fixed: 3 * time.Microsecond, PerDesc: 40, PreparedFixed: time.Microsecond, PerPair: 20}
	for _, tc := range []struct {
		name         string
		cost         kvxfer.PostCost
		descs, pairs int
		want         bool
		reason       string
	}{
		{"fragmented", nixlLike, 10240, 10240, true, "nothing coalesced: the cheaper entries win"},
		{"fresh", nixlLike, 80, 10240, false, "long runs: 128x fewer descriptors"},
		{"slightly coalesced", nixlLike, 10000, 10240, false, "2% fewer descriptors outweigh the cheaper entries"},
		{"tiny", nixlLike, 1, 1, true, "the prepared fixed cost is lower"},
		{"empty", nixlLike, 0, 0, true, "ties go prepared"},
		{"cheap half", cheap, 5000, 10240, false, "more than twice the pairs"},
		{"cheap under half", cheap, 5200, 10240, true, "under twice the pairs"},
		{"zero model", kvxfer.PostCost{}, 1, 100, true, "no costs: ties go prepared"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.cost.Prepared(tc.descs, tc.pairs); got != tc.want {
				t.Errorf("%+v.Prepared(%d, %d) = %v, want %v (%s)", tc.cost, tc.descs, tc.pairs, got, tc.want, tc.reason)
			}
		})
	}
}
