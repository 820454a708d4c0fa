package tcp

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"unsafe"

	"github.com/kvxfer/kvxfer/kvxfer"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/netxfer"
	"github.com/kvxfer/kvxfer/internal/peerauth"
)

// Config configures the built-in backend (see New).
type Config struct {
	// Name is the agent's unique name (default: random).
	Name string
	// Listen is the TCP address peers connect to (default
	// "127.0.0.1:0"); Advertise is the address they dial (default: the
	// listener's).
	Listen, Advertise string
	// Conns is the number of TCP connections per peer (default 4).
	Conns int
	// DisableLocal turns off the direct memory copy between agents of
	// one process.
	DisableLocal bool
	// DisableSameHost turns off the same-host path: by default a WRITE to
	// a peer agent of the same user on this host (same network namespace)
	// from memory adopted with MapFile is copied by the peer straight out
	// of that memory's file (one copy, no socket payload); see netxfer.
	DisableSameHost bool
	// Devices returns this process's GPU of a UUID, on which a same-host
	// peer's GPU memory (MapIPC) is imported and copied (nil: refused).
	Devices func(uuid [16]byte) (Device, error)
	// Auth authenticates the connections between agents (nil: none; the
	// daemon always sets it, insecure only with -insecure-peers).
	Auth *peerauth.Authenticator
	// ClientTLS and ServerTLS run the connections between agents over
	// mutual TLS (kvxferd -tls-*), see netxfer.Config.
	ClientTLS, ServerTLS *tls.Config
	Logger               *slog.Logger
	// DisableGates turns off one-sided same-host GPU WRITEs (see
	// OpenGate): every WRITE takes the two-sided path.
	DisableGates bool
	// MaxPendingPerAddr, MaxIncoming and Refused bound the incoming TCP
	// connections (see netxfer.Config; 0: its defaults).
	MaxPendingPerAddr, MaxIncoming int
	Refused                        func(reason string)
}

// Backend is the built-in kvxfer.Backend: TCP between kvxferd processes with
// zero-copy sends and receives, and a direct copy between agents of one
// process. Memory is caller-owned and adopted with Map before Register.
// It is safe for concurrent use.
type Backend struct {
	a *netxfer.Agent
}

var (
	_ kvxfer.Backend    = (*Backend)(nil)
	_ kvxfer.Guarded    = (*Backend)(nil)
	_ kvxfer.WriteGater = (*Backend)(nil)
)

// New starts a built-in backend agent.
func New(cfg Config) (*Backend, error) {
	a, err := netxfer.New(netxfer.Config{Name: cfg.Name, Listen: cfg.Listen, Advertise: cfg.Advertise,
		Conns: cfg.Conns, DisableLocal: cfg.DisableLocal, DisableSameHost: cfg.DisableSameHost, Devices: cfg.Devices, Auth: cfg.Auth, ClientTLS: cfg.ClientTLS, ServerTLS: cfg.ServerTLS, Logger: cfg.Logger,
		GateKey: kvxfer.GateKey, DisableGates: cfg.DisableGates, MaxPendingPerAddr: cfg.MaxPendingPerAddr, MaxIncoming: cfg.MaxIncoming,
		Refused: cfg.Refused})
	if err != nil {
		return nil, err
	}
	return &Backend{a: a}, nil
}

// Name returns the agent's name (its kvxfer.PeerName at peers).
func (n *Backend) Name() kvxfer.PeerName { return kvxfer.PeerName(n.a.Name()) }

// Addr returns the TCP address peers dial.
func (n *Backend) Addr() string { return n.a.Addr() }

// Map adopts caller-owned memory at base (a mapped shared-memory file).
func (n *Backend) Map(base uint64, mem []byte) error { return mapNetErr(n.a.Map(base, mem)) }

// MapFile adopts caller-owned memory at base that maps f's bytes
// [off, off+len(mem)): as Map, and same-host peers may copy out of it
// directly (the backend keeps a read-only reopening of f).
func (n *Backend) MapFile(base uint64, mem []byte, f *os.File, off int64) error {
	return mapNetErr(n.a.MapFile(base, mem, f, off))
}

// Device is a GPU as the same-host path uses it (kvxferd: a CUDA device of
// its process; addresses are device addresses, unified).
type Device = netxfer.Device

// BatchDevice is a Device that copies a part's GPU pieces with one
// asynchronous launch (see netxfer.BatchDevice); DevBatch, DevPiece and
// DevCopy are its batch being staged, a piece and a batch in flight.
type (
	BatchDevice = netxfer.BatchDevice
	DevBatch    = netxfer.DevBatch
	DevPiece    = netxfer.DevPiece
	DevCopy     = netxfer.DevCopy
	// LayoutBatch is a DevBatch that takes layouts as they are (bases
	// and entries, see netxfer.LayoutBatch); DevRegion and DevEntry are
	// their parts.
	// GateDevice is a BatchDevice that makes gates (one-sided WRITEs,
	// see OpenGate); its batches are GatedBatches.
	GateDevice  = netxfer.GateDevice
	GatedBatch  = netxfer.GatedBatch
	LayoutBatch = netxfer.LayoutBatch
	DevRegion   = netxfer.DevRegion
	DevEntry    = netxfer.DevEntry
)

// MapIPC adopts GPU memory at base (its address in this process) of size
// bytes: the allocation exported as handle (CUDA IPC) on the GPU of uuid.
// It moves only to and from peers on this host (the same-host path: the
// peer imports handle and copies with its GPU); a transfer to a peer on
// another host fails, naming that limit.
func (n *Backend) MapIPC(base, size uint64, dev Device, uuid [16]byte, handle [64]byte) error {
	return mapNetErr(n.a.MapDevice(base, size, dev, uuid, handle))
}

// SameHostParts returns how many transfer parts (WRITEs from same-host
// peers, READs of them) this backend copied straight out of a peer's
// memory file into its own memory.
func (n *Backend) SameHostParts() uint64 { return n.a.SameHostParts() }

// Unmap forgets memory mapped at base, waiting for transfers using it.
// Settle waits for the landings into this backend's memory in progress
// to end, and orders the caller's earlier accesses to that memory before
// every landing that begins after it (netxfer.Agent.Settle).
func (n *Backend) Settle() { n.a.Settle() }

func (n *Backend) Unmap(base uint64) error { return mapNetErr(n.a.Unmap(base)) }

// mapNetErr gives netxfer's errors kvxfer's sentinels.
func mapNetErr(err error) error {
	if err == nil {
		return nil
	}
	for _, p := range [...]struct{ from, to error }{
		{netxfer.ErrOutOfBounds, kvxfer.ErrOutOfBounds}, {netxfer.ErrClosed, kvxfer.ErrClosed}, {netxfer.ErrUnknownPeer, kvxfer.ErrUnknownPeer},
		{netxfer.ErrUnknownXfer, kvxfer.ErrUnknownXfer}, {netxfer.ErrBadMetadata, kvxfer.ErrBadMetadata},
		{netxfer.ErrNotRegistered, kvxfer.ErrNotRegistered}, {netxfer.ErrNotGranted, kvxfer.ErrNotGranted}, {netxfer.ErrXferFailed, kvxfer.ErrXferFailed},
	} {
		if errors.Is(err, p.from) {
			return fmt.Errorf("%w: %w", p.to, err)
		}
	}
	return err
}

func netRegions(rs []kvxfer.MemRegion) []netxfer.Region {
	out := make([]netxfer.Region, len(rs))
	for i, r := range rs {
		out[i] = netxfer.Region{Addr: r.Addr, Len: r.Len}
	}
	return out
}

// Register implements kvxfer.Backend.
func (n *Backend) Register(regions []kvxfer.MemRegion) error {
	return mapNetErr(n.a.Register(netRegions(regions)))
}

// Deregister implements kvxfer.Backend.
func (n *Backend) Deregister(regions []kvxfer.MemRegion) error {
	return mapNetErr(n.a.Deregister(netRegions(regions)))
}

// LocalMetadata implements kvxfer.Backend.
func (n *Backend) LocalMetadata() ([]byte, error) { return n.a.Metadata(), nil }

// LoadPeer implements kvxfer.Backend.
func (n *Backend) LoadPeer(meta []byte) (kvxfer.PeerName, error) {
	name, err := n.a.LoadPeer(meta)
	return kvxfer.PeerName(name), mapNetErr(err)
}

// InvalidatePeer implements kvxfer.Backend.
func (n *Backend) InvalidatePeer(peer kvxfer.PeerName) error {
	return mapNetErr(n.a.InvalidatePeer(string(peer)))
}

// Post implements kvxfer.Backend.
func (n *Backend) Post(op hotpath.Op, peer kvxfer.PeerName, descs []hotpath.Desc, notif []byte) (kvxfer.XferID, error) {
	nop, err := netOp(op)
	if err != nil {
		return 0, err
	}
	// One walk and one copy: the agent keeps this list (PostOwned).
	own := make([]netxfer.Desc, len(descs))
	for i, d := range descs {
		own[i] = netxfer.Desc{Local: d.Local, Remote: d.Remote, Len: d.Len}
	}
	id, err := n.a.PostOwned(nop, string(peer), own, notif)
	return kvxfer.XferID(id), mapNetErr(err)
}

// netOp is a transfer's direction as the agent names it.
func netOp(op hotpath.Op) (netxfer.Op, error) {
	switch op {
	case hotpath.OpWrite:
		return netxfer.Write, nil
	case hotpath.OpRead:
		return netxfer.Read, nil
	}
	return 0, fmt.Errorf("kvxfer: post op %v", op)
}

// State implements kvxfer.Backend.
func (n *Backend) State(id kvxfer.XferID) (kvxfer.XferState, error) {
	s, err := n.a.State(netxfer.XferID(id))
	if err != nil && s == 0 {
		return 0, mapNetErr(err)
	}
	switch s {
	case netxfer.Done:
		return kvxfer.XferDone, nil
	case netxfer.Failed:
		return kvxfer.XferFailed, mapNetErr(err)
	}
	return kvxfer.XferInProgress, nil
}

// Release implements kvxfer.Backend.
func (n *Backend) Release(id kvxfer.XferID) error { return mapNetErr(n.a.Release(netxfer.XferID(id))) }

// Notify implements kvxfer.Backend.
func (n *Backend) Notify(peer kvxfer.PeerName, msg []byte) error {
	return mapNetErr(n.a.Notify(string(peer), msg))
}

// DrainNotifs implements kvxfer.Backend.
func (n *Backend) DrainNotifs(dst []kvxfer.Notif) []kvxfer.Notif {
	for _, x := range n.a.Drain(nil) {
		dst = append(dst, kvxfer.Notif{From: kvxfer.PeerName(x.From), Msg: x.Msg})
	}
	return dst
}

// Events implements kvxfer.Backend.
func (n *Backend) Events() <-chan struct{} { return n.a.Events() }

// Close implements kvxfer.Backend.
func (n *Backend) Close() error { return n.a.Close() }

// SetGuard implements kvxfer.Guarded: the agent asks c about every range a peer
// names in a WRITE into or a READ of its memory, and about direct copies
// between agents of one process.
// A checker that is also a kvxfer.AccessFence (the Worker's table) fences
// the parts it admits: a grant revoked while a part lands returns only
// once the part has landed or was cut short.
func (n *Backend) SetGuard(c kvxfer.AccessChecker) error {
	if f, ok := c.(kvxfer.LayoutFence); ok {
		return n.a.SetGuard(&layoutFenceGuard{fenceGuard{netGuard: netGuard{c}, f: f}, f})
	}
	if f, ok := c.(kvxfer.AccessFence); ok {
		return n.a.SetGuard(&fenceGuard{netGuard: netGuard{c}, f: f})
	}
	return n.a.SetGuard(netGuard{c})
}

type netGuard struct{ c kvxfer.AccessChecker }

func (g netGuard) Check(peer string, op netxfer.Op, addr, n uint64) netxfer.Verdict {
	return verdict(g.c.CheckAccess(kvxfer.PeerName(peer), hotOp(op), addr, n))
}

func hotOp(op netxfer.Op) hotpath.Op {
	if op == netxfer.Read {
		return hotpath.OpRead
	}
	return hotpath.OpWrite
}

func verdict(a kvxfer.Access) netxfer.Verdict {
	switch a {
	case kvxfer.AccessAllow:
		return netxfer.Allow
	case kvxfer.AccessLate:
		return netxfer.Late
	}
	return netxfer.Deny
}

// fenceGuard is a netxfer.Fence over a kvxfer.AccessFence.
type fenceGuard struct {
	netGuard
	f kvxfer.AccessFence
}

func (g *fenceGuard) Admit(peer string, op netxfer.Op, ranges []netxfer.Region, tag []byte, abort func()) (netxfer.Verdict, int, uint64) {
	a, i, adm := g.f.Admit(kvxfer.PeerName(peer), hotOp(op), asRanges(ranges), tag, abort)
	return verdict(a), i, uint64(adm)
}

// asRanges views netxfer's regions as kvxfer's ranges (both are
// {Addr, Len uint64}: checked below), for the length of a call that
// keeps none of them: a part of thousands of pieces is not copied.
func asRanges(rs []netxfer.Region) []kvxfer.Range {
	return unsafe.Slice((*kvxfer.Range)(unsafe.Pointer(unsafe.SliceData(rs))), len(rs))
}

// The two range types agree field for field (a struct conversion
// compiles only then).
var _ = kvxfer.Range(netxfer.Region{})

func (g *fenceGuard) Done(ticket uint64) { g.f.Done(kvxfer.Admission(ticket)) }

// layoutFenceGuard is a netxfer.LayoutFence over a kvxfer.LayoutFence:
// layout parts are admitted as layouts.
type layoutFenceGuard struct {
	fenceGuard
	lf kvxfer.LayoutFence
}

func (g *layoutFenceGuard) AdmitLayout(peer string, op netxfer.Op, spans []netxfer.LayoutSpan, tag []byte, abort func()) (netxfer.Verdict, int, int, int, uint64) {
	var buf [4]kvxfer.LayoutRanges
	lays := buf[:0]
	for _, s := range spans {
		lays = append(lays, kvxfer.LayoutRanges{Bases: s.Bases, Entries: asRanges(s.Entries)})
	}
	a, li, bi, ei, adm := g.lf.AdmitLayout(kvxfer.PeerName(peer), hotOp(op), lays, tag, abort)
	return verdict(a), li, bi, ei, uint64(adm)
}

// AdmitGate admits a gate's grant as a standing admission where the
// Worker's table takes one (kvxfer.GateFence), else as a layout part.
func (g *layoutFenceGuard) AdmitGate(peer string, spans []netxfer.LayoutSpan, tag []byte, abort func()) (netxfer.Verdict, int, int, int, uint64) {
	gf, ok := g.lf.(kvxfer.GateFence)
	if !ok {
		return g.AdmitLayout(peer, netxfer.Write, spans, tag, abort)
	}
	var buf [4]kvxfer.LayoutRanges
	lays := buf[:0]
	for _, s := range spans {
		lays = append(lays, kvxfer.LayoutRanges{Bases: s.Bases, Entries: asRanges(s.Entries)})
	}
	a, li, bi, ei, adm := gf.AdmitGate(kvxfer.PeerName(peer), lays, tag, abort)
	return verdict(a), li, bi, ei, uint64(adm)
}

// OpenGate implements kvxfer.WriteGater: the grant's ranges are offered
// to peer as a gate (netxfer.Agent.OpenGate), so that its WRITEs inside
// them go one-sided, where both agents' memory is on one GPU of this
// host; kvxfer.ErrNoGate where no gate can be made.
func (n *Backend) OpenGate(peer kvxfer.PeerName, lays []kvxfer.LayoutRanges, tag []byte) error {
	spans := make([]netxfer.LayoutSpan, len(lays))
	for i, l := range lays {
		spans[i] = netxfer.LayoutSpan{Bases: l.Bases, Entries: *(*[]netxfer.Region)(unsafe.Pointer(&l.Entries))}
	}
	err := n.a.OpenGate(string(peer), spans, tag)
	if errors.Is(err, netxfer.ErrNoGate) {
		return fmt.Errorf("%w: %w", kvxfer.ErrNoGate, err)
	}
	return mapNetErr(err)
}

// Gates returns how many gates this backend has open for its peers and
// how many of its peers' it holds (see OpenGate).
func (n *Backend) Gates() (mine, peers int) { return n.a.GatesOpen() }

// Gateable implements kvxfer.WriteGater: some of the backend's memory is
// GPU memory on a device that makes gates (and gates are on).
func (n *Backend) Gateable() bool { return n.a.Gateable() }

// OneSidedWrites returns how many WRITEs this backend posted through a
// peer's gate (one-sided, see OpenGate).
func (n *Backend) OneSidedWrites() uint64 { return n.a.OneSidedWrites() }

// LayoutParts returns how many WRITE parts peers on this host sent this
// backend as layouts (see PostLayouts).
func (n *Backend) LayoutParts() uint64 { return n.a.LayoutParts() }

// PostLayouts implements kvxfer.LayoutPoster: a WRITE of layouts goes
// as layouts where the agent can (GPU memory on the same host: one
// launch, no piece listed), else as the pieces they stand for.
func (n *Backend) PostLayouts(op hotpath.Op, peer kvxfer.PeerName, l *hotpath.Layouts, notif []byte) (kvxfer.XferID, error) {
	nop, err := netOp(op)
	if err != nil {
		return 0, err
	}
	lays := make([]netxfer.Layout, len(l.Spans))
	for i, s := range l.Spans {
		bs := make([]netxfer.BasePair, s.B1-s.B0)
		for j, b := range l.Bases[s.B0:s.B1] {
			bs[j] = netxfer.BasePair{Local: b.Local, Remote: b.Remote}
		}
		lays[i] = netxfer.Layout{Bases: bs, Entries: asEntries(l.Entries[s.E0:s.E1])}
	}
	id, err := n.a.PostLayout(nop, string(peer), lays, notif)
	return kvxfer.XferID(id), mapNetErr(err)
}

// asEntries views hotpath's layout entries as netxfer's (both are
// {Local, Remote, Len uint64}) for a call that copies what it keeps.
func asEntries(es []hotpath.LayoutEntry) []netxfer.LayoutEntry {
	return unsafe.Slice((*netxfer.LayoutEntry)(unsafe.Pointer(unsafe.SliceData(es))), len(es))
}

var _ = netxfer.LayoutEntry(hotpath.LayoutEntry{})

var _ kvxfer.LayoutPoster = (*Backend)(nil)
