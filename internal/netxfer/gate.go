package netxfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"os"
	"slices"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// One-sided same-host WRITEs into GPU memory (gates).
//
// On the two-sided same-host path a WRITE crosses between the processes
// twice: the part to the receiver, which checks it against its grants
// and launches the copy, and the answer back. Each crossing wakes a
// sleeping process, which on the virtual machines GPUs are rented as
// costs tens of microseconds: more than the GPU takes to move a few MiB.
// A gate takes both off a WRITE's way. The receiver (D) admits a whole
// grant ahead, when it is made (OpenGate: its fence admits every range of
// it, as one landing, for the request it names), and announces it to the
// sender (P) with what P needs to write it itself: D's GPU memory (its
// CUDA IPC export) and a gate, GateSize bytes of D's GPU memory (a slot of
// an area D allocated and exported) holding the grant's generation. P
// then posts a WRITE for that request whose every piece lies in the grant
// as one launch of the gated copy kernel, from its memory straight into
// D's, and once the launch is done sends D the transfer's notification:
// no part, no answer.
//
// What D gives up by not seeing the part, the gate and P keep:
//   - P writes only what the grant covers: it checks every piece against
//     the granted ranges D announced (the same ranges D's fence admitted)
//     before the launch, and a WRITE that is not wholly inside one goes
//     the two-sided way, where D checks it. Both ends run as the same user
//     (the same-host path checks it), who could write D's memory anyway:
//     the checks keep an honest P's mistakes out of D's blocks, as D's own
//     checks do on the two-sided path.
//   - Nothing lands once the grant ended. The grant's end cuts its
//     landing short (the fence's abort): D stores a new generation in the
//     gate, then waits until no CTA is inside it. Each CTA of a gated
//     launch counts itself in, reads the generation, copies only if it is
//     the one its launch was given, and counts itself out after its
//     stores are visible (kernel/copy.cu in internal/cuda); so a CTA that
//     read the old generation is waited for, and every later one copies
//     nothing and marks the launch shut: P fails the transfer instead of
//     notifying D. Only then does the fence hear the landing is done,
//     and the grant's end return.
//   - A P that dies mid-launch cannot count itself out: D stops waiting
//     once P's process is gone (its GPU context, and every launch of it,
//     with it), and clears what it left counted.
//
// P's transfer is done once its launch ended and the notification was
// written to its connection to D (on the two-sided path, once D
// acknowledged it): a connection that breaks between the two leaves D's
// request to end by its deadline or its peer's liveness, as any lost
// peer does.
//
// Gates are used where both agents' memory is on one GPU of a device that
// makes them (GateDevice), the agents are on one host and the sender's
// agent takes them (gatesMark); anywhere else, and whenever P finds no
// gate for a WRITE, the two-sided path serves, unchanged.

// GateDevice is a BatchDevice that can make gates: device memory of this
// process that same-host peers import (kvxferd: a CUDA device).
type GateDevice interface {
	BatchDevice
	Alloc(n int) (uint64, error)
	Free(ptr uint64) error
	Export(ptr uint64) ([64]byte, error)
	// SideCopyIn and SideCopyOut copy a few bytes to and from device
	// memory and return once they landed, waiting for no other work of
	// the process: in an engine's own process, the gates' words are not
	// held up behind its kernels (CopyIn and CopyOut, on CUDA's legacy
	// default stream, would wait for them).
	SideCopyIn(dst uint64, src []byte) error
	SideCopyOut(dst []byte, src uint64) error
}

// GatedBatch is a DevBatch whose launch can be gated: its CTAs copy only
// while the gate at device address gate reads generation want (see
// internal/cuda's Batch.Gate).
type GatedBatch interface {
	DevBatch
	// Gate gates the batch; false: this device cannot (it stays
	// ungated, and the WRITE goes two-sided).
	Gate(gate uint64, want uint32) bool
}

// GatedCopy is a gated batch in flight: once Done, Shut reports whether
// some of its CTAs found the gate shut (and copied nothing).
type GatedCopy interface {
	DevCopy
	Shut() bool
}

// GateFence is a LayoutFence that admits a gate's grant (OpenGate) as a
// standing admission: as AdmitLayout, lasting until the grant ends, whose
// cut at that end is its normal end. OpenGate uses AdmitLayout with a
// fence that is not one.
type GateFence interface {
	LayoutFence
	AdmitGate(peer string, spans []LayoutSpan, tag []byte, abort func()) (v Verdict, lay, base, entry int, ticket uint64)
}

// ErrNoGate: OpenGate made no gate (the peer, the memory or the devices
// do not allow one); the two-sided path serves the grant.
var ErrNoGate = errors.New("netxfer: no gate")

const (
	// GateSize is the bytes of one gate (internal/cuda's kvxfer_gate): a
	// uint32 generation at 0 and gateShards uint32 counts of CTAs from
	// gateActiveOff.
	GateSize      = 128
	gateActiveOff = 64
	gateShards    = 16
	// gateSlots is the gates of one area (one per device of the agent's):
	// the grants open at once toward all peers.
	gateSlots = 4096

	// D to P, on a same-host connection D dialed (the frames ride with
	// the notifications that tell P of the grants they are for):
	//
	// tGateArea: area u32, uuid [16], handle [64]: D's gates on the GPU
	// of uuid (gateSlots×GateSize bytes, the CUDA IPC export handle).
	tGateArea = 23
	// tGateChunk: chunk u32, base u64, size u64, uuid [16], handle [64]:
	// D's GPU memory at [base, base+size) of D's addresses, an allocation
	// exported as handle.
	tGateChunk = 24
	// tGateOpen: area u32, slot u32, gen u32, key u32 | key | nspan u32 |
	// nspan×(nbase u32, nent u32, nbase×(addr u64, chunk u32),
	// nent×(off u64, len u64)): a grant, its ranges given as LayoutSpans
	// (every entry at every base), each base with the chunk it lies in.
	tGateOpen = 25
	// tGateShut: area u32, slot u32, gen u32: the grant ended (P forgets
	// it; a late launch of it would copy nothing anyway).
	tGateShut = 26

	// gatesMark is in the same-host socket's name of an agent that takes
	// gate frames, before layoutsMark (which older builds look for at its
	// end).
	gatesMark = ".gates"

	maxGateTable = 4 + maxLayouts*8 + maxDescs*16
)

// gateState is an agent's gates: those it opened for its peers (D side)
// and those its peers opened for it (P side).
type gateState struct {
	mu    sync.Mutex
	areas map[Device]*gateArea
	nArea uint32
	open  map[*gate]bool
	// views are the peers' gates by peer and key; items, the bases and
	// entries they hold by peer (bounded: maxGateItems).
	views map[string]map[string]*gateView
	items map[string]int
	// areaWarned: a gate area could not be made, and the log said so.
	areaWarned bool
	// stage is stageOneSided's scratch, reused from post to post (a.mu
	// held; a batch copies what AddLayout hands it).
	stage struct {
		regs []DevRegion
		ents []DevEntry
		seen []gateChecked
	}
	// unfit are the devices whose gated launches failed to post here:
	// WRITEs from their memory go two-sided (logged once per device).
	unfit map[Device]bool
}

// maxGateItems bounds the bases and entries of the gates one peer may
// have this agent hold at once (a request's grant is a few hundred; a
// variable for tests).
var maxGateItems = 1 << 22

// size is what a view counts against its peer's bound.
func (v *gateView) size() int {
	n := len(v.bases)
	for _, e := range v.ents {
		n += len(e)
	}
	for _, e := range v.order {
		n += len(e)
	}
	return n
}

// dropViewLocked forgets the view of peer under key (a.gates.mu held).
func (st *gateState) dropViewLocked(peer, key string) {
	if v := st.views[peer][key]; v != nil {
		st.items[peer] -= v.size()
		delete(st.views[peer], key)
	}
}

// gateSentKey names a gate area (area) or a chunk announced on a
// connection.
type gateSentKey struct {
	area bool
	id   uint32
}

// gateArea is one device's gates (D side).
type gateArea struct {
	id     uint32
	dev    GateDevice
	uuid   [16]byte
	ptr    uint64
	handle [64]byte
	free   []uint32
	gen    []uint32 // the last generation each slot was given
}

// gate is an open grant (D side).
type gate struct {
	area      *gateArea
	slot, gen uint32
	peer      string
	chunks    []uint64 // the bases of the chunks it covers
	ticket    uint64
	c         *conn // the connection it was announced on
	pid       int   // the peer's process
	// proc is that process itself (a pidfd where the kernel has them),
	// taken when the gate opened: its id alone may name another process
	// once the peer died (ids are reused), which would read as alive.
	proc     *os.Process
	shutting bool
	done     chan struct{}
}

// gateView is a peer's gate (P side).
type gateView struct {
	area, slot, gen uint32
	ptr             uint64 // the gate, mapped here
	dev             Device
	bases           []gateBase // sorted by addr
	ents            [][]Region // per span: sorted by Addr, merged
	// order is each span's entries as the gate listed them (those of
	// no bytes left out): a WRITE of the request's blocks in the same
	// order is checked against them in one walk (inOrder), where
	// checking its entries one by one in ents costs a search each.
	order [][]Region
	srv   *localServer
}

type gateBase struct {
	addr  uint64
	span  int
	chunk *gateChunk
}

// gateChunk is D's GPU memory as P imported it.
type gateChunk struct {
	base, size uint64
	imp        *devImport
}

// gateKey is the key a gate and a WRITE are matched by: the request the
// notification names (Config.GateKey), else the notification itself.
func (a *Agent) gateKey(notif []byte) string {
	if a.cfg.GateKey != nil {
		return a.cfg.GateKey(notif)
	}
	return string(notif)
}

// Gateable reports whether OpenGate could make a gate at all: gates are
// on and some of the agent's memory is GPU memory of a GateDevice.
func (a *Agent) Gateable() bool {
	if a.cfg.DisableGates {
		return false
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	for i := range a.mu.chunks {
		if _, ok := a.mu.chunks[i].dev.(GateDevice); ok {
			return true
		}
	}
	return false
}

// OpenGate admits a WRITE grant to peer ahead (every range of spans, for
// the request tag names, through the agent's LayoutFence) and offers it to
// the peer as a gate, so that the peer's WRITEs inside it go one-sided
// (see above). The admission lasts until the fence cuts it short (the
// grant's end: abort), the connection it was offered on ends, or the
// agent closes; each shuts the gate and waits for the launches inside it
// first. ErrNoGate: no gate could be made (the two-sided path serves).
func (a *Agent) OpenGate(peer string, spans []LayoutSpan, tag []byte) error {
	if a.cfg.DisableGates || a.gateKey(tag) == "" {
		return ErrNoGate
	}
	p, err := a.peer(peer)
	if err != nil {
		return err
	}
	if p.local != nil || !p.gates || p.uaddr == "" {
		return ErrNoGate
	}
	f, ok := a.layoutFence()
	if !ok {
		return ErrNoGate
	}
	// (The notification of its grant follows on the connection; a
	// Worker's loop waits at most dialWait for a first one.)
	c, err := p.firstConnWithin(dialWait)
	if errors.Is(err, errDialing) {
		return ErrNoGate
	}
	if err != nil {
		return err
	}
	if c.uc == nil {
		return ErrNoGate
	}
	// The chunks the spans lie in: GPU memory of one device that makes
	// gates.
	a.memMu.RLock()
	a.mu.Lock()
	var dev GateDevice
	var uuid [16]byte
	var chunks []*chunk
	for _, s := range spans {
		lo, hi := ^uint64(0), uint64(0)
		for _, e := range s.Entries {
			if e.Len > 0 {
				lo, hi = min(lo, e.Addr), max(hi, e.Addr+e.Len)
			}
		}
		if hi == 0 {
			continue
		}
		for _, b := range s.Bases {
			at := b + lo
			ch := a.chunkLocked(at)
			if at < b || ch == nil || ch.dev == nil || at-ch.base > ch.size || hi-lo > ch.size-(at-ch.base) {
				a.mu.Unlock()
				a.memMu.RUnlock()
				return ErrNoGate
			}
			gd, ok := ch.dev.(GateDevice)
			if !ok || dev != nil && gd != dev {
				a.mu.Unlock()
				a.memMu.RUnlock()
				return ErrNoGate
			}
			dev, uuid = gd, ch.uuid
			if !slices.Contains(chunks, ch) {
				chunks = append(chunks, ch)
			}
		}
	}
	// Copies: the chunks' slice may move once a.mu is let go. memMu
	// stays read-held until the gate is announced: Unmap, which shuts
	// the gates over what it unmaps, waits for it.
	held := make([]chunk, len(chunks))
	for i, ch := range chunks {
		held[i] = *ch
	}
	a.mu.Unlock()
	defer a.memMu.RUnlock()
	if dev == nil {
		return ErrNoGate // nothing to write
	}
	g := &gate{peer: peer, c: c, done: make(chan struct{})}
	for _, ch := range held {
		g.chunks = append(g.chunks, ch.base)
	}
	// The shut waits for the peer's CTAs until its process is gone: a
	// peer whose process id this one cannot see (0: another PID
	// namespace, as containers of one pod) would read as gone at once.
	pid, err := peerPID(c.uc)
	if err != nil || pid <= 0 {
		return ErrNoGate
	}
	g.pid = pid
	// Found while its connection is live: the process it names is the
	// peer's (os.FindProcess holds it by a pidfd where it can).
	if g.proc, err = os.FindProcess(pid); err != nil {
		return ErrNoGate
	}
	admit := func(abort func()) (Verdict, int, int, int, uint64) {
		return f.AdmitLayout(peer, Write, spans, tag, abort)
	}
	if gf, ok := f.(GateFence); ok {
		admit = func(abort func()) (Verdict, int, int, int, uint64) { return gf.AdmitGate(peer, spans, tag, abort) }
	}
	v, li, bi, ei, ticket := admit(func() { a.shutGate(g) })
	if v != Allow {
		_ = g.proc.Release()
		a.refusals[min(v, Deny)].Add(1)
		return fmt.Errorf("%w: gate for %s: layout %d base %d entry %d of %s", ErrNotGranted, peer, li, bi, ei, a.cfg.Name)
	}
	g.ticket = ticket
	if err := a.announceGate(g, dev, uuid, held, spans, a.gateKey(tag)); err != nil {
		a.shutGate(g)
		<-g.done
		if errors.Is(err, ErrNoGate) {
			return err
		}
		return fmt.Errorf("netxfer: gate for %s: %w", peer, err)
	}
	return nil
}

// announceGate takes a slot for g, stores its generation, and sends the
// gate (and what the peer lacks of its area and chunks) on g.c.
func (a *Agent) announceGate(g *gate, dev GateDevice, uuid [16]byte, chunks []chunk, spans []LayoutSpan, key string) error {
	// The slot and its generation are set under the lock shutGate
	// takes: a gate shut meanwhile is never opened after its drain.
	st := &a.gates
	st.mu.Lock()
	if g.shutting || a.isClosed() {
		st.mu.Unlock()
		return ErrNoGate
	}
	ar, err := a.gateAreaLocked(dev, uuid)
	if err != nil {
		// No memory for the gates (an engine's process may hold most of
		// its GPU's): two-sided, said once, tried again at the next grant.
		warn := !st.areaWarned
		st.areaWarned = true
		st.mu.Unlock()
		if warn {
			a.log.Warn("netxfer: no gate area on this device: grants are served two-sided until one can be made", "err", err)
		}
		return ErrNoGate
	}
	if len(ar.free) == 0 {
		st.mu.Unlock()
		return ErrNoGate // every slot in use
	}
	slot := ar.free[len(ar.free)-1]
	gen := ar.gen[slot] + 1
	if gen == 0 {
		gen = 1
	}
	var w, back [4]byte
	binary.LittleEndian.PutUint32(w[:], gen)
	// Read back (a belt and braces: the side copies return once landed).
	if err := dev.SideCopyIn(ar.ptr+uint64(slot)*GateSize, w[:]); err != nil {
		st.mu.Unlock()
		return fmt.Errorf("store the gate's generation: %w", err)
	}
	if err := dev.SideCopyOut(back[:], ar.ptr+uint64(slot)*GateSize); err != nil || back != w {
		st.mu.Unlock()
		return fmt.Errorf("store the gate's generation: read back %x, %v", back, err)
	}
	ar.free = ar.free[:len(ar.free)-1]
	ar.gen[slot] = gen
	g.area, g.slot, g.gen = ar, slot, gen
	st.open[g] = true
	st.mu.Unlock()
	h := make([]byte, 0, 256)
	c := g.c
	c.lockWrite()
	defer c.wmu.Unlock()
	if c.gateSent == nil {
		c.gateSent = map[gateSentKey]bool{}
	}
	if !c.gateSent[gateSentKey{area: true, id: ar.id}] {
		h = append(h, tGateArea)
		h = binary.LittleEndian.AppendUint32(h, ar.id)
		h = append(h, ar.uuid[:]...)
		h = append(h, ar.handle[:]...)
	}
	for _, ch := range chunks {
		if !c.gateSent[gateSentKey{id: ch.id}] {
			h = append(h, tGateChunk)
			h = binary.LittleEndian.AppendUint32(h, ch.id)
			h = binary.LittleEndian.AppendUint64(h, ch.base)
			h = binary.LittleEndian.AppendUint64(h, ch.size)
			h = append(h, ch.uuid[:]...)
			h = append(h, ch.handle[:]...)
		}
	}
	h = append(h, tGateOpen)
	h = binary.LittleEndian.AppendUint32(h, ar.id)
	h = binary.LittleEndian.AppendUint32(h, g.slot)
	h = binary.LittleEndian.AppendUint32(h, g.gen)
	h = binary.LittleEndian.AppendUint32(h, uint32(len(key)))
	h = append(h, key...)
	h = binary.LittleEndian.AppendUint32(h, uint32(len(spans)))
	for _, s := range spans {
		h = binary.LittleEndian.AppendUint32(h, uint32(len(s.Bases)))
		h = binary.LittleEndian.AppendUint32(h, uint32(len(s.Entries)))
		for _, b := range s.Bases {
			id := uint32(0)
			for _, ch := range chunks {
				if b >= ch.base && b-ch.base < ch.size {
					id = ch.id
				}
			}
			h = binary.LittleEndian.AppendUint64(h, b)
			h = binary.LittleEndian.AppendUint32(h, id)
		}
		for _, e := range s.Entries {
			h = binary.LittleEndian.AppendUint64(h, e.Addr)
			h = binary.LittleEndian.AppendUint64(h, e.Len)
		}
	}
	if len(h) > maxGateTable+256 {
		return ErrNoGate
	}
	if _, err := c.c.Write(h); err != nil {
		c.wmu.Unlock()
		c.fail(fmt.Errorf("%w: write to %s: %w", ErrXferFailed, c.p.name, err))
		c.wmu.Lock()
		return err
	}
	c.gateSent[gateSentKey{area: true, id: ar.id}] = true
	for _, ch := range chunks {
		c.gateSent[gateSentKey{id: ch.id}] = true
	}
	c.mu.Lock()
	gone := c.err != nil
	if !gone {
		c.gates = append(c.gates, g)
	}
	c.mu.Unlock()
	if gone {
		return ErrNoGate
	}
	return nil
}

// gateAreaLocked returns dev's gate area, making it first if need be
// (a.gates.mu held). An area is kept for the process's life, not freed
// when the agent closes: a peer may still hold it imported, and a late
// launch of the peer's reading freed memory would fault the peer's GPU
// context (512 KiB of GPU memory per device an agent gated on).
func (a *Agent) gateAreaLocked(dev GateDevice, uuid [16]byte) (*gateArea, error) {
	st := &a.gates
	if ar := st.areas[dev]; ar != nil {
		return ar, nil
	}
	n := gateSlots * GateSize
	ptr, err := dev.Alloc(n)
	if err != nil {
		return nil, fmt.Errorf("allocate gates: %w", err)
	}
	if err := dev.SideCopyIn(ptr, make([]byte, n)); err != nil {
		_ = dev.Free(ptr)
		return nil, fmt.Errorf("clear gates: %w", err)
	}
	h, err := dev.Export(ptr)
	if err != nil {
		_ = dev.Free(ptr)
		return nil, fmt.Errorf("export gates: %w", err)
	}
	st.nArea++
	ar := &gateArea{id: st.nArea, dev: dev, uuid: uuid, ptr: ptr, handle: h, gen: make([]uint32, gateSlots)}
	for i := gateSlots - 1; i >= 0; i-- {
		ar.free = append(ar.free, uint32(i))
	}
	st.areas[dev] = ar
	return ar, nil
}

// shutGate shuts g (once) and, on a goroutine of its own, waits for the
// launches inside it, tells the peer, frees its slot and ends its
// admission. It never blocks: the fence calls it holding its lock.
func (a *Agent) shutGate(g *gate) {
	st := &a.gates
	st.mu.Lock()
	if g.shutting {
		st.mu.Unlock()
		return
	}
	g.shutting = true
	st.mu.Unlock()
	go a.drainGate(g)
}

// gateSlowDrain is how long a drain goes before it says so in the log.
const gateSlowDrain = 5 * time.Second

func (a *Agent) drainGate(g *gate) {
	defer close(g.done)
	defer a.releaseGuard(g.ticket)
	defer func() {
		if g.proc != nil {
			_ = g.proc.Release()
		}
	}()
	st := &a.gates
	st.mu.Lock()
	ar := g.area
	st.mu.Unlock()
	if ar == nil { // never opened (and now never will be): nothing can be inside
		return
	}
	at := ar.ptr + uint64(g.slot)*GateSize
	if err := ar.dev.SideCopyIn(at, make([]byte, 4)); err != nil {
		a.log.Error("netxfer: shutting a gate failed: waiting for its launches anyway", "peer", g.peer, "err", err)
	}
	var cnt [gateShards * 4]byte
	start := time.Now()
	warned := false
	for wait := 10 * time.Microsecond; ; wait = min(2*wait, time.Millisecond) {
		if err := ar.dev.SideCopyOut(cnt[:], at+gateActiveOff); err != nil {
			// The device failed (a CUDA error sticks to the context):
			// nothing more can be known, or done, with this memory.
			a.log.Error("netxfer: reading a gate failed; its grant ends without knowing the peer's launches are out", "peer", g.peer, "err", err)
			break
		}
		if allZero(cnt[:]) {
			break
		}
		if !g.producerAlive() {
			// Its launches went with its GPU context, and the CTAs it
			// counted in will never count themselves out: cleared, for
			// the slot's next gate.
			if err := ar.dev.SideCopyIn(at+gateActiveOff, make([]byte, len(cnt))); err != nil {
				a.log.Error("netxfer: clearing a dead peer's counts in a gate failed", "peer", g.peer, "err", err)
			}
			break
		}
		if !warned && time.Since(start) > gateSlowDrain {
			warned = true
			a.log.Warn("netxfer: a peer's launch has been inside a shut gate for long; its grant waits", "peer", g.peer, "pid", g.pid)
		}
		time.Sleep(wait)
	}
	// The peer may forget it (best effort: a late launch copies nothing).
	if c := g.c; c != nil {
		var h [13]byte
		h[0] = tGateShut
		binary.LittleEndian.PutUint32(h[1:], ar.id)
		binary.LittleEndian.PutUint32(h[5:], g.slot)
		binary.LittleEndian.PutUint32(h[9:], g.gen)
		c.mu.Lock()
		alive := c.err == nil
		c.mu.Unlock()
		if alive {
			_ = c.writeFrame(h[:])
		}
	}
	st.mu.Lock()
	delete(st.open, g)
	ar.free = append(ar.free, g.slot)
	st.mu.Unlock()
}

// isClosed reports whether Close began.
func (a *Agent) isClosed() bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.mu.closed
}

func allZero(b []byte) bool {
	for _, x := range b {
		if x != 0 {
			return false
		}
	}
	return true
}

// producerAlive reports whether the gate's peer process still exists:
// by the process it found at the gate's opening, which, held by a pidfd,
// reads as gone once it exited even when another process took its id;
// by the id where the kernel has no pidfds.
func (g *gate) producerAlive() bool {
	if g.proc == nil {
		return processAlive(g.pid)
	}
	err := g.proc.Signal(syscall.Signal(0))
	return err == nil || errors.Is(err, unix.EPERM)
}

// processAlive reports whether process pid still exists.
func processAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := unix.Kill(pid, 0)
	return err == nil || errors.Is(err, unix.EPERM)
}

// peerPID returns the pid of the process at the other end of c.
func peerPID(c *net.UnixConn) (int, error) {
	cred, err := peerCred(c)
	if err != nil {
		return 0, err
	}
	return int(cred.Pid), nil
}

// shutGates shuts the gates that match and waits for them.
func (a *Agent) shutGates(match func(*gate) bool) {
	st := &a.gates
	st.mu.Lock()
	var gs []*gate
	for g := range st.open {
		if match(g) {
			gs = append(gs, g)
		}
	}
	st.mu.Unlock()
	for _, g := range gs {
		a.shutGate(g)
	}
	for _, g := range gs {
		<-g.done
	}
}

// GatesOpen returns how many gates this agent has open for its peers
// (D side) and how many of its peers' it holds (P side).
func (a *Agent) GatesOpen() (mine, peers int) {
	st := &a.gates
	st.mu.Lock()
	defer st.mu.Unlock()
	for g := range st.open {
		if !g.shutting {
			mine++
		}
	}
	for _, m := range st.views {
		peers += len(m)
	}
	return mine, peers
}

// OneSidedWrites returns how many WRITEs this agent posted through a
// peer's gate.
func (a *Agent) OneSidedWrites() uint64 { return a.oneSidedN.Load() }

// serveGate handles the gate frames a peer sends (P side).
func (a *Agent) serveGate(s *localServer, r *scatterReader, from string, typ byte, hdr []byte) error {
	switch typ {
	case tGateArea:
		var b [84]byte
		if err := readFull(r, b[:]); err != nil {
			return err
		}
		id := binary.LittleEndian.Uint32(b[:4])
		uuid, h := devRef(b[4:84])
		imp, err := a.importGateMem(s, from, uuid, h, gateSlots*GateSize, len(s.gateAreas), s.gateAreas[id] != nil)
		if err != nil || imp == nil {
			return err
		}
		if s.gateAreas == nil {
			s.gateAreas = map[uint32]*devImport{}
		}
		s.gateAreas[id] = imp
		return nil
	case tGateChunk:
		var b [100]byte
		if err := readFull(r, b[:]); err != nil {
			return err
		}
		id := binary.LittleEndian.Uint32(b[:4])
		base := binary.LittleEndian.Uint64(b[4:12])
		size := binary.LittleEndian.Uint64(b[12:20])
		uuid, h := devRef(b[20:100])
		if size == 0 || size > 1<<46 || base+size < base {
			return fmt.Errorf("%w: gate memory %d of %d bytes at %#x", ErrProtocol, id, size, base)
		}
		imp, err := a.importGateMem(s, from, uuid, h, size, len(s.gateChunks), s.gateChunks[id] != nil)
		if err != nil || imp == nil {
			return err
		}
		if s.gateChunks == nil {
			s.gateChunks = map[uint32]*gateChunk{}
		}
		s.gateChunks[id] = &gateChunk{base: base, size: size, imp: imp}
		return nil
	case tGateOpen:
		return a.serveGateOpen(s, r, from, hdr)
	case tGateShut:
		if err := readFull(r, hdr[:12]); err != nil {
			return err
		}
		area, slot := binary.LittleEndian.Uint32(hdr[:4]), binary.LittleEndian.Uint32(hdr[4:8])
		gen := binary.LittleEndian.Uint32(hdr[8:12])
		st := &a.gates
		st.mu.Lock()
		for k, v := range st.views[from] {
			if v.srv == s && v.area == area && v.slot == slot && v.gen == gen {
				st.dropViewLocked(from, k)
			}
		}
		st.mu.Unlock()
		return nil
	}
	return fmt.Errorf("%w: frame type %d", ErrProtocol, typ)
}

// importGateMem imports a peer's gate area or GPU memory (P side); nil
// and no error where this agent has no device for it (its gates are then
// not used), an error for what breaks the protocol.
func (a *Agent) importGateMem(s *localServer, from string, uuid [16]byte, h [64]byte, size uint64, have int, again bool) (*devImport, error) {
	if again {
		return nil, fmt.Errorf("%w: %s announced gate memory twice", ErrProtocol, from)
	}
	if have >= maxChunks {
		return nil, fmt.Errorf("%w: more than %d gate memories from %s", ErrProtocol, maxChunks, from)
	}
	if a.cfg.Devices == nil {
		return nil, nil
	}
	dev, err := a.cfg.Devices(uuid)
	if err != nil {
		a.log.Debug("netxfer: a peer's gate memory on a device this agent lacks", "peer", from, "err", err)
		return nil, nil
	}
	ptr, err := dev.Import(h)
	if err != nil {
		a.log.Warn("netxfer: importing a peer's gate memory failed: its WRITEs go two-sided", "peer", from, "err", err)
		return nil, nil
	}
	if err := checkImport(dev, ptr, size); err != nil {
		_ = dev.Unmap(ptr)
		return nil, fmt.Errorf("gate memory from %s: %w", from, err)
	}
	return &devImport{dev: dev, ptr: ptr, size: size, handle: h}, nil
}

// serveGateOpen records a peer's gate (P side).
func (a *Agent) serveGateOpen(s *localServer, r *scatterReader, from string, hdr []byte) error {
	if err := readFull(r, hdr[:16]); err != nil {
		return err
	}
	area, slot := binary.LittleEndian.Uint32(hdr[:4]), binary.LittleEndian.Uint32(hdr[4:8])
	gen, klen := binary.LittleEndian.Uint32(hdr[8:12]), binary.LittleEndian.Uint32(hdr[12:16])
	if klen > maxNotif || slot >= gateSlots || gen == 0 {
		return fmt.Errorf("%w: gate %d/%d gen %d, key of %d bytes", ErrProtocol, area, slot, gen, klen)
	}
	key := make([]byte, klen)
	if err := readFull(r, key); err != nil {
		return err
	}
	if err := readFull(r, hdr[:4]); err != nil {
		return err
	}
	nspan := binary.LittleEndian.Uint32(hdr[:4])
	if nspan > maxLayouts {
		return fmt.Errorf("%w: a gate of %d spans", ErrProtocol, nspan)
	}
	v := &gateView{area: area, slot: slot, gen: gen, srv: s}
	usable := true
	total := 0
	var b [16]byte
	for i := range int(nspan) {
		if err := readFull(r, b[:8]); err != nil {
			return err
		}
		nb, ne := binary.LittleEndian.Uint32(b[:4]), binary.LittleEndian.Uint32(b[4:8])
		total += int(nb) + int(ne)
		if nb > maxDescs || ne > maxDescs || total > maxDescs {
			return fmt.Errorf("%w: a gate of more than %d bases and entries", ErrProtocol, maxDescs)
		}
		for range nb {
			if err := readFull(r, b[:12]); err != nil {
				return err
			}
			ch := s.gateChunks[binary.LittleEndian.Uint32(b[8:12])]
			if ch == nil {
				usable = false
			}
			v.bases = append(v.bases, gateBase{addr: binary.LittleEndian.Uint64(b[:8]), span: i, chunk: ch})
		}
		ents := make([]Region, 0, ne)
		for range ne {
			if err := readFull(r, b[:16]); err != nil {
				return err
			}
			e := Region{binary.LittleEndian.Uint64(b[:8]), binary.LittleEndian.Uint64(b[8:16])}
			if e.Addr > maxLayoutOff || e.Len > maxLayoutOff {
				return fmt.Errorf("%w: gate entry [%#x, +%d)", ErrProtocol, e.Addr, e.Len)
			}
			if e.Len > 0 {
				ents = append(ents, e)
			}
		}
		v.order = append(v.order, ents)
		v.ents = append(v.ents, mergeRegions(slices.Clone(ents)))
	}
	ar := s.gateAreas[area]
	if ar == nil || !usable {
		return nil // memory this agent could not import: no one-sided WRITEs
	}
	v.dev = ar.dev
	v.ptr = ar.ptr + uint64(slot)*GateSize
	for _, gb := range v.bases {
		if gb.chunk.imp.dev != v.dev {
			return nil // D's memory and gate on different GPUs here
		}
	}
	slices.SortFunc(v.bases, func(x, y gateBase) int { return cmpU64(x.addr, y.addr) })
	st := &a.gates
	st.mu.Lock()
	defer st.mu.Unlock()
	m := st.views[from]
	if m == nil {
		m = map[string]*gateView{}
		st.views[from] = m
	}
	if _, ok := m[string(key)]; !ok && len(m) >= gateSlots {
		return fmt.Errorf("%w: %s holds more than %d gates open", ErrProtocol, from, gateSlots)
	}
	st.dropViewLocked(from, string(key))
	if st.items[from]+v.size() > maxGateItems {
		return fmt.Errorf("%w: %s's gates would hold more than %d bases and entries here", ErrProtocol, from, maxGateItems)
	}
	st.items[from] += v.size()
	m[string(key)] = v
	return nil
}

// mergeRegions sorts rs by address and merges those that touch or
// overlap.
func mergeRegions(rs []Region) []Region {
	slices.SortFunc(rs, func(x, y Region) int { return cmpU64(x.Addr, y.Addr) })
	out := rs[:0]
	for _, r := range rs {
		if n := len(out); n > 0 && r.Addr <= out[n-1].Addr+out[n-1].Len {
			out[n-1].Len = max(out[n-1].Addr+out[n-1].Len, r.Addr+r.Len) - out[n-1].Addr
			continue
		}
		out = append(out, r)
	}
	return out
}

// inOrder reports whether every entry of es, its destination offset
// moved by delta, lies in the gate's entries as listed (order): the
// common case of a WRITE of the request's blocks in the grant's own
// order, runs of them coalesced or cut, checked in one walk. Each
// entry's bytes must continue the grant's entries where the entry before
// it stopped. False says nothing: the caller checks each entry against
// the merged entries instead (covers).
func inOrder(order []Region, es []LayoutEntry, delta uint64) bool {
	j, pos := 0, uint64(0) // at byte pos of order[j]
	for _, e := range es {
		if e.Len == 0 {
			continue
		}
		off, n := delta+e.Remote, e.Len
		if off < delta || off+n < off {
			return false
		}
		for n > 0 {
			if j < len(order) && pos == order[j].Len {
				j, pos = j+1, 0
			}
			if j == len(order) || order[j].Addr+pos != off {
				return false
			}
			k := min(n, order[j].Len-pos)
			off, n, pos = off+k, n-k, pos+k
		}
	}
	return true
}

// covers reports whether [off, off+n) lies in one of rs (merged).
func covers(rs []Region, off, n uint64) bool {
	i, _ := slices.BinarySearchFunc(rs, off, func(r Region, t uint64) int {
		if r.Addr > t {
			return 1
		}
		return -1
	})
	if i == 0 {
		return false
	}
	r := rs[i-1]
	return off-r.Addr <= r.Len && n <= r.Len-(off-r.Addr)
}

// dropGateViews forgets the gates a connection's peer sent on it and
// waits for the launches through them (before its imports go).
func (a *Agent) dropGateViews(s *localServer) {
	st := &a.gates
	st.mu.Lock()
	for peer, m := range st.views {
		for k, v := range m {
			if v.srv == s {
				st.dropViewLocked(peer, k)
			}
		}
	}
	st.mu.Unlock()
	s.gateUse.Wait()
	for _, d := range s.gateAreas {
		d.unmap()
	}
	for _, c := range s.gateChunks {
		c.imp.unmap()
	}
	s.gateAreas, s.gateChunks = nil, nil
}

// oneSided posts a layout WRITE through the peer's gate for its request,
// when there is one and the WRITE lies wholly in it, on memory of the
// gate's GPU: one gated launch from this agent's memory into the peer's,
// then the notification. It reports false, having posted nothing, for
// any other WRITE (the two-sided path takes it).
func (a *Agent) oneSided(x *xfer) bool {
	if x.op != Write || x.layouts == nil || !x.peer.gates {
		return false
	}
	key := a.gateKey(x.notif)
	if key == "" {
		return false
	}
	st := &a.gates
	a.memMu.RLock()
	st.mu.Lock()
	v := st.views[x.peer.name][key]
	if v == nil || st.unfit[v.dev] {
		st.mu.Unlock()
		a.memMu.RUnlock()
		return false
	}
	// The view's imports stay mapped until Done (dropGateViews waits):
	// it is staged without the lock, other posts and gates going on.
	srv := v.srv
	srv.gateUse.Add(1)
	st.mu.Unlock()
	// The launch reads this agent's memory until it ended: a Release
	// meanwhile waits for it (see Release), and a released WRITE is not
	// launched (the two-sided path then refuses it too).
	if !a.beginLanding(x, nil) {
		srv.gateUse.Done()
		a.memMu.RUnlock()
		return false
	}
	cp, err := a.stageOneSided(v, x.layouts)
	if cp == nil {
		a.endLanding(x, nil)
		srv.gateUse.Done()
		a.memMu.RUnlock()
		if err != nil {
			// Nothing of the WRITE is lost: D's process copies it on the
			// two-sided path, which needs nothing of this device's
			// gated launches. What a failed post may have queued
			// before its error writes the same bytes inside the grant.
			a.gateUnfit(v.dev, x.peer.name, err)
		}
		return false
	}
	a.oneSidedN.Add(1)
	x.parts = 1
	a.wire(WirePartSent, x.id, 0)
	// Counted until its notification is sent (Close waits for it); this
	// goroutine is counted, so no Wait has seen the count at zero.
	a.wg.Add(1)
	polled.add([]DevCopy{cp}, func(err error) {
		srv.gateUse.Done()
		a.memMu.RUnlock()
		if err == nil {
			if g, ok := cp.(GatedCopy); ok && g.Shut() {
				err = fmt.Errorf("%w: one-sided write to %s: the grant ended (its gate shut) before every piece was written", ErrXferFailed, x.peer.name)
			}
		}
		// The launch read all it reads: a Release waiting for it returns
		// (what landed was read before, so the notification may go).
		a.endLanding(x, nil)
		a.wire(WireAnswerRead, x.id, 0)
		if err != nil || x.notif == nil {
			a.finishPart(x, err)
			a.wg.Done()
			return
		}
		// The notification, off the poller's goroutine (a write may
		// block).
		go func() {
			defer a.wg.Done()
			// To the peer the WRITE was posted to: one loaded under its
			// name since (another agent, or the same moved) did not get
			// these bytes.
			if err := a.notifyPeer(x.peer, x.notif); err != nil {
				a.finishPart(x, fmt.Errorf("%w: notification after a one-sided write: %w", ErrXferFailed, err))
				return
			}
			a.finishPart(x, nil)
		}()
	})
	return true
}

// gateUnfit takes dev's WRITEs off the one-sided path for good: its
// gated launch failed to post (err), and each further WRITE would fail
// the same way before going two-sided.
func (a *Agent) gateUnfit(dev Device, peer string, err error) {
	st := &a.gates
	st.mu.Lock()
	first := !st.unfit[dev]
	if st.unfit == nil {
		st.unfit = map[Device]bool{}
	}
	st.unfit[dev] = true
	st.mu.Unlock()
	if first {
		a.log.Error("netxfer: a one-sided WRITE's gated launch failed to post: this device's WRITEs go two-sided from now on", "peer", peer, "err", err)
	}
}

// gateChecked is a place of a gate's span whose entries a WRITE was
// checked against: the span and the WRITE's base's distance from the
// span's base.
type gateChecked struct {
	span  int
	delta uint64
}

// stageOneSided stages and posts lays as one gated launch through v (P
// side; memMu read-held, v's imports held: gateUse). It returns nil and no error
// when the WRITE does not qualify: a piece outside the gate's ranges or
// the peer's memory, local memory that is not GPU memory of the gate's
// device, a device that does not gate; nil and an error when staging or
// posting the launch failed (the two-sided path serves the WRITE).
func (a *Agent) stageOneSided(v *gateView, lays []Layout) (DevCopy, error) {
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return nil, nil
	}
	var c regionCursor
	var gb GatedBatch
	sc := &a.gates.stage
	giveUp := func() (DevCopy, error) {
		a.mu.Unlock()
		if gb != nil {
			gb.Discard()
		}
		return nil, nil
	}
	for _, l := range lays {
		ls, rs, ok := spans(l.Entries)
		if !ok {
			return giveUp()
		}
		llo, lhi, rlo, rhi := ls[0], ls[1], rs[0], rs[1]
		if lhi == llo {
			continue
		}
		seen, regs := sc.seen[:0], sc.regs[:0]
		for _, b := range l.Bases {
			// Local: GPU memory of the gate's device.
			at := b.Local + llo
			if at < b.Local || !c.inside(a, at, lhi-llo) {
				return giveUp()
			}
			ch := a.chunkLocked(at)
			if ch == nil || ch.dev != v.dev || at-ch.base+(lhi-llo) > ch.size {
				return giveUp()
			}
			// Remote: the gate base it lies past, and its chunk.
			rat := b.Remote + rlo
			if rat < b.Remote {
				return giveUp()
			}
			i, _ := slices.BinarySearchFunc(v.bases, rat, func(g gateBase, t uint64) int {
				if g.addr > t {
					return 1
				}
				return -1
			})
			if i == 0 {
				return giveUp()
			}
			g := v.bases[i-1]
			ck := g.chunk
			if rat < ck.base || rat-ck.base > ck.size || rhi-rlo > ck.size-(rat-ck.base) {
				return giveUp()
			}
			delta := b.Remote - g.addr
			k := gateChecked{g.span, delta}
			if !slices.Contains(seen, k) {
				if !inOrder(v.order[g.span], l.Entries, delta) {
					for _, e := range l.Entries {
						if e.Len > 0 && !covers(v.ents[g.span], delta+e.Remote, e.Len) {
							return giveUp()
						}
					}
				}
				seen = append(seen, k)
			}
			regs = append(regs, DevRegion{Dst: ck.imp.ptr + (b.Remote - ck.base), Src: b.Local})
		}
		if gb == nil {
			bd, ok := v.dev.(BatchDevice)
			if !ok {
				return giveUp()
			}
			nb, err := bd.NewBatch(len(l.Entries))
			if err != nil { // staging this device lacks now: this WRITE goes two-sided
				a.log.Debug("netxfer: no batch for a one-sided WRITE", "err", err)
				return giveUp()
			}
			if gb, ok = nb.(GatedBatch); !ok {
				nb.Discard()
				return giveUp()
			}
			if _, ok := nb.(LayoutBatch); !ok {
				return giveUp()
			}
		}
		ents := sc.ents[:0]
		for _, e := range l.Entries {
			ents = append(ents, DevEntry{Dst: e.Remote, Src: e.Local, Len: e.Len})
		}
		sc.seen, sc.regs, sc.ents = seen, regs, ents
		if !gb.(LayoutBatch).AddLayout(regs, ents) {
			return giveUp()
		}
	}
	a.mu.Unlock()
	if gb == nil {
		return nil, nil
	}
	if !gb.Gate(v.ptr, v.gen) {
		gb.Discard()
		return nil, nil
	}
	cp, err := gb.Post()
	if err != nil {
		return nil, err
	}
	return cp, nil
}
