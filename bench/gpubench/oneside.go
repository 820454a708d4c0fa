package main

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"net"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/hoptrace"
)

// The one-sided sketch (samehost-oneside): what a same-host WRITE would
// cost if the sender did the copy, as NIXL's cuda_ipc does. P imports D's
// region through its CUDA IPC handle and launches the copy kernel itself
// (the layout kvxfer's same-host path stages), polls it to completion,
// then tells D with one byte over a unix socket. No grant is checked and
// no fence set: this is not a path of kvxfer's, it measures the design
// that would take the two wake-ups of the two-sided path off the sender's
// timing (bench/RESULTS.md). The table's rate is P's post to P seeing the
// kernel done; the hop table adds D's notification.

// childNotes is when the child received the sketch's notifications.
var childNotes stampList[int64]

// onesideMeta is what the child's side tells the parent: its region's
// IPC handle and the socket to notify it on.
type onesideMeta struct {
	Handle [64]byte
	Socket string
}

// onesideSide is the child's side: a socket whose every byte is a
// notification, stamped when read.
type onesideSide struct {
	ln   net.Listener
	mu   sync.Mutex
	conn net.Conn
	done chan struct{}
}

func onesidePeer(_ *opts, s *side) ([]byte, peerSide, error) {
	var b [8]byte
	_, _ = rand.Read(b[:])
	name := "@gpubench-oneside-" + hex.EncodeToString(b[:])
	ln, err := net.Listen("unix", name)
	if err != nil {
		return nil, nil, err
	}
	p := &onesideSide{ln: ln, done: make(chan struct{})}
	go p.serve()
	meta, err := json.Marshal(onesideMeta{Handle: s.handle, Socket: name})
	if err != nil {
		ln.Close()
		return nil, nil, err
	}
	return meta, p, nil
}

func (p *onesideSide) serve() {
	defer close(p.done)
	c, err := p.ln.Accept()
	if err != nil {
		return
	}
	p.mu.Lock()
	p.conn = c
	p.mu.Unlock()
	buf := make([]byte, 1)
	for {
		if _, err := c.Read(buf); err != nil {
			return
		}
		childNotes.add(hoptrace.Now())
	}
}

func (p *onesideSide) link([]byte) error { return nil }

func (p *onesideSide) close() error {
	err := p.ln.Close()
	p.mu.Lock()
	if p.conn != nil {
		p.conn.Close()
	}
	p.mu.Unlock()
	<-p.done
	return err
}

// onesideMover is the parent's side: D's region imported here.
type onesideMover struct {
	remoteMover
	src   *side
	dst   uint64 // D's region, imported
	conn  net.Conn
	times [][2]int64 // this case's transfers: posted, seen done (hoptrace.Now)
}

func onesideOpen(_ *opts, src, _ *side, r *remote, meta []byte) (mover, []byte, error) {
	var m onesideMeta
	if err := json.Unmarshal(meta, &m); err != nil {
		return nil, nil, err
	}
	dst, err := src.g.Import(m.Handle)
	if err != nil {
		return nil, nil, fmt.Errorf("import the destination's region: %w", err)
	}
	c, err := net.Dial("unix", m.Socket)
	if err != nil {
		_ = src.g.Unmap(dst)
		return nil, nil, err
	}
	return &onesideMover{remoteMover: remoteMover{r}, src: src, dst: dst, conn: c}, nil, nil
}

func (m *onesideMover) prepare(c xcase) error {
	m.times = m.times[:0]
	if _, err := m.r.stamps(); err != nil { // the child's notes emptied
		return err
	}
	return m.remoteMover.prepare(c)
}

func (m *onesideMover) write(c xcase) (time.Duration, error) {
	regs, ents := devLayout(c.layout(m.src.base, m.dst))
	start, t0 := time.Now(), hoptrace.Now()
	err := postLayout(m.src.g, regs, ents)
	d := time.Since(start)
	m.times = append(m.times, [2]int64{t0, hoptrace.Now()})
	if err == nil {
		_, err = m.conn.Write([]byte{1}) // D's notification
	}
	return d, err
}

// onesideHops are the sketch's hops, in order.
var onesideHops = []string{
	"P post -> P saw it done (staging, launch, the GPU, P's poll)",
	"P saw it done -> D notified (one hop: D's wake-up)",
	"total: P post -> D notified",
}

func (m *onesideMover) hops(warmup int) ([]string, [][]float64, error) {
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
	out := make([][]float64, len(onesideHops))
	for i, t := range m.times {
		if i < warmup || i >= len(notes) {
			continue
		}
		n := notes[i]
		for h, d := range []int64{t[1] - t[0], n - t[1], n - t[0]} {
			out[h] = append(out[h], float64(d)/1e3)
		}
	}
	return onesideHops, out, nil
}

func (m *onesideMover) close() error {
	m.conn.Close()
	return m.src.g.Unmap(m.dst)
}
