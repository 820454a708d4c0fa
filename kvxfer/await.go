package kvxfer

import "time"

// A pull consumer request that waits in its engine's queue (its engine
// overloaded) holds nothing on this rank yet, but the producer holds its
// blocks under a lease that only heartbeats extend (SPEC §9: the
// reference tracks a request for heartbeats from its arrival). Before,
// a rank heartbeat only the requests allocated to it (st.recvs): one that
// waited longer than the lease found the producer's hold lapsed and was
// recomputed. The Scheduler publishes such requests at their arrival
// (StepMeta.Await); each rank heartbeats them, asking for the producer's
// holds (msgHold), until the request's RecvReq takes over (with the holds
// answered meanwhile, which bound its READs) or it ends in the queue
// (StepMeta.AwaitEnd).

// waitReq is a request of StepMeta.Await on this rank.
type waitReq struct {
	req   AwaitReq
	since time.Time
	holds []rankHold
	beat  bool // heartbeaten at least once
	fresh bool // listed in loopState.fresh
	// asked are the producer agents its heartbeats reached (told of its
	// end: endWait), in askedBuf while few.
	asked    []askedAgent
	askedBuf [2]askedAgent
}

// maxWaits bounds the waiting requests a rank heartbeats: past it, a
// request is refused (counted: dropped "await_limit") and only loses its
// heartbeats before it is allocated.
const maxWaits = 1 << 14

// newWait starts heartbeating a waiting request.
func (st *loopState) newWait(a *AwaitReq) {
	if st.cfg.Mode != ModePull || st.recvs[a.ReqID] != nil {
		return
	}
	why := longID("ReqID", a.ReqID) + longID("TransferID", a.TransferID) + longID("Remote.EngineID", a.Remote.EngineID) +
		longID("Remote.ReqID", a.Remote.ReqID) + longID("Remote.Addr", a.Remote.Addr)
	if why == "" && (a.ReqID == "" || a.Remote.EngineID == "" || a.Remote.ReqID == "" && a.TransferID == "") {
		why = "ReqID, Remote.EngineID, or both Remote.ReqID and TransferID are empty"
	}
	if why != "" {
		st.metrics.BadInput("await_req")
		st.log.Warn("kvxfer: a waiting request (StepMeta.Await) is not heartbeaten: " + why)
		return
	}
	if w := st.waits[a.ReqID]; w != nil && w.req.TransferID == a.TransferID && w.req.Remote.ReqID == a.Remote.ReqID {
		return
	}
	if len(st.waits) >= maxWaits || st.engines[a.Remote.EngineID] == nil && len(st.engines) >= maxEngines {
		st.metrics.Dropped("await_limit")
		return
	}
	w := &waitReq{req: *a, since: st.now, fresh: true}
	w.asked = w.askedBuf[:0]
	if old := st.waits[a.ReqID]; old == nil || !old.fresh {
		st.fresh = append(st.fresh, a.ReqID) // (one listing per id)
	}
	if old := st.waits[a.ReqID]; old != nil {
		// Another request under its id: the earlier one ended.
		st.releaseWait(old, FailureCancelled, "the consumer request ended while it waited in its engine's queue (another came under its id)")
	}
	st.waits[a.ReqID] = w
	st.beatFresh = true
	st.engineAt(a.Remote.EngineID, a.Remote.Addr, st.now) // its handshake, early (at the address it names: engineAt)
}

// heartbeatFresh heartbeats at once the waiting requests not heartbeaten
// yet whose producer engine is handshaken (the others stay fresh until
// it is), instead of at the next tick, up to Lease/6 away: a request may
// arrive late in the producer's hold (its router or the engine's front
// end slow), and a hold that lapses before the first heartbeat is lost
// (its READ refused as expired: recomputed). Before, an idle rank's first
// heartbeat went a full interval after the request came. One heartbeat
// per producer engine and rank for all the requests an input added.
func (st *loopState) heartbeatFresh() {
	st.beatFresh = false
	if len(st.fresh) == 0 {
		return
	}
	by := map[string][]string{}
	seen := make(map[string]bool, len(st.fresh))
	keep := st.fresh[:0]
	for _, id := range st.fresh {
		w := st.waits[id]
		if w == nil || !w.fresh || seen[id] {
			// (Ended, or listed twice: a request that ended and came
			// again before this pass.)
			continue
		}
		seen[id] = true
		e := st.engines[w.req.Remote.EngineID]
		if w.beat || e == nil || e.state != hsReady || w.req.Remote.Addr != "" && e.addr != "" && w.req.Remote.Addr != e.addr {
			if !w.beat && e != nil && (e.state == hsPending || e.state == hsFailed) {
				// Beaten once its engine is ready: a failed handshake is
				// tried again at the ticks (waitHeartbeats), and the
				// answer of that one comes a tick before the next.
				keep = append(keep, id)
			} else {
				w.fresh = false // (left to the ticks)
			}
			continue
		}
		w.beat, w.fresh = true, false
		e.lastActive = st.now
		by[e.id] = append(by[e.id], w.req.TransferID, w.req.Remote.ReqID, w.req.ReqID)
	}
	clear(st.fresh[len(keep):])
	st.fresh = keep
	st.heartbeat(by)
}

// takeWait hands a waiting request's answered holds to its receive, and
// the agents its heartbeats reached, whom the receive's end tells
// (releaseAsked). A wait of another request under its id ended: its
// agents are told now.
func (st *loopState) takeWait(r *recvReq) {
	w := st.popWait(&r.req)
	if w == nil {
		return
	}
	if !w.sameRequest(&r.req) {
		st.releaseWait(w, FailureCancelled, "the consumer request ended while it waited in its engine's queue (another came under its id)")
		return
	}
	if w.req.Remote.Expiry.Equal(r.req.Remote.Expiry) {
		r.holds = w.holds
	}
	for _, a := range w.asked {
		if a.told {
			r.told(a.peer)
		} else {
			r.ask(a.peer)
		}
	}
}

// waitLapsed reports whether the producer's hold of a waiting request
// has lapsed by our estimate: past the later of its params' expiry and
// the holds its producer's ranks answered (through the offset), or, with
// no expiry and no answer, a lease after it arrived. Its heartbeats stop
// then: nothing more can keep the hold.
func (st *loopState) waitLapsed(w *waitReq, e *engine) bool {
	end := w.req.Remote.Expiry
	for _, h := range w.holds {
		if h.at.After(end) {
			end = h.at
		}
	}
	if end.IsZero() {
		return st.now.After(w.since.Add(st.cfg.Lease))
	}
	return st.now.After(end.Add(-e.offset))
}

// waitHeartbeats adds the waiting requests to a round of heartbeats (by
// producer engine), dropping those whose hold lapsed; an engine not
// handshaken yet is asked (ensureEngine) and heartbeaten once it
// answers.
func (st *loopState) waitHeartbeats(by map[string][]string) {
	for _, id := range sortedKeys(st.waits) {
		w := st.waits[id]
		e := st.ensureEngine(w.req.Remote.EngineID, w.req.Remote.Addr)
		if st.waitLapsed(w, e) {
			// (By our estimate: an answer lost, the producer may hold it
			// still.)
			st.endWait(id, FailureExpired, "the consumer request's producer hold lapsed while it waited in its engine's queue")
			st.metrics.Dropped("await_lapsed")
			continue
		}
		if st.now.Sub(w.since) > st.cfg.RegistrationTTL {
			// Waiting longer than a producer keeps a registration it
			// cannot match: its end may never come (an AwaitEnd in a
			// step dropped whole), and each heartbeat would keep the
			// producer's blocks held as long as this rank lives. Its
			// hold lapses now as any unasked one does (a recompute if
			// the request is allocated after all).
			st.endWait(id, FailureExpired, "the consumer request waited in its engine's queue past RegistrationTTL")
			st.metrics.Dropped("await_ttl")
			continue
		}
		if e.state != hsReady || w.req.Remote.Addr != "" && e.addr != "" && w.req.Remote.Addr != e.addr {
			// (Not handshaken yet, or the engine is at another address
			// now: another engine under its id, which holds nothing of
			// this request.) One never heartbeaten is, once its
			// engine's handshake (begun or retried here) answers:
			// heartbeatFresh.
			if !w.beat && !w.fresh && e.state != hsReady {
				w.fresh = true
				st.fresh = append(st.fresh, id)
			}
			continue
		}
		e.lastActive = st.now
		w.beat = true
		by[e.id] = append(by[e.id], w.req.TransferID, w.req.Remote.ReqID, w.req.ReqID)
	}
}

// onWaitHold notes a producer rank's answer for a waiting request.
func (st *loopState) onWaitHold(m *msg, ref rankRef, tid, preq, dreq string, at time.Time) {
	w := st.waits[dreq]
	if w == nil || w.req.Remote.EngineID != m.Engine || w.req.TransferID != tid || w.req.Remote.ReqID != preq || w.req.Remote.Expiry.IsZero() {
		return
	}
	w.holds = noteHold(w.holds, ref, at)
}
