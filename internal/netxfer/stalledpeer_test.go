package netxfer

import (
	"encoding/binary"
	"errors"
	"net"
	"strings"
	"syscall"
	"testing"
	"time"
)

// silentPeer returns the address of a peer that takes one connection
// and reads nothing from it, ever (until the test ends).
func silentPeer(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	done := make(chan struct{})
	t.Cleanup(func() {
		ln.Close()
		close(stop)
		<-done
	})
	go func() {
		defer close(done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		<-stop
	}()
	return ln.Addr().String()
}

// A peer that keeps its connection open but stops reading it (a process
// frozen, its kernel still acknowledging) cannot hold a sender for ever:
// a frame not taken within FrameTimeout fails its connection, as the
// peer's own server cuts a frame that takes longer to arrive. Before,
// Notify blocked for good once the socket's buffers were full (and a
// Worker's loop with it: every request of the rank, and its Close).
func TestNotifyToStalledPeerIsBounded(t *testing.T) {
	addr := silentPeer(t)
	a, _ := newHeapAgent(t, "a", 1<<16, Config{DisableLocal: true, DisableSameHost: true, Conns: 1, FrameTimeout: 300 * time.Millisecond})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + addr))
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
	addr := silentPeer(t)
	const size = 64 << 20 // far past any socket buffer
	a, _ := newHeapAgent(t, "a", size, Config{DisableLocal: true, DisableSameHost: true, Conns: 1, FrameTimeout: 60 * time.Second})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + addr))
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

// blackhole returns a loopback address whose SYNs go unanswered, as a
// host that is down: a listening socket with a backlog of 0 whose queue
// is full.
func blackhole(t *testing.T) string {
	t.Helper()
	fd, err := syscall.Socket(syscall.AF_INET, syscall.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	if err := syscall.Bind(fd, &syscall.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Listen(fd, 0); err != nil {
		t.Fatal(err)
	}
	sa, err := syscall.Getsockname(fd)
	if err != nil {
		t.Fatal(err)
	}
	addr := (&net.TCPAddr{IP: net.IPv4(127, 0, 0, 1), Port: sa.(*syscall.SockaddrInet4).Port}).String()
	for range 16 {
		c, err := net.DialTimeout("tcp", addr, 200*time.Millisecond)
		if err != nil {
			return addr // the queue is full: this dial went unanswered
		}
		t.Cleanup(func() { c.Close() })
	}
	t.Fatal("the listen queue never filled")
	return ""
}

// A notification to a peer whose host does not answer (SYNs dropped)
// does not hold its caller (a Worker's loop: every request of the rank)
// for the dial's DialTimeout: it waits a moment for the dial, then waits
// queued for the connection, and is dropped with the dial. Once a dial
// took DialTimeout to fail, notifications fail at once for a while, so
// the caller hears the peer is unreachable. Before, each Notify dialed on
// its caller's goroutine, holding it DialTimeout every time.
func TestNotifyToUnansweringHostDoesNotWaitForTheDial(t *testing.T) {
	// "At once" is against DialTimeout: a call that waited for the dial
	// takes all of it, one that did not takes dialWait (100 ms). At 3 s
	// the bound (half of it) left 1.4 s for a loaded machine to delay a
	// correct call; at 10 s, 4.9 s.
	const dialTimeout = 10 * time.Second
	a, _ := newHeapAgent(t, "a", 1<<16, Config{DisableLocal: true, DisableSameHost: true, DialTimeout: dialTimeout})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + blackhole(t)))
	if err != nil {
		t.Fatal(err)
	}
	notify := func(what string) (time.Duration, error) {
		t.Helper()
		t0 := time.Now()
		err := a.Notify(name, []byte(what))
		return time.Since(t0), err
	}
	for i := range 3 {
		if took, err := notify("queued"); err != nil || took > dialTimeout/2 {
			t.Fatalf("Notify %d while the first dial is under way: %v after %v; want nil at once (DialTimeout %v)", i, err, took, dialTimeout)
		}
	}
	// The dial ends (failed) after DialTimeout: notifications then fail at
	// once, naming the dial's error.
	deadline := time.Now().Add(3 * dialTimeout)
	for {
		took, err := notify("after")
		if took > dialTimeout/2 {
			t.Fatalf("Notify took %v (DialTimeout %v)", took, dialTimeout)
		}
		if err != nil {
			if !errors.Is(err, ErrXferFailed) || !strings.Contains(err.Error(), "dial") {
				t.Fatalf("Notify after the dial failed: %v; want the dial's error", err)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("Notify still succeeded %v after the first call (DialTimeout %v)", 3*dialTimeout, dialTimeout)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// A notification to a peer that refuses the connection (nothing listens:
// a process gone) fails on the call, as before: the dial ends well
// within the wait.
func TestNotifyToRefusingPeerFailsOnTheCall(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	a, _ := newHeapAgent(t, "a", 1<<16, Config{DisableLocal: true, DisableSameHost: true})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + addr))
	if err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		if err := a.Notify(name, []byte("x")); !errors.Is(err, ErrXferFailed) || !strings.Contains(err.Error(), "refused") {
			t.Fatalf("Notify %d to a refusing peer: %v; want the dial's refusal", i, err)
		}
	}
}
