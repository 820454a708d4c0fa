package kvxfer

import (
	"fmt"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// The pre-READ hold check (pull, without data-plane grants).
//
// A pull consumer READs the producer blocks its params name. Without
// grants (NIXL) nothing on the producer refuses a READ of blocks it now
// holds for another request: params issued by a producer that restarted
// since (a new generation) name blocks that may hold another request's
// KV. Params carrying the producer's generation are checked against the
// loaded one (startRecv). Params without one (0: unknown) that name their
// producer request or transfer are read only once every producer rank
// read from has said it holds that request now: before its READs, the
// consumer asks each of them with a pull heartbeat naming just it
// (Reason hbAskHold), and reads once every rank's answer (msgHold) lists
// it, from the agent loaded for that rank when it asked. A rank whose
// answer does not list it within holdCheckBound (a producer answers only
// when it lists something) does not hold it: a restarted producer that
// never issued it, or one that released it or let its lease lapse. The
// request fails then (peer_gone), never read. An ask names the producer
// blocks the params name (Spans), and a rank lists the request only if it
// holds it in exactly those blocks: a restarted producer may hold a
// request under the old one's names (a router retrying it with the same
// transfer and request ids) in other blocks, and the params' blocks then
// hold another request's KV.

// holdCheck is a request's check in progress (or passed).
type holdCheck struct {
	gen     uint64     // the producer's generation asked
	targets []rankRef  // the ranks asked
	peers   []PeerName // the agent asked for each target
	held    []bool     // which targets listed the request
	asks    int        // asks sent to each rank not listing it yet
	next    time.Time  // when its timer (tHoldCheck) fires (zero: not armed)
	passed  bool
}

// holdCheckDelays are the waits after each ask before the next (the
// last before the request fails): a producer's worker may not have
// applied the step that holds the request when the first ask reaches
// it. About 1 s in all, far inside any request's deadline.
var holdCheckDelays = [...]time.Duration{50 * time.Millisecond, 100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond, 400 * time.Millisecond}

// holdCheckBound is how long a producer rank has to list the request.
func holdCheckBound() time.Duration {
	var d time.Duration
	for _, x := range holdCheckDelays {
		d += x
	}
	return d
}

// needsHoldCheck reports whether a request's READs wait for the hold
// check: pull, no grants, params without a generation, naming its
// producer request or transfer (a heartbeat's answer names requests by
// those; one naming neither keeps the generation rules alone).
func (st *loopState) needsHoldCheck(r *recvReq) bool {
	return st.cfg.Mode == ModePull && !st.guarded && r.req.Remote.Generation == 0 &&
		(r.req.Remote.ReqID != "" || r.req.TransferID != "")
}

// holdChecked reports whether request r, about to READ from targets of
// engine e (ready), passed its hold check against e's current agents;
// if not, it starts the check (or asks again, where its timer stopped
// while the handshake was out) and the request waits for it.
func (st *loopState) holdChecked(r *recvReq, e *engine, targets []rankRef) bool {
	if hc := r.hc; hc != nil && hc.gen == e.gen && len(hc.targets) == len(targets) && st.samePeers(hc, e, targets) {
		if hc.passed {
			return true
		}
		if hc.next.IsZero() {
			st.askHold(r, e)
		}
		return false
	}
	// A new check: the first, or the producer's agents changed since the
	// last one (its answers were the old agents').
	hc := &holdCheck{gen: e.gen, targets: targets, peers: make([]PeerName, len(targets)), held: make([]bool, len(targets))}
	for i, to := range targets {
		hc.peers[i] = e.peers[to]
	}
	r.hc = hc
	st.askHold(r, e)
	return false
}

func (st *loopState) samePeers(hc *holdCheck, e *engine, targets []rankRef) bool {
	for i, to := range targets {
		if hc.targets[i] != to || hc.peers[i] != e.peers[to] {
			return false
		}
	}
	return true
}

// askHold sends the hold question about r to each target rank that has
// not listed it yet, and arms the next ask (or the failure).
func (st *loopState) askHold(r *recvReq, e *engine) {
	hc := r.hc
	// The ask carries the producer blocks the params name: a producer
	// lists the request only if it holds it in those very blocks (a
	// restarted one may hold a request under the old one's names, the
	// router retrying it, in other blocks; producers of earlier builds
	// ignore a heartbeat's spans).
	m := st.self(&msg{Kind: msgHeartbeat, Reason: hbAskHold, IDs: []string{r.req.TransferID, r.req.Remote.ReqID, r.req.ReqID},
		Spans: r.req.Remote.Blocks})
	b := appendMsg(nil, m)
	for i, to := range hc.targets {
		if hc.held[i] || hc.peers[i] == "" {
			continue // (a rank without an agent is never listed: it fails)
		}
		st.fx.ops = append(st.fx.ops, op{kind: opNotify, peer: hc.peers[i], msg: b, notice: noticeHeartbeat, m: m, ref: to})
		r.ask(hc.peers[i])
	}
	hc.next = st.now.Add(holdCheckDelays[min(hc.asks, len(holdCheckDelays)-1)])
	hc.asks++
	st.arm(hc.next, tHoldCheck, r.req.ReqID)
}

// holdAnswered takes producer rank ref's answer (from agent from) that
// it holds r: once every target has, r's READs go.
func (st *loopState) holdAnswered(r *recvReq, e *engine, ref rankRef, from PeerName) {
	hc := r.hc
	if hc == nil || hc.passed || r.decided || r.sent || hc.gen != e.gen {
		return
	}
	all := true
	for i, to := range hc.targets {
		if to == ref && hc.peers[i] == from && e.peers[to] == from {
			hc.held[i] = true
		}
		all = all && hc.held[i]
	}
	if !all {
		return
	}
	hc.passed, hc.next = true, time.Time{}
	st.startRecv(r)
}

// holdCheckTimer asks again, or fails the request once the bound passed
// with a target rank that never listed it.
func (st *loopState) holdCheckTimer(t timerEntry) {
	r := st.recvs[t.id]
	if r == nil || r.decided || r.sent || r.hc == nil || r.hc.passed || !r.hc.next.Equal(t.at) {
		return
	}
	hc := r.hc
	hc.next = time.Time{}
	e := st.engines[r.req.Remote.EngineID]
	if e == nil || e.state != hsReady || e.stale || e.gen != hc.gen {
		// The handshake is out again: startRecv goes on with it once it
		// answers (redrive), asking again or anew.
		return
	}
	if hc.asks < len(holdCheckDelays) {
		st.askHold(r, e)
		return
	}
	var missing []string
	for i, to := range hc.targets {
		if !hc.held[i] {
			missing = append(missing, fmt.Sprintf("tp %d pp %d", to.tp, to.pp))
		}
	}
	reason := fmt.Sprintf("producer engine %s (%s) at generation %d does not hold this request (ranks %v did not list it within %v): its params carry no generation and may predate a restart of the producer; not read",
		e.id, e.addr, e.gen, missing, holdCheckBound())
	st.metrics.Dropped("pull_params_not_held")
	for _, to := range hc.targets {
		// Every rank is told: one that holds it after all (its answer
		// lost) frees its blocks now. The notice names the blocks, so
		// that a producer holding a request under the same names in
		// other blocks (not this one) does not end it.
		st.tellP(e, r, to, msgFail, FailurePeerGone, reason)
	}
	st.decide(r, ResultFailed, FailurePeerGone, reason)
	st.tryReport(r)
}

// refuseEndedAsk answers a consumer's hold question about a request
// this producer rank no longer holds because it ended here (pullEnded:
// its consumer read it, or another consumer request's notices ended it,
// its lease lapsed, its engine aborted it): that it does not hold it, and
// why, in a msgHold that lists nothing and names the request (TransferID,
// PReq, DReq, as the question did) with the reason. Its consumer fails
// at once (holdRefused); one of an earlier build ignores an answer that
// lists nothing, and fails at its check's bound as before. Before, the
// question was kept as an early one (stashAsk) for a request that was
// not coming, and its consumer (a second one the router handed the same
// params, or one that asked after the lease lapsed) failed only when its
// check ran out, holdCheckBound (1.15 s) later. A question about a
// request not handed over yet still waits for it: one naming an id
// reused for another transfer is not taken for the ended one
// (pullEnded: by transfer id where both name one), nor is one naming
// other blocks than the ended one held (its digest, goneSend.blocks): a
// router that reuses its transfer ids may hand the engine a new request
// under the ended one's very ids, and the new one's consumer, asking
// before it arrives, reads it once it does (were it refused, nothing
// would tell the new request that its consumer gave up: it would hold
// its blocks for its lease). What this cannot tell apart: such a new
// request that the engine gives the ended one's very blocks; its
// consumer fails (and the request waits out its lease).
func (st *loopState) refuseEndedAsk(m *msg, tid, preq, dreq string, g goneSend, at time.Time) {
	what := fmt.Sprintf("producer request %q", preq)
	if preq == "" {
		what = "the producer request"
	}
	if tid != "" {
		what += fmt.Sprintf(" of transfer %q", tid)
	}
	st.metrics.Dropped("hold_ask_after_end")
	st.notify(m.from, &msg{Kind: msgHold, TransferID: tid, PReq: preq, DReq: dreq,
		Reason: fmt.Sprintf("%s ended at this producer rank %v ago (%s): its blocks are no longer held for any consumer", what, st.now.Sub(at), g.why)})
}

// holdRefused takes producer rank ref's answer (from agent from) that it
// does not hold r, and why (refuseEndedAsk): r fails at once, never read,
// and the other ranks it asked are told (one that holds it for another
// consumer does not wait for r). Only an answer from the agent asked, to
// a check still running, counts.
func (st *loopState) holdRefused(r *recvReq, e *engine, ref rankRef, from PeerName, why string) {
	hc := r.hc
	if hc == nil || hc.passed || r.decided || r.sent || hc.gen != e.gen || e.peers[ref] != from {
		return
	}
	i := slices.Index(hc.targets, ref)
	if i < 0 || hc.peers[i] != from {
		return
	}
	hc.next = time.Time{}
	reason := fmt.Sprintf("producer engine %s (%s) rank tp %d pp %d does not hold this request: %s; not read",
		e.id, e.addr, ref.tp, ref.pp, why)
	st.metrics.Dropped("pull_params_not_held")
	r.told(from) // (it holds nothing of it to let go)
	for _, to := range hc.targets {
		if to != ref {
			st.tellP(e, r, to, msgFail, FailureSetup, reason)
		}
	}
	st.decide(r, ResultFailed, FailureSetup, reason)
	st.tryReport(r)
}

// heldIn reports whether a hold question (or a failure notice) m, naming
// in Spans the producer blocks of a consumer's params, is about request
// s: every group it names blocks in (none: a consumer of an earlier
// build, or a notice that names none), s holds the very same blocks in. A
// request held under the same names in other blocks is another one (a
// restarted producer's, the router having retried it under its old ids).
// A message kept for later compares by its digest (compact).
func heldIn(m *msg, s *sendReq) bool {
	if m.blocks.mask != 0 {
		sum, ok := sumIn(m.blocks.mask, s.req.Blocks)
		return ok && sum == m.blocks.sum
	}
	for g := range m.Spans {
		if len(m.Spans[g].IDs) == 0 {
			continue // nothing read from that group
		}
		if g >= len(s.req.Blocks) || !slices.Equal(m.Spans[g].IDs, s.req.Blocks[g].IDs) {
			return false
		}
	}
	return true
}

// blocksSum is a digest of the blocks a message's Spans name: which
// groups name any (mask; a message names at most maxWireGroups) and a
// hash of their ids, group by group.
type blocksSum struct{ mask, sum uint64 }

// compact replaces m's Spans by their digest, so that what a producer
// keeps of a message for later (stashAsk, stashEarly) is small whatever
// its sender put in it.
func (m *msg) compact() {
	if len(m.Spans) == 0 {
		return
	}
	m.blocks, m.Spans = spansSum(m.Spans), nil
}

// spansSum is the digest of the blocks spans name (blocksSum).
func spansSum(spans []topology.Span) blocksSum {
	var mask uint64
	for g := range spans {
		if len(spans[g].IDs) > 0 && g < 64 {
			mask |= 1 << g
		}
	}
	sum, _ := sumIn(mask, spans)
	return blocksSum{mask: mask, sum: sum}
}

// blocksOf is the digest of the blocks message m names (compact or not).
func (m *msg) blocksOf() blocksSum {
	if m.blocks.mask != 0 {
		return m.blocks
	}
	return spansSum(m.Spans)
}

// sumIn hashes (FNV-1a) the ids spans holds in the groups of mask; false
// if spans has no such group.
func sumIn(mask uint64, spans []topology.Span) (uint64, bool) {
	h := uint64(14695981039346656037)
	mix := func(v uint64) {
		for i := 0; i < 8; i++ {
			h ^= v & 0xff
			h *= 1099511628211
			v >>= 8
		}
	}
	for g := 0; g < 64 && mask>>g != 0; g++ {
		if mask&(1<<g) == 0 {
			continue
		}
		if g >= len(spans) {
			return 0, false
		}
		mix(uint64(g))
		mix(uint64(len(spans[g].IDs)))
		for _, id := range spans[g].IDs {
			mix(uint64(id))
		}
	}
	return h, true
}

// maxEarlyAsks caps the requests a producer keeps hold questions for
// before it holds them; maxAsksPerRequest the questions kept for one (one
// per consumer rank and request, its latest); maxEarlyAskBytes what they
// keep in all (askCost: a question's ids may be 1 KiB each), 16 MiB,
// some 40,000 questions of usual ids, while the counts alone let a peer
// that names long ids keep about a GiB.
const (
	maxEarlyAsks      = 1 << 12
	maxAsksPerRequest = 64
	maxEarlyAskBytes  = 16 << 20
)

// askCost is what a kept question costs maxEarlyAskBytes: its ids, and a
// fixed part for the message itself.
func askCost(m *msg) int {
	n := 256
	for _, id := range m.IDs {
		n += len(id)
	}
	return n
}

// stashAsk keeps a consumer's hold question about a request this
// producer rank does not hold yet (the consumer's params reached it before
// our engine's step did): the request's arrival answers it at once
// (replayAsks), where the consumer would otherwise learn of it only at
// its next ask, up to 400 ms later. Kept for twice the check's bound
// (its asker has given up by then), bounded in count and bytes; past a
// bound it is dropped (its asker learns at its next ask).
func (st *loopState) stashAsk(m *msg) {
	// What is kept is what answering it reads: its sender, ids and the
	// digest of its blocks; the fields a heartbeat does not use (a peer
	// may fill them) are let go, and its engine's name is the one we keep
	// anyway (admitted: the engine is known).
	m.compact()
	m.Addr, m.TransferID, m.DReq, m.PReq = "", "", "", ""
	if e := st.engines[m.Engine]; e != nil {
		m.Engine = e.id
	}
	key := m.IDs[1]
	if key == "" {
		key = "tid:" + m.IDs[0]
	}
	cost := askCost(m)
	e := st.earlyAsks[key]
	if e == nil {
		if len(st.earlyAsks) >= maxEarlyAsks || st.earlyAskBytes+cost > maxEarlyAskBytes {
			st.metrics.Dropped("hold_ask_unknown_request")
			return
		}
		e = &earlyNotes{at: st.now}
		st.earlyAsks[key] = e
	}
	for i, o := range e.msgs {
		if o.from == m.from && o.IDs[2] == m.IDs[2] {
			if d := cost - askCost(o); st.earlyAskBytes+d <= maxEarlyAskBytes {
				e.msgs[i] = m // its latest
				e.bytes += d
				st.earlyAskBytes += d
			} else {
				st.metrics.Dropped("hold_ask_unknown_request") // (its earlier one stands)
			}
			return
		}
	}
	if len(e.msgs) >= maxAsksPerRequest || st.earlyAskBytes+cost > maxEarlyAskBytes {
		st.metrics.Dropped("hold_ask_unknown_request")
		return
	}
	e.msgs = append(e.msgs, m)
	e.bytes += cost
	st.earlyAskBytes += cost
}

// forgetAsks drops the questions kept under key.
func (st *loopState) forgetAsks(key string, e *earlyNotes) {
	delete(st.earlyAsks, key)
	st.earlyAskBytes -= e.bytes
}

// replayAsks answers the hold questions kept for pull request s, which
// this rank now holds (onHeartbeat: one about other blocks, or another
// transfer, is not answered, and goes back to wait for its request).
func (st *loopState) replayAsks(s *sendReq) {
	for _, key := range [...]string{s.req.ReqID, "tid:" + s.req.TransferID} {
		e := st.earlyAsks[key]
		if e == nil || key == "tid:" {
			continue
		}
		st.forgetAsks(key, e)
		for _, m := range e.msgs {
			st.onHeartbeat(m)
		}
	}
}

// checkEarlyBytes panics when earlyBytes or earlyAskBytes is not what the
// early notices or hold questions kept cost (an -tags invariants
// self-check: a budget must neither leak nor be given back twice).
func (st *loopState) checkEarlyBytes() {
	for _, c := range [...]struct {
		what  string
		kept  map[string]*earlyNotes
		total int
		cost  func(*msg) int
	}{{"earlyBytes", st.early, st.earlyBytes, noticeCost}, {"earlyAskBytes", st.earlyAsks, st.earlyAskBytes, askCost}} {
		sum := 0
		for k, e := range c.kept {
			n := 0
			for _, m := range e.msgs {
				n += c.cost(m)
			}
			if n != e.bytes {
				panic(fmt.Sprintf("kvxfer: %s: %q counts %d bytes, keeps %d", c.what, k, e.bytes, n))
			}
			sum += n
		}
		if sum != c.total {
			panic(fmt.Sprintf("kvxfer: %s = %d, what is kept costs %d", c.what, c.total, sum))
		}
	}
}
