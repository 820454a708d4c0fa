package netxfer

import (
	"crypto/ed25519"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/internal/forkclose"
	"github.com/kvxfer/kvxfer/internal/peerauth"
)

// Errors. Wrapped with detail; match with errors.Is.
var (
	ErrClosed        = errors.New("netxfer: closed")
	ErrUnknownPeer   = errors.New("netxfer: unknown peer")
	ErrUnknownXfer   = errors.New("netxfer: unknown transfer")
	ErrOutOfBounds   = errors.New("netxfer: range outside registered memory")
	ErrBadMetadata   = errors.New("netxfer: bad peer metadata")
	ErrXferFailed    = errors.New("netxfer: transfer failed")
	ErrNotRegistered = errors.New("netxfer: memory not registered")
	ErrProtocol      = errors.New("netxfer: protocol error")
	// ErrDeviceMemory: GPU memory (MapDevice) named where only host
	// memory can go (TCP, the direct copy in one process).
	ErrDeviceMemory = errors.New("netxfer: GPU memory moves only on the same-host path (agents of one user on one host)")
)

// Region is a registered memory range.
type Region struct{ Addr, Len uint64 }

// Desc moves Len bytes between Local (this agent's memory) and Remote
// (the peer's).
type Desc struct{ Local, Remote, Len uint64 }

// Op is a transfer's direction.
type Op uint8

const (
	// Write moves local bytes to the peer.
	Write Op = iota + 1
	// Read moves the peer's bytes here.
	Read
)

// State is a transfer's state.
type State uint8

const (
	InProgress State = iota + 1
	Done
	Failed
)

// XferID names a posted transfer; 0 is invalid.
type XferID uint64

// Notif is a notification from a peer.
type Notif struct {
	From string
	Msg  []byte
}

// Config configures an Agent. Zero fields mean the defaults.
type Config struct {
	// Name is the agent's unique name (default: random). The agent's
	// name at its peers (Agent.Name) is Name followed by its key's tag
	// (see bind.go), at most maxName bytes in all.
	Name string
	// Listen is the TCP address for peers (default "127.0.0.1:0").
	Listen string
	// Advertise is the address peers dial (default: the listener's).
	Advertise string
	// Conns is the number of connections per peer that carry parts
	// (default 4). Above one, a peer gets one more, for notifications and
	// gates: they then never wait behind a part.
	Conns int
	// DialTimeout bounds one dial (default 5 s).
	DialTimeout time.Duration
	// DisableLocal turns off the direct copy between agents of one
	// process (tests of the TCP path).
	DisableLocal bool
	// DisableSameHost turns off the same-host path (see MapFile): the
	// agent neither listens on nor dials same-host sockets, and peers on
	// its host reach it over TCP.
	DisableSameHost bool
	// Devices returns this process's handle on the GPU of a UUID: a
	// same-host peer's GPU memory (MapDevice) is imported on it and copied
	// from or into. nil: GPU memory from peers is refused.
	Devices func(uuid [16]byte) (Device, error)
	// Auth authenticates every connection between agents (kvxfer's
	// peerauth, purpose "data"): the dialer proves it holds the shared
	// secret and names itself, and only that name's messages are accepted
	// on the connection. nil: no authentication (tests in one process).
	Auth *peerauth.Authenticator
	// ClientTLS and ServerTLS, when set, run every connection between
	// agents over TLS (mutual TLS: ServerTLS should require and verify
	// client certificates). ClientTLS's ServerName defaults to the host of
	// the address dialed.
	ClientTLS, ServerTLS *tls.Config
	// FrameTimeout bounds how long one incoming frame (a request and its
	// payload) and the connection's hello may take to arrive once started
	// (default 30 s): a peer that stalls mid-frame is cut off. It bounds
	// writing one outgoing frame (a part, a notification) too: a peer
	// that stops reading its connection fails it, and what waited to
	// write on it, instead of holding them for ever.
	FrameTimeout time.Duration
	// Logger (default slog.Default()).
	Logger *slog.Logger
	// WireTrace, when set, is called at each point of a WRITE part's way
	// between two agents (WireEvent), with the sender's transfer id and
	// the part: for tools that time the hops (bench/gpubench). It must be
	// quick and must not block.
	WireTrace func(ev WireEvent, id XferID, part uint32)
	// GateKey returns the key that matches a WRITE's notification to the
	// gate (OpenGate) its sender may write it through: kvxfer's names the
	// request both are for. nil: the notification itself, whole.
	GateKey func(notif []byte) string
	// DisableGates turns off one-sided WRITEs (see OpenGate): this agent
	// opens no gates, and its WRITEs take the two-sided path.
	DisableGates bool
	// MaxPendingPerAddr bounds the TCP connections from one remote IP
	// that have not yet authenticated and said their hello (default
	// DefaultMaxPendingPerAddr), and MaxIncoming the incoming TCP
	// connections open at once, from all (default DefaultMaxIncoming):
	// one past a bound is closed as it is accepted, and Refused, when
	// set, is called with why ("data_conns_per_addr", "data_conns"; it
	// must be quick). Peers that authenticate are not held back by the
	// first: each opens Conns+1 connections to an agent it talks to.
	MaxPendingPerAddr, MaxIncoming int
	Refused                        func(reason string)

	// noLayouts makes the agent act as a build from before layout frames
	// (tests of mixed builds): its same-host socket's name lacks
	// layoutsMark, and a layout frame drops the connection, as such a
	// build's does on a frame type it does not know.
	noLayouts bool
	// noGates makes the agent act as a build from before gates (its
	// same-host socket's name lacks gatesMark).
	noGates bool
	// noReadAcks makes the agent act as a build from before READ
	// acknowledgements (its socket's name lacks readAcksMark, and it
	// sends no tReadAcks); readAckGrace, if set, replaces readAckGrace.
	noReadAcks   bool
	readAckGrace time.Duration
	// noIdent makes the agent act as a build from before versionIdent
	// hellos (its same-host socket's name lacks identMark, it refuses
	// such hellos and sends none).
	noIdent bool
	// noBind makes the agent act as a build from before bound names (see
	// bind.go): its name is Name as given, it sends no versionBound hello
	// and refuses one. noIdent implies it.
	noBind bool
}

// WireEvent is a point of a WRITE part's way between two agents
// (Config.WireTrace).
type WireEvent uint8

const (
	// WirePartSent: the sender is about to write the part's frame (made)
	// to the socket.
	WirePartSent WireEvent = iota + 1
	// WirePartRead: the receiver read the part's header (before its
	// checks and copy).
	WirePartRead
	// WireAnswerSent: the receiver is about to write the part's answer
	// (its bytes landed, or why not).
	WireAnswerSent
	// WireAnswerRead: the sender read the answer (before the transfer is
	// marked).
	WireAnswerRead
)

// wire reports ev to Config.WireTrace, if set.
func (a *Agent) wire(ev WireEvent, id XferID, part uint32) {
	if a.cfg.WireTrace != nil {
		a.cfg.WireTrace(ev, id, part)
	}
}

// Agent is one transfer endpoint. It is safe for concurrent use.
type Agent struct {
	cfg Config
	// inc names this agent's incarnation in its hellos (versionIdent): a
	// process that restarts under the same name is told apart by it.
	inc string
	// pub and priv: the key pair its bound name is of (nil: noBind).
	pub          ed25519.PublicKey
	priv         ed25519.PrivateKey
	bindFailures atomic.Uint64
	ln           net.Listener
	addr         string
	// uln and uaddr: the same-host socket (nil and "" without one).
	uln        net.Listener
	uaddr      string
	shared     atomic.Int32  // chunks a same-host peer can copy from (a file or GPU memory)
	localParts atomic.Uint64 // parts copied in from same-host peers' files
	// layoutParts counts the layout parts received (tWriteLayout).
	layoutParts atomic.Uint64
	areaTables  atomic.Uint64 // their tables read from the peers' descriptor areas
	log         *slog.Logger
	events      chan struct{}
	// memMu is held for reading while bytes move into or out of memory;
	// Unmap holds it for writing, so memory never goes away under a copy.
	memMu        sync.RWMutex
	wg           sync.WaitGroup
	tlsFailures  atomic.Uint64
	acceptErrors atomic.Uint64
	guard        atomic.Pointer[guardBox]
	refusals     [Deny + 1]atomic.Uint64 // by Verdict
	gates        gateState
	oneSidedN    atomic.Uint64 // WRITEs posted through a peer's gate
	mu           struct {
		sync.Mutex
		closed    bool
		chunks    []chunk
		regs      []Region
		nextChunk uint32
		peers     map[string]*peer
		xfers     map[XferID]*xfer
		next      XferID
		inbox     []Notif
		incoming  map[net.Conn]bool
		localIn   map[*localServer]bool // same-host connections served
		landing   map[landKey]*landing
		// landingBy counts the unfinished multi-part WRITEs in landing
		// by peer (bounded per peer: maxLanding), served the connections
		// each peer has open to this agent (its unfinished WRITEs go
		// with its last).
		landingBy map[string]int
		served    map[session]int
		// tcpIn counts the incoming TCP connections (MaxIncoming), and
		// pending those not yet through their authentication and hello,
		// by remote IP (MaxPendingPerAddr).
		tcpIn   int
		pending map[string]int
	}
}

type chunk struct {
	base uint64
	mem  []byte // nil for GPU memory
	size uint64
	// dev, uuid and handle: GPU memory (mem nil), the CUDA IPC export of
	// the allocation it is (see MapDevice).
	dev    Device
	uuid   [16]byte
	handle [64]byte
	// id names the chunk on same-host connections; file (nil if none) is
	// a read-only reopening of the file mem maps from offset off.
	id   uint32
	file *os.File
	off  int64
}

// shareable reports whether a same-host peer can copy out of the chunk.
func (c *chunk) shareable() bool { return c.file != nil || c.dev != nil }

type landKey struct {
	peer string
	// inc is the sending process's (its agent's) incarnation, as its
	// hello named it ("" from a build that names none): a peer that
	// restarted under the same name numbers its transfers from 1 again,
	// and its parts are not counted with its predecessor's.
	inc string
	id  XferID
}

// session is one incarnation of a peer: the connections its agent opened.
type session struct{ peer, inc string }

// landing assembles the parts of an incoming WRITE; last is when a part
// of it last arrived (or it began).
type landing struct {
	landed, failed, parts int
	last                  time.Time
}

// local holds the agents of this process, for direct copies.
var local struct {
	sync.Mutex
	agents map[string]*Agent
}

// New starts an agent listening for peers.
func New(cfg Config) (*Agent, error) {
	if cfg.Name == "" {
		var b [8]byte
		_, _ = rand.Read(b[:])
		cfg.Name = "netxfer-" + hex.EncodeToString(b[:])
	}
	cfg.noBind = cfg.noBind || cfg.noIdent
	if n := maxName - boundTagLen; strings.ContainsAny(cfg.Name, "\n") || len(cfg.Name) > n {
		return nil, fmt.Errorf("netxfer: Config.Name %q: want one line of at most %d bytes", cfg.Name, n)
	}
	if cfg.Listen == "" {
		cfg.Listen = "127.0.0.1:0"
	}
	if cfg.Conns <= 0 {
		cfg.Conns = 4
	}
	if cfg.DialTimeout <= 0 {
		cfg.DialTimeout = 5 * time.Second
	}
	if cfg.FrameTimeout <= 0 {
		cfg.FrameTimeout = 30 * time.Second
	}
	if cfg.MaxPendingPerAddr <= 0 {
		cfg.MaxPendingPerAddr = DefaultMaxPendingPerAddr
	}
	if cfg.MaxIncoming <= 0 {
		cfg.MaxIncoming = DefaultMaxIncoming
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	local.Lock()
	defer local.Unlock()
	if local.agents == nil {
		local.agents = map[string]*Agent{}
	}
	if cfg.noBind && local.agents[cfg.Name] != nil {
		return nil, fmt.Errorf("netxfer: an agent named %q already exists in this process", cfg.Name)
	}
	ln, err := net.Listen("tcp", cfg.Listen)
	if err != nil {
		return nil, fmt.Errorf("netxfer: listen %s: %w", cfg.Listen, err)
	}
	forkclose.Listener(ln)
	var inc [12]byte
	_, _ = rand.Read(inc[:])
	a := &Agent{cfg: cfg, ln: ln, addr: cfg.Advertise, log: cfg.Logger, events: make(chan struct{}, 1), inc: hex.EncodeToString(inc[:])}
	if !cfg.noBind {
		a.bindName()
	}
	if a.addr == "" {
		a.addr = ln.Addr().String()
	}
	a.mu.peers = map[string]*peer{}
	a.mu.xfers = map[XferID]*xfer{}
	a.mu.incoming, a.mu.pending = map[net.Conn]bool{}, map[string]int{}
	a.mu.localIn = map[*localServer]bool{}
	a.mu.landing = map[landKey]*landing{}
	a.mu.landingBy, a.mu.served = map[string]int{}, map[session]int{}
	a.gates.areas, a.gates.open = map[Device]*gateArea{}, map[*gate]bool{}
	a.gates.views, a.gates.items = map[string]map[string]*gateView{}, map[string]int{}
	if !cfg.DisableSameHost {
		if err := a.listenLocal(); err != nil {
			a.log.Debug("netxfer: no same-host socket", "err", err)
		}
	}
	local.agents[a.cfg.Name] = a
	a.wg.Add(1)
	go a.accept(a.ln)
	if a.uln != nil {
		a.wg.Add(1)
		go a.accept(a.uln)
	}
	return a, nil
}

// AcceptErrors returns how many times accepting a connection failed
// (e.g. out of descriptors); the agent retried each time.
func (a *Agent) AcceptErrors() uint64 { return a.acceptErrors.Load() }

// TLSFailures returns how many TLS handshakes failed, dialing or served.
func (a *Agent) TLSFailures() uint64 { return a.tlsFailures.Load() }

// SameHostParts returns how many transfer parts this agent copied
// straight out of a same-host peer's memory files into its own memory:
// WRITEs from the peer, READs of the peer.
func (a *Agent) SameHostParts() uint64 { return a.localParts.Load() }

// LayoutParts returns how many WRITE parts same-host peers sent this
// agent as layouts (PostLayout) rather than as their pieces.
func (a *Agent) LayoutParts() uint64 { return a.layoutParts.Load() }

// Name returns the agent's name: Config.Name and its key's tag (a bound
// name, see bind.go).
func (a *Agent) Name() string { return a.cfg.Name }

// Addr returns the address peers dial.
func (a *Agent) Addr() string { return a.addr }

// Events receives a value (coalesced) when a notification arrives or a
// transfer leaves InProgress.
func (a *Agent) Events() <-chan struct{} { return a.events }

func (a *Agent) signal() {
	select {
	case a.events <- struct{}{}:
	default:
	}
}

// Settle waits for the landings into this agent's memory in progress to
// end, and orders the caller's earlier accesses to that memory before
// every landing that begins after it (for a program, a test, that reads
// memory the agent writes: what orders those is a socket, which the race
// detector does not see).
func (a *Agent) Settle() {
	a.memMu.Lock()
	//lint:ignore SA2001 the empty critical section is the point: it orders
	a.memMu.Unlock()
}

// Map adopts caller-owned memory at base (kvxferd: a mapped
// shared-memory file). It must not overlap mapped memory.
func (a *Agent) Map(base uint64, mem []byte) error {
	return a.mapChunk(chunk{base: base, mem: mem, size: uint64(len(mem))})
}

func (a *Agent) mapChunk(ch chunk) error {
	base, size := ch.base, ch.size
	if size == 0 || base+size < base {
		return fmt.Errorf("netxfer: map [%#x, +%d): empty or wrapping", base, size)
	}
	a.memMu.Lock()
	defer a.memMu.Unlock()
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return ErrClosed
	}
	for _, c := range a.mu.chunks {
		if base < c.base+c.size && c.base < base+size {
			return fmt.Errorf("netxfer: map [%#x, +%d): overlaps [%#x, +%d)", base, size, c.base, c.size)
		}
	}
	a.mu.nextChunk++
	ch.id = a.mu.nextChunk
	if ch.shareable() {
		a.shared.Add(1)
	}
	a.mu.chunks = append(a.mu.chunks, ch)
	slices.SortFunc(a.mu.chunks, func(x, y chunk) int { return cmpU64(x.base, y.base) })
	return nil
}

// Unmap forgets memory mapped at base, and every region registered in
// it. It waits for transfers moving bytes in or out of memory. Memory
// adopted with MapFile may still be read by same-host peers copying a
// WRITE or a READ: Unmap breaks the agent's same-host connections (their
// transfers in flight fail, and what a peer copies from now on does not
// count).
func (a *Agent) Unmap(base uint64) error {
	a.memMu.Lock()
	defer a.memMu.Unlock()
	// Peers' launches through the gates over it end first (OpenGate
	// holds memMu for reading until its gate is announced).
	a.shutGates(func(g *gate) bool { return slices.Contains(g.chunks, base) })
	a.mu.Lock()
	i := slices.IndexFunc(a.mu.chunks, func(c chunk) bool { return c.base == base })
	if i < 0 {
		a.mu.Unlock()
		return fmt.Errorf("netxfer: unmap %#x: %w", base, ErrNotRegistered)
	}
	c := a.mu.chunks[i]
	a.mu.chunks = slices.Delete(a.mu.chunks, i, i+1)
	a.mu.regs = slices.DeleteFunc(a.mu.regs, func(r Region) bool {
		return r.Addr >= c.base && r.Addr-c.base < c.size
	})
	var peers []*peer
	var served []*localServer
	if c.shareable() {
		a.shared.Add(-1)
		for _, p := range a.mu.peers {
			peers = append(peers, p)
		}
		for s := range a.mu.localIn {
			served = append(served, s)
		}
	}
	a.mu.Unlock()
	for _, p := range peers {
		p.dropLocal(fmt.Errorf("%w: memory at %#x unmapped", ErrXferFailed, base))
	}
	for _, s := range served {
		s.withdraw()
	}
	if c.file != nil {
		_ = c.file.Close()
	}
	return nil
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// sliceLocked returns mapped memory behind [addr, addr+n).
func (a *Agent) sliceLocked(addr, n uint64) ([]byte, bool) {
	cs := a.mu.chunks
	i, _ := slices.BinarySearchFunc(cs, addr, func(c chunk, t uint64) int {
		if c.base > t {
			return 1
		}
		return -1
	})
	if i == 0 {
		return nil, false
	}
	c := cs[i-1]
	o := addr - c.base
	if o > uint64(len(c.mem)) || n > uint64(len(c.mem))-o {
		return nil, false
	}
	return c.mem[o : o+n : o+n], true
}

// inside reports whether [addr, addr+n) lies inside r.
func (r Region) inside(addr, n uint64) bool {
	return addr >= r.Addr && addr-r.Addr <= r.Len && n <= r.Len-(addr-r.Addr)
}

// regionLocked returns a registered region holding [addr, addr+n): the
// regions are kept sorted by address, so a binary search finds the one
// starting last at or below addr; registrations that overlap (allowed)
// fall back to a scan.
func (a *Agent) regionLocked(addr, n uint64) (Region, bool) {
	regs := a.mu.regs
	i, _ := slices.BinarySearchFunc(regs, addr, func(r Region, t uint64) int {
		if r.Addr > t {
			return 1
		}
		return -1
	})
	if i > 0 && regs[i-1].inside(addr, n) {
		return regs[i-1], true
	}
	for _, r := range regs {
		if r.inside(addr, n) {
			return r, true
		}
	}
	return Region{}, false
}

// resolve bounds-checks ranges against registered memory and returns
// their bytes. Callers hold memMu for reading while they use the bytes.
// A range in the region of the one before it (a sorted or coalesced list)
// costs one comparison; any other, a binary search.
func (a *Agent) resolve(dst [][]byte, ranges []Region) ([][]byte, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return dst, ErrClosed
	}
	dst = slices.Grow(dst, len(ranges))
	var c cursor
	for i, r := range ranges {
		b, ok := c.bytes(a, r.Addr, r.Len)
		if !ok {
			return dst, a.outOfBoundsLocked(i, r.Addr, r.Len)
		}
		dst = append(dst, b)
	}
	return dst, nil
}

// outOfBoundsLocked is the error of range i, whose bytes resolve did not
// find: GPU memory (moved only on the same-host path) or memory not
// registered.
func (a *Agent) outOfBoundsLocked(i int, addr, n uint64) error {
	if _, ok := a.regionLocked(addr, n); ok {
		if c := a.chunkLocked(addr); c != nil && c.dev != nil {
			return fmt.Errorf("range %d [%#x, +%d) on %s: %w", i, addr, n, a.cfg.Name, ErrDeviceMemory)
		}
	}
	return fmt.Errorf("range %d [%#x, +%d) on %s: %w", i, addr, n, a.cfg.Name, ErrOutOfBounds)
}

// checkLocal bounds-checks the local side of descs (registered memory,
// host or GPU), allocating nothing.
func (a *Agent) checkLocal(descs []Desc) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return ErrClosed
	}
	var c regionCursor
	for i, d := range descs {
		if !c.inside(a, d.Local, d.Len) {
			return fmt.Errorf("range %d [%#x, +%d) on %s: %w", i, d.Local, d.Len, a.cfg.Name, ErrOutOfBounds)
		}
	}
	return nil
}

// regionCursor checks ranges against registered regions, remembering the
// last range's region (a sorted or coalesced list costs one comparison a
// range).
type regionCursor struct {
	cur Region
	ok  bool
}

func (c *regionCursor) inside(a *Agent, addr, n uint64) bool {
	if c.ok && c.cur.inside(addr, n) {
		return true
	}
	c.cur, c.ok = a.regionLocked(addr, n)
	return c.ok
}

// cursor finds the bytes of ranges, remembering the last range's region:
// a range in it (a sorted or coalesced list) costs one comparison.
type cursor struct {
	cur Region
	mem []byte // cur's bytes (a region lies inside one mapped chunk)
}

// bytes returns the registered bytes of [addr, addr+n) (a.mu held).
func (c *cursor) bytes(a *Agent, addr, n uint64) ([]byte, bool) {
	if c.mem == nil || !c.cur.inside(addr, n) {
		reg, ok := a.regionLocked(addr, n)
		var mem []byte
		if ok {
			mem, ok = a.sliceLocked(reg.Addr, reg.Len)
		}
		if !ok {
			return nil, false
		}
		c.cur, c.mem = reg, mem
	}
	o := addr - c.cur.Addr
	return c.mem[o : o+n : o+n], true
}

// Register makes regions usable; each must lie inside mapped memory.
func (a *Agent) Register(regions []Region) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return ErrClosed
	}
	for i, r := range regions {
		if r.Len == 0 {
			return fmt.Errorf("netxfer: register region %d: Len = 0", i)
		}
		if c := a.chunkLocked(r.Addr); c == nil || r.Len > c.size-(r.Addr-c.base) {
			return fmt.Errorf("netxfer: register region %d [%#x, +%d): not mapped", i, r.Addr, r.Len)
		}
	}
	for _, r := range regions {
		i, _ := slices.BinarySearchFunc(a.mu.regs, r.Addr, func(x Region, t uint64) int { return cmpU64(x.Addr, t) })
		a.mu.regs = slices.Insert(a.mu.regs, i, r)
	}
	return nil
}

// Deregister removes regions.
func (a *Agent) Deregister(regions []Region) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return ErrClosed
	}
	for i, r := range regions {
		k := slices.Index(a.mu.regs, r)
		if k < 0 {
			return fmt.Errorf("netxfer: deregister region %d [%#x, +%d): %w", i, r.Addr, r.Len, ErrNotRegistered)
		}
		a.mu.regs = slices.Delete(a.mu.regs, k, k+1)
	}
	return nil
}

const metaPrefix = "netxfer1\n"

// Metadata returns the blob a peer loads to reach this agent.
// A same-host socket, when the agent has one, follows on a third line:
// "unix <name>".
func (a *Agent) Metadata() []byte {
	m := metaPrefix + a.cfg.Name + "\n" + a.addr
	if a.uaddr != "" {
		m += "\nunix " + a.uaddr
	}
	return []byte(m)
}

// LoadPeer loads a peer's metadata and returns its name.
func (a *Agent) LoadPeer(meta []byte) (string, error) {
	rest, ok := strings.CutPrefix(string(meta), metaPrefix)
	name, addr, ok2 := strings.Cut(rest, "\n")
	addr, uline, hasU := strings.Cut(addr, "\n")
	uaddr, okU := strings.CutPrefix(uline, "unix @")
	if !ok || !ok2 || name == "" || addr == "" || len(name) > maxName ||
		hasU && (!okU || uaddr == "" || len(uaddr) > 100 || strings.ContainsAny(uaddr, "\n\x00")) {
		return "", fmt.Errorf("netxfer: load peer: %w (%d bytes)", ErrBadMetadata, len(meta))
	}
	if hasU {
		uaddr = "@" + uaddr
	}
	layouts := strings.HasSuffix(uaddr, layoutsMark)
	gates := layouts && strings.HasSuffix(uaddr, gatesMark+layoutsMark)
	readAcks := hasMark(uaddr, readAcksMark) && !a.cfg.noReadAcks
	ident := ""
	if hasMark(uaddr, identMark) && !a.cfg.noIdent {
		ident = uaddr
	}
	if a.cfg.DisableSameHost {
		uaddr = ""
	}
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return "", ErrClosed
	}
	old := a.mu.peers[name]
	if old != nil && old.addr == addr && old.uaddr == uaddr && old.ident == ident {
		a.mu.Unlock()
		return name, nil
	}
	p := &peer{owner: a, name: name, addr: addr, uaddr: uaddr, layouts: layouts, gates: gates, readAcks: readAcks, ident: ident}
	if !a.cfg.DisableLocal {
		local.Lock()
		if l := local.agents[name]; l != nil && l.addr == addr {
			p.local = l
		}
		local.Unlock()
	}
	a.mu.peers[name] = p
	a.mu.Unlock()
	if old != nil {
		// Closed once a.mu is let go: failing its connections fails their
		// parts under a.mu.
		old.close(fmt.Errorf("%w: peer %s moved to %s", ErrXferFailed, name, addr))
	}
	return name, nil
}

// InvalidatePeer forgets a peer; its transfers in flight fail. It returns
// once none of them moves bytes in or out of this agent's memory: parts
// landing or going out when the peer's connections close end with them
// (a same-host copy or GPU launch runs to its end, which is bounded), and
// no part begins after. The caller may then report them and let the
// engine reuse their blocks; it still calls Release for each.
func (a *Agent) InvalidatePeer(name string) error {
	a.mu.Lock()
	p := a.mu.peers[name]
	delete(a.mu.peers, name)
	a.mu.Unlock()
	if p == nil {
		return fmt.Errorf("netxfer: invalidate %q: %w", name, ErrUnknownPeer)
	}
	err := fmt.Errorf("%w: peer %s invalidated", ErrXferFailed, name)
	p.close(err)
	a.mu.Lock()
	var idle []chan struct{}
	for _, x := range a.mu.xfers {
		if x.peer != p {
			continue
		}
		x.failLocked(err) // no part of it begins to move bytes from now on
		if x.landing > 0 {
			if x.idle == nil {
				x.idle = make(chan struct{})
			}
			idle = append(idle, x.idle)
		}
	}
	a.mu.Unlock()
	a.signal()
	for _, ch := range idle {
		<-ch
	}
	return nil
}

func (a *Agent) peer(name string) (*peer, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return nil, ErrClosed
	}
	p := a.mu.peers[name]
	if p == nil {
		return nil, fmt.Errorf("netxfer: peer %q: %w", name, ErrUnknownPeer)
	}
	return p, nil
}

// Notify sends a bare notification.
func (a *Agent) Notify(name string, msg []byte) error {
	if len(msg) > maxNotif {
		return fmt.Errorf("netxfer: notify %q: %d bytes exceed %d", name, len(msg), maxNotif)
	}
	p, err := a.peer(name)
	if err != nil {
		return err
	}
	return a.notifyPeer(p, msg)
}

// notifyPeer sends a bare notification to p (as loaded: a peer loaded
// again under its name since, or invalidated, fails it).
func (a *Agent) notifyPeer(p *peer, msg []byte) error {
	name := p.name
	if p.local != nil {
		p.mu.Lock()
		dead := p.dead
		p.mu.Unlock()
		if dead != nil {
			return dead
		}
		return p.local.deliver(a.cfg.Name, slices.Clone(msg))
	}
	// On the connection gates go on, one for all notifications: the peer
	// reads them in the order they were sent, a registration after the
	// gate of its grant, and parts (on the others) do not hold them up.
	// The caller never waits for the peer: not for a part being written
	// (writeNotif), nor for a dial past dialWait (a host that does not
	// answer): the notification then waits for the connection the dial
	// makes, or is dropped with it.
	frame := appendNotif(nil, msg)
	p.mu.Lock()
	if p.dead != nil {
		p.mu.Unlock()
		return p.dead
	}
	p.dropBrokenLocked()
	if len(p.conns) > 0 {
		c := p.conns[0]
		p.mu.Unlock()
		return c.writeNotif(frame)
	}
	if d := p.first; d != nil && d.abandoned {
		// A dial already outlasted its wait: this one waits with the
		// others for its end.
		if p.pendingBytes+len(frame) > maxNotifQueue && len(p.pending) > 0 {
			n := p.pendingBytes
			p.mu.Unlock()
			return fmt.Errorf("%w: notify %q: %d bytes already wait for a connection (at most %d)", ErrXferFailed, name, n, maxNotifQueue)
		}
		p.pending = append(p.pending, frame)
		p.pendingBytes += len(frame)
		p.mu.Unlock()
		return nil
	}
	if p.first == nil && p.slowErr != nil && time.Since(p.slowAt) < a.cfg.DialTimeout {
		// The last dial took DialTimeout to fail: not another one yet.
		err := p.slowErr
		p.mu.Unlock()
		return fmt.Errorf("netxfer: notify %q: %w", name, err)
	}
	d := p.first
	if d == nil {
		var err error
		if d, err = p.dialFirstLocked(); err != nil {
			p.mu.Unlock()
			return fmt.Errorf("netxfer: notify %q: %w", name, err)
		}
	}
	p.pending = append(p.pending, frame)
	p.pendingBytes += len(frame)
	p.mu.Unlock()
	t := time.NewTimer(dialWait)
	defer t.Stop()
	select {
	case <-d.done:
	case <-t.C:
		p.mu.Lock()
		ended := p.first != d
		d.abandoned = d.abandoned || !ended
		p.mu.Unlock()
		if !ended {
			return nil // queued: the dial goes on
		}
	}
	if d.err != nil {
		return fmt.Errorf("netxfer: notify %q: %w", name, d.err)
	}
	return nil
}

// deliver queues a notification from peer.
func (a *Agent) deliver(from string, msg []byte) error {
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return ErrClosed
	}
	a.mu.inbox = append(a.mu.inbox, Notif{From: from, Msg: msg})
	a.mu.Unlock()
	a.signal()
	return nil
}

// Drain appends the notifications received since the last call.
func (a *Agent) Drain(dst []Notif) []Notif {
	a.mu.Lock()
	defer a.mu.Unlock()
	dst = append(dst, a.mu.inbox...)
	clear(a.mu.inbox)
	a.mu.inbox = a.mu.inbox[:0]
	return dst
}

// Close stops the agent: the listener and every connection close, every
// transfer in flight fails. It is idempotent and returns once the agent's
// goroutines exited.
func (a *Agent) Close() error {
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		a.wg.Wait()
		return nil
	}
	a.mu.closed = true
	peers := a.mu.peers
	a.mu.peers = map[string]*peer{}
	incoming := a.mu.incoming
	a.mu.incoming = map[net.Conn]bool{}
	for s := range a.mu.localIn {
		s.withdraw() // before any connection closes: READs being copied do not count
	}
	for _, x := range a.mu.xfers {
		x.failLocked(fmt.Errorf("%w: agent closed", ErrXferFailed))
	}
	a.mu.Unlock()
	_ = a.ln.Close()
	if a.uln != nil {
		_ = a.uln.Close()
	}
	for _, p := range peers {
		p.close(fmt.Errorf("%w: agent closed", ErrXferFailed))
	}
	a.shutGates(func(*gate) bool { return true })
	for c := range incoming {
		_ = c.Close()
	}
	local.Lock()
	if local.agents[a.cfg.Name] == a {
		delete(local.agents, a.cfg.Name)
	}
	local.Unlock()
	a.wg.Wait()
	a.memMu.Lock()
	a.mu.Lock()
	for i := range a.mu.chunks {
		if f := a.mu.chunks[i].file; f != nil {
			_ = f.Close()
			a.mu.chunks[i].file = nil
		}
	}
	a.mu.Unlock()
	a.memMu.Unlock()
	a.signal()
	return nil
}

// accept serves incoming connections on ln.
func (a *Agent) accept(ln net.Listener) {
	defer a.wg.Done()
	var backoff time.Duration
	for {
		c, err := ln.Accept()
		if err != nil {
			if errors.Is(err, net.ErrClosed) {
				return
			}
			// Out of descriptors (EMFILE, ENFILE) or another passing error:
			// wait and accept again, never stop serving for good.
			a.mu.Lock()
			closed := a.mu.closed
			a.mu.Unlock()
			if closed {
				return
			}
			backoff = min(max(2*backoff, 5*time.Millisecond), time.Second)
			a.acceptErrors.Add(1)
			a.log.Warn("netxfer: accept failed; retrying", "err", err, "in", backoff)
			time.Sleep(backoff)
			continue
		}
		backoff = 0
		a.mu.Lock()
		if a.mu.closed {
			a.mu.Unlock()
			_ = c.Close()
			return
		}
		var in *tcpIncoming
		if ta, ok := c.RemoteAddr().(*net.TCPAddr); ok {
			in = &tcpIncoming{a: a, host: ta.IP.String()}
			reason := ""
			switch {
			case a.mu.pending[in.host] >= a.cfg.MaxPendingPerAddr:
				reason = "data_conns_per_addr"
			case a.mu.tcpIn >= a.cfg.MaxIncoming:
				reason = "data_conns"
			}
			if reason != "" {
				a.mu.Unlock()
				if a.cfg.Refused != nil {
					a.cfg.Refused(reason) // counted before the dialer can see the close
				}
				_ = c.Close()
				continue
			}
			a.mu.pending[in.host]++
			a.mu.tcpIn++
			in.pending = true
		}
		a.mu.incoming[c] = true
		a.wg.Add(1)
		a.mu.Unlock()
		go a.serve(c, in)
	}
}

// DefaultMaxPendingPerAddr and DefaultMaxIncoming are Config's bounds on
// incoming TCP connections: those not yet authenticated from one IP, and
// all of them.
const DefaultMaxPendingPerAddr, DefaultMaxIncoming = 64, 4096

// tcpIncoming is an incoming TCP connection as the bounds count it.
type tcpIncoming struct {
	a       *Agent
	host    string
	pending bool // counted in a.mu.pending (a.mu guards it)
}

// hello says that the connection authenticated and said its hello: it is
// pending no more.
func (in *tcpIncoming) hello() {
	if in == nil {
		return
	}
	in.a.mu.Lock()
	in.unpendLocked()
	in.a.mu.Unlock()
}

func (in *tcpIncoming) unpendLocked() {
	if in.pending {
		in.pending = false
		if in.a.mu.pending[in.host]--; in.a.mu.pending[in.host] <= 0 {
			delete(in.a.mu.pending, in.host)
		}
	}
}

// closed says that the connection closed.
func (in *tcpIncoming) closed() {
	if in == nil {
		return
	}
	in.a.mu.Lock()
	in.unpendLocked()
	in.a.mu.tcpIn--
	in.a.mu.Unlock()
}

// readFull reads exactly len(b) bytes.
func readFull(r io.Reader, b []byte) error {
	_, err := io.ReadFull(r, b)
	return err
}
