package netxfer

import (
	"bytes"
	"encoding/binary"
	"io"
	"math/rand/v2"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// lateAnswerFence admits everything, a READ only once open is closed
// (the producer answers late); admitted receives a value as a READ waits
// for it, and done one as an admission ends.
type lateAnswerFence struct {
	op       Op // the op held (0: Read)
	open     chan struct{}
	admitted chan struct{}
	done     chan struct{}
	mu       sync.Mutex
	n        uint64
}

func newLateAnswerFence() *lateAnswerFence {
	return &lateAnswerFence{open: make(chan struct{}), admitted: make(chan struct{}, 16), done: make(chan struct{}, 16)}
}

func (f *lateAnswerFence) Check(string, Op, uint64, uint64) Verdict { return Allow }
func (f *lateAnswerFence) Admit(_ string, op Op, _ []Region, _ []byte, _ func()) (Verdict, int, uint64) {
	if op == Read && f.op == 0 || f.op != 0 && op == f.op {
		f.admitted <- struct{}{}
		select {
		case <-f.open:
		case <-time.After(10 * time.Second): // the test ended without it
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	return Allow, -1, f.n
}
func (f *lateAnswerFence) Done(uint64) {
	select {
	case f.done <- struct{}{}:
	default:
	}
}

func recv(t *testing.T, ch <-chan struct{}, what string) {
	t.Helper()
	select {
	case <-ch:
	case <-time.After(10 * time.Second):
		t.Fatalf("waited 10 s for %s", what)
	}
}

// stays fails the test if b[:n] does not hold only v for the next 300 ms
// (what a released READ would land meanwhile).
func stays(t *testing.T, what string, get func() []byte, v byte) {
	t.Helper()
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		for i, c := range get() {
			if c != v {
				t.Fatalf("%s: byte %d is %#x after the READ was released and the blocks reused (%#x): the released READ landed in them", what, i, c, v)
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A READ released before its answer came (the consumer gave it up: its
// producer deemed gone, a close) lands nothing once its answer comes: the
// Worker reports the request and the engine reuses its blocks as soon as
// Release returns. Over TCP the answer is drained, on the same-host path
// acknowledged without a copy; the connection serves the next READ.
func TestReleasedReadLandsNothing(t *testing.T) {
	for _, path := range []string{"tcp", "same-host"} {
		t.Run(path, func(t *testing.T) {
			var a, b *Agent
			var am, bm []byte
			if path == "tcp" {
				a, b, am, bm = pairOf(t, 1<<16, false)
			} else {
				a, b, am, bm = localPair(t, 1<<16, Config{})
			}
			f := newLateAnswerFence()
			if err := b.SetGuard(f); err != nil {
				t.Fatal(err)
			}
			fill(bm, 3)
			id, err := a.Post(Read, b.Name(), []Desc{{Local: base, Remote: base, Len: 4096}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			recv(t, f.admitted, "the READ to reach the producer")
			if err := a.Release(id); err != nil {
				t.Fatal(err)
			}
			// The engine reuses the blocks (the next request's KV).
			for i := range am[:4096] {
				am[i] = 0xdd
			}
			close(f.open)
			recv(t, f.done, "the producer to answer")
			stays(t, path, func() []byte { return am[:4096] }, 0xdd)
			if path == "same-host" && a.SameHostParts() != 0 {
				t.Fatalf("a copied %d same-host parts, want none", a.SameHostParts())
			}
			// The connection still serves.
			id, err = a.Post(Read, b.Name(), []Desc{{Local: base + 8192, Remote: base + 8192, Len: 4096}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if st, err := wait(t, a, id); st != Done {
				t.Fatalf("the READ after: %v, %v", st, err)
			}
			if !bytes.Equal(am[8192:12288], bm[8192:12288]) {
				t.Fatal("the READ after landed wrong bytes")
			}
		})
	}
}

// A READ released while its same-host copy is under way (the reader's GPU
// starts it 100 ms late) is waited for: Release returns once the copy
// ended, so the engine's reuse of the blocks after it is not overwritten
// by the READ's bytes.
func TestReleaseWaitsForReadCopy(t *testing.T) {
	a, b, _, g, gpu, ptr, _ := readHoldSetup(t, 100*time.Millisecond, Config{})
	id, err := a.Post(Read, b.Name(), []Desc{{Local: ptr, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	recv(t, gpu.started, "the reader's copy to start") // it has its answer and is copying
	if err := a.Release(id); err != nil {
		t.Fatal(err)
	}
	g.mu.Lock()
	for i, m := 0, g.at(ptr, 4096); i < len(m); i++ {
		m[i] = 0xdd
	}
	g.mu.Unlock()
	stays(t, "GPU memory", func() []byte { return g.view(ptr, 4096) }, 0xdd)
}

// A READ released while its answer's payload is on the way over TCP (the
// producer sent part of it, then stalls) is cut short: Release does not
// wait for the stalled payload, and what comes after it is drained, not
// landed in blocks the engine reuses.
func TestReleaseCutsReadPayload(t *testing.T) {
	ln, a, mem, name := besideFakeTCP(t)
	half, rest := make(chan struct{}), make(chan struct{})
	finished := make(chan struct{})
	fakeServer(t, ln, func(c net.Conn, id uint64, part uint32) {
		defer close(finished)
		var b [17]byte
		b[0] = tReadResp
		binary.LittleEndian.PutUint64(b[1:], id)
		binary.LittleEndian.PutUint32(b[9:], part)
		_, _ = c.Write(b[:])
		_, _ = c.Write(bytes.Repeat([]byte{0xab}, 1000)) // of 32 KiB
		close(half)
		<-rest
		_, _ = c.Write(bytes.Repeat([]byte{0xab}, 1<<15-1000))
		time.Sleep(400 * time.Millisecond) // the connection open while the test looks
	})
	id, err := a.Post(Read, name, []Desc{{Local: base, Remote: base, Len: 1 << 15}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	recv(t, half, "the first bytes of the answer")
	time.Sleep(20 * time.Millisecond) // the reader waits for the rest
	released := make(chan error, 1)
	go func() { released <- a.Release(id) }()
	select {
	case err := <-released:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		close(rest)
		t.Fatal("Release waited 5 s for a stalled READ payload")
	}
	for i := range mem[:1<<15] {
		mem[i] = 0xdd
	}
	close(rest)
	stays(t, "memory", func() []byte { return mem[:1<<15] }, 0xdd)
	recv(t, finished, "the fake server to end")
}

// budgetProxy forwards TCP connections to target: what the client sends
// only up to budget bytes until heal is closed (a link that goes quiet
// mid-frame and heals later), what the server sends freely.
func budgetProxy(t *testing.T, target string, budget int64, heal <-chan struct{}) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var conns []net.Conn
	t.Cleanup(func() {
		_ = ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range conns {
			_ = c.Close()
		}
	})
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			s, err := net.Dial("tcp", target)
			if err != nil {
				_ = c.Close()
				continue
			}
			mu.Lock()
			conns = append(conns, c, s)
			mu.Unlock()
			go func() { _, _ = io.Copy(c, s); _ = c.Close() }()
			go func() {
				defer s.Close()
				if _, err := io.CopyN(s, c, budget); err != nil {
					return
				}
				<-heal
				_, _ = io.Copy(s, c)
			}()
		}
	}()
	return ln.Addr().String()
}

// A WRITE released while its payload is still going out over TCP (the
// link stalled mid-part; a producer Worker that closes or breaks releases
// its WRITEs and reports its requests, and the engine reuses the blocks)
// sends nothing of what the blocks hold from then on: when the link
// heals, the consumer must not get the reused bytes, let alone the
// transfer's notification as if its bytes had landed.
func TestReleasedWriteSendsNoReusedBytes(t *testing.T) {
	const size = 32 << 20
	mk := func(name string) (*Agent, []byte) {
		return newHeapAgent(t, name, size, Config{DisableLocal: true, DisableSameHost: true, Conns: 1})
	}
	a, am := mk("p")
	b, bm := mk("d")
	heal := make(chan struct{})
	var once sync.Once
	healNow := func() { once.Do(func() { close(heal) }) }
	t.Cleanup(healNow)
	_, addr, _ := strings.Cut(strings.TrimPrefix(string(b.Metadata()), metaPrefix), "\n")
	addr, _, _ = strings.Cut(addr, "\n")
	name, err := a.LoadPeer([]byte(metaPrefix + b.Name() + "\n" + budgetProxy(t, addr, 1<<20, heal)))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := b.LoadPeer(a.Metadata()); err != nil {
		t.Fatal(err)
	}
	for i := range am {
		am[i] = byte(i%251) | 1 // never 0xdd... nor 0
	}
	for i := range am {
		if am[i] == 0xdd {
			am[i] = 0x11
		}
	}
	id, err := a.Post(Write, name, []Desc{{Local: base, Remote: base, Len: size}}, []byte("w"))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(200 * time.Millisecond) // the payload fills the buffers and stalls
	if st, _ := a.State(id); st != InProgress {
		t.Fatalf("WRITE over a stalled link: %v, want in progress", st)
	}
	released := make(chan error, 1)
	go func() { released <- a.Release(id) }()
	select {
	case err := <-released:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("Release waited 5 s for a stalled WRITE")
	}
	// The engine reuses the blocks.
	for i := range am {
		am[i] = 0xdd
	}
	healNow()
	deadline := time.Now().Add(time.Second)
	for time.Now().Before(deadline) {
		if n := b.Drain(nil); len(n) > 0 {
			t.Errorf("the consumer got the notification of a WRITE released mid-payload: %q", n[0].Msg)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if i := bytes.IndexByte(bm, 0xdd); i >= 0 {
		t.Fatalf("byte %d of the consumer's memory holds the reused blocks' bytes: a released WRITE sent them", i)
	}
}

// A one-sided WRITE released while its gated launch runs (its first CTA
// inside the gate, its copy not done) is waited for: Release returns only
// once the launch read what it reads, so the engine's reuse of P's blocks
// after it never reaches D's memory.
func TestReleaseWaitsForOneSidedLaunch(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	r := rand.New(rand.NewPCG(7, 8))
	s.d.pause = make(chan chan struct{})
	l := s.layout(r, []int{3, 4, 9})
	ds := ExpandLayouts(nil, []Layout{l})
	var want [][]byte
	for _, d := range ds {
		want = append(want, s.g.view(d.Local, d.Len))
	}
	id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{l}, []byte("req-1"))
	if err != nil {
		t.Fatal(err)
	}
	var inside chan struct{}
	select {
	case inside = <-s.d.pause: // the first CTA is inside, its copy not done
	case <-time.After(10 * time.Second):
		t.Fatal("no CTA of a one-sided launch within 10 s (did the WRITE go two-sided?)")
	}
	var once sync.Once
	letGo := func() { once.Do(func() { close(inside) }) }
	t.Cleanup(letGo)
	released := make(chan struct{})
	go func() {
		_ = s.p.Release(id)
		close(released)
	}()
	select {
	case <-released:
	case <-time.After(50 * time.Millisecond):
	}
	// The engine reuses P's blocks once Release returned (or the launch
	// goes on, below).
	reuse := func() {
		s.g.mu.Lock()
		defer s.g.mu.Unlock()
		for _, d := range ds {
			m := s.g.at(d.Local, d.Len)
			for i := range m {
				m[i] = 0xdd
			}
		}
	}
	select {
	case <-released:
		reuse() // Release did not wait for the launch
		letGo()
	default:
		letGo()
		recv(t, released, "Release to return once the launch ended")
		reuse()
	}
	if s.p.OneSidedWrites() != 1 {
		t.Fatalf("one-sided WRITEs %d, want 1", s.p.OneSidedWrites())
	}
	waitFor(t, "D hears the WRITE", func() bool { return len(s.dd.Drain(nil)) > 0 })
	for i, d := range ds {
		if !bytes.Equal(s.g.view(d.Remote, d.Len), want[i]) {
			t.Fatalf("D's piece %d [%#x, +%d) is not P's bytes: the launch read P's blocks after Release returned and the engine reused them", i, d.Remote, d.Len)
		}
	}
}

// A same-host WRITE released after its part went out, before the
// receiver copied it out of the sender's memory (its admission held up):
// the engine reuses the sender's blocks once Release returned, so the
// receiver must not count what it then copies: no notification, as if
// the bytes of the transfer had landed.
func TestReleasedSameHostWriteNotCounted(t *testing.T) {
	a, b, am, _ := localPair(t, 1<<16, Config{})
	f := newLateAnswerFence()
	f.op = Write
	if err := b.SetGuard(f); err != nil {
		t.Fatal(err)
	}
	fill(am, 5)
	id, err := a.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 4096}}, []byte("w"))
	if err != nil {
		t.Fatal(err)
	}
	recv(t, f.admitted, "the part to reach the receiver")
	released := make(chan error, 1)
	go func() { released <- a.Release(id) }()
	select {
	case err := <-released:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(5 * time.Second):
		close(f.open)
		t.Fatal("Release waited 5 s for the receiver")
	}
	for i := range am[:4096] {
		am[i] = 0xdd // the engine reuses the blocks
	}
	close(f.open)
	deadline := time.Now().Add(300 * time.Millisecond)
	for time.Now().Before(deadline) {
		if n := b.Drain(nil); len(n) > 0 {
			t.Fatalf("the receiver counted a WRITE whose sender released it before the copy (notification %q): it landed the reused blocks as the transfer's bytes", n[0].Msg)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if b.SameHostParts() == 0 && a.SameHostParts() == 0 {
		t.Log("(no same-host part counted)")
	}
}

// InvalidatePeer ends the peer's transfers in flight: once it returned,
// none of their bytes land (kvxfer.Backend's contract), so a caller that
// reports them failed then may let the engine reuse their blocks. A READ
// whose same-host copy is under way (the reader's GPU starts it 100 ms
// late) is waited for, and has failed by then.
func TestInvalidatePeerWaitsForReadCopy(t *testing.T) {
	a, b, _, g, gpu, ptr, _ := readHoldSetup(t, 100*time.Millisecond, Config{})
	id, err := a.Post(Read, b.Name(), []Desc{{Local: ptr, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	recv(t, gpu.started, "the reader's copy to start") // it has its answer and is copying
	if err := a.InvalidatePeer(b.Name()); err != nil {
		t.Fatal(err)
	}
	if st, err := a.State(id); st != Failed {
		t.Errorf("READ after InvalidatePeer returned: %v, %v, want Failed", st, err)
	}
	g.mu.Lock()
	for i, m := 0, g.at(ptr, 4096); i < len(m); i++ {
		m[i] = 0xdd
	}
	g.mu.Unlock()
	stays(t, "GPU memory", func() []byte { return g.view(ptr, 4096) }, 0xdd)
}
