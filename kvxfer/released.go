package kvxfer

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
func (r *recvReq) ask(peer PeerName) {
	if peer == "" {
		return
	}
	for i := range r.asked {
		if r.asked[i].peer == peer {
			return // (told stays: its READ or notice already went)
		}
	}
	if len(r.asked) < maxHoldRanks {
		r.asked = append(r.asked, askedAgent{peer: peer})
	}
}

// told notes that peer heard of r's end (a notice about it, or its READ).
func (r *recvReq) told(peer PeerName) {
	for i := range r.asked {
		if r.asked[i].peer == peer {
			r.asked[i].told = true
			return
		}
	}
	if peer != "" && len(r.asked) < maxHoldRanks {
		r.asked = append(r.asked, askedAgent{peer: peer, told: true})
	}
}

// notedAsked notes the consumer requests of a heartbeat's ids (triples:
// transfer id, producer request id, consumer request id) as asked of
// peer. Waiting requests (StepMeta.Await) are not this rank's receives
// yet and are not noted.
func (st *loopState) notedAsked(ids []string, peer PeerName) {
	if st.cfg.Mode != ModePull {
		return
	}
	for i := 0; i+2 < len(ids); i += 3 {
		if r := st.recvs[ids[i+2]]; r != nil && r.req.TransferID == ids[i] && r.req.Remote.ReqID == ids[i+1] {
			r.ask(peer)
		}
	}
}

// releaseAsked tells each producer agent r asked to hold it, and told
// nothing since, that r ended (o): it lets the blocks go now instead of
// at the end of the hold the asking extended. It goes to the agent by
// name, never through the engine entry, which may name another engine at
// another address by now.
func (st *loopState) releaseAsked(r *recvReq, o Outcome) {
	if st.cfg.Mode != ModePull {
		return
	}
	kind, reason := o.Kind, o.Reason
	if o.Result == ResultDone || kind == FailureNone {
		// Done, read from other agents (the producer re-attached its
		// rank since this one was asked): this one is not read.
		kind, reason = FailurePeerGone, "the consumer request ended without reading from this agent"
	}
	for i := range r.asked {
		a := &r.asked[i]
		if a.told {
			continue
		}
		a.told = true
		st.notify(a.peer, r.notice(msgFail, kind, reason))
	}
}
