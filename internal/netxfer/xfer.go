package netxfer

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"
)

// Wire format (little endian). A client opens a connection with a hello
// (magic, version, its name) and then sends requests; the server answers
// on the same connection.
const (
	magic   = "KVXN"
	version = 1
	// versionIdent opens a connection whose hello also names the agent
	// the dialer means to reach (its same-host socket's name, which is
	// its process's own, from its metadata) and the dialer's incarnation:
	// the server refuses a hello meant for another agent (one that
	// listened at its address before: a process restarted at the same
	// port) and, on TCP, confirms the others with helloOK before anything
	// else it writes; it counts a multi-part WRITE's parts by the
	// incarnation that sent them. Sent only to agents whose socket's name
	// carries identMark (on the same-host socket too, unconfirmed: its
	// name is its process's own).
	versionIdent = 2
	helloOK      = 0x4b

	tWrite   = 1 // xfer u64, part u32, parts u32, ndesc u32, notif u32 | notif | ndesc×(addr u64, len u64) | payload
	tReadReq = 2 // xfer u64, part u32, ndesc u32 | ndesc×(addr u64, len u64)
	// A READ request that carries its transfer's notification (its tag:
	// what the server's guard admits it for).
	tReadReqTag = 9  // xfer u64, part u32, ndesc u32, notif u32 | notif | ndesc×(addr u64, len u64)
	tNotif      = 3  // len u32 | msg
	tNotifReq   = 4  // xfer u64, len u32 | msg
	tAck        = 16 // xfer u64, part u32, errlen u32 | err
	tReadResp   = 17 // xfer u64, part u32, errlen u32 | err | payload (when no error)
	tNotifAck   = 18 // xfer u64
	// A part the server's guard refused (Late: the connection is kept):
	// as tAck and tReadResp, with the refusal as the error.
	tAckRefused  = 19
	tReadRefused = 20
	notifPart    = ^uint32(0)
	maxName      = 256
	maxNotif     = 1 << 20
	maxDescs     = 1 << 20
	// maxLanding bounds the multi-part WRITEs an agent is landing at once
	// for one peer; at the bound, those no part of which came for
	// staleLanding are forgotten.
	maxLanding   = 1 << 14
	staleLanding = 10 * time.Minute
	maxErr       = 4096
	maxPayload   = 1 << 40
)

// xfer is a posted transfer.
type xfer struct {
	id     XferID
	op     Op
	peer   *peer
	parts  int
	acked  int
	notif  []byte
	descs  []Desc // READ: where response payloads land
	split  []int  // part boundaries into descs
	state  State
	err    error
	direct bool
	device bool // its local memory is GPU memory (one part: one launch)
	// gateTried: PostLayout tried the one-sided path on the caller's
	// goroutine and it did not take the WRITE (start goes two-sided).
	gateTried bool
	// layouts: a WRITE posted as layouts (PostLayout) and sent as such
	// on a same-host connection; elsewhere expanded into descs first.
	layouts []Layout
	// What uses this agent's memory for the transfer (under the owner's
	// mu, see Release): released is set once the poster gave the transfer
	// up, after which no READ part lands and no WRITE part goes out;
	// landing counts the READ parts copying into the memory now and the
	// WRITE parts reading it (being sent, a one-sided launch), cuts the
	// connections of those whose bytes the socket carries (cut short by
	// Release), and idle is closed when the last of them ends after
	// Release began waiting. local are the same-host connections WRITE
	// parts went out on: the peer copies out of this memory until it
	// answers.
	released bool
	landing  int
	cuts     []*conn
	idle     chan struct{}
	local    []*conn
}

// beginSend admits the sending of WRITE part of x on c, which reads this
// agent's memory until it returns (and, on a same-host connection, the
// peer reads it until it answers): false once x was released or ended
// (movesLocked), the part then dropped from c. Each true is matched by
// one endLanding(x, c).
func (a *Agent) beginSend(x *xfer, c *conn, part int) bool {
	a.mu.Lock()
	ok := x.movesLocked()
	if ok {
		x.landing++
		x.cuts = append(x.cuts, c)
		if c.uc != nil && !slices.Contains(x.local, c) {
			x.local = append(x.local, c)
		}
	}
	a.mu.Unlock()
	if !ok {
		c.take(partKey{x.id, uint32(part)})
	}
	return ok
}

// waiting reports whether a part of x (of parts) still waits on c for
// its answer.
func (c *conn) waiting(x *xfer, parts int) bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	for p := range parts {
		if c.pending[partKey{x.id, uint32(p)}] == x {
			return true
		}
	}
	return false
}

// beginLanding admits a part of READ x into this agent's memory, from the
// socket of c when c is not nil (else a same-host copy): false once x was
// released or ended (its bytes must not land: the caller discards them).
// Each true is matched by one endLanding.
func (a *Agent) beginLanding(x *xfer, c *conn) bool {
	a.mu.Lock()
	defer a.mu.Unlock()
	if !x.movesLocked() {
		return false
	}
	x.landing++
	if c != nil {
		x.cuts = append(x.cuts, c)
	}
	return true
}

// movesLocked reports whether a part of x may still begin moving bytes in
// or out of this agent's memory (owner's mu held): not once its poster
// released it, nor once it ended (a failed transfer's parts still to
// come are not landed or sent; InvalidatePeer and Close wait only for
// those already moving).
func (x *xfer) movesLocked() bool { return !x.released && x.state == InProgress }

// endLanding ends a part's landing begun with beginLanding (c as there),
// and reports whether x was released meanwhile (Release then waits for
// this, and c's read deadline may have been set to cut the part short).
func (a *Agent) endLanding(x *xfer, c *conn) (released bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	x.landing--
	if c != nil {
		if i := slices.Index(x.cuts, c); i >= 0 {
			x.cuts = slices.Delete(x.cuts, i, i+1)
		}
	}
	if x.landing == 0 && x.idle != nil {
		close(x.idle)
		x.idle = nil
	}
	return x.released
}

// expand turns a layout transfer into the pieces it stands for (the
// goroutine that sends or lands its one part).
func (x *xfer) expand() {
	if x.layouts != nil {
		x.descs = ExpandLayouts(nil, x.layouts)
		x.split, x.layouts = []int{0, len(x.descs)}, nil
	}
}

// failLocked fails a transfer in progress (owner's mu held).
func (x *xfer) failLocked(err error) {
	if x.state == InProgress {
		x.state, x.err = Failed, err
	}
}

// peer is a loaded remote agent and its connections.
type peer struct {
	owner *Agent
	name  string
	addr  string
	local *Agent
	// uaddr is the peer's same-host socket ("" if none); noLocal is set
	// once dialing it failed (another host or network namespace).
	uaddr string
	// layouts: the peer takes layout frames (its same-host socket's name
	// ends in layoutsMark); to a peer of an older build, layouts go as the
	// pieces they stand for.
	layouts bool
	// gates: the peer takes gate frames (gatesMark); readAcks: it takes
	// READ acknowledgements (readAcksMark).
	gates    bool
	readAcks bool
	// ident: the peer's same-host socket's name (its process's own) when
	// it confirms who it is (identMark): a TCP connection's hello names
	// it, and a dial reaching another agent at the peer's address (a
	// process that restarted there) fails. "": not checked (an older
	// build, or an agent without a same-host socket).
	ident   string
	mu      sync.Mutex
	noLocal bool
	dialing bool // a connection is being dialed in the background
	conns   []*conn
	next    int
	dead    error
	// first is the dial of a first connection under way (nil: none): it
	// runs on a goroutine of its own, never under mu, so that no caller
	// waits for it longer than it chooses to. pending holds the
	// notifications that wait for it (pendingBytes their size): it hands
	// them to the connection it made, in order, or drops them with it.
	first        *firstDial
	pending      [][]byte
	pendingBytes int
	// slowErr is the error of the last first dial that outlasted its
	// caller's wait (a peer whose host does not answer), at slowAt: for
	// DialTimeout after it, a notification fails at once instead of
	// starting another dial.
	slowErr error
	slowAt  time.Time
}

// firstDial is one dial of a peer's first connection.
type firstDial struct {
	done chan struct{} // closed when it ended, err set
	err  error
	// abandoned: a caller stopped waiting for it (under p.mu).
	abandoned bool
}

// dialWait is how long a notification (or a gate, on a Worker's loop)
// waits for a first connection being dialed before it is queued (or given
// up): a dial that is answered takes well under it, and one to a host
// that does not answer takes DialTimeout, which nobody's loop should.
const dialWait = 100 * time.Millisecond

// conn is one client connection to a peer.
type conn struct {
	p   *peer
	c   net.Conn
	r   *scatterReader // the answers, read by c.read alone
	wmu sync.Mutex
	mu  sync.Mutex
	// pending parts waiting for their answer, by (xfer, part).
	pending map[partKey]*xfer
	err     error
	// A same-host connection (uc non-nil): the fence page it passed (set
	// by fail, see withdraw) and the memory files passed already (under
	// wmu).
	uc    *net.UnixConn
	fence []byte
	sent  map[uint32]bool
	// descs is the descriptor area passed to the server (nil: none) and
	// head how many ring bytes were written into it (under wmu).
	descs []byte
	head  uint64
	// in holds what the server passed for READs (its fence and memory
	// files), read by c.read alone.
	in *localServer
	// gateSent: the gate areas and chunks announced on the connection
	// (under wmu); gates: the gates announced on it (under mu), shut when
	// it fails.
	gateSent map[gateSentKey]bool
	gates    []*gate
	// acks: this client acknowledges the server's local READ answers
	// (it sent tReadAcks).
	acks bool
	// nq holds the notification frames waiting for the write side (under
	// nmu; nqBytes their size), written in order by one flusher goroutine
	// (flushing): a Notify never waits for a part being written.
	nmu      sync.Mutex
	nq       [][]byte
	nqBytes  int
	flushing bool
}

// maxNotifQueue bounds the notification bytes one connection holds while
// its write side is taken (a frame alone is always taken).
const maxNotifQueue = 4 << 20

type partKey struct {
	id   XferID
	part uint32
}

// conn returns the next connection to the peer. With none, it dials one
// and waits for it; with fewer than Conns, it dials the next in the
// background and returns one it has: a transfer never waits for a dial
// the peer's connections could spare it (a same-host dial and its
// authentication take about half a millisecond, longer than a GPU
// transfer of a few MiB).
func (p *peer) conn() (*conn, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for {
		if p.dead != nil {
			return nil, p.dead
		}
		p.dropBrokenLocked()
		if len(p.conns) > 0 {
			break
		}
		// The first connection: dialed on a goroutine of its own (see
		// firstDial), waited for here.
		d := p.first
		if d == nil {
			var err error
			if d, err = p.dialFirstLocked(); err != nil {
				return nil, err
			}
		}
		p.mu.Unlock()
		<-d.done
		p.mu.Lock()
		if d.err != nil {
			return nil, d.err
		}
	}
	if len(p.conns) < p.wantConns() && !p.dialing {
		p.dialMore()
	}
	// The first connection carries the notifications and gates (see
	// firstConn); parts take the others once there are others, so that a
	// notification is not written behind a part.
	data := p.conns
	if len(data) > 1 {
		data = data[1:]
	}
	c := data[p.next%len(data)]
	p.next++
	return c, nil
}

// dropBrokenLocked drops the peer's broken connections (p.mu held).
func (p *peer) dropBrokenLocked() {
	p.conns = slices.DeleteFunc(p.conns, func(c *conn) bool {
		c.mu.Lock()
		defer c.mu.Unlock()
		return c.err != nil
	})
}

// dialFirstLocked starts the dial of the peer's first connection on a
// goroutine of the agent's (p.mu held, no connection, none being
// dialed). When it ends, the connection joins the peer's and takes the
// pending notifications, in order; a failed one drops them.
func (p *peer) dialFirstLocked() (*firstDial, error) {
	a := p.owner
	d := &firstDial{done: make(chan struct{})}
	local := p.tryLocal()
	err := a.goCounted(func() {
		c, noLocal, err := p.dial(local)
		p.mu.Lock()
		p.first = nil
		p.noLocal = p.noLocal || noLocal
		if err == nil && p.dead != nil {
			c.fail(p.dead)
			err = p.dead
		}
		q := p.pending
		p.pending, p.pendingBytes = nil, 0
		if err == nil {
			p.conns = append(p.conns, c)
			c.queueNotifs(q) // before any later notification: they take p.mu to find c
			p.slowErr = nil
		} else if d.abandoned {
			p.slowErr, p.slowAt = err, time.Now()
		}
		d.err = err
		p.mu.Unlock()
		if err != nil && len(q) > 0 {
			a.log.Debug("netxfer: notifications dropped: no connection", "peer", p.name, "notifications", len(q), "err", err)
		}
		close(d.done)
	})
	if err != nil {
		return nil, err
	}
	p.first = d // (p.mu held: the dial's end, which takes it, comes after)
	return d, nil
}

// firstConnWithin returns the peer's first live connection, dialing one
// if it has none, waiting at most wait for that dial: errDialing if it
// takes longer (it goes on, and the connection it makes serves what
// follows).
func (p *peer) firstConnWithin(wait time.Duration) (*conn, error) {
	p.mu.Lock()
	if p.dead != nil {
		p.mu.Unlock()
		return nil, p.dead
	}
	p.dropBrokenLocked()
	if len(p.conns) == 0 {
		d := p.first
		if d == nil {
			var err error
			if d, err = p.dialFirstLocked(); err != nil {
				p.mu.Unlock()
				return nil, err
			}
		}
		p.mu.Unlock()
		t := time.NewTimer(wait)
		defer t.Stop()
		select {
		case <-d.done:
			if d.err != nil {
				return nil, d.err
			}
		case <-t.C:
			p.mu.Lock()
			d.abandoned = true
			p.mu.Unlock()
			return nil, errDialing
		}
	} else {
		p.mu.Unlock()
	}
	return p.firstConn()
}

// errDialing: a first connection is still being dialed.
var errDialing = fmt.Errorf("%w: still dialing the first connection", ErrXferFailed)

// wantConns is how many connections the peer keeps: Conns for the parts,
// and one more for the notifications and gates when Conns is above one
// (p.mu held).
func (p *peer) wantConns() int {
	if n := p.owner.cfg.Conns; n > 1 {
		return n + 1
	}
	return 1
}

// firstConn returns the peer's first connection (dialing one if it has
// none): notifications and gates go on it, so that a peer reads them in
// the order they were sent (a gate before the notification that tells of
// its grant; a registration before the abort that ends it).
func (p *peer) firstConn() (*conn, error) {
	if _, err := p.conn(); err != nil {
		return nil, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, c := range p.conns {
		c.mu.Lock()
		ok := c.err == nil
		c.mu.Unlock()
		if ok {
			return c, nil
		}
	}
	return nil, fmt.Errorf("%w: no live connection to %s", ErrXferFailed, p.name)
}

// dialHook, when set (tests), runs at the start of every dial.
var dialHook atomic.Pointer[func()]

// tryLocal reports whether a dial should try the same-host path first
// (p.mu held).
func (p *peer) tryLocal() bool { return p.uaddr != "" && !p.noLocal }

// dialMore dials one more connection on a goroutine of its own and adds
// it to the peer's (p.mu held; the peer has one already).
func (p *peer) dialMore() {
	a := p.owner
	local := p.tryLocal()
	p.dialing = a.goCounted(func() {
		c, noLocal, err := p.dial(local)
		p.mu.Lock()
		defer p.mu.Unlock()
		p.dialing = false
		p.noLocal = p.noLocal || noLocal
		switch {
		case err != nil:
			a.log.Debug("netxfer: dial of another connection failed", "peer", p.name, "err", err)
		case p.dead != nil:
			c.fail(p.dead)
		default:
			p.conns = append(p.conns, c)
		}
	}) == nil // (p.mu held: the dial's end, which takes it, comes after)
}

// dial opens a connection to the peer: on the same-host path first when
// local (noLocal: that failed, the peer is on another host or network
// namespace), else TCP.
func (p *peer) dial(local bool) (c *conn, noLocal bool, err error) {
	a := p.owner
	if h := dialHook.Load(); h != nil {
		(*h)()
	}
	if local && a.shared.Load() > 0 {
		c, err := p.dialLocal()
		if err == nil {
			c, err = p.started(c)
			return c, false, err
		}
		noLocal = true
		a.log.Debug("netxfer: no same-host path; TCP", "peer", p.name, "err", err)
	}
	nc, err := net.DialTimeout("tcp", p.addr, a.cfg.DialTimeout)
	if err != nil {
		return nil, noLocal, fmt.Errorf("%w: dial %s (%s): %w", ErrXferFailed, p.name, p.addr, err)
	}
	if tc, ok := nc.(*net.TCPConn); ok {
		_ = tc.SetNoDelay(true)
	}
	if a.cfg.ClientTLS != nil {
		cfg := a.cfg.ClientTLS.Clone()
		if cfg.ServerName == "" {
			cfg.ServerName, _, _ = net.SplitHostPort(p.addr)
		}
		tc := tls.Client(nc, cfg)
		ctx, cancel := context.WithTimeout(context.Background(), a.cfg.DialTimeout)
		err := tc.HandshakeContext(ctx)
		cancel()
		if err != nil {
			_ = nc.Close()
			a.tlsFailures.Add(1)
			if a.cfg.Auth != nil {
				a.cfg.Auth.CountFailure() // kvxfer_peer_auth_failures_total
			}
			return nil, noLocal, fmt.Errorf("%w: %s (%s): TLS: %w", ErrXferFailed, p.name, p.addr, err)
		}
		nc = tc
	}
	if a.cfg.Auth != nil {
		if err := a.cfg.Auth.Client(nc, "data", a.cfg.Name); err != nil {
			_ = nc.Close()
			return nil, noLocal, fmt.Errorf("%w: %s (%s): %w", ErrXferFailed, p.name, p.addr, err)
		}
	}
	hello := p.tcpHello
	if a.priv != nil && isBound(p.name) {
		hello = p.boundDial // both names bound: each side proves it holds its name's key
	}
	if err := hello(nc); err != nil {
		_ = nc.Close()
		return nil, noLocal, err
	}
	c, err = p.started(&conn{p: p, c: nc, r: newScatterReader(nc), pending: map[partKey]*xfer{}})
	return c, noLocal, err
}

// tcpHello opens a TCP connection to a peer without a bound name (or from
// an agent without one): the plain hello, or the ident hello and the
// peer's confirmation that it is the agent meant.
func (p *peer) tcpHello(nc net.Conn) error {
	a := p.owner
	hello := helloFrame(a.cfg.Name)
	if p.ident != "" {
		hello = identHello(a.cfg.Name, p.ident, a.inc)
	}
	if _, err := nc.Write(hello); err != nil {
		return fmt.Errorf("%w: hello to %s: %w", ErrXferFailed, p.name, err)
	}
	if p.ident == "" {
		return nil
	}
	// The agent at the address says it is the one meant (it closes the
	// connection otherwise).
	var ok [1]byte
	_ = nc.SetReadDeadline(time.Now().Add(a.cfg.DialTimeout))
	err := readFull(nc, ok[:])
	_ = nc.SetReadDeadline(time.Time{})
	if err != nil || ok[0] != helloOK {
		return fmt.Errorf("%w: the agent listening at %s is not %s (a new process there?): %v", ErrXferFailed, p.addr, p.name, cmpErr(err, "bad answer to hello"))
	}
	return nil
}

// started starts reading a new connection's answers.
func (p *peer) started(c *conn) (*conn, error) {
	a := p.owner
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		c.withdraw()
		_ = c.c.Close()
		return nil, ErrClosed
	}
	a.wg.Add(1)
	a.mu.Unlock()
	go c.read()
	return c, nil
}

// helloFrame opens a connection: magic, version, the dialer's name.
func helloFrame(name string) []byte {
	hello := append([]byte(magic), version)
	hello = binary.LittleEndian.AppendUint16(hello, uint16(len(name)))
	return append(hello, name...)
}

// identHello opens a connection to the agent whose same-host socket is
// target (versionIdent): magic, versionIdent, the dialer's name, target,
// the dialer's incarnation (Agent.inc), each after its u16 length.
func identHello(name, target, inc string) []byte {
	hello := append([]byte(magic), versionIdent)
	for _, s := range []string{name, target, inc} {
		hello = binary.LittleEndian.AppendUint16(hello, uint16(len(s)))
		hello = append(hello, s...)
	}
	return hello
}

// cmpErr is err, or what when it is nil.
func cmpErr(err error, what string) any {
	if err != nil {
		return err
	}
	return what
}

// close fails the peer's transfers and closes its connections.
func (p *peer) close(err error) {
	p.mu.Lock()
	if p.dead == nil {
		p.dead = err
	}
	conns := p.conns
	p.conns = nil
	p.mu.Unlock()
	for _, c := range conns {
		c.fail(err)
	}
}

// writeFrame writes one frame (several buffers) atomically.
func (c *conn) writeFrame(bufs ...[]byte) error {
	c.lockWrite()
	defer c.wmu.Unlock()
	nb := net.Buffers(bufs)
	if err := writeGuarded(&nb, c.c); err != nil {
		c.fail(fmt.Errorf("%w: write to %s: %w", ErrXferFailed, c.p.name, err))
		return err
	}
	return nil
}

// queueNotifs queues notification frames on c (a connection just made,
// before any other notification).
func (c *conn) queueNotifs(q [][]byte) {
	if len(q) == 0 {
		return
	}
	c.nmu.Lock()
	defer c.nmu.Unlock()
	c.nq = append(c.nq, q...)
	for _, f := range q {
		c.nqBytes += len(f)
	}
	if !c.flushing {
		if c.p.owner.goCounted(c.flushNotifs) != nil {
			c.nq, c.nqBytes = nil, 0
			return
		}
		c.flushing = true
	}
}

// writeNotif writes a notification frame, or queues it when the write
// side is taken (a part, a gate, or notifications queued before it): the
// caller (a Worker's loop) never waits for a part's bytes to go out. The
// frames leave in the order they came. A connection that fails drops
// what it had queued, as a socket buffer would.
func (c *conn) writeNotif(frame []byte) error {
	c.nmu.Lock()
	if len(c.nq) == 0 && !c.flushing && c.wmu.TryLock() {
		c.nmu.Unlock()
		_ = c.c.SetWriteDeadline(time.Now().Add(c.p.owner.cfg.FrameTimeout))
		defer c.wmu.Unlock()
		nb := net.Buffers{frame}
		if err := writeGuarded(&nb, c.c); err != nil {
			c.fail(fmt.Errorf("%w: write to %s: %w", ErrXferFailed, c.p.name, err))
			return err
		}
		return nil
	}
	defer c.nmu.Unlock()
	c.mu.Lock()
	err := c.err
	c.mu.Unlock()
	if err != nil {
		return err
	}
	if len(c.nq) > 0 && c.nqBytes+len(frame) > maxNotifQueue {
		return fmt.Errorf("%w: notification to %s: %d bytes already wait behind the connection's writes (at most %d)",
			ErrXferFailed, c.p.name, c.nqBytes, maxNotifQueue)
	}
	if !c.flushing {
		if err := c.p.owner.goCounted(c.flushNotifs); err != nil {
			return err
		}
		c.flushing = true
	}
	c.nq = append(c.nq, frame)
	c.nqBytes += len(frame)
	return nil
}

// flushNotifs writes the queued notifications, in order, until none is
// left (one goroutine per connection at a time: c.flushing).
func (c *conn) flushNotifs() {
	for {
		c.lockWrite()
		c.nmu.Lock()
		q := c.nq
		c.nq, c.nqBytes = nil, 0
		if len(q) == 0 {
			c.flushing = false
			c.nmu.Unlock()
			c.wmu.Unlock()
			return
		}
		c.nmu.Unlock()
		nb := net.Buffers(q)
		err := writeGuarded(&nb, c.c)
		c.wmu.Unlock()
		if err != nil {
			c.fail(fmt.Errorf("%w: write to %s: %w", ErrXferFailed, c.p.name, err))
			c.nmu.Lock()
			c.nq, c.nqBytes, c.flushing = nil, 0, false
			c.nmu.Unlock()
			return
		}
	}
}

// lockWrite takes the connection's write side (wmu) for one frame, which
// must be written within FrameTimeout: the peer's server cuts a frame
// that takes longer to arrive, and a peer that keeps the connection open
// but stops reading it (its process frozen, its kernel still answering)
// would otherwise hold the writer, and everything queued behind wmu (a
// Worker's notification on its loop), for ever. A write past it fails,
// and fails the connection.
func (c *conn) lockWrite() {
	c.wmu.Lock()
	_ = c.c.SetWriteDeadline(time.Now().Add(c.p.owner.cfg.FrameTimeout))
}

// fail breaks the connection and fails every part waiting on it.
func (c *conn) fail(err error) {
	c.mu.Lock()
	if c.err != nil {
		c.mu.Unlock()
		return
	}
	c.err = err
	pending := c.pending
	c.pending = map[partKey]*xfer{}
	gates := c.gates
	c.gates = nil
	c.mu.Unlock()
	a0 := c.p.owner
	for _, g := range gates {
		a0.shutGate(g) // the peer loses the gate's memory with the connection
	}
	// A same-host receiver may still be copying out of our memory: the
	// fence tells it not to count what it copies, before anyone learns
	// the parts failed and reuses the memory.
	c.withdraw()
	_ = c.c.Close()
	a := c.p.owner
	a.mu.Lock()
	for _, x := range pending {
		x.failLocked(err)
	}
	a.mu.Unlock()
	a.signal()
}

func (c *conn) expect(k partKey, x *xfer) error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.err != nil {
		return c.err
	}
	c.pending[k] = x
	return nil
}

func (c *conn) take(k partKey) *xfer {
	c.mu.Lock()
	defer c.mu.Unlock()
	x := c.pending[k]
	delete(c.pending, k)
	return x
}

// Post starts a transfer to peer. notif, when not nil, reaches the peer
// after every byte landed (WRITE: there; READ: here). descs are copied.
func (a *Agent) Post(op Op, name string, descs []Desc, notif []byte) (XferID, error) {
	return a.PostOwned(op, name, slices.Clone(descs), notif)
}

// PostOwned is Post taking descs over: the caller must not use them after
// (no copy is made). Each descriptor is walked once before Post returns,
// to bounds-check its local side.
func (a *Agent) PostOwned(op Op, name string, descs []Desc, notif []byte) (XferID, error) {
	if op != Write && op != Read {
		return 0, fmt.Errorf("netxfer: post op %d", op)
	}
	if len(notif) > maxNotif || len(descs) > maxDescs {
		return 0, fmt.Errorf("netxfer: post: %d descriptors and %d notification bytes exceed %d and %d", len(descs), len(notif), maxDescs, maxNotif)
	}
	p, err := a.peer(name)
	if err != nil {
		return 0, err
	}
	// Local ranges are checked before anything moves.
	a.memMu.RLock()
	err = a.checkLocal(descs)
	a.memMu.RUnlock()
	if err != nil {
		return 0, fmt.Errorf("netxfer: post: %w", err)
	}
	x := &xfer{op: op, peer: p, notif: slices.Clone(notif), descs: descs, state: InProgress}
	a.mu.Lock()
	if len(descs) > 0 {
		c := a.chunkLocked(descs[0].Local)
		x.device = c != nil && c.dev != nil
	}
	a.recordLocked(x)
	a.mu.Unlock()
	if p.local != nil {
		x.direct = true
		err = a.direct(x)
		a.mu.Lock()
		if err != nil {
			x.failLocked(err)
		} else if x.state == InProgress {
			x.state = Done
		}
		a.mu.Unlock()
		a.signal()
		return x.id, nil
	}
	if err := a.goStart(x); err != nil {
		return 0, err
	}
	return x.id, nil
}

// recordLocked names a posted transfer and records it (a.mu held).
func (a *Agent) recordLocked(x *xfer) {
	a.mu.next++
	x.id = a.mu.next
	a.mu.xfers[x.id] = x
}

// startOneSided tries x on the one-sided path on the caller's goroutine
// (a WRITE through its peer's gate is its checks, its staging and a
// queued launch: no goroutine between the post and the launch, whose
// wake-up costs more than they do); false, with x marked for start to go
// two-sided, where it did not go.
func (a *Agent) startOneSided(x *xfer) bool {
	if x.op != Write || x.layouts == nil || !x.peer.gates {
		return false
	}
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return false
	}
	a.wg.Add(1) // as a goroutine goStart starts is counted
	a.mu.Unlock()
	defer a.wg.Done()
	if a.oneSided(x) {
		return true
	}
	x.gateTried = true
	return false
}

// goStart sends a recorded transfer on a goroutine of the agent's (or
// reports ErrClosed): the poster returns at once, so a caller posting
// many transfers (the Worker's loop) never waits for one transfer's bytes
// to reach the wire.
func (a *Agent) goStart(x *xfer) error {
	return a.goCounted(func() { a.start(x) })
}

// goCounted runs f on a goroutine Close waits for, or reports ErrClosed
// (the agent closed: f does not run).
func (a *Agent) goCounted(f func()) error {
	a.mu.Lock()
	if a.mu.closed {
		a.mu.Unlock()
		return ErrClosed
	}
	a.wg.Add(1)
	a.mu.Unlock()
	go func() {
		defer a.wg.Done()
		f()
	}()
	return nil
}

// direct copies between two agents of this process.
func (a *Agent) direct(x *xfer) error {
	b := x.peer.local
	first, second := a, b
	if b.cfg.Name < a.cfg.Name {
		first, second = b, a
	}
	first.memMu.RLock()
	defer first.memMu.RUnlock()
	if second != first {
		second.memMu.RLock()
		defer second.memMu.RUnlock()
	}
	loc := make([]Region, len(x.descs))
	rem := make([]Region, len(x.descs))
	for i, d := range x.descs {
		loc[i], rem[i] = Region{d.Local, d.Len}, Region{d.Remote, d.Len}
	}
	lb, err := a.resolve(nil, loc)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrXferFailed, err)
	}
	_, ticket, err := b.admitGuard(a.cfg.Name, x.op, rem, x.notif, nil)
	if err != nil {
		return fmt.Errorf("%w: %w", ErrXferFailed, err)
	}
	rb, err := b.resolve(nil, rem)
	if err != nil {
		b.releaseGuard(ticket)
		return fmt.Errorf("%w: %w", ErrXferFailed, err)
	}
	if x.op == Write {
		err = copyGuarded(rb, lb)
	} else {
		err = copyGuarded(lb, rb)
	}
	// Released before the completion is delivered: the Worker that waits
	// for it may be the one the delivery goes to.
	b.releaseGuard(ticket)
	if err != nil {
		return err
	}
	if x.notif != nil {
		// WRITE: the peer hears; READ: the peer (the source) hears too.
		return b.deliver(a.cfg.Name, x.notif)
	}
	return nil
}

// start splits a transfer into parts and sends them.
func (a *Agent) start(x *xfer) {
	if !x.gateTried && a.oneSided(x) {
		return
	}
	n := len(x.descs)
	parts := min(a.cfg.Conns, max(n, 1))
	if x.device {
		// GPU memory moves only on the same-host path, where the copying
		// side posts a part's pieces as one launch: one part, one launch.
		parts = 1
	}
	// Balance parts by bytes.
	var total uint64
	for _, d := range x.descs {
		total += d.Len
	}
	x.split = []int{0}
	var acc uint64
	for i, d := range x.descs {
		acc += d.Len
		if len(x.split) < parts && acc*uint64(parts) >= total*uint64(len(x.split)) && i+1 < n {
			x.split = append(x.split, i+1)
		}
	}
	x.split = append(x.split, n)
	x.parts = len(x.split) - 1
	fail := func(err error) {
		a.mu.Lock()
		x.failLocked(fmt.Errorf("%w: %w", ErrXferFailed, err))
		a.mu.Unlock()
		a.signal()
	}
	// A WRITE part reads this agent's memory while it is sent (see
	// Release); a released one is not sent.
	send := func(c *conn, part int) error {
		if x.op == Write {
			if !a.beginSend(x, c, part) {
				return fmt.Errorf("transfer %d released or ended before its part %d was sent", x.id, part)
			}
			defer a.endLanding(x, c)
		}
		return a.sendPart(c, x, part)
	}
	// Each part goes out on its own connection at once (one goroutine
	// each, the last on this one): the connections carry the transfer in
	// parallel instead of one after another.
	for part := range x.parts {
		c, err := x.peer.conn()
		if err == nil {
			err = c.expect(partKey{x.id, uint32(part)}, x)
		}
		if err != nil {
			fail(err)
			return
		}
		if part == x.parts-1 {
			if err := send(c, part); err != nil {
				fail(err)
			}
			return
		}
		a.wg.Add(1) // this goroutine is counted: the agent cannot have finished waiting
		go func() {
			defer a.wg.Done()
			if err := send(c, part); err != nil {
				fail(err)
			}
		}()
	}
}

func (a *Agent) sendPart(c *conn, x *xfer, part int) error {
	if x.layouts != nil {
		// One part (GPU memory): as layouts where the connection is a
		// same-host one, else as the pieces they stand for.
		if c.uc != nil {
			send := a.sendLayoutLocal
			if x.op == Read {
				send = a.sendReadLayout
			}
			if sent, err := send(c, x); sent {
				return err
			}
		}
		x.expand()
		a.memMu.RLock()
		err := a.checkLocal(x.descs)
		a.memMu.RUnlock()
		if err != nil {
			return err
		}
	}
	ds := x.descs[x.split[part]:x.split[part+1]]
	if x.op == Read {
		h := make([]byte, 0, 21+len(x.notif)+16*len(ds))
		typ := byte(tReadReq)
		if x.notif != nil {
			typ = tReadReqTag
		}
		h = append(h, typ)
		h = binary.LittleEndian.AppendUint64(h, uint64(x.id))
		h = binary.LittleEndian.AppendUint32(h, uint32(part))
		h = binary.LittleEndian.AppendUint32(h, uint32(len(ds)))
		if x.notif != nil {
			h = binary.LittleEndian.AppendUint32(h, uint32(len(x.notif)))
			h = append(h, x.notif...)
		}
		for _, d := range ds {
			h = binary.LittleEndian.AppendUint64(h, d.Remote)
			h = binary.LittleEndian.AppendUint64(h, d.Len)
		}
		return c.writeFrame(h)
	}
	if c.uc != nil {
		if sent, err := a.sendPartLocal(c, x, part); sent {
			return err
		}
	}
	h := make([]byte, 0, 25+len(x.notif)+16*len(ds))
	h = appendWriteHeader(h, tWrite, x, part, len(ds))
	for _, d := range ds {
		h = binary.LittleEndian.AppendUint64(h, d.Remote)
		h = binary.LittleEndian.AppendUint64(h, d.Len)
	}
	loc := make([]Region, len(ds))
	for i, d := range ds {
		loc[i] = Region{d.Local, d.Len}
	}
	// Payload straight from the source memory (writev), held mapped
	// until it is on the wire.
	a.memMu.RLock()
	defer a.memMu.RUnlock()
	bufs, err := a.resolve(append(make([][]byte, 0, len(loc)+1), h), loc)
	if err != nil {
		return err
	}
	a.wire(WirePartSent, x.id, uint32(part))
	return c.writeFrame(bufs...)
}

// appendWriteHeader appends a WRITE part's header and notification.
func appendWriteHeader(h []byte, typ byte, x *xfer, part, ndesc int) []byte {
	h = append(h, typ)
	h = binary.LittleEndian.AppendUint64(h, uint64(x.id))
	h = binary.LittleEndian.AppendUint32(h, uint32(part))
	h = binary.LittleEndian.AppendUint32(h, uint32(x.parts))
	h = binary.LittleEndian.AppendUint32(h, uint32(ndesc))
	h = binary.LittleEndian.AppendUint32(h, uint32(len(x.notif)))
	return append(h, x.notif...)
}

// read handles a client connection's answers.
func (c *conn) read() {
	a := c.p.owner
	defer a.wg.Done()
	if c.in != nil {
		defer c.in.close()
	}
	if c.descs != nil {
		defer func() { // under wmu: a part being sent may be writing it
			c.wmu.Lock()
			_ = unix.Munmap(c.descs)
			c.descs = nil
			c.wmu.Unlock()
		}()
	}
	var hdr [32]byte
	for {
		if c.uc == nil {
			// Idle between answers as long as it likes; an answer, once
			// begun, must arrive within FrameTimeout, as a frame the
			// peer's server reads must: a peer that stalls mid-answer
			// (its process frozen, the connection kept open) fails the
			// connection, and the transfers waiting on it, instead of
			// holding them in progress for ever.
			_ = c.c.SetReadDeadline(time.Time{})
		}
		if err := readFull(c.r, hdr[:1]); err != nil {
			c.fail(fmt.Errorf("%w: connection to %s lost: %w", ErrXferFailed, c.p.name, err))
			return
		}
		if c.uc == nil {
			_ = c.c.SetReadDeadline(time.Now().Add(a.cfg.FrameTimeout))
		}
		var err error
		switch hdr[0] {
		case tAck, tReadResp, tAckRefused, tReadRefused:
			err = c.readAnswer(hdr[0], hdr[:])
		case tNotifAck:
			if err = readFull(c.r, hdr[:8]); err == nil {
				if x := c.take(partKey{XferID(binary.LittleEndian.Uint64(hdr[:8])), notifPart}); x != nil {
					a.finishPart(x, nil)
				}
			}
		case tFence, tChunk, tChunkDev, tReadLocal, tReadLayoutLocal:
			switch {
			case c.in == nil:
				err = fmt.Errorf("%w: same-host frame type %d from %s on a TCP connection", ErrProtocol, hdr[0], c.p.name)
			case hdr[0] == tReadLocal:
				err = c.readLocal(hdr[:])
			case hdr[0] == tReadLayoutLocal:
				err = c.readLayoutLocal(hdr[:])
			default:
				err = a.serveLocal(c.in, c.r, nil, c.p.name, hdr[0], hdr[:])
			}
		default:
			err = fmt.Errorf("%w: frame type %d from %s", ErrProtocol, hdr[0], c.p.name)
		}
		if err != nil {
			c.fail(fmt.Errorf("%w: %w", ErrXferFailed, err))
			return
		}
	}
}

func (c *conn) readAnswer(typ byte, hdr []byte) error {
	a := c.p.owner
	if err := readFull(c.r, hdr[:16]); err != nil {
		return err
	}
	id := XferID(binary.LittleEndian.Uint64(hdr[:8]))
	part := binary.LittleEndian.Uint32(hdr[8:12])
	elen := binary.LittleEndian.Uint32(hdr[12:16])
	if elen > maxErr {
		return fmt.Errorf("%w: error of %d bytes", ErrProtocol, elen)
	}
	var perr error
	if elen > 0 {
		msg := make([]byte, elen)
		if err := readFull(c.r, msg); err != nil {
			return err
		}
		perr = fmt.Errorf("%w: peer %s: %s", ErrXferFailed, c.p.name, msg)
		if typ == tAckRefused || typ == tReadRefused {
			perr = fmt.Errorf("%w: %w: peer %s: %s", ErrXferFailed, ErrNotGranted, c.p.name, msg)
		}
	} else if typ == tAckRefused || typ == tReadRefused {
		return fmt.Errorf("%w: a refusal without its reason", ErrProtocol)
	}
	if typ == tAck || typ == tAckRefused {
		a.wire(WireAnswerRead, id, part)
	}
	x := c.take(partKey{id, part})
	if x == nil {
		if typ == tReadResp && perr == nil {
			return fmt.Errorf("%w: unexpected read response %d/%d", ErrProtocol, id, part)
		}
		return nil
	}
	if typ == tReadResp && perr == nil {
		// Payload straight into our memory.
		x.expand()
		ds := x.descs[x.split[part]:x.split[part+1]]
		loc := make([]Region, len(ds))
		var n int64
		for i, d := range ds {
			loc[i] = Region{d.Local, d.Len}
			n += int64(d.Len)
		}
		if !a.beginLanding(x, c) {
			// Released: the engine may have reused the memory.
			if _, derr := io.CopyN(io.Discard, c.r, n); derr != nil {
				return derr
			}
			return nil
		}
		a.memMu.RLock()
		bufs, err := a.resolve(nil, loc)
		if err != nil {
			// Our memory went away: drain the payload, fail the part.
			a.memMu.RUnlock()
			a.endLanding(x, c)
			if _, derr := io.CopyN(io.Discard, c.r, n); derr != nil {
				return c.lost(x, derr)
			}
			a.finishPart(x, fmt.Errorf("%w: %w", ErrXferFailed, err))
			return nil
		}
		left, err := c.r.fillvLeft(bufs)
		a.memMu.RUnlock()
		if a.endLanding(x, c) {
			// Released while landing: Release may have set the deadline
			// to cut the payload short; what it left is drained (within
			// the bound of a frame, over TCP).
			var by time.Time
			if c.uc == nil {
				by = time.Now().Add(a.cfg.FrameTimeout)
			}
			_ = c.c.SetReadDeadline(by)
			if err != nil && errors.Is(err, os.ErrDeadlineExceeded) {
				if _, derr := io.CopyN(io.Discard, c.r, left); derr != nil {
					return derr
				}
				return nil
			}
		}
		if err != nil {
			return c.lost(x, err)
		}
	}
	a.finishPart(x, perr)
	return nil
}

// lost fails x, whose part's answer was taken off the connection and
// then broke off or broke the protocol (err, which the connection then
// fails with: x is no longer among the parts that fail with it).
func (c *conn) lost(x *xfer, err error) error {
	c.p.owner.finishPart(x, fmt.Errorf("%w: the answer from %s: %w", ErrXferFailed, c.p.name, err))
	return err
}

// finishPart records one answered part; a READ sends its notification
// once every part landed.
func (a *Agent) finishPart(x *xfer, err error) {
	a.mu.Lock()
	if err != nil {
		x.failLocked(err)
		a.mu.Unlock()
		a.signal()
		return
	}
	x.acked++
	if x.state != InProgress {
		a.mu.Unlock()
		return
	}
	switch {
	case x.acked < x.parts:
	case x.op == Read && x.notif != nil && x.acked == x.parts && !x.released:
		// (A released READ tells the peer nothing: its poster gave it up.)
		a.mu.Unlock()
		c, cerr := x.peer.conn()
		if cerr == nil {
			cerr = c.expect(partKey{x.id, notifPart}, x)
		}
		if cerr == nil {
			h := make([]byte, 0, 13+len(x.notif))
			h = append(h, tNotifReq)
			h = binary.LittleEndian.AppendUint64(h, uint64(x.id))
			h = binary.LittleEndian.AppendUint32(h, uint32(len(x.notif)))
			cerr = c.writeFrame(append(h, x.notif...))
		}
		if cerr != nil {
			a.mu.Lock()
			x.failLocked(fmt.Errorf("%w: notification: %w", ErrXferFailed, cerr))
			a.mu.Unlock()
			a.signal()
		}
		return
	default:
		x.state = Done
	}
	a.mu.Unlock()
	a.signal()
}

// State polls a transfer.
func (a *Agent) State(id XferID) (State, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	x := a.mu.xfers[id]
	if x == nil {
		if a.mu.closed {
			return 0, ErrClosed
		}
		return 0, fmt.Errorf("netxfer: state of transfer %d: %w", id, ErrUnknownXfer)
	}
	return x.state, x.err
}

// Release forgets a transfer; its outcome is dropped. Once it returned,
// the transfer no longer uses this agent's memory: its caller (a Worker
// giving a request up: its producer deemed gone, a close, a panic; or
// one whose transfer failed while other parts still moved) reports the
// request next, and the engine reuses the blocks at once.
//
// A READ lands nothing more: a part whose answer comes later is
// discarded (a TCP payload drained, a same-host answer acknowledged
// without a copy), and Release waits for the parts landing now: a
// same-host copy (CPU or GPU) runs to its end, which is bounded; a
// payload read from a TCP socket, which a stalled peer could hold up for
// ever, is cut short first (the connection's read deadline set in the
// past: the reader drains the rest of the payload and goes on with the
// connection).
//
// A WRITE sends nothing more of the memory: a part not sent yet is not
// sent, and the connections of the parts still reading it fail (a part
// being sent over TCP is cut off mid-frame, so its receiver drops it; a
// same-host part the peer may still be copying from here is withdrawn
// from with the connection's fence, so the copy does not count): the
// peer never lands bytes the engine wrote after this, let alone notifies
// them as the transfer's. Other parts on those connections fail with
// them. A one-sided launch is waited for (it ends on its own, on the
// GPU; what it landed was read before Release returned).
func (a *Agent) Release(id XferID) error {
	a.mu.Lock()
	x, ok := a.mu.xfers[id]
	if !ok {
		a.mu.Unlock()
		return fmt.Errorf("netxfer: release transfer %d: %w", id, ErrUnknownXfer)
	}
	delete(a.mu.xfers, id)
	x.released = true
	var idle chan struct{}
	if x.landing > 0 {
		if x.idle == nil {
			x.idle = make(chan struct{})
		}
		idle = x.idle
		if x.op == Read {
			for _, c := range x.cuts {
				_ = c.c.SetReadDeadline(time.Unix(1, 0))
			}
		}
	}
	// A WRITE's parts still unanswered may read the memory (a done one's
	// were all answered: their bytes arrived whole).
	var conns []*conn
	parts := 0
	if x.op == Write && x.state != Done {
		for _, c := range slices.Concat(x.cuts, x.local) {
			if !slices.Contains(conns, c) {
				conns = append(conns, c)
			}
		}
		if len(conns) > 0 {
			parts = x.parts // set before the first part was sent
		}
	}
	a.mu.Unlock()
	for _, c := range conns {
		if c.waiting(x, parts) {
			c.fail(fmt.Errorf("%w: transfer %d released while its parts read this agent's memory", ErrXferFailed, id))
		}
	}
	if idle != nil {
		<-idle
	}
	return nil
}

// frame builders

func appendNotif(b, msg []byte) []byte {
	b = append(b, tNotif)
	b = binary.LittleEndian.AppendUint32(b, uint32(len(msg)))
	return append(b, msg...)
}

// dropLocal breaks the peer's same-host connections.
func (p *peer) dropLocal(err error) {
	p.mu.Lock()
	var drop []*conn
	p.conns = slices.DeleteFunc(p.conns, func(c *conn) bool {
		if c.uc != nil {
			drop = append(drop, c)
			return true
		}
		return false
	})
	p.mu.Unlock()
	for _, c := range drop {
		c.fail(err)
	}
}
