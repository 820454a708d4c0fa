package kvxfer

import (
	"errors"
	"slices"
	"strings"
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

// Range is [Addr, Addr+Len) of an agent's registered memory.
type Range struct{ Addr, Len uint64 }

// Admission names a part admitted by an AccessFence (0: none).
type Admission uint64

// AccessFence is an AccessChecker that also knows which admitted parts of
// peers' transfers are still moving bytes, so that ending what allowed
// them waits for them: the Worker's table is one. A backend that moves a
// peer's bytes over time (a part read off a socket into registered
// memory, a copy out of another process's) admits each part through it,
// before a byte moves, and tells it once the last has moved or the part
// failed; a grant revoked (or a pull hold let go) meanwhile cuts the part
// short through abort and returns only once it is done, so no byte lands
// in (or is read out of) blocks the engine was told are free.
type AccessFence interface {
	AccessChecker
	// Admit checks every range as CheckAccess does and, when all are
	// allowed, notes the part as moving until Done. Otherwise it returns
	// the verdict and the index of the first range refused (-1: the part
	// as a whole). tag is the notification the transfer carries (nil:
	// none): a WRITE's names the request it is for, and is admitted only
	// into blocks granted for that request, so a producer's late WRITE of
	// a request that ended cannot land in the blocks the consumer granted
	// it again for its next one. abort, if not nil, may be called once,
	// from another goroutine, before Done: the part must then stop moving
	// bytes and fail; it must not block.
	Admit(peer PeerName, op hotpath.Op, ranges []Range, tag []byte, abort func()) (Access, int, Admission)
	// Done ends an admission (0: nothing).
	Done(Admission)
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
	// holders: [group][logical block]: the keys (readKey) of the
	// producer requests holding it (pull; those hold names), one of
	// which a tagged READ must name.
	holders [][][]string
	grants  map[uint32]*writeGrant
	revoked []uint32 // ended grants still in grants, oldest first
	// closed: the Worker broke (closeAll): nothing is granted any more.
	closed bool

	// lands are the admitted parts still moving bytes (slots reused
	// through freeLands); landed is signalled (under mu) when one ends.
	lands     []landing
	freeLands []int
	landed    *sync.Cond
}

// landing is a part admitted into (WRITE) or out of (READ) the Worker's
// memory whose bytes are still moving.
type landing struct {
	gen     uint32 // bumped at each reuse of the slot
	live    bool
	aborted bool
	// standing: a grant admitted whole ahead (WriteGater's gate), whose
	// cut at the grant's end is its normal end, not an aborted part.
	standing bool
	op       hotpath.Op
	grants   []uint32 // WRITE: the grants it lands under
	ranges   []Range  // READ: what it reads
	forReq   string   // READ: the hold it names (readKey; "": none)
	abort    func()
}

type accessRegion struct {
	base, size, blockLen uint64
	ppl                  uint64 // region blocks per logical block (kernel blocks; 1 for Mamba)
	groups               []int
}

type writeGrant struct {
	peers []PeerName
	live  bool
	req   string // the consumer request it is for ("": not said)
}

func newAccessTable(l *topology.Layout, groupBlocks []int, mode Mode, m *Metrics) *accessTable {
	t := &accessTable{mode: mode, metrics: m, grants: map[uint32]*writeGrant{}}
	t.landed = sync.NewCond(&t.mu)
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
			t.holders = append(t.holders, make([][]string, n))
		}
	}
	return t
}

// grantWrite lets peers WRITE into the blocks of spans (one per group)
// under grant id (the Worker's core names its grants: never 0, never
// reused while remembered) for consumer request req, until
// revokeWrite(id).
func (t *accessTable) grantWrite(id uint32, peers []PeerName, spans []topology.Span, req string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.grants[id] = &writeGrant{peers: peers, live: true, req: req}
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
}

// revokeWrite ends a grant. Its blocks keep naming it while it is
// remembered, so its peers' late WRITEs are told apart. It returns once
// no part admitted under it moves bytes any more: parts still landing are
// cut short (their abort) and waited for.
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
	t.drainLocked(func(l *landing) bool { return l.op == hotpath.OpWrite && slices.Contains(l.grants, id) })
}

// drainLocked cuts short every admitted part that hit says is affected by
// a change just made, and waits until none is left (t.mu held; no new
// such part can be admitted: the change refuses it).
func (t *accessTable) drainLocked(hit func(*landing) bool) {
	for {
		busy := false
		for i := range t.lands {
			l := &t.lands[i]
			if !l.live || !hit(l) {
				continue
			}
			busy = true
			if !l.aborted {
				l.aborted = true
				if !l.standing {
					t.metrics.AbortedLanding(l.op)
				}
				if l.abort != nil {
					l.abort()
				}
			}
		}
		if !busy {
			return
		}
		t.landed.Wait()
	}
}

// Admit implements AccessFence.
func (t *accessTable) Admit(peer PeerName, op hotpath.Op, ranges []Range, tag []byte, abort func()) (Access, int, Admission) {
	forReq, ok := t.tagRequest(op, tag)
	if !ok {
		return AccessDeny, -1, 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := t.takeLandingLocked()
	l := &t.lands[i]
	for j, r := range ranges {
		if a := t.checkLocked(peer, op, r.Addr, r.Len, &l.grants); a != AccessAllow {
			t.freeLands = append(t.freeLands, i)
			t.metrics.RefusedAccess(op, a)
			return a, j, 0
		}
	}
	a, adm := t.admittedLocked(i, op, ranges, forReq, abort)
	return a, -1, adm
}

// LayoutRanges is one layout of a part as a LayoutFence sees it: each of
// Entries (Addr an offset) at each of Bases.
type LayoutRanges struct {
	Bases   []uint64
	Entries []Range
}

// LayoutFence is an AccessFence that also admits a WRITE given as layouts
// (every entry at every base), deciding exactly what Admit would for
// the ranges they expand to, with each entry checked once per distinct
// place its bases put it in the grant table (a KV cache's layers share
// their blocks' grants: once for all of them) rather than once per range.
type LayoutFence interface {
	AccessFence
	// AdmitLayout is Admit for layouts: on refusal it returns the
	// layout, base and entry of the first range refused (-1s: the part as
	// a whole).
	AdmitLayout(peer PeerName, op hotpath.Op, lays []LayoutRanges, tag []byte, abort func()) (a Access, lay, base, entry int, adm Admission)
}

var _ LayoutFence = (*accessTable)(nil)

// GateFence is a LayoutFence that admits a WRITE grant offered one-sided
// (WriteGater) as a standing admission: AdmitLayout's checks, lasting
// until the grant ends, its cut then not counted as an aborted part.
type GateFence interface {
	LayoutFence
	AdmitGate(peer PeerName, lays []LayoutRanges, tag []byte, abort func()) (a Access, lay, base, entry int, adm Admission)
}

var _ GateFence = (*accessTable)(nil)

// layoutKey is where a base puts a layout's entries in the grant table:
// the region's blocks and groups, and the base's offset in the region.
type layoutKey struct {
	blockLen, ppl, off uint64
	groups             []int
}

// AdmitLayout implements LayoutFence.
func (t *accessTable) AdmitLayout(peer PeerName, op hotpath.Op, lays []LayoutRanges, tag []byte, abort func()) (Access, int, int, int, Admission) {
	return t.admitLayout(peer, op, lays, tag, abort, false)
}

// AdmitGate admits a WRITE grant offered one-sided (WriteGater) as
// AdmitLayout does, as a standing admission: it lasts until the grant
// ends, and is cut short then without counting as an aborted part.
func (t *accessTable) AdmitGate(peer PeerName, lays []LayoutRanges, tag []byte, abort func()) (Access, int, int, int, Admission) {
	return t.admitLayout(peer, hotpath.OpWrite, lays, tag, abort, true)
}

func (t *accessTable) admitLayout(peer PeerName, op hotpath.Op, lays []LayoutRanges, tag []byte, abort func(), standing bool) (Access, int, int, int, Admission) {
	forReq, ok := t.tagRequest(op, tag)
	if !ok {
		return AccessDeny, -1, -1, -1, 0
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	i := t.takeLandingLocked()
	l := &t.lands[i]
	refuse := func(a Access, li, bi, ei int) (Access, int, int, int, Admission) {
		t.freeLands = append(t.freeLands, i)
		t.metrics.RefusedAccess(op, a)
		return a, li, bi, ei, 0
	}
	// checked are the ranges checked (a READ's: the holds it needs);
	// a range skipped as another's twin needs what its twin does.
	var checked []Range
	var seenBuf [4]layoutKey
	seen := seenBuf[:0]
	for li, lay := range lays {
		lo, hi := ^uint64(0), uint64(0)
		for _, e := range lay.Entries {
			if e.Len > 0 {
				lo, hi = min(lo, e.Addr), max(hi, e.Addr+e.Len)
			}
		}
		if hi == 0 {
			continue // moves nothing
		}
		seen = seen[:0]
		for bi, b := range lay.Bases {
			// Every range of this base lies in one region: its entries
			// land where any base at the same place in a region of the
			// same blocks and groups puts them, checked once.
			if r, _, _, ok := t.blocksOf(b+lo, hi-lo); ok && b+lo >= b {
				k := layoutKey{r.blockLen, r.ppl, b - r.base, r.groups}
				if slices.ContainsFunc(seen, func(s layoutKey) bool {
					return s.blockLen == k.blockLen && s.ppl == k.ppl && s.off == k.off && slices.Equal(s.groups, k.groups)
				}) {
					continue
				}
				seen = append(seen, k)
			}
			for ei, e := range lay.Entries {
				if a := t.checkLocked(peer, op, b+e.Addr, e.Len, &l.grants); a != AccessAllow {
					return refuse(a, li, bi, ei)
				}
				if op == hotpath.OpRead {
					checked = append(checked, Range{b + e.Addr, e.Len})
				}
			}
		}
	}
	a, adm := t.admittedLocked(i, op, checked, forReq, abort)
	if adm != 0 {
		t.lands[i].standing = standing
	}
	return a, -1, -1, -1, adm
}

// tagRequest decodes the request a transfer's notification names: the
// consumer request a WRITE is for, the hold a READ reads (readKey: its
// producer request, else its transfer; "": none named); false when the
// tag is no such notice (denied).
func (t *accessTable) tagRequest(op hotpath.Op, tag []byte) (string, bool) {
	if len(tag) == 0 {
		return "", true
	}
	m, err := decodeMsg(tag)
	if err != nil || m.Kind != msgDone && m.Kind != msgTag || m.DReq == "" {
		t.metrics.RefusedAccess(op, AccessDeny)
		return "", false
	}
	if op == hotpath.OpRead {
		return readKey(m.PReq, m.TransferID), true
	}
	return writeKey(m.DReq, m.TransferID), true
}

// writeKey is what a WRITE grant is for, and what a WRITE's notice names
// of it: the consumer request, and its transfer when it has one. A
// consumer request id is used again once its request ended (a router's
// retry, an engine without random request ids), for another transfer:
// before, a grant named the id alone, and a late WRITE of the earlier
// transfer (its producer never confirmed the consumer's cancel, which
// reported it at its fence timeout) was admitted into the blocks the new
// request shares with the earlier one.
func writeKey(dreq, tid string) string {
	if tid == "" {
		return dreq
	}
	return dreq + "\x00" + tid
}

// readKey is what a pull READ names of the hold it reads, and what a hold
// is known by: its producer request ("r" and the id) when the consumer
// knows it (remote_request_id), else its transfer ("t" and the id), else
// nothing (""). A hold is known by both of its own (holdKeys). Before, a
// READ that named no producer request was admitted out of any hold: a
// consumer whose params lacked remote_request_id, reading after the
// producer's engine had crashed and attached again, got the bytes of the
// new engine's request held in the same blocks as done.
func readKey(preq, tid string) string {
	switch {
	case preq != "" && tid != "":
		// Both: the hold of that request for that transfer only. A
		// producer request id is used again once its request ended (a
		// retried engine, ids not randomized): a late READ of the earlier
		// transfer read the new request's KV held in the same blocks, and
		// reported it done.
		return "r" + preq + "\x00" + tid
	case preq != "":
		return "r" + preq
	case tid != "":
		return "t" + tid
	}
	return ""
}

// readAnyTransfer is, for the key of a READ naming a producer request and
// a transfer, the key of a hold of that request whose transfer was not
// said (holdKeys), which that READ reads too ("" for other keys).
func readAnyTransfer(key string) string {
	if i := strings.IndexByte(key, 0); i > 0 && key[0] == 'r' {
		return key[:i+1]
	}
	return ""
}

// holdKeys are the keys a hold of producer request req of transfer tid
// is known by (readKey).
func holdKeys(req, tid string) []string {
	var ks []string
	if req != "" {
		ks = append(ks, readKey(req, ""))
	}
	switch {
	case req != "" && tid != "":
		ks = append(ks, readKey(req, tid))
	case req != "":
		// No transfer said: a READ of req naming any transfer reads it
		// (readAnyTransfer).
		ks = append(ks, "r"+req+"\x00")
	}
	if tid != "" {
		ks = append(ks, readKey("", tid))
	}
	return ks
}

// takeLandingLocked returns a free landing slot, its grants and ranges
// emptied (t.mu held).
func (t *accessTable) takeLandingLocked() int {
	var i int
	if n := len(t.freeLands); n > 0 {
		i, t.freeLands = t.freeLands[n-1], t.freeLands[:n-1]
	} else {
		t.lands = append(t.lands, landing{})
		i = len(t.lands) - 1
	}
	l := &t.lands[i]
	l.grants, l.ranges = l.grants[:0], l.ranges[:0]
	return i
}

// admittedLocked ends the admission of a part whose ranges were allowed
// (landing slot i, its grants collected): refused as late when the
// request it names is not the one its blocks are held or granted for,
// else noted as moving (t.mu held).
func (t *accessTable) admittedLocked(i int, op hotpath.Op, ranges []Range, forReq string, abort func()) (Access, Admission) {
	l := &t.lands[i]
	if forReq != "" && op == hotpath.OpRead {
		for _, r := range ranges {
			if !t.heldForLocked(r, forReq) {
				// Its blocks are held for another request: the one it
				// names let them go (a READ after its lease).
				t.freeLands = append(t.freeLands, i)
				t.metrics.RefusedAccess(op, AccessLate)
				return AccessLate, 0
			}
		}
	}
	if forReq != "" && op == hotpath.OpWrite {
		for _, id := range l.grants {
			if g := t.grants[id]; g.req != "" && g.req != forReq {
				// Its blocks are granted to the peer for another request:
				// the one it names ended (a late WRITE).
				t.freeLands = append(t.freeLands, i)
				t.metrics.RefusedAccess(op, AccessLate)
				return AccessLate, 0
			}
		}
	}
	l.forReq = ""
	if op == hotpath.OpRead {
		l.ranges = append(l.ranges, ranges...)
		l.forReq = forReq
	}
	l.gen++
	l.live, l.aborted, l.standing, l.op, l.abort = true, false, false, op, abort
	return AccessAllow, Admission(uint64(l.gen)<<32 | uint64(i+1))
}

// Done implements AccessFence.
func (t *accessTable) Done(a Admission) {
	if a == 0 {
		return
	}
	i, gen := int(uint32(a))-1, uint32(a>>32)
	t.mu.Lock()
	defer t.mu.Unlock()
	if i < 0 || i >= len(t.lands) || !t.lands[i].live || t.lands[i].gen != gen {
		return
	}
	l := &t.lands[i]
	l.live, l.abort = false, nil
	t.freeLands = append(t.freeLands, i)
	t.landed.Broadcast()
}

// hold adds (delta 1) or removes (-1) a pull hold on the blocks of spans
// for producer request req of transfer tid ("": not said).
func (t *accessTable) hold(spans []topology.Span, delta int32, req, tid string) {
	keys := holdKeys(req, tid)
	t.mu.Lock()
	defer t.mu.Unlock()
	for g, s := range spans {
		if g >= len(t.held) {
			break
		}
		for _, b := range s.IDs {
			if b >= 0 && int(b) < len(t.held[g]) {
				t.held[g][b] = max(t.held[g][b]+delta, 0)
				for _, k := range keys {
					hs := t.holders[g][b]
					if delta > 0 {
						t.holders[g][b] = append(hs, k)
					} else if i := slices.Index(hs, k); i >= 0 {
						t.holders[g][b] = slices.Delete(hs, i, i+1)
					}
				}
			}
		}
	}
	if delta < 0 {
		// READs admitted out of blocks no longer held (for the request
		// they name) end first.
		t.drainLocked(func(l *landing) bool {
			if l.op != hotpath.OpRead {
				return false
			}
			for _, r := range l.ranges {
				if t.checkLocked("", hotpath.OpRead, r.Addr, r.Len, nil) != AccessAllow || !t.heldForLocked(r, l.forReq) {
					return true
				}
			}
			return false
		})
	}
}

// heldForLocked reports whether every block of r is held for the hold
// key req names (readKey; "": any hold will do; a hold of unnamed
// requests too).
func (t *accessTable) heldForLocked(r Range, req string) bool {
	if req == "" || r.Len == 0 {
		return true
	}
	alt := readAnyTransfer(req)
	reg, first, last, ok := t.blocksOf(r.Addr, r.Len)
	if !ok {
		return false
	}
	for b := first; b <= last; b++ {
		for _, g := range reg.groups {
			if g < len(t.holders) && b < uint64(len(t.holders[g])) && t.held[g][b] > 0 {
				if hs := t.holders[g][b]; len(hs) > 0 && !slices.Contains(hs, req) && (alt == "" || !slices.Contains(hs, alt)) {
					return false
				}
			}
		}
	}
	return true
}

// closeAll ends every grant and hold at once, for a Worker that broke:
// its blocks go back to the engine without waiting for any peer, once
// every part still moving bytes in or out of them was cut short.
func (t *accessTable) closeAll() {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.closed = true
	t.drainLocked(func(*landing) bool { return true })
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
	t.mu.RLock()
	defer t.mu.RUnlock()
	return t.checkLocked(peer, op, addr, n, nil)
}

// blocksOf finds the region holding [addr, addr+n) (n > 0) and the
// logical blocks it spans; ok is false when no one region holds it all.
func (t *accessTable) blocksOf(addr, n uint64) (r *accessRegion, first, last uint64, ok bool) {
	i, _ := slices.BinarySearchFunc(t.regions, addr, func(r accessRegion, a uint64) int {
		if r.base > a {
			return 1
		}
		return -1
	})
	if i == 0 {
		return nil, 0, 0, false
	}
	r = &t.regions[i-1]
	off := addr - r.base
	if off >= r.size || n > r.size-off {
		return nil, 0, 0, false
	}
	return r, off / r.blockLen / r.ppl, (off + n - 1) / r.blockLen / r.ppl, true
}

// checkLocked is check with t.mu held; grants, if not nil, collects the
// WRITE grants an allowed range lands under.
func (t *accessTable) checkLocked(peer PeerName, op hotpath.Op, addr, n uint64, grants *[]uint32) Access {
	if n == 0 {
		return AccessAllow // moves nothing
	}
	if (op == hotpath.OpWrite) != (t.mode == ModePush) || (op != hotpath.OpWrite && op != hotpath.OpRead) {
		return AccessDeny // push: peers only WRITE here; pull: only READ
	}
	r, first, last, ok := t.blocksOf(addr, n)
	if !ok {
		return AccessDeny
	}
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
					if grants != nil && lastAccess == AccessAllow && !slices.Contains(*grants, id) {
						*grants = append(*grants, id)
					}
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

// WriteGater is implemented by backends that can let a producer WRITE a
// grant's blocks one-sided, straight into the consumer's memory (the
// built-in backend's gates, between agents on one GPU of a host): a push
// consumer's Worker offers each WRITE grant to its peers when it makes
// it, admitted whole through its table (LayoutFence) for its request.
// The grant's end cuts that admission short like any part's, and
// returns only once nothing the peer launched can land any more.
type WriteGater interface {
	// Gateable reports whether any grant could be offered one-sided (the
	// backend has memory it can gate): cheap, asked before every grant.
	Gateable() bool
	// OpenGate offers the ranges of lays (every entry at every base) to
	// peer for the request tag names. ErrNoGate (wrapped): none could be
	// made, and the grant is served as before.
	OpenGate(peer PeerName, lays []LayoutRanges, tag []byte) error
}

// ErrNoGate: a backend could not offer a grant one-sided (WriteGater).
var ErrNoGate = errors.New("kvxfer: no gate")

// GateKey is the key a backend matches a WRITE's notification to the
// gate (WriteGater) its grant was offered as: the consumer request the
// notification names, with its transfer (writeKey; "" when it names no
// request: no gate matches).
func GateKey(notif []byte) string {
	m, err := decodeMsg(notif)
	if err != nil || m.Kind != msgDone && m.Kind != msgTag || m.DReq == "" {
		return ""
	}
	return writeKey(m.DReq, m.TransferID)
}

// grantLayouts returns the ranges a WRITE grant of spans (one per group)
// covers, as layouts: each logical block granted in a region's groups is
// an entry (its offset and length in the region), and regions whose
// blocks and groups agree share their entries (bases: the regions').
func (t *accessTable) grantLayouts(spans []topology.Span) []LayoutRanges {
	// Regions of one size, blocks and groups have the same entries: the
	// first's are laid out, the others add their bases (out[i] is
	// classes[i]'s).
	var out []LayoutRanges
	var classes []*accessRegion
	for ri := range t.regions {
		r := &t.regions[ri]
		stride := r.blockLen * r.ppl
		if i := slices.IndexFunc(classes, func(o *accessRegion) bool {
			return o.size == r.size && o.blockLen == r.blockLen && o.ppl == r.ppl && slices.Equal(o.groups, r.groups)
		}); i >= 0 {
			out[i].Bases = append(out[i].Bases, r.base)
			continue
		}
		var ents []Range
		for _, g := range r.groups {
			if g >= len(spans) {
				continue
			}
			for _, b := range spans[g].IDs {
				if b < 0 || uint64(b)*stride >= r.size {
					continue
				}
				ents = append(ents, Range{uint64(b) * stride, min(stride, r.size-uint64(b)*stride)})
			}
		}
		if len(ents) == 0 {
			continue
		}
		slices.SortFunc(ents, func(x, y Range) int { return cmpU64(x.Addr, y.Addr) })
		ents = slices.CompactFunc(ents, func(x, y Range) bool { return x.Addr == y.Addr })
		classes = append(classes, r)
		out = append(out, LayoutRanges{Bases: []uint64{r.base}, Entries: ents})
	}
	return out
}
