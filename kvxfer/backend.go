package kvxfer

import (
	"errors"
	"fmt"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
)

// MemKind is the kind of memory a region lives in.
type MemKind uint8

const (
	// MemDRAM is host memory (shared-memory files in kvxferd).
	MemDRAM MemKind = iota + 1
	// MemVRAM is device memory (CUDA IPC imports in kvxferd).
	MemVRAM
)

func (k MemKind) String() string {
	switch k {
	case MemDRAM:
		return "DRAM"
	case MemVRAM:
		return "VRAM"
	}
	return fmt.Sprintf("MemKind(%d)", uint8(k))
}

// MemRegion is one registered memory range.
type MemRegion struct {
	Addr uint64
	Len  uint64
	Dev  int32
	Kind MemKind
}

// PeerName names a peer agent once its metadata is loaded.
type PeerName string

// XferID names a posted transfer. The zero value is invalid.
type XferID uint64

// XferState is the state of a posted transfer.
type XferState uint8

const (
	// XferInProgress: bytes may still be moving.
	XferInProgress XferState = iota + 1
	// XferDone: every byte landed and the notification was delivered.
	XferDone
	// XferFailed: the transfer failed; State returns the reason.
	XferFailed
)

func (s XferState) String() string {
	switch s {
	case XferInProgress:
		return "in_progress"
	case XferDone:
		return "done"
	case XferFailed:
		return "failed"
	}
	return fmt.Sprintf("XferState(%d)", uint8(s))
}

// Notif is a notification received from a peer.
type Notif struct {
	From PeerName
	Msg  []byte
}

// Backend errors. Backends wrap them with detail; match with errors.Is.
var (
	ErrClosed        = errors.New("kvxfer: closed")
	ErrUnknownPeer   = errors.New("kvxfer: unknown peer")
	ErrUnknownXfer   = errors.New("kvxfer: unknown transfer")
	ErrOutOfBounds   = errors.New("kvxfer: descriptor outside registered memory")
	ErrBadMetadata   = errors.New("kvxfer: bad peer metadata")
	ErrXferFailed    = errors.New("kvxfer: transfer failed")
	ErrNotRegistered = errors.New("kvxfer: memory not registered")
	// ErrNotGranted: a peer named memory the receiving Worker's grants do
	// not cover (see Guarded).
	ErrNotGranted = errors.New("kvxfer: no grant for the memory")
	// ErrPeerLost: the peer's agent cannot be reached through the
	// connection the backend had to it (its process exited, its agent
	// closed, or the transport found the connection broken). A Worker
	// whose request got nowhere for it handshakes again and restarts the
	// request once (the peer may be at new agents), as it does for a
	// connection refused or reset.
	ErrPeerLost = errors.New("kvxfer: peer agent lost")
	// ErrPeerExited: the process that held the peer's agent has exited,
	// seen for certain (on the same host, by its pidfd: not a connection
	// that broke, nor a peer that does not answer). An error that says it
	// also says ErrPeerLost. Nothing that process had yet to post can
	// move any more: a push consumer waiting on that agent's WRITEs
	// fences it without its confirmation (README: fencing).
	ErrPeerExited = errors.New("kvxfer: peer agent's process exited")
)

// Backend moves bytes between registered memory regions of agents. It
// mirrors the NIXL agent so that the NIXL backend is a thin binding and the
// built-in and fake backends are faithful stand-ins (DESIGN.md).
//
// Implementations are safe for concurrent use. Every descriptor a peer
// names is bounds-checked against registered regions: a transfer never
// reads or writes outside registered memory.
type Backend interface {
	// Register makes regions usable as local transfer endpoints.
	Register(regions []MemRegion) error
	// Deregister removes regions registered earlier.
	Deregister(regions []MemRegion) error
	// LocalMetadata returns the blob a peer passes to LoadPeer to reach
	// this agent and its registered regions.
	LocalMetadata() ([]byte, error)
	// LoadPeer loads a peer's metadata blob and returns its name.
	LoadPeer(meta []byte) (PeerName, error)
	// InvalidatePeer forgets a peer. Its transfers in flight end: they fail,
	// or a backend that cannot stop them (NIXL) waits for them to end first,
	// so that none of their bytes land after it returns.
	InvalidatePeer(peer PeerName) error
	// Post starts a WRITE (local -> remote) or READ (remote -> local) of
	// the descriptors to peer. notif, when not nil, is delivered to the
	// peer only after every byte of the batch has landed. The backend
	// does not keep descs after Post returns.
	Post(op hotpath.Op, peer PeerName, descs []hotpath.Desc, notif []byte) (XferID, error)
	// State polls a transfer; for XferFailed the error says why.
	State(id XferID) (XferState, error)
	// Release forgets a finished transfer, or abandons a running one:
	// once it returns, none of the transfer's bytes move any more (a
	// backend that cannot stop them waits for them, within its bound).
	// The Worker calls it for an abandoned transfer on a goroutine of its
	// own, beside its other calls, and reports the request after.
	Release(id XferID) error
	// Notify sends a bare notification to a peer.
	Notify(peer PeerName, msg []byte) error
	// DrainNotifs appends the notifications received since the last call
	// to dst, in arrival order.
	DrainNotifs(dst []Notif) []Notif
	// Events returns a channel that receives a value (coalesced: it
	// holds at most one) whenever a notification arrives or a posted
	// transfer leaves XferInProgress, so a caller can wait for work
	// instead of polling. A transfer that progresses only when polled may
	// not signal; callers poll in-flight transfers while they have any.
	Events() <-chan struct{}
	// Close releases everything; it is idempotent. Calls after Close
	// return ErrClosed.
	Close() error
}

// Awaiter is implemented by backends that learn of notifications only by
// polling for them (NIXL has no completion callback), and that poll less
// often while nothing happens. A Worker says when it awaits messages from
// its peers (a consumer waiting for a WRITE's completion notice, a
// producer holding requests or registrations, acknowledgements due) and
// when it no longer does, so the backend keeps polling at its busy rate
// for exactly as long as a notice could be on the critical path. Calls
// from several Workers sharing a backend nest: each Awaiting(true) is
// matched by an Awaiting(false).
type Awaiter interface {
	Awaiting(on bool)
}

// XferTelemetry is a backend's own measurement of a finished transfer.
type XferTelemetry struct {
	Post, Transfer time.Duration
	Bytes, Descs   uint64
}

// Telemeter is implemented by backends that measure transfers themselves
// (NIXL): the Worker records their figures for post and transfer time
// instead of its own. Telemetry is asked before Release.
type Telemeter interface {
	Telemetry(id XferID) (XferTelemetry, bool)
}

// PrepID names a prepared descriptor list; 0 is invalid.
type PrepID uint64

// PreparedPoster is implemented by backends with prepared descriptor
// lists (NIXL's prep_xfer_dlist): a list of fixed entries is handed over
// once per peer rank, and each transfer names entries by index, so a
// post passes only indices. The Worker uses it when
// WorkerConfig.Prepared is set (hotpath.AppendPrepared and
// Builder.AppendIndices build the lists and the indices).
type PreparedPoster interface {
	// Prepare hands over a list: this agent's own when peer is "", else
	// one of the peer's registered memory.
	Prepare(peer PeerName, entries []hotpath.Entry) (PrepID, error)
	// PostPrepared posts a transfer of the index pairs between a local and
	// a remote list, with the notification after the bytes.
	PostPrepared(op hotpath.Op, local, remote PrepID, pairs []hotpath.IndexPair, notif []byte) (XferID, error)
	// ReleasePrepared releases a list.
	ReleasePrepared(id PrepID) error
}

// LayoutPoster is implemented by backends that take a WRITE in factored
// form (hotpath.Layouts: base pairs and entries, each entry at each base)
// and can move it without listing its pieces: the built-in backend's
// same-host GPU path, where one kernel launch computes every piece's
// addresses. A Worker over such a backend (not prepared) posts every
// WRITE that is not layer-wise (push) and every READ (pull) this way; the
// backend expands what it cannot move as layouts.
type LayoutPoster interface {
	// PostLayouts posts the layouts of l.Spans (indices into l.Bases and
	// l.Entries) as one transfer, with the notification after the bytes.
	// The backend does not keep l after it returns.
	PostLayouts(op hotpath.Op, peer PeerName, l *hotpath.Layouts, notif []byte) (XferID, error)
}

// PostCost models what one post costs its poster (request creation and
// posting, not the bytes' flight), by kind: Fixed + PerDesc per
// descriptor for an on-the-fly post of a coalesced list (Backend.Post),
// PreparedFixed + PerPair per index pair for a prepared one
// (PreparedPoster.PostPrepared). A prepared post names every unit's
// segment (hotpath.Builder.AppendIndices), an on-the-fly one only the
// coalesced runs (hotpath.Builder.AppendDescs), so which is cheaper
// depends on the request: scattered blocks coalesce little and favour
// the prepared kind's cheaper entries; long runs favour the fewer
// descriptors of the on-the-fly kind.
type PostCost struct {
	Fixed, PerDesc         time.Duration
	PreparedFixed, PerPair time.Duration
}

// Prepared reports whether a prepared post of pairs index pairs costs no
// more than an on-the-fly post of descs descriptors.
func (c PostCost) Prepared(descs, pairs int) bool {
	return c.PreparedFixed+c.PerPair*time.Duration(pairs) <= c.Fixed+c.PerDesc*time.Duration(descs)
}

// PostCoster is implemented by PreparedPosters that model the cost of
// their two kinds of post. With WorkerConfig.Prepared set, a Worker over
// one builds both a request's index pairs and its coalesced descriptors
// and posts the kind PostCost says is cheaper; over a PreparedPoster
// without it, every post is prepared. PostCost is asked once, when the
// Worker starts.
type PostCoster interface {
	PostCost() PostCost
}
