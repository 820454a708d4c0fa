package kvxfer

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// noticeCore is a pull consumer core (engine "D", rank 0 of 1) driven by
// hand: the handshakes it asks for and the notices it sends are kept for
// the test to read, and its clock moves only when the test moves now.
type noticeCore struct {
	t     *testing.T
	d     *loopState
	now   time.Time
	asks  []hsAsk
	notes []sentNote
}

// sentNote is a notice the core sent: its op and its message, decoded.
type sentNote struct {
	op   op
	peer PeerName
	m    *msg
}

func newNoticeCore(t *testing.T) *noticeCore {
	return &noticeCore{t: t, d: newTestCore(t, "D", ModePull, traceLayout(0, 1, 1<<30), traceEpoch), now: traceEpoch}
}

// run steps the core with in, carries its ops out (every one succeeds)
// and returns what it reported.
func (c *noticeCore) run(in input) Finished {
	c.t.Helper()
	c.d.Step(c.now, in)
	carryOut(c.d, nil, nil, func(_ int, o *op) error {
		if o.kind == opNotify {
			m, err := decodeMsg(o.msg)
			if err != nil {
				c.t.Fatalf("a notice that does not decode: %v", err)
			}
			c.notes = append(c.notes, sentNote{op: *o, peer: o.peer, m: m})
		}
		return nil
	})
	c.asks = append(c.asks, c.d.fx.asks...)
	c.d.fx.asks = c.d.fx.asks[:0]
	out := c.d.out
	c.d.out = Finished{}
	return out
}

// step runs a step at the core's clock.
func (c *noticeCore) step(m *StepMeta) Finished {
	c.t.Helper()
	m.SchedulerClock = c.now
	return c.run(input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
}

// answer answers handshake a: producer engine P, one rank, generation gen,
// its agent named agent.
func (c *noticeCore) answer(a hsAsk, gen uint64, agent PeerName) Finished {
	c.t.Helper()
	h := &hsResult{engine: a.engine, probe: a.probe, moves: a.moves,
		res:   HandshakeResult{Generation: gen, Ranks: []RankInfo{{EngineID: "P", CompatHash: "h", Layout: traceLayout(0, 1, 1<<20), Agent: []byte(agent)}}},
		names: []PeerName{agent}, loadErrs: []error{nil}}
	return c.run(input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
}

// recvOf is consumer request id of producer engine P at addr, one block.
func (c *noticeCore) recvOf(id, addr string, block topology.BlockID) RecvReq {
	return RecvReq{ReqID: id, TransferID: "t-" + id, Deadline: c.now.Add(time.Minute), Local: []topology.Span{{IDs: []topology.BlockID{block}}},
		Remote: RemoteRef{EngineID: "P", Addr: addr, ReqID: "p-" + id, TPSize: 1, PPSize: 1, Tokens: 16}}
}

// names reports whether the notice is about consumer request id.
func (s sentNote) names(id string) bool {
	if s.m.DReq == id {
		return true
	}
	for i := 2; i < len(s.m.IDs); i += 3 {
		if s.m.IDs[i] == id {
			return true
		}
	}
	return false
}

// handshakeAt checks that the core asked for one handshake, at addr,
// answers it (gen, agent) and forgets the ask.
func (c *noticeCore) handshakeAt(addr string, gen uint64, agent PeerName) Finished {
	c.t.Helper()
	if len(c.asks) != 1 || c.asks[0].addr != addr {
		c.t.Fatalf("asks = %+v, want one handshake at %s", c.asks, addr)
	}
	a := c.asks[0]
	c.asks = nil
	return c.answer(a, gen, agent)
}

// sentAbout reports whether a notice of kind about consumer request id
// went to peer.
func (c *noticeCore) sentAbout(peer PeerName, kind msgKind, id string) bool {
	for _, s := range c.notes {
		if s.peer == peer && s.m.Kind == kind && s.names(id) {
			return true
		}
	}
	return false
}
