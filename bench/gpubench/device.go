package main

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/internal/netxfer"
)

// gpu is a GPU as the bench uses it: CUDA's (cudaGPU) or, with -fake-gpu,
// host memory standing in for it (fakeGPU, for tests without a GPU). Both
// are netxfer Devices: the same-host contender hands them to its agents.
// This file is the only place that adapts a device to netxfer.Device.
type gpu interface {
	netxfer.BatchDevice
	// PostCopy stages ps as one batch and posts it (the copy kernel).
	PostCopy(ps []netxfer.DevPiece) (netxfer.DevCopy, error)
	// PostEach queues one asynchronous copy per piece (the same stream).
	PostEach(ps []netxfer.DevPiece) (netxfer.DevCopy, error)
	Alloc(n int) (uint64, error)
	Free(ptr uint64) error
	Export(ptr uint64) ([64]byte, error)
	UUID() ([16]byte, error)
	Ordinal() int
	// Sync returns once every copy this process queued has finished
	// (cuMemcpyDtoD between device addresses returns before it is done).
	Sync() error
	Close() error
}

var (
	_ gpu = (*cudaGPU)(nil)
	_ gpu = (*fakeGPU)(nil)
	// Both make gates (kvxfer's one-sided same-host WRITE).
	_ netxfer.GateDevice = (*cudaGPU)(nil)
	_ netxfer.GateDevice = (*fakeGPU)(nil)
)

// cudaGPU is a CUDA device of this process.
type cudaGPU struct {
	*cuda.Device
	scratch uint64 // 8 bytes read back by Sync
}

func openCUDA(ordinal int) (*cudaGPU, error) {
	d, err := cuda.Open(ordinal)
	if err != nil {
		return nil, err
	}
	p, err := d.Alloc(8)
	if err != nil {
		d.Close()
		return nil, err
	}
	return &cudaGPU{Device: d, scratch: p}, nil
}

func (g *cudaGPU) Export(ptr uint64) ([64]byte, error) {
	h, err := g.Device.Export(ptr)
	return [64]byte(h), err
}

func (g *cudaGPU) Import(h [64]byte) (uint64, error) { return g.Device.Import(cuda.Handle(h)) }

func cudaPieces(ps []netxfer.DevPiece) []cuda.Piece {
	return unsafe.Slice((*cuda.Piece)(unsafe.Pointer(unsafe.SliceData(ps))), len(ps))
}

// NewBatch is the same-host path's batch: one launch of the copy kernel.
func (g *cudaGPU) NewBatch(n int) (netxfer.DevBatch, error) {
	b, err := g.Device.NewBatch(n)
	if err != nil {
		return nil, err
	}
	return cudaBatch{b}, nil
}

type cudaBatch struct{ *cuda.Batch }

// AddLayout stages a layout as the kernel's regions and entries (the same
// shapes as cuda's).
func (b cudaBatch) AddLayout(regions []netxfer.DevRegion, entries []netxfer.DevEntry) bool {
	return b.Batch.AddLayout(unsafe.Slice((*cuda.Region)(unsafe.Pointer(unsafe.SliceData(regions))), len(regions)),
		unsafe.Slice((*cuda.Entry)(unsafe.Pointer(unsafe.SliceData(entries))), len(entries)))
}

func (b cudaBatch) Post() (netxfer.DevCopy, error) {
	c, err := b.Batch.Post()
	if err != nil {
		return nil, err
	}
	return c, nil
}

func (g *cudaGPU) PostCopy(ps []netxfer.DevPiece) (netxfer.DevCopy, error) {
	c, err := g.Device.Post(cudaPieces(ps))
	if err != nil {
		return nil, err
	}
	return c, nil
}

func (g *cudaGPU) PostEach(ps []netxfer.DevPiece) (netxfer.DevCopy, error) {
	c, err := g.Device.PostEach(cudaPieces(ps))
	if err != nil {
		return nil, err
	}
	return c, nil
}

// Sync reads 8 bytes back: a device-to-host copy on the legacy default
// stream waits for the copies queued before it and returns when done.
func (g *cudaGPU) Sync() error {
	var b [8]byte
	return g.CopyOut(b[:], g.scratch)
}

func (g *cudaGPU) Close() error {
	_ = g.Free(g.scratch)
	return g.Device.Close()
}

// fakeGPU stands in for a GPU with host memory, for running the bench
// where there is none (its test): an allocation is a file under /dev/shm
// mapped shared, its address is where it is mapped, and its "IPC handle"
// is the file's path, which another process of this user maps.
type fakeGPU struct {
	mu    sync.Mutex
	maps  map[uint64][]byte // by address: allocations and imports
	files map[uint64]string // allocations' files, removed by Free
	busy  time.Duration     // how long after its post a batch is done
}

func newFakeGPU() *fakeGPU { return &fakeGPU{maps: map[uint64][]byte{}, files: map[uint64]string{}} }

func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

func fakeDir() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return "/dev/shm"
	}
	return os.TempDir()
}

func (g *fakeGPU) mapFile(path string, n int) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if n < 0 {
		st, err := f.Stat()
		if err != nil {
			return nil, err
		}
		n = int(st.Size())
	}
	return unix.Mmap(int(f.Fd()), 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
}

func (g *fakeGPU) Alloc(n int) (uint64, error) {
	var r [8]byte
	_, _ = rand.Read(r[:])
	path := filepath.Join(fakeDir(), "gpubench-"+hex.EncodeToString(r[:]))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, err
	}
	err = f.Truncate(int64(n))
	f.Close()
	var b []byte
	if err == nil {
		b, err = g.mapFile(path, n)
	}
	if err != nil {
		os.Remove(path)
		return 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	p := addrOf(b)
	g.maps[p], g.files[p] = b, path
	return p, nil
}

func (g *fakeGPU) Free(ptr uint64) error {
	g.mu.Lock()
	path, ok := g.files[ptr]
	delete(g.files, ptr)
	g.mu.Unlock()
	if !ok {
		return errors.New("fake gpu: free of memory not allocated")
	}
	os.Remove(path)
	return g.Unmap(ptr)
}

func (g *fakeGPU) Export(ptr uint64) (h [64]byte, err error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	path, ok := g.files[ptr]
	if !ok || len(path) > len(h) {
		return h, fmt.Errorf("fake gpu: export %#x: not an allocation", ptr)
	}
	copy(h[:], path)
	return h, nil
}

func (g *fakeGPU) Import(h [64]byte) (uint64, error) {
	path := strings.TrimRight(string(h[:]), "\x00")
	if !strings.HasPrefix(filepath.Base(path), "gpubench-") {
		return 0, fmt.Errorf("fake gpu: import %q: not a handle", path)
	}
	b, err := g.mapFile(path, -1)
	if err != nil {
		return 0, err
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	g.maps[addrOf(b)] = b
	return addrOf(b), nil
}

func (g *fakeGPU) Unmap(ptr uint64) error {
	g.mu.Lock()
	b, ok := g.maps[ptr]
	delete(g.maps, ptr)
	g.mu.Unlock()
	if !ok {
		return fmt.Errorf("fake gpu: unmap %#x: not mapped", ptr)
	}
	return unix.Munmap(b)
}

// at returns the mapped bytes [ptr, ptr+n).
func (g *fakeGPU) at(ptr uint64, n int) ([]byte, error) {
	g.mu.Lock()
	defer g.mu.Unlock()
	for base, b := range g.maps {
		if ptr >= base && ptr-base+uint64(n) <= uint64(len(b)) {
			return b[ptr-base : ptr-base+uint64(n)], nil
		}
	}
	return nil, fmt.Errorf("fake gpu: [%#x, +%d) is not mapped", ptr, n)
}

func (g *fakeGPU) CopyDevice(dst, src uint64, n int) error {
	d, err := g.at(dst, n)
	if err != nil {
		return err
	}
	s, err := g.at(src, n)
	if err != nil {
		return err
	}
	copy(d, s)
	return nil
}

// fakeDone is a fake batch: copied when posted, done at (a kernel's
// time later, with -fake-gpu-busy).
type fakeDone struct{ at time.Time }

func (d fakeDone) Done() (bool, error) { return !time.Now().Before(d.at), nil }

func (g *fakeGPU) PostCopy(ps []netxfer.DevPiece) (netxfer.DevCopy, error) {
	for _, p := range ps {
		if err := g.CopyDevice(p.Dst, p.Src, int(p.Len)); err != nil {
			return nil, err
		}
	}
	return fakeDone{time.Now().Add(g.busy)}, nil
}

func (g *fakeGPU) PostEach(ps []netxfer.DevPiece) (netxfer.DevCopy, error) { return g.PostCopy(ps) }

func (g *fakeGPU) NewBatch(n int) (netxfer.DevBatch, error) { return &fakeBatch{g: g, room: n}, nil }

// fakeBatch stages a fake batch as a list of pieces, copied when posted.
type fakeBatch struct {
	g    *fakeGPU
	room int
	ps   []netxfer.DevPiece
	gate uint64
	want uint32
}

func (b *fakeBatch) Add(dst, src, n uint64) bool {
	if len(b.ps) == b.room {
		return false
	}
	b.ps = append(b.ps, netxfer.DevPiece{Dst: dst, Src: src, Len: n})
	return true
}

func (b *fakeBatch) AddLayout(regions []netxfer.DevRegion, entries []netxfer.DevEntry) bool {
	for _, r := range regions {
		for _, e := range entries {
			b.ps = append(b.ps, netxfer.DevPiece{Dst: r.Dst + e.Dst, Src: r.Src + e.Src, Len: e.Len})
		}
	}
	return true
}

func (b *fakeBatch) Post() (netxfer.DevCopy, error) {
	if b.gate != 0 {
		return b.g.postGated(b.ps, b.gate, b.want)
	}
	return b.g.PostCopy(b.ps)
}
func (b *fakeBatch) Discard() {}

// Gate makes the batch gated (netxfer.GatedBatch): copied as the gated
// kernel copies, piece by piece (a CTA each), through the gate at gate.
func (b *fakeBatch) Gate(gate uint64, want uint32) bool {
	b.gate, b.want = gate, want
	return true
}

// fakeGated is a fake gated batch's result.
type fakeGated struct {
	fakeDone
	shut bool
}

func (c fakeGated) Shut() bool { return c.shut }

// postGated copies ps as the gated kernel does: each piece counted in the
// gate (its words in shared memory: atomics across the processes), the
// generation read, the piece copied only if it is want, counted out.
func (g *fakeGPU) postGated(ps []netxfer.DevPiece, gate uint64, want uint32) (netxfer.DevCopy, error) {
	gb, err := g.at(gate, netxfer.GateSize)
	if err != nil {
		return nil, err
	}
	gen := (*uint32)(unsafe.Pointer(&gb[0]))
	shut := false
	for i, p := range ps {
		act := (*uint32)(unsafe.Pointer(&gb[64+4*(i%16)]))
		atomic.AddUint32(act, 1)
		if atomic.LoadUint32(gen) == want {
			err = g.CopyDevice(p.Dst, p.Src, int(p.Len))
		} else {
			shut = true
		}
		atomic.AddUint32(act, ^uint32(0))
		if err != nil {
			return nil, err
		}
	}
	return fakeGated{fakeDone{time.Now().Add(g.busy)}, shut}, nil
}

func (g *fakeGPU) CopyIn(dst uint64, src []byte) error {
	d, err := g.at(dst, len(src))
	if err == nil {
		copy(d, src)
	}
	return err
}

func (g *fakeGPU) CopyOut(dst []byte, src uint64) error {
	s, err := g.at(src, len(dst))
	if err == nil {
		copy(dst, s)
	}
	return err
}

// SideCopyIn and SideCopyOut are CopyIn and CopyOut (no streams here).
func (g *fakeGPU) SideCopyIn(dst uint64, src []byte) error  { return g.CopyIn(dst, src) }
func (g *fakeGPU) SideCopyOut(dst []byte, src uint64) error { return g.CopyOut(dst, src) }

func (g *fakeGPU) UUID() ([16]byte, error) { return [16]byte{0xfa, 0xce}, nil }
func (g *fakeGPU) Ordinal() int            { return 0 }
func (g *fakeGPU) Sync() error             { return nil }

func (g *fakeGPU) Close() error {
	g.mu.Lock()
	var ps []uint64
	for p := range g.files {
		ps = append(ps, p)
	}
	g.mu.Unlock()
	for _, p := range ps {
		_ = g.Free(p)
	}
	return nil
}
