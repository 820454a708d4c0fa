package kvxfer

// Peer events from outside: a registry of engines (kvxferd -etcd) that
// holds each engine under a lease tells the worker when an engine's lease
// ended or its generation changed, so that what waits on it does not
// wait for a probe (liveness.go) to find out. Both post an event into the
// worker's loop, which handles it like a probe's answer; neither blocks.

// PeerGone tells the worker that producer engine engineID is gone (why:
// e.g. its registry lease ended): every request waiting on it fails at
// once, as when it stays silent for PeerTimeout (FailurePeerGone, the
// reason naming the engine and why), even with probes off (negative
// PeerTimeout). Its handshake is dropped, so the next request handshakes
// again. An engine the worker does not know, or has no handshake with,
// is ignored. It returns ErrClosed after Close.
func (w *Worker) PeerGone(engineID, why string) error {
	return w.post(event{kind: evInspect, fn: func(st *loopState) { st.peerGoneEvent(engineID, why) }})
}

// PeerGeneration tells the worker that engine engineID is now at
// generation gen (it registered again: a restart). When the worker's
// handshake with it is of another generation, it asks the engine's
// daemon at once, and the answer is handled as a probe's: requests
// waiting on a rank whose agent changed fail, and the new ranks are
// loaded for the next requests (a rejoin). It returns ErrClosed after
// Close.
func (w *Worker) PeerGeneration(engineID string, gen uint64) error {
	return w.post(event{kind: evInspect, fn: func(st *loopState) { st.peerGenerationEvent(engineID, gen) }})
}

// Mode is the worker's mode (push or pull).
func (w *Worker) Mode() Mode { return w.cfg.Mode }
