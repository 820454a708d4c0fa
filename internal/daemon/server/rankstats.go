package server

import (
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// A rank's statistics outlive its worker: each rank (engine, pp, tp) has
// one kvxfer.Metrics, which every worker attached for it records into, so
// that its counters go on from one attach to the next, and what its
// worker counted while it closed (the outcomes of the requests it held,
// worker_closed) is still exported after the rank detached. A rank
// detached is kept KeepDetachedStats, and at most MaxDetachedStats of
// them (the oldest go first): engine ids are the engines' to choose, and
// what they leave behind is bounded.
const (
	KeepDetachedStats = 10 * time.Minute
	MaxDetachedStats  = 256
)

// RankStats is one rank's statistics: those of every worker attached for
// it, the one attached now included (Attached).
type RankStats struct {
	Engine         string
	TPRank, PPRank int
	Attached       bool
	Stats          kvxfer.Stats
}

type rankStats struct {
	mu  sync.Mutex
	m   map[rankKey]*rankStat
	now func() time.Time
}

type rankStat struct {
	m        *kvxfer.Metrics
	attached int       // workers holding m
	gone     time.Time // when the last of them let go (attached == 0)
}

// acquire returns the Metrics of rank k for a worker of it.
func (r *rankStats) acquire(k rankKey) *kvxfer.Metrics {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.m == nil {
		r.m = map[rankKey]*rankStat{}
	}
	st := r.m[k]
	if st == nil {
		st = &rankStat{m: kvxfer.NewMetrics()}
		r.m[k] = st
	}
	st.attached++
	return st.m
}

// release says a worker of rank k, which acquired its Metrics, ended:
// it records into them no more.
func (r *rankStats) release(k rankKey) {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := r.m[k]
	if st == nil {
		return
	}
	if st.attached--; st.attached <= 0 {
		st.attached, st.gone = 0, r.clock()
	}
	r.pruneLocked()
}

func (r *rankStats) clock() time.Time {
	if r.now != nil {
		return r.now()
	}
	return time.Now()
}

// pruneLocked forgets ranks detached KeepDetachedStats ago, and the
// oldest detached past MaxDetachedStats.
func (r *rankStats) pruneLocked() {
	now, detached := r.clock(), 0
	for k, st := range r.m {
		switch {
		case st.attached > 0:
		case now.Sub(st.gone) >= KeepDetachedStats:
			delete(r.m, k)
		default:
			detached++
		}
	}
	for ; detached > MaxDetachedStats; detached-- {
		var oldest rankKey
		var at time.Time
		for k, st := range r.m {
			if st.attached == 0 && (at.IsZero() || st.gone.Before(at)) {
				oldest, at = k, st.gone
			}
		}
		delete(r.m, oldest)
	}
}

// snapshot returns every rank's statistics kept.
func (r *rankStats) snapshot() []RankStats {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pruneLocked()
	out := make([]RankStats, 0, len(r.m))
	for k, st := range r.m {
		out = append(out, RankStats{Engine: k.engine, TPRank: k.tp, PPRank: k.pp, Attached: st.attached > 0, Stats: st.m.Snapshot()})
	}
	return out
}

// RankStats returns the statistics of every rank attached, and of those
// detached within KeepDetachedStats (at most MaxDetachedStats of them),
// for metrics: a rank's counters carry on over its detach and its next
// attach.
func (s *Server) RankStats() []RankStats { return s.stats.snapshot() }
