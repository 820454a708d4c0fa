package netxfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"os/exec"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// memFile returns size bytes of a new memfd mapped shared, and the file.
func memFile(t testing.TB, size int) ([]byte, *os.File) {
	t.Helper()
	fd, err := unix.MemfdCreate("netxfer-test", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	f := os.NewFile(uintptr(fd), "memfd")
	if err := f.Truncate(int64(size)); err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(fd, 0, size, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = unix.Munmap(mem); _ = f.Close() })
	return mem, f
}

// localPair returns two agents of one process (no direct copy) whose
// memory is file-backed: their WRITEs take the same-host path.
func localPair(t testing.TB, size int, cfg Config) (a, b *Agent, am, bm []byte) {
	t.Helper()
	mk := func(name string) (*Agent, []byte) {
		c := cfg
		if c.Conns == 0 {
			c.Conns = 3
		}
		return newMemAgent(t, name, size, c)
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

// scattered returns n descriptors of piece bytes, every other slot, the
// remote side shifted by one slot.
func scattered(n, piece int) []Desc {
	ds := make([]Desc, n)
	for i := range ds {
		ds[i] = Desc{Local: base + uint64(2*i*piece), Remote: base + uint64((2*i+1)*piece), Len: uint64(piece)}
	}
	return ds
}

func fillRandom(b []byte) {
	for i := range b {
		b[i] = byte(rand.Uint32())
	}
}

func checkMoved(t *testing.T, ds []Desc, src, dst []byte) {
	t.Helper()
	for i, d := range ds {
		s, r := src[d.Local-base:][:d.Len], dst[d.Remote-base:][:d.Len]
		if !bytes.Equal(s, r) {
			t.Fatalf("piece %d: bytes differ", i)
		}
	}
}

func TestSameHostWrite(t *testing.T) {
	const size = 1 << 20
	a, b, am, bm := localPair(t, size, Config{})
	if !strings.Contains(string(a.Metadata()), "\nunix @") {
		t.Fatalf("metadata %q names no same-host socket", a.Metadata())
	}
	fillRandom(am)
	for _, piece := range []int{512, 4096, 64 << 10} {
		ds := scattered(size/(2*piece)-1, piece)
		before := b.SameHostParts()
		id, err := a.Post(Write, b.Name(), ds, []byte("landed"))
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("piece %d: state %v, %v", piece, s, err)
		}
		checkMoved(t, ds, am, bm)
		if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "landed" || n[0].From != a.Name() {
			t.Fatalf("notifications %+v", n)
		}
		if got := b.SameHostParts() - before; got != 3 {
			t.Fatalf("piece %d: %d parts copied on the same-host path, want 3 (one per connection)", piece, got)
		}
	}
	// READs: a copies straight out of b's file.
	fillRandom(bm)
	for _, piece := range []int{512, 4096, 64 << 10} {
		ds := scattered(size/(2*piece)-1, piece)
		before := a.SameHostParts()
		id, err := a.Post(Read, b.Name(), ds, []byte("read"))
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("read: %v, %v", s, err)
		}
		for i, d := range ds {
			if !bytes.Equal(am[d.Local-base:][:d.Len], bm[d.Remote-base:][:d.Len]) {
				t.Fatalf("read piece %d differs", i)
			}
		}
		if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "read" {
			t.Fatalf("read notifications %+v", n)
		}
		if got := a.SameHostParts() - before; got != 3 {
			t.Fatalf("read, piece %d: %d parts copied on the same-host path, want 3", piece, got)
		}
	}
}

// A READ of memory its owner unmaps fails or completes with the bytes
// from before (never silently with bytes copied after); the next READ of
// memory still mapped works over a new connection.
func TestSameHostReadUnmap(t *testing.T) {
	a, b, am, bm := localPair(t, 1<<16, Config{})
	mem, f := memFile(t, 1<<16)
	const xb = 0x4000_0000
	if err := b.MapFile(xb, mem, f, 0); err != nil {
		t.Fatal(err)
	}
	if err := b.Register([]Region{{xb, 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	fillRandom(mem)
	fillRandom(bm)
	read := func(ds []Desc) (State, error) {
		t.Helper()
		id, err := a.Post(Read, b.Name(), ds, nil)
		if err != nil {
			t.Fatal(err)
		}
		return wait(t, a, id)
	}
	if s, err := read([]Desc{{Local: base, Remote: xb, Len: 4096}}); s != Done {
		t.Fatalf("read: %v, %v", s, err)
	}
	if !bytes.Equal(am[:4096], mem[:4096]) {
		t.Fatal("bytes differ")
	}
	if err := b.Unmap(xb); err != nil {
		t.Fatal(err)
	}
	if s, err := read([]Desc{{Local: base, Remote: xb, Len: 4096}}); s != Failed {
		t.Fatalf("read of unmapped memory: %v, %v; want failed", s, err)
	}
	// The unmap ended b's same-host connections: a READ on one a has not
	// seen end yet fails; the next ones dial anew.
	ds := scattered(4, 4096)
	s, err := read(ds)
	for i := 0; s != Done && i < 3; i++ {
		t.Logf("read after the unmap: %v, %v", s, err)
		s, err = read(ds)
	}
	if s != Done {
		t.Fatalf("read after the unmap: %v, %v", s, err)
	}
	for i, d := range ds {
		if !bytes.Equal(am[d.Local-base:][:d.Len], bm[d.Remote-base:][:d.Len]) {
			t.Fatalf("piece %d differs", i)
		}
	}
}

// A READ answer whose server withdrew its memory during the copy fails.
func TestSameHostReadFence(t *testing.T) {
	// One connection: the fenced one carries the next READ.
	a, b, _, _ := localPair(t, 1<<16, Config{Conns: 1})
	ds := scattered(2, 4096)
	id, err := a.Post(Read, b.Name(), ds, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done {
		t.Fatalf("read: %v, %v", s, err)
	}
	// Set b's fences as its Unmap or Close would, without ending the
	// connections: the next answer's copy must not count.
	b.mu.Lock()
	for s := range b.mu.localIn {
		s.mu.Lock()
		setFence(s.mu.fence)
		s.mu.Unlock()
	}
	b.mu.Unlock()
	id, err = a.Post(Read, b.Name(), ds, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := wait(t, a, id)
	if s != Failed || !strings.Contains(fmt.Sprint(err), "withdrew") {
		t.Fatalf("read after the fence: %v, %v; want failed, withdrawn", s, err)
	}
}

// Memory without a file still moves, as bytes over the same socket.
func TestSameHostWithoutFile(t *testing.T) {
	const size = 1 << 18
	a, b, _, bm := localPair(t, size, Config{})
	extra := make([]byte, size)
	fillRandom(extra)
	const xb = 0x4000_0000
	if err := a.Map(xb, extra); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([]Region{{xb, size}}); err != nil {
		t.Fatal(err)
	}
	ds := []Desc{{Local: xb, Remote: base, Len: 4096}, {Local: xb + 8192, Remote: base + 4096, Len: 100}}
	id, err := a.Post(Write, b.Name(), ds, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done {
		t.Fatalf("state %v, %v", s, err)
	}
	if !bytes.Equal(bm[:4096], extra[:4096]) || !bytes.Equal(bm[4096:4196], extra[8192:8292]) {
		t.Fatal("bytes differ")
	}
	if n := b.SameHostParts(); n != 0 {
		t.Fatalf("%d parts copied on the same-host path, want 0", n)
	}
}

func TestSameHostDisabled(t *testing.T) {
	a, b, am, bm := localPair(t, 1<<16, Config{DisableSameHost: true})
	if strings.Contains(string(a.Metadata()), "unix") {
		t.Fatalf("metadata %q names a same-host socket", a.Metadata())
	}
	fillRandom(am)
	ds := scattered(4, 4096)
	id, err := a.Post(Write, b.Name(), ds, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done {
		t.Fatalf("state %v, %v", s, err)
	}
	checkMoved(t, ds, am, bm)
	if b.SameHostParts() != 0 {
		t.Fatal("a part took the same-host path")
	}
}

type verdictGuard struct{ v Verdict }

func (g verdictGuard) Check(string, Op, uint64, uint64) Verdict { return g.v }

func TestSameHostGuard(t *testing.T) {
	for _, v := range []Verdict{Late, Deny} {
		t.Run(fmt.Sprint(v), func(t *testing.T) {
			a, b, am, bm := localPair(t, 1<<16, Config{})
			if err := b.SetGuard(verdictGuard{v}); err != nil {
				t.Fatal(err)
			}
			fillRandom(am)
			ds := scattered(4, 4096)
			id, err := a.Post(Write, b.Name(), ds, []byte("n"))
			if err != nil {
				t.Fatal(err)
			}
			s, err := wait(t, a, id)
			if s != Failed {
				t.Fatalf("state %v, want Failed", s)
			}
			if v == Late && !errors.Is(err, ErrNotGranted) {
				t.Fatalf("err %v, want ErrNotGranted", err)
			}
			if !bytes.Equal(bm, make([]byte, len(bm))) {
				t.Fatal("a refused write landed")
			}
			if n := b.Drain(nil); len(n) != 0 {
				t.Fatalf("notifications %+v after a refused write", n)
			}
		})
	}
}

// rawLocal dials b's same-host socket as a bare client and sends the
// hello and a fence page, set when withdrawn.
func rawLocal(t *testing.T, b *Agent, withdrawn bool) (*net.UnixConn, *scatterReader) {
	t.Helper()
	nc, err := net.Dial("unix", b.uaddr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = nc.Close() })
	uc := nc.(*net.UnixConn)
	if _, err := uc.Write(helloFrame("raw")); err != nil {
		t.Fatal(err)
	}
	fence, ff := memFile(t, fenceSize)
	if withdrawn {
		fence[0] = 1
	}
	if _, _, err := uc.WriteMsgUnix([]byte{tFence}, unix.UnixRights(int(ff.Fd())), nil); err != nil {
		t.Fatal(err)
	}
	_ = uc.SetDeadline(time.Now().Add(20 * time.Second))
	return uc, newScatterReader(uc)
}

func sendChunk(t *testing.T, uc *net.UnixConn, id uint32, f *os.File, n uint64) {
	t.Helper()
	// (An error: the agent dropped the connection already; readAck tells.)
	h := []byte{tChunk}
	h = binary.LittleEndian.AppendUint32(h, id)
	h = binary.LittleEndian.AppendUint64(h, 0)
	h = binary.LittleEndian.AppendUint64(h, n)
	if _, _, err := uc.WriteMsgUnix(h, unix.UnixRights(int(f.Fd())), nil); err != nil {
		t.Logf("write: %v", err)
	}
}

// sendWriteLocal sends a local WRITE part; a connection the agent
// dropped already is no error here (readAck tells).
func sendWriteLocal(t *testing.T, uc *net.UnixConn, id uint64, notif string, refs ...[4]uint64) {
	t.Helper()
	h := []byte{tWriteLocal}
	h = binary.LittleEndian.AppendUint64(h, id)
	h = binary.LittleEndian.AppendUint32(h, 0)
	h = binary.LittleEndian.AppendUint32(h, 1)
	h = binary.LittleEndian.AppendUint32(h, uint32(len(refs)))
	h = binary.LittleEndian.AppendUint32(h, uint32(len(notif)))
	h = append(h, notif...)
	for _, r := range refs { // remote, len, chunk, off
		h = binary.LittleEndian.AppendUint64(h, r[0])
		h = binary.LittleEndian.AppendUint64(h, r[1])
		h = binary.LittleEndian.AppendUint32(h, uint32(r[2]))
		h = binary.LittleEndian.AppendUint64(h, r[3])
	}
	if _, err := uc.Write(h); err != nil {
		t.Logf("write: %v", err)
	}
}

// readAck reads one answer: its type and error text.
func readAck(t *testing.T, r *scatterReader) (byte, string, error) {
	t.Helper()
	var h [17]byte
	if err := readFull(r, h[:]); err != nil {
		return 0, "", err
	}
	msg := make([]byte, binary.LittleEndian.Uint32(h[13:]))
	err := readFull(r, msg)
	return h[0], string(msg), err
}

// A sender that withdrew its memory (its fence set) gets its part
// refused after the copy, and no notification is delivered.
func TestSameHostFence(t *testing.T) {
	_, b, _, _ := localPair(t, 1<<16, Config{})
	for _, withdrawn := range []bool{false, true} {
		uc, r := rawLocal(t, b, withdrawn)
		src, f := memFile(t, 1<<16)
		fillRandom(src)
		sendChunk(t, uc, 7, f, 1<<16)
		sendWriteLocal(t, uc, 1, "done", [4]uint64{base + 4096, 4096, 7, 8192})
		typ, msg, err := readAck(t, r)
		if err != nil || typ != tAck {
			t.Fatalf("withdrawn %v: answer %d %q, %v", withdrawn, typ, msg, err)
		}
		notifs := b.Drain(nil)
		if withdrawn {
			if !strings.Contains(msg, "withdrew") || len(notifs) != 0 {
				t.Fatalf("withdrawn: answer %q, notifications %+v", msg, notifs)
			}
		} else if msg != "" || len(notifs) != 1 || string(notifs[0].Msg) != "done" {
			t.Fatalf("answer %q, notifications %+v", msg, notifs)
		}
	}
}

// hungUp sees the other end close (or die), with bytes still unread.
func TestHungUp(t *testing.T) {
	fds, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM, 0)
	if err != nil {
		t.Fatal(err)
	}
	conn := func(fd int) *net.UnixConn {
		f := os.NewFile(uintptr(fd), "pair")
		defer f.Close()
		c, err := net.FileConn(f)
		if err != nil {
			t.Fatal(err)
		}
		return c.(*net.UnixConn)
	}
	a, b := conn(fds[0]), conn(fds[1])
	defer a.Close()
	if hungUp(a) {
		t.Fatal("hung up before anything happened")
	}
	if _, err := b.Write([]byte("unread")); err != nil {
		t.Fatal(err)
	}
	if hungUp(a) {
		t.Fatal("hung up with the other end open")
	}
	b.Close()
	if !hungUp(a) {
		t.Fatal("the other end closed, not seen")
	}
}

// A sender that hung up (killed: no fence) around its part: either the
// copy was over before (the part lands, its notification is delivered)
// or the part fails naming the hang-up and nothing is delivered.
func TestSameHostSenderHungUp(t *testing.T) {
	_, b, _, _ := localPair(t, 1<<16, Config{})
	uc, r := rawLocal(t, b, false)
	src, f := memFile(t, 1<<16)
	fillRandom(src)
	sendChunk(t, uc, 7, f, 1<<16)
	sendWriteLocal(t, uc, 1, "done", [4]uint64{base + 4096, 4096, 7, 8192})
	if err := uc.CloseWrite(); err != nil {
		t.Fatal(err)
	}
	typ, msg, err := readAck(t, r)
	if err != nil || typ != tAck {
		t.Fatalf("answer %d %q, %v", typ, msg, err)
	}
	n := waitNotifFor(b, msg == "")
	switch {
	case msg == "" && len(n) != 1:
		t.Fatalf("the part landed but notifications are %+v", n)
	case msg != "" && (!strings.Contains(msg, "hung up") || len(n) != 0):
		t.Fatalf("answer %q, notifications %+v; want the hang-up named and nothing delivered", msg, n)
	}
	t.Logf("answer %q", msg)
}

// waitNotifFor drains a's notifications, waiting for one when want.
func waitNotifFor(a *Agent, want bool) []Notif {
	deadline := time.Now().Add(10 * time.Second)
	for {
		n := a.Drain(nil)
		if len(n) > 0 || !want || time.Now().After(deadline) {
			return n
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// A peer naming memory it never passed, or beyond what it passed, loses
// its connection; nothing is written.
func TestSameHostBadReference(t *testing.T) {
	_, b, _, bm := localPair(t, 1<<16, Config{})
	for _, ref := range [][4]uint64{
		{base, 4096, 9, 0},            // chunk never passed
		{base, 4096, 7, 1<<16 - 4095}, // past its end
		{base, 4096, 7, 1 << 62},      // offset overflowing
	} {
		uc, r := rawLocal(t, b, false)
		_, f := memFile(t, 1<<16)
		sendChunk(t, uc, 7, f, 1<<16)
		sendWriteLocal(t, uc, 1, "", ref)
		if typ, msg, err := readAck(t, r); err == nil {
			t.Fatalf("ref %v: answered %d %q, want the connection dropped", ref, typ, msg)
		}
	}
	// A file shorter than the memory it is said to hold is refused too.
	uc, r := rawLocal(t, b, false)
	_, f := memFile(t, 4096)
	sendChunk(t, uc, 7, f, 1<<16)
	sendWriteLocal(t, uc, 1, "", [4]uint64{base, 4096, 7, 0})
	if _, _, err := readAck(t, r); err == nil {
		t.Fatal("a short file was mapped")
	}
	if !bytes.Equal(bm, make([]byte, len(bm))) {
		t.Fatal("bytes landed")
	}
}

// A sender's file that shrinks under the receiver's mapping fails the
// part; the receiver stays up.
func TestSameHostShrunkFile(t *testing.T) {
	_, b, _, _ := localPair(t, 1<<16, Config{})
	uc, r := rawLocal(t, b, false)
	_, f := memFile(t, 1<<16)
	sendChunk(t, uc, 7, f, 1<<16)
	sendWriteLocal(t, uc, 1, "", [4]uint64{base, 4096, 7, 0})
	if typ, msg, err := readAck(t, r); err != nil || msg != "" {
		t.Fatalf("answer %d %q, %v", typ, msg, err)
	}
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	sendWriteLocal(t, uc, 2, "", [4]uint64{base, 4096, 7, 8192})
	typ, msg, err := readAck(t, r)
	if err != nil || typ != tAck || !strings.Contains(msg, "faulted") {
		t.Fatalf("answer %d %q, %v; want the part failed by a fault", typ, msg, err)
	}
}

// Unmap breaks the same-host connections; the next WRITE dials again.
func TestSameHostUnmap(t *testing.T) {
	a, b, am, bm := localPair(t, 1<<16, Config{})
	mem, f := memFile(t, 1<<16)
	const xb = 0x4000_0000
	if err := a.MapFile(xb, mem, f, 0); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([]Region{{xb, 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	fillRandom(am)
	fillRandom(mem)
	post := func(ds []Desc) {
		t.Helper()
		id, err := a.Post(Write, b.Name(), ds, nil)
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("state %v, %v", s, err)
		}
	}
	post([]Desc{{Local: xb, Remote: base, Len: 4096}})
	if err := a.Unmap(xb); err != nil {
		t.Fatal(err)
	}
	ds := scattered(4, 4096)
	post(ds)
	checkMoved(t, ds, am, bm)
	if n := b.SameHostParts(); n < 2 {
		t.Fatalf("%d same-host parts, want the WRITEs before and after Unmap", n)
	}
}

func TestSameHostMetadata(t *testing.T) {
	a, err := New(Config{DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	for _, m := range []string{
		metaPrefix + "p\n127.0.0.1:1\nunix x",
		metaPrefix + "p\n127.0.0.1:1\nunix @",
		metaPrefix + "p\n127.0.0.1:1\nunix @a\nmore",
		metaPrefix + "p\n127.0.0.1:1\ntcp @a",
	} {
		if _, err := a.LoadPeer([]byte(m)); !errors.Is(err, ErrBadMetadata) {
			t.Errorf("LoadPeer(%q) = %v, want ErrBadMetadata", m, err)
		}
	}
	if _, err := a.LoadPeer([]byte(metaPrefix + "p\n127.0.0.1:1\nunix @abc")); err != nil {
		t.Fatal(err)
	}
}

// The same-host path is only between agents of one user: an agent of
// another user reaching this one's socket is refused (the server's
// check), and one dialing it falls back to TCP (the client's check); its
// WRITE still lands, over TCP.
func TestSameHostOtherUser(t *testing.T) {
	if os.Geteuid() != 0 {
		t.Skip("needs root to run a peer as another user (setpriv)")
	}
	setpriv, err := exec.LookPath("setpriv")
	if err != nil {
		t.Fatalf("setpriv is needed to run a peer as another user: %v", err)
	}
	_, b, _, bm := localPair(t, 1<<16, Config{})
	cmd := exec.Command(setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", os.Args[0], "-test.run=^TestSameHostOtherUserChild$")
	cmd.Env = append(os.Environ(), "NETXFER_TEST_PEER="+string(b.Metadata()), "NETXFER_TEST_UADDR="+b.uaddr)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	for _, want := range []string{"raw same-host connection: refused", "WRITE: done"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("child output lacks %q:\n%s", want, out)
		}
	}
	if n := b.SameHostParts(); n != 0 {
		t.Errorf("%d parts from another user took the same-host path", n)
	}
	if !bytes.Equal(bm[:4096], bytes.Repeat([]byte{0xab}, 4096)) {
		t.Error("the WRITE over TCP did not land")
	}
}

// TestSameHostOtherUserChild is TestSameHostOtherUser's peer, run as
// uid 65534.
func TestSameHostOtherUserChild(t *testing.T) {
	meta, ok := os.LookupEnv("NETXFER_TEST_PEER")
	if !ok {
		return // only as TestSameHostOtherUser's child
	}
	// A bare client on the socket: the server hangs up after the hello.
	if nc, err := net.Dial("unix", os.Getenv("NETXFER_TEST_UADDR")); err != nil {
		fmt.Println("raw same-host connection: dial:", err)
	} else {
		_, _ = nc.Write(helloFrame("stranger"))
		_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
		var b [1]byte
		if _, err := nc.Read(b[:]); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			fmt.Println("raw same-host connection: refused")
		}
		nc.Close()
	}
	a, err := New(Config{DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	mem, f := memFile(t, 1<<16)
	for i := range 4096 {
		mem[i] = 0xab
	}
	if err := a.MapFile(base, mem, f, 0); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([]Region{{base, 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	name, err := a.LoadPeer([]byte(meta))
	if err != nil {
		t.Fatal(err)
	}
	id, err := a.Post(Write, name, []Desc{{Local: base, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	s, err := wait(t, a, id)
	if s == Done {
		fmt.Println("WRITE: done")
	} else {
		fmt.Println("WRITE:", s, err)
	}
}

// Transfers to a peer with a connection never wait for the dial of
// another: while every dial after the first is held, transfers go on the
// connection there is; once let go, the peer gets its Conns connections.
func TestTransfersDoNotWaitForDials(t *testing.T) {
	for _, cfg := range []Config{{Conns: 4}, {Conns: 4, DisableSameHost: true}} {
		var dials atomic.Int32
		held := make(chan struct{})
		hook := func() {
			if dials.Add(1) > 1 {
				<-held
			}
		}
		dialHook.Store(&hook)
		a, b, am, bm := localPair(t, 1<<16, cfg)
		for i := range 6 {
			fillRandom(am)
			ds := scattered(4, 4096)
			id, err := a.Post(Write, b.Name(), ds, nil)
			if err != nil {
				t.Fatal(err)
			}
			if s, err := wait(t, a, id); s != Done {
				t.Fatalf("transfer %d while a dial is held: %v, %v", i, s, err)
			}
			for j, d := range ds {
				if !bytes.Equal(am[d.Local-base:][:d.Len], bm[d.Remote-base:][:d.Len]) {
					t.Fatalf("transfer %d piece %d differs", i, j)
				}
			}
		}
		if n := dials.Load(); n != 2 {
			t.Fatalf("%d dials while the second was held, want 2 (one at a time)", n)
		}
		close(held)
		p, err := a.peer(b.Name())
		if err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
			id, err := a.Post(Write, b.Name(), scattered(1, 4096), nil)
			if err != nil {
				t.Fatal(err)
			}
			if s, err := wait(t, a, id); s != Done {
				t.Fatalf("%v, %v", s, err)
			}
			p.mu.Lock()
			n := len(p.conns)
			p.mu.Unlock()
			if n == 5 {
				break
			}
			if time.Now().After(deadline) || n > 5 {
				t.Fatalf("%d connections 10 s after the dials were let go, want 5 (Conns 4 for parts, one for notifications)", n)
			}
		}
		dialHook.Store(nil)
	}
}
