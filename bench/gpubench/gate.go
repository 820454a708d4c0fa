package main

import (
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/hoptrace"
	"github.com/kvxfer/kvxfer/internal/netxfer"
)

// The one-sided same-host WRITE (samehost-gate): kvxfer's gates
// (internal/netxfer/gate.go). Before each case the child's agent (D)
// offers the parent's (P) the case's destination blocks in every layer
// as a gate, the shape a push consumer's Worker offers a request's grant
// in (a base per layer, an entry per block); P's layout WRITEs carrying
// the case's tag then go as P's own gated launch straight into D's
// memory, and D hears the notification afterwards. The table's rate is
// P's post to P seeing its transfer done; the hop table adds when D
// drained the notification.

// gateTag is the notification a case's WRITEs carry and its gate is
// keyed by.
func gateTag(c xcase) []byte { return []byte("gpubench-gate " + c.String()) }

// childNotes is when the child drained the gate contender's
// notifications.
var childNotes stampList[int64]

func gatePeer(_ *opts, s *side) ([]byte, peerSide, error) {
	a, err := netxferAgent(s, "d", new(wireLog))
	if err != nil {
		return nil, nil, err
	}
	return a.Metadata(), &gateSide{a: a, s: s, stop: make(chan struct{})}, nil
}

// gateSide is D: its agent, and the goroutine that drains (and stamps)
// the notifications once linked.
type gateSide struct {
	a    *netxfer.Agent
	s    *side
	peer string
	stop chan struct{}
	wg   sync.WaitGroup
}

func (g *gateSide) link(meta []byte) error {
	peer, err := g.a.LoadPeer(meta)
	if err != nil {
		return err
	}
	g.peer = peer
	g.wg.Add(1)
	go func() {
		defer g.wg.Done()
		for {
			select {
			case <-g.stop:
				return
			case <-g.a.Events():
			}
			for range g.a.Drain(nil) {
				childNotes.add(hoptrace.Now())
			}
		}
	}()
	return nil
}

// open offers P the case's destination blocks as a gate.
func (g *gateSide) open(c xcase) error {
	l := c.layout(0, g.s.base)
	var span netxfer.LayoutSpan
	for _, b := range l.Bases {
		span.Bases = append(span.Bases, b.Remote)
	}
	for _, e := range l.Entries {
		span.Entries = append(span.Entries, netxfer.Region{Addr: e.Remote, Len: e.Len})
	}
	if err := g.a.OpenGate(g.peer, []netxfer.LayoutSpan{span}, gateTag(c)); err != nil {
		return fmt.Errorf("open a gate: %w", err)
	}
	return nil
}

func (g *gateSide) close() error {
	close(g.stop)
	g.wg.Wait()
	return g.a.Close()
}

// gateOpen is P: samehost's mover, its WRITEs tagged for the case's gate.
func gateOpen(o *opts, src, scratch *side, r *remote, meta []byte) (mover, []byte, error) {
	m, back, err := netxferOpen(true, 1)(o, src, scratch, r, meta)
	if err != nil {
		return nil, nil, err
	}
	return &gateMover{netxferMover: m.(*netxferMover)}, back, nil
}

type gateMover struct {
	*netxferMover
	gates int // opened so far (one per case)
}

func (m *gateMover) prepare(c xcase) error {
	if _, err := m.r.call(ctlReq{Op: "gate", Contender: "samehost-gate", Case: c}); err != nil {
		return err
	}
	m.gates++
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(100 * time.Microsecond) {
		if _, n := m.a.GatesOpen(); n >= m.gates {
			break
		}
		if time.Now().After(deadline) {
			return errors.New("the destination's gate never reached this agent")
		}
	}
	m.notif = gateTag(c)
	return m.netxferMover.prepare(c)
}
func (m *gateMover) write(c xcase) (time.Duration, error) {
	before := m.a.OneSidedWrites()
	d, err := m.netxferMover.write(c)
	if err == nil && m.a.OneSidedWrites() == before {
		err = errors.New("a WRITE went two-sided: not what this contender measures")
	}
	return d, err
}

// gateHops are the one-sided WRITE's hops, in order. P's wire stamps
// split its own share: the part "sent" once the gated launch was queued,
// the "answer read" once its poller saw the launch done.
var gateHops = []string{
	"P post -> launched (P's checks, staging, the launch queued)",
	"launched -> P's poller saw it done (the GPU, the poll)",
	"P's poller saw it done -> P saw it done (P's waiter)",
	"P post -> P saw it done",
	"P saw it done -> D drained the notification (one hop: D's wake-up)",
	"total: P post -> D notified",
}

func (m *gateMover) hops(warmup int) ([]string, [][]float64, error) {
	// One note per transfer, in order; the last may still be on its way.
	var notes []int64
	for deadline := time.Now().Add(time.Second); ; {
		st, err := m.r.stamps()
		if err != nil {
			return nil, nil, err
		}
		notes = append(notes, st.Notes...)
		if len(notes) >= len(m.times) || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	// A one-sided WRITE's part is "sent" once its launch is queued, its
	// answer "read" once P's poller saw the launch done.
	ways := wireWays(m.wire.take())
	out := make([][]float64, len(gateHops))
	for i, t := range m.times {
		if i < warmup || i >= len(notes) {
			continue
		}
		w := ways[t.id]
		if w == nil || w.sent == 0 || w.ansRead == 0 {
			continue
		}
		n := notes[i]
		for h, d := range []int64{w.sent - t.posted, w.ansRead - w.sent, t.seen - w.ansRead, t.seen - t.posted, n - t.seen, n - t.posted} {
			out[h] = append(out[h], float64(d)/1e3)
		}
	}
	return gateHops, out, nil
}
