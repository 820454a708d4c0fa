package kvxfer

import (
	"errors"
	"fmt"
	"slices"
)

// Aggregator folds the Finished sets of an engine's ranks into one per
// request: the engine's scheduler hears of a request only once every rank
// reported it (SPEC §1: the reference's KVOutputAggregator), with the
// worst result over the ranks. Each request is emitted exactly once per
// side.
//
// An Aggregator is not safe for concurrent use.
type Aggregator struct {
	world int
	send  map[string]*agg
	recv  map[string]*agg
}

type agg struct {
	ranks []bool
	seen  int
	worst Outcome
}

// NewAggregator returns an aggregator over world ranks.
func NewAggregator(world int) (*Aggregator, error) {
	if world <= 0 {
		return nil, fmt.Errorf("kvxfer: NewAggregator: world = %d, want > 0", world)
	}
	return &Aggregator{world: world, send: map[string]*agg{}, recv: map[string]*agg{}}, nil
}

// severity orders results: one failed rank fails the request.
func severity(r Result) int {
	switch r {
	case ResultFailed:
		return 4
	case ResultExpired:
		return 3
	case ResultAborted:
		return 2
	case ResultDone:
		return 1
	}
	return 0
}

// Add takes one rank's Finished and returns the requests every rank has
// now reported (nil when none). A rank reporting a request twice, or a
// rank out of range, is an error naming it; the rest of f still counts.
func (a *Aggregator) Add(rank int, f *Finished) (*Finished, error) {
	if rank < 0 || rank >= a.world {
		return nil, fmt.Errorf("kvxfer: aggregate: rank %d, want 0..%d", rank, a.world-1)
	}
	if f == nil {
		return nil, nil
	}
	out := &Finished{}
	var errs []error
	fold := func(m map[string]*agg, os []Outcome, side string) []Outcome {
		var done []Outcome
		for _, o := range os {
			g := m[o.ReqID]
			if g == nil {
				g = &agg{ranks: make([]bool, a.world)}
				m[o.ReqID] = g
			}
			if g.ranks[rank] {
				errs = append(errs, fmt.Errorf("kvxfer: aggregate: rank %d reported %s request %q twice", rank, side, o.ReqID))
				continue
			}
			g.ranks[rank] = true
			g.seen++
			if severity(o.Result) > severity(g.worst.Result) {
				g.worst = o
			}
			if g.seen == a.world {
				done = append(done, g.worst)
				delete(m, o.ReqID)
			}
		}
		return done
	}
	out.Sending = fold(a.send, f.Sending, "sending")
	out.Recving = fold(a.recv, f.Recving, "receiving")
	seen := map[int32]bool{}
	for _, b := range f.InvalidBlocks {
		if !seen[int32(b)] {
			seen[int32(b)] = true
			out.InvalidBlocks = append(out.InvalidBlocks, b)
		}
	}
	slices.Sort(out.InvalidBlocks)
	err := errors.Join(errs...)
	if len(out.Sending)+len(out.Recving)+len(out.InvalidBlocks) == 0 {
		return nil, err
	}
	return out, err
}

// Pending returns how many requests wait for more ranks.
func (a *Aggregator) Pending() int { return len(a.send) + len(a.recv) }
