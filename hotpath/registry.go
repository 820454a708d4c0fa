package hotpath

import (
	"fmt"
	"maps"

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

// Registry holds a Worker's tables of peer ranks: their layouts and the
// plans computed from them, a plan computed once per key and reused.
//
// A Registry is owned by one goroutine (a Worker's loop): it is not safe
// for concurrent use, and needs no lock. Stored layouts and plans are
// immutable: never modify one after storing it.
type Registry struct {
	layouts map[RankKey]*topology.Layout
	plans   map[PlanKey]*topology.Plan
}

// NewRegistry returns an empty Registry.
func NewRegistry() *Registry {
	return &Registry{layouts: map[RankKey]*topology.Layout{}, plans: map[PlanKey]*topology.Plan{}}
}

// StoreLayout validates and records a peer rank's layout, replacing an
// earlier one for the same key. Plans of that peer and generation are
// dropped, since they were computed from the old table.
func (r *Registry) StoreLayout(k RankKey, l *topology.Layout) error {
	if err := l.Validate(); err != nil {
		return fmt.Errorf("hotpath: layout of %s gen %d rank %d/%d: %w", k.Peer, k.Generation, k.TPRank, k.PPRank, err)
	}
	r.layouts[k] = l
	maps.DeleteFunc(r.plans, func(pk PlanKey, _ *topology.Plan) bool { return pk.Peer == k.Peer && pk.Generation == k.Generation })
	return nil
}

// Layout returns a peer rank's layout.
func (r *Registry) Layout(k RankKey) (*topology.Layout, bool) {
	l, ok := r.layouts[k]
	return l, ok
}

// Plan returns the plan for k, computing it with build on first use. A
// failed build is not cached.
func (r *Registry) Plan(k PlanKey, build func() (*topology.Plan, error)) (*topology.Plan, error) {
	if p, ok := r.plans[k]; ok {
		return p, nil
	}
	p, err := build()
	if err != nil {
		return nil, err
	}
	r.plans[k] = p
	return p, nil
}

// DropPeer forgets every layout and plan of a peer (all generations), as
// on engine eviction. It returns how many entries it removed.
func (r *Registry) DropPeer(peer string) int {
	return r.drop(func(p string, _ uint64) bool { return p == peer })
}

// DropGeneration forgets a peer's entries older than gen, as when a peer
// restarts and handshakes again.
func (r *Registry) DropGeneration(peer string, gen uint64) int {
	return r.drop(func(p string, g uint64) bool { return p == peer && g < gen })
}

func (r *Registry) drop(match func(peer string, gen uint64) bool) int {
	n := len(r.layouts) + len(r.plans)
	maps.DeleteFunc(r.layouts, func(k RankKey, _ *topology.Layout) bool { return match(k.Peer, k.Generation) })
	maps.DeleteFunc(r.plans, func(k PlanKey, _ *topology.Plan) bool { return match(k.Peer, k.Generation) })
	return n - len(r.layouts) - len(r.plans)
}
