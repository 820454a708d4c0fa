package kvxfer_test

import (
	"math/rand/v2"
	"strconv"
	"testing"
	"testing/synctest"

	"github.com/kvxfer/kvxfer/topology"
)

// sweepLists gives a request block lists an engine may hand over that are
// not exactly what its tokens need: more blocks than its tokens fill on
// P, on D or both (taken from the pools: blocks past the tokens on D must
// stay untouched, those on P must not be sent), and a D list short of
// the tokens (D receives only what its list holds; its other blocks stay
// untouched). Sliding-window lists are not shortened (their window is
// anchored at the list's end), Mamba state is left alone.
func sweepLists(rng *rand.Rand, _ int, q *xreq, groups []topology.Group, pp, dp *blockPool) {
	what := rng.IntN(8)
	for g, grp := range groups {
		if grp.Kind == topology.KindMamba {
			continue
		}
		if what&1 != 0 {
			q.sim.P[g].IDs = append(q.sim.P[g].IDs, pp.take(g, 1+rng.IntN(2))...)
		}
		if what&4 != 0 && grp.Kind != topology.KindSlidingWindow && len(q.sim.D[g].IDs) > 1 {
			q.sim.D[g].IDs = q.sim.D[g].IDs[:len(q.sim.D[g].IDs)-1]
		}
		if what&2 != 0 && len(q.sim.D[g].IDs) > 0 {
			q.sim.D[g].IDs = append(q.sim.D[g].IDs, dp.take(g, 1+rng.IntN(2))...)
		}
	}
}

// TestByteSweepLists is TestByteSweep with block lists longer than the
// tokens need on either side and D lists short of them (sweepLists), and
// with coalesced runs cut at a cap (WorkerConfig.MaxRunBytes) for a
// third, with block ids handed out in order half the time, so consecutive
// requests' blocks are adjacent on both engines (a run may not coalesce
// past a request's end), over the fake fabric and, for a third of the
// cases, the built-in backend's TCP and same-host GPU paths. Every other
// sweep hands each request exactly the blocks its tokens fill: pairing
// bounded by P's list and the tokens but not D's list (topology Align)
// passed TestByteSweep, TestByteSweepNet and TestEndToEnd; here a D list
// short of the tokens catches it.
func TestByteSweepLists(t *testing.T) {
	n, seed := sweepSize(t, 40, 12)
	rng := rand.New(rand.NewPCG(seed, 0x11575))
	for i := range n {
		c := sweepRandomCase(rng)
		c.p.Blocks += 3 * c.n
		c.d.Blocks += 3 * c.n
		c.lists = sweepLists
		c.contiguous = rng.IntN(2) == 0
		if rng.IntN(3) == 0 {
			// Coalesced runs cut at a cap (WorkerConfig.MaxRunBytes),
			// often inside a block.
			c.maxRun = pick(rng, int64(24), int64(100), int64(1000))
		}
		caseSeed := rng.Uint64()
		var ok bool
		if rng.IntN(3) == 0 {
			c.backend = pick(rng, "tcp", "gpu")
			ok = t.Run(strconv.Itoa(i), func(t *testing.T) { runSweep(t, c, caseSeed) })
		} else {
			ok = t.Run(strconv.Itoa(i), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) { runSweep(t, c, caseSeed) })
			})
		}
		if !ok {
			t.Fatalf("case %d (seed %d): %s", i, seed, c)
		}
	}
}
