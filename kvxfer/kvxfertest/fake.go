package kvxfertest

import (
	"fmt"
	"strings"
	"sync"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// Fabric connects the fake agents of one process. Memory comes from
// Agent.Alloc: real byte slices at synthetic addresses unique in the
// fabric, so a descriptor can only ever touch the slice it was checked
// against.
//
// A Fabric and its agents are safe for concurrent use.
type Fabric struct {
	faults Faults
	mu     struct {
		sync.Mutex
		agents   map[string]*Agent
		nextBase uint64
	}
}

// NewFabric returns an empty fabric with no faults armed.
func NewFabric() *Fabric {
	f := &Fabric{}
	f.mu.agents = map[string]*Agent{}
	f.mu.nextBase = 1 << 32
	f.faults.stalled = map[kvxfer.PeerName]bool{}
	return f
}

// Faults returns the fabric's fault injector.
func (f *Fabric) Faults() *Faults { return &f.faults }

// NewAgent adds an agent. Names are unique in a fabric.
func (f *Fabric) NewAgent(name string) (*Agent, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if name == "" || strings.ContainsRune(name, '\n') {
		return nil, fmt.Errorf("kvxfertest: agent name %q, want a non-empty single line", name)
	}
	if _, ok := f.mu.agents[name]; ok {
		return nil, fmt.Errorf("kvxfertest: agent %q already exists", name)
	}
	a := &Agent{fabric: f, name: name, events: make(chan struct{}, 1)}
	a.mu.peers = map[kvxfer.PeerName]bool{}
	a.mu.xfers = map[kvxfer.XferID]*xfer{}
	f.mu.agents[name] = a
	return a, nil
}

func (f *Fabric) agent(name kvxfer.PeerName) *Agent {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.mu.agents[string(name)]
}

func (f *Fabric) base(n uint64) uint64 {
	f.mu.Lock()
	defer f.mu.Unlock()
	b := f.mu.nextBase
	f.mu.nextBase += (n + 4095) &^ 4095
	f.mu.nextBase += 4096 // a guard gap between allocations
	return b
}

// chunk is one allocation of an agent.
type chunk struct {
	base uint64
	mem  []byte
}

type xfer struct {
	op     hotpath.Op
	peer   kvxfer.PeerName
	descs  []hotpath.Desc
	notif  []byte
	state  kvxfer.XferState
	reason error
	fail   bool // injected failure
	ruin   bool // injected corruption
}

// Agent is a fake backend agent: transfers copy between real byte slices
// of the fabric's agents, and notifications are delivered after the bytes.
// A transfer runs when it is posted, or, while its peer is stalled, on the
// first State poll after the stall is lifted.
type Agent struct {
	fabric *Fabric
	name   string
	events chan struct{}
	mu     struct {
		sync.Mutex
		closed     bool
		chunks     []chunk
		registered []kvxfer.MemRegion
		peers      map[kvxfer.PeerName]bool
		xfers      map[kvxfer.XferID]*xfer
		nextID     kvxfer.XferID
		inbox      []kvxfer.Notif
		posted     int
	}
}

// Posted returns how many transfers were posted by this agent.
func (a *Agent) Posted() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.mu.posted
}

// InFlight returns how many transfers this agent posted are still in
// progress.
func (a *Agent) InFlight() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	n := 0
	for _, x := range a.mu.xfers {
		if x.state == kvxfer.XferInProgress {
			n++
		}
	}
	return n
}

var _ kvxfer.Backend = (*Agent)(nil)

// Name returns the agent's name, which is its PeerName for other agents.
func (a *Agent) Name() kvxfer.PeerName { return kvxfer.PeerName(a.name) }

// Alloc returns a new zeroed memory range of n bytes on device dev. It is
// not registered yet.
func (a *Agent) Alloc(n int, dev int32) kvxfer.MemRegion {
	base := a.fabric.base(uint64(n))
	a.mu.Lock()
	defer a.mu.Unlock()
	a.mu.chunks = append(a.mu.chunks, chunk{base: base, mem: make([]byte, n)})
	return kvxfer.MemRegion{Addr: base, Len: uint64(n), Dev: dev, Kind: kvxfer.MemDRAM}
}

// Map adopts caller-owned memory at base, the way kvxferd maps an engine's
// shared-memory file: transfers then read and write mem itself. It is not
// registered yet. The range must not overlap the agent's other memory.
func (a *Agent) Map(base uint64, mem []byte) (kvxfer.MemRegion, error) {
	if len(mem) == 0 || base+uint64(len(mem)) < base {
		return kvxfer.MemRegion{}, fmt.Errorf("kvxfertest: map [%#x, +%d): empty or wrapping", base, len(mem))
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for _, c := range a.mu.chunks {
		if base < c.base+uint64(len(c.mem)) && c.base < base+uint64(len(mem)) {
			return kvxfer.MemRegion{}, fmt.Errorf("kvxfertest: map [%#x, +%d): overlaps [%#x, +%d)", base, len(mem), c.base, len(c.mem))
		}
	}
	a.mu.chunks = append(a.mu.chunks, chunk{base: base, mem: mem})
	return kvxfer.MemRegion{Addr: base, Len: uint64(len(mem)), Kind: kvxfer.MemDRAM}, nil
}

// Bytes returns the allocated bytes behind [addr, addr+n), for tests to
// fill and check. It panics when the range was never allocated: that is a
// broken test, not an input error.
func (a *Agent) Bytes(addr, n uint64) []byte {
	a.mu.Lock()
	defer a.mu.Unlock()
	b, ok := a.sliceLocked(addr, n)
	if !ok {
		panic(fmt.Sprintf("kvxfertest: [%#x, +%d) is not allocated by agent %s", addr, n, a.name))
	}
	return b
}

func (a *Agent) sliceLocked(addr, n uint64) ([]byte, bool) {
	for _, c := range a.mu.chunks {
		if addr >= c.base && addr-c.base <= uint64(len(c.mem)) && n <= uint64(len(c.mem))-(addr-c.base) {
			o := addr - c.base
			return c.mem[o : o+n], true
		}
	}
	return nil, false
}

// registeredLocked returns the bytes of [addr, addr+n) when the range lies
// inside one registered region.
func (a *Agent) registeredLocked(addr, n uint64) ([]byte, bool) {
	for _, r := range a.mu.registered {
		if addr >= r.Addr && addr-r.Addr <= r.Len && n <= r.Len-(addr-r.Addr) {
			return a.sliceLocked(addr, n)
		}
	}
	return nil, false
}

// Register implements kvxfer.Backend. Regions must lie inside memory from
// Alloc.
func (a *Agent) Register(regions []kvxfer.MemRegion) error {
	if err := a.fabric.faults.take(&a.fabric.faults.failRegister); err != nil {
		return fmt.Errorf("register: %w", err)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return kvxfer.ErrClosed
	}
	for i, r := range regions {
		if r.Len == 0 {
			return fmt.Errorf("kvxfertest: register region %d: Len = 0", i)
		}
		if _, ok := a.sliceLocked(r.Addr, r.Len); !ok {
			return fmt.Errorf("kvxfertest: register region %d [%#x, +%d): not allocated by agent %s", i, r.Addr, r.Len, a.name)
		}
	}
	a.mu.registered = append(a.mu.registered, regions...)
	return nil
}

// Deregister implements kvxfer.Backend.
func (a *Agent) Deregister(regions []kvxfer.MemRegion) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return kvxfer.ErrClosed
	}
	for i, r := range regions {
		k := -1
		for j, have := range a.mu.registered {
			if have == r {
				k = j
				break
			}
		}
		if k < 0 {
			return fmt.Errorf("deregister region %d [%#x, +%d): %w", i, r.Addr, r.Len, kvxfer.ErrNotRegistered)
		}
		a.mu.registered = append(a.mu.registered[:k], a.mu.registered[k+1:]...)
	}
	return nil
}

const metaPrefix = "kvxfertest-agent:"

// LocalMetadata implements kvxfer.Backend.
func (a *Agent) LocalMetadata() ([]byte, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return nil, kvxfer.ErrClosed
	}
	return []byte(metaPrefix + a.name), nil
}

// LoadPeer implements kvxfer.Backend.
func (a *Agent) LoadPeer(meta []byte) (kvxfer.PeerName, error) {
	if err := a.fabric.faults.take(&a.fabric.faults.failLoadPeer); err != nil {
		return "", fmt.Errorf("load peer: %w", err)
	}
	name, ok := strings.CutPrefix(string(meta), metaPrefix)
	if !ok || a.fabric.agent(kvxfer.PeerName(name)) == nil {
		return "", fmt.Errorf("load peer %q: %w", meta, kvxfer.ErrBadMetadata)
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return "", kvxfer.ErrClosed
	}
	a.mu.peers[kvxfer.PeerName(name)] = true
	return kvxfer.PeerName(name), nil
}

// InvalidatePeer implements kvxfer.Backend: the peer's transfers that have
// not run yet fail.
func (a *Agent) InvalidatePeer(peer kvxfer.PeerName) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return kvxfer.ErrClosed
	}
	if !a.mu.peers[peer] {
		return fmt.Errorf("invalidate %q: %w", peer, kvxfer.ErrUnknownPeer)
	}
	delete(a.mu.peers, peer)
	for _, x := range a.mu.xfers {
		if x.peer == peer && x.state == kvxfer.XferInProgress {
			x.state, x.reason = kvxfer.XferFailed, fmt.Errorf("%w: peer %q invalidated", kvxfer.ErrXferFailed, peer)
		}
	}
	a.signal()
	return nil
}

// Post implements kvxfer.Backend. Descriptors are bounds-checked against
// registered regions on both sides at once; an out-of-bounds descriptor
// fails the call and moves nothing.
func (a *Agent) Post(op hotpath.Op, peer kvxfer.PeerName, descs []hotpath.Desc, notif []byte) (kvxfer.XferID, error) {
	if op != hotpath.OpWrite && op != hotpath.OpRead {
		return 0, fmt.Errorf("kvxfertest: post op %v", op)
	}
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return 0, kvxfer.ErrClosed
	}
	if !a.mu.peers[peer] {
		a.mu.Unlock()
		return 0, fmt.Errorf("post to %q: %w", peer, kvxfer.ErrUnknownPeer)
	}
	for i, d := range descs {
		if _, ok := a.registeredLocked(d.Local, d.Len); !ok {
			a.mu.Unlock()
			return 0, fmt.Errorf("post desc %d local [%#x, +%d): %w", i, d.Local, d.Len, kvxfer.ErrOutOfBounds)
		}
	}
	a.mu.Unlock()
	p := a.fabric.agent(peer)
	if p == nil {
		return 0, fmt.Errorf("post to %q: %w", peer, kvxfer.ErrUnknownPeer)
	}
	if err := p.checkRemote(descs); err != nil {
		return 0, err
	}
	f := &a.fabric.faults
	x := &xfer{op: op, peer: peer, descs: append([]hotpath.Desc(nil), descs...), notif: append([]byte(nil), notif...),
		state: kvxfer.XferInProgress, fail: f.take(&f.failTransfer) != nil, ruin: f.take(&f.corruptTransfer) != nil}
	if notif == nil {
		x.notif = nil
	}
	a.mu.Lock()
	a.mu.nextID++
	a.mu.posted++
	id := a.mu.nextID
	a.mu.xfers[id] = x
	a.mu.Unlock()
	a.progress(x)
	return id, nil
}

// checkRemote bounds-checks descriptors against this agent's registered
// regions (as the remote side).
func (a *Agent) checkRemote(descs []hotpath.Desc) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return fmt.Errorf("peer %s: %w", a.name, kvxfer.ErrClosed)
	}
	for i, d := range descs {
		if _, ok := a.registeredLocked(d.Remote, d.Len); !ok {
			return fmt.Errorf("post desc %d remote [%#x, +%d) on %s: %w", i, d.Remote, d.Len, a.name, kvxfer.ErrOutOfBounds)
		}
	}
	return nil
}

// progress runs a transfer unless its peer is stalled or it already ran.
func (a *Agent) progress(x *xfer) {
	f := &a.fabric.faults
	if f.isStalled(x.peer) {
		return
	}
	a.mu.Lock()
	if x.state != kvxfer.XferInProgress {
		a.mu.Unlock()
		return
	}
	a.mu.Unlock()
	err := a.run(x)
	a.mu.Lock()
	defer a.mu.Unlock()
	if x.state != kvxfer.XferInProgress { // invalidated meanwhile
		return
	}
	if err != nil {
		x.state, x.reason = kvxfer.XferFailed, err
	} else {
		x.state = kvxfer.XferDone
	}
	a.signal()
}

// signal wakes whoever waits on Events; a pending signal absorbs it.
func (a *Agent) signal() {
	select {
	case a.events <- struct{}{}:
	default:
	}
}

// Events implements kvxfer.Backend.
func (a *Agent) Events() <-chan struct{} { return a.events }

// run copies the bytes, then delivers the notification.
func (a *Agent) run(x *xfer) error {
	if x.fail {
		return fmt.Errorf("%w: injected failure", kvxfer.ErrXferFailed)
	}
	p := a.fabric.agent(x.peer)
	if p == nil {
		return fmt.Errorf("%w: peer %q is gone", kvxfer.ErrXferFailed, x.peer)
	}
	// Lock both agents in name order (a transfer to oneself locks once).
	first, second := a, p
	if p.name < a.name {
		first, second = p, a
	}
	first.mu.Lock()
	if second != first {
		second.mu.Lock()
	}
	var err error
	if p.mu.closed {
		err = fmt.Errorf("%w: peer %q closed", kvxfer.ErrXferFailed, x.peer)
	}
	for i := 0; err == nil && i < len(x.descs); i++ {
		d := x.descs[i]
		l, lok := a.registeredLocked(d.Local, d.Len)
		r, rok := p.registeredLocked(d.Remote, d.Len)
		if !lok || !rok { // deregistered since Post
			err = fmt.Errorf("%w: desc %d: %w", kvxfer.ErrXferFailed, i, kvxfer.ErrOutOfBounds)
			break
		}
		if x.op == hotpath.OpWrite {
			copy(r, l)
		} else {
			copy(l, r)
		}
	}
	if err == nil && x.ruin && len(x.descs) > 0 && x.descs[0].Len > 0 {
		d := x.descs[0]
		if x.op == hotpath.OpWrite {
			b, _ := p.registeredLocked(d.Remote, 1)
			b[0] ^= 0xff
		} else {
			b, _ := a.registeredLocked(d.Local, 1)
			b[0] ^= 0xff
		}
	}
	if second != first {
		second.mu.Unlock()
	}
	first.mu.Unlock()
	if err == nil && x.notif != nil {
		p.deliver(kvxfer.Notif{From: a.Name(), Msg: x.notif})
	}
	return err
}

// deliver hands a notification to this agent's inbox, through the
// notification faults.
func (a *Agent) deliver(n kvxfer.Notif) {
	f := &a.fabric.faults
	if f.take(&f.dropNotif) != nil {
		return
	}
	if f.take(&f.delayNotif) != nil {
		f.hold(a, n)
		return
	}
	copies := 1
	if f.take(&f.duplicateNotif) != nil {
		copies = 2
	}
	reorder := f.take(&f.reorderNotif) != nil
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return
	}
	for i := 0; i < copies; i++ {
		if reorder {
			a.mu.inbox = append([]kvxfer.Notif{n}, a.mu.inbox...)
		} else {
			a.mu.inbox = append(a.mu.inbox, n)
		}
	}
	a.signal()
}

// State implements kvxfer.Backend.
func (a *Agent) State(id kvxfer.XferID) (kvxfer.XferState, error) {
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return 0, kvxfer.ErrClosed
	}
	x, ok := a.mu.xfers[id]
	a.mu.Unlock()
	if !ok {
		return 0, fmt.Errorf("state of transfer %d: %w", id, kvxfer.ErrUnknownXfer)
	}
	a.progress(x)
	a.mu.Lock()
	defer a.mu.Unlock()
	return x.state, x.reason
}

// Release implements kvxfer.Backend.
func (a *Agent) Release(id kvxfer.XferID) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return kvxfer.ErrClosed
	}
	if _, ok := a.mu.xfers[id]; !ok {
		return fmt.Errorf("release transfer %d: %w", id, kvxfer.ErrUnknownXfer)
	}
	delete(a.mu.xfers, id)
	return nil
}

// Notify implements kvxfer.Backend.
func (a *Agent) Notify(peer kvxfer.PeerName, msg []byte) error {
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return kvxfer.ErrClosed
	}
	known := a.mu.peers[peer]
	a.mu.Unlock()
	if !known {
		return fmt.Errorf("notify %q: %w", peer, kvxfer.ErrUnknownPeer)
	}
	if err := a.fabric.faults.take(&a.fabric.faults.failNotify); err != nil {
		return fmt.Errorf("notify %q: %w", peer, err)
	}
	p := a.fabric.agent(peer)
	if p == nil {
		return fmt.Errorf("notify %q: %w", peer, kvxfer.ErrUnknownPeer)
	}
	p.deliver(kvxfer.Notif{From: a.Name(), Msg: append([]byte(nil), msg...)})
	return nil
}

// DrainNotifs implements kvxfer.Backend.
func (a *Agent) DrainNotifs(dst []kvxfer.Notif) []kvxfer.Notif {
	a.mu.Lock()
	defer a.mu.Unlock()
	dst = append(dst, a.mu.inbox...)
	a.mu.inbox = a.mu.inbox[:0]
	return dst
}

// Close implements kvxfer.Backend. It is idempotent.
func (a *Agent) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.closed {
		return nil
	}
	a.mu.closed = true
	a.mu.registered = nil
	a.mu.inbox = nil
	for _, x := range a.mu.xfers {
		if x.state == kvxfer.XferInProgress {
			x.state, x.reason = kvxfer.XferFailed, fmt.Errorf("%w: agent closed", kvxfer.ErrXferFailed)
		}
	}
	return nil
}
