package netxfer

import (
	"bufio"
	"crypto/tls"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"runtime/debug"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// serve handles one incoming connection: a peer's requests, answered in
// order on the same connection.
// in counts a TCP connection in the agent's bounds (nil: a same-host one).
func (a *Agent) serve(raw net.Conn, in *tcpIncoming) {
	defer a.wg.Done()
	defer func() {
		_ = raw.Close()
		a.mu.Lock()
		delete(a.mu.incoming, raw)
		a.mu.Unlock()
		in.closed()
	}()
	from, inc := "", "" // the peer and its incarnation, once its hello was taken
	defer func() {
		if from != "" {
			a.servedEnd(session{from, inc})
		}
	}()
	nc := raw
	uc, isLocal := raw.(*net.UnixConn)
	if isLocal {
		// The same-host socket: only this agent's own user, no TLS (the
		// bytes never leave the kernel).
		if err := checkPeerUser(uc); err != nil {
			a.log.Warn("netxfer: refused a same-host connection", "err", err)
			return
		}
	} else if a.cfg.ServerTLS != nil {
		tc := tls.Server(raw, a.cfg.ServerTLS)
		_ = raw.SetDeadline(time.Now().Add(a.cfg.FrameTimeout))
		if err := tc.Handshake(); err != nil {
			a.tlsFailures.Add(1)
			if a.cfg.Auth != nil {
				a.cfg.Auth.CountFailure() // kvxfer_peer_auth_failures_total
			}
			a.log.Warn("netxfer: refused a connection", "from", raw.RemoteAddr(), "err", fmt.Errorf("TLS: %w", err))
			return
		}
		_ = raw.SetDeadline(time.Time{})
		nc = tc
	}
	authed := ""
	if a.cfg.Auth != nil && a.cfg.Auth.Enabled() {
		name, err := a.cfg.Auth.Server(nc, "data")
		if err != nil {
			a.log.Warn("netxfer: refused a connection", "from", nc.RemoteAddr(), "err", err)
			return
		}
		authed = name
	}
	var r *scatterReader
	var ls *localServer
	if isLocal {
		ls = newLocalServer(uc)
		a.mu.Lock()
		if a.mu.closed {
			a.mu.Unlock()
			ls.close()
			return
		}
		a.mu.localIn[ls] = true
		a.mu.Unlock()
		defer func() {
			a.mu.Lock()
			delete(a.mu.localIn, ls)
			a.mu.Unlock()
			a.dropGateViews(ls) // and waits for the launches through them
			if ls.serving {     // left mid-frame: the parts still in flight answer
				ls.serving = false
				ls.wmu.Unlock()
			}
			ls.close()             // its fence set first: copies from now on do not count
			a.releaseHeldReads(ls) // the READ answers its client did not acknowledge
		}()
		r = newScatterReader(ls.fr)
	} else {
		r = newScatterReader(nc)
	}
	var hdr [32]byte
	_ = nc.SetReadDeadline(time.Now().Add(a.cfg.FrameTimeout))
	if err := readFull(r, hdr[:7]); err != nil {
		return
	}
	bound := hdr[4] == versionBound && !isLocal && !a.cfg.noBind
	if string(hdr[:4]) != magic || hdr[4] != version && (hdr[4] != versionIdent || a.cfg.noIdent) && !bound {
		a.log.Warn("netxfer: refused a connection", "from", nc.RemoteAddr(), "reason", "bad hello")
		return
	}
	nlen := binary.LittleEndian.Uint16(hdr[5:7])
	if nlen == 0 || nlen > maxName {
		return
	}
	name := make([]byte, nlen)
	if err := readFull(r, name); err != nil {
		return
	}
	switch {
	case bound:
		var err error
		if inc, err = a.boundServe(nc, r, hdr[:7], name); err != nil {
			a.refuseHello(nc, name, err)
			return
		}
	case isBound(string(name)) && !isLocal && !a.cfg.noBind:
		// A bound name is given only with its proof (on TCP; the
		// same-host socket's peer is kvxferd's own user).
		a.refuseHello(nc, name, fmt.Errorf("its hello gives a bound name without proving it holds its key"))
		return
	case hdr[4] == versionIdent:
		// The agent the dialer means, by its same-host socket's name (its
		// process's own): another that listened at this address before
		// (a process restarted at the same port) is not this one.
		var fields [2][]byte
		for i := range fields {
			if err := readFull(r, hdr[:2]); err != nil {
				return
			}
			n := binary.LittleEndian.Uint16(hdr[:2])
			if n > maxName {
				return
			}
			fields[i] = make([]byte, n)
			if err := readFull(r, fields[i]); err != nil {
				return
			}
		}
		if target := string(fields[0]); target == "" || target != a.uaddr {
			a.log.Warn("netxfer: refused a connection", "from", nc.RemoteAddr(), "peer", string(name), "reason",
				fmt.Sprintf("its hello is for the agent at same-host socket %q, this agent (%s) is at %q: meant for another agent that listened at this address", target, a.cfg.Name, a.uaddr))
			return
		}
		if !isLocal { // (a same-host socket's name is its process's own)
			if _, err := nc.Write([]byte{helloOK}); err != nil {
				return
			}
		}
		inc = string(fields[1])
		if ls != nil {
			ls.inc = inc
		}
	}
	if a.cfg.Auth != nil && a.cfg.Auth.Enabled() && string(name) != authed {
		a.log.Warn("netxfer: refused a connection", "from", nc.RemoteAddr(), "reason",
			fmt.Sprintf("its hello names %q, it authenticated as %q", name, authed))
		return
	}
	from = string(name)
	a.mu.Lock()
	a.mu.served[session{from, inc}]++
	a.mu.Unlock()
	in.hello()
	// Answers are small; a buffered writer batches them. Payloads of READ
	// responses bypass it (Flush first, then writev from memory).
	w := bufio.NewWriterSize(nc, 4096)
	var sc scratch
	// A part admitted under a grant that ends while its bytes still move
	// is cut short: the connection's next read or write fails at once.
	sc.abort = func() {
		past := time.Unix(1, 0)
		_ = nc.SetReadDeadline(past)
		_ = nc.SetWriteDeadline(past)
	}
	for {
		// Idle between frames as long as it likes; a frame, once begun,
		// must arrive within FrameTimeout. (Both deadlines are cleared: an
		// abort that came as the part before ended set them in the past.)
		_ = nc.SetDeadline(time.Time{})
		if err := readFull(r, hdr[:1]); err != nil {
			return
		}
		_ = nc.SetReadDeadline(time.Now().Add(a.cfg.FrameTimeout))
		if ls != nil {
			// Answers of parts whose GPU batches end later are written
			// between frames (see localServer.async).
			ls.wmu.Lock()
			ls.serving = true
		}
		var err error
		switch hdr[0] {
		case tWrite:
			err = a.serveWrite(r, w, session{from, inc}, hdr[:], &sc)
		case tReadReq, tReadReqTag:
			err = a.serveRead(r, nc, w, from, hdr[:], hdr[0] == tReadReqTag, &sc, ls)
		case tNotif:
			var msg []byte
			if msg, err = readMsg(r, hdr[:4]); err == nil {
				err = a.deliver(from, msg)
			}
		case tNotifReq:
			if err = readFull(r, hdr[:8]); err != nil {
				return
			}
			var msg []byte
			if msg, err = readMsg(r, hdr[8:12]); err == nil {
				if err = a.deliver(from, msg); err == nil {
					ack := append([]byte{tNotifAck}, hdr[:8]...)
					if _, err = w.Write(ack); err == nil {
						err = w.Flush()
					}
				}
			}
		case tFence, tChunk, tChunkDev, tWriteLocal, tDescs, tWriteTable, tWriteLayout, tWriteLayoutTable, tReadLayout,
			tGateArea, tGateChunk, tGateOpen, tGateShut, tReadAcks, tReadCopied:
			if ls == nil {
				err = fmt.Errorf("%w: same-host frame type %d from %s on a TCP connection", ErrProtocol, hdr[0], from)
			} else {
				err = a.serveLocal(ls, r, w, from, hdr[0], hdr[:])
			}
		default:
			err = fmt.Errorf("%w: frame type %d from %s", ErrProtocol, hdr[0], from)
		}
		if ls != nil {
			ls.serving = false
			ls.wmu.Unlock()
		}
		if err != nil {
			a.log.Warn("netxfer: dropped a connection", "from", from, "err", err)
			return
		}
	}
}

func readMsg(r io.Reader, lenBuf []byte) ([]byte, error) {
	if err := readFull(r, lenBuf[:4]); err != nil {
		return nil, err
	}
	n := binary.LittleEndian.Uint32(lenBuf[:4])
	if n > maxNotif {
		return nil, fmt.Errorf("%w: notification of %d bytes", ErrProtocol, n)
	}
	msg := make([]byte, n)
	return msg, readFull(r, msg)
}

// scratch is a connection's buffers for the frames it serves, reused
// from frame to frame (kept up to keepScratch descriptors).
type scratch struct {
	tab    []byte
	ranges []Region
	bufs   [][]byte
	tg     []target
	abort  func() // cuts the connection's part in progress short
}

const keepScratch = 1 << 16

// done clears what the frame left and drops buffers grown past
// keepScratch.
func (sc *scratch) done() {
	clear(sc.bufs)
	clear(sc.tg)
	if cap(sc.ranges) > keepScratch {
		*sc = scratch{}
	}
}

// readTable reads n (addr, len) pairs into sc.
func readTable(r io.Reader, n uint32, sc *scratch) ([]Region, uint64, error) {
	if n > maxDescs {
		return nil, 0, fmt.Errorf("%w: %d descriptors", ErrProtocol, n)
	}
	if cap(sc.tab) < 16*int(n) {
		sc.tab = make([]byte, 16*int(n))
	}
	tab := sc.tab[:16*int(n)]
	if err := readFull(r, tab); err != nil {
		return nil, 0, err
	}
	if cap(sc.ranges) < int(n) {
		sc.ranges = make([]Region, n)
	}
	rs := sc.ranges[:n]
	var total uint64
	for i := range rs {
		rs[i] = Region{binary.LittleEndian.Uint64(tab[16*i:]), binary.LittleEndian.Uint64(tab[16*i+8:])}
		total += rs[i].Len
		if rs[i].Len > maxPayload || total > maxPayload {
			return nil, 0, fmt.Errorf("%w: payload over %d bytes", ErrProtocol, uint64(maxPayload))
		}
	}
	return rs, total, nil
}

func answer(w *bufio.Writer, typ byte, id uint64, part uint32, err error) error {
	var msg string
	if err != nil {
		msg = err.Error()
		if len(msg) > maxErr {
			msg = msg[:maxErr]
		}
	}
	var b [17]byte
	b[0] = typ
	binary.LittleEndian.PutUint64(b[1:], id)
	binary.LittleEndian.PutUint32(b[9:], part)
	binary.LittleEndian.PutUint32(b[13:], uint32(len(msg)))
	if _, werr := w.Write(b[:]); werr != nil {
		return werr
	}
	_, werr := w.WriteString(msg)
	return werr
}

// writeHeader is a WRITE part's header, as read by the receiver.
type writeHeader struct {
	id          uint64
	part, parts uint32
	n, nl       uint32
	notif       []byte
}

// readWriteHeader reads a WRITE part's header and notification (the
// frame type read already).
func readWriteHeader(r io.Reader, hdr []byte) (writeHeader, error) {
	if err := readFull(r, hdr[:24]); err != nil {
		return writeHeader{}, err
	}
	h := writeHeader{id: binary.LittleEndian.Uint64(hdr[:8]), part: binary.LittleEndian.Uint32(hdr[8:12]),
		parts: binary.LittleEndian.Uint32(hdr[12:16]), n: binary.LittleEndian.Uint32(hdr[16:20]), nl: binary.LittleEndian.Uint32(hdr[20:24])}
	if h.nl > maxNotif || h.parts == 0 || h.part >= h.parts || h.parts > 1<<16 {
		return h, fmt.Errorf("%w: write header part %d/%d, notification %d bytes", ErrProtocol, h.part, h.parts, h.nl)
	}
	h.notif = make([]byte, h.nl)
	return h, readFull(r, h.notif)
}

// landingRoom refuses a part that would start one multi-part WRITE too
// many for its peer: a peer cannot grow the table by starting transfers
// it never finishes, nor fill it for the others.
func (a *Agent) landingRoom(ss session, h writeHeader) error {
	k := landKey{ss.peer, ss.inc, XferID(h.id)}
	a.mu.Lock()
	full := a.mu.landing[k] == nil && h.parts > 1 && a.mu.landingBy[ss.peer] >= maxLanding
	if full {
		// WRITEs whose other parts will never come (their sender gave
		// them up, or its connection failed while the peer keeps others
		// open) are forgotten once no part came for staleLanding.
		now := time.Now()
		for lk, l := range a.mu.landing {
			if lk.peer == ss.peer && now.Sub(l.last) > staleLanding {
				a.endLandingLocked(lk)
			}
		}
		full = a.mu.landingBy[ss.peer] >= maxLanding
	}
	a.mu.Unlock()
	if full {
		return fmt.Errorf("%w: %d multi-part writes from %s unfinished, the most an agent keeps for a peer", ErrProtocol, maxLanding, ss.peer)
	}
	return nil
}

// landingLocked returns the landing of k, starting it (counted against
// its peer) if need be (a.mu held).
func (a *Agent) landingLocked(k landKey, parts uint32) *landing {
	l := a.mu.landing[k]
	if l == nil {
		l = &landing{parts: int(parts)}
		a.mu.landing[k] = l
		a.mu.landingBy[k.peer]++
	}
	l.last = time.Now()
	return l
}

// endLandingLocked forgets the landing of k (a.mu held).
func (a *Agent) endLandingLocked(k landKey) {
	if _, ok := a.mu.landing[k]; !ok {
		return
	}
	delete(a.mu.landing, k)
	if a.mu.landingBy[k.peer]--; a.mu.landingBy[k.peer] <= 0 {
		delete(a.mu.landingBy, k.peer)
	}
}

// partLost records a WRITE part whose frame broke off after its header
// (the connection failed, or the peer broke the protocol): it never
// lands, and its sender fails the transfer with the connection. Counted
// as failed, so that the landing ends with its other parts.
func (a *Agent) partLost(ss session, h writeHeader) {
	if h.parts <= 1 {
		return
	}
	k := landKey{ss.peer, ss.inc, XferID(h.id)}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.landing[k] == nil && a.mu.landingBy[ss.peer] >= maxLanding {
		return
	}
	l := a.landingLocked(k, h.parts)
	l.failed++
	if l.landed+l.failed >= l.parts {
		a.endLandingLocked(k)
	}
}

// servedEnd notes the end of a connection from a peer's incarnation:
// with its last, the multi-part WRITEs it left unfinished are forgotten
// (their parts still to come went with the connections they were on,
// and their sender failed them).
func (a *Agent) servedEnd(ss session) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.mu.served[ss]--; a.mu.served[ss] > 0 {
		return
	}
	delete(a.mu.served, ss)
	if a.mu.landingBy[ss.peer] == 0 {
		return
	}
	for k := range a.mu.landing {
		if k.peer == ss.peer && k.inc == ss.inc {
			a.endLandingLocked(k)
		}
	}
}

// landed records a WRITE part that landed (berr nil) or was refused,
// delivers the notification once every part landed, and acknowledges
// the part.
func (a *Agent) landed(w *bufio.Writer, ss session, h writeHeader, v Verdict, berr error) error {
	from := ss.peer
	k := landKey{ss.peer, ss.inc, XferID(h.id)}
	a.mu.Lock()
	l := a.landingLocked(k, h.parts)
	if berr != nil {
		l.failed++
	} else {
		l.landed++
	}
	deliver := l.landed == l.parts && h.nl > 0
	if l.landed+l.failed >= l.parts {
		a.endLandingLocked(k)
	}
	a.mu.Unlock()
	if deliver {
		_ = a.deliver(from, h.notif)
	}
	typ := byte(tAck)
	if v == Late {
		typ = tAckRefused
	}
	if berr != nil {
		berr = fmt.Errorf("write refused: %w", berr)
	}
	a.wire(WireAnswerSent, XferID(h.id), h.part)
	if err := answer(w, typ, h.id, h.part, berr); err != nil {
		return err
	}
	return w.Flush()
}

// serveWrite lands one WRITE part straight into registered memory.
func (a *Agent) serveWrite(r *scatterReader, w *bufio.Writer, ss session, hdr []byte, sc *scratch) error {
	from := ss.peer
	defer sc.done()
	h, err := readWriteHeader(r, hdr)
	if err != nil {
		return err
	}
	answered := false
	defer func() {
		if !answered {
			a.partLost(ss, h)
		}
	}()
	a.wire(WirePartRead, XferID(h.id), h.part)
	ranges, total, err := readTable(r, h.n, sc)
	if err != nil {
		return err
	}
	if err := a.landingRoom(ss, h); err != nil {
		return err
	}
	// The guard first: a range the peer holds no grant for is refused
	// before any byte lands; one it never held drops the connection. An
	// admitted part lands before the grant that let it in can end (its
	// revocation waits for it, cutting a part still arriving short).
	v, ticket, berr := a.admitGuard(from, Write, ranges, h.notif, sc.abort)
	if v == Deny {
		return berr
	}
	a.memMu.RLock()
	var bufs [][]byte
	if berr == nil {
		bufs, berr = a.resolve(sc.bufs[:0], ranges)
		sc.bufs = bufs
	}
	if berr != nil {
		a.memMu.RUnlock()
		a.releaseGuard(ticket)
		// Refused: nothing is written; the payload is skipped.
		if _, err := io.CopyN(io.Discard, r, int64(total)); err != nil {
			return err
		}
	} else {
		err := r.fillv(bufs)
		a.memMu.RUnlock()
		a.releaseGuard(ticket)
		if err != nil {
			return err
		}
	}
	answered = true
	return a.landed(w, ss, h, v, berr)
}

// answerReadRefused answers a READ part with why it was refused (v: the
// guard's verdict; a Late refusal keeps the part's transfer able to try
// again).
func answerReadRefused(w *bufio.Writer, v Verdict, id uint64, part uint32, berr error) error {
	typ := byte(tReadResp)
	if v == Late {
		typ = tReadRefused
	}
	if err := answer(w, typ, id, part, fmt.Errorf("read refused: %w", berr)); err != nil {
		return err
	}
	return w.Flush()
}

// serveRead answers one READ part straight from registered memory.
func (a *Agent) serveRead(r *scatterReader, nc net.Conn, w *bufio.Writer, from string, hdr []byte, tagged bool, sc *scratch, ls *localServer) error {
	defer sc.done()
	if err := readFull(r, hdr[:16]); err != nil {
		return err
	}
	id := binary.LittleEndian.Uint64(hdr[:8])
	part := binary.LittleEndian.Uint32(hdr[8:12])
	n := binary.LittleEndian.Uint32(hdr[12:16])
	var tag []byte
	if tagged {
		var err error
		if tag, err = readMsg(r, hdr[:4]); err != nil {
			return err
		}
	}
	ranges, _, err := readTable(r, n, sc)
	if err != nil {
		return err
	}
	abort := sc.abort
	var hr *heldRead
	if ls != nil && ls.acks {
		hr, abort = a.readAbort(ls, sc.abort)
	}
	v, ticket, berr := a.admitGuard(from, Read, ranges, tag, abort)
	if v == Deny {
		return berr
	}
	defer func() {
		if !ls.isHeld(hr) { // else it ends with the client's acknowledgement
			a.releaseGuard(ticket) // after the bytes went out
		}
	}()
	a.memMu.RLock()
	defer a.memMu.RUnlock()
	if berr == nil && hr != nil {
		// Same host: where the bytes are (host files or GPU memory), for
		// the client to copy.
		if sc.tg, berr = a.targets(sc.tg[:0], ranges); berr == nil {
			if done, err := a.answerReadLocal(ls, w, partKey{XferID(id), part}, ranges, hr, ticket); done {
				return err
			}
		}
	}
	var bufs [][]byte
	if berr == nil {
		bufs, berr = a.resolve(sc.bufs[:0], ranges)
		sc.bufs = bufs
	}
	if berr != nil {
		return answerReadRefused(w, v, id, part, berr)
	}
	if err := answer(w, tReadResp, id, part, nil); err != nil {
		return err
	}
	if err := w.Flush(); err != nil {
		return err
	}
	nb := net.Buffers(bufs)
	return writeGuarded(&nb, nc)
}

// Incoming frames are read through a buffer, so that headers and small
// frames cost a read call per buffer, not one per field. A payload goes
// straight from the socket into its destinations: whatever the buffer
// read ahead is copied out, and the rest is read with readv into the
// destination pieces themselves, up to maxIOV pieces per call, so many
// small pieces (one per descriptor: a head's slice of a block, or a P
// rank's share of a D block) cost neither a call nor a copy each. A
// connection without a file descriptor (TLS) reads pieces of directRead
// bytes or more straight into their destination, smaller ones through
// the buffer.
const (
	readBufSize = 64 << 10
	directRead  = 16 << 10
	maxIOV      = 1024
)

// scatterReader reads one connection's frames.
type scatterReader struct {
	raw io.Reader
	br  *bufio.Reader
	rc  syscall.RawConn // nil: no readv (TLS, tests)
	iov [][]byte
}

func newScatterReader(c io.Reader) *scatterReader {
	s := &scatterReader{raw: c, br: bufio.NewReaderSize(c, readBufSize)}
	if tc, ok := c.(*net.TCPConn); ok {
		s.rc, _ = tc.SyscallConn()
	}
	return s
}

func (s *scatterReader) Read(p []byte) (int, error) { return s.br.Read(p) }

// fill reads exactly len(b) bytes into b: what is buffered first, then,
// for a large piece, the rest straight from the connection.
func (s *scatterReader) fill(b []byte) error {
	_, err := s.fillN(b)
	return err
}

// fillN is fill, also returning how many bytes of b it read.
func (s *scatterReader) fillN(b []byte) (int, error) {
	if len(b) < directRead {
		return io.ReadFull(s.br, b)
	}
	n := 0
	if k := s.br.Buffered(); k > 0 {
		n, _ = s.br.Read(b[:min(k, len(b))]) // copies from the buffer only
	}
	m, err := io.ReadFull(s.raw, b[n:])
	return n + m, err
}

// fillv reads exactly the bytes of every piece of bufs, in order.
func (s *scatterReader) fillv(bufs [][]byte) error {
	_, err := s.fillvLeft(bufs)
	return err
}

// fillvLeft is fillv, also returning, when it fails, how many of the
// pieces' bytes it did not read: a reader cut short by a deadline (a
// released READ, see Agent.Release) drains that many to go on with the
// connection's next frame.
func (s *scatterReader) fillvLeft(bufs [][]byte) (left int64, err error) {
	// The pieces are mapped memory: what the buffer read ahead is copied
	// into them in Go, and over TLS the decryption writes them.
	defer faultGuard(debug.SetPanicOnFault(true), &err)
	for _, b := range bufs {
		left += int64(len(b))
	}
	if s.rc == nil {
		for _, b := range bufs {
			n, err := s.fillN(b)
			if left -= int64(n); err != nil {
				return left, err
			}
		}
		return 0, nil
	}
	// What the buffer read ahead, copied out.
	var head []byte
	for len(bufs) > 0 && s.br.Buffered() > 0 {
		b := bufs[0]
		n, _ := s.br.Read(b[:min(len(b), s.br.Buffered())])
		left -= int64(n)
		bufs = bufs[1:]
		if n < len(b) {
			head = b[n:]
			break
		}
	}
	for len(bufs) > 0 || head != nil {
		s.iov = s.iov[:0]
		if head != nil {
			s.iov, head = append(s.iov, head), nil
		}
		k := min(len(bufs), maxIOV-len(s.iov))
		s.iov, bufs = append(s.iov, bufs[:k]...), bufs[k:]
		n, err := s.readv(s.iov)
		if left -= n; err != nil {
			clear(s.iov)
			return left, err
		}
	}
	clear(s.iov)
	return 0, nil
}

// readv fills every piece of iov (at most maxIOV, modified) straight
// from the socket, waiting for it as a plain read would (deadlines hold),
// and returns how many bytes it read.
func (s *scatterReader) readv(iov [][]byte) (got int64, _ error) {
	for len(iov) > 0 && len(iov[0]) == 0 {
		iov = iov[1:]
	}
	for len(iov) > 0 {
		var n int
		var rerr error
		err := s.rc.Read(func(fd uintptr) bool {
			n, rerr = unix.Readv(int(fd), iov)
			return rerr != unix.EAGAIN
		})
		if err != nil {
			return got, err
		}
		if rerr == unix.EINTR {
			continue
		}
		if rerr != nil {
			return got, rerr
		}
		if n == 0 {
			return got, io.ErrUnexpectedEOF
		}
		got += int64(n)
		for n > 0 {
			k := min(n, len(iov[0]))
			iov[0] = iov[0][k:]
			n -= k
			for len(iov) > 0 && len(iov[0]) == 0 {
				iov = iov[1:]
			}
		}
	}
	return got, nil
}
