package netxfer

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// slowCopyIn is a GPU whose copies from host memory start a while after
// they are asked for (a busy stream): delay later, or (delay < 0) once
// release is closed; started is closed at the first.
type slowCopyIn struct {
	*fakeGPU
	delay   *atomic.Int64 // ns
	once    *sync.Once
	started chan struct{}
	release chan struct{}
}

func newSlowCopyIn(g *fakeGPU, delay time.Duration) slowCopyIn {
	s := slowCopyIn{g, new(atomic.Int64), new(sync.Once), make(chan struct{}), make(chan struct{})}
	s.delay.Store(int64(delay))
	return s
}

func (g slowCopyIn) CopyIn(dst uint64, src []byte) error {
	g.once.Do(func() { close(g.started) })
	if d := time.Duration(g.delay.Load()); d >= 0 {
		time.Sleep(d)
	} else {
		select {
		case <-g.release:
		case <-time.After(10 * time.Second): // the test ended without it
		}
	}
	return g.fakeGPU.CopyIn(dst, src)
}

// holdFence admits everything; a READ's admission is a P hold on the
// blocks: once it is done (Done), the engine reuses them at once (reuse).
// end ends the hold as a Worker's table does: it cuts the admissions
// still open (abort) and waits for them to be done.
type holdFence struct {
	mu     sync.Mutex
	n      uint64
	open   map[uint64]*holdAdmission
	reuse  func(Region)
	closed atomic.Bool // the test is over: reuse nothing
	// reusing is held (read) while a reuse runs: the test's end takes it
	// (stop) before its memory goes.
	reusing sync.RWMutex
}

// stop ends the reuses: none starts after it returns, and none runs.
func (f *holdFence) stop() {
	f.closed.Store(true)
	f.reusing.Lock()
	defer f.reusing.Unlock()
}

type holdAdmission struct {
	ranges []Region
	abort  func()
	done   chan struct{}
}

func newHoldFence(reuse func(Region)) *holdFence {
	return &holdFence{open: map[uint64]*holdAdmission{}, reuse: reuse}
}

func (f *holdFence) Check(string, Op, uint64, uint64) Verdict { return Allow }
func (f *holdFence) Admit(_ string, op Op, ranges []Region, _ []byte, abort func()) (Verdict, int, uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.n++
	if op == Read {
		f.open[f.n] = &holdAdmission{append([]Region(nil), ranges...), abort, make(chan struct{})}
	}
	return Allow, -1, f.n
}

func (f *holdFence) Done(t uint64) {
	f.mu.Lock()
	ad := f.open[t]
	delete(f.open, t)
	f.mu.Unlock()
	if ad == nil {
		return
	}
	f.reusing.RLock()
	if !f.closed.Load() {
		for _, r := range ad.ranges {
			f.reuse(r)
		}
	}
	f.reusing.RUnlock()
	close(ad.done)
}

// openCount is the READ admissions not done.
func (f *holdFence) openCount() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.open)
}

// end cuts every open READ admission and waits until each is done.
func (f *holdFence) end(t *testing.T) {
	f.mu.Lock()
	var ads []*holdAdmission
	for _, ad := range f.open {
		ads = append(ads, ad)
	}
	f.mu.Unlock()
	for _, ad := range ads {
		if ad.abort != nil {
			ad.abort()
		}
		select {
		case <-ad.done:
		case <-time.After(10 * time.Second):
			t.Fatal("the hold's end waited 10 s for a READ admission")
		}
	}
}

// readHoldSetup: a reads b's host memory (a memory file) into a's GPU
// memory, whose copies start late; b's fence reuses the blocks (0xee) as
// soon as a READ's admission is done.
func readHoldSetup(t *testing.T, delay time.Duration, cfg Config) (a, b *Agent, bm []byte, g *fakeGPU, gpu slowCopyIn, ptr uint64, f *holdFence) {
	t.Helper()
	g = newFakeGPU()
	a, b, _, bm = localPair(t, 1<<16, cfg)
	ptr, h, _ := g.alloc(1 << 16)
	gpu = newSlowCopyIn(g, delay)
	if err := a.MapDevice(ptr, 1<<16, gpu, fakeUUID, h); err != nil {
		t.Fatal(err)
	}
	if err := a.Register([]Region{{ptr, 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	fillRandom(bm)
	var mu sync.Mutex
	f = newHoldFence(func(r Region) {
		mu.Lock()
		defer mu.Unlock()
		for i := range r.Len {
			bm[r.Addr-base+i] = 0xee // the next request's KV
		}
	})
	t.Cleanup(f.stop) // before bm is unmapped: a Done still reusing it was the test's own fault
	if err := b.SetGuard(f); err != nil {
		t.Fatal(err)
	}
	return
}

// A same-host READ is admitted by the side it reads until the reader
// says it copied the bytes: the blocks are not given back while the copy
// may still read them (the reader's GPU stream starts it 100 ms late),
// and they are given back once it did, without the hold's end.
func TestSameHostReadHeldUntilCopied(t *testing.T) {
	a, b, bm, g, _, ptr, f := readHoldSetup(t, 100*time.Millisecond, Config{})
	want := bytes.Clone(bm[:4096])
	id, err := a.Post(Read, b.Name(), []Desc{{Local: ptr, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Done {
		t.Fatalf("READ: %v, %v", st, err)
	}
	if got := g.view(ptr, 4096); !bytes.Equal(got, want) {
		t.Fatalf("READ done with bytes copied after the hold let them go (first byte %#x, want %#x)", got[0], want[0])
	}
	if a.SameHostParts() == 0 {
		t.Fatal("not on the same-host path")
	}
	waitFor(t, "the READ's admission ends with the reader's acknowledgement", func() bool { return f.openCount() == 0 })
}

// A hold that ends while the reader still copies waits for it: the
// reader's acknowledgement ends the admission, and only then are the
// blocks reused, so the READ lands what the hold covered.
func TestSameHostReadHoldEndWaitsForCopy(t *testing.T) {
	a, b, bm, g, gpu, ptr, f := readHoldSetup(t, 100*time.Millisecond, Config{})
	want := bytes.Clone(bm[:4096])
	id, err := a.Post(Read, b.Name(), []Desc{{Local: ptr, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	recv(t, gpu.started, "the reader's copy to start") // it has its answer and is copying
	f.end(t)
	if st, err := wait(t, a, id); st != Done {
		t.Fatalf("READ: %v, %v", st, err)
	}
	if got := g.view(ptr, 4096); !bytes.Equal(got, want) {
		t.Fatalf("READ done with bytes of the blocks' next use (first byte %#x, want %#x)", got[0], want[0])
	}
}

// A reader that does not acknowledge within the grace after the hold's
// end (its copy starts only once the test lets it, after that end) is
// withdrawn from: the hold's end returns without waiting for the copy,
// and the READ fails instead of landing the reused blocks as done. The
// next READ, on a new connection, lands.
func TestSameHostReadUnacknowledgedWithdrawn(t *testing.T) {
	a, b, bm, g, gpu, ptr, f := readHoldSetup(t, -1, Config{readAckGrace: 20 * time.Millisecond})
	id, err := a.Post(Read, b.Name(), []Desc{{Local: ptr, Remote: base, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	recv(t, gpu.started, "the reader's copy to start")
	f.end(t) // fails the test if it waits for the copy
	gpu.delay.Store(0)
	close(gpu.release)
	if st, err := wait(t, a, id); st != Failed || !errors.Is(err, ErrXferFailed) {
		t.Fatalf("READ copied after its hold ended and was withdrawn from: %v, %v; want Failed", st, err)
	}
	fillRandom(bm[:4096])
	want := bytes.Clone(bm[:4096])
	// (A READ posted before a noticed the connection closed fails with
	// it; the next goes on a new one.)
	for try := 0; ; try++ {
		id, err = a.Post(Read, b.Name(), []Desc{{Local: ptr + 8192, Remote: base, Len: 4096}}, nil)
		if err != nil {
			t.Fatal(err)
		}
		st, err := wait(t, a, id)
		if st == Done {
			break
		}
		if try == 3 {
			t.Fatalf("the READ after: %v, %v", st, err)
		}
	}
	if !bytes.Equal(g.view(ptr+8192, 4096), want) {
		t.Fatal("the READ after landed wrong bytes")
	}
}

// A reader of a build from before acknowledgements is never answered
// with where the bytes lie (it would not say when it is done with
// them): host memory goes over the socket, and the admission ends once
// it went out; GPU memory, which has no such path, fails that READ with
// a clear error.
func TestSameHostReadOlderReader(t *testing.T) {
	g := newFakeGPU()
	devs := func(u [16]byte) (Device, error) {
		if u != fakeUUID {
			return nil, fmt.Errorf("no GPU %x here", u)
		}
		return g, nil
	}
	a, am := newMemAgent(t, "a", 1<<16, Config{noReadAcks: true, Devices: devs})
	b, bm := newMemAgent(t, "b", 1<<16, Config{Devices: devs})
	bd, h, _ := g.alloc(1 << 16)
	if err := b.MapDevice(bd, 1<<16, g, fakeUUID, h); err != nil {
		t.Fatal(err)
	}
	if err := b.Register([]Region{{bd, 1 << 16}}); err != nil {
		t.Fatal(err)
	}
	for _, p := range [][2]*Agent{{a, b}, {b, a}} {
		if _, err := p[0].LoadPeer(p[1].Metadata()); err != nil {
			t.Fatal(err)
		}
	}
	f := newHoldFence(func(Region) {})
	if err := b.SetGuard(f); err != nil {
		t.Fatal(err)
	}
	fillRandom(bm)
	id, err := a.Post(Read, b.Name(), []Desc{{Local: base, Remote: base + 4096, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Done {
		t.Fatalf("host READ: %v, %v", st, err)
	}
	if !bytes.Equal(am[:4096], bm[4096:8192]) {
		t.Fatal("host READ landed wrong bytes")
	}
	if n := b.SameHostParts(); n != 0 {
		t.Fatalf("b answered %d parts with where the bytes lie to a reader that does not acknowledge", n)
	}
	waitFor(t, "the admission ends once the bytes went out", func() bool { return f.openCount() == 0 })
	id, err = a.Post(Read, b.Name(), []Desc{{Local: base, Remote: bd, Len: 4096}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Failed || err == nil {
		t.Fatalf("GPU READ by an older reader: %v, %v; want Failed", st, err)
	}
}

// newHeapAgent is an agent named after the test and name, with size
// bytes of Go memory at base, registered.
func newHeapAgent(t testing.TB, name string, size int, cfg Config) (*Agent, []byte) {
	t.Helper()
	cfg.Name = fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64())
	ag, err := New(cfg)
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

// newMemAgent is an agent (not taking direct copies) with size bytes of
// file-backed memory at base, registered: one of localPair's.
func newMemAgent(t testing.TB, name string, size int, cfg Config) (*Agent, []byte) {
	t.Helper()
	cfg.Name = fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64())
	cfg.DisableLocal = true
	ag, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ag.Close() })
	mem, fl := memFile(t, size)
	if err := ag.MapFile(base, mem, fl, 0); err != nil {
		t.Fatal(err)
	}
	if err := ag.Register([]Region{{base, uint64(size)}}); err != nil {
		t.Fatal(err)
	}
	return ag, mem
}
