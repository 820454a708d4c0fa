package kvxfer

import "slices"

// A pull consumer rank that asks a producer agent to hold a request (its
// heartbeats, its hold check's questions) extends that agent's hold by
// the producer's Lease·2/3 each time: 20 s with the default lease,
// whatever lease the request's own params carry. Most ways a request
// ends tell the agents it read from (the READ's notice, tellP); a request
// that ends without telling an agent it asked would keep that agent's
// blocks held for the whole extension after the consumer is done with
// them. So a request's end tells each agent it asked and told nothing
// since: in particular a request failed as naming its engine elsewhere
// (engineAt), which is never sent to the engine at its new address, but
// did ask the agent at the address its params name before the engine
// moved. Before, that agent held its blocks long past the request's end
// (TestTwoProducersShareAnID/nixl, on a loaded machine: the hold check's
// question reached P1, then the request failed as elsewhere, and P1 held
// p-c1 for 20 s).

// askedAgent is a producer agent a consumer request asked to hold it.
type askedAgent struct {
	peer PeerName
	told bool // told of the request's end (or read from: the READ carries it)
}

// ask notes that peer was asked to hold r.
func (r *recvReq) ask(peer PeerName) { r.asked = askAgent(r.asked, peer) }

// told notes that peer heard of r's end (a notice about it, or its READ).
func (r *recvReq) told(peer PeerName) { r.asked = tellAgent(r.asked, peer) }

// askAgent notes in asked that peer was asked to hold a request (at most
// maxHoldRanks agents).
func askAgent(asked []askedAgent, peer PeerName) []askedAgent {
	if peer == "" {
		return asked
	}
	for i := range asked {
		if asked[i].peer == peer {
			return asked // (told stays: its READ or notice already went)
		}
	}
	if len(asked) < maxHoldRanks {
		asked = append(asked, askedAgent{peer: peer})
	}
	return asked
}

// tellAgent notes in asked that peer heard of the request's end.
func tellAgent(asked []askedAgent, peer PeerName) []askedAgent {
	for i := range asked {
		if asked[i].peer == peer {
			asked[i].told = true
			return asked
		}
	}
	if peer != "" && len(asked) < maxHoldRanks {
		asked = append(asked, askedAgent{peer: peer, told: true})
	}
	return asked
}

// notedAsked notes the consumer requests of a heartbeat's ids (triples:
// transfer id, producer request id, consumer request id) as asked of
// peer: this rank's receives and its waiting requests (StepMeta.Await),
// whose heartbeats extend the hold alike.
func (st *loopState) notedAsked(ids []string, peer PeerName) {
	if st.cfg.Mode != ModePull {
		return
	}
	for i := 0; i+2 < len(ids); i += 3 {
		if r := st.recvs[ids[i+2]]; r != nil && r.req.TransferID == ids[i] && r.req.Remote.ReqID == ids[i+1] {
			r.ask(peer)
		} else if w := st.waits[ids[i+2]]; w != nil && w.req.TransferID == ids[i] && w.req.Remote.ReqID == ids[i+1] {
			w.asked = askAgent(w.asked, peer)
		}
	}
}

// releaseAsked tells each producer agent r concerns, and told nothing
// since, that r ended (o): it lets the blocks go now instead of at the
// end of the hold the asking extended. The agents it concerns are those
// it asked to hold it (its heartbeats, its hold check), those it was
// sent to (read: the READ's notice tells them, noteSent), and, for a
// request that ended before it was sent, the producer ranks it would
// have read from (noteUnsent). It goes to each agent by name, never
// through the engine entry, which may name another engine at another
// address by now.
//
// It is the one place a pull consumer request's end reaches its
// producer: before, each way a request ended told the ranks it knew of
// itself (a close, its deadline, a refusal at handshake, the generation
// rules, an expired hold), each with its own list, and a request that
// expired before it asked anyone (its engine still handshaking, its
// producer's clock being measured again) told nobody: its producer held
// the blocks for its whole lease. Only what must go before the request
// ends (a READ given up, or waiting to be tried again, whose rank hears at
// once; a failed hold check) is told where it happens.
func (st *loopState) releaseAsked(r *recvReq, o Outcome) {
	if st.cfg.Mode != ModePull {
		return
	}
	kind, reason := o.Kind, o.Reason
	if o.Result == ResultDone || kind == FailureNone {
		// Done, read from other agents (the producer re-attached its
		// rank since this one was asked): this one is not read.
		kind, reason = FailurePeerGone, "the consumer request ended without reading from this agent"
	} else {
		st.noteUnsent(r)
	}
	st.tellUntold(r.asked, r.notice(msgFail, kind, reason))
}

// noteSent notes the producer agents of e that pull request r is sent
// to (its targets) among the agents it concerns.
func (st *loopState) noteSent(r *recvReq, e *engine) {
	for _, to := range r.targets {
		if p, ok := e.peers[to]; ok {
			r.ask(p)
		}
	}
}

// noteUnsent notes, for pull request r that ended before it was sent,
// the producer agents it would have read from among those it concerns:
// the ranks of its producer's handshake loaded now that map to this rank
// (producerRanks). None where its producer engine is elsewhere (another
// engine at another address answers under its id now) or not loaded,
// nor where its notices must name its blocks (notRead) and its params
// name none: a producer could not tell its request from another held
// under the same names.
func (st *loopState) noteUnsent(r *recvReq) {
	if r.sent || r.elsewhere {
		return
	}
	e := st.engines[r.req.Remote.EngineID]
	if e == nil || len(e.peers) == 0 {
		return
	}
	if r.notRead && spanIDs(r.req.Remote.Blocks) == 0 {
		return
	}
	for _, to := range st.producerRanks(e.tpSize, e.ppSize) {
		if p, ok := e.peers[to]; ok {
			r.ask(p)
		}
	}
}

// tellUntold sends m to each agent of asked not told yet of its request's
// end, and notes it told.
func (st *loopState) tellUntold(asked []askedAgent, m *msg) {
	for i := range asked {
		if a := &asked[i]; !a.told {
			a.told = true
			st.notify(a.peer, m)
		}
	}
}

// A waiting request (StepMeta.Await) is heartbeaten too, and each
// heartbeat extends its producer's hold alike: every way it ends tells the
// agents its heartbeats reached (endWait), unless its receive takes over
// (takeWait carries them to the receive, whose end tells them) or tells
// them itself (an empty receive's release, releaseProducer). Before, a
// request that ended while it waited (aborted in its engine's queue with
// no receive to release its producer, its params refused at allocation,
// its step dropped, its wait past RegistrationTTL, its Worker closed) left
// its producer holding the blocks for up to Lease·2/3 past its last
// heartbeat.

// endWait stops heartbeating the waiting request id, if any, and tells
// the agents its heartbeats reached that it ended (kind, reason).
func (st *loopState) endWait(id string, kind FailureKind, reason string) {
	if w := st.waits[id]; w != nil {
		delete(st.waits, id)
		st.releaseWait(w, kind, reason)
	}
}

// endWaits ends every waiting request (endWait).
func (st *loopState) endWaits(kind FailureKind, reason string) {
	for _, id := range sortedKeys(st.waits) {
		st.endWait(id, kind, reason)
	}
}

// releaseWait tells each agent w's heartbeats reached, and told nothing
// since, that w ended (a failure notice: this rank read nothing of it).
func (st *loopState) releaseWait(w *waitReq, kind FailureKind, reason string) {
	st.tellUntold(w.asked, &msg{Kind: msgFail, TransferID: w.req.TransferID, DReq: w.req.ReqID, PReq: w.req.Remote.ReqID, FailKind: kind, Reason: reason})
}

// untold reports whether an agent w's heartbeats reached was not told of
// its end yet.
func (w *waitReq) untold() bool {
	for _, a := range w.asked {
		if !a.told {
			return true
		}
	}
	return false
}

// sameRequest reports whether w is the waiting request of receive in
// (not another request under its id).
func (w *waitReq) sameRequest(in *RecvReq) bool {
	return w.req.TransferID == in.TransferID && w.req.Remote.ReqID == in.Remote.ReqID && w.req.Remote.EngineID == in.Remote.EngineID
}

// popWait takes the waiting request of receive in's id off the waits: one
// still waiting, else one an AwaitEnd of this very step ended (its end is
// told at the step's end unless the receive took it: endedWaits).
func (st *loopState) popWait(in *RecvReq) *waitReq {
	if w := st.waits[in.ReqID]; w != nil {
		delete(st.waits, in.ReqID)
		return w
	}
	for i, w := range st.endedWaits {
		if w.req.ReqID == in.ReqID {
			st.endedWaits = slices.Delete(st.endedWaits, i, i+1)
			return w
		}
	}
	return nil
}
