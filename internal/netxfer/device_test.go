package netxfer

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"sync"
	"testing"
)

// fakeGPU stands in for CUDA in tests of the same-host path's GPU memory:
// allocations are host bytes at made-up device addresses, one address
// space for the process (unified addressing), and IPC handles name
// allocations across agents.
type fakeGPU struct {
	mu      sync.Mutex
	next    uint64
	maps    map[uint64][]byte
	exports map[[64]byte][]byte
	imports int
	copies  int
	illegal int // batch pieces that named memory outside every allocation
}

func newFakeGPU() *fakeGPU {
	return &fakeGPU{next: 0x7000_0000_0000, maps: map[uint64][]byte{}, exports: map[[64]byte][]byte{}}
}

// alloc returns a new allocation: its address, its handle, its bytes.
func (g *fakeGPU) alloc(n int) (uint64, [64]byte, []byte) {
	g.mu.Lock()
	defer g.mu.Unlock()
	mem := make([]byte, n)
	ptr := g.next
	g.next += uint64(n) + 1<<20
	g.maps[ptr] = mem
	var h [64]byte
	for i := range h {
		h[i] = byte(rand.Uint32())
	}
	g.exports[h] = mem
	return ptr, h, mem
}

func (g *fakeGPU) Import(h [64]byte) (uint64, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	mem, ok := g.exports[h]
	if !ok {
		return 0, errors.New("fake: invalid handle")
	}
	ptr := g.next
	g.next += uint64(len(mem)) + 1<<20
	g.maps[ptr] = mem
	g.imports++
	return ptr, nil
}

func (g *fakeGPU) Unmap(ptr uint64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	if _, ok := g.maps[ptr]; !ok {
		return errors.New("fake: not mapped")
	}
	delete(g.maps, ptr)
	g.imports--
	return nil
}

// at returns the bytes at [ptr, ptr+n), or panics (an illegal access).
func (g *fakeGPU) at(ptr, n uint64) []byte {
	for base, mem := range g.maps {
		if ptr >= base && ptr-base+n <= uint64(len(mem)) {
			return mem[ptr-base : ptr-base+n]
		}
	}
	panic(fmt.Sprintf("fake GPU: illegal address [%#x, +%d)", ptr, n))
}

// view returns a copy of [ptr, ptr+n); fill fills it with random bytes.
func (g *fakeGPU) view(ptr, n uint64) []byte {
	g.mu.Lock()
	defer g.mu.Unlock()
	return bytes.Clone(g.at(ptr, n))
}

func (g *fakeGPU) fill(ptr, n uint64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	fillRandom(g.at(ptr, n))
}

func (g *fakeGPU) counts() (imports, copies int) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.imports, g.copies
}

func (g *fakeGPU) CopyDevice(dst, src uint64, n int) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.copies++
	copy(g.at(dst, uint64(n)), g.at(src, uint64(n)))
	return nil
}

func (g *fakeGPU) CopyIn(dst uint64, src []byte) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.copies++
	copy(g.at(dst, uint64(len(src))), src)
	return nil
}

func (g *fakeGPU) CopyOut(dst []byte, src uint64) error {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.copies++
	copy(dst, g.at(src, uint64(len(dst))))
	return nil
}

var fakeUUID = [16]byte{0xfa, 0xce}

// devicePair returns two agents with host memory (file-backed, at base)
// and GPU memory (at their device addresses) each, registered.
func devicePair(t *testing.T, g *fakeGPU, cfg Config) (a, b *Agent, am, bm []byte, ad, bd uint64) {
	t.Helper()
	cfg.Devices = func(u [16]byte) (Device, error) {
		if u != fakeUUID {
			return nil, fmt.Errorf("no GPU %x here", u)
		}
		return g, nil
	}
	a, b, am, bm = localPair(t, 1<<16, cfg)
	for _, x := range []struct {
		ag  *Agent
		ptr *uint64
	}{{a, &ad}, {b, &bd}} {
		ptr, h, _ := g.alloc(1 << 16)
		if err := x.ag.MapDevice(ptr, 1<<16, g, fakeUUID, h); err != nil {
			t.Fatal(err)
		}
		if err := x.ag.Register([]Region{{ptr, 1 << 16}}); err != nil {
			t.Fatal(err)
		}
		*x.ptr = ptr
	}
	return a, b, am, bm, ad, bd
}

func TestSameHostDevice(t *testing.T) {
	g := newFakeGPU()
	a, b, am, bm, ad, bd := devicePair(t, g, Config{})
	fillRandom(am)
	g.fill(ad, 1<<16)
	move := func(op Op, local, remote uint64) {
		t.Helper()
		var ds []Desc
		for i := range 8 {
			ds = append(ds, Desc{Local: local + uint64(2*i*512), Remote: remote + uint64((2*i+1)*512), Len: 512})
		}
		before, beforeA := b.SameHostParts(), a.SameHostParts()
		id, err := a.Post(op, b.Name(), ds, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("%v %#x -> %#x: %v, %v", op, local, remote, s, err)
		}
		mem := func(addr, n uint64, host []byte) []byte {
			if addr >= base && addr < base+uint64(len(host)) {
				return host[addr-base:][:n]
			}
			return g.view(addr, n)
		}
		for i, d := range ds {
			l, r := mem(d.Local, d.Len, am), mem(d.Remote, d.Len, bm)
			if !bytes.Equal(l, r) {
				t.Fatalf("%v %#x -> %#x: piece %d differs", op, local, remote, i)
			}
		}
		if op == Write && b.SameHostParts() == before || op == Read && a.SameHostParts() == beforeA {
			t.Fatalf("%v %#x -> %#x: not on the same-host path", op, local, remote)
		}
		waitNotif(t, b)
	}
	move(Write, ad, bd)   // GPU to GPU
	move(Write, base, bd) // host to GPU
	move(Write, ad, base) // GPU to host
	g.fill(bd, 1<<16)
	move(Read, ad, bd)   // GPU from GPU
	move(Read, base, bd) // host from GPU
	if _, copies := g.counts(); copies == 0 {
		t.Fatal("no copy went through the device")
	}
	_ = a.Close()
	_ = b.Close()
	if imports, _ := g.counts(); imports != 0 {
		t.Errorf("%d imports left open after both agents closed", imports)
	}
}

// GPU memory never goes over TCP: a WRITE from it or into it fails with a
// reason naming the limit, and nothing moves.
func TestDeviceOverTCP(t *testing.T) {
	g := newFakeGPU()
	a, b, am, _, ad, bd := devicePair(t, g, Config{DisableSameHost: true})
	fillRandom(am)
	for _, d := range []Desc{{Local: ad, Remote: base, Len: 512}, {Local: base, Remote: bd, Len: 512}} {
		id, err := a.Post(Write, b.Name(), []Desc{d}, nil)
		if err != nil {
			t.Fatal(err)
		}
		s, err := wait(t, a, id)
		if s != Failed || !strings.Contains(fmt.Sprint(err), "GPU memory moves only on the same-host path") {
			t.Fatalf("WRITE %#x -> %#x over TCP: %v, %v; want failed naming the same-host path", d.Local, d.Remote, s, err)
		}
	}
	if !bytes.Equal(g.view(bd, 512), make([]byte, 512)) {
		t.Fatal("bytes landed in GPU memory over TCP")
	}
}

// An agent that takes no GPU memory from peers (no Devices) refuses it:
// the transfer fails and nothing moves.
func TestDeviceRefused(t *testing.T) {
	g := newFakeGPU()
	a, b, _, bm := localPair(t, 1<<16, Config{})
	ptr, h, mem := g.alloc(1 << 16)
	fillRandom(mem)
	if err := a.MapDevice(ptr, 1<<16, g, fakeUUID, h); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([]Region{{ptr, 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	id, err := a.Post(Write, b.Name(), []Desc{{Local: ptr, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Failed {
		t.Fatalf("WRITE from GPU memory to an agent without devices: %v, %v; want failed", s, err)
	}
	if !bytes.Equal(bm[:4096], make([]byte, 4096)) {
		t.Fatal("bytes landed")
	}
	if imports, _ := g.counts(); imports != 0 {
		t.Fatalf("%d imports", imports)
	}
}

// Agents whose only memory is GPU memory (GPU engines) take the
// same-host path too: WRITE and READ between two GPUs' allocations.
func TestSameHostDeviceOnly(t *testing.T) {
	g := newFakeGPU()
	devices := func(u [16]byte) (Device, error) {
		if u != fakeUUID {
			return nil, fmt.Errorf("no GPU %x here", u)
		}
		return g, nil
	}
	var ags [2]*Agent
	var ptrs [2]uint64
	for i := range ags {
		a, err := New(Config{Name: fmt.Sprintf("%s-%d-%d", t.Name(), i, rand.Uint64()), DisableLocal: true, Devices: devices})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = a.Close() })
		ptr, h, _ := g.alloc(1 << 16)
		if err := a.MapDevice(ptr, 1<<16, g, fakeUUID, h); err != nil {
			t.Fatal(err)
		}
		if err := a.Register([]Region{{ptr, 1 << 16}}); err != nil {
			t.Fatal(err)
		}
		ags[i], ptrs[i] = a, ptr
	}
	a, b := ags[0], ags[1]
	if _, err := a.LoadPeer(b.Metadata()); err != nil {
		t.Fatal(err)
	}
	g.fill(ptrs[0], 1<<16)
	g.fill(ptrs[1], 1<<16)
	for _, op := range []Op{Write, Read} {
		if op == Read {
			g.fill(ptrs[1]+8192, 4096) // new bytes for the READ to bring back
		}
		ds := []Desc{{Local: ptrs[0] + 4096, Remote: ptrs[1] + 8192, Len: 4096}}
		id, err := a.Post(op, b.Name(), ds, nil)
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("%v between GPU-only agents: %v, %v", op, s, err)
		}
		if !bytes.Equal(g.view(ptrs[0]+4096, 4096), g.view(ptrs[1]+8192, 4096)) {
			t.Fatalf("%v: bytes differ", op)
		}
	}
	if a.SameHostParts()+b.SameHostParts() != 2 {
		t.Fatalf("same-host parts %d + %d, want 2", a.SameHostParts(), b.SameHostParts())
	}
}
