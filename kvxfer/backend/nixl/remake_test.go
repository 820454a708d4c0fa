//go:build linux

package nixl

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"os"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// A WRITE out of memory that faults (its file shrank under the mapping)
// breaks UCX's connection to the peer, and NIXL then refuses every later
// post and notification to it. The Backend makes the connection again:
// within a few seconds a WRITE out of good memory lands, byte for byte,
// through a plain post and through the lists prepared before the break
// (same ids), and notifications reach the peer again. Before, every
// later post and notification failed for as long as both agents lived.
func TestBrokenConnectionMadeAgain(t *testing.T) {
	defer func(d time.Duration) { remakeEvery = d }(remakeEvery)
	remakeEvery = 50 * time.Millisecond
	const n = 1 << 16
	a, b := newCloseEnd(t, n), newCloseEnd(t, n)
	for i := range a.mem {
		a.mem[i] = byte(i*7 + 3)
	}
	// A second region of a's, a shared-memory file's mapping.
	f, err := os.CreateTemp("/dev/shm", "kvxfer-remake-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(f.Name())
	defer f.Close()
	if err := f.Truncate(n); err != nil {
		t.Fatal(err)
	}
	file, err := syscall.Mmap(int(f.Fd()), 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(file)
	fileAddr := uint64(uintptr(unsafe.Pointer(&file[0])))
	if err := a.b.Map(fileAddr, file); err != nil {
		t.Fatal(err)
	}
	if err := a.b.Register([]kvxfer.MemRegion{{Addr: fileAddr, Len: n, Kind: kvxfer.MemDRAM}}); err != nil {
		t.Fatal(err)
	}
	peer := linked(t, a, b)
	back := linked(t, b, a)
	remadeBefore := RemadeConnections()
	local, err := a.b.Prepare("", []hotpath.Entry{{Addr: a.r.Addr, Len: 4096}, {Addr: a.r.Addr + 8192, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	remote, err := a.b.Prepare(peer, []hotpath.Entry{{Addr: b.r.Addr, Len: 4096}, {Addr: b.r.Addr + 8192, Len: 4096}})
	if err != nil {
		t.Fatal(err)
	}
	write := func(from uint64, to uint64) error {
		id, err := a.b.Post(hotpath.OpWrite, peer, []hotpath.Desc{{Local: from, Remote: to, Len: 512}, {Local: from + 4096, Remote: to + 4096, Len: 512}}, []byte("w"))
		if err != nil {
			return err
		}
		defer a.b.Release(id)
		if s, err := settled(t, a.b, id); s != kvxfer.XferDone {
			return fmt.Errorf("ended %v: %v", s, err)
		}
		return nil
	}
	if err := write(fileAddr, b.r.Addr); err != nil {
		t.Fatalf("a WRITE before the break: %v", err)
	}
	if err := f.Truncate(0); err != nil {
		t.Fatal(err)
	}
	if err := write(fileAddr, b.r.Addr); err == nil {
		t.Skip("a WRITE out of a shrunk file did not fail here: the connection did not break")
	} else {
		t.Logf("the WRITE out of the shrunk file: %v", err)
	}
	// Good memory from here on.
	var last error
	deadline := time.Now().Add(10 * time.Second)
	for ; time.Now().Before(deadline); time.Sleep(20 * time.Millisecond) {
		if last = write(a.r.Addr, b.r.Addr+16384); last == nil {
			break
		}
	}
	if last != nil {
		t.Fatalf("no WRITE to the peer landed within 10 s of the break: %v", last)
	}
	for _, off := range []uint64{0, 4096} {
		if !bytes.Equal(b.mem[16384+off:16384+off+512], a.mem[off:off+512]) {
			t.Errorf("the WRITE after the break: bytes at +%d differ", off)
		}
	}
	id, err := a.b.PostPrepared(hotpath.OpWrite, local, remote, []hotpath.IndexPair{{Local: 0, Remote: 0}, {Local: 1, Remote: 1}}, nil)
	if err != nil {
		t.Fatalf("a prepared WRITE after the break: %v", err)
	}
	if s, err := settled(t, a.b, id); s != kvxfer.XferDone {
		t.Fatalf("the prepared WRITE after the break ended %v: %v", s, err)
	}
	_ = a.b.Release(id)
	if !bytes.Equal(b.mem[:4096], a.mem[:4096]) || !bytes.Equal(b.mem[8192:12288], a.mem[8192:12288]) {
		t.Error("the prepared WRITE after the break did not land byte for byte")
	}
	if err := a.b.Notify(peer, []byte("to b")); err != nil {
		t.Errorf("a notification after the break: %v", err)
	}
	// b's connection to a may have broken too: its notifications reach a
	// within the same bound.
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if last = b.b.Notify(back, []byte("to a")); last == nil || time.Now().After(deadline) {
			break
		}
	}
	if last != nil {
		t.Errorf("b's notifications to a still fail 10 s after the break: %v", last)
	}
	if got := RemadeConnections() - remadeBefore; got == 0 {
		t.Error("no connection made again is counted")
	} else {
		t.Logf("connections made again: %d", got)
	}
}

// A peer whose connection is being made again is refused at once, naming
// why, and only that peer: posts to another peer go on.
func TestRemakeRefusesOnlyItsPeer(t *testing.T) {
	a, b, c := newCloseEnd(t, 1<<14), newCloseEnd(t, 1<<14), newCloseEnd(t, 1<<14)
	pb, pc := linked(t, a, b), linked(t, a, c)
	// Stand in for a remake under way (its goroutine never started).
	a.b.mu.Lock()
	a.b.mu.remaking[pb] = fmt.Errorf("test %d", rand.IntN(10))
	a.b.mu.Unlock()
	defer func() {
		a.b.mu.Lock()
		delete(a.b.mu.remaking, pb)
		a.b.mu.Unlock()
	}()
	if _, err := a.b.Post(hotpath.OpWrite, pb, []hotpath.Desc{{Local: a.r.Addr, Remote: b.r.Addr, Len: 64}}, nil); err == nil ||
		!bytes.Contains([]byte(err.Error()), []byte("being made again")) {
		t.Errorf("a post to the peer being remade: %v, want refused naming why", err)
	}
	if err := a.b.Notify(pb, []byte("x")); err == nil {
		t.Error("a notification to the peer being remade was sent")
	}
	if _, err := a.b.Prepare(pb, []hotpath.Entry{{Addr: b.r.Addr, Len: 64}}); err == nil {
		t.Error("a list of the peer being remade was prepared")
	}
	id, err := a.b.Post(hotpath.OpWrite, pc, []hotpath.Desc{{Local: a.r.Addr, Remote: c.r.Addr, Len: 64}}, nil)
	if err != nil {
		t.Fatalf("a post to another peer: %v", err)
	}
	if s, err := settled(t, a.b, id); s != kvxfer.XferDone {
		t.Errorf("the WRITE to another peer ended %v: %v", s, err)
	}
	_ = a.b.Release(id)
}
