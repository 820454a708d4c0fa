package netxfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"testing"
	"time"
)

// TestSuccessorAtSameAddressNotReached: a peer loaded from metadata of an
// agent that is gone (its process restarted) is not reached through the
// agent that now listens at its address (kvxferd with -data-port-base
// listens at the same port after a restart): a WRITE posted to the old
// agent fails, lands nothing in the new one's memory, and the new one
// hears no notification; a bare notification to the old one fails too.
func TestSuccessorAtSameAddressNotReached(t *testing.T) {
	const size = 1 << 16
	mk := func(name, listen string) (*Agent, []byte) {
		return newHeapAgent(t, name, size, Config{Listen: listen, DisableLocal: true, Conns: 3})
	}
	a, am := mk("a", "")
	old, _ := mk("old", "")
	name, err := a.LoadPeer(old.Metadata())
	if err != nil {
		t.Fatal(err)
	}
	addr := old.Addr()
	_ = old.Close()
	// Its successor at the same address (a new process: a new agent).
	var succ *Agent
	var sm []byte
	for try := 0; ; try++ {
		ag, err := New(Config{Name: fmt.Sprintf("%s-new-%d", t.Name(), rand.Uint64()), Listen: addr, DisableLocal: true, Conns: 3})
		if err == nil {
			t.Cleanup(func() { _ = ag.Close() })
			succ, sm = ag, make([]byte, size)
			break
		}
		if try > 50 {
			t.Skipf("cannot listen at %s again: %v", addr, err)
		}
		time.Sleep(20 * time.Millisecond)
	}
	if err := succ.Map(base, sm); err != nil {
		t.Fatal(err)
	}
	if err := succ.Register([]Region{{base, size}}); err != nil {
		t.Fatal(err)
	}
	for i := range am {
		am[i] = byte(i*7 + 1)
	}
	id, err := a.Post(Write, name, []Desc{{base, base, size / 2}, {base + size/2, base + size/2, size / 2}}, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	s, werr := wait(t, a, id)
	if s != Failed || !errors.Is(werr, ErrXferFailed) {
		t.Errorf("WRITE to the agent that is gone: state %v (%v), want Failed", s, werr)
	}
	nerr := a.Notify(name, []byte("hello"))
	time.Sleep(100 * time.Millisecond)
	if n := succ.Drain(nil); len(n) > 0 {
		t.Errorf("the successor heard %d notifications meant for the agent before it (first %q from %s)", len(n), n[0].Msg, n[0].From)
	}
	if !bytes.Equal(sm, make([]byte, size)) {
		t.Errorf("a WRITE to the agent that is gone landed in its successor's memory")
	}
	if nerr == nil {
		t.Logf("(a bare notification to the agent that is gone was sent without error)")
	}
}

// TestOneSidedNotifiesItsOwnPeer: a one-sided WRITE's notification goes
// to the peer the WRITE was posted to. A LoadPeer of the same name with
// other metadata while its launch runs (another agent now goes by the
// name) fails the WRITE, as it fails the two-sided ones in flight: the
// agent now known by the name hears nothing of bytes that landed in the
// memory of the one before.
func TestOneSidedNotifiesItsOwnPeer(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	other, err := New(Config{Name: fmt.Sprintf("%s-other-%d", t.Name(), rand.Uint64()), DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = other.Close() })
	pause := make(chan chan struct{}, 1)
	s.d.mu.Lock()
	s.d.pause = pause
	s.d.mu.Unlock()
	r := rand.New(rand.NewPCG(3, 4))
	id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{s.layout(r, []int{3, 9})}, []byte("req-1"))
	if err != nil {
		t.Fatal(err)
	}
	var resume chan struct{}
	select {
	case resume = <-pause:
	case <-time.After(10 * time.Second):
		t.Fatal("the WRITE did not go one-sided")
	}
	// The name now stands for another agent.
	if _, err := s.p.LoadPeer([]byte(metaPrefix + s.dd.Name() + "\n" + other.Addr())); err != nil {
		t.Fatal(err)
	}
	close(resume)
	st, werr := wait(t, s.p, id)
	time.Sleep(50 * time.Millisecond)
	if n := other.Drain(nil); len(n) > 0 {
		t.Errorf("the agent that took the name heard %q (the WRITE: %v, %v), a notification of bytes that landed in another agent's memory", n[0].Msg, st, werr)
	}
	if st != Failed {
		t.Errorf("WRITE to a peer reloaded while its launch ran: %v (%v), want Failed", st, werr)
	}
}

// writePart is part of parts of WRITE id: one piece of n bytes at remote
// (the payload follows), and notif.
func writePart(id uint64, part, parts uint32, remote uint64, payload []byte, notif string) [][]byte {
	h := []byte{tWrite}
	h = binary.LittleEndian.AppendUint64(h, id)
	h = binary.LittleEndian.AppendUint32(h, part)
	h = binary.LittleEndian.AppendUint32(h, parts)
	h = binary.LittleEndian.AppendUint32(h, 1)
	h = binary.LittleEndian.AppendUint32(h, uint32(len(notif)))
	h = append(h, notif...)
	h = binary.LittleEndian.AppendUint64(h, remote)
	h = binary.LittleEndian.AppendUint64(h, uint64(len(payload)))
	return [][]byte{h, payload}
}

// TestRestartedPeerSameNameLandingApart: a peer that restarted under the
// same agent name (Config.Name) while its predecessor's connections
// linger (its host went away without closing them) numbers its
// transfers from 1 again. A part of the new process's WRITE is not
// counted with a part its predecessor sent of the WRITE it numbered the
// same: the notification waits for the new WRITE's own parts, all of
// them.
func TestRestartedPeerSameNameLandingApart(t *testing.T) {
	const size = 1 << 16
	var answered atomic.Int32
	d, err := New(Config{Name: fmt.Sprintf("%s-d-%d", t.Name(), rand.Uint64()), DisableLocal: true,
		WireTrace: func(ev WireEvent, _ XferID, _ uint32) {
			if ev == WireAnswerSent {
				answered.Add(1)
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = d.Close() })
	dm := make([]byte, size)
	if err := d.Map(base, dm); err != nil {
		t.Fatal(err)
	}
	if err := d.Register([]Region{{base, size}}); err != nil {
		t.Fatal(err)
	}
	name := fmt.Sprintf("%s-p-%d", t.Name(), rand.Uint64())
	mkP := func() *Agent {
		p, err := New(Config{Name: name, DisableLocal: true, Conns: 1})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = p.Close() })
		if _, err := p.LoadPeer(d.Metadata()); err != nil {
			t.Fatal(err)
		}
		return p
	}
	send := func(p *Agent, bufs [][]byte) {
		t.Helper()
		pp, err := p.peer(d.Name())
		if err != nil {
			t.Fatal(err)
		}
		c, err := pp.conn()
		if err != nil {
			t.Fatal(err)
		}
		if err := c.writeFrame(bufs...); err != nil {
			t.Fatal(err)
		}
	}
	landed := func(n int) {
		t.Helper()
		waitFor(t, "the part landed", func() bool { return answered.Load() >= int32(n) })
	}
	// The first process sent part 0 of its WRITE 1 and went away, its
	// connection left open (the process is gone: its name is free).
	old := mkP()
	send(old, writePart(1, 0, 2, base, bytes.Repeat([]byte{0xaa}, 4096), "old"))
	landed(1)
	local.Lock()
	delete(local.agents, name)
	local.Unlock()
	// The new process's WRITE 1: part 1 came, part 0 not yet.
	p := mkP()
	send(p, writePart(1, 1, 2, base+8192, bytes.Repeat([]byte{0xbb}, 4096), "new"))
	landed(2)
	time.Sleep(20 * time.Millisecond)
	if n := d.Drain(nil); len(n) > 0 {
		t.Fatalf("D heard %q from %s after one of the two parts of the new process's WRITE landed (the other was its predecessor's)", n[0].Msg, n[0].From)
	}
}
