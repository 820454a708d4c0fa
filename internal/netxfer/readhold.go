package netxfer

import (
	"encoding/binary"
	"fmt"
	"time"
)

// A same-host READ is answered with where its bytes lie in this agent's
// memory, and the client copies them after the answer went out. Its
// admission (the guard's ticket) therefore lasts until the client says it
// no longer reads that memory (tReadCopied), not until the answer is
// sent: a hold that ends meanwhile waits for it, as it waits for a READ
// still going out over TCP, so the engine cannot reuse blocks a peer is
// still copying. A client that does not acknowledge within readAckGrace
// of the hold's end is withdrawn from (the connection's fence set, then
// the connection closed): the READ it copies fails there, the admission
// ends, and the hold's end returns. Only clients that announced
// acknowledgements (tReadAcks) get such answers; others get the bytes
// over the socket (GPU memory, which has no such path, is refused them).

// readAckGrace is how long the end of a hold waits for the client to
// acknowledge a READ answer it is copying before withdrawing from it.
const readAckGrace = time.Second

// heldRead is a same-host READ part's admission from its answer to the
// client's acknowledgement (fields under the localServer's mu).
type heldRead struct {
	ticket   uint64
	held     bool // answered (or about to be): ends with tReadCopied
	cut      bool // what admitted it ended
	released bool
	timer    *time.Timer
}

// readAbort returns the abort of a READ part admitted on a local
// connection whose client acknowledges its copies, and the part's
// heldRead: before its answer, early (may be nil) cuts it short as any
// part; once answered, the client gets readAckGrace to acknowledge.
func (a *Agent) readAbort(s *localServer, early func()) (*heldRead, func()) {
	hr := &heldRead{}
	return hr, func() {
		s.mu.Lock()
		hr.cut = true
		answered := hr.held
		if answered && !hr.released {
			a.awaitAckLocked(s, hr)
		}
		s.mu.Unlock()
		if !answered && early != nil {
			early()
		}
	}
}

// awaitAckLocked starts hr's grace (s.mu held).
func (a *Agent) awaitAckLocked(s *localServer, hr *heldRead) {
	if hr.timer != nil {
		return
	}
	grace := cmpOr(a.cfg.readAckGrace, readAckGrace)
	hr.timer = time.AfterFunc(grace, func() {
		s.mu.Lock()
		live := hr.held && !hr.released
		s.mu.Unlock()
		if live {
			a.log.Warn("netxfer: withdrew from a same-host connection: a READ answered on it was not acknowledged within the grace after its hold ended",
				"grace", grace)
			s.withdraw()
		}
	})
}

func cmpOr(d, def time.Duration) time.Duration {
	if d > 0 {
		return d
	}
	return def
}

// holdRead records the READ part k, about to be answered with where its
// bytes lie, as held until the client acknowledges it.
func (s *localServer) holdRead(a *Agent, k partKey, hr *heldRead, ticket uint64) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.mu.withdrawn {
		return ErrClosed
	}
	if s.mu.reads == nil {
		s.mu.reads = map[partKey]*heldRead{}
	}
	if s.mu.reads[k] != nil {
		return fmt.Errorf("%w: a second READ of transfer %d part %d before the first was acknowledged", ErrProtocol, k.id, k.part)
	}
	if len(s.mu.reads) >= maxHeldReads {
		return fmt.Errorf("%w: %d READ answers not acknowledged, the most a connection keeps", ErrProtocol, maxHeldReads)
	}
	hr.ticket, hr.held = ticket, true
	s.mu.reads[k] = hr
	if hr.cut {
		a.awaitAckLocked(s, hr)
	}
	return nil
}

// isHeld reports whether holdRead took hr (its admission then ends with
// the client's acknowledgement or the connection).
func (s *localServer) isHeld(hr *heldRead) bool {
	if hr == nil {
		return false
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	return hr.held
}

// readCopied takes a client's acknowledgement (tReadCopied).
func (a *Agent) readCopied(s *localServer, r *scatterReader, hdr []byte) error {
	if err := readFull(r, hdr[:12]); err != nil {
		return err
	}
	k := partKey{XferID(binary.LittleEndian.Uint64(hdr[:8])), binary.LittleEndian.Uint32(hdr[8:12])}
	s.mu.Lock()
	hr := s.mu.reads[k]
	if hr == nil {
		s.mu.Unlock()
		return fmt.Errorf("%w: an acknowledgement of transfer %d part %d, which no READ answer on the connection awaits", ErrProtocol, k.id, k.part)
	}
	delete(s.mu.reads, k)
	hr.released = true
	if hr.timer != nil {
		hr.timer.Stop()
	}
	s.mu.Unlock()
	a.releaseGuard(hr.ticket)
	return nil
}

// releaseHeldReads ends the admissions of the READ answers a closed
// connection's client never acknowledged (after its fence was set:
// whatever it copies from now on does not count).
func (a *Agent) releaseHeldReads(s *localServer) {
	s.mu.Lock()
	held := s.mu.reads
	s.mu.reads = nil
	for _, hr := range held {
		hr.released = true
		if hr.timer != nil {
			hr.timer.Stop()
		}
	}
	s.mu.Unlock()
	for _, hr := range held {
		a.releaseGuard(hr.ticket)
	}
}

// ackRead tells the server that this client no longer reads the memory
// its answer to part of READ id named (client side; where the server
// takes acknowledgements).
func (c *conn) ackRead(id XferID, part uint32) {
	if !c.acks {
		return
	}
	var b [13]byte
	b[0] = tReadCopied
	binary.LittleEndian.PutUint64(b[1:], uint64(id))
	binary.LittleEndian.PutUint32(b[9:], part)
	_ = c.writeFrame(b[:]) // a failed write fails the connection: the server then ends the admission
}
