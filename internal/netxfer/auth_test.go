package netxfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/peerauth"
)

func auth(t testing.TB, secret string) *peerauth.Authenticator {
	t.Helper()
	a, err := peerauth.New([]byte(secret))
	if err != nil {
		t.Fatal(err)
	}
	return a
}

// authPair returns two agents (TCP between them) with one mapped,
// registered region each, authenticating with their own Authenticators.
func authPair(t *testing.T, size int, aa, ba *peerauth.Authenticator, frame time.Duration) (a, b *Agent, am, bm []byte) {
	t.Helper()
	mk := func(name string, au *peerauth.Authenticator) (*Agent, []byte) {
		ag, err := New(Config{Name: fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), DisableLocal: true, Conns: 2,
			Auth: au, FrameTimeout: frame})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ag.Close() })
		mem := make([]byte, size)
		if err := ag.Map(base, mem); err != nil {
			t.Fatal(err)
		}
		if err := ag.Register([]Region{{base, uint64(size)}}); err != nil {
			t.Fatal(err)
		}
		return ag, mem
	}
	a, am = mk("a", aa)
	b, bm = mk("b", ba)
	if _, err := a.LoadPeer(b.Metadata()); err != nil {
		t.Fatal(err)
	}
	if _, err := b.LoadPeer(a.Metadata()); err != nil {
		t.Fatal(err)
	}
	return a, b, am, bm
}

// Agents with the same secret move bytes and notifications as before;
// with another secret every transfer fails with the reason and nothing
// lands.
func TestAuthenticatedTransfers(t *testing.T) {
	const s = "0123456789abcdef-shared"
	a, b, am, bm := authPair(t, 1<<16, auth(t, s), auth(t, s), 0)
	fill(am, 1)
	id, err := a.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 1 << 15}}, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "done" || n[0].From != a.Name() {
		t.Fatalf("notifications = %+v", n)
	}
	if st, err := wait(t, a, id); st != Done || !bytes.Equal(bm[:1<<15], am[:1<<15]) {
		t.Fatalf("write: %v, %v; bytes equal %v", st, err, bytes.Equal(bm[:1<<15], am[:1<<15]))
	}
	rid, err := a.Post(Read, b.Name(), []Desc{{Local: base + 1<<15, Remote: base, Len: 1 << 15}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, rid); st != Done || !bytes.Equal(am[1<<15:], am[:1<<15]) {
		t.Fatalf("read: %v, %v", st, err)
	}
	if err := a.Notify(b.Name(), []byte("hi")); err != nil {
		t.Fatal(err)
	}
	if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "hi" {
		t.Fatalf("notify: %+v", n)
	}

	x, y, xm, ym := authPair(t, 1<<16, auth(t, s), auth(t, "0123456789abcdef-other"), 0)
	fill(xm, 3)
	before := bytes.Clone(ym)
	id, err = x.Post(Write, y.Name(), []Desc{{Local: base, Remote: base, Len: 4096}}, []byte("done"))
	if err == nil {
		var st State
		st, err = wait(t, x, id)
		if st != Failed {
			t.Fatalf("write with another secret: state %v", st)
		}
	}
	if !errors.Is(err, peerauth.ErrAuth) || !errors.Is(err, ErrXferFailed) {
		t.Errorf("write with another secret: %v, want ErrAuth and ErrXferFailed", err)
	}
	if !bytes.Equal(ym, before) || len(y.Drain(nil)) != 0 {
		t.Error("bytes or a notification landed from a peer with another secret")
	}
}

// Without the secret, a client speaking the old plain hello (or any
// name) writes nothing and is disconnected; a client with the secret
// cannot pose as another agent in its hello.
func TestUnauthenticatedClientRefused(t *testing.T) {
	const s = "0123456789abcdef-shared"
	_, b, _, bm := authPair(t, 4096, auth(t, s), auth(t, s), 0)
	before := bytes.Clone(bm)
	hello := func(name string) []byte {
		h := append([]byte(magic), version)
		h = binary.LittleEndian.AppendUint16(h, uint16(len(name)))
		return append(h, name...)
	}
	write := func(name string) []byte { return append(hello(name), rawWrite()...) }
	drained := func(nc net.Conn) {
		_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		buf := make([]byte, 4096)
		for {
			if _, err := nc.Read(buf); err != nil {
				if ne, ok := err.(net.Error); ok && ne.Timeout() {
					t.Error("the server kept the connection open")
				}
				return
			}
		}
	}
	nc, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	_, _ = nc.Write(write("evil"))
	drained(nc)
	nc.Close()
	// With the secret, but naming another agent in the hello.
	nc, err = net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	if err := auth(t, s).Client(nc, "data", "insider"); err != nil {
		t.Fatal(err)
	}
	_, _ = nc.Write(write("someone-else"))
	drained(nc)
	nc.Close()
	time.Sleep(50 * time.Millisecond)
	if !bytes.Equal(bm, before) {
		t.Error("an unauthenticated or mis-named client wrote into memory")
	}
	if n := b.Drain(nil); len(n) != 0 {
		t.Errorf("forged notifications delivered: %+v", n)
	}
}

// A peer that starts a frame and stalls is cut off after FrameTimeout;
// an idle connection between frames is not.
func TestStalledFrameCutOff(t *testing.T) {
	a, b, _, _ := authPair(t, 4096, nil, nil, 200*time.Millisecond)
	_ = a
	nc, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	h := append([]byte(magic), version)
	h = binary.LittleEndian.AppendUint16(h, 4)
	h = append(h, "slow"...)
	if _, err := nc.Write(h); err != nil {
		t.Fatal(err)
	}
	time.Sleep(400 * time.Millisecond)                         // idle between frames: kept
	if _, err := nc.Write([]byte{tNotif, 10, 0}); err != nil { // a frame begun, its length half sent
		t.Fatalf("the idle connection was cut: %v", err)
	}
	start := time.Now()
	_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := nc.Read(make([]byte, 1)); err == nil {
		t.Fatal("the server answered a half frame")
	} else if ne, ok := err.(net.Error); ok && ne.Timeout() {
		t.Fatal("the server kept a stalled frame open for 10 s")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("cut off after %v", d)
	}
}

// FuzzServeHello: whatever bytes open a connection, serve never panics
// and lands nothing.
func FuzzServeHello(f *testing.F) {
	f.Add([]byte("KVXN\x01\x04\x00evil\x01"), true)
	f.Add([]byte("KVXA\x01\x04data\x04evil"), true)
	f.Add([]byte("KVXN\x01\x04\x00evil\x03\x02\x00\x00\x00hi"), false)
	// A bound hello (versionBound) for an agent this is not, by a name
	// that is not the key's, and with a proof of zeros.
	f.Add(append([]byte("KVXN\x03\x04\x00evil\x06\x00target\x01\x00i"), make([]byte, 32+32+64)...), false)
	f.Add(append([]byte("KVXN\x03\x25\x00evil~0123456789abcdef0123456789abcdef\x00\x00\x00\x00"), make([]byte, 32+32+64)...), false)
	a1, err := New(Config{Name: "fuzz-auth", DisableLocal: true, Auth: auth(f, "0123456789abcdef-fuzz"), FrameTimeout: 100 * time.Millisecond})
	if err != nil {
		f.Fatal(err)
	}
	defer a1.Close()
	a1.cfg.Auth.Timeout = 100 * time.Millisecond
	a2, err := New(Config{Name: "fuzz-plain", DisableLocal: true, FrameTimeout: 100 * time.Millisecond})
	if err != nil {
		f.Fatal(err)
	}
	defer a2.Close()
	mem := make([]byte, 4096)
	for _, ag := range []*Agent{a1, a2} {
		if err := ag.Map(base, mem); err != nil {
			f.Fatal(err)
		}
		if err := ag.Register([]Region{{base, 4096}}); err != nil {
			f.Fatal(err)
		}
	}
	f.Fuzz(func(t *testing.T, in []byte, authed bool) {
		ag := a2
		if authed {
			ag = a1
		}
		cc, sc := net.Pipe()
		ag.mu.Lock()
		ag.mu.incoming[sc] = true
		ag.wg.Add(1)
		ag.mu.Unlock()
		done := make(chan struct{})
		go func() { ag.serve(sc, nil); close(done) }()
		go func() {
			buf := make([]byte, 4096)
			for {
				if _, err := cc.Read(buf); err != nil {
					return
				}
			}
		}()
		_, _ = cc.Write(in)
		cc.Close()
		<-done
		if authed {
			for _, b := range mem {
				if b != 0 {
					t.Fatalf("unauthenticated bytes landed: %q", in)
				}
			}
			if n := ag.Drain(nil); len(n) != 0 {
				t.Fatalf("unauthenticated notification: %+v", n)
			}
		} else {
			clear(mem)
			ag.Drain(nil)
		}
	})
}

// A peer that starts multi-part WRITEs and never finishes them cannot
// grow the agent's table of unfinished writes past maxLanding: past it,
// its connection is dropped (and with its last connection, what it left
// unfinished is forgotten).
func TestUnfinishedWritesBounded(t *testing.T) {
	_, b, _, _ := authPair(t, 4096, nil, nil, 0)
	nc, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	h := append([]byte(magic), version)
	h = binary.LittleEndian.AppendUint16(h, 4)
	h = append(h, "slow"...)
	go func() { // answers are read and dropped
		buf := make([]byte, 1<<16)
		for {
			if _, err := nc.Read(buf); err != nil {
				return
			}
		}
	}()
	var w []byte
	w = append(w, h...)
	for id := range maxLanding + 1 {
		w = append(w, tWrite)
		w = binary.LittleEndian.AppendUint64(w, uint64(id+1))
		w = binary.LittleEndian.AppendUint32(w, 0) // part 0
		w = binary.LittleEndian.AppendUint32(w, 2) // of 2
		w = binary.LittleEndian.AppendUint32(w, 0) // no descriptors
		w = binary.LittleEndian.AppendUint32(w, 0) // no notification
	}
	_, _ = nc.Write(w[:len(w)-25]) // the bound, then (below) one past it
	deadline := time.Now().Add(20 * time.Second)
	for time.Now().Before(deadline) {
		b.mu.Lock()
		n := len(b.mu.landing)
		b.mu.Unlock()
		if n == maxLanding {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	time.Sleep(100 * time.Millisecond)
	b.mu.Lock()
	n := len(b.mu.landing)
	b.mu.Unlock()
	if n != maxLanding {
		t.Errorf("unfinished writes = %d, want the bound %d", n, maxLanding)
	}
	_, _ = nc.Write(w[len(w)-25:]) // one too many
	for time.Now().Before(deadline) {
		b.mu.Lock()
		n = len(b.mu.landing)
		b.mu.Unlock()
		if n != maxLanding {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if n != 0 {
		t.Errorf("unfinished writes = %d past the bound, want 0 (dropped with the connection)", n)
	}
	// The server closes its side (after it dropped the landings: a
	// loaded machine can hold it between the two): a write fails once
	// its close is in. Waited for, not slept for 100 ms.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := nc.Write([]byte{tNotif, 0, 0, 0, 0}); err != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Error("the connection past the bound stayed open 10 s")
			break
		}
	}
}

// Out of descriptors for a moment, the agent keeps accepting once some
// are free again: the accept loop retries instead of stopping for good.
func TestAcceptSurvivesDescriptorExhaustion(t *testing.T) {
	a, b, am, bm := authPair(t, 4096, nil, nil, 0)
	var old unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	entries, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Skip("no /proc/self/fd:", err)
	}
	lim := old
	lim.Cur = uint64(len(entries) + 40)
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &lim); err != nil {
		t.Fatal(err)
	}
	var idle []net.Conn
	for range 200 { // each takes a descriptor here and one in the agent
		c, err := net.Dial("tcp", b.Addr())
		if err != nil {
			break
		}
		idle = append(idle, c)
	}
	deadline := time.Now().Add(10 * time.Second)
	for b.AcceptErrors() == 0 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	for _, c := range idle {
		c.Close()
	}
	if err := unix.Setrlimit(unix.RLIMIT_NOFILE, &old); err != nil {
		t.Fatal(err)
	}
	if b.AcceptErrors() == 0 {
		t.Fatalf("accept never failed with %d idle connections under a limit of %d descriptors", len(idle), lim.Cur)
	}
	// The agent still serves.
	fill(am, 4)
	id, err := a.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Done || !bytes.Equal(am, bm) {
		t.Errorf("write after descriptors ran out: %v, %v", st, err)
	}
}
