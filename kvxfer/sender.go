package kvxfer

import "time"

// Identity binds to messages: a peer message names its sender (engine,
// TP rank, PP rank), and is accepted only from the agent that rank is
// known by. For an engine this rank handshook with, the handshake says
// which agent each of its ranks is (authoritative); a message from another
// agent makes the worker handshake again (the peer may have restarted
// with new agents) and waits for the answer, at most once per
// handshakeRetry. While the first handshake with an engine is under way,
// its messages wait for it. A message of an engine it has no handshake
// with (a pull producer hears from its consumers first) starts one and
// waits for it: an agent is never taken at its word, only as the engine's
// daemon lists it; what no handshake confirms is refused.
//
// What an agent is called is authenticated by the transport (the shared
// secret or mutual TLS of kvxferd's data plane and NIXL's metadata,
// exchanged only with authenticated peers): the binding keeps one engine
// from speaking for another over a peer connection.

const (
	// maxParked bounds the messages of one engine waiting for a
	// handshake to say who sent them (a consumer's first burst of
	// registrations waits for the producer's first handshake with it).
	maxParked = 4096
)

type parkedMsg struct {
	from  PeerName
	m     *msg
	tries int // handshakes it waited for
}

// maxParkTries is how many handshakes a message may wait for before it is
// refused (its engine never answers to say who speaks for the rank).
const maxParkTries = 3

// admit reports whether pm.m, received from agent pm.from (and parked
// pm.tries times already), may be handled now. A message it does not admit
// is dropped (counted) or parked until a handshake with its engine says
// who speaks for its rank.
func (st *loopState) admit(pm parkedMsg) bool {
	from, m := pm.from, pm.m
	e := st.engines[m.Engine]
	if e != nil && (e.refreshing || e.state == hsPending && e.peers == nil) {
		return st.parkMsg(e, pm) // a handshake on its way decides
	}
	if e != nil && e.peers != nil {
		if want, ok := e.peers[rankRef{pp: m.PPRank, tp: m.TPRank}]; ok && want == from {
			return true
		}
		const why = "its engine's handshake names another agent for that rank"
		if st.senderMoved(e, pm) {
			return st.parkMsg(e, pm)
		}
		if pm.tries > 0 && st.now.Sub(e.loadedAt) < handshakeRetry {
			// It waited for this very answer, which does not list it.
			st.refuseSender(from, m, why)
			return false
		}
		return st.verifyAgain(e, pm, e.loadedAt.Add(handshakeRetry), why)
	}
	// An engine this rank has no handshake with: what its daemon answers,
	// not the first agent to speak for a rank, says who speaks for it.
	if e == nil {
		if len(st.engines) >= maxEngines {
			// One more engine would be a handshake, parked messages and an
			// entry kept until EngineTTL, on the word of a peer that names
			// what engine it likes. Before, messages naming ever new
			// engines grew the engines a rank knows without bound (a
			// consumer request naming one more fails: overLimit).
			st.metrics.Dropped("engine_limit")
			st.log.Debug("kvxfer: dropped a peer message from an engine past the rank's limit on peer engines", "kind", m.Kind,
				"engine", m.Engine, "agent", from, "limit", maxEngines)
			return false
		}
		e = st.ensureEngine(m.Engine, m.Addr)
	} else if e.state != hsPending && st.senderMoved(e, pm) {
		return st.parkMsg(e, pm)
	}
	return st.verifyAgain(e, pm, time.Time{}, "no handshake with its engine names that agent for that rank")
}

// senderMoved: a message from an agent no handshake with its engine
// lists, sent from another address than the engine's, says the engine is
// there now (restarted elsewhere under its id): it is handshaken there at
// once, the message parked for the answer (which must list the agent, as
// ever). Before, the engine was asked again at its old address, which
// could not vouch for the new agent: a consumer back at another address
// was refused by its producer until the old handshake failed for good.
// Each rank of an in-process engine speaks from its own port: a rank
// whose agent is listed moves nothing, and an engine a request's params
// named (engineAt: the producer of our consumer requests) is moved by
// requests alone. Before that rule, a producer rank restarted on its own
// port moved the engine from the address the params name to that rank's,
// and the next requests moved it back: two handshakes, and a false alarm
// of two engines sharing an id.
func (st *loopState) senderMoved(e *engine, pm parkedMsg) bool {
	if e.named || pm.m.Addr == "" || e.addr == "" || pm.m.Addr == e.addr || pm.tries >= maxParkTries {
		return false
	}
	st.moveEngine(e, pm.m.Addr, "a peer message comes from an agent its engine's handshake does not list, at another address", false)
	e.refreshing = true
	return true
}

// verifyAgain parks p until a handshake with e says who speaks for its
// rank: the one under way, or a new one, started at once or, within
// handshakeRetry of the last one loaded (from notBefore) or failed, once
// that passed (a peer that restarts just after we handshook with it is
// asked again a moment later; its messages wait). Past maxParkTries p is
// refused.
func (st *loopState) verifyAgain(e *engine, p parkedMsg, notBefore time.Time, why string) bool {
	if p.tries >= maxParkTries {
		st.refuseSender(p.from, p.m, why)
		return false
	}
	if e.state != hsPending {
		if e.state == hsFailed {
			notBefore = later(notBefore, e.failedAt.Add(handshakeRetry))
		}
		if st.now.Before(notBefore) {
			if !e.refreshing {
				st.arm(notBefore, tRehandshake, e.id)
			}
			e.refreshing = true
			return st.parkMsg(e, p)
		}
		st.startHandshake(e)
	}
	e.refreshing = true
	return st.parkMsg(e, p)
}

func later(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

// rehandshake starts the handshake a parked message waits for.
func (st *loopState) rehandshake(t timerEntry) {
	if e := st.engines[t.id]; e != nil && e.refreshing && e.state != hsPending {
		st.startHandshake(e)
	}
}

func (st *loopState) refuseSender(from PeerName, m *msg, why string) {
	st.metrics.Dropped("sender_mismatch")
	st.log.Warn("kvxfer: dropped a peer message from an agent that does not speak for its sender", "kind", m.Kind,
		"engine", m.Engine, "tp_rank", m.TPRank, "pp_rank", m.PPRank, "agent", from, "why", why)
}

func (st *loopState) parkMsg(e *engine, p parkedMsg) bool {
	if len(e.parked) >= maxParked {
		st.metrics.Dropped("sender_parked_full")
		return false
	}
	p.tries++
	e.parked = append(e.parked, p)
	return false
}

// unpark re-admits the messages parked for an engine once its new
// handshake is in (or failed).
func (st *loopState) unpark(e *engine) {
	parked := e.parked
	e.parked, e.refreshing = nil, false
	for _, p := range parked {
		if st.admit(p) {
			st.dispatch(p.m)
		}
	}
}
