package kvxfer

import (
	"crypto/tls"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/netxfer"
	"github.com/kvxfer/kvxfer/internal/peerauth"
)

// NetConfig configures the built-in backend (see NewNetBackend).
type NetConfig struct {
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
	// Auth authenticates the connections between agents (nil: none; the
	// daemon always sets it, insecure only with -insecure-peers).
	Auth *peerauth.Authenticator
	// ClientTLS and ServerTLS run the connections between agents over
	// mutual TLS (kvxferd -tls-*), see netxfer.Config.
	ClientTLS, ServerTLS *tls.Config
	Logger               *slog.Logger
}

// NetBackend is the built-in Backend: TCP between kvxferd processes with
// zero-copy sends and receives, and a direct copy between agents of one
// process. Memory is caller-owned and adopted with Map before Register.
// It is safe for concurrent use.
type NetBackend struct {
	a    *netxfer.Agent
	pool sync.Pool // *[]netxfer.Desc
}

var (
	_ Backend = (*NetBackend)(nil)
	_ Guarded = (*NetBackend)(nil)
)

// NewNetBackend starts a built-in backend agent.
func NewNetBackend(cfg NetConfig) (*NetBackend, error) {
	a, err := netxfer.New(netxfer.Config{Name: cfg.Name, Listen: cfg.Listen, Advertise: cfg.Advertise,
		Conns: cfg.Conns, DisableLocal: cfg.DisableLocal, Auth: cfg.Auth, ClientTLS: cfg.ClientTLS, ServerTLS: cfg.ServerTLS, Logger: cfg.Logger})
	if err != nil {
		return nil, err
	}
	return &NetBackend{a: a}, nil
}

// Name returns the agent's name (its PeerName at peers).
func (n *NetBackend) Name() PeerName { return PeerName(n.a.Name()) }

// Addr returns the TCP address peers dial.
func (n *NetBackend) Addr() string { return n.a.Addr() }

// Map adopts caller-owned memory at base (a mapped shared-memory file).
func (n *NetBackend) Map(base uint64, mem []byte) error { return mapNetErr(n.a.Map(base, mem)) }

// Unmap forgets memory mapped at base, waiting for transfers using it.
func (n *NetBackend) Unmap(base uint64) error { return mapNetErr(n.a.Unmap(base)) }

// mapNetErr gives netxfer's errors kvxfer's sentinels.
func mapNetErr(err error) error {
	if err == nil {
		return nil
	}
	for _, p := range [...]struct{ from, to error }{
		{netxfer.ErrOutOfBounds, ErrOutOfBounds}, {netxfer.ErrClosed, ErrClosed}, {netxfer.ErrUnknownPeer, ErrUnknownPeer},
		{netxfer.ErrUnknownXfer, ErrUnknownXfer}, {netxfer.ErrBadMetadata, ErrBadMetadata},
		{netxfer.ErrNotRegistered, ErrNotRegistered}, {netxfer.ErrNotGranted, ErrNotGranted}, {netxfer.ErrXferFailed, ErrXferFailed},
	} {
		if errors.Is(err, p.from) {
			return fmt.Errorf("%w: %w", p.to, err)
		}
	}
	return err
}

func netRegions(rs []MemRegion) []netxfer.Region {
	out := make([]netxfer.Region, len(rs))
	for i, r := range rs {
		out[i] = netxfer.Region{Addr: r.Addr, Len: r.Len}
	}
	return out
}

// Register implements Backend.
func (n *NetBackend) Register(regions []MemRegion) error {
	return mapNetErr(n.a.Register(netRegions(regions)))
}

// Deregister implements Backend.
func (n *NetBackend) Deregister(regions []MemRegion) error {
	return mapNetErr(n.a.Deregister(netRegions(regions)))
}

// LocalMetadata implements Backend.
func (n *NetBackend) LocalMetadata() ([]byte, error) { return n.a.Metadata(), nil }

// LoadPeer implements Backend.
func (n *NetBackend) LoadPeer(meta []byte) (PeerName, error) {
	name, err := n.a.LoadPeer(meta)
	return PeerName(name), mapNetErr(err)
}

// InvalidatePeer implements Backend.
func (n *NetBackend) InvalidatePeer(peer PeerName) error {
	return mapNetErr(n.a.InvalidatePeer(string(peer)))
}

// Post implements Backend.
func (n *NetBackend) Post(op hotpath.Op, peer PeerName, descs []hotpath.Desc, notif []byte) (XferID, error) {
	nop := netxfer.Write
	switch op {
	case hotpath.OpWrite:
	case hotpath.OpRead:
		nop = netxfer.Read
	default:
		return 0, fmt.Errorf("kvxfer: post op %v", op)
	}
	bp, _ := n.pool.Get().(*[]netxfer.Desc)
	if bp == nil {
		bp = new([]netxfer.Desc)
	}
	buf := (*bp)[:0]
	for _, d := range descs {
		buf = append(buf, netxfer.Desc{Local: d.Local, Remote: d.Remote, Len: d.Len})
	}
	id, err := n.a.Post(nop, string(peer), buf, notif)
	*bp = buf[:0]
	n.pool.Put(bp)
	return XferID(id), mapNetErr(err)
}

// State implements Backend.
func (n *NetBackend) State(id XferID) (XferState, error) {
	s, err := n.a.State(netxfer.XferID(id))
	if err != nil && s == 0 {
		return 0, mapNetErr(err)
	}
	switch s {
	case netxfer.Done:
		return XferDone, nil
	case netxfer.Failed:
		return XferFailed, mapNetErr(err)
	}
	return XferInProgress, nil
}

// Release implements Backend.
func (n *NetBackend) Release(id XferID) error { return mapNetErr(n.a.Release(netxfer.XferID(id))) }

// Notify implements Backend.
func (n *NetBackend) Notify(peer PeerName, msg []byte) error {
	return mapNetErr(n.a.Notify(string(peer), msg))
}

// DrainNotifs implements Backend.
func (n *NetBackend) DrainNotifs(dst []Notif) []Notif {
	for _, x := range n.a.Drain(nil) {
		dst = append(dst, Notif{From: PeerName(x.From), Msg: x.Msg})
	}
	return dst
}

// Events implements Backend.
func (n *NetBackend) Events() <-chan struct{} { return n.a.Events() }

// Close implements Backend.
func (n *NetBackend) Close() error { return n.a.Close() }

// SetGuard implements Guarded: the agent asks c about every range a peer
// names in a WRITE into or a READ of its memory, and about direct copies
// between agents of one process.
func (n *NetBackend) SetGuard(c AccessChecker) error { return n.a.SetGuard(netGuard{c}) }

type netGuard struct{ c AccessChecker }

func (g netGuard) Check(peer string, op netxfer.Op, addr, n uint64) netxfer.Verdict {
	hop := hotpath.OpWrite
	if op == netxfer.Read {
		hop = hotpath.OpRead
	}
	switch g.c.CheckAccess(PeerName(peer), hop, addr, n) {
	case AccessAllow:
		return netxfer.Allow
	case AccessLate:
		return netxfer.Late
	}
	return netxfer.Deny
}
