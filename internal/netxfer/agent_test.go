package netxfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

// pairOf returns two agents with one mapped, registered region each.
func pairOf(t *testing.T, size int, direct bool) (a, b *Agent, am, bm []byte) {
	t.Helper()
	mk := func(name string) (*Agent, []byte) {
		ag, err := New(Config{Name: fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), DisableLocal: !direct, Conns: 3})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ag.Close() })
		mem := make([]byte, size)
		base := uint64(0x1000_0000)
		if err := ag.Map(base, mem); err != nil {
			t.Fatal(err)
		}
		if err := ag.Register([]Region{{base, uint64(size)}}); err != nil {
			t.Fatal(err)
		}
		return ag, mem
	}
	a, am = mk("a")
	b, bm = mk("b")
	if _, err := a.LoadPeer(b.Metadata()); err != nil {
		t.Fatal(err)
	}
	if _, err := b.LoadPeer(a.Metadata()); err != nil {
		t.Fatal(err)
	}
	return a, b, am, bm
}

const base = 0x1000_0000

// wait polls a transfer until it leaves InProgress (bounded).
func wait(t *testing.T, a *Agent, id XferID) (State, error) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		s, err := a.State(id)
		if s != InProgress || time.Now().After(deadline) {
			return s, err
		}
		select {
		case <-a.Events():
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func waitNotif(t *testing.T, a *Agent) []Notif {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for {
		if n := a.Drain(nil); len(n) > 0 || time.Now().After(deadline) {
			return n
		}
		select {
		case <-a.Events():
		case <-time.After(10 * time.Millisecond):
		}
	}
}

func fill(b []byte, seed uint64) {
	r := rand.New(rand.NewPCG(seed, 1))
	for i := range b {
		b[i] = byte(r.Uint32())
	}
}

func TestWriteAndRead(t *testing.T) {
	for _, direct := range []bool{false, true} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			a, b, am, bm := pairOf(t, 1<<20, direct)
			fill(am, 1)
			fill(bm, 2)
			var descs []Desc
			for i := range 64 { // scattered 4 KiB pieces
				descs = append(descs, Desc{Local: base + uint64(i*8192), Remote: base + uint64((63-i)*8192+100), Len: 4096})
			}
			want := bytes.Clone(bm)
			for _, d := range descs {
				copy(want[d.Remote-base:d.Remote-base+d.Len], am[d.Local-base:])
			}
			id, err := a.Post(Write, b.Name(), descs, []byte("done"))
			if err != nil {
				t.Fatal(err)
			}
			n := waitNotif(t, b)
			// The notification comes after the bytes.
			if len(n) != 1 || string(n[0].Msg) != "done" || n[0].From != a.Name() {
				t.Fatalf("notifications = %+v, want one 'done' from %s", n, a.Name())
			}
			if !bytes.Equal(bm, want) {
				t.Fatal("destination bytes differ after the notification")
			}
			if s, err := wait(t, a, id); s != Done || err != nil {
				t.Fatalf("write state = %v, %v; want done", s, err)
			}
			// Read them back into a fresh place.
			var back []Desc
			for i, d := range descs {
				back = append(back, Desc{Local: base + 600_000 + uint64(i)*4096, Remote: d.Remote, Len: d.Len})
			}
			rid, err := a.Post(Read, b.Name(), back, []byte("read"))
			if err != nil {
				t.Fatal(err)
			}
			if s, err := wait(t, a, rid); s != Done || err != nil {
				t.Fatalf("read state = %v, %v; want done", s, err)
			}
			for i, d := range descs {
				got := am[600_000+i*4096 : 600_000+(i+1)*4096]
				if !bytes.Equal(got, am[d.Local-base:d.Local-base+d.Len]) {
					t.Fatalf("read piece %d differs", i)
				}
			}
			if n := b.Drain(nil); len(n) != 1 || string(n[0].Msg) != "read" {
				t.Errorf("READ notification at the source = %+v, want 'read'", n)
			}
			_ = a.Release(id)
			_ = a.Release(rid)
		})
	}
}

// A large transfer over several connections.
func TestLargeTransfer(t *testing.T) {
	size := 64 << 20
	if testing.Short() {
		size = 8 << 20
	}
	a, b, am, bm := pairOf(t, size, false)
	fill(am, 3)
	descs := []Desc{}
	for off := 0; off < size; off += 1 << 20 {
		descs = append(descs, Desc{Local: base + uint64(off), Remote: base + uint64(off), Len: 1 << 20})
	}
	id, err := a.Post(Write, b.Name(), descs, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done || err != nil {
		t.Fatalf("state = %v, %v", s, err)
	}
	if !bytes.Equal(am, bm) {
		t.Fatal("bytes differ")
	}
}

// Remote ranges outside registered memory fail the transfer and move
// nothing; local ones are refused at Post.
func TestBoundsChecked(t *testing.T) {
	for _, direct := range []bool{false, true} {
		t.Run(fmt.Sprintf("direct=%v", direct), func(t *testing.T) {
			a, b, am, bm := pairOf(t, 1<<16, direct)
			fill(am, 4)
			before := bytes.Clone(bm)
			for _, tc := range []struct {
				name string
				op   Op
				d    Desc
			}{
				{"write past the end", Write, Desc{Local: base, Remote: base + 1<<16 - 10, Len: 100}},
				{"write below", Write, Desc{Local: base, Remote: base - 100, Len: 10}},
				{"write wrapping", Write, Desc{Local: base, Remote: ^uint64(0) - 5, Len: 64}},
				{"read past the end", Read, Desc{Local: base, Remote: base + 1<<16, Len: 1}},
			} {
				good := Desc{Local: base, Remote: base, Len: 256}
				id, err := a.Post(tc.op, b.Name(), []Desc{good, tc.d}, []byte("n"))
				if err != nil {
					t.Fatalf("%s: Post: %v", tc.name, err)
				}
				s, err := wait(t, a, id)
				if s != Failed || !errors.Is(err, ErrXferFailed) || !strings.Contains(err.Error(), "outside registered memory") {
					t.Errorf("%s: state = %v, %v; want failed, out of bounds", tc.name, s, err)
				}
			}
			// Parts are checked one by one: the good descriptor may have
			// landed (the transfer still fails as a whole); nothing of a
			// refused one did.
			if !bytes.Equal(bm[256:], before[256:]) {
				t.Error("a refused descriptor changed the destination")
			}
			if n := b.Drain(nil); len(n) != 0 {
				t.Errorf("refused transfers delivered %d notifications", len(n))
			}
			if _, err := a.Post(Write, b.Name(), []Desc{{Local: base + 1<<16, Remote: base, Len: 1}}, nil); !errors.Is(err, ErrOutOfBounds) {
				t.Errorf("local out of bounds Post error = %v, want ErrOutOfBounds", err)
			}
		})
	}
}

// A hostile client's frames are checked: an out-of-bounds WRITE is refused
// and answered, a malformed frame drops its connection, and the agent
// keeps serving others.
func TestHostileClient(t *testing.T) {
	a, b, _, bm := pairOf(t, 4096, false)
	before := bytes.Clone(bm)
	nc, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	hello := append([]byte(magic), version)
	hello = binary.LittleEndian.AppendUint16(hello, 4)
	hello = append(hello, "evil"...)
	w := append(hello, tWrite)
	w = binary.LittleEndian.AppendUint64(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 0)
	w = binary.LittleEndian.AppendUint32(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 1)
	w = binary.LittleEndian.AppendUint32(w, 0)
	w = binary.LittleEndian.AppendUint64(w, base-4096) // outside
	w = binary.LittleEndian.AppendUint64(w, 8)
	w = append(w, "XXXXXXXX"...)
	w = append(w, 99) // then garbage: an unknown frame type
	if _, err := nc.Write(w); err != nil {
		t.Fatal(err)
	}
	ack := make([]byte, 17)
	_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := nc.Read(ack[:1]); err != nil || ack[0] != tAck {
		t.Fatalf("answer = %v, %v; want an ack", ack[0], err)
	}
	// The connection is dropped after the garbage.
	buf := make([]byte, 4096)
	for {
		if _, err := nc.Read(buf); err != nil {
			break
		}
	}
	if !bytes.Equal(bm, before) {
		t.Error("hostile write changed memory")
	}
	// Others are still served.
	id, err := a.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 16}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done {
		t.Errorf("state after the hostile client = %v, %v", s, err)
	}
}

// A peer that stops answering and then goes away fails the transfers that
// wait on it, with a reason — never a hang.
func TestPeerLossFailsTransfers(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var conns []net.Conn
	var mu sync.Mutex
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			conns = append(conns, c)
			mu.Unlock()
		}
	}()
	a, err := New(Config{Name: "loss-" + fmt.Sprint(rand.Uint64())})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	mem := make([]byte, 1<<16)
	_ = a.Map(base, mem)
	_ = a.Register([]Region{{base, 1 << 16}})
	name, err := a.LoadPeer([]byte(metaPrefix + "silent\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	id, err := a.Post(Write, name, []Desc{{Local: base, Remote: base, Len: 1024}}, []byte("x"))
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if s, _ := a.State(id); s != InProgress {
		t.Fatalf("state = %v before the peer went away, want in progress", s)
	}
	_ = ln.Close()
	mu.Lock()
	for _, c := range conns {
		_ = c.Close()
	}
	mu.Unlock()
	s, err := wait(t, a, id)
	if s != Failed || !strings.Contains(err.Error(), "lost") {
		t.Errorf("state = %v, %v; want failed: connection lost", s, err)
	}
}

func TestNotifyAndMetadata(t *testing.T) {
	a, b, _, _ := pairOf(t, 4096, false)
	if err := a.Notify(b.Name(), []byte("hello")); err != nil {
		t.Fatal(err)
	}
	if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "hello" {
		t.Errorf("notifications = %+v", n)
	}
	for _, bad := range []string{"", "netxfer1\n", "netxfer1\nname", "other\nname\naddr", "netxfer1\n\naddr"} {
		if _, err := a.LoadPeer([]byte(bad)); !errors.Is(err, ErrBadMetadata) {
			t.Errorf("LoadPeer(%q) error = %v, want ErrBadMetadata", bad, err)
		}
	}
	if err := a.Notify("nobody", nil); !errors.Is(err, ErrUnknownPeer) {
		t.Errorf("Notify(unknown) = %v", err)
	}
	if err := a.InvalidatePeer(b.Name()); err != nil {
		t.Fatal(err)
	}
	if _, err := a.Post(Write, b.Name(), nil, nil); !errors.Is(err, ErrUnknownPeer) {
		t.Errorf("Post after invalidate = %v, want ErrUnknownPeer", err)
	}
}

// Close stops every goroutine the agents started.
func TestCloseLeavesNoGoroutines(t *testing.T) {
	before := runtime.NumGoroutine()
	func() {
		a, b, _, _ := pairOf(t, 4096, false)
		id, _ := a.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 64}}, []byte("x"))
		_, _ = wait(t, a, id)
		_ = a.Close()
		_ = b.Close()
		if err := a.Close(); err != nil {
			t.Errorf("second Close = %v", err)
		}
	}()
	leakcheck.Check(t, before, 0, 10*time.Second)
}

// Pieces of every size class in one transfer, both ways over TCP: many
// below the read buffer's direct threshold (copied through the buffer),
// some at and above it (read straight into memory, after what the buffer
// already holds), in a scattered order, so that pieces of both kinds
// follow each other inside one frame.
func TestMixedPieceSizes(t *testing.T) {
	const size = 8 << 20
	a, b, am, bm := pairOf(t, size, false)
	fill(am, 5)
	fill(bm, 6)
	rng := rand.New(rand.NewPCG(7, 8))
	lens := []uint64{1, 7, 512, 4096, directRead - 1, directRead, directRead + 1, readBufSize - 3, readBufSize + 5, 700 << 10}
	var descs []Desc
	off := uint64(0)
	for i := range 200 {
		n := lens[rng.IntN(len(lens))]
		if i%3 == 0 {
			n = uint64(1 + rng.IntN(300))
		}
		if off+n > size/2 {
			break
		}
		descs = append(descs, Desc{Local: base + off, Len: n})
		off += n + uint64(rng.IntN(64))
	}
	// Destinations: the same pieces in reverse order in the upper half.
	doff := uint64(size / 2)
	for i := len(descs) - 1; i >= 0; i-- {
		descs[i].Remote = base + doff
		doff += descs[i].Len + 3
	}
	want := bytes.Clone(bm)
	for _, d := range descs {
		copy(want[d.Remote-base:d.Remote-base+d.Len], am[d.Local-base:d.Local-base+d.Len])
	}
	id, err := a.Post(Write, b.Name(), descs, []byte("w"))
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done || err != nil {
		t.Fatalf("write state = %v, %v", s, err)
	}
	if !bytes.Equal(bm, want) {
		t.Fatal("WRITE: destination bytes differ")
	}
	// READ the pieces back over the sources, scrambled first.
	fill(am[:size/2], 9)
	rid, err := a.Post(Read, b.Name(), descs, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, rid); s != Done || err != nil {
		t.Fatalf("read state = %v, %v", s, err)
	}
	for i, d := range descs {
		if !bytes.Equal(am[d.Local-base:d.Local-base+d.Len], bm[d.Remote-base:d.Remote-base+d.Len]) {
			t.Fatalf("READ: piece %d (%d bytes) differs", i, d.Len)
		}
	}
	_ = a.Release(id)
	_ = a.Release(rid)
}

// trickle returns at most a few bytes per Read, as a busy socket may.
type trickle struct {
	src []byte
	rng *rand.Rand
}

func (r *trickle) Read(p []byte) (int, error) {
	if len(r.src) == 0 {
		return 0, io.EOF
	}
	n := min(len(p), len(r.src), 1+r.rng.IntN(3*directRead))
	copy(p, r.src[:n])
	r.src = r.src[n:]
	return n, nil
}

// The reader hands every piece its exact bytes whatever the sizes and
// however the source splits them, and reports a short source.
func TestScatterReader(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	src := make([]byte, 4<<20)
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	r := newScatterReader(&trickle{src: src, rng: rng})
	off := 0
	for off < len(src) {
		n := min(len(src)-off, []int{1, 100, directRead - 1, directRead, 3 * directRead, readBufSize + 1}[rng.IntN(6)])
		b := make([]byte, n)
		if rng.IntN(4) == 0 {
			if _, err := io.ReadFull(r, b); err != nil {
				t.Fatal(err)
			}
		} else if err := r.fill(b); err != nil {
			t.Fatalf("fill %d bytes at %d: %v", n, off, err)
		}
		if !bytes.Equal(b, src[off:off+n]) {
			t.Fatalf("%d bytes at %d differ", n, off)
		}
		off += n
	}
	if err := r.fill(make([]byte, directRead)); !errors.Is(err, io.EOF) {
		t.Errorf("fill past the end: %v, want EOF", err)
	}
}

// fillv over a real socket (readv straight into the pieces) hands every
// piece its exact bytes: pieces of any size, lists longer than one readv
// takes, bytes buffered ahead of the payload, and a source that trickles.
func TestScatterReaderReadv(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	rng := rand.New(rand.NewPCG(3, 4))
	src := make([]byte, 8<<20)
	for i := range src {
		src[i] = byte(rng.Uint32())
	}
	go func() {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			return
		}
		defer c.Close()
		wr := rand.New(rand.NewPCG(5, 6))
		for off := 0; off < len(src); {
			n := min(len(src)-off, 1+wr.IntN(200<<10))
			if _, err := c.Write(src[off : off+n]); err != nil {
				return
			}
			off += n
		}
	}()
	c, err := ln.Accept()
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(20 * time.Second))
	r := newScatterReader(c)
	if r.rc == nil {
		t.Fatal("no raw connection for readv")
	}
	off := 0
	for off < len(src) {
		// A header read through the buffer, then a payload of pieces.
		h := make([]byte, min(len(src)-off, 1+rng.IntN(64)))
		if err := readFull(r, h); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(h, src[off:off+len(h)]) {
			t.Fatalf("header at %d differs", off)
		}
		off += len(h)
		var bufs [][]byte
		start := off
		for n := rng.IntN(3000); n > 0 && off < len(src); n-- {
			k := min(len(src)-off, []int{0, 1, 512, 4096, 70 << 10}[rng.IntN(5)])
			bufs = append(bufs, make([]byte, k))
			off += k
		}
		if err := r.fillv(bufs); err != nil {
			t.Fatalf("fillv of %d pieces at %d: %v", len(bufs), start, err)
		}
		for _, b := range bufs {
			if !bytes.Equal(b, src[start:start+len(b)]) {
				t.Fatalf("piece at %d differs", start)
			}
			start += len(b)
		}
	}
	if err := r.fillv([][]byte{make([]byte, 10)}); err == nil {
		t.Error("fillv past the end succeeded")
	}
}
