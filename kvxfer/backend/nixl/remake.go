package nixl

import (
	"errors"
	"fmt"
	"log/slog"
	"sync/atomic"
	"time"

	capi "github.com/kvxfer/kvxfer/internal/nixl"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// Connections made again.
//
// Once UCX finds the connection to a peer agent broken (an endpoint
// error: a transfer whose source memory faulted, a transport's error),
// NIXL marks the peer disconnected and refuses every later post and
// notification to it, for as long as both agents live: loading the
// peer's metadata again changes nothing, and the peer's own handshakes
// report the same generation, so nothing above the backend would ever
// load it anew. Measured with nixl-cu12 1.5.1: after one WRITE out of a
// shrunk memory file, every later request between the two engines
// failed, and a failure notice that could not be sent left the
// consumer's request waiting for its deadline
// (TestBrokenConnectionMadeAgain).
//
// So a transport's failure to a peer whose process lives on (a post
// that failed once its transfer was made, a transfer that ended with an
// error, a notification that failed in the backend) makes the Backend
// make the connection again, on a goroutine of its own: posts,
// preparations and notifications to the peer are refused meanwhile (at
// once, naming why); its transfers in flight are waited for (within
// releaseWait, as InvalidatePeer does: NIXL would forget them while UCX
// moves their bytes); its prepared lists are freed; NIXL forgets the
// peer and loads its metadata again, which opens a new connection; the
// lists are prepared again under the same ids, so the Worker's prepared
// posts carry on. One remake per peer at a time, and at most one per
// remakeEvery, so a peer that keeps failing costs little.

// remakeEvery is the least time between two remakes of the connection to
// one peer (a variable for tests).
var remakeEvery = time.Second

// usable returns why posts and notifications to peer are refused now
// (its process is gone, or its connection is being made again), or nil.
func (n *Backend) usable(peer kvxfer.PeerName) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if err := n.peerGoneLocked(peer); err != nil {
		return err
	}
	return n.remakingLocked(peer)
}

func (n *Backend) remakingLocked(peer kvxfer.PeerName) error {
	if why, ok := n.mu.remaking[peer]; ok {
		return fmt.Errorf("%w: %w: the connection to %s is being made again after it failed (%v)", kvxfer.ErrXferFailed, kvxfer.ErrPeerLost, peer, why)
	}
	return nil
}

// transportErr reports whether err, a post's or notification's, is the
// transport's: a post that failed once its transfer was made, or a
// notification the backend could not send.
func transportErr(err error) bool {
	var e *capi.Error
	return errors.As(err, &e) && e.Transport
}

// lostErr is nixlErr, saying kvxfer.ErrPeerLost where err is the
// transport's: the Worker handshakes again before it gives its request
// up (the peer may be at new agents).
func lostErr(err error) error {
	if transportErr(err) {
		return fmt.Errorf("%w: %w", kvxfer.ErrPeerLost, err)
	}
	return nixlErr(err)
}

// broke is brokeLocked for a post's or notification's error.
func (n *Backend) broke(peer kvxfer.PeerName, err error) {
	if !transportErr(err) {
		return
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.brokeLocked(peer, err, true)
}

// brokeLocked starts remaking the connection to peer after err, where
// transport says err is the transport's (not a request's), the peer's
// process is not known to be gone (its generation ends instead), no
// remake of it is under way, and its metadata is at hand. Caller holds
// mu.
func (n *Backend) brokeLocked(peer kvxfer.PeerName, err error, transport bool) {
	if !transport || peer == "" || n.mu.closed || n.mu.metas[peer] == nil {
		return
	}
	if _, ok := n.mu.remaking[peer]; ok || n.peerGoneLocked(peer) != nil {
		return
	}
	n.mu.remaking[peer] = err
	wait := time.Until(n.mu.remadeAt[peer].Add(remakeEvery))
	n.bg.Add(1)
	go n.remake(peer, wait)
}

// remake makes the connection to peer again (see above), after wait.
func (n *Backend) remake(peer kvxfer.PeerName, wait time.Duration) {
	defer n.bg.Done()
	var err error
	defer func() {
		n.mu.Lock()
		delete(n.mu.remaking, peer)
		n.mu.remadeAt[peer] = time.Now()
		if err == nil && !n.mu.closed {
			remade.Add(1)
		}
		n.mu.Unlock()
		if err != nil && !errors.Is(err, kvxfer.ErrClosed) {
			slog.Warn("kvxfer: NIXL connection not made again", "agent", n.a.Name(), "peer", peer, "err", err)
		} else if err == nil {
			slog.Info("kvxfer: NIXL connection made again after it failed", "agent", n.a.Name(), "peer", peer)
		}
	}()
	if wait > 0 {
		time.Sleep(wait)
	}
	// Its transfers in flight end first (new ones are refused), before
	// anything is held that every other post needs.
	n.mu.Lock()
	left := n.quietLocked(func(x *nixlXfer) bool { return x.peer == peer }, time.Now().Add(releaseWait))
	n.mu.Unlock()
	n.life.RLock()
	defer n.life.RUnlock()
	n.prep.Lock() // no post, prepared post or preparation under way
	defer n.prep.Unlock()
	n.mu.Lock()
	if n.mu.closed {
		n.mu.Unlock()
		err = kvxfer.ErrClosed
		return
	}
	if left > 0 {
		// Posted before the refusals began: the last ones, waited for
		// briefly.
		left = n.quietLocked(func(x *nixlXfer) bool { return x.peer == peer }, time.Now().Add(100*time.Millisecond))
	}
	if left > 0 {
		releasedInFlight.Add(uint64(left))
	}
	meta := n.mu.metas[peer]
	var lists []kvxfer.PrepID
	for id, p := range n.mu.preps {
		if p.peer == peer && !p.dead {
			lists = append(lists, id)
			_ = n.a.Unprepare(p.p) // before NIXL forgets what it refers to
			p.dead, p.stale = true, fmt.Errorf("the connection to %s was made again and this list could not be prepared again", peer)
			n.mu.preps[id] = p
		}
	}
	n.mu.Unlock()
	if meta == nil { // forgotten meanwhile (InvalidatePeer)
		return
	}
	if e := n.a.InvalidatePeer(string(peer)); e != nil && !errors.Is(e, capi.ErrClosed) {
		err = fmt.Errorf("forget %s: %w", peer, e)
	}
	if _, e := n.a.LoadPeer(meta); e != nil {
		err = errors.Join(err, fmt.Errorf("load %s again: %w", peer, nixlErr(e)))
		return
	}
	err = nil
	for _, id := range lists {
		n.mu.Lock()
		p := n.mu.preps[id]
		n.mu.Unlock()
		h, e := n.a.Prepare(string(peer), p.entries)
		n.mu.Lock()
		if q, ok := n.mu.preps[id]; ok && e == nil { // not released meanwhile: ReleasePrepared waits for prep
			q.p, q.dead, q.stale = h, false, nil
			n.mu.preps[id] = q
		} else if e == nil {
			_ = n.a.Unprepare(h)
		}
		n.mu.Unlock()
	}
}

// remade counts the connections this process's Backends made again.
var remade atomic.Uint64

// RemadeConnections returns how many connections to peers this process's
// Backends made again after they failed.
func RemadeConnections() uint64 { return remade.Load() }
