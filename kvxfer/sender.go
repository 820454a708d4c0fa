package kvxfer

import "time"

// Identity binds to messages: a peer message names its sender (engine,
// TP rank, PP rank), and is accepted only from the agent that rank is
// known by. For an engine this rank handshook with, the handshake says
// which agent each of its ranks is (authoritative); a message from another
// agent makes the worker handshake again (the peer may have restarted
// with new agents) and waits for the answer, at most once per
// handshakeRetry. For an engine it never needed to handshake with (a pull
// producer hears from its consumers only), the first agent that speaks
// for a rank is pinned to it; another is refused while the pinned one is
// heard from (pinIdle).
//
// What an agent is called is authenticated by the transport (the shared
// secret or mutual TLS of kvxferd's data plane and NIXL's metadata,
// exchanged only with authenticated peers): the binding keeps one engine
// from speaking for another over a peer connection.

const (
	// pinIdle is how long a pinned agent must be silent before another
	// agent may speak for its rank (a restarted peer).
	pinIdle = 30 * time.Second
	// maxPins bounds the pins; the oldest are forgotten first.
	maxPins = 1 << 16
	// maxParked bounds the messages of one engine waiting for a new
	// handshake to say who sent them.
	maxParked = 1024
)

type senderKey struct {
	engine string
	pp, tp int
}

type pin struct {
	agent PeerName
	seen  time.Time
}

type parkedMsg struct {
	from PeerName
	m    *msg
}

// admit reports whether m, received from agent from, may be handled now.
// A message it does not admit is dropped (counted) or parked until a
// handshake with its engine says who speaks for its rank.
func (st *loopState) admit(from PeerName, m *msg) bool {
	e := st.engines[m.Engine]
	if e != nil && e.refreshing {
		return st.park(e, from, m) // a handshake on its way decides
	}
	if e != nil && e.peers != nil {
		if want, ok := e.peers[rankRef{pp: m.PPRank, tp: m.TPRank}]; ok && want == from {
			return true
		}
		return st.verifyAgain(e, from, m, time.Since(e.loadedAt) >= handshakeRetry, "its engine's handshake names another agent for that rank")
	}
	k := senderKey{engine: m.Engine, pp: m.PPRank, tp: m.TPRank}
	now := time.Now()
	p, ok := st.pins[k]
	if ok && p.agent != from && now.Sub(p.seen) < pinIdle {
		// Two agents speak for one rank: ask the engine which.
		if e == nil {
			e = st.ensureEngine(m.Engine, m.Addr)
		}
		return st.verifyAgain(e, from, m, true, "another agent speaks for that rank")
	}
	if !ok && len(st.pins) >= maxPins {
		st.forgetOldestPin()
	}
	st.pins[k] = pin{agent: from, seen: now}
	return true
}

// verifyAgain parks m until a handshake with e says who speaks for its
// rank: the one under way, or a new one when start allows it and the last
// one did not fail just now. Without one, m is refused.
func (st *loopState) verifyAgain(e *engine, from PeerName, m *msg, start bool, why string) bool {
	if e.state != hsPending && start && (e.state != hsFailed || time.Since(e.failedAt) >= handshakeRetry) {
		st.startHandshake(e)
	}
	if e.state == hsPending {
		e.refreshing = true
		return st.park(e, from, m)
	}
	st.refuseSender(from, m, why)
	return false
}

func (st *loopState) refuseSender(from PeerName, m *msg, why string) {
	st.w.metrics.Dropped("sender_mismatch")
	st.w.log.Warn("kvxfer: dropped a peer message from an agent that does not speak for its sender", "kind", m.Kind,
		"engine", m.Engine, "tp_rank", m.TPRank, "pp_rank", m.PPRank, "agent", from, "why", why)
}

func (st *loopState) park(e *engine, from PeerName, m *msg) bool {
	if len(e.parked) >= maxParked {
		st.w.metrics.Dropped("sender_parked_full")
		return false
	}
	e.parked = append(e.parked, parkedMsg{from: from, m: m})
	return false
}

// unpark re-admits the messages parked for an engine once its new
// handshake is in (or failed).
func (st *loopState) unpark(e *engine) {
	parked := e.parked
	e.parked, e.refreshing = nil, false
	for _, p := range parked {
		if st.admit(p.from, p.m) {
			st.dispatch(p.m)
		}
	}
}

func (st *loopState) forgetOldestPin() {
	var oldest senderKey
	var at time.Time
	for k, p := range st.pins {
		if at.IsZero() || p.seen.Before(at) {
			oldest, at = k, p.seen
		}
	}
	delete(st.pins, oldest)
}

// sweepPins forgets pins silent for longer than ttl.
func (st *loopState) sweepPins(now time.Time, ttl time.Duration) {
	for k, p := range st.pins {
		if now.Sub(p.seen) > ttl {
			delete(st.pins, k)
		}
	}
}
