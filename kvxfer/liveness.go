package kvxfer

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// Peer liveness: while a consumer rank waits on a producer engine (a push
// registration waiting for its WRITE, a pull READ), it asks the
// producer's daemon about the engine every PeerTimeout/5 (a handshake, so
// the answer also says whether the engine's ranks changed). The peer is
// alive while it answers with the same generation; a rank of it, also
// while it speaks to us (ranksGone).
//
//   - Silent for PeerTimeout (no answer, no message): it is gone. Every
//     request waiting on it fails, with a reason naming it; the handshake
//     is dropped, so a new request handshakes again.
//   - Unanswered for PeerTimeout while some of its ranks speak: the
//     requests waiting on a rank silent that long fail, naming it (an
//     in-process engine's rank process died alone).
//   - It answers with another generation (it restarted, or a rank of it
//     re-attached): requests waiting on a rank whose agent changed fail
//     (the old agent can no longer complete them), and the new handshake
//     is loaded for the next requests.
//   - A transfer or notice to it failing (a refused dial, a lost
//     connection) asks at once instead of at the next tick.
//
// With the data-plane grants in force (the built-in backend) a request
// failed this way is reported at once: revoking its grant cuts short what
// lands under it and refuses what comes later, even once the engine
// registered the same blocks, with the same producer, for its next
// request (a WRITE names the request it is for, and a grant is for one
// request: FuzzCores found the hole when grants were by block and peer).
// A pull consumer's READs in flight are cut short the same way. Without
// grants (NIXL), a producer that is only unreachable may still WRITE once
// it is back, so a push consumer waits for its fence as for any cancel
// (unless the process posting a rank's WRITEs is seen to exit:
// writerExited);
// so it does when the producer changed generation: a producer that
// restarted cannot complete anything, but its ranks that did not change,
// and one being let go while its WRITEs end, may still write.

// probeEvery is how often a watched engine is asked about.
func (st *loopState) probeEvery() time.Duration {
	return max(st.cfg.PeerTimeout/5, 10*time.Millisecond)
}

// watch starts watching an engine a request now waits on.
func (st *loopState) watch(e *engine) {
	if st.cfg.PeerTimeout < 0 || e.watching {
		return
	}
	e.watching = true
	if e.lastAlive.IsZero() {
		e.lastAlive = st.now
	}
	e.probeAt = st.now.Add(st.probeEvery())
	st.arm(e.probeAt, tProbe, e.id)
}

// waitsOn reports whether a consumer request waits on a transfer from e,
// or on a confirmation of e's that liveness may spare it (awaitsFence).
func (st *loopState) waitsOn(e *engine) bool {
	for _, r := range st.recvs {
		if r.req.Remote.EngineID == e.id && r.sent && (!r.decided || st.awaitsFence(r)) {
			return true
		}
	}
	return false
}

// awaitsFence reports whether r, a push consumer request decided (failed
// or expired) before its producer was judged gone, still waits for a
// producer rank's confirmation of its cancel, with the data-plane grants
// in force: a rank then judged gone is fenced at once (failWaiting), as it
// is for a request that was still waiting, instead of the request
// holding its blocks until FenceTimeout (2 x Lease) for a confirmation a
// dead rank cannot send. Before, a request decided first some other way
// (its deadline passed, its heartbeats to the dead rank failed for a
// third of the lease, the engine cancelled it) while the rank's process
// had just died was no longer watched, and reported only at its fence
// timeout. Without grants (NIXL) an unreachable rank may still WRITE:
// such a request waits for its fence as before (or for writerExited).
func (st *loopState) awaitsFence(r *recvReq) bool {
	if !st.guarded || !r.decided || !r.canceled || st.cfg.Mode != ModePush {
		return false
	}
	for _, t := range r.targets {
		if !r.fenced.has(t) {
			return true
		}
	}
	return false
}

// probeTimer asks about a watched engine, and keeps watching while
// requests wait on it.
func (st *loopState) probeTimer(t timerEntry) {
	e := st.engines[t.id]
	if e == nil || !e.watching || !e.probeAt.Equal(t.at) {
		return
	}
	if !st.waitsOn(e) {
		e.watching = false
		return
	}
	st.probe(e)
	e.probeAt = st.now.Add(st.probeEvery())
	st.arm(e.probeAt, tProbe, e.id)
}

// probe asks e's daemon about it, unless a question is out already. A
// watched engine whose last handshake failed is asked too: requests still
// wait on the agents loaded before (failedProbe).
func (st *loopState) probe(e *engine) {
	if e.probing || st.cfg.PeerTimeout < 0 || e.state != hsReady && (e.state != hsFailed || !e.watching || e.peers == nil) {
		return
	}
	e.probing = true
	st.askResolver(e, min(st.cfg.HandshakeTimeout, max(st.cfg.PeerTimeout/2, 10*time.Millisecond)), true)
}

// probeSoon asks about the engine of a failed transfer or notice at once.
func (st *loopState) probeSoon(engineID string) {
	if e := st.engines[engineID]; e != nil && e.watching {
		st.probe(e)
	}
}

// alive notes that e answered (a handshake or a probe: for every rank).
func (e *engine) alive(now time.Time) { e.lastAlive = now }

// spoke notes that rank t of e sent a message (a rank the handshake
// loaded lists; others are not kept: a peer names what it likes).
func (e *engine) spoke(t rankRef, now time.Time) {
	if _, ok := e.peers[t]; !ok {
		return
	}
	if e.rankSpoke == nil {
		e.rankSpoke = map[rankRef]time.Time{}
	}
	e.rankSpoke[t] = now
}

// recheckLater asks e's daemon again when a registry's PeerGeneration
// came while a question was out (peerGenerationEvent).
func (st *loopState) recheckLater(e *engine) {
	if e.recheck && e.state == hsReady && !e.probing {
		e.recheck = false
		e.probing = true
		st.askResolver(e, st.cfg.HandshakeTimeout, true)
	}
}

// probeDone handles the answer to a probe.
func (st *loopState) probeDone(h *hsResult) {
	e := st.engines[h.engine]
	if e == nil || h.moves != e.addrMoves {
		return // (a probe of an address the engine moved from: engineAt)
	}
	e.probing = false
	defer st.recheckLater(e)
	if e.stale && e.state == hsReady {
		// What waited for the registry's word goes on with this answer
		// (an error too: it then goes to the agents it has).
		defer func() {
			if e.stale && e.state == hsReady && (h.err != nil || h.res.Generation == e.gen) {
				e.stale = false
				st.redrive(e)
			}
		}()
	}
	if e.state == hsFailed {
		st.failedProbe(e, h)
		return
	}
	if e.state != hsReady {
		return // a handshake of its own is under way
	}
	if h.err != nil {
		if errors.Is(h.err, context.Canceled) && h.closing {
			return // closing
		}
		st.doubt(e) // unanswered: the handshake loaded may be past (handshakeFresh)
		st.answeredRanks(e, h.err)
		// Probes off (negative PeerTimeout): only a registry's
		// PeerGeneration asked, and an unanswered question is no verdict.
		if silent := st.now.Sub(e.lastAlive); st.cfg.PeerTimeout >= 0 && silent >= st.cfg.PeerTimeout {
			st.ranksGone(e, silent, h.err)
		}
		return
	}
	e.alive(st.now)
	if h.res.Generation == e.gen {
		if h.took <= expiryMargin {
			// A probe is a handshake, timed as one: the peer's clock as of
			// now, which a pull consumer's READs are bounded by (read). The
			// engine, in use, is not handshaken again, and its clock may
			// have been stepped since (NTP setting it right). Before, the
			// first handshake's offset stayed: a producer's clock set
			// forward since by more than expiryMargin had its holds read
			// past their end, possibly another request's KV over NIXL. An
			// answer slower than the margin (its offset's error up to
			// half of it) leaves the offset as it was.
			e.offset, e.offsetAt = h.res.ClockOffset, st.now
		}
		return
	}
	if h.names == nil {
		// Its generation changed after the probe was asked (a handshake
		// meanwhile), and the driver loaded no agents: ask again in full.
		st.startHandshake(e)
		return
	}
	// Its ranks changed: loading the answer fails what waited on the
	// ranks whose agent changed (failChanged).
	e.state = hsPending
	st.handshakeDone(&hsResult{engine: h.engine, res: h.res, names: h.names, loadErrs: h.loadErrs})
}

// offsetMaxAge is how old the clock offset a pull consumer's READs are
// bounded by may be (its producer's expiry is on the producer's clock).
// An engine in use is probed every PeerTimeout/5, each probe measuring
// it again; an idle one (up to EngineTTL) is not, and its clock may have
// been stepped meanwhile (NTP setting it right) by more than
// expiryMargin. The first READ after a longer gap waits for a probe.
const offsetMaxAge = 30 * time.Second

// refreshOffset reports whether a pull READ bounded by e's clock (an
// expiry on it) waits for a probe that measures the offset again: it is
// older than offsetMaxAge, and not asked within offsetMaxAge (a probe
// answered too slowly to time it, or not at all, leaves it as it was:
// the READ then goes by it, as before). What waits is read once the
// answer is in (probeDone: stale).
func (st *loopState) refreshOffset(e *engine) bool {
	if e.state != hsReady || st.now.Sub(e.offsetAt) <= offsetMaxAge || st.now.Sub(e.offsetAsked) <= offsetMaxAge {
		return false
	}
	e.offsetAsked = st.now
	e.stale = true
	if !e.probing {
		e.probing = true
		st.askResolver(e, st.cfg.HandshakeTimeout, true)
	}
	return true
}

// failedProbe handles the answer to a probe of an engine whose last
// handshake failed (a new request's, after a rank's port refused it)
// while requests still wait on the agents loaded before: they are judged
// as while the handshake was loaded. Unanswered for PeerTimeout, the
// ranks silent that long are gone (ranksGone); answered at another
// generation, a handshake loads it, failing what waited on the ranks that
// changed (failChanged). Before, a failed handshake ended the probes, and
// a request waiting on a rank whose process had died waited for its
// deadline.
func (st *loopState) failedProbe(e *engine, h *hsResult) {
	if h.err != nil {
		if errors.Is(h.err, context.Canceled) && h.closing {
			return
		}
		st.answeredRanks(e, h.err)
		if silent := st.now.Sub(e.lastAlive); silent >= st.cfg.PeerTimeout {
			st.ranksGone(e, silent, h.err)
		}
		return
	}
	e.alive(st.now)
	if h.res.Generation != e.gen {
		st.startHandshake(e)
	}
}

// answeredRanks notes, for a probe that failed because some of e's ranks
// did not answer (PartialHandshakeError: an in-process engine's ranks
// answer at servers of their own, and one rank's process died), that each
// rank that answered with the agent loaded for it is alive, as if it had
// spoken (ranksGone judges by rank): a request waiting on it alone is not
// failed as if its engine were gone because a sibling rank died. A rank
// answering with another agent restarted: its old agent, which requests
// wait on, is gone, so that answer counts for nothing (those requests are
// judged by the liveness bound, as before). Before, such an answer counted
// as no answer at all: once no rank had spoken for PeerTimeout (a push
// consumer hears nothing from its producer ranks until its WRITE ends),
// every request waiting on the engine failed, "producer engine ... is
// gone", those whose own producer rank lived too.
func (st *loopState) answeredRanks(e *engine, err error) {
	var partial *PartialHandshakeError
	if !errors.As(err, &partial) {
		return
	}
	for i := range partial.Answered {
		r := &partial.Answered[i]
		ref := rankRef{tp: r.Layout.TPRank, pp: r.Layout.PPRank}
		if sum, ok := e.agentSums[ref]; ok && r.EngineID == e.id && sum == sha256.Sum256(r.Agent) {
			e.spoke(ref, st.now)
		}
	}
}

// failChanged fails the requests waiting on e's ranks whose agent the
// handshake h, of another generation than the one loaded, no longer
// lists, before h is loaded: their old agent can no longer complete
// them. Every handshake that loads a new generation goes through it, not
// only a probe's: before, one a request started (retryAfterHandshake: its
// registration found the old agents gone) or one started in full after a
// probe saw the generation change (the driver loaded no agents) loaded
// the new agents without a word to the requests registered with the old
// ones, and probes, answered by the new generation, found nothing
// changed: those requests waited for their registration timeout (8
// minutes by default) instead of failing within the liveness bound.
func (st *loopState) failChanged(e *engine, h *hsResult) {
	if e.peers == nil || e.gen == 0 || h.res.Generation == e.gen {
		return
	}
	// replaced: a rank another agent speaks for now. Its old agent is
	// gone with everything it moved: a daemon attaches a rank again only
	// once its old Worker's close fenced what it moved, and an engine
	// process that restarted took its agents with it.
	changed, replaced := map[rankRef]bool{}, map[rankRef]bool{}
	for ref, old := range e.peers {
		changed[ref] = true
		for i := range h.res.Ranks {
			l := &h.res.Ranks[i].Layout
			if l.TPRank == ref.tp && l.PPRank == ref.pp {
				if name, err := h.agent(i); err == nil && name == old {
					changed[ref] = false
				} else if err == nil {
					replaced[ref] = true
				}
			}
		}
	}
	reason := fmt.Sprintf("producer engine %s (%s) restarted or re-attached a rank (generation %d -> %d): the transfer cannot complete",
		e.id, e.addr, e.gen, h.res.Generation)
	// Under grants every rank is fenced at once (revoking cuts short what
	// lands). Without them only a replaced rank is: one that did not
	// change may still be writing into the request's blocks, and so may
	// one that left without a successor (a daemon unpublishes a detaching
	// rank before its Worker's close has fenced its WRITEs); the request
	// waits for their confirmations as for any cancel (FenceTimeout
	// bounds the wait).
	n := st.failOnRanks(e, reason, changed, replaced)
	st.log.Warn("kvxfer: peer engine changed; handshaking again", "engine", e.id, "addr", e.addr,
		"old_generation", e.gen, "generation", h.res.Generation, "failed_requests", n)
}

// failOnRanks fails (peer_gone, reason) the requests waiting on e that
// still wait on a producer rank of on, with the ranks of replaced fenced
// (every rank under grants, whose revoking cuts short what lands), and
// returns how many.
func (st *loopState) failOnRanks(e *engine, reason string, on, replaced map[rankRef]bool) int {
	fence := func(t rankRef) bool { return st.guarded || replaced[t] }
	return st.failWaiting(e, FailurePeerGone, reason, fence, func(r *recvReq) bool {
		for _, t := range r.targets {
			if on[t] && !r.got.has(t) {
				return true
			}
		}
		return false
	})
}

// ranksGone judges an engine whose probes have gone unanswered for
// silent (PeerTimeout or more), rank by rank: with no rank heard from
// within PeerTimeout either, the engine is gone (peerGone); otherwise
// the requests waiting on a rank silent that long fail, naming it, and
// the rest wait on (their ranks speak: an in-process engine's rank
// process died, its siblings live).
func (st *loopState) ranksGone(e *engine, silent time.Duration, err error) {
	cut := st.now.Add(-st.cfg.PeerTimeout)
	spoke := func(t rankRef) bool { at, ok := e.rankSpoke[t]; return ok && at.After(cut) }
	anySpoke := false
	for t := range e.rankSpoke {
		anySpoke = anySpoke || spoke(t)
	}
	if !anySpoke {
		st.peerGone(e, fmt.Errorf("unreachable for %v: %w", silent.Round(time.Millisecond), err))
		return
	}
	waitsOnSilent := func(r *recvReq) bool {
		for _, t := range r.targets {
			if !r.got.has(t) && !r.fenced.has(t) && !spoke(t) {
				return true
			}
		}
		return false
	}
	var gone []string
	for _, id := range sortedKeys(st.recvs) {
		r := st.recvs[id]
		if r.req.Remote.EngineID != e.id || !r.sent || r.decided && !st.awaitsFence(r) {
			continue
		}
		for _, t := range r.targets {
			if name := fmt.Sprintf("tp %d pp %d", t.tp, t.pp); !r.got.has(t) && !r.fenced.has(t) && !spoke(t) && !slices.Contains(gone, name) {
				gone = append(gone, name)
			}
		}
	}
	if len(gone) == 0 {
		return
	}
	slices.Sort(gone)
	reason := fmt.Sprintf("producer engine %s (%s): rank %s silent and unreachable for %v while its other ranks speak: %v",
		e.id, e.addr, strings.Join(gone, ", rank "), silent.Round(time.Millisecond), err)
	fence := func(rankRef) bool { return st.guarded } // as peerGone
	n := st.failWaiting(e, FailurePeerGone, reason, fence, waitsOnSilent)
	st.log.Warn("kvxfer: peer engine's ranks are gone", "failure_type", "peer_gone", "engine", e.id, "addr", e.addr,
		"ranks", gone, "err", err, "failed_requests", n)
}

// peerGone fails what waits on an engine that stopped answering, and
// drops its handshake so the next request handshakes again.
func (st *loopState) peerGone(e *engine, err error) {
	reason := fmt.Sprintf("producer engine %s (%s) is gone: %v", e.id, e.addr, err)
	fence := func(rankRef) bool { return st.guarded } // see above
	n := st.failWaiting(e, FailurePeerGone, reason, fence, func(*recvReq) bool { return true })
	st.log.Warn("kvxfer: peer engine is gone", "failure_type", "peer_gone", "engine", e.id, "addr", e.addr, "err", err, "failed_requests", n)
	// The next request handshakes again at once (the peer may be back by
	// then); if that fails too, handshakeRetry applies as usual.
	e.state, e.err, e.failedAt = hsFailed, fmt.Errorf("kvxfer: engine %s: %w", e.id, err), time.Time{}
	e.watching = false
}

// failWaiting fails the consumer requests that wait on e and match, each
// producer rank fenced at once where fence says nothing of it can land
// any more, and returns how many. A matching request decided already and
// waiting for confirmations (awaitsFence) keeps its outcome, its ranks
// fenced the same way: it reports once none is left to wait for.
func (st *loopState) failWaiting(e *engine, kind FailureKind, reason string, fence func(rankRef) bool, match func(*recvReq) bool) int {
	n := 0
	for _, id := range sortedKeys(st.recvs) {
		r := st.recvs[id]
		if r.req.Remote.EngineID != e.id || !r.sent || r.decided && !st.awaitsFence(r) || !match(r) {
			continue
		}
		if r.decided {
			for _, t := range r.targets {
				if fence(t) && !r.fenced.has(t) {
					r.fenced = r.fenced.add(t)
				}
			}
			st.tryReport(r)
			continue
		}
		n++
		for _, t := range r.targets {
			if fence(t) && !r.fenced.has(t) {
				r.fenced = r.fenced.add(t)
			}
		}
		for _, h := range slices.Sorted(maps.Keys(r.handles)) {
			if x := st.handles[h]; x != nil && fence(r.handles[h]) {
				st.abandonXfer(x)
			}
		}
		st.decide(r, ResultFailed, kind, reason)
		st.tryReport(r)
	}
	return n
}

// peerGoneEvent is Worker.PeerGone in the loop: a registry says the
// engine is gone (its lease ended).
func (st *loopState) peerGoneEvent(id, why string) {
	e := st.engines[id]
	if e == nil || e.state != hsReady {
		return
	}
	st.peerGone(e, errors.New(why))
}

// peerGenerationEvent is Worker.PeerGeneration in the loop: a registry
// says the engine is at generation gen; a handshake of another
// generation is asked about at once (a probe, whose answer handles the
// change).
func (st *loopState) peerGenerationEvent(id string, gen uint64) {
	e := st.engines[id]
	if e == nil || e.state == hsFailed || e.state == hsReady && e.gen == gen {
		return
	}
	if e.state == hsPending {
		// The handshake out may be answered by the old address (an
		// engine that moved off a dead daemon): ask again once it is in
		// (recheckLater), not drop the registry's word.
		e.recheck = true
		return
	}
	// Until the answer is in, new requests wait for it instead of going
	// to agents the registry says are past (stale); a question already
	// out (a probe of the old, perhaps dead, address: up to a second)
	// is not waited for: this one goes now.
	e.stale = true
	st.log.Info("kvxfer: peer engine has a new generation; asking it", "engine", id, "addr", e.addr, "generation", e.gen, "new_generation", gen)
	e.probing = true
	st.askResolver(e, st.cfg.HandshakeTimeout, true)
}
