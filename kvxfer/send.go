package kvxfer

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// producerState is the producer side: P's requests (by id, transfer id and
// base id), D's registrations waiting for them and the pairs matched,
// tombstones of finished pairs, and what ended before any registration
// paired with it. A request is in sends from its SendReq (or layer-wise
// Prefill) until its one outcome; a registration is in regs or, matched,
// in matched, never both.
type producerState struct {
	sends     sendTable // by P request id
	sendByTID sendTable // by transfer id
	// sendBase: by base id, the oldest request of each base, the others
	// after it through their nextBase (most bases have one request: a
	// list needs no allocation of its own).
	sendBase map[string]*sendReq
	// deadSends: requests forgotten during the input being handled, kept
	// from reuse until it ends (a caller up the stack may still read
	// one); freeSends: records of earlier inputs, cleared, for addSend.
	deadSends []*sendReq
	// regAgain: registrations held back while their pair was held
	// (sendReq.again), to be handled once the input that ended it is.
	regAgain  []*msg
	freeSends []*sendReq
	regs      map[regKey]*regGroup // unmatched registrations
	// regIDs: the block ids their registrations hold (maxRegIDs).
	regIDs    int
	regByTID  map[string][]regKey
	regByBase map[string][]regKey
	matched   map[regKey]*sendReq // live matches by D request
	tombs     map[regKey]tomb
	// abortedP and abortedT: producer requests gone unpaired (push), or
	// ended (pull), by id and by transfer id, for RegistrationTTL, at
	// most maxAborted of each, the oldest forgotten first.
	abortedP recent[goneSend]
	abortedT recent[goneSend]
	// endedPaired: push producer requests that ended paired with a
	// consumer request, by "p:" and producer request id and by "t:" and
	// transfer id, for RegistrationTTL, at most maxEndedPaired (onReg).
	endedPaired recent[goneSend]
	// ambRegs and ambSends: scratch for findReg and findSend.
	ambRegs   []*regGroup
	ambSends  []*sendReq
	early     map[string]*earlyNotes // pull: notices before their request
	earlyAsks map[string]*earlyNotes // pull: hold questions before their request (holdcheck.go)
	// earlyAskBytes: what earlyAsks keep (askCost; maxEarlyAskBytes).
	earlyAskBytes int
	// earlyBytes: what early keep (noticeCost; maxEarlyBytes).
	earlyBytes int
	layerSteps map[uint64][]string // layer-wise: step -> P ids prefilled in it
}

// Producer side: leases, registration matching, WRITEs (push) and the
// consumer's completion notices (pull).

func (st *loopState) newSend(in *SendReq, deadline time.Time) {
	h := st.sends.hash(in.ReqID)
	if s := st.sends.getH(in.ReqID, h); s != nil {
		if s.prefill {
			// Layer-wise: the prefill entry is followed by the finish;
			// every layer is saved by now.
			s.prefill = false
			if s.doom != "" {
				st.failUnmatched(s, s.doomKind, s.doom)
				return
			}
			s.req.Tokens = in.Tokens
			if s.match != nil {
				for _, tp := range s.expect {
					st.refuseTokens(s, tp, s.ranks[tp])
				}
			}
			if !s.preempted && movedBlocks(s.req.Blocks, in.Blocks) {
				// Its blocks are not those of its prefill: its engine
				// moved it since (a preemption it did not tell), and the
				// layers written from the prefill's blocks may hold
				// another request's KV. Every layer is written again from
				// the finish's blocks, as for a preemption told.
				st.log.Warn("kvxfer: layer-wise request finished from other blocks than its prefill's: every layer is written again", "req", in.ReqID)
				s.preempted = true
			}
			if s.preempted {
				// Its blocks are the finish's: those of its prefill were
				// freed at its preemption.
				s.req.Blocks = in.Blocks
				s.retaken = true
			}
			for i := range s.saved {
				s.saved[i] = true
			}
			st.armLease(s, deadline)
			st.retake(s)
			st.pushReady(s)
			return
		}
		if st.draining(s) {
			// The request's finish (after its prefill entry, if it
			// waits too): its SendReq decides its blocks.
			s.next = &pendingSend{req: *in, deadline: deadline}
			return
		}
		st.metrics.BadInput("send_req.duplicate")
		st.log.Warn("kvxfer: SendReq for a request already held", "req", in.ReqID)
		return
	}
	st.addSend(in, h, deadline, false)
}

// draining reports whether s is an aborted request that waits for its
// WRITEs in flight to end: its engine freed it, so a request it hands over
// under the same id is a new one (next), not a duplicate.
func (st *loopState) draining(s *sendReq) bool {
	return s.aborted && !s.done && !s.prefill && (s.next == nil || s.next.prefill)
}

// promote holds the request that waited for the one under its id to be
// forgotten (sendReq.next).
func (st *loopState) promote(p *pendingSend) {
	h := st.sends.hash(p.req.ReqID)
	if !p.prefill {
		st.addSend(&p.req, h, p.deadline, false)
		return
	}
	// Layers it saved while it waited are written at its finish (its
	// SendReq marks them all saved); those saved from now on as they are.
	st.layerSteps[p.step] = append(st.layerSteps[p.step], p.req.ReqID)
	st.addSend(&p.req, h, time.Time{}, true).step = p.step
}

// newPrefill holds a layer-wise request from its prefill step on, so its
// layers can be written as they are saved.
func (st *loopState) newPrefill(in *SendReq, step uint64) {
	if !st.cfg.Layerwise || st.cfg.Mode != ModePush {
		return
	}
	h := st.sends.hash(in.ReqID)
	if s := st.sends.getH(in.ReqID, h); s != nil {
		if st.draining(s) && s.next == nil {
			s.next = &pendingSend{req: *in, prefill: true, step: step}
			return
		}
		if s.prefill && s.preempted && !s.retaken && in.TransferID == s.req.TransferID {
			// Prefilled again after its preemption: its layers are
			// written from the new blocks as this step saves them.
			s.req.Blocks, s.req.Tokens = in.Blocks, in.Tokens
			s.retaken, s.step = true, step
			clear(s.saved)
			st.layerSteps[step] = append(st.layerSteps[step], in.ReqID)
			st.retake(s)
			return
		}
		st.metrics.BadInput("prefill.duplicate")
		return
	}
	if l := st.cfg.MaxRequests; l >= 0 && st.sends.len() >= l {
		// Past the bound the request is not held layer-wise, and reports
		// nothing now: its SendReq, which follows, decides it (held then
		// if there is room, else failed: one outcome, when its engine's
		// scheduler holds it).
		st.metrics.BadInput("prefill.limit")
		st.log.Warn("kvxfer: layer-wise prefill past the rank's request limit: its layers are written at its finish",
			"req", in.ReqID, "held", st.sends.len(), "limit", l)
		return
	}
	st.layerSteps[step] = append(st.layerSteps[step], in.ReqID)
	st.addSend(in, h, time.Time{}, true).step = step
}

// addSend holds a new producer request, whose id hashes to h in sends.
func (st *loopState) addSend(in *SendReq, h uint64, deadline time.Time, prefill bool) *sendReq {
	var s *sendReq
	if n := len(st.freeSends); n > 0 {
		s = st.freeSends[n-1]
		st.freeSends[n-1] = nil
		st.freeSends = st.freeSends[:n-1]
	} else {
		s = new(sendReq)
	}
	s.req, s.prefill = *in, prefill
	if prefill {
		s.saved = make([]bool, st.nLayers)
	}
	s.hID = h
	st.sends.insert(s, h)
	if in.TransferID != "" {
		ht := st.sendByTID.hash(in.TransferID)
		if old := st.sendByTID.getH(in.TransferID, ht); old != nil {
			st.metrics.BadInput("send_req.transfer_id")
			st.log.Warn("kvxfer: transfer id reused", "transfer_id", in.TransferID, "req", in.ReqID, "held_by", old.req.ReqID)
		} else {
			s.hTID = ht
			st.sendByTID.insert(s, ht)
			s.byTID = true
		}
	}
	if in.TransferID == "" {
		// Only a registration without a transfer id looks requests up by
		// base id, and it matches only requests without one (pairOf).
		b := BaseRequestID(in.ReqID)
		if last := st.sendBase[b]; last == nil {
			st.sendBase[b] = s
		} else {
			for last.nextBase != nil {
				last = last.nextBase
			}
			last.nextBase, s.prevBase = s, last
		}
		s.inBase = true
	}
	if !prefill {
		// A prefilling request has no lease yet: it starts at finish.
		st.armLease(s, deadline)
	}
	if st.cfg.Mode == ModePull {
		if st.guarded {
			// Consumers may READ the blocks while they are held.
			st.holdOp(s.req.Blocks, 1, s.req.ReqID, s.req.TransferID)
		}
		st.replayEarly(s)
		st.replayAsks(s)
	}
	if st.cfg.Mode == ModePush {
		for {
			g, amb := st.findReg(s)
			if amb != nil {
				if g = st.namedBy(s, amb); g == nil {
					st.ambiguousSend(s, amb)
					return s
				}
			}
			if g == nil {
				break
			}
			if g.gaveUp != "" {
				// The consumer gave the request up before it arrived.
				st.dropReg(g.key)
				kind := g.gaveUpKind
				if kind == FailureNone {
					kind = FailureCancelled
				}
				st.failUnmatched(s, kind, g.gaveUp)
				return s
			}
			if !g.until.IsZero() && !st.now.Before(g.until) {
				// It waited past the consumer's deadline: the consumer gave
				// the request up; fail it and look again.
				st.metrics.Dropped("reg_expired")
				st.failRegGroup(g, s.req.ReqID, FailureExpired, "the consumer's deadline passed before the producer's request arrived")
				continue
			}
			st.dropReg(g.key) // before attach takes its ranks
			st.attach(s, g)
			break
		}
		st.pushReady(s)
	}
	return s
}

// layerSaved posts one layer's WRITEs for the requests prefilled in step.
func (st *loopState) layerSaved(step uint64, layer int) {
	li := -1
	for i := range st.layout.Regions {
		if st.cfg.LayerOf[i] == layer {
			li = st.regionLayer[i]
			break
		}
	}
	if li < 0 {
		st.metrics.BadInput("layer_saved.layer")
		st.log.Warn("kvxfer: LayerSaved for a layer this rank does not hold", "layer", layer, "step", step)
		return
	}
	taken := false
	for _, id := range slices.Clone(st.layerSteps[step]) {
		if s := st.sends.get(id); s != nil && s.prefill && s.step == step {
			taken = true
			s.saved[li] = true
			st.pushReady(s)
		}
	}
	if !taken {
		// Not the engine's mistake, and nothing is lost: no request of
		// the step prefills on this rank (the step listed none here, its
		// entries were refused, it was dropped or is not taken in yet,
		// or its requests ended, were finished or were preempted first). A request whose
		// layer was saved unseen has every layer written at its finish.
		// Counted, so that an engine that signals ahead of its steps, or
		// for steps it never sent, shows.
		st.metrics.Dropped("layer_saved_unknown_step")
	}
}

// movedBlocks reports whether a layer-wise request's blocks at its finish
// (to) are not those of its prefill (from): a group whose list starts
// elsewhere, or a block at the same place that differs (blocks added at
// the end, for tokens decoded since, are not a move).
func movedBlocks(from, to []topology.Span) bool {
	if len(from) != len(to) {
		return true
	}
	for g := range from {
		a, b := from[g], to[g]
		if a.Start != b.Start {
			return true
		}
		n := min(len(a.IDs), len(b.IDs))
		if !slices.Equal(a.IDs[:n], b.IDs[:n]) {
			return true
		}
	}
	return false
}

// producerPreempted handles a layer-wise producer its engine preempted
// after its prefill step (StepMeta.Preempted): its blocks are freed, so
// nothing more is written from them (a layer not posted yet is not
// posted; one in flight still lands, and is written again), and its layer
// signals of that step are taken by nothing. Its pairing with its
// consumer stays: once its blocks are known again (retaken) and nothing of
// it is in flight, every layer is written again into the same consumer
// blocks, and the completion notice follows the last of those (retake).
// It has one outcome, at its finish or abort, as any prefilling request.
func (st *loopState) producerPreempted(id string) {
	s := st.sends.get(id)
	if s != nil && s.aborted && s.next != nil && s.next.prefill {
		// The new request under its id, waiting for an aborted one to
		// drain, was preempted before it was held: its prefill blocks
		// are gone; its finish, which follows, is held from its own.
		s.next = nil
		return
	}
	if s == nil || !s.prefill || s.aborted {
		// Not prefilling here: its prefill entry was refused (past the
		// rank's limit: its finish decides it), or it ended.
		st.metrics.Dropped("preempted_not_prefilling")
		return
	}
	s.preempted, s.retaken = true, false
	clear(s.saved)
	st.unlistStep(s)
}

// unlistStep drops a layer-wise request from its prefill step's list.
func (st *loopState) unlistStep(s *sendReq) {
	ids := slices.DeleteFunc(st.layerSteps[s.step], func(id string) bool { return id == s.req.ReqID })
	if len(ids) == 0 {
		delete(st.layerSteps, s.step)
	} else {
		st.layerSteps[s.step] = ids
	}
}

// retake ends a preempted request's wait: once its blocks are known again
// and nothing of its first attempt is in flight to any consumer rank,
// every layer is to be written again (none counts as posted), so no layer
// of the first attempt, read from blocks freed meanwhile, stays in the
// consumer's blocks.
func (st *loopState) retake(s *sendReq) {
	if !s.preempted || !s.retaken {
		return
	}
	for _, r := range s.ranks {
		if r.inflight > 0 {
			return
		}
	}
	s.preempted, s.retaken = false, false
	for _, r := range s.ranks {
		clear(r.posted)
	}
	st.pushReady(s)
}

func (st *loopState) armLease(s *sendReq, deadline time.Time) {
	if deadline.IsZero() {
		deadline = st.now.Add(st.cfg.Lease)
	}
	s.deadline = deadline
	st.arm(deadline, tLease, s.req.ReqID)
}

// pairing is how a D registration names a P request.
type pairing uint8

const (
	pairNone pairing = iota
	// pairBase: the same base id with different suffixes (SPEC §7.7's
	// fuzzy lookup): the reference pairs D's and P's ids that each
	// engine suffixed at random.
	pairBase
	// pairExact: the router's transfer id, or the very id.
	pairExact
)

// pairOf is the matching rule between a D registration and a P request
// (id, tid): the router's transfer id when either side has one; else the
// id D names for P's request (its own id when it names none), exactly;
// else the same base id (SPEC §7.7) — unless D named P's id with a suffix
// and the request carries another one: D named another request.
//
// Exact pairs always win over base pairs, and a base pair is taken only
// when it is the only one on both sides (findReg, findSend), and only by a
// producer of one rank (pairsByBase): base ids collide whenever clients
// reuse request ids, and a guess would WRITE one request's KV into
// another's blocks.
func pairOf(g *regGroup, id, tid string) pairing {
	if g.tid != "" || tid != "" {
		if g.tid == tid {
			return pairExact
		}
		return pairNone
	}
	name, named := g.name()
	if name == id {
		return pairExact
	}
	nb, ib := BaseRequestID(name), BaseRequestID(id)
	if nb != ib || named && nb != name && ib != id {
		// Different bases; or D named P's request by a full id (what
		// P's engine returned to it) and this is another one.
		return pairNone
	}
	return pairBase
}

// pairsByBase reports whether this rank pairs by base id at all: only as
// its producer's one rank. A base pair is a guess each rank makes on its
// own, from what it holds when it decides; two ranks could guess
// differently (one gets a registration before a request of its base,
// another after), and the consumer request would hold one producer
// request's KV from one rank and another's from the other, reported done.
// A producer of several ranks pairs by transfer id or the id D names.
func (st *loopState) pairsByBase() bool { return st.layout.TPSize*st.layout.PPSize == 1 }

// name is the id g names P's request by: the one D named, else D's own;
// named says which.
func (g *regGroup) name() (string, bool) {
	if g.preq != "" {
		return g.preq, true
	}
	return g.key.dreq, false
}

func (g *regGroup) base() string {
	n, _ := g.name()
	return BaseRequestID(n)
}

// findReg finds the waiting registration s pairs with: the one that names
// it exactly, else the one that pairs with it by base id, if s is also
// the only waiting request that registration pairs with. When several
// pair at the best tier nothing is guessed: they are returned in amb (a
// scratch slice, valid until the next call), best is nil.
func (st *loopState) findReg(s *sendReq) (best *regGroup, amb []*regGroup) {
	if len(st.regs) == 0 {
		return nil, nil // nothing waits: the usual case, no lookup
	}
	var cands []regKey
	if s.req.TransferID != "" {
		cands = st.regByTID[s.req.TransferID]
	} else {
		cands = st.regByBase[BaseRequestID(s.req.ReqID)]
	}
	amb = st.ambRegs[:0]
	tier := pairBase
	for _, k := range cands {
		g := st.regs[k]
		if g == nil {
			continue
		}
		p := pairOf(g, s.req.ReqID, s.req.TransferID)
		if p == pairBase && !st.pairsByBase() {
			continue
		}
		switch {
		case p < tier:
		case p > tier:
			tier, amb = p, append(amb[:0], g)
		default:
			amb = append(amb, g)
		}
	}
	st.ambRegs = amb
	switch {
	case len(amb) == 0:
		return nil, nil
	case len(amb) > 1:
		return nil, amb
	case tier == pairBase && st.sendsPairing(amb[0], s) > 0:
		return nil, amb
	}
	return amb[0], nil
}

// sendsPairing counts the waiting producer requests other than s that g
// pairs with by base id.
func (st *loopState) sendsPairing(g *regGroup, s *sendReq) int {
	n := 0
	for o := st.sendBase[g.base()]; o != nil; o = o.nextBase {
		if o != s && o.match == nil && !o.done && pairOf(g, o.req.ReqID, o.req.TransferID) != pairNone {
			n++
		}
	}
	return n
}

// findSend finds the waiting P request a new registration pairs with:
// the one it names exactly, else the only one it pairs with by base id,
// if no other waiting registration pairs with that one. taken is the
// request it names exactly when that one is paired already; amb lists
// the requests it pairs with when that is ambiguous (a scratch slice).
func (st *loopState) findSend(g *regGroup) (s, taken *sendReq, amb []*sendReq) {
	name, _ := g.name()
	var x *sendReq
	if g.tid != "" {
		x = st.sendByTID.get(g.tid)
	} else {
		x = st.sends.get(name)
	}
	if x != nil && pairOf(g, x.req.ReqID, x.req.TransferID) == pairExact {
		if x.match != nil || x.done {
			return nil, x, nil
		}
		return x, nil, nil
	}
	if g.tid != "" || !st.pairsByBase() {
		return nil, nil, nil
	}
	amb = st.ambSends[:0]
	for o := st.sendBase[g.base()]; o != nil; o = o.nextBase {
		if o.match == nil && !o.done && pairOf(g, o.req.ReqID, o.req.TransferID) == pairBase {
			amb = append(amb, o)
		}
	}
	st.ambSends = amb
	switch {
	case len(amb) == 0:
		return nil, nil, nil
	case len(amb) > 1 || st.regsPairing(amb[0], g) > 0:
		return nil, nil, amb
	}
	return amb[0], nil, nil
}

// regsPairing counts the waiting registrations other than g that pair
// with s.
func (st *loopState) regsPairing(s *sendReq, g *regGroup) int {
	n := 0
	for _, k := range st.regByBase[BaseRequestID(s.req.ReqID)] {
		if o := st.regs[k]; o != nil && o != g && pairOf(o, s.req.ReqID, s.req.TransferID) != pairNone {
			n++
		}
	}
	return n
}

// namedBy returns the one of several registrations that name producer
// request s's transfer (regs) that names s by its request id too, if
// exactly one does, having failed the others at once: they name another
// producer request, or none (reg_taken), and s is written into that one's
// blocks alone. Else it returns nil (ambiguousSend).
func (st *loopState) namedBy(s *sendReq, regs []*regGroup) *regGroup {
	if s.req.TransferID == "" || pairOf(regs[0], s.req.ReqID, s.req.TransferID) != pairExact {
		return nil
	}
	var named *regGroup
	for _, g := range regs {
		if g.preq == s.req.ReqID {
			if named != nil {
				return nil
			}
			named = g
		}
	}
	if named == nil {
		return nil
	}
	for _, g := range slices.Clone(regs) {
		if g == named {
			continue
		}
		names := fmt.Sprintf("producer request %q", g.preq)
		if g.preq == "" {
			names = "no producer request"
		}
		st.metrics.Dropped("reg_taken")
		st.failRegGroup(g, s.req.ReqID, FailureSetup, fmt.Sprintf(
			"consumer request %q of engine %q registered for transfer %q too, naming its producer request %q; this registration names %s: the producer request is written into that one's blocks",
			named.key.dreq, named.key.engine, s.req.TransferID, s.req.ReqID, names))
	}
	return named
}

// ambiguousSend fails a new producer request that several waiting
// registrations pair with at the same tier (regs): which consumer
// request's blocks are its is not known, and a guess would WRITE one
// request's KV into another's. Registrations that name it exactly fail
// with it, at once: they name nothing else. Before, they waited for their
// consumer's deadline, their blocks held, for a request that had ended
// (TestTwoConsumersNameOneProducerRequest, push, d1 d2 p). Those that
// pair with it by base id keep waiting for the requests they name
// exactly. Counted, logged, and the engine told why.
func (st *loopState) ambiguousSend(s *sendReq, regs []*regGroup) {
	var why string
	if pairOf(regs[0], s.req.ReqID, s.req.TransferID) == pairExact {
		why = fmt.Sprintf("%d consumer requests name producer request %q (transfer id %q): which one it serves is ambiguous, so none is written",
			len(regs), s.req.ReqID, s.req.TransferID)
		for _, g := range slices.Clone(regs) {
			st.metrics.Dropped("reg_ambiguous")
			st.failRegGroup(g, s.req.ReqID, FailureSetup, why)
		}
	} else {
		why = fmt.Sprintf("producer request %q pairs by its base id %q with %d waiting consumer requests, none naming it exactly: ambiguous, so nothing is written (transfer ids pair requests exactly)",
			s.req.ReqID, BaseRequestID(s.req.ReqID), len(regs))
		if len(regs) == 1 {
			why = fmt.Sprintf("producer request %q pairs by its base id %q with consumer request %q, which %d other waiting producer requests pair with too: ambiguous, so nothing is written (transfer ids pair requests exactly)",
				s.req.ReqID, BaseRequestID(s.req.ReqID), regs[0].key.dreq, st.sendsPairing(regs[0], s))
		}
	}
	st.log.Warn("kvxfer: ambiguous pairing refused", "req", s.req.ReqID, "why", why)
	st.metrics.BadInput("send_req.ambiguous")
	st.failPaired(s, why)
}

// ambiguousReg refuses a new registration that pairs by base id with
// several waiting producer requests, or with one that another waiting
// registration pairs with (sends), as ambiguousSend does; the requests
// keep waiting for registrations that name them exactly.
func (st *loopState) ambiguousReg(g *regGroup, sends []*sendReq) {
	n, _ := g.name()
	why := fmt.Sprintf("consumer request %q (naming %q) pairs by base id %q with %d waiting producer requests, naming none exactly: ambiguous, so nothing is written (transfer ids pair requests exactly)",
		g.key.dreq, n, g.base(), len(sends))
	if len(sends) == 1 {
		why = fmt.Sprintf("consumer request %q (naming %q) pairs by base id %q with producer request %q, which %d other waiting consumer requests pair with too: ambiguous, so nothing is written (transfer ids pair requests exactly)",
			g.key.dreq, n, g.base(), sends[0].req.ReqID, st.regsPairing(sends[0], g))
	}
	st.log.Warn("kvxfer: ambiguous pairing refused", "dreq", g.key.dreq, "engine", g.key.engine, "why", why)
	st.metrics.Dropped("reg_ambiguous")
	st.failRegGroup(g, "", FailureSetup, why)
}

// failPaired fails an unmatched producer request whose pairing was
// refused, and remembers it, so a registration that names it later is
// told at once.
func (st *loopState) failPaired(s *sendReq, why string) {
	st.rememberGone(s.req.ReqID, s.req.TransferID, goneSend{at: st.now, why: why, kind: FailureSetup, tid: s.req.TransferID})
	st.failUnmatched(s, FailureSetup, why)
}

// failUnmatched fails a producer request no registration is paired
// with: at once, or, for one still prefilling (layer-wise), when its
// engine finishes it (a request reports once its engine's scheduler
// holds it); meanwhile it pairs with nothing.
func (st *loopState) failUnmatched(s *sendReq, kind FailureKind, why string) {
	s.done = true
	if s.prefill {
		s.doom, s.doomKind = why, kind
		return
	}
	s.failReason, s.failKind = why, kind
	st.report(RoleProducer, Outcome{ReqID: s.req.ReqID, Result: ResultFailed, Kind: kind, Reason: why})
	st.forgetSend(s)
}

// goneSend remembers a producer request that ended before any
// registration paired with it (its engine aborted it, or its pairing was
// refused): a registration naming it later is answered at once.
type goneSend struct {
	at   time.Time
	why  string
	kind FailureKind
	tid  string // its transfer id, if it had one
	// blocks: pull, a digest of the blocks it held (every group it held
	// any in), which a hold question about it names (refuseEndedAsk).
	blocks blocksSum
}

// rememberGone records a gone producer request by id and transfer id,
// at most maxAborted of each: past the bound the oldest are forgotten,
// each counted (ended_limit): a registration naming one waits for its
// TTL instead (push), a late notice of one is kept as an early one
// (pull). Before, past the bound the newest were not remembered, for
// RegistrationTTL (8 minutes): a pull producer rank through which more
// than about 136 requests a second ended (every pull request ends so)
// knew none of the newer ones had ended, and kept every late notice for
// them as an early one.
func (st *loopState) rememberGone(id, tid string, g goneSend) {
	n := st.abortedP.put(id, st.now, g, maxAborted)
	if tid != "" {
		n += st.abortedT.put(tid, st.now, g, maxAborted)
	}
	for range n {
		st.metrics.Dropped("ended_limit")
	}
}

// addReg keeps a registration (or a consumer's give-up) waiting for its
// producer request.
func (st *loopState) addReg(g *regGroup) {
	st.regs[g.key] = g
	st.regIDs += g.ids
	if g.tid != "" {
		st.regByTID[g.tid] = append(st.regByTID[g.tid], g.key)
	}
	st.regByBase[g.base()] = append(st.regByBase[g.base()], g.key)
}

// supersede moves aside the unmatched group waiting under k if it waits
// for another transfer than tid: the consumer's request id was reused
// (an engine's live request ids are unique, so the request it registered
// or released before is over). It waits on, under a key of its own, as a
// give-up of its own transfer: the producer request it names fails when
// it arrives instead of writing into blocks the consumer has since given
// to another request, and the new registration is neither dropped as a
// duplicate of it nor added to it.
func (st *loopState) supersede(k regKey, tid string) {
	g := st.regs[k]
	if g == nil || g.tid == tid {
		return
	}
	st.dropReg(k)
	st.metrics.Dropped("reg_superseded")
	g.key.moved = "\x00" + g.tid
	if g.gaveUp == "" {
		g.gaveUp = fmt.Sprintf("consumer request %q was registered again for another transfer (%q): the request it registered for this one ended", k.dreq, tid)
	}
	clear(g.ranks)
	g.ids = 0
	if st.regs[g.key] == nil {
		st.addReg(g)
	}
}

func (st *loopState) dropReg(k regKey) {
	g := st.regs[k]
	if g == nil {
		return
	}
	delete(st.regs, k)
	st.regIDs -= g.ids
	if g.tid != "" {
		st.regByTID[g.tid] = slices.DeleteFunc(st.regByTID[g.tid], func(x regKey) bool { return x == k })
		if len(st.regByTID[g.tid]) == 0 {
			delete(st.regByTID, g.tid)
		}
	}
	b := g.base()
	st.regByBase[b] = slices.DeleteFunc(st.regByBase[b], func(x regKey) bool { return x == k })
	if len(st.regByBase[b]) == 0 {
		delete(st.regByBase, b)
	}
}

// replayRegs handles the registrations held back while their pair was
// held (sendReq.again), once it ended: a Worker closing drops them.
func (st *loopState) replayRegs() {
	for len(st.regAgain) > 0 {
		ms := st.regAgain
		st.regAgain = nil
		for _, m := range ms {
			if st.closing {
				st.metrics.Dropped("reg_duplicate")
				continue
			}
			st.onReg(m)
		}
	}
}

// onReg handles a D rank's registration (push).
func (st *loopState) onReg(m *msg) {
	if st.cfg.Mode != ModePush {
		// A registration is push's: a consumer rank in push mode
		// registered its blocks with this rank, which runs pull (the
		// engines' modes differ; a handshake does not carry them).
		// Before, it was dropped and nothing told the consumer: it
		// waited for its deadline, then for its fence (FenceTimeout, two
		// leases by default) for a WRITE that never comes, its blocks
		// held, and reported the producer late. Told, it fails at once;
		// nothing of ours was or will be written into its blocks.
		if m.DReq == "" {
			st.metrics.Dropped("reg_in_pull")
			return
		}
		why := fmt.Sprintf("producer engine %s runs in pull mode: it takes no registrations and writes nothing (consumer request %q registered as in push mode): the engines' modes differ",
			st.cfg.EngineID, m.DReq)
		st.refuseReg(m, "reg_in_pull", FailureIncompatible, why)
		if len(m.Spans) > 0 {
			// A push consumer never READs: its rank's registration is its
			// failure notice here too (as a cancel from it is), so that our
			// request of that transfer ends once its consumer ranks all
			// said so, not at its lease. (Its spans are its own blocks, not
			// ours: the notice names none.) An empty registration (a
			// release) reads nothing either, and is the same word.
			n := *m
			n.Kind, n.Spans, n.blocks = msgFail, nil, blocksSum{}
			st.onPullDone(&n, "consumer registered as in push mode: "+why, FailureIncompatible)
		}
		return
	}
	k := regKey{engine: m.Engine, dreq: m.DReq}
	if m.DReq == "" {
		st.metrics.Dropped("reg_without_request")
		return
	}
	// Past its Until the consumer gave the request up and may have freed
	// the blocks (its cancel, and our tombstone of it, may be long gone):
	// such a registration starts nothing. A copy of one we already act
	// on is only a duplicate.
	late := !m.Until.IsZero() && !st.now.Before(m.Until)
	if tb, dead := st.tombs[k]; dead && !tb.names(m.TransferID, m.PReq) {
		// A new request under the id of one that finished: the
		// tombstone is the old one's, and must neither drop this
		// registration nor answer this request's cancel.
		delete(st.tombs, k)
	}
	if tb, dead := st.tombs[k]; dead {
		st.metrics.Dropped("reg_after_finish")
		if len(m.Spans) > 0 {
			// This rank registers after we finished without it (its
			// handshake was late, our failure notice lost): tell it now,
			// so it does not wait for its timeout.
			why, kind := tb.fail, tb.failKind
			if why == "" {
				why, kind = "the producer finished the request before this rank registered", FailureCancelled
			}
			if slices.Contains(tb.done, m.TPRank) {
				// Our WRITE into this rank landed and we told it so: a
				// registration naming that transfer again is a copy its
				// request no longer waits for (it heard our completion
				// first: this notice is nothing to it), or a new request
				// under the same consumer id, transfer id and producer
				// request (a router that reuses transfer ids), which
				// nothing here tells apart from the one we served.
				// Dropped, the new request waited for its deadline and
				// its cancel was answered with the old transfer's
				// completion notice: its consumer reported blocks loaded
				// that nothing wrote.
				why, kind = fmt.Sprintf("transfer %q of consumer request %q (producer request %q) was completed already; "+
					"a registration for it again cannot be told apart from the completed one: give each transfer its own transfer_id",
					m.TransferID, m.DReq, tb.preq), FailureSetup
				// The producer request of that transfer we may hold
				// now, or get later (the new request's, the engine's
				// second under its id), is written to no consumer: its
				// one consumer is failed here. It fails at once, as
				// for a consumer that gave it up, instead of holding
				// its blocks for its lease. Only one we hold is failed
				// where no transfer id names the transfer: a late copy
				// of the finished one's registration (a retransmission)
				// is kept for nothing that only pairs by request id.
				st.giveUpNamed(k, m, kind, why, m.TransferID != "")
			}
			st.sendTo(st.ensureEngine(m.Engine, m.Addr), rankRef{tp: m.TPRank},
				&msg{Kind: msgFail, TransferID: m.TransferID, DReq: m.DReq, PReq: tb.preq, Reason: why, FailKind: kind})
		}
		return
	}
	s := st.matched[k]
	if s != nil && s.match.tid != m.TransferID && len(m.Spans) == 0 && m.TransferID != "" {
		// The release of another transfer under the consumer id paired
		// here (its request under the id, aborted before it was
		// scheduled, needs nothing): it writes nothing, and goes to its
		// own transfer's request, under a key of its own, as a
		// superseded group does: refused, that request would hold its
		// blocks for its whole lease.
		k.moved = "\x00" + m.TransferID
		s = st.matched[k]
	}
	if s != nil {
		if s.match.tid != m.TransferID {
			// The consumer's request id was reused for another transfer
			// while the one it was paired with here is still held: the
			// registration must not join that one's ranks (it would be
			// dropped as a duplicate, or take a rank's place and be
			// written the other transfer's KV).
			st.refuseReg(m, "reg_id_in_use", FailureSetup, fmt.Sprintf(
				"consumer request %q is still paired here with transfer %q (producer request %q); this registration is for transfer %q",
				m.DReq, s.match.tid, s.req.ReqID, m.TransferID))
			return
		}
		if r := s.ranks[m.TPRank]; late && r != nil && r.state == rkWaiting && m.TPSize == s.match.dTP {
			st.metrics.Dropped("reg_expired")
			st.failRank(s, m.TPRank, r, FailureExpired, regLate)
			st.settleSend(s)
			return
		}
		if r := s.ranks[m.TPRank]; r != nil && m.TPSize == s.match.dTP && len(m.Spans) > 0 && r.inflight == 0 &&
			(r.state == rkCancelled || r.state == rkFailed) {
			// This rank registers again after its part of the pairing
			// ended (it cancelled, or we failed it) while the request is
			// still held (a layer-wise request prefills; another rank's
			// WRITE drains): nothing will be written into these blocks;
			// tell it now, as its tombstone would once the request ends,
			// so it does not wait out its deadline.
			st.metrics.Dropped("reg_after_finish")
			why := r.reason
			if r.state == rkCancelled {
				why = fmt.Sprintf("consumer rank %d cancelled: %s", m.TPRank, r.reason)
			}
			st.tellD(s, m.TPRank, &msg{Kind: msgFail, Reason: why, FailKind: r.kind})
			return
		}
		if r := s.ranks[m.TPRank]; r != nil && m.TPSize == s.match.dTP && len(m.Spans) > 0 &&
			(r.state == rkPosted || r.state == rkDone || r.state == rkReleased) {
			// This rank's part may be over at the consumer already: our
			// completion notice may have reached it (it goes with the
			// WRITE, before we see the WRITE end), or it released the
			// request. A registration now is a copy of its first, or a
			// new request under the consumer id, transfer id and
			// producer request (a router that reuses transfer ids, its
			// consumer acting on our notice at once). Dropped as a
			// duplicate, the new request waited for its deadline and
			// our tombstone answered its cancel with this pair's
			// completion notice: blocks reported loaded that nothing
			// wrote. It is handled once the pair ends, as one arriving
			// then is (regAgain): failed, naming the transfer.
			s.again = slices.DeleteFunc(s.again, func(x *msg) bool { return x.TPRank == m.TPRank })
			s.again = append(s.again, m)
			return
		}
		st.addRank(s, m)
		st.pushReady(s)
		return
	}
	st.supersede(k, m.TransferID)
	g := st.regs[k]
	if g == nil && late {
		st.refuseLateReg(m)
		return
	}
	if g == nil && len(st.regs) >= maxRegs {
		// Registrations wait for their request up to RegistrationTTL; peers
		// cannot make us keep more than maxRegs at once.
		st.refuseReg(m, "reg_limit", FailureSetup,
			fmt.Sprintf("the producer rank holds %d registrations waiting for their requests, its limit", len(st.regs)))
		return
	}
	if n := spanIDs(m.Spans); n > 0 && st.regIDs+n > maxRegIDs {
		// Nor more block ids than maxRegIDs in them: each may be as long
		// as a message.
		st.refuseReg(m, "reg_limit", FailureSetup,
			fmt.Sprintf("the producer rank holds %d block ids in registrations waiting for their requests; %d more exceed its limit %d",
				st.regIDs, n, maxRegIDs))
		return
	}
	if g == nil {
		g = &regGroup{key: k, tid: m.TransferID, preq: m.PReq, addr: m.Addr, dTP: m.TPSize, ranks: map[int]*msg{}, arrived: st.now, until: m.Until}
		s, taken, amb := st.findSend(g)
		// A request it names that ended before any registration paired
		// with it is told so, unless a request held now pairs with it
		// exactly (one the engine handed over again under a re-used id).
		gs, _, gone := st.abortedT.get(m.TransferID)
		if !gone && m.TransferID != "" {
			gs, _, gone = st.endedPaired.get("t:" + m.TransferID)
		}
		if n, named := g.name(); !gone && (named || g.tid == "") {
			// By producer request id, unless the request gone under it
			// was another transfer (the id was reused for this one).
			gs, _, gone = st.abortedP.get(n)
			if !gone {
				gs, _, gone = st.endedPaired.get("p:" + n)
			}
			gone = gone && (gs.tid == "" || g.tid == "" || gs.tid == g.tid)
		}
		if gone && (s == nil || pairOf(g, s.req.ReqID, s.req.TransferID) != pairExact) {
			g.ranks[m.TPRank] = m
			st.failRegGroup(g, m.PReq, gs.kind, gs.why)
			return
		}
		switch {
		case s != nil:
			st.attach(s, g)
			st.addRank(s, m)
			st.pushReady(s)
			return
		case taken != nil:
			// It names a request paired with another consumer request:
			// one of the two is not what it claims; the first keeps it.
			g.ranks[m.TPRank] = m
			st.metrics.Dropped("reg_taken")
			why := "the producer request it names has finished"
			if taken.match != nil {
				why = fmt.Sprintf("the producer request it names (%s) is paired with consumer request %q of engine %q already",
					taken.req.ReqID, taken.match.key.dreq, taken.match.key.engine)
			}
			st.failRegGroup(g, taken.req.ReqID, FailureSetup, why)
			return
		case amb != nil:
			g.ranks[m.TPRank] = m
			st.ambiguousReg(g, amb)
			return
		}
		st.addReg(g)
	}
	if g.dTP != m.TPSize {
		st.metrics.BadInput("reg.tp_size")
		return
	}
	if _, dup := g.ranks[m.TPRank]; dup {
		st.metrics.Dropped("reg_duplicate")
		return
	}
	if late {
		st.refuseLateReg(m)
		return
	}
	g.ranks[m.TPRank] = m
	n := spanIDs(m.Spans)
	g.ids += n
	if st.regs[g.key] == g {
		st.regIDs += n
	}
	if !m.Until.IsZero() && (g.until.IsZero() || m.Until.Before(g.until)) {
		g.until = m.Until
	}
}

// maxRegs bounds the registrations a producer rank keeps waiting for
// their requests, and maxRegIDs the block ids in them (64 MiB of ids).
const (
	maxRegs   = 1 << 16
	maxRegIDs = 1 << 24
)

// maxTombs bounds the tombstones (producerState.tombs) a cancel of a
// request the rank does not hold paired makes: one past it is dropped
// (onCancel, counted cancel_limit). Those of the rank's own pairs that
// ended are always kept (their number is bounded by the pairs that end
// within RegistrationTTL: each an engine request and a registration).
const maxTombs = 1 << 16

// checkRegIDs panics when regIDs is not the block ids of the waiting
// registrations (an -tags invariants self-check: the budget must neither
// leak nor be given back twice).
func (st *loopState) checkRegIDs() {
	total := 0
	for _, g := range st.regs {
		n := 0
		for _, m := range g.ranks {
			n += spanIDs(m.Spans)
		}
		if n != g.ids {
			panic(fmt.Sprintf("kvxfer: registration %v counts %d block ids, holds %d", g.key, g.ids, n))
		}
		total += n
	}
	if total != st.regIDs {
		panic(fmt.Sprintf("kvxfer: regIDs = %d, the waiting registrations hold %d", st.regIDs, total))
	}
}

// spanIDs is the number of block ids in spans.
func spanIDs(spans []topology.Span) int {
	n := 0
	for _, sp := range spans {
		n += len(sp.IDs)
	}
	return n
}

// regLate is why a registration past its Until is refused.
const regLate = "the registration reached the producer after the consumer's deadline"

// refuseLateReg drops a registration past its Until that nothing of ours
// acts on yet, telling its rank, in case it still waits.
func (st *loopState) refuseLateReg(m *msg) {
	st.refuseReg(m, "reg_expired", FailureExpired, regLate)
}

// refuseReg drops a registration, counted as dropped, and tells its rank
// why.
func (st *loopState) refuseReg(m *msg, dropped string, kind FailureKind, why string) {
	st.metrics.Dropped(dropped)
	st.sendTo(st.ensureEngine(m.Engine, m.Addr), rankRef{tp: m.TPRank},
		&msg{Kind: msgFail, TransferID: m.TransferID, DReq: m.DReq, PReq: m.PReq, Reason: why, FailKind: kind})
}

// attach matches a P request with a D request's registrations.
func (st *loopState) attach(s *sendReq, g *regGroup) {
	s.match = g
	st.matched[g.key] = s
	s.ranks = map[int]*dRank{}
	var err error
	s.expect, err = topology.TargetRanks(nil, st.layout.TPSize, g.dTP, st.layout.TPRank)
	if err != nil {
		// A D TP size we cannot connect to: fail every rank that
		// registered, and the request.
		for tp, m := range g.ranks {
			s.ranks[tp] = &dRank{state: rkFailed, reg: m, reason: err.Error(), kind: FailureIncompatible}
		}
		s.expect = nil
		for tp := range g.ranks {
			s.expect = append(s.expect, tp)
		}
		slices.Sort(s.expect)
		st.ensureEngine(g.key.engine, g.addr)
		for tp := range g.ranks {
			st.tellD(s, tp, &msg{Kind: msgFail, Reason: err.Error(), FailKind: FailureIncompatible})
		}
		st.settleSend(s)
		return
	}
	for _, tp := range s.expect {
		s.ranks[tp] = &dRank{}
	}
	for _, m := range g.ranks {
		st.addRank(s, m)
	}
	g.ranks, g.ids = nil, 0
}

// addRank records one D rank's registration on a matched request.
func (st *loopState) addRank(s *sendReq, m *msg) {
	r := s.ranks[m.TPRank]
	switch {
	case r == nil:
		st.metrics.BadInput("reg.tp_rank")
		st.log.Warn("kvxfer: registration from a D rank this rank does not serve", "req", s.req.ReqID, "d_tp_rank", m.TPRank)
	case m.TPSize != s.match.dTP:
		st.metrics.BadInput("reg.tp_size")
	case r.state != rkWaiting:
		st.metrics.Dropped("reg_duplicate")
	case len(m.Spans) == 0:
		r.state, r.reg = rkReleased, m
	default:
		r.state, r.reg, r.since = rkReady, m, st.now
		st.refuseTokens(s, m.TPRank, r)
	}
}

// refuseTokens fails D rank tp of matched request s (r, registered) when
// its consumer takes more tokens as loaded than s holds (a router that
// gave it a longer prompt): the WRITE would leave its blocks past our
// tokens as they were, reported loaded. Checked when the rank registers,
// and again when a layer-wise request finishes (its prefill entry gives
// the prompt's tokens, its finish those it holds: fewer by the prefill
// backoff). Counted reg.tokens.
func (st *loopState) refuseTokens(s *sendReq, tp int, r *dRank) {
	m := r.reg
	if m == nil || m.Tokens == 0 || s.req.Tokens == 0 || m.Tokens <= s.req.Tokens || r.state.settled() || r.reason != "" {
		return
	}
	st.metrics.BadInput("reg.tokens")
	st.failRank(s, tp, r, FailureSetup, fmt.Sprintf(
		"consumer request %q takes %d tokens as loaded (its registration's token count), but producer request %q holds %d: "+
			"the prompts differ (the router gave them different requests?); its blocks are not loaded", s.match.key.dreq, m.Tokens, s.req.ReqID, s.req.Tokens))
}

// tellD sends a message about a matched request to one of its D ranks,
// queueing it until the handshake with D is ready.
func (st *loopState) tellD(s *sendReq, tp int, m *msg) {
	m.TransferID, m.DReq, m.PReq = s.match.tid, s.match.key.dreq, s.req.ReqID
	st.sendTo(st.ensureEngine(s.match.key.engine, s.match.addr), rankRef{tp: tp}, m)
}

// pushReady posts what a matched request can post now.
func (st *loopState) pushReady(s *sendReq) {
	if s.match == nil || s.done {
		return
	}
	if s.expired || s.aborted {
		st.settleSend(s)
		return
	}
	if st.wantsPost(s) {
		e := st.ensureEngine(s.match.key.engine, s.match.addr)
		switch e.state {
		case hsPending:
			return
		case hsFailed:
			// Every rank is judged on this failed handshake before any
			// new attempt starts (ownAttempt).
			was := st.redriving
			st.redriving = true
			for _, tp := range s.expect {
				if r := s.ranks[tp]; r.state == rkReady && r.inflight == 0 && st.ownAttempt(e, r.since) {
					st.failRank(s, tp, r, FailureHandshake, "handshake with consumer failed: "+e.err.Error())
				}
			}
			st.redriving = was
			if !was && e.retryWanted {
				st.startHandshake(e)
			}
		case hsReady:
			e.lastActive = st.now
			if err := st.refusal(e, asProducer); err != nil {
				// Refused at handshake: logged once per peer generation
				// (refusal), not per request.
				for _, tp := range s.expect {
					if r := s.ranks[tp]; r.state == rkReady && r.inflight == 0 {
						r.quiet = true
						st.failRank(s, tp, r, FailureIncompatible, err.Error())
					}
				}
				break
			}
			for _, tp := range s.expect {
				if r := s.ranks[tp]; r.state == rkReady || r.state == rkPosted {
					st.postWrite(s, e, tp, r)
				}
			}
		}
	}
	st.settleSend(s)
}

// wantsPost reports whether some ready rank has something to post.
func (st *loopState) wantsPost(s *sendReq) bool {
	if st.closing || s.preempted {
		// Preempted: nothing is written until it is retaken.
		return false
	}
	for _, r := range s.ranks {
		if r.state != rkReady && r.state != rkPosted || r.ackOwed || r.reason != "" {
			// An ackOwed rank cancelled, one with a reason failed (a
			// WRITE into it failed while another was in flight):
			// nothing more goes to it.
			continue
		}
		if !st.cfg.Layerwise {
			if r.state == rkReady {
				return true
			}
			continue
		}
		for li, saved := range s.layersSaved() {
			if saved && (r.posted == nil || !r.posted[li]) {
				return true
			}
		}
		if r.inflight == 0 && !s.prefill {
			return true // every layer posted and landed: send the notice
		}
	}
	return false
}

// layersSaved returns which layers are saved (all once finished).
func (s *sendReq) layersSaved() []bool { return s.saved }

// postWrite builds and posts the WRITEs into one D rank: everything at
// once, or, layer-wise, the saved layers not posted yet, with the
// completion notice sent once the last layer landed.
func (st *loopState) postWrite(s *sendReq, e *engine, tp int, r *dRank) {
	layerwise := st.cfg.Layerwise && s.saved != nil
	if s.preempted {
		// Its blocks were freed: nothing (not even the notice) until it
		// is retaken.
		return
	}
	if r.ackOwed || r.reason != "" {
		// The consumer rank cancelled while a WRITE into it was in
		// flight: its acknowledgement waits only for that one, and no
		// further layer (or notice) goes to blocks it gave up. Or a
		// WRITE into it failed while another was in flight: it fails
		// once that one ends, and no later layer is written meanwhile.
		return
	}
	if r.state == rkPosted && !layerwise {
		// Posted at once: its one WRITE is in flight. Never a second (it
		// could land after D handed its blocks back).
		return
	}
	peer, ok := e.peers[rankRef{tp: tp}]
	if !ok {
		st.failRank(s, tp, r, FailureIncompatible, fmt.Sprintf("consumer engine %s has no rank tp %d", e.id, tp))
		return
	}
	if r.reg != nil && r.reg.from != "" && r.reg.from != peer {
		// The rank that registered these blocks is gone (its engine
		// restarted or re-attached it: another agent speaks for it now);
		// they may hold another request's KV by now.
		st.failRank(s, tp, r, FailurePeerGone, fmt.Sprintf("consumer engine %s rank tp %d restarted after it registered (agent %s, now %s)", e.id, tp, r.reg.from, peer))
		return
	}
	p, err := st.plan(e, rankRef{tp: st.layout.TPRank, pp: st.layout.PPRank}, tp)
	if err != nil {
		st.failRank(s, tp, r, FailureIncompatible, err.Error())
		return
	}
	done := appendMsg(nil, st.self(&msg{Kind: msgDone, TransferID: s.match.tid, DReq: s.match.key.dreq, PReq: s.req.ReqID}))
	if layerwise && r.posted == nil {
		r.posted = make([]bool, st.nLayers)
	}
	// Which layers go now.
	mask := st.layerMask
	any := false
	for li := range mask {
		mask[li] = !layerwise || (s.saved[li] && !r.posted[li])
		any = any || mask[li]
	}
	if p.NotifyOnly || !any {
		if layerwise && (s.prefill || r.inflight > 0 || slices.Contains(r.posted, false) && !p.NotifyOnly) {
			return // more layers to come, or still landing
		}
		st.sendCompletion(s, tp, r, peer, done)
		return
	}
	req := hotpath.Request{Tokens: s.req.Tokens, Src: s.req.Blocks, Dst: r.reg.Spans}
	// This request's lists must hold every token it says it holds that
	// the consumer's blocks take: the WRITE moves what both lists hold,
	// and the consumer's blocks past a short list would be reported
	// loaded.
	if err := hotpath.CheckCovered(p, &req); err != nil {
		st.metrics.BadInput("send_req.blocks")
		st.failRank(s, tp, r, FailureSetup, "blocks rejected: "+err.Error())
		return
	}
	if st.prepare && !layerwise {
		id, n, bytes, err := st.postPrepared(e, planKey(e, rankRef{tp: st.layout.TPRank, pp: st.layout.PPRank}, tp), p, rankRef{tp: tp}, &req, done)
		if err != nil {
			if errors.Is(err, hotpath.ErrInvalidRequest) {
				st.metrics.BadInput("reg.spans")
				st.failRank(s, tp, r, FailureSetup, "registration rejected: "+err.Error())
				return
			}
			st.metrics.FailedTransfer()
			st.failRank(s, tp, r, FailureSetup, "post WRITE: "+err.Error())
			return
		}
		r.state = rkPosted
		r.inflight++
		st.handles[id] = &handle{id: id, posted: st.now, bytes: bytes, descs: n, blocks: spanBlocks(s.req.Blocks), send: s.req.ReqID, dtp: tp}
		return
	}
	if st.layouts && !layerwise {
		// As layouts: a base pair per layer, an entry per run of blocks.
		from := len(st.fx.lays.Spans)
		if err := st.builder.AppendLayouts(&st.fx.lays, p, &req); err != nil {
			st.metrics.BadInput("reg.spans")
			st.failRank(s, tp, r, FailureSetup, "registration rejected: "+err.Error())
			return
		}
		n, bytes := st.fx.lays.Pieces(st.fx.lays.Spans[from:])
		id := st.postLayoutOp(hotpath.OpWrite, peer, from, done)
		r.state = rkPosted
		r.inflight++
		st.handles[id] = &handle{id: id, posted: st.now, bytes: bytes, descs: n, blocks: spanBlocks(s.req.Blocks), send: s.req.ReqID, dtp: tp}
		return
	}
	from := len(st.fx.descs)
	st.fx.descs, err = st.builder.AppendDescs(st.fx.descs, p, &req)
	if err != nil {
		st.fx.descs = st.fx.descs[:from]
		st.metrics.BadInput("reg.spans")
		st.failRank(s, tp, r, FailureSetup, "registration rejected: "+err.Error())
		return
	}
	descs := st.fx.descs[from:]
	notif := done
	if layerwise {
		// The notice follows the last layer, bare; each layer's WRITE
		// names its request, for the consumer's grants.
		notif = appendMsg(nil, st.self(&msg{Kind: msgTag, TransferID: s.match.tid, DReq: s.match.key.dreq, PReq: s.req.ReqID}))
		kept := descs[:0]
		for _, d := range descs {
			if mask[st.layerIndexOf(d.Local)] {
				kept = append(kept, d)
			}
		}
		descs = kept
		st.fx.descs = st.fx.descs[:from+len(kept)]
		for li := range mask {
			r.posted[li] = r.posted[li] || mask[li]
		}
		if len(descs) == 0 {
			r.state = rkPosted
			st.pushLayerDone(s, tp, r)
			return
		}
	}
	id := st.postOp(hotpath.OpWrite, peer, from, notif)
	r.state = rkPosted
	r.inflight++
	st.handles[id] = &handle{id: id, posted: st.now, bytes: descBytes(descs), descs: len(descs),
		blocks: spanBlocks(s.req.Blocks), send: s.req.ReqID, dtp: tp}
}

// sendCompletion sends a D rank the completion notice of a request with
// nothing (more) to WRITE; the notice counts as in flight until the
// driver says it went (completionSent).
func (st *loopState) sendCompletion(s *sendReq, tp int, r *dRank, peer PeerName, done []byte) {
	r.state = rkPosted
	r.inflight++
	st.notifyOp(peer, done, noticeDone, s.req.ReqID, tp, nil)
}

// completionSent: the completion notice of send request id to D rank tp
// went, or failed; the rank is done, or fails, once nothing else of it
// is in flight.
func (st *loopState) completionSent(id string, tp int, err error) {
	s := st.sends.get(id)
	if s == nil || s.ranks == nil {
		return
	}
	r := s.ranks[tp]
	if r == nil || r.inflight == 0 {
		return
	}
	if err != nil {
		st.metrics.FailedNotification()
		if r.reason == "" {
			r.reason, r.kind = "completion notice: "+err.Error(), FailureNotification
		}
	}
	r.inflight--
	if r.inflight > 0 {
		return
	}
	if r.reason != "" {
		r.state = rkFailed
		st.failRank(s, tp, r, r.kind, r.reason)
	} else {
		r.state = rkDone
	}
	st.answerAckOwed(s, tp, r)
	st.settleSend(s)
}

// pushLayerDone sends a layer-wise rank's completion notice once every
// layer was posted and landed.
func (st *loopState) pushLayerDone(s *sendReq, tp int, r *dRank) {
	if r.inflight > 0 || s.prefill || s.preempted || s.aborted || slices.Contains(r.posted, false) {
		// Aborted: its engine freed its blocks before the abort reached
		// us, so a WRITE that was in flight may have read another
		// request's KV; the consumer is told it failed (settleSend).
		return
	}
	e := st.engines[s.match.key.engine]
	if e == nil || e.state != hsReady {
		return
	}
	done := appendMsg(nil, st.self(&msg{Kind: msgDone, TransferID: s.match.tid, DReq: s.match.key.dreq, PReq: s.req.ReqID}))
	st.sendCompletion(s, tp, r, e.peers[rankRef{tp: tp}], done)
}

func descBytes(d []hotpath.Desc) int64 {
	var n int64
	for i := range d {
		n += int64(d[i].Len)
	}
	return n
}

func spanBlocks(spans []topology.Span) int {
	n := 0
	for _, s := range spans {
		n += len(s.IDs)
	}
	return n
}

// failRank fails one D rank and tells D at once — once nothing of ours
// is in flight into it (until then the reason waits).
func (st *loopState) failRank(s *sendReq, tp int, r *dRank, kind FailureKind, reason string) {
	if r.reason == "" {
		r.reason, r.kind = reason, kind
	}
	if r.inflight > 0 {
		return
	}
	r.state = rkFailed
	if !r.quiet {
		st.log.Warn("kvxfer: transfer failure", "failure_type", r.kind.String(), "side", "producer", "request_id", s.req.ReqID,
			"engine_id", st.cfg.EngineID, "remote_engine_id", s.match.key.engine, "remote_request_id", s.match.key.dreq,
			"d_tp_rank", tp, "num_local_blocks", spanBlocks(s.req.Blocks), "reason", r.reason)
	}
	st.tellD(s, tp, &msg{Kind: msgFail, Reason: r.reason, FailKind: r.kind})
}

// sendSettled handles the end of one of a producer's WRITEs.
func (st *loopState) sendSettled(h *handle, ok bool, err error) {
	s := st.sends.get(h.send)
	if s == nil || s.ranks == nil {
		return
	}
	r := s.ranks[h.dtp]
	if r == nil || r.inflight == 0 {
		return
	}
	r.inflight--
	if !ok && r.reason == "" {
		r.reason, r.kind = "WRITE failed: "+err.Error(), FailureTransfer
	}
	if r.inflight > 0 {
		return
	}
	switch {
	case r.reason != "":
		r.state = rkFailed
		st.failRank(s, h.dtp, r, r.kind, r.reason)
	case st.cfg.Layerwise && r.posted != nil && r.ackOwed:
		// Cancelled meanwhile: no more layers; answerAckOwed settles it.
	case st.cfg.Layerwise && r.posted != nil:
		st.pushLayerDone(s, h.dtp, r)
		if r.state == rkPosted && !s.expired && !s.aborted {
			st.pushReady(s) // layers saved meanwhile
		}
	default:
		r.state = rkDone
	}
	if s.preempted {
		// A WRITE of an earlier attempt ended (whatever became of its
		// rank): once none is in flight to any rank, every layer goes
		// again.
		st.retake(s)
	}
	st.answerAckOwed(s, h.dtp, r)
	st.settleSend(s)
}

// answerAckOwed answers a D rank's cancel that waited for our WRITEs to
// it to end, once none is in flight.
func (st *loopState) answerAckOwed(s *sendReq, tp int, r *dRank) {
	if r.ackOwed && r.inflight == 0 {
		r.ackOwed = false
		if r.state == rkPosted {
			r.state, r.reason, r.kind = rkCancelled, "consumer cancelled", FailureCancelled
		}
		st.tellD(s, tp, &msg{Kind: msgAck})
	}
}

// settleSend reports a producer request once its outcome is decided and
// nothing of it is in flight (fencing: a WRITE in flight still reads our
// blocks, so an expired lease waits for it).
func (st *loopState) settleSend(s *sendReq) {
	if s.done || st.cfg.Mode == ModePull || s.prefill {
		// A prefilling request reports once the engine finishes it (its
		// SendReq or abort), so the engine's scheduler holds it first.
		return
	}
	if s.match == nil && !s.expired && !s.aborted {
		return
	}
	anyFailed, allSettled := false, true
	for _, tp := range s.expect {
		r := s.ranks[tp]
		if r.inflight > 0 {
			return // fencing: a WRITE still reads our blocks
		}
		if r.state == rkPosted && !s.expired && !s.aborted {
			return // layer-wise: more layers to come
		}
		anyFailed = anyFailed || r.state == rkFailed || r.state == rkCancelled
		allSettled = allSettled && r.state.settled()
	}
	if !allSettled && !anyFailed && !s.expired && !s.aborted {
		return
	}
	o := Outcome{ReqID: s.req.ReqID, Result: ResultDone}
	why, whyKind := "producer lease expired", FailureExpired
	switch {
	case s.aborted && s.failReason != "":
		// Its finish was refused (rejectEntry): it fails.
		why, whyKind = s.failReason, s.failKind
	case s.aborted:
		why, whyKind = "producer aborted", FailureCancelled
	case !s.expired:
		why, whyKind = "another consumer rank failed", FailureCancelled
	}
	for _, tp := range s.expect {
		r := s.ranks[tp]
		switch r.state {
		case rkFailed:
			if o.Result == ResultDone {
				o.Result, o.Kind, o.Reason = ResultFailed, r.kind, fmt.Sprintf("consumer rank %d: %s", tp, r.reason)
			}
		case rkCancelled:
			if o.Result == ResultDone {
				o.Result, o.Kind, o.Reason = ResultFailed, FailureCancelled, fmt.Sprintf("consumer rank %d cancelled: %s", tp, r.reason)
			}
		case rkWaiting, rkReady, rkPosted:
			// Never (fully) posted, and never will be: tell the D rank now.
			r.state, r.reason, r.kind = rkFailed, why, whyKind
			st.tellD(s, tp, &msg{Kind: msgFail, Reason: why, FailKind: whyKind})
		}
	}
	switch {
	case s.aborted && s.failReason != "":
		o.Result, o.Kind, o.Reason = ResultFailed, s.failKind, why
	case s.aborted:
		o.Result, o.Kind, o.Reason = ResultAborted, FailureNone, why
	case s.expired && !allSettledOK(s):
		o.Result, o.Kind, o.Reason = ResultExpired, FailureExpired, why
		st.metrics.ExpiredRequest()
	}
	s.done = true
	if o.Result != ResultDone {
		s.failReason, s.failKind = o.Reason, o.Kind
		if s.failKind == FailureNone {
			s.failKind = FailureCancelled // aborted by its engine
		}
	}
	st.report(RoleProducer, o)
	st.forgetSend(s)
}

func allSettledOK(s *sendReq) bool {
	if s.match == nil {
		return false
	}
	for _, tp := range s.expect {
		if st := s.ranks[tp].state; st != rkDone && st != rkReleased {
			return false
		}
	}
	return true
}

// forgetSend drops every trace of a finished producer request, keeping a
// tombstone for its D request so late duplicates are dropped.
func (st *loopState) forgetSend(s *sendReq) {
	st.sends.remove(s, s.hID)
	if st.guarded && st.cfg.Mode == ModePull {
		st.holdOp(s.req.Blocks, -1, s.req.ReqID, s.req.TransferID)
	}
	if s.saved != nil {
		ids := slices.DeleteFunc(st.layerSteps[s.step], func(id string) bool { return id == s.req.ReqID })
		if len(ids) == 0 {
			delete(st.layerSteps, s.step)
		} else {
			st.layerSteps[s.step] = ids
		}
	}
	if s.byTID {
		st.sendByTID.remove(s, s.hTID)
		s.byTID = false
	}
	if s.inBase {
		prev, next := s.prevBase, s.nextBase
		switch {
		case prev != nil:
			prev.nextBase = next
		case next != nil:
			st.sendBase[BaseRequestID(s.req.ReqID)] = next
		default:
			delete(st.sendBase, BaseRequestID(s.req.ReqID))
		}
		if next != nil {
			next.prevBase = prev
		}
		s.prevBase, s.nextBase, s.inBase = nil, nil, false
	}
	if st.cfg.Mode == ModePull {
		// A consumer's notice that comes later (it read after the
		// lease, or another consumer request's notices ended it) is
		// known as late (onPullDone), not kept as an early one.
		// (And a hold question that comes later is answered at once
		// that it is not held, and why: refuseEndedAsk.)
		why := "it ended"
		switch {
		case s.aborted:
			why = "its engine aborted it"
		case s.pullEnded && s.pullFail == "":
			why = "its consumer read it"
		case s.pullEnded:
			why = "its consumer failed it"
		case s.expired:
			why = "its lease expired"
		}
		st.rememberGone(s.req.ReqID, s.req.TransferID, goneSend{at: st.now, why: why, tid: s.req.TransferID, blocks: spansSum(s.req.Blocks)})
	}
	if s.match == nil && s.failReason != "" && st.cfg.Mode == ModePush {
		// It ended (expired, aborted, failed) before any registration
		// paired with it: one that comes for it later is told at once,
		// instead of waiting for the consumer's deadline.
		st.rememberGone(s.req.ReqID, s.req.TransferID, goneSend{at: st.now, why: s.failReason, kind: s.failKind, tid: s.req.TransferID})
	}
	if s.match != nil && st.cfg.Mode == ModePush {
		st.rememberPaired(s)
	}
	if s.match != nil {
		delete(st.matched, s.match.key)
		tb := tomb{at: st.now, tid: s.match.tid, preq: s.req.ReqID, fail: s.failReason, failKind: s.failKind}
		for _, tp := range s.expect {
			if s.ranks[tp].state == rkDone {
				tb.done = append(tb.done, tp)
			}
		}
		st.tombs[s.match.key] = tb
		// Registrations that came while it was held, after a rank's part
		// may have ended at the consumer: handled now, against the
		// tombstone, at the end of the input (replayRegs).
		st.regAgain = append(st.regAgain, s.again...)
		s.again = nil
	}
	for _, r := range s.ranks {
		if r.inflight != 0 {
			panic("kvxfer: forgetSend with a WRITE in flight")
		}
	}
	if s.dead {
		panic("kvxfer: forgetSend twice for " + s.req.ReqID)
	}
	s.dead = true
	st.deadSends = append(st.deadSends, s)
	if p := s.next; p != nil {
		s.next = nil
		if st.closing {
			// Nothing new is held once the Worker closes.
			st.report(RoleProducer, Outcome{ReqID: p.req.ReqID, Result: ResultFailed, Kind: FailureClosed, Reason: "worker closed"})
			return
		}
		st.promote(p)
	}
}

// leaseTimer expires a producer request whose lease ran out.
func (st *loopState) leaseTimer(e timerEntry) {
	s := st.sends.get(e.id)
	if s == nil || s.done || !s.deadline.Equal(e.at) {
		return // stale entry: finished or extended
	}
	s.expired = true
	if st.log.Enabled(context.Background(), slog.LevelInfo) { // its arguments are an allocation
		st.log.Info("kvxfer: producer lease expired", "req", s.req.ReqID)
	}
	if st.cfg.Mode == ModePull {
		st.settlePull(s)
		return
	}
	st.settleSend(s)
}

// onHeartbeat extends the leases a consumer still wants (SPEC §9), by the
// max of the old deadline and now + Lease·2/3.
func (st *loopState) onHeartbeat(m *msg) {
	ext := st.now.Add(st.cfg.Lease * 2 / 3)
	// A pull consumer that asks is answered with the deadline each
	// request it names is held to now (msgHold), so that it bounds its
	// READs by the hold the heartbeats keep, not by the params' first
	// expiry.
	var ans *msg
	if m.Reason == hbAskHold && st.cfg.Mode == ModePull {
		ans = &msg{Kind: msgHold}
	}
	for i := 0; i+2 < len(m.IDs); i += 3 {
		tid, preq, dreq := m.IDs[i], m.IDs[i+1], m.IDs[i+2]
		// As a completion notice finds its request (sendFor): by transfer
		// id, else by the producer request id, never one that carries
		// another transfer id.
		s := st.sendFor(tid, preq)
		if s == nil && dreq != "" {
			// By the consumer request it was paired with, only when the
			// heartbeat is of that pairing's transfer: a consumer request
			// id is used again for another transfer once its request
			// ended, and a heartbeat of the earlier one, sent before it
			// ended, extended the lease of the request paired with the
			// new one (held then for a consumer that may be gone).
			if c := st.matched[regKey{engine: m.Engine, dreq: dreq}]; c != nil && namesTransfer(c.match.tid, c.req.ReqID, tid, preq) {
				s = c
			}
		}
		if s == nil && ans != nil && (len(m.Spans) > 0 || m.blocks.mask != 0) && len(m.IDs) == 3 {
			// A consumer's hold check asks before our engine handed us
			// the request (its step not applied yet): answered when it
			// is (replayAsks), not at the consumer's next ask. One about
			// a request that ended here, in its very blocks, is answered
			// at once that it is not held (refuseEndedAsk).
			if g, at, ended := st.pullEnded(tid, preq); ended && g.blocks == m.blocksOf() {
				st.refuseEndedAsk(m, tid, preq, dreq, g, at)
				continue
			}
			st.stashAsk(m)
			continue
		}
		if s == nil || s.done || s.expired || s.prefill {
			// A request still prefilling (layer-wise) has no lease to
			// extend: it starts at its finish, and one started here
			// would lapse mid-prefill if the heartbeats paused. Nor is
			// it answered: no deadline holds its blocks yet.
			continue
		}
		if _, seen := s.pullSeen[pullRank{engine: m.Engine, dreq: dreq, tpSize: m.TPSize, tp: m.TPRank}]; seen {
			// From a consumer rank that already said it read the request
			// (or gave up on it): sent before its notice, delivered after.
			// It reads no more. Before, it extended the hold by
			// Lease·2/3 all the same, and where the request's other
			// consumer ranks were gone without a word, P held the blocks
			// that much longer for nobody.
			st.metrics.Dropped("heartbeat_after_done")
			continue
		}
		if ans != nil && !heldIn(m, s) {
			// Asked about other blocks than the request's: the asker's
			// params are an earlier producer's, which held a request
			// under these names in those blocks. Neither held for it
			// nor listed.
			st.metrics.Dropped("hold_other_blocks")
			continue
		}
		s.hbBy, s.hbAt = pullRank{engine: m.Engine, dreq: dreq, tpSize: m.TPSize, tp: m.TPRank}, st.now
		if ext.After(s.deadline) {
			s.deadline = ext
			st.arm(ext, tLease, s.req.ReqID)
		}
		if ans != nil && !s.aborted {
			ans.IDs = append(ans.IDs, tid, preq, dreq)
			ans.Holds = append(ans.Holds, s.deadline)
		}
	}
	if ans != nil && len(ans.Holds) > 0 {
		st.notify(m.from, ans)
	}
	// Heartbeats also keep unmatched registrations of that engine alive.
}

// onCancel: a D rank gives up on a request (push).
func (st *loopState) onCancel(m *msg) {
	k := regKey{engine: m.Engine, dreq: m.DReq}
	s := st.matched[k]
	if s != nil && m.TransferID != "" && s.match.tid != m.TransferID {
		// A cancel of another transfer under the consumer id paired here
		// (its registration refused as reg_id_in_use at another rank of
		// ours, the consumer gave up; or it was released): it is that
		// transfer's, under a key of its own as its release's is (onReg).
		// Taken as the paired request's, it cancelled that one's rank,
		// and the request of its own transfer held its blocks for its
		// whole lease.
		k.moved = "\x00" + m.TransferID
		s = st.matched[k]
	}
	if s == nil {
		// Unmatched or unknown: nothing of ours can be in flight. Drop
		// its registration, remember it, and confirm — with the
		// completion notice again when our WRITE into that rank landed.
		tb, had := st.tombs[k]
		if !had && len(st.tombs) >= maxTombs {
			// A tombstone more, made by a peer's word alone: past the
			// bound the cancel is dropped as a lost one would be, its
			// rank sending it again at each tick until its fence's
			// timeout (and handled once tombstones lapsed). Before, a
			// consumer that cancelled ever new requests grew the
			// tombstones without bound for RegistrationTTL.
			st.metrics.Dropped("cancel_limit")
			st.log.Debug("kvxfer: dropped a cancel: too many tombstones", "engine", m.Engine, "d_req", m.DReq, "limit", maxTombs)
			return
		}
		if had && !tb.names(m.TransferID, m.PReq) {
			// The tombstone is of an earlier request under this id:
			// nothing of ours landed for this one.
			tb, had = tomb{}, false
		}
		if g := st.regs[k]; !had || g == nil || g.gaveUp == "" || g.tid != m.TransferID {
			// A give-up of this request already waiting (another of
			// its consumer's ranks cancelled first, or this one
			// retried) stays: it fails the producer request when that
			// comes. Dropped, the request held its blocks for its
			// whole lease (a consumer of more ranks than ours whose
			// handshake refused the pair).
			st.dropReg(k)
		}
		if !had {
			st.tombs[k] = tomb{at: st.now, tid: m.TransferID, preq: m.PReq}
		}
		e := st.ensureEngine(m.Engine, m.Addr)
		ack := &msg{Kind: msgAck, TransferID: m.TransferID, DReq: m.DReq, PReq: m.PReq}
		if slices.Contains(tb.done, m.TPRank) {
			ack = &msg{Kind: msgDone, TransferID: tb.tid, DReq: m.DReq, PReq: tb.preq}
		}
		st.sendTo(e, rankRef{tp: m.TPRank}, ack)
		switch {
		case !had:
			st.consumerGaveUp(k, m)
		case st.regs[k] == nil:
			// Also after a tombstone that names it: a cancel of the
			// request that ended, which asks for its completion notice
			// again, or of a new request under its ids (a consumer that
			// refused it, reusedTransfer): the producer request of that
			// transfer we hold now, or get later, would be the new
			// one's, and is written to no consumer. Kept waiting (as
			// long as registrations: RegistrationTTL) only where a
			// transfer id names it: a give-up by request id alone may
			// pair by base id with an unrelated later request.
			st.giveUpNamed(k, m, FailureCancelled, "consumer gave up: "+m.Reason, m.TransferID != "")
		}
		return
	}
	r := s.ranks[m.TPRank]
	if r == nil {
		st.metrics.BadInput("cancel.tp_rank")
		return
	}
	if r.inflight > 0 {
		r.ackOwed = true // answered when the WRITEs end
		return
	}
	switch r.state {
	case rkWaiting, rkReady, rkPosted:
		r.state, r.reason, r.kind = rkCancelled, m.Reason, FailureCancelled
	}
	st.tellD(s, m.TPRank, &msg{Kind: msgAck})
	st.settleSend(s)
}

// consumerGaveUp: a consumer cancelled a request it never registered (its
// handshake with us was refused, say): the producer request it names
// fails at once instead of waiting for its lease; one still prefilling
// (layer-wise) fails when its engine finishes it; one we do not hold yet
// fails when it arrives: the give-up waits for it among the
// registrations (bounded by maxRegs and RegistrationTTL like them).
// Which request it names is decided as for a registration (pairOf):
// exactly, or by base id only where that is not ambiguous.
func (st *loopState) consumerGaveUp(k regKey, m *msg) {
	st.giveUpNamed(k, m, FailureCancelled, "consumer gave up: "+m.Reason, true)
}

// giveUpNamed fails the producer request that m, a consumer's message
// under key k, names (as consumerGaveUp), with kind and why: at once if
// held, else, if wait, when it arrives (unless a give-up of it waits
// already). Without wait only a request it names exactly is failed.
func (st *loopState) giveUpNamed(k regKey, m *msg, kind FailureKind, why string, wait bool) {
	if g := st.regs[k]; g != nil && g.gaveUp != "" && g.tid == m.TransferID {
		return
	}
	g := &regGroup{key: k, tid: m.TransferID, preq: m.PReq, addr: m.Addr,
		ranks: map[int]*msg{}, arrived: st.now, gaveUp: why, gaveUpKind: kind}
	if !wait {
		if s, _, _ := st.findSend(g); s != nil && pairOf(g, s.req.ReqID, s.req.TransferID) == pairExact {
			st.failUnmatched(s, kind, why)
		}
		return
	}
	st.supersede(k, m.TransferID)
	s, _, amb := st.findSend(g)
	switch {
	case s != nil:
		st.failUnmatched(s, kind, why)
	case amb != nil:
		st.metrics.Dropped("cancel_ambiguous")
	case len(st.regs) >= maxRegs:
		st.metrics.Dropped("reg_limit")
	default:
		st.addReg(g)
	}
}

// rememberPaired remembers push request s, which ended paired: a
// registration of another consumer request naming it (a router that
// handed its params to a second consumer, or retried one under a new id)
// is told at once that it ended, as while it was held (findSend's taken):
// before, it waited for its request until the consumer's deadline, its
// blocks held, for KV this rank no longer holds. (Its own consumer's late
// registrations meet its tombstone first.) Kept apart from the requests
// gone unpaired (abortedP and abortedT): every request ends so, and they
// must not crowd those out; the oldest are forgotten first.
func (st *loopState) rememberPaired(s *sendReq) {
	g := goneSend{at: st.now, kind: FailureSetup, tid: s.req.TransferID,
		why: fmt.Sprintf("the producer request it names (%s) was paired with consumer request %q of engine %q, and has ended",
			s.req.ReqID, s.match.key.dreq, s.match.key.engine)}
	st.endedPaired.put("p:"+s.req.ReqID, st.now, g, maxEndedPaired)
	if g.tid != "" {
		st.endedPaired.put("t:"+g.tid, st.now, g, maxEndedPaired)
	}
}

// maxAborted bounds the aborted producer requests remembered by id and by
// transfer id (producerAborted).
const maxAborted = 1 << 16

// maxEndedPaired bounds the entries of producerState.endedPaired (two a
// request with a transfer id).
const maxEndedPaired = 1 << 17

// producerAborted handles a producer request the engine aborted after it
// was scheduled: nothing will be sent, so matched consumers are told.
func (st *loopState) producerAborted(id, tid string) {
	s := st.sends.get(id)
	if s != nil && s.aborted && s.next != nil {
		// The new request under its id, waiting for that one to drain, is
		// the one aborted: never held, it ends now, and registrations
		// waiting for it are told as for any request aborted unheld.
		s.next = nil
		st.report(RoleProducer, Outcome{ReqID: id, Result: ResultAborted, Reason: "producer aborted"})
		s = nil
	}
	if s != nil && otherTID(s, tid) {
		// Of another transfer: the abort is of another request under its
		// id (the id used again while this one's consumer still reads or
		// registers), one never held here. Before, it ended this request:
		// reported aborted, cut short under its consumer's READs or
		// WRITEs. An abort that names no transfer, or this one, ends this
		// request even when held from its finish: its engine says its
		// blocks are free (StepMeta.NotProcessed), and reading or writing
		// them on would move another request's KV.
		s = nil
	}
	if s != nil {
		if s.doom != "" {
			// Its pairing failed while it prefilled: it ends now.
			s.prefill = false
			st.report(RoleProducer, Outcome{ReqID: id, Result: ResultAborted, Reason: "producer aborted"})
			st.forgetSend(s)
			return
		}
		s.aborted, s.prefill = true, false
		if st.cfg.Mode == ModePull {
			st.settlePull(s)
		} else {
			st.settleSend(s)
		}
		return
	}
	if st.cfg.Mode != ModePush {
		return
	}
	// Remembered for RegistrationTTL, so a registration arriving later is
	// answered at once; the engine names these ids, so they are bounded
	// (past the bound such a registration waits for its TTL instead).
	const why = "producer aborted the request"
	st.rememberGone(id, tid, goneSend{at: st.now, why: why, kind: FailureCancelled, tid: tid})
	// Every registration that names it exactly is told; one that pairs
	// with it only by base id is told only if it pairs with nothing else.
	var cands []regKey
	if tid != "" {
		cands = st.regByTID[tid]
	} else {
		cands = st.regByBase[BaseRequestID(id)]
	}
	var exact, base []*regGroup
	for _, k := range cands {
		g := st.regs[k]
		p := pairOf(g, id, tid)
		if tid == "" && g.tid != "" && g.preq == id {
			// The engine names the aborted request by its id alone: a
			// registration that names that id is its, whatever its
			// transfer id.
			p = pairExact
		}
		switch p {
		case pairExact:
			exact = append(exact, g)
		case pairBase:
			base = append(base, g)
		}
	}
	if len(exact) == 0 && len(base) == 1 && st.pairsByBase() && st.sendsPairing(base[0], nil) == 0 {
		exact = base
	}
	for _, g := range exact {
		if g.gaveUp == "" {
			st.failRegGroup(g, id, FailureCancelled, why)
		} else {
			st.dropReg(g.key)
		}
	}
}

// failRegGroup answers an unmatched registration with a failure notice to
// each D rank that sent it, and forgets it.
func (st *loopState) failRegGroup(g *regGroup, pid string, kind FailureKind, reason string) {
	k := g.key
	st.dropReg(k)
	st.tombs[k] = tomb{at: st.now, tid: g.tid, preq: g.preq}
	e := st.ensureEngine(k.engine, g.addr)
	for _, tp := range slices.Sorted(maps.Keys(g.ranks)) {
		st.sendTo(e, rankRef{tp: tp}, &msg{Kind: msgFail, TransferID: g.tid, DReq: k.dreq, PReq: pid, Reason: reason, FailKind: kind})
	}
}

// Pull producer: D ranks report with msgDone (or msgFail) after reading.

func (st *loopState) onPullDone(m *msg, failReason string, failKind FailureKind) {
	if !st.pullNoticeFromReader(m) {
		return
	}
	s := st.pullSendFor(m)
	if s == nil && st.pullEndedFor(m) {
		st.metrics.Dropped("done_after_end")
		st.log.Debug("kvxfer: consumer's notice after its producer request ended", "kind", m.Kind,
			"p_req", m.PReq, "transfer_id", m.TransferID, "engine", m.Engine, "d_req", m.DReq)
		return
	}
	if s == nil {
		// The consumer may read before our engine hands us the request
		// (its params reach D first): keep the notice for a while.
		st.stashEarly(m)
		return
	}
	if !heldIn(m, s) {
		// A notice naming other blocks (a consumer's hold check that
		// failed) is about a request an earlier producer held under these
		// names, not this one: it does not end this one.
		st.metrics.Dropped("notice_other_blocks")
		st.log.Debug("kvxfer: consumer's notice names other blocks than the request's", "kind", m.Kind,
			"p_req", m.PReq, "transfer_id", m.TransferID, "engine", m.Engine, "d_req", m.DReq)
		return
	}
	k := pullRank{engine: m.Engine, dreq: m.DReq, tpSize: m.TPSize, tp: m.TPRank}
	if _, seen := s.pullSeen[k]; seen {
		st.metrics.Dropped("done_duplicate")
		return
	}
	if !s.pullReader(k) && s.pullReaders() >= maxPullReaders {
		// A consumer naming ever new requests (or engines) for one of
		// ours would grow what it keeps without bound: past a few
		// readers, a new one is refused (and not waited for).
		st.metrics.BadInput("done.readers")
		st.log.Warn("kvxfer: refused a completion notice from one consumer request too many for a pull request",
			"req", s.req.ReqID, "engine", m.Engine, "d_req", m.DReq, "limit", maxPullReaders)
		return
	}
	if s.pullSeen == nil {
		s.pullSeen = map[pullRank]pullNote{}
	}
	if m.Kind != msgDone && failReason == "" {
		// A failure notice (or a cancel) that gives no reason still
		// fails: an empty reason read as none, and the request was
		// reported done without a READ.
		st.metrics.BadInput("fail.reason")
		failReason = "failed (its notice gives no reason)"
	}
	note := pullNote{}
	if failReason != "" {
		note = pullNote{fail: fmt.Sprintf("consumer rank %d: %s", m.TPRank, failReason), kind: failKind}
	}
	s.pullSeen[k] = note
	// The ranks of one consumer request (of one engine) count together,
	// never with another's, and the request ends once every consumer
	// request that reported on it has heard from all its ranks that read
	// from ours: a request read by two (a router that handed its params
	// to two engines, or retried the consumer request) is let go only
	// when neither reads any more, or at its lease. Before, one engine's
	// rank 0 and the other's rank 1 ended it while the other two ranks
	// still read its blocks, and a second consumer request's notices on
	// one engine were dropped as duplicates of the first's. Its outcome
	// is done when one consumer request's ranks all read it, else its
	// lowest failed rank's.
	st.pullEnd(s)
	st.settlePull(s)
}

// pullEnd decides whether a pull request's consumers all reported
// (pullEnded) and with what outcome (onPullDone).
func (st *loopState) pullEnd(s *sendReq) {
	type group struct {
		engine, dreq string
		tpSize       int
	}
	n := map[group]int{}
	failed := map[group]bool{}
	first, firstTP := pullNote{}, 0
	for o, on := range s.pullSeen {
		g := group{o.engine, o.dreq, o.tpSize}
		n[g]++
		if on.fail != "" {
			failed[g] = true
			if first.fail == "" || o.tp < firstTP {
				first, firstTP = on, o.tp
			}
		}
	}
	ok := false
	for g, c := range n {
		if c < st.pullExpect(g.tpSize) {
			return // that engine's ranks may still read
		}
		ok = ok || !failed[g]
	}
	s.pullEnded = true
	if !ok {
		s.pullFail, s.pullKind = first.fail, first.kind
	}
}

// pullEndedFor reports whether a consumer's notice for no request held
// names one that ended (forgetSend, within RegistrationTTL): by its
// transfer id, else by its producer request id where neither names
// another transfer than the other.
func (st *loopState) pullEndedFor(m *msg) bool {
	_, _, ok := st.pullEnded(m.TransferID, m.PReq)
	return ok
}

// pullEnded is pullEndedFor of transfer id tid and producer request
// preq (a notice's, or a hold question's): what is remembered of the
// request that ended, and when it did.
func (st *loopState) pullEnded(tid, preq string) (goneSend, time.Time, bool) {
	if tid != "" {
		if g, at, ok := st.abortedT.get(tid); ok {
			return g, at, true
		}
	}
	g, at, ok := st.abortedP.get(preq)
	if ok && preq != "" && (g.tid == "" || tid == "" || g.tid == tid) {
		return g, at, true
	}
	return goneSend{}, time.Time{}, false
}

// pullRank is a consumer rank that reported a pull request: its engine,
// the consumer request, that engine's TP size and its rank.
type pullRank struct {
	engine, dreq string
	tpSize, tp   int
}

// maxPullReaders bounds the consumer requests one pull request keeps
// completion notices of (pullRank's engine and dreq).
const maxPullReaders = 8

// pullReader reports whether s has a notice of k's consumer request.
func (s *sendReq) pullReader(k pullRank) bool {
	for o := range s.pullSeen {
		if o.engine == k.engine && o.dreq == k.dreq {
			return true
		}
	}
	return false
}

// pullReaders counts the consumer requests s has notices of.
func (s *sendReq) pullReaders() int {
	type reader struct{ engine, dreq string }
	seen := map[reader]bool{}
	for o := range s.pullSeen {
		seen[reader{o.engine, o.dreq}] = true
	}
	return len(seen)
}

// pullNote is what a consumer rank reported: done (fail ""), or failed.
type pullNote struct {
	fail string
	kind FailureKind
}

// pullNoticeFromReader reports whether a consumer's completion notice
// (done or fail) comes from a rank that reads from ours: one of the TP
// size its engine's handshake says (admit checked the rank against it)
// and, where that TP size maps onto ours, one of the consumer ranks that
// map to this rank. A notice from any other counted toward the ranks this
// rank waits for: P let its blocks go while the consumer ranks that read
// them were still reading (a notice that claimed TP 1 of a consumer of
// TP 2; one from the rank that reads from our peer rank), and each TP size
// a rank claimed kept an early notice of its own (stashEarly's bound is
// one per rank). It is refused, counted and logged, naming the field.
// Where the TP sizes map onto each other nowhere (refuseProducer's
// fallback tells each producer rank from one consumer rank), any of its
// ranks counts, once.
func (st *loopState) pullNoticeFromReader(m *msg) bool {
	field, want := "", ""
	if e := st.engines[m.Engine]; e != nil && e.tpSize > 0 && m.TPSize != e.tpSize {
		field, want = "done.tp_size", fmt.Sprintf("its engine's handshake says %d", e.tpSize)
	} else if t, err := topology.TargetRanks(st.rankBuf[:0], st.layout.TPSize, m.TPSize, st.layout.TPRank); err == nil {
		st.rankBuf = t
		if !slices.Contains(t, m.TPRank) {
			field, want = "done.tp_rank", fmt.Sprintf("this rank (tp %d of %d) is read by consumer ranks %v", st.layout.TPRank, st.layout.TPSize, t)
		}
	}
	if field == "" {
		return true
	}
	st.metrics.BadInput(field)
	st.log.Warn("kvxfer: refused a consumer's completion notice from a rank that does not read from this one",
		"field", field, "engine", m.Engine, "tp_rank", m.TPRank, "tp_size", m.TPSize, "want", want,
		"p_req", m.PReq, "transfer_id", m.TransferID, "kind", m.Kind)
	return false
}

// pullSendFor finds the producer request a consumer's notice is about:
// by its transfer id, else by the producer request id it names; never a
// request that carries another transfer id than the notice (the engine
// used the request id again once the notice's request ended: a late
// notice of that one would free the new request's blocks before its own
// consumer read them). Where the transfer id is held by another request
// than the one named (the engine used a transfer id twice: refused at
// the second SendReq, which is then held by id alone), the one named by
// both wins.
func (st *loopState) pullSendFor(m *msg) *sendReq { return st.sendFor(m.TransferID, m.PReq) }

// sendFor is pullSendFor of a message naming transfer id tid and
// producer request preq (a notice, or a heartbeat's triple).
func (st *loopState) sendFor(tid, preq string) *sendReq {
	if tid != "" {
		if s := st.sendByTID.get(tid); s != nil {
			if preq != "" && s.req.ReqID != preq {
				if o := st.sends.get(preq); o != nil && o.req.TransferID == tid {
					return o
				}
			}
			return s
		}
	}
	if preq == "" {
		return nil
	}
	if s := st.sends.get(preq); s != nil && !otherTID(s, tid) {
		return s
	}
	return nil
}

// otherTransfer reports whether a consumer's notice names a transfer id
// other than producer request s's (both have one).
func otherTransfer(s *sendReq, m *msg) bool { return otherTID(s, m.TransferID) }

// otherTID is otherTransfer for a transfer id named tid.
func otherTID(s *sendReq, tid string) bool {
	return tid != "" && s.req.TransferID != "" && tid != s.req.TransferID
}

// stashEarly keeps a pull completion notice for a request not held yet:
// one per consumer rank and consumer request (its first of a transfer; a
// duplicate counts for nothing when the request arrives either; a notice
// of another transfer id takes its place), for at most maxPullReaders
// consumer requests, so what a request's notices keep is bounded by its
// consumer ranks, however often, and whatever, they send. Each consumer
// request's ranks count for it alone when the request arrives
// (onPullDone): before, a second consumer request's notice was dropped
// here as its rank's duplicate.
func (st *loopState) stashEarly(m *msg) {
	m.compact() // (kept small: a notice may name many blocks)
	// Its strings are cut from one copy of the whole message (decodeMsg),
	// which they would keep alive: kept, they are copies of their own, so
	// that what it costs is what noticeCost counts.
	if e := st.engines[m.Engine]; e != nil {
		m.Engine = e.id
	} else {
		m.Engine = strings.Clone(m.Engine)
	}
	m.Addr, m.TransferID, m.DReq, m.PReq, m.Reason = strings.Clone(m.Addr), strings.Clone(m.TransferID), strings.Clone(m.DReq),
		strings.Clone(m.PReq), strings.Clone(m.Reason)
	key := m.PReq
	if key == "" {
		key = "tid:" + m.TransferID
	}
	cost := noticeCost(m)
	e := st.early[key]
	if e == nil && (len(st.early) >= maxEarly || st.earlyBytes+cost > maxEarlyBytes) {
		st.metrics.Dropped("done_unknown_request")
		return
	}
	if e == nil {
		e = &earlyNotes{at: st.now}
		st.early[key] = e
	}
	readers := 0
	for i, o := range e.msgs {
		if i == slices.IndexFunc(e.msgs, func(x *msg) bool { return x.Engine == o.Engine && x.DReq == o.DReq }) {
			readers++
		}
		if o.Engine != m.Engine || o.DReq != m.DReq || o.TPRank != m.TPRank || o.TPSize != m.TPSize {
			continue
		}
		if o.TransferID == m.TransferID {
			st.metrics.Dropped("done_duplicate")
			return
		}
		// The rank's notice of another transfer under this id: the
		// newer one stands (one per rank, whatever it names), where
		// maxEarlyBytes leaves room for it.
		st.metrics.Dropped("done_unknown_request")
		if d := cost - noticeCost(o); st.earlyBytes+d <= maxEarlyBytes {
			e.msgs[i] = m
			e.bytes += d
			st.earlyBytes += d
		}
		return
	}
	if readers >= maxPullReaders && !slices.ContainsFunc(e.msgs, func(x *msg) bool { return x.Engine == m.Engine && x.DReq == m.DReq }) {
		st.metrics.BadInput("done.readers")
		return
	}
	if st.earlyBytes+cost > maxEarlyBytes {
		st.metrics.Dropped("done_unknown_request")
		return
	}
	e.msgs = append(e.msgs, m)
	e.bytes += cost
	st.earlyBytes += cost
}

// maxEarlyBytes bounds what the early notices keep in all (noticeCost):
// 64 MiB, some 150,000 notices of usual ids, while the counts alone
// (maxEarly requests, maxPullReaders consumer requests each, one notice
// per consumer rank, each up to some 6 KiB of ids and reason) let peers
// keep gigabytes.
const maxEarlyBytes = 64 << 20

// noticeCost is what an early notice costs maxEarlyBytes: its strings
// (the engine's name is the one we keep anyway where it is known) and a
// fixed part for the message itself.
func noticeCost(m *msg) int {
	return 256 + len(m.Addr) + len(m.TransferID) + len(m.DReq) + len(m.PReq) + len(m.Reason)
}

// forgetEarly drops the early notices kept under key.
func (st *loopState) forgetEarly(key string, e *earlyNotes) {
	delete(st.early, key)
	st.earlyBytes -= e.bytes
}

// replayEarly applies the notices that arrived before a pull request.
// One that names another transfer id is not about it (about an earlier
// request under the same id): it stays where it is, for its TTL.
func (st *loopState) replayEarly(s *sendReq) {
	for _, key := range []string{s.req.ReqID, "tid:" + s.req.TransferID} {
		e := st.early[key]
		if e == nil || key == "tid:" && s.req.TransferID == "" {
			continue
		}
		var keep, apply []*msg
		for _, m := range e.msgs {
			if otherTransfer(s, m) {
				keep = append(keep, m)
			} else {
				apply = append(apply, m)
			}
		}
		if len(keep) > 0 {
			kept := 0
			for _, m := range keep {
				kept += noticeCost(m)
			}
			st.earlyBytes -= e.bytes - kept
			e.msgs, e.bytes = keep, kept
		} else {
			st.forgetEarly(key, e)
		}
		for _, m := range apply {
			reason, kind := "", FailureNone
			if m.Kind == msgFail {
				reason, kind = m.Reason, m.failKind()
			}
			st.onPullDone(m, reason, kind)
		}
	}
}

func (st *loopState) settlePull(s *sendReq) {
	if s.done {
		return
	}
	o := Outcome{ReqID: s.req.ReqID}
	switch {
	case s.aborted:
		o.Result, o.Reason = ResultAborted, "producer aborted"
	case s.pullEnded:
		o.Result = ResultDone
		if s.pullFail != "" {
			o.Result, o.Kind, o.Reason = ResultFailed, s.pullKind, s.pullFail
		}
	case s.expired:
		o.Result, o.Kind, o.Reason = ResultExpired, FailureExpired, "lease expired"
		st.metrics.ExpiredRequest()
	default:
		return
	}
	s.done = true
	st.report(RoleProducer, o)
	st.forgetSend(s)
}

// pullExpect is how many consumer ranks of TP size tp read from this
// rank (1 where the sizes map onto each other nowhere: refuseProducer
// tells each producer rank from one consumer rank).
func (st *loopState) pullExpect(tp int) int {
	t, err := topology.TargetRanks(st.rankBuf[:0], st.layout.TPSize, tp, st.layout.TPRank)
	if err != nil {
		return 1
	}
	st.rankBuf = t
	return len(t)
}

// postPrepared posts a request's transfer to peer rank `to` on the
// prepared path: through prepared lists (built once per plan), so that
// only index pairs cross to the backend; or, where the backend models
// its costs (PostCoster) and says a coalesced descriptor list posts for
// less, on the fly. It returns the transfer, how many descriptors or
// pairs it names, and its bytes (0 when prepared: not summed).
func (st *loopState) postPrepared(e *engine, key hotpath.PlanKey, p *topology.Plan, to rankRef, req *hotpath.Request, notif []byte) (XferID, int, int64, error) {
	var err error
	st.idxBuf, err = st.builder.AppendIndices(st.idxBuf[:0], p, req)
	if err != nil {
		return 0, 0, 0, err
	}
	// Coalescing gives at least IndexRuns descriptors: when a prepared
	// post wins even against that many (scattered blocks), the
	// descriptors need not be built to know it.
	if st.costed && !st.cost.Prepared(hotpath.IndexRuns(st.idxBuf), len(st.idxBuf)) {
		from := len(st.fx.descs)
		st.fx.descs, err = st.builder.AppendDescs(st.fx.descs, p, req)
		if err != nil {
			st.fx.descs = st.fx.descs[:from]
			return 0, 0, 0, err
		}
		if descs := st.fx.descs[from:]; !st.cost.Prepared(len(descs), len(st.idxBuf)) {
			return st.postOp(opFor(st.cfg.Mode), e.peers[to], from, notif), len(descs), descBytes(descs), nil
		}
		st.fx.descs = st.fx.descs[:from]
	}
	pr, err := st.prepared(e, key, p, to)
	if err != nil {
		return 0, 0, 0, err
	}
	return st.postPreparedOp(opFor(st.cfg.Mode), pr.local, pr.remote, st.idxBuf, notif), len(st.idxBuf), 0, nil
}
