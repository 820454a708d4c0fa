package kvxfer

import (
	"slices"
	"sync"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// Least privilege on the data plane: a Worker keeps a table of which peer
// may move which of its blocks, and a backend that enforces it (Guarded:
// the built-in one) asks it about every range a peer names before a byte
// moves. A push consumer grants the producer ranks of a request WRITE
// access to that request's blocks from its registration until the request
// ends; a pull producer grants READ access to the blocks it holds for a
// request until it forgets the request. Nothing else is reachable.

// Access is a Worker's answer about bytes a peer wants to move.
type Access uint8

const (
	// AccessAllow: the peer holds a grant covering the bytes.
	AccessAllow Access = iota + 1
	// AccessLate: the bytes are the kind this Worker grants, but not now:
	// a grant the peer held has ended (a WRITE that lost a race with a
	// cancel or a fence timeout), or a pull producer does not hold the
	// block (a READ too early or after the lease). Refused; an honest peer
	// can do this, so its connection is kept.
	AccessLate
	// AccessDeny: the peer never held a grant covering the bytes (another
	// request's blocks, memory this Worker never exposes that way).
	// Refused, and the connection is dropped.
	AccessDeny
)

func (a Access) String() string {
	switch a {
	case AccessAllow:
		return "allow"
	case AccessLate:
		return "late"
	case AccessDeny:
		return "deny"
	}
	return "Access(?)"
}

// AccessChecker answers whether a peer may move the bytes of [addr,
// addr+n) of this agent's registered memory: into it (op OpWrite, a
// peer's WRITE) or out of it (OpRead, a peer's READ). It is safe for
// concurrent use and does not block for long.
type AccessChecker interface {
	CheckAccess(peer PeerName, op hotpath.Op, addr, n uint64) Access
}

// Guarded is implemented by backends that enforce an AccessChecker on
// every transfer a peer posts into or out of their memory (the built-in
// backend). A Worker installs its table at start unless
// WorkerConfig.OpenDataPlane is set; a backend takes one table.
type Guarded interface {
	SetGuard(c AccessChecker) error
}

// maxRevoked is how many ended WRITE grants a table remembers, so that a
// late WRITE of their peer is told apart from one that never had a grant.
const maxRevoked = 4096

// accessTable is a Worker's grants. The Worker's loop changes it; the
// backend's goroutines read it.
type accessTable struct {
	mode    Mode
	metrics *Metrics
	regions []accessRegion // sorted by base

	mu      sync.RWMutex
	writeTo [][]uint32 // [group][logical block]: the WRITE grant it was last given (0: none)
	held    [][]int32  // [group][logical block]: pull holds
	grants  map[uint32]*writeGrant
	revoked []uint32 // ended grants still in grants, oldest first
	next    uint32
	// closed: the Worker broke (closeAll): nothing is granted any more.
	closed bool
}

type accessRegion struct {
	base, size, blockLen uint64
	ppl                  uint64 // region blocks per logical block (kernel blocks; 1 for Mamba)
	groups               []int
}

type writeGrant struct {
	peers []PeerName
	live  bool
}

func newAccessTable(l *topology.Layout, groupBlocks []int, mode Mode, m *Metrics) *accessTable {
	t := &accessTable{mode: mode, metrics: m, grants: map[uint32]*writeGrant{}}
	groups := l.GroupList()
	for i, r := range l.Regions {
		ar := accessRegion{base: r.Base, size: uint64(r.BlockLen) * uint64(r.NumBlocks), blockLen: uint64(r.BlockLen), ppl: 1}
		if r.Kind != topology.KindMamba {
			ar.ppl = uint64(max(l.PagesPerBlock(), 1))
		}
		for g := range groups {
			if slices.Contains(groups[g].Regions, i) {
				ar.groups = append(ar.groups, g)
			}
		}
		t.regions = append(t.regions, ar)
	}
	slices.SortFunc(t.regions, func(a, b accessRegion) int { return cmpU64(a.base, b.base) })
	for _, n := range groupBlocks {
		if mode == ModePush {
			t.writeTo = append(t.writeTo, make([]uint32, n))
		} else {
			t.held = append(t.held, make([]int32, n))
		}
	}
	return t
}

// grantWrite lets peers WRITE into the blocks of spans (one per group)
// and returns the grant, for revokeWrite.
func (t *accessTable) grantWrite(peers []PeerName, spans []topology.Span) uint32 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next++
	if t.next == 0 {
		t.next++
	}
	id := t.next
	t.grants[id] = &writeGrant{peers: peers, live: true}
	for g, s := range spans {
		if g >= len(t.writeTo) {
			break
		}
		for _, b := range s.IDs {
			if b >= 0 && int(b) < len(t.writeTo[g]) {
				t.writeTo[g][b] = id
			}
		}
	}
	return id
}

// revokeWrite ends a grant. Its blocks keep naming it while it is
// remembered, so its peers' late WRITEs are told apart.
func (t *accessTable) revokeWrite(id uint32) {
	if id == 0 {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	g := t.grants[id]
	if g == nil || !g.live {
		return
	}
	g.live = false
	t.revoked = append(t.revoked, id)
	if len(t.revoked) > maxRevoked {
		delete(t.grants, t.revoked[0])
		t.revoked = slices.Delete(t.revoked, 0, 1)
	}
}

// hold adds (delta 1) or removes (-1) a pull hold on the blocks of spans.
func (t *accessTable) hold(spans []topology.Span, delta int32) {
	t.mu.Lock()
	defer t.mu.Unlock()
	for g, s := range spans {
		if g >= len(t.held) {
			break
		}
		for _, b := range s.IDs {
			if b >= 0 && int(b) < len(t.held[g]) {
				t.held[g][b] = max(t.held[g][b]+delta, 0)
			}
		}
	}
}

// closeAll ends every grant and hold at once, for a Worker that broke:
// its blocks go back to the engine without waiting for any peer.
func (t *accessTable) closeAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
}

// CheckAccess implements AccessChecker.
func (t *accessTable) CheckAccess(peer PeerName, op hotpath.Op, addr, n uint64) Access {
	a := t.check(peer, op, addr, n)
	if a != AccessAllow {
		t.metrics.RefusedAccess(op, a)
	}
	return a
}

func (t *accessTable) check(peer PeerName, op hotpath.Op, addr, n uint64) Access {
	if n == 0 {
		return AccessAllow // moves nothing
	}
	if (op == hotpath.OpWrite) != (t.mode == ModePush) || (op != hotpath.OpWrite && op != hotpath.OpRead) {
		return AccessDeny // push: peers only WRITE here; pull: only READ
	}
	i, _ := slices.BinarySearchFunc(t.regions, addr, func(r accessRegion, a uint64) int {
		if r.base > a {
			return 1
		}
		return -1
	})
	if i == 0 {
		return AccessDeny
	}
	r := &t.regions[i-1]
	off := addr - r.base
	if off >= r.size || n > r.size-off {
		return AccessDeny
	}
	first := off / r.blockLen / r.ppl
	last := (off + n - 1) / r.blockLen / r.ppl
	t.mu.RLock()
	defer t.mu.RUnlock()
	if t.closed {
		return AccessLate // what it granted has ended
	}
	verdict := AccessAllow
	// A run's blocks mostly share one grant: its answer is kept.
	var lastID uint32
	var lastAccess Access
	for b := first; b <= last; b++ {
		best := AccessDeny
		for _, g := range r.groups {
			var a Access
			if op == hotpath.OpWrite {
				if g >= len(t.writeTo) || b >= uint64(len(t.writeTo[g])) {
					continue
				}
				if id := t.writeTo[g][b]; id != lastID || lastAccess == 0 {
					lastID, lastAccess = id, t.writeAccess(id, peer)
				}
				a = lastAccess
			} else {
				if g >= len(t.held) || b >= uint64(len(t.held[g])) {
					continue
				}
				a = AccessLate
				if t.held[g][b] > 0 {
					a = AccessAllow
				}
			}
			best = min(best, a) // Allow < Late < Deny
		}
		verdict = max(verdict, best)
		if verdict == AccessDeny {
			break
		}
	}
	return verdict
}

// writeAccess: what grant id gives peer.
func (t *accessTable) writeAccess(id uint32, peer PeerName) Access {
	g := t.grants[id]
	if g == nil || !slices.Contains(g.peers, peer) {
		return AccessDeny
	}
	if g.live {
		return AccessAllow
	}
	return AccessLate
}
