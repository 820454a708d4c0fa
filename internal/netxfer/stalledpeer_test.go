package netxfer

import (
	"encoding/binary"
	"net"
	"testing"
	"time"
)

// A peer that keeps its connection open but stops reading it (a process
// frozen, its kernel still acknowledging) cannot hold a sender for ever:
// a frame not taken within FrameTimeout fails its connection, as the
// peer's own server cuts a frame that takes longer to arrive. Before,
// Notify blocked for good once the socket's buffers were full (and a
// Worker's loop with it: every request of the rank, and its Close).
func TestNotifyToStalledPeerIsBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		<-stop // reads nothing, ever
	}()
	a, _ := newHeapAgent(t, "a", 1<<16, Config{DisableLocal: true, DisableSameHost: true, Conns: 1, FrameTimeout: 300 * time.Millisecond})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	msg := make([]byte, 256<<10)
	ended := make(chan error, 1)
	go func() {
		for range 1024 { // 256 MiB: far past any socket buffer
			if err := a.Notify(name, msg); err != nil {
				ended <- err
				return
			}
		}
		ended <- nil
	}()
	select {
	case err := <-ended:
		if err == nil {
			t.Fatal("256 MiB of notifications went to a peer that reads nothing")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Notify to a peer that stopped reading still blocked after 10 s (FrameTimeout 300 ms)")
	}
}

// A READ whose answer begins and then stalls (the peer sent part of the
// payload and keeps the connection open) fails once the answer took
// FrameTimeout, as a frame the peer's server reads would: it does not
// stay in progress for ever, holding its request (and its blocks) with
// it.
func TestReadAnswerStalledMidFrameFails(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	a, _ := newHeapAgent(t, "a", 1<<16, Config{DisableLocal: true, DisableSameHost: true, Conns: 1, FrameTimeout: 300 * time.Millisecond})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	finished := make(chan struct{})
	fakeServer(t, ln, func(c net.Conn, id uint64, part uint32) {
		defer close(finished)
		var b [17]byte
		b[0] = tReadResp
		binary.LittleEndian.PutUint64(b[1:], id)
		binary.LittleEndian.PutUint32(b[9:], part)
		_, _ = c.Write(b[:])
		_, _ = c.Write(make([]byte, 1000)) // of 32 KiB, then nothing
		<-stop
	})
	id, err := a.Post(Read, name, []Desc{{Local: base, Remote: base, Len: 1 << 15}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	st, err := wait(t, a, id)
	close(stop)
	<-finished
	if st != Failed {
		t.Fatalf("READ whose answer stalled mid-payload: %v, %v after %v; want Failed", st, err, time.Since(start).Round(time.Millisecond))
	}
}

// A notification does not wait behind a part whose write stalls: Notify
// returns at once while the peer takes none of the part's bytes (a slow
// link, a peer frozen with its kernel still answering), and the part's
// FrameTimeout still ends it. Before, Notify took the connection's write
// side after the part, holding a Worker's loop (every request of the
// rank) for up to FrameTimeout, or for as long as a big part took to go
// out on a slow link.
func TestNotifyDoesNotWaitBehindStalledPart(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		<-stop // reads nothing, ever
	}()
	const size = 64 << 20 // far past any socket buffer
	a, _ := newHeapAgent(t, "a", size, Config{DisableLocal: true, DisableSameHost: true, Conns: 1, FrameTimeout: 60 * time.Second})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	id, err := a.Post(Write, name, []Desc{{Local: base, Remote: base, Len: size}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	// The part holds the connection's write side (its write blocked).
	a.mu.Lock()
	p := a.mu.peers[name]
	a.mu.Unlock()
	held := false
	for range 1000 {
		p.mu.Lock()
		var c *conn
		if len(p.conns) > 0 {
			c = p.conns[0]
		}
		p.mu.Unlock()
		if c != nil && !c.wmu.TryLock() {
			held = true
			break
		}
		if c != nil {
			c.wmu.Unlock()
		}
		time.Sleep(5 * time.Millisecond)
	}
	if !held {
		t.Fatal("the part never held its connection's write side")
	}
	ended := make(chan error, 1)
	go func() { ended <- a.Notify(name, []byte("done")) }()
	select {
	case err := <-ended:
		if err != nil {
			t.Fatalf("Notify beside a stalled part: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Notify still waited behind a stalled part after 10 s (FrameTimeout 60 s)")
	}
	if st, _ := a.State(id); st != InProgress {
		t.Fatalf("the stalled WRITE: %v; want still in progress", st)
	}
	_ = a.Close() // fails the part; the queued notification goes with it
	if st, _ := a.State(id); st != Failed {
		t.Fatalf("the stalled WRITE after Close: %v; want Failed", st)
	}
}
