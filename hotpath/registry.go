package hotpath

import (
	"fmt"

	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvxfer/kvxfer/topology"
)

// RankKey names one rank of one peer engine at one handshake generation.
type RankKey struct {
	Peer       string
	Generation uint64
	TPRank     int
	PPRank     int
}

// PlanKey names the plan between a source rank and a destination rank of
// a peer pairing. Peer and Generation identify the remote engine's
// handshake; the ranks identify both ends.
type PlanKey struct {
	Peer       string
	Generation uint64
	SrcTPRank  int
	SrcPPRank  int
	DstTPRank  int
}

// Registry holds what the hot path reads concurrently: the region tables
// (layouts) of peer ranks and the plans computed from them. Reads are
// lock-free; a plan is computed once per key and reused.
//
// A Registry is safe for concurrent use. Stored layouts and plans are
// immutable: never modify one after storing it.
type Registry struct {
	layouts *xsync.Map[RankKey, *topology.Layout]
	plans   *xsync.Map[PlanKey, *topology.Plan]
}

// NewRegistry returns an empty Registry.
func NewRegistry() *Registry {
	return &Registry{
		layouts: xsync.NewMap[RankKey, *topology.Layout](),
		plans:   xsync.NewMap[PlanKey, *topology.Plan](),
	}
}

// StoreLayout validates and records a peer rank's layout, replacing an
// earlier one for the same key. Plans of that peer and generation are
// dropped, since they were computed from the old table.
func (r *Registry) StoreLayout(k RankKey, l *topology.Layout) error {
	if err := l.Validate(); err != nil {
		return fmt.Errorf("hotpath: layout of %s gen %d rank %d/%d: %w", k.Peer, k.Generation, k.TPRank, k.PPRank, err)
	}
	r.layouts.Store(k, l)
	r.plans.Range(func(pk PlanKey, _ *topology.Plan) bool {
		if pk.Peer == k.Peer && pk.Generation == k.Generation {
			r.plans.Delete(pk)
		}
		return true
	})
	return nil
}

// Layout returns a peer rank's layout.
func (r *Registry) Layout(k RankKey) (*topology.Layout, bool) {
	return r.layouts.Load(k)
}

// Plan returns the plan for k, computing it with build on first use.
// Concurrent callers for the same key wait for one build. A failed build
// is not cached.
func (r *Registry) Plan(k PlanKey, build func() (*topology.Plan, error)) (*topology.Plan, error) {
	if p, ok := r.plans.Load(k); ok {
		return p, nil
	}
	var buildErr error
	p, _ := r.plans.LoadOrCompute(k, func() (*topology.Plan, bool) {
		p, err := build()
		if err != nil {
			buildErr = err
			return nil, true
		}
		return p, false
	})
	if buildErr != nil {
		return nil, buildErr
	}
	return p, nil
}

// DropPeer forgets every layout and plan of a peer (all generations), as
// on engine eviction. It returns how many entries it removed.
func (r *Registry) DropPeer(peer string) int {
	n := 0
	r.layouts.Range(func(k RankKey, _ *topology.Layout) bool {
		if k.Peer == peer {
			r.layouts.Delete(k)
			n++
		}
		return true
	})
	r.plans.Range(func(k PlanKey, _ *topology.Plan) bool {
		if k.Peer == peer {
			r.plans.Delete(k)
			n++
		}
		return true
	})
	return n
}

// DropGeneration forgets a peer's entries older than gen, as when a peer
// restarts and handshakes again.
func (r *Registry) DropGeneration(peer string, gen uint64) int {
	n := 0
	r.layouts.Range(func(k RankKey, _ *topology.Layout) bool {
		if k.Peer == peer && k.Generation < gen {
			r.layouts.Delete(k)
			n++
		}
		return true
	})
	r.plans.Range(func(k PlanKey, _ *topology.Plan) bool {
		if k.Peer == peer && k.Generation < gen {
			r.plans.Delete(k)
			n++
		}
		return true
	})
	return n
}
