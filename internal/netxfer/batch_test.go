package netxfer

import (
	"bytes"
	"cmp"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// batchGPU is a fake GPU (a view of fakeGPU's memory: several batchGPUs
// over one fakeGPU are GPUs of one host) that copies batches as a GPU
// does: asynchronously, the bytes landing only when the batch runs. A
// held batch runs once release is called; failNext makes the next batch
// fail after it ran.
type batchGPU struct {
	*fakeGPU
	name     string
	mu       sync.Mutex
	posts    int
	pieces   int
	imported map[uint64]bool // imports made on this device
	hold     bool            // hold the batches posted from now on
	held     []*fakeCopy
	failNext error
}

// pieceBatch stages a fake device's batch as a list of pieces.
type pieceBatch struct {
	ps   []DevPiece
	room int
	post func([]DevPiece) (DevCopy, error)
}

func (b *pieceBatch) Add(dst, src, n uint64) bool {
	if len(b.ps) == b.room {
		return false
	}
	b.ps = append(b.ps, DevPiece{dst, src, n})
	return true
}

func (b *pieceBatch) Post() (DevCopy, error) { return b.post(b.ps) }
func (b *pieceBatch) Discard()               {}

type fakeCopy struct {
	done atomic.Bool
	err  error
}

func (c *fakeCopy) Done() (bool, error) {
	if c.done.Load() {
		return true, c.err
	}
	return false, nil
}

func newBatchGPU(g *fakeGPU, name string) *batchGPU {
	return &batchGPU{fakeGPU: g, name: name, imported: map[uint64]bool{}}
}

func (d *batchGPU) Import(h [64]byte) (uint64, error) {
	ptr, err := d.fakeGPU.Import(h)
	if err == nil {
		d.mu.Lock()
		d.imported[ptr] = true
		d.mu.Unlock()
	}
	return ptr, err
}

func (d *batchGPU) NewBatch(n int) (DevBatch, error) {
	return &pieceBatch{room: n, post: d.PostCopy}, nil
}

func (d *batchGPU) PostCopy(ps []DevPiece) (DevCopy, error) {
	ps = append([]DevPiece(nil), ps...)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.posts++
	d.pieces += len(ps)
	c := &fakeCopy{}
	run := func(err error) {
		for _, p := range ps {
			if e := d.copyPiece(p); e != nil {
				err = cmp.Or(err, e)
				break
			}
		}
		c.err = err
		c.done.Store(true)
	}
	err := d.failNext
	d.failNext = nil
	if d.hold {
		d.held = append(d.held, c)
		held := len(d.held) - 1
		go func() {
			for {
				d.mu.Lock()
				released := d.held[held] == nil
				d.mu.Unlock()
				if released {
					run(err)
					return
				}
				time.Sleep(time.Millisecond)
			}
		}()
		return c, nil
	}
	run(err)
	return c, nil
}

// copyPiece copies one piece of a batch; a piece outside every
// allocation is an illegal address (a GPU's context would be lost):
// counted, the batch failed.
func (d *batchGPU) copyPiece(p DevPiece) (err error) {
	g := d.fakeGPU
	g.mu.Lock()
	defer g.mu.Unlock()
	defer func() {
		if r := recover(); r != nil {
			g.illegal++
			err = fmt.Errorf("%v", r)
		}
	}()
	copy(d.at(p.Dst, p.Len), d.at(p.Src, p.Len))
	return nil
}

// release lets the held batches run.
func (d *batchGPU) release() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.hold = false
	for i := range d.held {
		d.held[i] = nil
	}
}

func (d *batchGPU) stats() (posts, pieces int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.posts, d.pieces
}

// pairGPU is a fake GPU that batchPair puts agents' memory on.
type pairGPU interface {
	Device
	alloc(n int) (uint64, [64]byte, []byte)
	fill(ptr, n uint64)
}

// batchPair returns two GPU-only agents on the same-host path: a's memory
// on GPU da, b's on db (the same fake device or two of one host).
func batchPair(t *testing.T, da, db pairGPU, cfg Config) (a, b *Agent, pa, pb uint64) {
	t.Helper()
	return batchPairCfgs(t, da, db, cfg, cfg)
}

// batchPairCfgs is batchPair with a config for each agent.
func batchPairCfgs(t *testing.T, da, db pairGPU, cfgA, cfgB Config) (a, b *Agent, pa, pb uint64) {
	t.Helper()
	uuids := map[pairGPU][16]byte{da: {0xda}, db: {0xdb}}
	devices := func(u [16]byte) (Device, error) {
		for d, du := range uuids {
			if du == u {
				return d, nil
			}
		}
		return nil, fmt.Errorf("no GPU %x here", u)
	}
	var ags [2]*Agent
	var ptrs [2]uint64
	for i, d := range []pairGPU{da, db} {
		c := []Config{cfgA, cfgB}[i]
		c.Name = fmt.Sprintf("%s-%d-%d", t.Name(), i, rand.Uint64())
		c.DisableLocal, c.Devices = true, devices
		ag, err := New(c)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ag.Close() })
		ptr, h, _ := d.alloc(1 << 20)
		if err := ag.MapDevice(ptr, 1<<20, d, uuids[d], h); err != nil {
			t.Fatal(err)
		}
		if err := ag.Register([]Region{{ptr, 1 << 20}}); err != nil {
			t.Fatal(err)
		}
		ags[i], ptrs[i] = ag, ptr
		d.fill(ptr, 1<<20)
	}
	if _, err := ags[0].LoadPeer(ags[1].Metadata()); err != nil {
		t.Fatal(err)
	}
	if _, err := ags[1].LoadPeer(ags[0].Metadata()); err != nil {
		t.Fatal(err)
	}
	return ags[0], ags[1], ptrs[0], ptrs[1]
}

// blockDescs returns n scattered descriptors of piece bytes between
// [local, +1 MiB) and [remote, +1 MiB): a permutation on each side.
func blockDescs(r *rand.Rand, local, remote uint64, n, piece int) []Desc {
	ls, rs := r.Perm((1<<20)/piece), r.Perm((1<<20)/piece)
	ds := make([]Desc, n)
	for i := range ds {
		ds[i] = Desc{Local: local + uint64(ls[i]*piece), Remote: remote + uint64(rs[i]*piece), Len: uint64(piece)}
	}
	return ds
}

func checkGPUMoved(t *testing.T, g *fakeGPU, op Op, ds []Desc) {
	t.Helper()
	for i, d := range ds {
		if !bytes.Equal(g.view(d.Local, d.Len), g.view(d.Remote, d.Len)) {
			t.Fatalf("%v: piece %d [%#x -> %#x, %d bytes] differs", op, i, d.Local, d.Remote, d.Len)
		}
	}
}

// A transfer's GPU pieces go to the device as one batch, WRITE and READ,
// whatever the number of connections: one launch per transfer, no piece
// copied on its own, every byte where it belongs.
func TestSameHostDeviceOneBatch(t *testing.T) {
	g := newFakeGPU()
	d := newBatchGPU(g, "gpu0")
	a, b, pa, pb := batchPair(t, d, d, Config{Conns: 4})
	r := rand.New(rand.NewPCG(3, 4))
	for i, op := range []Op{Write, Read, Write} {
		ds := blockDescs(r, pa, pb, 64, 4096)
		id, err := a.Post(op, b.Name(), ds, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("%v: %v, %v", op, s, err)
		}
		checkGPUMoved(t, g, op, ds)
		if posts, pieces := d.stats(); posts != i+1 || pieces != 64*(i+1) {
			t.Fatalf("after %d transfers of 64 pieces: %d batches of %d pieces in all; want one batch per transfer", i+1, posts, pieces)
		}
		g.fill(pa, 1<<20)
		g.fill(pb, 1<<20)
	}
	if _, copies := g.counts(); copies != 0 {
		t.Fatalf("%d pieces copied one by one", copies)
	}
}

// recordFence is a Fence that allows everything and records when each
// admission ends.
type recordFence struct {
	mu       sync.Mutex
	next     uint64
	admitted int
	ended    int
}

func (f *recordFence) Check(string, Op, uint64, uint64) Verdict { return Allow }

func (f *recordFence) Admit(string, Op, []Region, []byte, func()) (Verdict, int, uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.next++
	f.admitted++
	return Allow, 0, f.next
}

func (f *recordFence) Done(uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.ended++
}

func (f *recordFence) open() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.admitted - f.ended
}

// A batch still running holds everything its part holds: the admission
// (a grant's revocation waits for it), D's memory (Unmap waits), and the
// part's completion (no acknowledgement, no notification). Meanwhile the
// connection serves other parts: a second transfer on the one connection
// completes while the first's batch is held. Once the batch ran, all of
// it is let go and the bytes are there.
func TestDeviceBatchHeld(t *testing.T) {
	g := newFakeGPU()
	d := newBatchGPU(g, "gpu0")
	a, b, pa, pb := batchPair(t, d, d, Config{Conns: 1})
	f := &recordFence{}
	if err := b.SetGuard(f); err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(5, 6))
	first := blockDescs(r, pa, pb, 32, 4096)
	d.mu.Lock()
	d.hold = true
	d.mu.Unlock()
	id, err := a.Post(Write, b.Name(), first, []byte("first"))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(10 * time.Second)
	for posts, _ := d.stats(); posts == 0; posts, _ = d.stats() {
		if time.Now().After(deadline) {
			t.Fatal("the first batch was never posted")
		}
		time.Sleep(time.Millisecond)
	}
	// The second transfer on the same connection, not held, ends while
	// the first's batch still runs.
	d.mu.Lock()
	d.hold = false
	d.mu.Unlock()
	second := []Desc{{Local: pa, Remote: pb + 4096*255, Len: 4096}}
	id2, err := a.Post(Write, b.Name(), second, []byte("second"))
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id2); s != Done {
		t.Fatalf("second, while the first's batch is held: %v, %v", s, err)
	}
	checkGPUMoved(t, g, Write, second)
	// Unmap takes the memory lock first: it waits for the batch.
	unmapped := make(chan error, 1)
	go func() { unmapped <- b.Unmap(pb + 1<<19) }()
	time.Sleep(50 * time.Millisecond)
	if s, _ := a.State(id); s != InProgress {
		t.Fatalf("the first transfer is %v while its batch is held", s)
	}
	if n := f.open(); n != 1 {
		t.Fatalf("%d admissions open while a batch is held; want its part's", n)
	}
	select {
	case err := <-unmapped:
		t.Fatalf("Unmap returned (%v) while a batch writing that memory was held", err)
	default:
	}
	for _, n := range b.Drain(nil) {
		if string(n.Msg) == "first" {
			t.Fatal("the first transfer's notification was delivered while its batch was held")
		}
	}
	d.release()
	if s, err := wait(t, a, id); s != Done {
		t.Fatalf("first: %v, %v", s, err)
	}
	select {
	case <-unmapped:
	case <-time.After(10 * time.Second):
		t.Fatal("Unmap did not return once the batch ran")
	}
	checkGPUMoved(t, g, Write, first)
	if n := f.open(); n != 0 {
		t.Fatalf("%d admissions left open", n)
	}
}

// Agents on two GPUs of one host: the receiving side imports the sender's
// allocation on its own GPU as well and its batch reads through that
// import (no piece copied on its own).
func TestDeviceBatchTwoGPUs(t *testing.T) {
	g := newFakeGPU()
	d0, d1 := newBatchGPU(g, "gpu0"), newBatchGPU(g, "gpu1")
	a, b, pa, pb := batchPair(t, d0, d1, Config{})
	r := rand.New(rand.NewPCG(7, 8))
	ds := blockDescs(r, pa, pb, 16, 8192)
	id, err := a.Post(Write, b.Name(), ds, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done {
		t.Fatalf("%v, %v", s, err)
	}
	checkGPUMoved(t, g, Write, ds)
	if posts, _ := d1.stats(); posts != 1 {
		t.Fatalf("%d batches on the destination's GPU, want 1", posts)
	}
	d1.mu.Lock()
	imports := len(d1.imported)
	d1.mu.Unlock()
	if imports == 0 {
		t.Fatal("the sender's allocation was not imported on the destination's GPU")
	}
	if _, copies := g.counts(); copies != 0 {
		t.Fatalf("%d pieces copied one by one", copies)
	}
}

// A batch that fails fails its transfer, naming it; the connection and
// the next transfer carry on.
func TestDeviceBatchFails(t *testing.T) {
	g := newFakeGPU()
	d := newBatchGPU(g, "gpu0")
	a, b, pa, pb := batchPair(t, d, d, Config{Conns: 1})
	r := rand.New(rand.NewPCG(9, 10))
	d.mu.Lock()
	d.failNext = errors.New("an illegal address was encountered")
	d.mu.Unlock()
	id, err := a.Post(Write, b.Name(), blockDescs(r, pa, pb, 8, 4096), nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Failed || !strings.Contains(fmt.Sprint(err), "GPU copy: an illegal address") {
		t.Fatalf("a transfer whose batch failed: %v, %v; want failed naming the GPU copy", s, err)
	}
	ds := blockDescs(r, pa, pb, 8, 4096)
	id, err = a.Post(Write, b.Name(), ds, nil)
	if err != nil {
		t.Fatal(err)
	}
	if s, err := wait(t, a, id); s != Done {
		t.Fatalf("the next transfer: %v, %v", s, err)
	}
	checkGPUMoved(t, g, Write, ds)
}

// nopGPU is a GPU whose batches are done at once and move nothing: what
// the same-host path costs around the GPU's own work.
type nopGPU struct {
	next  atomic.Uint64
	mu    sync.Mutex
	words map[uint64][4]byte // what 4-byte CopyIns stored (gates' generations)
}

type nopDone struct{}

func (nopDone) Done() (bool, error) { return true, nil }

func (g *nopGPU) Import([64]byte) (uint64, error)      { return 0x5000_0000_0000 + g.next.Add(1<<32), nil }
func (g *nopGPU) Unmap(uint64) error                   { return nil }
func (g *nopGPU) CopyDevice(uint64, uint64, int) error { return nil }
func (g *nopGPU) CopyIn(dst uint64, b []byte) error {
	if len(b) == 4 {
		g.mu.Lock()
		defer g.mu.Unlock()
		if g.words == nil {
			g.words = map[uint64][4]byte{}
		}
		g.words[dst] = [4]byte(b)
	}
	return nil
}

func (g *nopGPU) SideCopyIn(dst uint64, b []byte) error  { return g.CopyIn(dst, b) }
func (g *nopGPU) SideCopyOut(b []byte, src uint64) error { return g.CopyOut(b, src) }

func (g *nopGPU) CopyOut(b []byte, src uint64) error {
	clear(b)
	if len(b) == 4 {
		g.mu.Lock()
		defer g.mu.Unlock()
		w := g.words[src]
		copy(b, w[:])
	}
	return nil
}
func (g *nopGPU) NewBatch(int) (DevBatch, error) { return nopBatch{}, nil }

// It makes gates too (their words read 0: nothing inside).
func (g *nopGPU) Alloc(int) (uint64, error)       { return 0x4000_0000_0000 + g.next.Add(1<<32), nil }
func (g *nopGPU) Free(uint64) error               { return nil }
func (g *nopGPU) Export(uint64) ([64]byte, error) { return [64]byte{0xff}, nil }

// nopBatch stages nothing and is done at once.
type nopBatch struct{}

func (nopBatch) Add(uint64, uint64, uint64) bool        { return true }
func (nopBatch) AddLayout([]DevRegion, []DevEntry) bool { return true }
func (nopBatch) Post() (DevCopy, error)                 { return nopDone{}, nil }
func (nopBatch) Discard()                               {}
func (nopBatch) Gate(uint64, uint32) bool               { return true }
func (nopDone) Shut() bool                              { return false }

// BenchmarkSameHostDeviceOverhead: a WRITE of 32 layers x n blocks of
// GPU memory (256 and 8,192 pieces of 64 KiB) on the same-host path, post
// to completion, the GPU's work left out (nopGPU): what the path adds to
// the kernel, posted as pieces (Post) and as one layout (PostLayout: 32
// bases, n entries), READs likewise, and a layout WRITE one-sided
// through the receiver's gate ("gate": the receiver offered its memory
// as one grant; the sender checks and launches, then notifies).
func BenchmarkSameHostDeviceOverhead(b *testing.B) {
	g := &nopGPU{}
	devices := func([16]byte) (Device, error) { return g, nil }
	const piece, layer, layers = 64 << 10, 32 << 20, 32
	const size = layers * layer
	var ags [2]*Agent
	var ptrs [2]uint64
	for i := range ags {
		a, err := New(Config{Name: fmt.Sprintf("bench-%d-%d", i, rand.Uint64()), DisableLocal: true, Devices: devices})
		if err != nil {
			b.Fatal(err)
		}
		defer a.Close()
		ptr := uint64(0x7000_0000_0000 + i<<40)
		if err := a.MapDevice(ptr, size, g, [16]byte{1}, [64]byte{byte(i)}); err != nil {
			b.Fatal(err)
		}
		if err := a.Register([]Region{{ptr, size}}); err != nil {
			b.Fatal(err)
		}
		ags[i], ptrs[i] = a, ptr
	}
	a, c := ags[0], ags[1]
	if _, err := a.LoadPeer(c.Metadata()); err != nil {
		b.Fatal(err)
	}
	if _, err := c.LoadPeer(a.Metadata()); err != nil {
		b.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 1))
	ls, rs := r.Perm(layer/piece), r.Perm(layer/piece)
	// The grant as a Worker offers it: each layer's base, the request's
	// blocks (the most a case writes) in each.
	tag := []byte("bench")
	var grant LayoutSpan
	for l := range layers {
		grant.Bases = append(grant.Bases, ptrs[1]+uint64(l*layer))
	}
	for i := range 256 {
		grant.Entries = append(grant.Entries, Region{uint64(rs[i] * piece), piece})
	}
	if err := c.OpenGate(a.Name(), []LayoutSpan{grant}, tag); err != nil {
		b.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		if _, n := a.GatesOpen(); n == 1 {
			break
		}
		if time.Now().After(deadline) {
			b.Fatal("the gate never reached the sender")
		}
	}
	for _, form := range []string{"pieces", "layout", "read-pieces", "read-layout", "gate"} {
		for _, blocks := range []int{8, 256} {
			b.Run(fmt.Sprintf("%s/%d", form, layers*blocks), func(b *testing.B) {
				var lay Layout
				for l := range layers {
					lay.Bases = append(lay.Bases, BasePair{ptrs[0] + uint64(l*layer), ptrs[1] + uint64(l*layer)})
				}
				for i := range blocks {
					lay.Entries = append(lay.Entries, LayoutEntry{uint64(ls[i] * piece), uint64(rs[i] * piece), piece})
				}
				ds := ExpandLayouts(nil, []Layout{lay})
				before, parts := c.SameHostParts(), c.LayoutParts()
				if strings.HasPrefix(form, "read-") {
					before = a.SameHostParts()
				}
				op := Write
				if strings.HasPrefix(form, "read-") {
					op = Read
				}
				var notif []byte
				oneSided := a.OneSidedWrites()
				if form == "gate" {
					notif = tag
				}
				for range b.N {
					if strings.HasSuffix(form, "pieces") {
						postDone(b, a, op, c.Name(), ds)
						continue
					}
					id, err := a.PostLayout(op, c.Name(), []Layout{lay}, notif)
					if err != nil {
						b.Fatal(err)
					}
					waitID(b, a, id)
				}
				if form == "gate" {
					if a.OneSidedWrites()-oneSided != uint64(b.N) || c.LayoutParts() != parts {
						b.Fatal("the transfers did not go one-sided")
					}
					_ = c.Drain(nil)
					return
				}
				moved := c.SameHostParts()
				if op == Read {
					moved = a.SameHostParts()
				}
				if moved == before || strings.HasSuffix(form, "layout") != (c.LayoutParts() > parts) {
					b.Fatal("the transfers did not take the same-host path in their form")
				}
			})
		}
	}
}

// The descriptor ring: tables go in one after another, wrap to the start
// when the end has no room for the next, and a table goes inline (false)
// while the server has not consumed enough of the ring for it.
func TestDescriptorRing(t *testing.T) {
	c := &conn{descs: make([]byte, descAreaSize)}
	consume := func(n uint64) { *(*uint64)(unsafe.Pointer(&c.descs[0])) = n }
	tab := bytes.Repeat([]byte{7}, 1<<20)
	var last uint64
	for i := range 3 {
		pos, ok := c.putTable(tab)
		if !ok || pos != uint64(i)<<20 {
			t.Fatalf("table %d: at %d, %v; want at %d", i, pos, ok, i<<20)
		}
		last = pos
	}
	// 3 MiB written, 4 MiB - 64 of ring: the fourth does not fit before
	// the end, and the start is not consumed yet.
	if _, ok := c.putTable(tab); ok {
		t.Fatal("a table was written over bytes the server has not consumed")
	}
	consume(last + 1<<20) // all three consumed
	pos, ok := c.putTable(tab)
	if !ok || pos%descRingSize != 0 || pos != descRingSize {
		t.Fatalf("after the server consumed the ring: at %d (offset %d), %v; want the ring's start", pos, pos%descRingSize, ok)
	}
	if !bytes.Equal(c.descs[descRingOff:descRingOff+1<<20], tab) {
		t.Fatal("the table is not where its position says")
	}
	if _, ok := c.putTable(make([]byte, descRingSize/2+1)); ok {
		t.Fatal("a table over half the ring went into it")
	}
}

// Same-host WRITEs whose tables go through the descriptor area, enough of
// them to wrap its ring several times, every byte checked.
func TestSameHostTablesInArea(t *testing.T) {
	a, b, am, bm := localPair(t, 1<<20, Config{Conns: 1})
	r := rand.New(rand.NewPCG(11, 12))
	for i := range 60 {
		fillRandom(am)
		ls, rs := r.Perm(1<<20/64), r.Perm(1<<20/64)
		ds := make([]Desc, 6000) // a table of 168,000 bytes
		for j := range ds {
			ds[j] = Desc{Local: base + uint64(ls[j]*64), Remote: base + uint64(rs[j]*64), Len: 64}
		}
		id, err := a.Post(Write, b.Name(), ds, nil)
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, a, id); s != Done {
			t.Fatalf("transfer %d: %v, %v", i, s, err)
		}
		for j, d := range ds {
			if !bytes.Equal(am[d.Local-base:][:64], bm[d.Remote-base:][:64]) {
				t.Fatalf("transfer %d piece %d differs", i, j)
			}
		}
		_ = a.Release(id)
	}
	if n := b.areaTables.Load(); n != 60 {
		t.Fatalf("%d tables read from the descriptor area, want 60", n)
	}
}

// sendArea passes f as the connection's descriptor area.
func sendArea(t *testing.T, uc *net.UnixConn, f *os.File) {
	t.Helper()
	if _, _, err := uc.WriteMsgUnix([]byte{tDescs}, unix.UnixRights(int(f.Fd())), nil); err != nil {
		t.Logf("write: %v", err)
	}
}

// sendWriteTable sends a local WRITE part of n pieces whose table is at
// pos of the descriptor ring.
func sendWriteTable(t *testing.T, uc *net.UnixConn, id, pos uint64, n uint32) {
	t.Helper()
	h := []byte{tWriteTable}
	h = binary.LittleEndian.AppendUint64(h, id)
	h = binary.LittleEndian.AppendUint32(h, 0)
	h = binary.LittleEndian.AppendUint32(h, 1)
	h = binary.LittleEndian.AppendUint32(h, n)
	h = binary.LittleEndian.AppendUint32(h, 0)
	h = binary.LittleEndian.AppendUint64(h, pos)
	if _, err := uc.Write(h); err != nil {
		t.Logf("write: %v", err)
	}
}

// A peer's descriptor area is checked like any other frame of it: a
// table named in an area never passed, a table running past the ring's
// end, a second area and an area file shorter than an area are refused
// (the connection dropped, nothing landed); a table where it belongs
// lands, and marks the ring consumed up to its end.
func TestSameHostBadTableArea(t *testing.T) {
	_, b, _, bm := localPair(t, 1<<16, Config{})
	table := func(area []byte, pos uint64, ref [4]uint64) {
		e := area[descRingOff+pos%descRingSize:]
		binary.LittleEndian.PutUint64(e, ref[0])
		binary.LittleEndian.PutUint64(e[8:], ref[1])
		binary.LittleEndian.PutUint32(e[16:], uint32(ref[2]))
		binary.LittleEndian.PutUint64(e[20:], ref[3])
	}
	ref := [4]uint64{base, 4096, 7, 0}
	refused := func(name string, r *scatterReader) {
		t.Helper()
		if typ, msg, err := readAck(t, r); err == nil {
			t.Fatalf("%s: answered %d %q, want the connection dropped", name, typ, msg)
		}
	}
	{ // no area
		uc, r := rawLocal(t, b, false)
		_, f := memFile(t, 1<<16)
		sendChunk(t, uc, 7, f, 1<<16)
		sendWriteTable(t, uc, 1, 0, 1)
		refused("a table without an area", r)
	}
	{ // past the ring's end
		uc, r := rawLocal(t, b, false)
		_, f := memFile(t, 1<<16)
		sendChunk(t, uc, 7, f, 1<<16)
		area, af := memFile(t, descAreaSize)
		sendArea(t, uc, af)
		pos := uint64(descRingSize - localDescSize + 1)
		table(area, 0, ref)
		sendWriteTable(t, uc, 1, pos, 1)
		refused("a table past the ring's end", r)
	}
	{ // a second area
		uc, r := rawLocal(t, b, false)
		_, af := memFile(t, descAreaSize)
		sendArea(t, uc, af)
		sendArea(t, uc, af)
		refused("a second area", r)
	}
	{ // a short area file
		uc, r := rawLocal(t, b, false)
		_, af := memFile(t, descAreaSize/2)
		sendArea(t, uc, af)
		_, f := memFile(t, 1<<16)
		sendChunk(t, uc, 7, f, 1<<16)
		sendWriteTable(t, uc, 1, 0, 1)
		refused("a short area", r)
	}
	if !bytes.Equal(bm, make([]byte, len(bm))) {
		t.Fatal("bytes landed from a refused table")
	}
	// Where it belongs: the part lands and the ring is consumed.
	uc, r := rawLocal(t, b, false)
	src, f := memFile(t, 1<<16)
	fillRandom(src)
	sendChunk(t, uc, 7, f, 1<<16)
	area, af := memFile(t, descAreaSize)
	sendArea(t, uc, af)
	const pos = 3 * localDescSize
	table(area, pos, ref)
	sendWriteTable(t, uc, 1, pos, 1)
	if typ, msg, err := readAck(t, r); err != nil || typ != tAck || msg != "" {
		t.Fatalf("a table in the area: answer %d %q, %v", typ, msg, err)
	}
	if !bytes.Equal(bm[:4096], src[:4096]) {
		t.Fatal("the part whose table was in the area did not land")
	}
	if got := binary.LittleEndian.Uint64(area); got != pos+localDescSize {
		t.Fatalf("ring consumed up to %d, want %d", got, pos+localDescSize)
	}
}
