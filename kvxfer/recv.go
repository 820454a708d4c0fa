package kvxfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// consumerState is the consumer side: D's requests from their RecvReq
// until their one outcome, which waits for every producer rank that may
// still WRITE into their blocks to be fenced.
type consumerState struct {
	recvs map[string]*recvReq
	// waits: pull consumer requests waiting in the engine's queue,
	// heartbeaten until allocated (await.go); fresh: those of them not
	// heartbeaten yet, beaten at the end of the input that added them or
	// that readied their producer's engine (beatFresh set).
	waits map[string]*waitReq
	// endedWaits are waits an AwaitEnd of the step being applied ended,
	// told of their end at its end (loopState.step).
	endedWaits []*waitReq
	fresh      []string
	beatFresh  bool
	// ended: push consumer requests that registered with their producer
	// and ended, by id, for RegistrationTTL (reusedTransfer), at most
	// maxEnded.
	ended recent[endedRecv]
}

// endedRecv is what a push consumer rank remembers of a request of its
// that registered with its producer and ended: the transfer it named
// (the producer engine, transfer id and producer request).
type endedRecv struct {
	engine, tid, preq string
}

// maxEnded bounds the ended push consumer requests a rank remembers
// (reusedTransfer); past it the oldest is forgotten first.
const maxEnded = 1 << 16

// Consumer side: registrations (push), READs (pull), completion counting,
// deadlines, cancels and fencing.

// expiryMargin is how long before the producer's expiry (on our clock,
// by the handshake's offset) a pull consumer's READ must have ended to
// count: the offset's error (half a round trip when measured, and the
// clocks' drift since) with room to spare. A read is not started that
// close to it, and one in flight then is given up (expired). The
// producer's hold only ends at its expiry or later (heartbeats extend
// it), so a READ that ended before it read the request's own blocks. (The
// reference's 5 s margin at the start of a read is none at its end: a
// read that started in time and ended past the expiry counted.)
const expiryMargin = 250 * time.Millisecond

func (st *loopState) newRecv(in *RecvReq, deadline time.Time) {
	if st.recvs[in.ReqID] != nil && !(in.Aborted && len(in.Local) == 0) {
		// (One aborted before it was scheduled holds nothing: it is a new
		// request under the id of one still receiving, which its engine
		// ended and which waits for its producer. Its own producer is
		// released below, or it would hold its blocks for its lease.)
		st.metrics.BadInput("recv_req.duplicate")
		st.log.Warn("kvxfer: RecvReq for a request already receiving", "req", in.ReqID)
		return
	}
	if len(in.Local) > 0 && st.reusedTransfer(in) {
		return
	}
	if len(in.Local) == 0 {
		w := st.popWait(in)
		if w != nil && !w.sameRequest(in) {
			st.releaseWait(w, FailureCancelled, "the consumer request ended while it waited in its engine's queue (another came under its id)")
			w = nil
		}
		st.releaseProducer(in, w)
		res, why := ResultDone, ""
		if in.Aborted {
			res, why = ResultAborted, "aborted before it was scheduled"
		}
		if w != nil {
			// Agents its wait's heartbeats reached that the release did
			// not (the engine is elsewhere now).
			st.releaseWait(w, FailurePeerGone, "the consumer request ended without reading from this agent")
		}
		st.report(RoleConsumer, Outcome{ReqID: in.ReqID, Result: res, Reason: why})
		return
	}
	r := &recvReq{req: *in, deadline: deadline, own: deadline, since: st.now}
	if e := st.engines[in.Remote.EngineID]; e != nil && e.gen != 0 && (in.Remote.Addr == "" || in.Remote.Addr == e.genAddr) {
		r.knewGen = e.gen
	}
	r.got, r.fenced = r.gotBuf[:0], r.fencedBuf[:0]
	r.asked = r.askedBuf[:0]
	st.takeWait(r)
	st.recvs[in.ReqID] = r
	if !deadline.IsZero() {
		st.arm(deadline, tRecvDeadline, in.ReqID)
	}
	st.startRecv(r)
}

// addHandle notes a READ in flight from producer rank to.
func (r *recvReq) addHandle(id XferID, to rankRef) {
	if r.handles == nil {
		r.handles = map[XferID]rankRef{}
	}
	r.handles[id] = to
}

// releaseProducer tells P at once that D needs nothing for a request (a
// full prefix hit or an abort before schedule), so P frees its blocks
// instead of waiting for its lease (SPEC §14).
func (st *loopState) releaseProducer(in *RecvReq, w *waitReq) {
	kind := msgDone // pull: P counts one report per D rank
	if st.cfg.Mode == ModePush {
		kind = msgReg // push: an empty registration releases this rank
	}
	e, ranks := st.paramsRanks(in)
	for _, to := range ranks {
		st.sendTo(e, to, &msg{Kind: kind, TransferID: in.TransferID, DReq: in.ReqID, PReq: in.Remote.ReqID})
		if p, ok := e.peers[to]; ok && w != nil {
			w.asked = tellAgent(w.asked, p)
		}
	}
}

// paramsRanks finds the producer engine of a consumer request that never
// became one this rank sends (released, refused) and the ranks of it this
// rank tells: by its handshake once loaded, else by the sizes its params
// give. None where its engine is elsewhere now (not after a handshake
// begun this very pass: it is that engine's), nor where the sizes map
// onto each other nowhere (logged: what the message says could not be
// read there).
func (st *loopState) paramsRanks(in *RecvReq) (*engine, []rankRef) {
	e, elsewhere := st.engineAt(in.Remote.EngineID, in.Remote.Addr, st.now)
	if elsewhere {
		return e, nil
	}
	tp, pp := max(in.Remote.TPSize, 1), max(in.Remote.PPSize, 1)
	if e.state == hsReady {
		tp, pp = e.tpSize, e.ppSize
	}
	targets, err := st.targets(tp, pp)
	if err != nil {
		st.log.Warn("kvxfer: cannot tell the producer of a request that never went to it", "req", in.ReqID, "err", err)
	}
	return e, targets
}

// targets lists the producer ranks this rank exchanges with.
func (st *loopState) targets(ptp, ppp int) ([]rankRef, error) {
	tps, err := topology.TargetRanks(nil, st.layout.TPSize, ptp, st.layout.TPRank)
	if err != nil {
		return nil, err
	}
	var out []rankRef
	for pp := range ppp {
		for _, tp := range tps {
			out = append(out, rankRef{pp: pp, tp: tp})
		}
	}
	return out, nil
}

// startRecv registers (push) or reads (pull) once the handshake is ready.
func (st *loopState) startRecv(r *recvReq) {
	e, elsewhere := st.engineAt(r.req.Remote.EngineID, r.req.Remote.Addr, r.since)
	if elsewhere {
		r.elsewhere = true // (its end tells no rank of that engine)
		st.decide(r, ResultFailed, FailurePeerGone, elsewhereReason(e, r.req.Remote.Addr))
		st.tryReport(r)
		return
	}
	switch e.state {
	case hsPending:
		return
	case hsReady:
		if e.stale {
			return // a registry said it changed: its daemon is asked (liveness.go)
		}
		if st.cfg.Mode == ModePull && !r.req.Remote.Expiry.IsZero() && st.refreshOffset(e) {
			return // its READs wait for the producer's clock, measured again
		}
	case hsFailed:
		if !st.ownAttempt(e, r.since) {
			return
		}
		reason, kind := "handshake with producer failed: "+e.err.Error(), FailureHandshake
		if e.answered {
			kind = FailureIncompatible // it answered but was refused
		}
		if len(e.peers) > 0 {
			st.refuseProducer(e, r, kind, reason) // its agents are known: tell them
		}
		st.decide(r, ResultFailed, kind, reason)
		st.tryReport(r)
		return
	}
	if g := r.req.Remote.Generation; g != 0 && g != e.gen {
		// The params were issued by another generation of the producer
		// than the loaded handshake's: it restarted (or re-attached a
		// rank) since one of the two. Its daemon is asked again first,
		// once per request: params of a generation newer than the
		// handshake name the new agents' blocks, and are read once it is
		// loaded (before, over NIXL the first request after a producer
		// restarted went to the gone agents and failed). Params of
		// another generation than the producer's current one are never
		// read: their blocks may hold another request's KV since.
		if r.since.After(e.hsStarted) {
			st.startHandshake(e)
			return
		}
		reason := fmt.Sprintf("producer engine %s (%s) issued this request's params at generation %d and is at generation %d (it restarted or re-attached a rank since): its blocks are not this request's; not read",
			e.id, e.addr, g, e.gen)
		r.notRead = true
		st.decide(r, ResultFailed, FailurePeerGone, reason)
		st.tryReport(r)
		return
	}
	e.lastActive = st.now
	if err := st.refusal(e, asConsumer); err != nil {
		// Refused at handshake: fail at once, logged once per peer
		// generation (refusal), not per request.
		st.refuseProducer(e, r, FailureIncompatible, err.Error())
		r.quiet = true
		st.decide(r, ResultFailed, FailureIncompatible, err.Error())
		st.tryReport(r)
		return
	}
	if want := r.req.Remote.TPSize; want > 0 && want != e.tpSize {
		st.metrics.BadInput("recv_req.remote.tp_size")
		reason := fmt.Sprintf("producer %s has TP %d, the request says %d", e.id, e.tpSize, want)
		st.refuseProducer(e, r, FailureIncompatible, reason)
		st.decide(r, ResultFailed, FailureIncompatible, reason)
		st.tryReport(r)
		return
	}
	targets, err := st.targets(e.tpSize, e.ppSize)
	if err != nil {
		st.refuseProducer(e, r, FailureIncompatible, err.Error())
		st.decide(r, ResultFailed, FailureIncompatible, err.Error())
		st.tryReport(r)
		return
	}
	unnamed := r.req.Remote.ReqID == "" && r.req.TransferID == "" // no grant can tell its hold from another's
	from, changed := r.rehandshookFrom, r.rehandshook && e.gen != r.rehandshookFrom
	if !changed && r.knewGen != 0 && e.gen != r.knewGen {
		from, changed = r.knewGen, true
	}
	if changed && st.cfg.Mode == ModePull && (!st.guarded || unnamed) && r.req.Remote.Generation == 0 {
		// The producer is at another generation than the one this rank
		// knew it at when the request came in (a handshake since found
		// it restarted), or than the one the request was sent under
		// (restarted after a new handshake): its params (the blocks to
		// READ) may be the old producer's, whose engine may have reused
		// those blocks since. Without grants (or naming neither its
		// producer request nor its transfer, which grants tell holds
		// apart by) nothing refuses a READ of blocks the producer holds
		// for another request, so it is not read: before, such a request
		// was reported done with the bytes of whatever request the new
		// producer held in those blocks (over NIXL;
		// TestPullRetryAcrossRestartReadsNoOtherRequest, and for one that
		// came in while the new handshake was out or had failed,
		// TestPullArrivingDuringRehandshakeReadsNoOtherRequest). Params
		// that carry the producer's generation were checked against the
		// new one above: they are the new producer's, and are read; so
		// are params naming the producer at another address than the
		// generation known here (issued by whatever answers there).
		reason := fmt.Sprintf("producer engine %s (%s) restarted (generation %d -> %d) before this request's READ reached it: without data-plane grants its blocks are not known to be held for this request; not read",
			e.id, e.addr, from, e.gen)
		r.notRead = true
		st.decide(r, ResultFailed, FailurePeerGone, reason)
		st.tryReport(r)
		return
	}
	if st.needsHoldCheck(r) {
		// Params the READ would refuse are refused first, as such: the
		// hold check asks about the blocks they name.
		if !st.remoteBlocksOK(r, e, targets) {
			st.tryReport(r)
			return
		}
		if !st.holdChecked(r, e, targets) {
			// Its params carry no generation and nothing refuses a READ
			// of blocks the producer holds for another request: it is
			// read only once every producer rank says it holds it
			// (holdcheck.go). Before, params of a producer that restarted
			// since, reaching a rank that had loaded the new generation
			// already, were read and the request reported done with
			// another request's KV.
			return
		}
	}
	r.targets, r.sent = targets, true
	st.watch(e)
	if st.cfg.Mode == ModePush {
		st.register(r, e)
	} else {
		st.noteSent(r, e)
		st.read(r, e)
	}
	st.tryReport(r)
}

// refuseProducer tells every producer rank of a push request that this
// rank gives up before it registered, so they fail their side at once
// instead of waiting for their lease. (A pull request's end tells its
// producer's ranks itself: releaseAsked.)
func (st *loopState) refuseProducer(e *engine, r *recvReq, fk FailureKind, reason string) {
	if st.cfg.Mode == ModePull {
		return
	}
	for _, to := range st.producerRanks(e.tpSize, e.ppSize) {
		st.tellP(e, r, to, msgCancel, fk, reason)
	}
}

// producerRanks lists the ranks of a producer of TP size tp and PP size
// pp this rank exchanges with (targets), or, where the TP sizes map onto
// each other nowhere, those this rank tells of a request's end: no
// producer rank maps to ours, yet each holds the request, and each is
// told by one of our ranks, producer rank t by our rank t mod our TP
// size. Before, none was, and each held its blocks for its whole lease.
func (st *loopState) producerRanks(tp, pp int) []rankRef {
	targets, err := st.targets(tp, pp)
	if err == nil {
		return targets
	}
	targets = targets[:0]
	for p := range pp {
		for t := range tp {
			if t%st.layout.TPSize == st.layout.TPRank {
				targets = append(targets, rankRef{pp: p, tp: t})
			}
		}
	}
	return targets
}

// register sends D's registration to every producer rank it needs.
func (st *loopState) register(r *recvReq, e *engine) {
	m := &msg{Kind: msgReg, TransferID: r.req.TransferID, DReq: r.req.ReqID, PReq: r.req.Remote.ReqID, Spans: r.req.Local, Tokens: r.req.Tokens}
	if !r.deadline.IsZero() {
		// Past our deadline we give the request up: the producer must not
		// act on this registration then, however late it reaches it. On
		// its clock (the handshake's offset: its clock minus ours).
		m.Until = r.deadline.Add(e.offset)
	}
	b := appendMsg(nil, st.self(m))
	if st.guarded && r.grant == 0 {
		// The producer ranks may WRITE into these blocks from before they
		// hear of them until the request ends.
		peers := make([]PeerName, 0, len(r.targets))
		for _, to := range r.targets {
			if p, ok := e.peers[to]; ok {
				peers = append(peers, p)
			}
		}
		r.grant = st.grantOp(peers, r.req.Local, r.req.ReqID, r.req.TransferID)
	}
	r.regErrs, r.regWait = make([]error, len(r.targets)), 0
	for i, to := range r.targets {
		if p, ok := e.peers[to]; !ok {
			r.regErrs[i] = fmt.Errorf("producer %s has no rank tp %d pp %d", e.id, to.tp, to.pp)
		} else {
			st.notifyOp(p, b, noticeReg, r.req.ReqID, i, nil)
			r.regWait++
		}
	}
	if r.regWait == 0 {
		st.registerSettled(r, e)
	}
}

// registered takes the result of one registration notice of request id
// to its target i; once all are in, registerSettled.
func (st *loopState) registered(id string, i int, err error) {
	r := st.recvs[id]
	if r == nil || r.regWait == 0 {
		return
	}
	e := st.engines[r.req.Remote.EngineID]
	if err != nil {
		r.regErrs[i] = err
		if e != nil {
			st.probe(e) // is the producer gone?
		}
	}
	if r.regWait--; r.regWait > 0 {
		return
	}
	if e != nil {
		st.registerSettled(r, e)
	}
	st.tryReport(r)
}

// registerSettled fails the request at the targets its registration did
// not reach, or, when it reached none, restarts it after a new handshake
// if that applies.
func (st *loopState) registerSettled(r *recvReq, e *engine) {
	errs := r.regErrs
	r.regErrs = nil
	failed := func(err error) bool { return err != nil }
	if slices.ContainsFunc(errs, failed) {
		// For the requests after this one: over a fresh handshake, this
		// one's failure is a verdict unless its agent is gone.
		defer st.doubt(e)
	}
	if !slices.ContainsFunc(errs, func(err error) bool { return err == nil }) && st.retryAfterHandshake(r, e, slices.ContainsFunc(errs, agentGone)) {
		return // nothing registered: asked again once the producer answers
	}
	for i, to := range r.targets {
		if err := errs[i]; err != nil {
			st.metrics.FailedNotification()
			r.fenced = r.fenced.add(to) // nothing registered there
			st.decide(r, ResultFailed, FailureRegistration, "registration: "+err.Error())
		}
	}
}

// retryAfterHandshake restarts a request that reached none of its
// producer's ranks (its first registration or READs failed to get through)
// once a new handshake with the producer answers, when the one it used is
// not fresh (handshakeFresh: older than handshakeRetry, or the producer
// found unreachable since it was loaded) or the failure says the agent's
// process is gone (gone: agentGone): a producer that restarted while this
// rank was idle is at new agents, and the old handshake still names the
// gone ones. Before, freshness was the handshake's age alone: a producer
// daemon back on its address within a second of the consumer's handshake
// had the consumer's next request go to its gone agents and fail. Once
// per request; false when it does not apply.
func (st *loopState) retryAfterHandshake(r *recvReq, e *engine, gone bool) bool {
	if r.rehandshook || r.decided || len(r.got) > 0 || len(r.handles) > 0 || !gone && st.handshakeFresh(e) {
		return false
	}
	r.rehandshook, r.rehandshookFrom = true, e.gen
	st.revoke(r) // the grant names the old agents
	r.sent, r.targets = false, nil
	clear(r.retryAt) // the READs all go again
	r.fenced = r.fenced[:0]
	r.exited, r.exitWhy = nil, ""
	r.holds = nil // the old agents' answers
	for i := range r.asked {
		// Its READs failed, none carried its notice: an agent they went
		// to that still holds the request hears of its end (releaseAsked)
		// unless a READ of the new round goes to it again.
		r.asked[i].told = false
	}
	if e.state != hsPending {
		st.startHandshake(e)
	}
	return true
}

// agentGone reports whether err says the peer's end of a connection is
// gone: the connection refused (nothing listens where the agent was) or
// closed by the peer (reset, a broken pipe, or EOF where an answer was
// due), or a backend says so (ErrPeerLost: NIXL's peer whose process
// exited, or whose connection broke). A fault of the path (a timeout, a
// partition) is not.
func agentGone(err error) bool {
	return errors.Is(err, ErrPeerLost) || errors.Is(err, syscall.ECONNREFUSED) || errors.Is(err, syscall.ECONNRESET) || errors.Is(err, syscall.EPIPE) || errors.Is(err, io.EOF)
}

// read posts the READs of a pull consumer.
func (st *loopState) read(r *recvReq, e *engine) {
	if exp := r.holdEnd(); !exp.IsZero() {
		local := exp.Add(-e.offset - expiryMargin)
		if !st.now.Before(local) {
			st.metrics.ExpiredRequest()
			st.decide(r, ResultExpired, FailureExpired, "producer blocks expire before the read could finish")
			return
		}
		// The READs must be done when the producer frees its blocks: on
		// our clock, by the handshake's offset (the producer's clock
		// minus ours). Before, the Scheduler copied the expiry into
		// Deadline, which was rebased as a time on our own scheduler
		// clock: with the producer's clock behind ours by more than its
		// hold left, the read was given up at once; ahead, it was bounded
		// that much past the hold.
		r.bound = true
		if r.deadline.IsZero() || local.Before(r.deadline) {
			r.deadline = local
			st.arm(local, tRecvDeadline, r.req.ReqID)
		}
	}
	// The producer's lists come from the router, not from this rank's
	// engine (whose own lists Step checks): one naming a block twice would
	// land that block's KV in two of this request's blocks, the KV of the
	// other lost and the request reported loaded.
	if err := st.builder.CheckDistinct(r.req.Remote.Blocks, "remote"); err != nil {
		st.refuseRemote(r, e, r.targets, err)
		return
	}
	for _, to := range r.targets {
		st.readFrom(r, e, to)
	}
	if !r.decided && len(r.got) == len(r.targets) {
		st.decide(r, ResultDone, FailureNone, "")
	}
}

// remoteBlocksOK checks the producer blocks pull request r's params name
// (from the router, not this rank's engine) as its READs from targets
// would, before they go: false (r failed, the ranks told) if they name a
// block twice or fall short of what the request's blocks take.
func (st *loopState) remoteBlocksOK(r *recvReq, e *engine, targets []rankRef) bool {
	if err := st.builder.CheckDistinct(r.req.Remote.Blocks, "remote"); err != nil {
		st.refuseRemote(r, e, targets, err)
		return false
	}
	hreq := hotpath.Request{Tokens: r.req.Remote.Tokens, Src: r.req.Remote.Blocks, Dst: r.req.Local}
	for _, to := range targets {
		p, err := st.plan(e, to, st.layout.TPRank)
		if err != nil || p.NotifyOnly {
			continue // (readFrom fails it, or reads nothing)
		}
		if err := hotpath.CheckCovered(p, &hreq); err != nil {
			st.refuseRemote(r, e, targets, err)
			return false
		}
	}
	return true
}

// refuseRemote fails pull request r for the producer blocks its params
// name (err), telling ranks to.
func (st *loopState) refuseRemote(r *recvReq, e *engine, to []rankRef, err error) {
	st.metrics.BadInput("recv_req.remote.blocks")
	for _, t := range to {
		st.tellP(e, r, t, msgFail, FailureSetup, err.Error())
	}
	st.decide(r, ResultFailed, FailureSetup, "remote blocks rejected: "+err.Error())
}

// readFrom posts the READ of one producer rank's share of a request.
func (st *loopState) readFrom(r *recvReq, e *engine, to rankRef) {
	hreq := hotpath.Request{Tokens: r.req.Remote.Tokens, Src: r.req.Remote.Blocks, Dst: r.req.Local}
	if r.decided {
		st.tellP(e, r, to, msgFail, r.outcome.Kind, r.outcome.Reason)
		return
	}
	p, err := st.plan(e, to, st.layout.TPRank)
	if err != nil {
		st.tellP(e, r, to, msgFail, FailureIncompatible, err.Error())
		st.decide(r, ResultFailed, FailureIncompatible, err.Error())
		return
	}
	if p.NotifyOnly {
		st.tellP(e, r, to, msgDone, FailureNone, "")
		r.got = r.got.add(to)
		return
	}
	// The producer's lists must hold every token it says it holds that
	// this request's blocks take: the READ moves what both lists hold, and
	// the blocks past a short list would be reported loaded.
	if err := hotpath.CheckCovered(p, &hreq); err != nil {
		st.refuseRemote(r, e, []rankRef{to}, err)
		return
	}
	done := appendMsg(nil, st.self(&msg{Kind: msgDone, TransferID: r.req.TransferID, DReq: r.req.ReqID, PReq: r.req.Remote.ReqID}))
	if st.prepare {
		id, n, bytes, err := st.postPrepared(e, planKey(e, to, st.layout.TPRank), p, to, &hreq, done)
		if err != nil {
			st.tellP(e, r, to, msgFail, FailureSetup, err.Error())
			st.decide(r, ResultFailed, FailureSetup, "post READ: "+err.Error())
			return
		}
		r.addHandle(id, to)
		r.told(e.peers[to]) // (the READ carries its notice)
		st.handles[id] = &handle{id: id, posted: st.now, bytes: bytes, descs: n, blocks: spanBlocks(r.req.Local), recv: r.req.ReqID, src: to}
		return
	}
	if st.layouts {
		// As layouts: a base pair per layer, an entry per run of blocks.
		from := len(st.fx.lays.Spans)
		if err := st.builder.AppendLayouts(&st.fx.lays, p, &hreq); err != nil {
			st.refuseRemote(r, e, []rankRef{to}, err)
			return
		}
		n, bytes := st.fx.lays.Pieces(st.fx.lays.Spans[from:])
		id := st.postLayoutOp(hotpath.OpRead, e.peers[to], from, done)
		r.addHandle(id, to)
		r.told(e.peers[to])
		st.handles[id] = &handle{id: id, posted: st.now, bytes: bytes, descs: n, blocks: spanBlocks(r.req.Local), recv: r.req.ReqID, src: to}
		return
	}
	from := len(st.fx.descs)
	st.fx.descs, err = st.builder.AppendDescs(st.fx.descs, p, &hreq)
	if err != nil {
		st.fx.descs = st.fx.descs[:from]
		st.refuseRemote(r, e, []rankRef{to}, err)
		return
	}
	descs := st.fx.descs[from:]
	id := st.postOp(hotpath.OpRead, e.peers[to], from, done)
	r.addHandle(id, to)
	r.told(e.peers[to])
	st.handles[id] = &handle{id: id, posted: st.now, bytes: descBytes(descs), descs: len(descs),
		blocks: spanBlocks(r.req.Local), recv: r.req.ReqID, src: to}
}

// postFailed: the backend refused a post the core asked for (its bytes
// never moved); the request fails as if the post had failed in place.
func (st *loopState) postFailed(id XferID, err error) {
	h := st.handles[id]
	if h == nil {
		return
	}
	delete(st.handles, id)
	st.metrics.FailedTransfer()
	if h.send != "" {
		s := st.sends.get(h.send)
		if s == nil || s.ranks == nil {
			return
		}
		if r := s.ranks[h.dtp]; r != nil && r.reason == "" {
			r.reason, r.kind = "post WRITE: "+err.Error(), FailureSetup
		}
		st.sendSettled(h, false, err)
		return
	}
	r := st.recvs[h.recv]
	if r == nil {
		return
	}
	delete(r.handles, id)
	if e := st.engines[r.req.Remote.EngineID]; e != nil && agentGone(err) {
		// Posted to agents that are gone (the producer restarted or
		// re-attached its rank while this rank was idle): read again
		// once a new handshake answers, as after a READ that failed so.
		retried := st.retryAfterHandshake(r, e, true)
		st.doubt(e)
		if retried {
			return
		}
	}
	if e := st.engines[r.req.Remote.EngineID]; e != nil {
		st.tellP(e, r, h.src, msgFail, FailureSetup, "post READ: "+err.Error())
	}
	st.decide(r, ResultFailed, FailureSetup, "post READ: "+err.Error())
	st.tryReport(r)
}

// tellP sends a bare message about a request to one producer rank.
func (st *loopState) tellP(e *engine, r *recvReq, to rankRef, k msgKind, fk FailureKind, reason string) {
	if p, ok := e.peers[to]; ok {
		r.told(p)
	}
	st.sendTo(e, to, r.notice(k, fk, reason))
}

// notice is a bare message about r. One of a request whose params went
// through the hold check names their producer blocks, as its questions
// did: a producer holding a request under the same names in other blocks
// (a restarted one's, the router retrying it) does not take it for that
// one's (holdcheck.go).
func (r *recvReq) notice(k msgKind, fk FailureKind, reason string) *msg {
	m := &msg{Kind: k, TransferID: r.req.TransferID, DReq: r.req.ReqID, PReq: r.req.Remote.ReqID, FailKind: fk, Reason: reason}
	if r.hc != nil || r.notRead {
		m.Spans = r.req.Remote.Blocks
	}
	return m
}

// recvSettled handles the end of one of a pull consumer's READs.
func (st *loopState) recvSettled(h *handle, ok bool, err error) {
	r := st.recvs[h.recv]
	if r == nil {
		return
	}
	delete(r.handles, h.id)
	if !r.decided && !r.deadline.IsZero() && !st.now.Before(r.deadline) {
		// Handled at or past the deadline, its timer not run yet (the
		// driver handed this in first): the READ was in flight past the
		// point it had to end by (for a read bounded by the producer's
		// expiry, expiryMargin before it: the producer may have freed and
		// reused its blocks since). It is given up as the timer would
		// have. Before, it was done. A READ that failed carried no
		// notice: its rank is told here.
		if e := st.engines[r.req.Remote.EngineID]; !ok && e != nil {
			st.tellP(e, r, h.src, msgFail, FailureExpired, fmt.Sprintf("READ failed past the consumer deadline: %v", err))
		}
		st.recvDeadline(timerEntry{at: r.deadline, kind: tRecvDeadline, id: r.req.ReqID})
		return
	}
	if ok {
		r.got = r.got.add(h.src)
		if !r.decided && len(r.got) == len(r.targets) {
			st.decide(r, ResultDone, FailureNone, "")
		}
	} else if !r.decided && errors.Is(err, ErrNotGranted) && r.retries[h.src] < maxReadRetries {
		// The producer does not hold the blocks (yet): its rank may not
		// have taken the step that holds them when our READ arrived.
		// Read again shortly; the deadline still bounds the request.
		if r.retries == nil {
			r.retries, r.retryAt = map[rankRef]int{}, map[rankRef]time.Time{}
		}
		at := st.now.Add(readRetryDelay(r.retries[h.src]))
		r.retries[h.src]++
		r.retryAt[h.src] = at
		st.metrics.RetriedRead()
		st.arm(at, tReadRetry, r.req.ReqID)
		return
	} else {
		if errors.Is(err, ErrNotGranted) {
			st.metrics.FailedTransfer() // not counted by xferEnded
		} else {
			st.probeSoon(r.req.Remote.EngineID) // is the producer gone?
			if e := st.engines[r.req.Remote.EngineID]; e != nil && errors.Is(err, ErrXferFailed) {
				retried := st.retryAfterHandshake(r, e, agentGone(err))
				st.doubt(e) // for the requests after this one (handshakeFresh)
				if retried {
					return // read again once the producer answers
				}
			}
		}
		if e := st.engines[r.req.Remote.EngineID]; e != nil {
			st.tellP(e, r, h.src, msgFail, FailureTransfer, "READ failed: "+err.Error())
		}
		st.decide(r, ResultFailed, FailureTransfer, "READ failed: "+err.Error())
	}
	st.tryReport(r)
}

// A pull consumer's READ refused because the producer does not hold the
// blocks is tried again maxReadRetries times, readRetryDelay apart.
const maxReadRetries = 16

func readRetryDelay(try int) time.Duration {
	return min(5*time.Millisecond<<min(try, 10), 500*time.Millisecond)
}

// readRetry posts the READs due again.
func (st *loopState) readRetry(t timerEntry) {
	r := st.recvs[t.id]
	if r == nil || r.decided || !r.sent {
		return // !sent: it reads everything again once a handshake answers
	}
	e := st.engines[r.req.Remote.EngineID]
	for _, to := range r.targets {
		at, ok := r.retryAt[to]
		if !ok || at.After(t.at) {
			continue
		}
		if e == nil || e.state != hsReady {
			// decide tells the ranks whose READ waits to be tried again
			// (this one among them) where they can be reached.
			st.decide(r, ResultFailed, FailurePeerGone, "producer handshake lost before a READ was retried")
			break
		}
		delete(r.retryAt, to)
		st.readFrom(r, e, to)
	}
	if !r.decided && len(r.got) == len(r.targets) {
		st.decide(r, ResultDone, FailureNone, "")
	}
	st.tryReport(r)
}

// onPushDone counts a producer rank's completion notice (push).
func (st *loopState) onPushDone(m *msg) {
	r, ref, ok := st.recvFor(m)
	if !ok {
		return
	}
	if r.got.has(ref) {
		st.metrics.Dropped("done_duplicate")
		return
	}
	r.got, r.fenced = r.got.add(ref), r.fenced.add(ref)
	if len(r.got) == len(r.targets) {
		if !r.decided {
			st.decide(r, ResultDone, FailureNone, "")
		} else if r.canceled && r.outcome.Result != ResultDone && !r.failedRank {
			// Every byte landed after all (a lost notice was resent in
			// answer to our cancel): the request is done.
			// The failure logged at the decision is not what the
			// engine hears: say so, or a reader of the log counts a
			// failure that did not happen.
			st.log.Info("kvxfer: request done after all: every producer rank's bytes landed before its cancel", "request_id", r.req.ReqID,
				"engine_id", st.cfg.EngineID, "remote_engine_id", r.req.Remote.EngineID, "was", r.outcome.Reason)
			r.outcome = Outcome{ReqID: r.req.ReqID, Result: ResultDone}
		}
	}
	st.tryReport(r)
}

// onPushFail: a producer rank cannot complete and has nothing in flight.
func (st *loopState) onPushFail(m *msg) {
	if r := st.recvs[m.DReq]; r != nil && r.req.Remote.EngineID == m.Engine && !r.sent && sameTransfer(r, m) && m.TPRank >= 0 && m.TPRank < max(m.TPSize, 1) {
		// The producer failed the request before this rank registered
		// (its handshake still pending): nothing was registered, nothing
		// can land; fail it now.
		st.decide(r, ResultFailed, m.failKind(), fmt.Sprintf("producer %s rank tp %d pp %d: %s", m.Engine, m.TPRank, m.PPRank, m.Reason))
		st.tryReport(r)
		return
	}
	r, ref, ok := st.recvFor(m)
	if !ok {
		return
	}
	r.fenced = r.fenced.add(ref)
	r.failedRank = true
	st.decide(r, ResultFailed, m.failKind(), fmt.Sprintf("producer %s rank tp %d pp %d: %s", m.Engine, m.TPRank, m.PPRank, m.Reason))
	st.tryReport(r)
}

// onAck: a producer rank confirms nothing of it can land any more.
func (st *loopState) onAck(m *msg) {
	r, ref, ok := st.recvFor(m)
	if !ok {
		return
	}
	r.fenced = r.fenced.add(ref)
	st.tryReport(r)
}

// sameTransfer reports whether a producer's message about r's id may be
// about r: not when both name a transfer id and they differ, nor, where
// no transfer id tells them apart, when it names another producer request
// than r's (by its id, or by base id as the producer pairs them: one of
// the two the other's base). Either is about an earlier request under the
// same id, one that finished: a producer answers a cancel after its
// WRITE landed with the completion notice again, which may reach a new
// request under the id, counted there it would report blocks loaded that
// nothing wrote.
func sameTransfer(r *recvReq, m *msg) bool {
	return namesTransfer(r.req.TransferID, r.req.Remote.ReqID, m.TransferID, m.PReq)
}

// namesTransfer is sameTransfer for a request of transfer id tid and
// producer request name, and a message naming transfer id mtid and
// producer request preq (any may be empty: unknown).
func namesTransfer(tid, name, mtid, preq string) bool {
	if mtid != "" && tid != "" {
		return mtid == tid
	}
	if preq == "" || name == "" || preq == name {
		return true
	}
	// Paired by base id (pairOf): the same base, one of the two that base.
	nb, pb := BaseRequestID(name), BaseRequestID(preq)
	return nb == pb && (nb == name || pb == preq)
}

// recvFor finds the receiving request and sender rank a producer's
// message is about.
func (st *loopState) recvFor(m *msg) (*recvReq, rankRef, bool) {
	r := st.recvs[m.DReq]
	if r == nil || r.req.Remote.EngineID != m.Engine || !sameTransfer(r, m) {
		st.metrics.Dropped(m.Kind.String() + "_unknown_request")
		st.log.Debug("kvxfer: message for an unknown request", "kind", m.Kind, "d_req", m.DReq, "from", m.Engine)
		return nil, rankRef{}, false
	}
	ref := rankRef{pp: m.PPRank, tp: m.TPRank}
	for _, t := range r.targets {
		if t == ref {
			return r, ref, true
		}
	}
	st.metrics.BadInput(m.Kind.String() + ".rank")
	return nil, rankRef{}, false
}

// decide fixes a consumer request's outcome (first decision wins). A
// push consumer that gives up cancels every producer rank that may still
// WRITE, and reports only once they confirm (fencing).
func (st *loopState) decide(r *recvReq, res Result, kind FailureKind, reason string) {
	if r.decided {
		return
	}
	r.decided = true
	if res == ResultDone {
		kind = FailureNone
	}
	r.outcome = Outcome{ReqID: r.req.ReqID, Result: res, Kind: kind, Reason: reason}
	if res != ResultDone && st.cfg.Mode == ModePull && len(r.retryAt) > 0 {
		// A producer rank whose READ waits to be tried again reads
		// nothing more from us, and is told now: it would hold its
		// blocks for its whole lease.
		if e := st.engines[r.req.Remote.EngineID]; e != nil {
			for _, to := range r.targets {
				if _, ok := r.retryAt[to]; ok {
					st.tellP(e, r, to, msgFail, kind, reason)
				}
			}
		}
		clear(r.retryAt)
	}
	if res != ResultDone && st.cfg.Mode == ModePull && len(r.handles) > 0 && !st.closing {
		// Its READs in flight are given up (abandonReads) at the next
		// poll, once the input at hand has been carried out: some may
		// not be posted yet (a timer due now would fire in this input).
		r.giveUpAt = st.now.Add(st.cfg.PollInterval)
		st.arm(r.giveUpAt, tGiveUp, r.req.ReqID)
	}
	if res != ResultDone && st.cfg.Mode == ModePush && r.sent {
		r.canceled = true
		st.sendCancels(r)
		r.fenceBy = st.now.Add(st.cfg.FenceTimeout)
		st.arm(r.fenceBy, tFence, r.req.ReqID)
	}
	if res != ResultDone && !r.quiet {
		st.log.Warn("kvxfer: transfer failure", "failure_type", kind.String(), "side", "consumer", "request_id", r.req.ReqID,
			"engine_id", st.cfg.EngineID, "remote_engine_id", r.req.Remote.EngineID, "remote_request_id", r.req.Remote.ReqID,
			"num_local_blocks", spanBlocks(r.req.Local), "result", res, "reason", reason)
	}
}

// sendCancels asks every unfenced producer rank to stop: by the agent
// loaded for it, whatever the engine's handshake state (one pending or
// failed keeps the agents it had, or that a partial answer named), or,
// with none loaded yet, once the pending handshake loads one (sendTo).
// Before, a request failed while a handshake was pending (a rank
// re-attached: failChanged) asked no rank: one that did not change and
// might still write into its blocks was waited for until its own done or
// the fence timeout.
func (st *loopState) sendCancels(r *recvReq) {
	e := st.engines[r.req.Remote.EngineID]
	if e == nil {
		return
	}
	for _, to := range r.targets {
		if !r.fenced.has(to) {
			st.tellP(e, r, to, msgCancel, r.outcome.Kind, r.outcome.Reason)
		}
	}
}

// tryReport reports a decided consumer request once nothing can land in
// its blocks any more.
func (st *loopState) tryReport(r *recvReq) {
	if !r.decided || len(r.handles) > 0 {
		return
	}
	if st.cfg.Mode == ModePush && r.sent {
		for _, t := range r.targets {
			if !r.fenced.has(t) {
				st.exitFence(r)
				return
			}
		}
	}
	st.finishRecv(r, r.outcome)
}

func (st *loopState) finishRecv(r *recvReq, o Outcome) {
	delete(st.recvs, r.req.ReqID)
	st.releaseAsked(r, o)
	st.rememberEnded(r)
	st.revoke(r)
	if o.Result != ResultDone {
		st.out.InvalidBlocks = append(st.out.InvalidBlocks, group0(r.req.Local)...)
	}
	st.report(RoleConsumer, o)
}

// revoke ends a consumer request's WRITE grant: from here its blocks may
// go back to the engine, and a producer's late WRITE is refused.
func (st *loopState) revoke(r *recvReq) {
	if st.guarded && r.grant != 0 {
		st.revokeOp(r.grant)
		r.grant = 0
	}
}

// abandonReads gives up the READs of a pull consumer request that failed
// while they were in flight (tGiveUp, armed by decide): its outcome no
// longer depends on them, and a READ whose producer stalls (its daemon
// still answering, so it is not deemed gone) would otherwise hold the
// request, and its blocks, for ever. Each is released (abandonXfer: the request reports once none of
// its bytes can land any more), and its producer rank is told only then
// (released), so it does not let its blocks go while the READ could
// still read them. A closing Worker lets its READs end within
// CloseTimeout instead (fenceClose).
func (st *loopState) abandonReads(t timerEntry) {
	r := st.recvs[t.id]
	if r == nil || !r.giveUpAt.Equal(t.at) || st.closing {
		return
	}
	r.giveUpAt = time.Time{}
	for _, id := range slices.Sorted(maps.Keys(r.handles)) {
		if h := st.handles[id]; h != nil {
			h.giveUp = true
			st.abandonXfer(h)
		}
	}
}

// recvDeadline: the producer did not complete in time.
func (st *loopState) recvDeadline(e timerEntry) {
	r := st.recvs[e.id]
	if r == nil || r.decided || !r.deadline.Equal(e.at) {
		return
	}
	st.metrics.ExpiredRequest()
	if !r.sent {
		// Nothing was registered or read: no fence to wait for (its end
		// tells a pull producer's ranks: releaseAsked).
		st.decide(r, ResultExpired, FailureExpired, "producer did not complete before the deadline")
		st.tryReport(r)
		return
	}
	// (Pull: decide tells the ranks whose READ waits to be tried again,
	// a READ in flight is given up and its rank told once it ends, and
	// the request's end tells any other: releaseAsked.)
	st.decide(r, ResultExpired, FailureExpired, "producer did not complete before the deadline")
	st.tryReport(r)
}

// writerExitGrace is how long after a producer rank's writer process
// was seen to exit a push consumer still keeps the blocks that rank was
// to WRITE (writerExited), at most FenceTimeout: a byte the process
// handed to a transport before it died and that this side's own agent
// applies (UCX's shared-memory FIFOs, which NIXL's progress thread and
// the backend's polls drain) lands within it. Work the process queued on
// a device and that outlives it (a GPU copy under CUDA MPS, an RDMA WRITE
// on the wire) is not proven over by the exit: it must end within it.
const writerExitGrace = 500 * time.Millisecond

// writerExited: a notice to peer failed because the process holding
// that agent exited (ErrPeerExited, seen on the same host). That process
// is the one that posts the WRITEs of the producer ranks it speaks for
// (their daemon's, or an in-process engine's), so nothing of theirs can
// land any more: a push consumer's requests waiting on them fail now,
// naming it, and are reported once writerExitGrace has passed, without
// waiting for the confirmation nobody can send (FenceTimeout). A rank
// only unreachable (a partition, a frozen process) is no proof, and
// waits for its confirmation or the fence's timeout as before. With
// grants (the built-in backend) revoking them fences at once anyway.
func (st *loopState) writerExited(peer PeerName, err error) {
	if st.cfg.Mode != ModePush || peer == "" {
		return
	}
	for _, id := range sortedKeys(st.recvs) {
		r := st.recvs[id]
		e := st.engines[r.req.Remote.EngineID]
		if e == nil || !r.sent {
			continue
		}
		for _, t := range r.targets {
			if e.peers[t] != peer || r.fenced.has(t) || r.exited.has(t) {
				continue
			}
			why := fmt.Sprintf("producer engine %s rank tp %d pp %d: the process posting its WRITEs (agent %s) exited: %v", e.id, t.tp, t.pp, peer, err)
			r.exited = r.exited.add(t)
			if r.exitWhy == "" {
				r.exitWhy = why
			}
			st.log.Warn("kvxfer: producer's writer process exited", "failure_type", "peer_gone", "request_id", r.req.ReqID,
				"engine_id", st.cfg.EngineID, "remote_engine_id", e.id, "peer", peer, "err", err)
			st.decide(r, ResultFailed, FailurePeerGone, why)
		}
		st.tryReport(r)
	}
}

// exitFence brings a decided push consumer request's fence forward to
// writerExitGrace from now once every producer rank it still waits on
// has a writer process that exited.
func (st *loopState) exitFence(r *recvReq) {
	if !r.decided || len(r.exited) == 0 || r.fenceBy.IsZero() {
		return
	}
	for _, t := range r.targets {
		if !r.fenced.has(t) && !r.exited.has(t) {
			return
		}
	}
	if at := st.now.Add(min(writerExitGrace, st.cfg.FenceTimeout)); at.Before(r.fenceBy) {
		r.fenceBy = at
		st.arm(at, tFence, r.req.ReqID)
	}
}

// fenceTimer gives up waiting for producer confirmations.
func (st *loopState) fenceTimer(e timerEntry) {
	r := st.recvs[e.id]
	if r == nil || !r.fenceBy.Equal(e.at) {
		return
	}
	if done := slices.IndexFunc(r.targets, func(t rankRef) bool { return !r.fenced.has(t) && !r.exited.has(t) }) < 0; done && len(r.exited) > 0 {
		// Every rank left unconfirmed had its writer process exit.
		st.metrics.Dropped("fence_writer_exited")
		st.log.Warn("kvxfer: producer's writer process exited; reporting the request without its confirmation", "req", r.req.ReqID, "engine", r.req.Remote.EngineID)
		o := r.outcome
		if o.Reason != r.exitWhy {
			o.Reason += " (fenced: " + r.exitWhy + ")"
		}
		st.finishRecv(r, o)
		return
	}
	st.metrics.Dropped("fence_timeout")
	st.log.Error("kvxfer: producer never confirmed a cancel; reporting the request anyway", "req", r.req.ReqID, "engine", r.req.Remote.EngineID)
	o := r.outcome
	o.Reason += " (fence timed out: the producer never confirmed)"
	st.finishRecv(r, o)
}

// abandonXfer gives up a consumer's READ in flight (its producer is
// gone): the driver releases it (effects.abandon), and its request,
// which still counts it among its handles, reports only once that is
// done (released): a backend's release waits for bytes still moving,
// which would land in blocks the engine reuses once the request reports.
func (st *loopState) abandonXfer(h *handle) {
	delete(st.handles, h.id)
	st.abandoned[h.id] = h
	st.fx.abandon = append(st.fx.abandon, h.id)
}

// released: the driver released an abandoned transfer; nothing of it
// moves any more, and its request may report.
func (st *loopState) released(id XferID) {
	h := st.abandoned[id]
	if h == nil {
		return
	}
	delete(st.abandoned, id)
	r := st.recvs[h.recv]
	if r == nil {
		return
	}
	delete(r.handles, id)
	if h.giveUp {
		if e := st.engines[r.req.Remote.EngineID]; e != nil {
			st.tellP(e, r, h.src, msgFail, r.outcome.Kind, r.outcome.Reason)
		}
	}
	st.tryReport(r)
}

// rankHold is the deadline a producer rank answered a heartbeat with.
type rankHold struct {
	ref rankRef
	at  time.Time
}

// holdEnd is when the producer's hold of the request's blocks ends
// unless heartbeats extend it, on the producer's clock (zero: the params
// set no bound): the params' expiry, or later where every producer rank
// it reads from (still to read from) answered a later deadline
// (msgHold). Only the producer's own answers extend it.
func (r *recvReq) holdEnd() time.Time {
	exp := r.req.Remote.Expiry
	if exp.IsZero() || len(r.holds) == 0 {
		return exp
	}
	var end time.Time
	n := 0
	for _, to := range r.targets {
		if r.got.has(to) {
			continue
		}
		n++
		at := exp
		for _, h := range r.holds {
			if h.ref == to && h.at.After(at) {
				at = h.at
			}
		}
		if end.IsZero() || at.Before(end) {
			end = at
		}
	}
	if n == 0 {
		return exp
	}
	return end
}

// maxHoldRanks bounds the answers a request keeps: one per producer rank
// it reads from (a rank of ours reads from a few).
const maxHoldRanks = 64

// onHold takes a producer rank's answer to our heartbeat (msgHold): the
// deadlines it holds our requests' blocks to. A request it names that is
// ours (its transfer, producer request and engine), not decided and
// bounded by the producer's hold, has its READs' bound moved to the
// later hold, by the latest offset and the same margin as the params'
// expiry. It never moves a bound earlier, nor past the request's own
// deadline.
func (st *loopState) onHold(m *msg) {
	if st.cfg.Mode != ModePull {
		st.metrics.BadInput("hold.mode")
		return
	}
	if len(m.Holds)*3 != len(m.IDs) { // decodeMsg refuses it first
		st.metrics.BadInput("hold.ids")
		return
	}
	e := st.engines[m.Engine]
	if e == nil {
		return
	}
	ref := rankRef{pp: m.PPRank, tp: m.TPRank}
	if len(m.Holds) == 0 && m.DReq != "" && m.Reason != "" {
		// An answer that lists nothing and names a request: the rank
		// does not hold it, and says why (refuseEndedAsk).
		if r := st.recvs[m.DReq]; r != nil && r.req.Remote.EngineID == m.Engine && r.req.TransferID == m.TransferID && r.req.Remote.ReqID == m.PReq {
			st.holdRefused(r, e, ref, m.from, m.Reason)
		}
		return
	}
	for i, at := range m.Holds {
		tid, preq, dreq := m.IDs[3*i], m.IDs[3*i+1], m.IDs[3*i+2]
		st.onWaitHold(m, ref, tid, preq, dreq, at)
		r := st.recvs[dreq]
		if r == nil || r.decided || r.req.Remote.EngineID != m.Engine || r.req.TransferID != tid || r.req.Remote.ReqID != preq {
			continue
		}
		if !r.req.Remote.Expiry.IsZero() {
			r.holds = noteHold(r.holds, ref, at)
			if r.bound { // (unbound: its READ bounds itself by it, read)
				local := r.holdEnd().Add(-e.offset - expiryMargin)
				if !r.own.IsZero() && r.own.Before(local) {
					local = r.own
				}
				if local.After(r.deadline) {
					r.deadline = local
					st.arm(local, tRecvDeadline, r.req.ReqID)
				}
			}
		}
		if r.hc != nil {
			st.holdAnswered(r, e, ref, m.from) // its READs may go
		}
	}
}

// noteHold keeps in holds the latest deadline producer rank ref
// answered (at most maxHoldRanks ranks).
func noteHold(holds []rankHold, ref rankRef, at time.Time) []rankHold {
	for i := range holds {
		if holds[i].ref == ref {
			if at.After(holds[i].at) {
				holds[i].at = at
			}
			return holds
		}
	}
	if len(holds) < maxHoldRanks {
		holds = append(holds, rankHold{ref: ref, at: at})
	}
	return holds
}

// sendHeartbeats tells each producer engine which of its requests this
// rank still waits for (SPEC §9), from the worker's own clock.
func (st *loopState) sendHeartbeats() {
	by := map[string][]string{}
	for _, id := range sortedKeys(st.recvs) {
		r := st.recvs[id]
		e := st.engines[r.req.Remote.EngineID]
		switch {
		case e == nil:
			continue
		case e.state == hsReady:
			if r.decided && len(r.handles) == 0 {
				// (A decided request whose READs are still being released
				// keeps the producer's lease alive: they may still read.)
				continue
			}
		case r.decided || len(r.handles) == 0:
			continue
		default:
			// Its READs in flight read from the agents it has, whatever
			// became of the handshake since (another request's failed
			// again): the producer's lease on their blocks is kept alive
			// there, or, not delivered, the request fails (failUnheard)
			// before it could lapse.
		}
		by[r.req.Remote.EngineID] = append(by[r.req.Remote.EngineID], r.req.TransferID, r.req.Remote.ReqID, r.req.ReqID)
	}
	st.waitHeartbeats(by)
	st.heartbeat(by)
}

// heartbeat sends the heartbeats of requests by producer engine (IDs
// in triples) to each of its ranks.
func (st *loopState) heartbeat(by map[string][]string) {
	for _, id := range sortedKeys(by) {
		e := st.engines[id]
		ids := by[id]
		// Every producer rank is heartbeaten (its hold extended), but only
		// those this rank reads from are told of a request's end by it
		// (released.go): the others refuse its notices (done.tp_rank), and
		// the consumer rank that reads them tells them.
		reads, _ := st.targets(e.tpSize, e.ppSize)
		for len(ids) > 0 {
			n := heartbeatSplit(ids)
			m := st.self(&msg{Kind: msgHeartbeat, IDs: ids[:n:n]})
			if st.cfg.Mode == ModePull {
				m.Reason = hbAskHold // answered with the holds (onHold)
			}
			b := appendMsg(nil, m)
			for _, ref := range sortedRefs(e.peers) {
				st.fx.ops = append(st.fx.ops, op{kind: opNotify, peer: e.peers[ref], msg: b, notice: noticeHeartbeat, m: m, ref: ref})
				if slices.Contains(reads, ref) {
					st.notedAsked(ids[:n], e.peers[ref])
				}
			}
			ids = ids[n:]
		}
	}
}

// maxHeartbeatBytes bounds the request ids one heartbeat carries: a rank
// waiting on many requests of one producer sends several heartbeats, each
// far inside every backend's notification limit (the built-in one's is
// 1 MiB; 8,000 vLLM-style ids take about 1 MiB).
const maxHeartbeatBytes = 64 << 10

// heartbeatSplit is how many of ids (triples: transfer id, P id, D id)
// the next heartbeat carries: whole triples, at least one, within
// maxHeartbeatBytes and maxWireIDs.
func heartbeatSplit(ids []string) int {
	size := 0
	for i := 0; i+3 <= len(ids); i += 3 {
		t := 3*binary.MaxVarintLen32 + len(ids[i]) + len(ids[i+1]) + len(ids[i+2])
		if i > 0 && (size+t > maxHeartbeatBytes || i+3 > maxWireIDs) {
			return i
		}
		size += t
	}
	return len(ids)
}

// heartbeatSent follows a heartbeat to one producer rank: delivered, its
// requests' lease there is extended; not delivered, it goes once more at
// once, and a request whose heartbeats to a rank have failed for
// hbGrace fails (FailureNotification), before the producer's lease on
// its blocks, extended by the last one delivered, can lapse (a pull
// consumer's READ would find them freed).
func (st *loopState) heartbeatSent(o *op, err error) {
	ids := o.m.IDs
	for i := 2; i < len(ids); i += 3 {
		r := st.recvs[ids[i]]
		if r == nil || r.decided {
			continue
		}
		if err == nil {
			r.hbFailing = slices.DeleteFunc(r.hbFailing, func(x rankRef) bool { return x == o.ref })
			if len(r.hbFailing) == 0 {
				r.hbFailSince = time.Time{}
			}
			continue
		}
		if r.hc != nil && !r.sent && agentGone(err) && slices.Contains(r.hc.peers, o.peer) {
			// Its hold check's question found the agent gone: the producer
			// restarted or re-attached the rank while this rank was idle.
			// As after a READ that failed so, it goes on once a new
			// handshake answers (and is asked anew there).
			if e := st.engines[r.req.Remote.EngineID]; e != nil {
				st.doubt(e)
				if st.retryAfterHandshake(r, e, true) {
					continue
				}
			}
		}
		if !slices.Contains(r.hbFailing, o.ref) {
			r.hbFailing = append(r.hbFailing, o.ref)
		}
		if r.hbFailSince.IsZero() {
			r.hbFailSince = st.now
		}
	}
	if err == nil {
		return
	}
	st.metrics.FailedNotification()
	if o.notice == noticeHeartbeat {
		st.log.Warn("kvxfer: heartbeat not delivered; sending it again", "peer", o.peer, "requests", len(ids)/3, "err", err)
		if m, b := st.liveHeartbeat(o.m, o.msg); m != nil {
			st.fx.ops = append(st.fx.ops, op{kind: opNotify, peer: o.peer, msg: b, notice: noticeHeartbeatRetry, m: m, ref: o.ref})
		}
	}
}

// liveHeartbeat is heartbeat m (encoded b) less the requests that ended
// since it was built (nil when none is left): its retry goes after their
// end's notices, and would extend the producer's hold of each once more
// after it was told to let it go. The same message where none ended.
func (st *loopState) liveHeartbeat(m *msg, b []byte) (*msg, []byte) {
	live := func(i int) bool {
		tid, preq, dreq := m.IDs[i], m.IDs[i+1], m.IDs[i+2]
		if r := st.recvs[dreq]; r != nil {
			return r.req.TransferID == tid && r.req.Remote.ReqID == preq
		}
		w := st.waits[dreq]
		return w != nil && w.req.TransferID == tid && w.req.Remote.ReqID == preq
	}
	n := 0
	for i := 0; i+2 < len(m.IDs); i += 3 {
		if live(i) {
			n += 3
		}
	}
	if n == len(m.IDs) {
		return m, b
	}
	if n == 0 {
		return nil, nil
	}
	c := *m
	c.IDs = make([]string, 0, n)
	for i := 0; i+2 < len(m.IDs); i += 3 {
		if live(i) {
			c.IDs = append(c.IDs, m.IDs[i:i+3]...)
		}
	}
	return &c, appendMsg(nil, &c)
}

// hbGrace is how long a request's heartbeats to a producer rank may fail
// before it fails: two heartbeat periods, a third of the lease before the
// producer's lease (two thirds of it from the last heartbeat delivered)
// can lapse.
func (st *loopState) hbGrace() time.Duration { return st.cfg.Lease / 3 }

// failUnheard fails the requests whose heartbeats have not reached a
// producer rank for hbGrace.
func (st *loopState) failUnheard() {
	for _, id := range sortedKeys(st.recvs) {
		r := st.recvs[id]
		if r.decided || r.hbFailSince.IsZero() || st.now.Sub(r.hbFailSince) < st.hbGrace() {
			continue
		}
		st.decide(r, ResultFailed, FailureNotification, fmt.Sprintf(
			"heartbeats to producer engine %s (%s) ranks %v were not delivered for %v: its lease on the request's blocks could lapse",
			r.req.Remote.EngineID, r.req.Remote.Addr, r.hbFailing, st.now.Sub(r.hbFailSince).Round(time.Millisecond)))
		st.tryReport(r)
	}
}

func sortedRefs[V any](m map[rankRef]V) []rankRef {
	out := make([]rankRef, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	for i := 1; i < len(out); i++ {
		for j := i; j > 0 && (out[j].pp < out[j-1].pp || out[j].pp == out[j-1].pp && out[j].tp < out[j-1].tp); j-- {
			out[j], out[j-1] = out[j-1], out[j]
		}
	}
	return out
}

// Transfer ids reused (push). A producer tombstones each consumer request
// it finished, by consumer engine and request id, for its
// RegistrationTTL: a registration that names the same transfer (transfer
// id, else producer request: tomb.names) is a late copy of the finished
// one's as far as it can tell. A new request under the consumer id,
// transfer id and producer request of one that finished (a router that
// reuses its ids) is therefore never served: our producer fails its
// registration, and one without that check dropped it and answered its
// cancel with the finished transfer's completion notice, which the new
// request counted: blocks reported loaded that nothing wrote. So the
// consumer refuses such a request itself, at its engine's intake, before
// it registers (its engine recomputes at once instead of waiting for the
// producer's answer), and cancels it at the producer, so that the
// producer's request of that transfer fails at once instead of holding
// its blocks for its lease.
//
// Remembered are push requests that registered (one that never did left
// nothing at its producer), for this rank's RegistrationTTL (a producer
// whose TTL is longer is covered by its own check) and at most maxEnded
// of them, the oldest forgotten first.

// rememberEnded notes a consumer request that ended (reusedTransfer).
func (st *loopState) rememberEnded(r *recvReq) {
	if st.cfg.Mode != ModePush || !r.sent {
		return
	}
	st.ended.put(r.req.ReqID, st.now, endedRecv{engine: r.req.Remote.EngineID, tid: r.req.TransferID, preq: r.req.Remote.ReqID}, maxEnded)
}

// reusedTransfer refuses a new push consumer request that names the
// transfer of a request under its id that ended within RegistrationTTL
// (counted as bad input of the field that names it, its one outcome
// failed, its blocks reported invalid), and tells its producer, which
// ends its request of that transfer at once.
func (st *loopState) reusedTransfer(in *RecvReq) bool {
	if st.cfg.Mode != ModePush || st.ended.len() == 0 {
		return false
	}
	e, at, ok := st.ended.get(in.ReqID)
	if !ok || st.now.Sub(at) > st.cfg.RegistrationTTL || e.engine != in.Remote.EngineID ||
		!namesTransfer(e.tid, e.preq, in.TransferID, in.Remote.ReqID) {
		return false
	}
	field, val := "recv_req.transfer_id", in.TransferID
	if in.TransferID == "" || e.tid == "" {
		field, val = "recv_req.remote.req_id", in.Remote.ReqID
	}
	why := fmt.Sprintf("%s %q: consumer request %q of producer engine %q (producer request %q, transfer id %q) ended %v ago under this transfer; "+
		"a producer cannot tell a new transfer under the same ids from the finished one: give each transfer its own transfer_id",
		field, val, in.ReqID, in.Remote.EngineID, in.Remote.ReqID, in.TransferID, st.now.Sub(at))
	st.log.Warn("kvxfer: consumer request reuses a finished transfer: refused", "req", in.ReqID, "transfer_id", in.TransferID,
		"remote_engine_id", in.Remote.EngineID, "remote_request_id", in.Remote.ReqID)
	st.refuse(RoleConsumer, in.ReqID, in.Local, field, FailureSetup, why)
	st.cancelProducer(in, why)
	return true
}

// cancelProducer tells the producer ranks of a consumer request this rank
// refused before it registered that it gave the request up, as a
// consumer that registered tells them when it fails: the producer's
// request fails at once (consumerGaveUp) instead of holding its blocks
// for its lease.
func (st *loopState) cancelProducer(in *RecvReq, why string) {
	e, ranks := st.paramsRanks(in)
	for _, to := range ranks {
		st.sendTo(e, to, &msg{Kind: msgCancel, TransferID: in.TransferID, DReq: in.ReqID, PReq: in.Remote.ReqID, Reason: why, FailKind: FailureSetup})
	}
}
