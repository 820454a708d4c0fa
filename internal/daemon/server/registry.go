package server

import (
	"cmp"
	"maps"
	"slices"
)

// What a registry (kvxferd -etcd) publishes about the engines a server
// serves, and how it tells their workers about peers it watches.

// PublishedEngine is one attached engine as a registry publishes it: the
// handshake's generation and the ranks attached here.
type PublishedEngine struct {
	EngineID, Mode, CompatHash string
	TPSize, PPSize             int
	Generation                 uint64
	Ranks                      [][2]int // (tp, pp), sorted
}

// Published returns the attached engines, ordered by id.
func (s *Server) Published() []PublishedEngine {
	var out []PublishedEngine
	s.engines.Range(func(id string, e *engineEntry) bool {
		pe := PublishedEngine{EngineID: id, Generation: e.gen}
		for _, k := range slices.SortedFunc(maps.Keys(e.ranks), func(a, b [2]int) int { return cmp.Or(cmp.Compare(a[1], b[1]), cmp.Compare(a[0], b[0])) }) {
			r := e.ranks[k]
			l := &r.info.Layout
			pe.Ranks = append(pe.Ranks, [2]int{l.TPRank, l.PPRank})
			pe.TPSize, pe.PPSize, pe.CompatHash, pe.Mode = l.TPSize, l.PPSize, r.info.CompatHash, r.worker.Mode().String()
		}
		out = append(out, pe)
		return true
	})
	slices.SortFunc(out, func(a, b PublishedEngine) int { return cmp.Compare(a.EngineID, b.EngineID) })
	return out
}

// PeerGone tells every attached rank that peer engine engine is gone
// (kvxfer.Worker.PeerGone). It does not block.
func (s *Server) PeerGone(engine, why string) {
	s.engines.Range(func(_ string, e *engineEntry) bool {
		for _, r := range e.ranks {
			_ = r.worker.PeerGone(engine, why) // closed: it holds nothing
		}
		return true
	})
}

// PeerGeneration tells every attached rank that peer engine engine is at
// generation gen (kvxfer.Worker.PeerGeneration). It does not block.
func (s *Server) PeerGeneration(engine string, gen uint64) {
	s.engines.Range(func(_ string, e *engineEntry) bool {
		for _, r := range e.ranks {
			_ = r.worker.PeerGeneration(engine, gen)
		}
		return true
	})
}
