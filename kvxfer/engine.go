package kvxfer

import (
	"crypto/sha256"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// engineCache is the peer engines a rank knows: their handshakes (layouts,
// agents, generation), liveness, and messages waiting for a handshake.
type engineCache struct {
	engines   map[string]*engine
	nextEvict time.Time // when the next idle engine passes EngineTTL
	// outboxed: the messages in every engine's outbox (maxOutbox).
	outboxed int
}

// maxOutbox bounds the messages a rank keeps for peer engines whose
// handshake is pending (engine.outbox), all engines together. A peer
// cannot fill it (its messages wait, parked and bounded, for the same
// handshake, and the answers to those go straight to its agents), but
// our engine can: each request it hands over aborted before it was
// scheduled, or refused, is a release or a cancel to each of its
// producer's ranks, and holds nothing else here. Before, an engine that
// handed over such requests without end while a producer's handshake was
// pending (up to HandshakeTimeout, again at the next) grew the outbox
// without bound. Past it a message is dropped (outbox_full): its producer
// request ends at its lease, as when the message is lost.
const maxOutbox = 1 << 16

// handshakeRetry is how long a failed handshake is remembered before a
// notice or a parked message starts another (a request that comes in
// meanwhile still gets an attempt of its own: ownAttempt).
const handshakeRetry = time.Second

// handshakeFresh reports whether e's loaded handshake can be taken as the
// engine's current word: loaded within handshakeRetry, and e not found
// unreachable since (doubt). A request that reached none of its
// producer's ranks over a fresh handshake fails; over one that is not, it
// handshakes again first (retryAfterHandshake): the producer may have
// restarted at new agents.
func (st *loopState) handshakeFresh(e *engine) bool {
	return st.now.Sub(e.loadedAt) < handshakeRetry && !e.doubtedAt.After(e.loadedAt)
}

// doubt notes that something sent to e did not get through.
func (st *loopState) doubt(e *engine) { e.doubtedAt = st.now }

type hsState uint8

const (
	hsPending hsState = iota + 1
	hsReady
	hsFailed
)

// engine is the handshake cache entry of one peer engine.
type engine struct {
	id, addr string
	// addrMoves counts the times a request named the engine at another
	// address than addr (engineAt): a question out to an earlier address
	// is answered for a place the engine has left.
	addrMoves uint64
	// movedFrom and movedAt: the address of the last move, and when
	// (moveEngine tells a flip-flop from a move).
	movedFrom string
	movedAt   time.Time
	// named: a request's params named the engine's address (engineAt):
	// they alone move it then, never a peer message (senderMoved).
	named bool
	state hsState
	err   error
	gen   uint64
	// genAddr: the address gen was loaded from (a request's params
	// naming another were issued by whatever answers there).
	genAddr string
	offset  time.Duration
	// offsetAt: when offset was measured (a handshake, or a probe timed
	// within expiryMargin); offsetAsked: when a READ last had it measured
	// again (refreshOffset).
	offsetAt, offsetAsked time.Time
	tpSize                int
	ppSize                int
	peers                 map[rankRef]PeerName
	layouts               map[rankRef]*topology.Layout
	lastActive            time.Time
	failedAt              time.Time
	answered              bool // the last handshake answered, and its answer ruled a transfer out
	// hsStarted is when the last handshake began. A request fails on a
	// failed handshake only if that handshake began once it was waiting:
	// one that came in later (it joined a dial begun, say, during a
	// partition that has healed since) gets an attempt of its own first;
	// retryWanted says one did.
	hsStarted   time.Time
	retryWanted bool
	// recheck: a registry said the engine has a new generation while a
	// question to it was out (liveness.go, recheckLater).
	recheck bool
	// stale: a registry said the engine has a new generation and its
	// daemon is being asked: new requests wait for the answer.
	stale bool
	// outbox holds messages to send once the handshake is ready: ours
	// alone (sendTo), bounded for all engines by maxOutbox.
	outbox []outMsg
	// loadedAt is when a handshake was last loaded; refreshing says a new
	// one was started because a message came from an agent the loaded one
	// does not list, and parked holds such messages until it answers.
	loadedAt   time.Time
	refreshing bool
	parked     []parkedMsg
	// doubtedAt is when a transfer, a registration or a probe to the
	// engine last failed to get through: a handshake loaded before it
	// may name agents that are gone, however recent (handshakeFresh).
	doubtedAt time.Time
	// Liveness (liveness.go): watched while requests wait on it; when it
	// last answered or spoke; the next probe; a probe out.
	watching, probing  bool
	lastAlive, probeAt time.Time
	// rankSpoke: when each rank the handshake lists last spoke (a
	// message from it). A probe answers for the whole engine
	// (lastAlive); a message only for its rank: an in-process engine's
	// ranks are processes of their own, and one may die while another
	// speaks on.
	rankSpoke map[rankRef]time.Time
	// agentSums: a digest of the agent metadata each rank's loaded agent
	// (peers) came from, so that a probe's partial answer (some ranks
	// answered) counts, as the rank speaking, only for a rank that answers
	// with the agent loaded (answeredRanks).
	agentSums map[rankRef][sha256.Size]byte
	// prepped caches the prepared list pairs by plan.
	prepped map[hotpath.PlanKey]preppedPair
	// refused says, by role (asProducer, asConsumer), why KV cannot move
	// between this rank and the engine's (checkPlans, at each handshake);
	// refusalSeen whether that was logged and counted yet.
	refused     [numRoles]error
	refusalSeen [numRoles]bool
}

type preppedPair struct{ local, remote PrepID }

// prepared returns (preparing once) the local and remote prepared lists
// of plan p between this rank and peer rank `to`.
func (st *loopState) prepared(e *engine, key hotpath.PlanKey, p *topology.Plan, to rankRef) (preppedPair, error) {
	if pr, ok := e.prepped[key]; ok {
		return pr, nil
	}
	localSide, remoteSide := hotpath.SrcSide, hotpath.DstSide
	if st.cfg.Mode == ModePull {
		localSide, remoteSide = hotpath.DstSide, hotpath.SrcSide
	}
	le, err := hotpath.AppendPrepared(nil, p, localSide)
	if err != nil {
		return preppedPair{}, err
	}
	re, err := hotpath.AppendPrepared(nil, p, remoteSide)
	if err != nil {
		return preppedPair{}, err
	}
	l, r := st.prepareOp("", le), st.prepareOp(e.peers[to], re)
	if e.prepped == nil {
		e.prepped = map[hotpath.PlanKey]preppedPair{}
	}
	pr := preppedPair{l, r}
	e.prepped[key] = pr
	return pr, nil
}

type outMsg struct {
	to rankRef
	m  *msg
}

// ensureEngine returns the engine entry, starting a handshake when there
// is none (or the last one failed).
func (st *loopState) ensureEngine(id, addr string) *engine {
	e := st.engines[id]
	if e != nil && (e.state != hsFailed || st.now.Sub(e.failedAt) < handshakeRetry) {
		// A failed handshake is retried here only after handshakeRetry;
		// a request decides for itself (ownAttempt).
		if e.addr == "" {
			e.addr = addr
		}
		return e
	}
	if e == nil {
		e = &engine{id: id}
		st.engines[id] = e
	}
	if e.addr != "" && addr != "" && addr != e.addr {
		e.addrMoves++ // (a probe still out asked the old address: engineAt)
	}
	e.addr = addr
	st.startHandshake(e)
	return e
}

// engineAt is ensureEngine for a request's params, which name the
// producer engine at the address its engine hands out now. A known engine
// named at another address by a request that came in after the engine's
// last handshake began has moved there (restarted on another host or
// port under the same id): it is handshaken there at once, whatever the
// state of the handshake at the old one, whose answers no longer count.
// Before, the engine was known by its id alone and its old address kept
// until a handshake there failed: the first requests after the move went
// to the gone daemon and failed.
//
// elsewhere: the request names the engine at another address than the
// one it was last handshaken at, and came in before that handshake
// began: the engine moved on since (two live engines share the id, named
// by turns). The request fails (peer_gone, both addresses named), never
// sent to the engine at the other address, whose blocks are not its
// request's, and never moves the engine back: requests in flight at once
// that name both would have it handshaken back and forth for ever. An engine a request named is
// moved by requests alone, never by a peer message (senderMoved): each
// rank of an in-process engine speaks from its own port, while the
// params name the engine by its first rank's.
func (st *loopState) engineAt(id, addr string, since time.Time) (e *engine, elsewhere bool) {
	e = st.engines[id]
	if e == nil || addr == "" || e.addr == "" || addr == e.addr {
		e = st.ensureEngine(id, addr)
		e.named = e.named || addr != ""
		return e, false
	}
	e.named = true
	if !since.After(e.hsStarted) {
		return e, true
	}
	st.moveEngine(e, addr, "a request names the producer engine at another address than its handshake's", true)
	return e, false
}

// sharedIDWindow: an engine moved back to the address it left less than
// this ago is two engines that share an id (moveEngine).
const sharedIDWindow = time.Minute

// moveEngine has e handshaken at addr, the address it is now named at,
// at once: what is out to its old one answers for a place it left.
// byParams: requests' params moved it, which name an engine by one
// address (a move back is two engines under one id); a peer's messages
// come from each of its ranks' own ports (in-process).
func (st *loopState) moveEngine(e *engine, addr, why string, byParams bool) {
	if byParams && addr == e.movedFrom && st.now.Sub(e.movedAt) < sharedIDWindow {
		// Back where it just left: two live engines share the id.
		// Counted as the misconfiguration it is, each time.
		st.metrics.BadInput("engine_id_shared")
		st.log.Error("kvxfer: two peer engines share an engine id, at two addresses: their transfers fail by turns; give each engine an id of its own",
			"engine", e.id, "addr", addr, "other_addr", e.addr)
	} else {
		st.log.Warn("kvxfer: "+why+": handshaking there (it moved, or two engines share its id)", "engine", e.id, "addr", addr, "was", e.addr)
	}
	e.movedFrom, e.movedAt = e.addr, st.now
	e.addr = addr
	e.addrMoves++
	e.probing = false // a probe out is of the old address: dropped as it answers
	st.startHandshake(e)
}

// elsewhereReason is why a request that names its producer engine at
// another address than the engine's latest handshake fails (engineAt).
func elsewhereReason(e *engine, addr string) string {
	return fmt.Sprintf("the params name producer engine %s at %s, but it was handshaken at %s since this request came in (two engines share the id, or it moved back): not sent to it there",
		e.id, addr, e.addr)
}

// startHandshake (re)starts the handshake with an engine.
func (st *loopState) startHandshake(e *engine) {
	e.state, e.err = hsPending, nil
	e.lastActive, e.hsStarted, e.retryWanted = st.now, st.now, false
	st.askResolver(e, st.cfg.HandshakeTimeout, false)
}

// askResolver asks the resolver for e's ranks off the loop, within
// timeout; the answer comes back as an evHandshake event (a liveness
// probe's when probe).
func (st *loopState) askResolver(e *engine, timeout time.Duration, probe bool) {
	st.fx.asks = append(st.fx.asks, hsAsk{engine: e.id, addr: e.addr, timeout: timeout, probe: probe, gen: e.gen, moves: e.addrMoves})
}

// handshakeDone loads a finished handshake and re-drives whatever waited.
func (st *loopState) handshakeDone(h *hsResult) {
	if h.probe {
		st.probeDone(h)
		return
	}
	e := st.engines[h.engine]
	if e == nil || e.state != hsPending || h.moves != e.addrMoves {
		// (An answer from an address the engine moved from: the
		// handshake begun at its new one answers for it.)
		return
	}
	err := h.err
	if err == nil {
		st.failChanged(e, h)
		err = st.load(e, h)
	}
	st.metrics.Handshake(h.took, err == nil)
	// answered: the peer answered, and its answer rules a transfer out.
	e.answered = h.err == nil && err != nil
	if h.err != nil && h.names != nil {
		st.loadAnswered(e, h)
	}
	if err != nil {
		e.state, e.err, e.failedAt = hsFailed, err, st.now
		st.log.Warn("kvxfer: handshake failed", "failure_type", "handshake_setup_failed", "engine", e.id, "err", err)
	} else {
		e.state = hsReady
		st.checkPlans(e)
		st.beatFresh = st.beatFresh || len(st.fresh) > 0
	}
	e.loadedAt, e.stale = st.now, false // a handshake is the engine's word
	if err == nil {
		e.alive(st.now)
	}
	out := e.outbox
	e.outbox = nil
	st.outboxed -= len(out)
	for _, o := range out {
		if o.m.Kind == msgAck || o.m.Kind == msgDone {
			// A cancel confirmed only now: its tombstone, which drops a
			// registration of that request arriving late, lives a full
			// RegistrationTTL from the confirmation, not from the cancel.
			k := regKey{engine: e.id, dreq: o.m.DReq}
			if tb, ok := st.tombs[k]; ok {
				tb.at = st.now
				st.tombs[k] = tb
			} else if o.m.Kind == msgAck {
				st.tombs[k] = tomb{at: st.now, tid: o.m.TransferID, preq: o.m.PReq}
			}
		}
		st.sendTo(e, o.to, o.m)
	}
	// Messages that waited for this handshake first (a producer's failure
	// notice spares the registration it would answer), then what waited
	// to register or read.
	st.unpark(e)
	defer st.recheckLater(e)
	st.redriving = true
	st.redrive(e)
	st.redriving = false
	if e.state == hsFailed && e.retryWanted {
		st.startHandshake(e) // for what came in after the failed one began
	}
}

// ownAttempt reports whether something that has waited on e since `since`
// had a handshake attempt of its own, that is one begun once it waited:
// only then does a failed handshake fail it. An answer that ruled a
// transfer out is final whenever it began. Otherwise it asks for a new
// attempt: at once, or (while a failed handshake re-drives what waited on
// it) once that pass is over, so what had its attempt fails first.
func (st *loopState) ownAttempt(e *engine, since time.Time) bool {
	if e.answered || !since.After(e.hsStarted) {
		return true
	}
	e.retryWanted = true
	if !st.redriving {
		st.startHandshake(e)
	}
	return false
}

// load checks a handshake's ranks and takes their agents (loaded by the
// driver).
func (st *loopState) load(e *engine, h *hsResult) error {
	res := &h.res
	if len(res.Ranks) == 0 {
		return fmt.Errorf("kvxfer: handshake with %s: no ranks", e.id)
	}
	peers := map[rankRef]PeerName{}
	sums := map[rankRef][sha256.Size]byte{}
	layouts := map[rankRef]*topology.Layout{}
	tp, pp := res.Ranks[0].Layout.TPSize, res.Ranks[0].Layout.PPSize
	for i := range res.Ranks {
		r := &res.Ranks[i]
		if !st.cfg.SkipCompatCheck && r.CompatHash != st.cfg.CompatHash {
			st.loadForNotices(e, h)
			return fmt.Errorf("kvxfer: handshake with %s: compatibility hash %q, want %q (%s)", e.id, r.CompatHash, st.cfg.CompatHash,
				compatHint(st.layout, &r.Layout))
		}
		l := r.Layout
		if err := l.Validate(); err != nil {
			return fmt.Errorf("kvxfer: handshake with %s rank tp %d pp %d: %w", e.id, l.TPRank, l.PPRank, err)
		}
		if l.TPSize != tp || l.PPSize != pp {
			return fmt.Errorf("kvxfer: handshake with %s: rank sizes tp %d pp %d differ from tp %d pp %d", e.id, l.TPSize, l.PPSize, tp, pp)
		}
		ref := rankRef{pp: l.PPRank, tp: l.TPRank}
		if _, dup := layouts[ref]; dup {
			return fmt.Errorf("kvxfer: handshake with %s: rank tp %d pp %d listed twice", e.id, l.TPRank, l.PPRank)
		}
		name, err := h.agent(i)
		if err != nil {
			return fmt.Errorf("kvxfer: handshake with %s rank tp %d pp %d: %w", e.id, l.TPRank, l.PPRank, err)
		}
		peers[ref] = name
		sums[ref] = sha256.Sum256(r.Agent)
		layouts[ref] = &l
		if err := st.registry.StoreLayout(hotpath.RankKey{Peer: e.id, Generation: res.Generation, TPRank: l.TPRank, PPRank: l.PPRank}, &l); err != nil {
			return err
		}
	}
	if e.gen != 0 && e.gen != res.Generation {
		st.registry.DropGeneration(e.id, e.gen)
		for _, pr := range e.prepped {
			st.fx.unprepare = append(st.fx.unprepare, pr.local, pr.remote)
		}
		e.prepped = nil
	}
	e.gen, e.offset, e.tpSize, e.ppSize = res.Generation, res.ClockOffset, tp, pp
	e.genAddr = e.addr
	e.offsetAt = st.now
	e.peers, e.layouts, e.agentSums = peers, layouts, sums
	return nil
}

// compatHint says which of the model's fields a peer's layout and ours
// disagree on, for a refusal by compatibility hash, which names nothing
// itself.
func compatHint(ours, theirs *topology.Layout) string {
	if ours == nil {
		return "the engines run other models, dtypes or builds"
	}
	var d []string
	for _, f := range []struct {
		name         string
		ours, theirs int
	}{
		{"total_kv_heads", ours.TotalKVHeads, theirs.TotalKVHeads}, {"head_size", ours.HeadSize, theirs.HeadSize},
		{"elem_bytes", ours.ElemBytes, theirs.ElemBytes}, {"cache groups", len(ours.Groups), len(theirs.Groups)},
	} {
		if f.ours != f.theirs {
			d = append(d, fmt.Sprintf("%s %d, ours %d", f.name, f.theirs, f.ours))
		}
	}
	if len(d) == 0 {
		return "the layouts agree on heads, head size, element size and cache groups: the engines differ in what else the hash covers (the model, its dtype, the engine's build; a vLLM engine's prefill backoff, the trailing prompt tokens a producer leaves to its consumer: its MTP speculative tokens)"
	}
	return "the peer's layout: " + strings.Join(d, "; ")
}

// sendTo sends a message to one rank of a peer engine: at once when its
// agent is loaded (also after a refused handshake, so failure notices
// still reach it), queued while the handshake is pending, dropped and
// counted when the engine cannot be reached.
func (st *loopState) sendTo(e *engine, to rankRef, m *msg) {
	if p, ok := e.peers[to]; ok {
		st.notify(p, m)
		return
	}
	if e.state == hsPending {
		if st.outboxed >= maxOutbox {
			st.metrics.Dropped("outbox_full")
			st.log.Debug("kvxfer: dropped a message to a peer engine whose handshake is pending: too many wait", "kind", m.Kind,
				"engine", e.id, "d_req", m.DReq, "p_req", m.PReq, "limit", maxOutbox)
			return
		}
		e.outbox = append(e.outbox, outMsg{to: to, m: m})
		st.outboxed++
		return
	}
	st.metrics.Dropped("notice_unreachable")
}

// loadForNotices loads a refused peer's agents only so failure notices
// reach it; no plan is ever built against it.
func (st *loopState) loadForNotices(e *engine, h *hsResult) {
	res := &h.res
	e.peers, e.agentSums = map[rankRef]PeerName{}, map[rankRef][sha256.Size]byte{}
	for i := range res.Ranks {
		l := &res.Ranks[i].Layout
		if name, err := h.agent(i); err == nil {
			ref := rankRef{pp: l.PPRank, tp: l.TPRank}
			e.peers[ref], e.agentSums[ref] = name, sha256.Sum256(res.Ranks[i].Agent)
		}
	}
	e.tpSize, e.ppSize = max(res.Ranks[0].Layout.TPSize, 1), max(res.Ranks[0].Layout.PPSize, 1)
}

// loadAnswered takes, from a handshake that failed because some of the
// engine's ranks did not answer (PartialHandshakeError), the agents of the
// ranks that did: they admit those ranks' messages and receive our
// notices (loadForNotices' way). The handshake stays failed: no transfer
// is planned on it, and what waited on it fails as before. A rank that
// answers with another agent than the one loaded for it restarted (or
// was attached again): its old agent is gone with what it moved, so, as a
// handshake that loads in full does for a rank whose agent changed
// (failChanged), the requests waiting on that rank fail (their producer
// rank fenced: nothing more of its old agent lands) and the new agent
// takes its place. Before, the agent loaded first was kept: the new one's
// messages were refused as from an agent that does not speak for its
// rank, and our notices went to the dead one, until a handshake answered
// in full.
func (st *loopState) loadAnswered(e *engine, h *hsResult) {
	res := &h.res
	if len(res.Ranks) == 0 {
		return
	}
	if e.peers == nil {
		e.peers = map[rankRef]PeerName{}
	}
	if e.agentSums == nil {
		e.agentSums = map[rankRef][sha256.Size]byte{}
	}
	var replaced map[rankRef]bool
	for i := range res.Ranks {
		l := &res.Ranks[i].Layout
		ref := rankRef{pp: l.PPRank, tp: l.TPRank}
		name, err := h.agent(i)
		if err != nil {
			continue
		}
		if old, ok := e.peers[ref]; ok && old != name {
			if replaced == nil {
				replaced = map[rankRef]bool{}
			}
			replaced[ref] = true
		}
		e.peers[ref], e.agentSums[ref] = name, sha256.Sum256(res.Ranks[i].Agent)
	}
	if e.tpSize == 0 {
		e.tpSize, e.ppSize = max(res.Ranks[0].Layout.TPSize, 1), max(res.Ranks[0].Layout.PPSize, 1)
	}
	if len(replaced) == 0 {
		return
	}
	// Lists prepared against the old agents go (as at a new generation).
	for _, pr := range e.prepped {
		st.fx.unprepare = append(st.fx.unprepare, pr.local, pr.remote)
	}
	e.prepped = nil
	var names []string
	for _, ref := range sortedRefs(replaced) {
		names = append(names, fmt.Sprintf("tp %d pp %d", ref.tp, ref.pp))
	}
	reason := fmt.Sprintf("producer engine %s (%s) restarted or re-attached rank %s (another agent speaks for it): the transfer cannot complete",
		e.id, e.addr, strings.Join(names, ", rank "))
	n := st.failOnRanks(e, reason, replaced, replaced)
	st.log.Warn("kvxfer: peer engine's ranks changed agent (a partial handshake)", "engine", e.id, "addr", e.addr,
		"ranks", names, "failed_requests", n)
}

// redrive re-runs whatever waited for an engine's handshake.
func (st *loopState) redrive(e *engine) {
	for _, id := range sortedKeys(st.recvs) {
		r := st.recvs[id]
		if r.req.Remote.EngineID == e.id && !r.sent && !r.decided {
			st.startRecv(r)
		}
	}
	for _, id := range st.sendIDs() {
		s := st.sends.get(id)
		if s.match != nil && s.match.key.engine == e.id {
			st.pushReady(s)
		}
	}
	// Registrations we could not answer: tell the D ranks we fail.
}

// plan returns the plan from source rank src to destination rank dst,
// where the remote side is engine e.
func planKey(e *engine, src rankRef, dstTP int) hotpath.PlanKey {
	return hotpath.PlanKey{Peer: e.id, Generation: e.gen, SrcTPRank: src.tp, SrcPPRank: src.pp, DstTPRank: dstTP}
}

func (st *loopState) plan(e *engine, src rankRef, dstTP int) (*topology.Plan, error) {
	key := planKey(e, src, dstTP)
	return st.registry.Plan(key, func() (*topology.Plan, error) {
		if st.cfg.Mode == ModePush {
			dl := e.layouts[rankRef{tp: dstTP}]
			if dl == nil {
				return nil, fmt.Errorf("kvxfer: engine %s has no rank tp %d pp 0", e.id, dstTP)
			}
			return topology.NewPlan(st.layout, dl, st.planOptions())
		}
		sl := e.layouts[src]
		if sl == nil {
			return nil, fmt.Errorf("kvxfer: engine %s has no rank tp %d pp %d", e.id, src.tp, src.pp)
		}
		return topology.NewPlan(sl, st.layout, st.planOptions())
	})
}

func (st *loopState) dropEngine(e *engine) {
	for _, pr := range e.prepped {
		st.fx.unprepare = append(st.fx.unprepare, pr.local, pr.remote)
	}
	e.prepped = nil
	for _, ref := range sortedRefs(e.peers) {
		st.fx.invalidate = append(st.fx.invalidate, e.peers[ref])
	}
	st.registry.DropPeer(e.id)
	st.outboxed -= len(e.outbox)
	delete(st.engines, e.id)
}

// evictEngines drops engines idle past EngineTTL that nothing uses, and
// notes when the next one falls due.
func (st *loopState) evictEngines(now time.Time) {
	st.nextEvict = time.Time{}
	if st.cfg.EngineTTL < 0 {
		return
	}
	for _, id := range sortedKeys(st.engines) {
		e := st.engines[id]
		if e.state == hsPending || st.engineInUse(id) {
			continue
		}
		due := e.lastActive.Add(st.cfg.EngineTTL)
		if now.Before(due) {
			if st.nextEvict.IsZero() || due.Before(st.nextEvict) {
				st.nextEvict = due
			}
			continue
		}
		st.dropEngine(e)
	}
}

func (st *loopState) engineInUse(id string) bool {
	for _, w := range st.waits {
		if w.req.Remote.EngineID == id {
			return true
		}
	}
	for _, r := range st.recvs {
		if r.req.Remote.EngineID == id {
			return true
		}
	}
	for s := range st.sends.all() {
		if s.match != nil && s.match.key.engine == id {
			return true
		}
	}
	return false
}

// sendIDs returns the ids of the producer requests held, sorted.
func (st *loopState) sendIDs() []string {
	ids := make([]string, 0, st.sends.len())
	for s := range st.sends.all() {
		ids = append(ids, s.req.ReqID)
	}
	slices.Sort(ids)
	return ids
}

func sortedKeys[V any](m map[string]V) []string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	slices.Sort(keys)
	return keys
}

// prepFailed: the backend could not prepare list id (a post through it
// fails too, and says why); the pair holding it is forgotten, so the next
// transfer between those ranks prepares its lists again.
func (st *loopState) prepFailed(id PrepID) {
	for _, e := range st.engines {
		for k, pr := range e.prepped {
			if pr.local == id || pr.remote == id {
				delete(e.prepped, k)
				st.fx.unprepare = append(st.fx.unprepare, pr.local, pr.remote)
			}
		}
	}
}

// checkOutboxed panics when outboxed is not the messages in the engines'
// outboxes (an -tags invariants self-check).
func (st *loopState) checkOutboxed() {
	n := 0
	for _, e := range st.engines {
		n += len(e.outbox)
	}
	if n != st.outboxed {
		panic(fmt.Sprintf("kvxfer: outboxed = %d, the engines' outboxes hold %d", st.outboxed, n))
	}
}
