package netxfer

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// gateGPU is a layoutGPU that makes gates and runs gated batches as the
// copy kernel does (internal/cuda's kvxfer_copy_gated), one piece per
// CTA: count in, read the generation, copy only if it is the launch's,
// count out. Every access to its memory is under the fake GPU's lock, as
// D's stores and loads of the gate are (CopyIn, CopyOut). pause, when
// set, stops the first CTA that found its gate open before it copies,
// until the channel it sends is closed.
type gateGPU struct {
	*layoutGPU
	handles map[uint64][64]byte
	pause   chan chan struct{}
	gated   atomic.Int32 // gated batches posted
	jitter  bool         // gated CTAs sleep a few µs between their check and their copy
	// failGated makes a gated batch's Post fail (a launch the driver
	// refuses), after queueing its first piece, as a launch of several
	// sections may have.
	failGated atomic.Bool
	// allocFails: the next so many Allocs fail (a GPU an engine's
	// process holds most of).
	allocFails atomic.Int32
}

func newGateGPU(g *fakeGPU) *gateGPU {
	return &gateGPU{layoutGPU: &layoutGPU{batchGPU: newBatchGPU(g, "gpu0")}, handles: map[uint64][64]byte{}}
}

func (d *gateGPU) Alloc(n int) (uint64, error) {
	if d.allocFails.Load() > 0 {
		d.allocFails.Add(-1)
		return 0, errors.New("fake: out of memory")
	}
	ptr, h, _ := d.fakeGPU.alloc(n)
	d.mu.Lock()
	d.handles[ptr] = h
	d.mu.Unlock()
	return ptr, nil
}

func (d *gateGPU) Free(uint64) error { return nil }

func (d *gateGPU) SideCopyIn(dst uint64, src []byte) error  { return d.CopyIn(dst, src) }
func (d *gateGPU) SideCopyOut(dst []byte, src uint64) error { return d.CopyOut(dst, src) }

func (d *gateGPU) Export(ptr uint64) ([64]byte, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	h, ok := d.handles[ptr]
	if !ok {
		return h, errors.New("fake: not an allocation")
	}
	return h, nil
}

func (d *gateGPU) NewBatch(n int) (DevBatch, error) {
	return &gatedBatch{layoutBatch: layoutBatch{pieceBatch: pieceBatch{room: 1 << 30, post: d.PostCopy}, layouts: &d.layouts, mu: &d.mu}, d: d}, nil
}

type gatedBatch struct {
	layoutBatch
	d    *gateGPU
	gate uint64
	want uint32
}

func (b *gatedBatch) Gate(gate uint64, want uint32) bool {
	b.gate, b.want = gate, want
	return true
}

func (b *gatedBatch) Post() (DevCopy, error) {
	if b.gate == 0 {
		return b.layoutBatch.Post()
	}
	b.d.gated.Add(1)
	if b.d.failGated.Load() {
		b.d.postGated(b.ps[:1], b.gate, b.want)
		return nil, errors.New("fake: CUDA_ERROR_INVALID_VALUE (a gated launch refused)")
	}
	return b.d.postGated(b.ps, b.gate, b.want), nil
}

type gatedCopy struct {
	fakeCopy
	shut atomic.Bool
}

func (c *gatedCopy) Shut() bool { return c.shut.Load() }

func (d *gateGPU) postGated(ps []DevPiece, gate uint64, want uint32) *gatedCopy {
	ps = append([]DevPiece(nil), ps...)
	c := &gatedCopy{}
	d.mu.Lock()
	d.posts++
	d.pieces += len(ps)
	hold := d.hold
	d.held = append(d.held, &c.fakeCopy)
	held := len(d.held) - 1
	pause := d.pause
	d.mu.Unlock()
	g := d.fakeGPU
	run := func() {
		for i, p := range ps {
			shard := gate + gateActiveOff + uint64(i%gateShards)*4
			g.mu.Lock()
			act := g.at(shard, 4)
			binary.LittleEndian.PutUint32(act, binary.LittleEndian.Uint32(act)+1)
			open := binary.LittleEndian.Uint32(g.at(gate, 4)) == want
			g.mu.Unlock()
			if !open {
				c.shut.Store(true)
			} else {
				if pause != nil {
					wait := make(chan struct{})
					pause <- wait
					<-wait
					pause = nil
				}
				if d.jitter { // a CTA between its check and its stores
					time.Sleep(time.Duration(rand.IntN(30)) * time.Microsecond)
				}
				if err := d.copyPiece(p); err != nil {
					c.err = err
				}
			}
			g.mu.Lock()
			act = g.at(shard, 4)
			binary.LittleEndian.PutUint32(act, binary.LittleEndian.Uint32(act)-1)
			g.mu.Unlock()
		}
		c.done.Store(true)
	}
	go func() {
		for hold {
			time.Sleep(time.Millisecond)
			d.mu.Lock()
			hold = d.held[held] != nil
			d.mu.Unlock()
		}
		run()
	}()
	return c
}

// gateFence is a LayoutFence that allows everything and can revoke what
// it admitted: revoke cuts every admission short (its abort) and waits
// until each has ended, as a Worker's grant table does when a grant ends,
// and refuses as late what comes after it, until regrant.
type gateFence struct {
	mu      sync.Mutex
	next    uint64
	aborts  map[uint64]func()
	ended   *sync.Cond
	deny    bool
	revoked bool
}

func (f *gateFence) regrant() {
	f.mu.Lock()
	f.revoked = false
	f.mu.Unlock()
}

func newGateFence() *gateFence {
	f := &gateFence{aborts: map[uint64]func(){}}
	f.ended = sync.NewCond(&f.mu)
	return f
}

func (f *gateFence) Check(string, Op, uint64, uint64) Verdict { return Allow }

func (f *gateFence) Admit(_ string, _ Op, _ []Region, _ []byte, abort func()) (Verdict, int, uint64) {
	return f.admit(abort)
}

func (f *gateFence) AdmitLayout(_ string, _ Op, _ []LayoutSpan, _ []byte, abort func()) (Verdict, int, int, int, uint64) {
	v, _, t := f.admit(abort)
	return v, -1, -1, -1, t
}

func (f *gateFence) admit(abort func()) (Verdict, int, uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.deny {
		return Deny, -1, 0
	}
	if f.revoked {
		return Late, -1, 0
	}
	f.next++
	f.aborts[f.next] = abort
	return Allow, -1, f.next
}

func (f *gateFence) Done(t uint64) {
	f.mu.Lock()
	defer f.mu.Unlock()
	delete(f.aborts, t)
	f.ended.Broadcast()
}

func (f *gateFence) open() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.aborts)
}

func (f *gateFence) revoke() {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.revoked = true
	for _, abort := range f.aborts {
		if abort != nil {
			abort()
		}
	}
	for len(f.aborts) > 0 {
		f.ended.Wait()
	}
}

// gateSetup is a P (a) and a D (b) on one gating fake GPU, D fenced by a
// gateFence, and a grant of D's: layers bases of D's memory, blocks of
// block bytes (entries) in each.
type gateSetup struct {
	g      *fakeGPU
	d      *gateGPU
	p, dd  *Agent
	pa, pb uint64
	f      *gateFence
	grant  LayoutSpan
}

const gateLayer = 128 << 10

func newGateSetup(t *testing.T, cfgP, cfgD Config) *gateSetup {
	t.Helper()
	g := newFakeGPU()
	d := newGateGPU(g)
	s := &gateSetup{g: g, d: d, f: newGateFence()}
	t.Cleanup(func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		if g.illegal > 0 {
			t.Errorf("%d pieces of GPU batches named memory outside every allocation", g.illegal)
		}
	})
	s.p, s.dd, s.pa, s.pb = batchPairCfgs(t, d, d, cfgP, cfgD)
	if err := s.dd.SetGuard(s.f); err != nil {
		t.Fatal(err)
	}
	for i := range 8 {
		s.grant.Bases = append(s.grant.Bases, s.pb+uint64(i*gateLayer))
	}
	for _, blk := range []int{3, 4, 9, 17, 30} {
		s.grant.Entries = append(s.grant.Entries, Region{uint64(blk * 4096), 4096})
	}
	return s
}

// layout is a WRITE of blocks (into D's granted blocks, at the grant's
// layers) from scattered blocks of P's.
func (s *gateSetup) layout(r *rand.Rand, blocks []int) Layout {
	var l Layout
	for _, b := range s.grant.Bases {
		l.Bases = append(l.Bases, BasePair{Local: s.pa + (b - s.pb), Remote: b})
	}
	src := r.Perm(gateLayer / 4096)
	for i, blk := range blocks {
		l.Entries = append(l.Entries, LayoutEntry{Local: uint64(src[i] * 4096), Remote: uint64(blk * 4096), Len: 4096})
	}
	return l
}

func (s *gateSetup) open(t *testing.T, tag string) {
	t.Helper()
	if err := s.dd.OpenGate(s.p.Name(), []LayoutSpan{s.grant}, []byte(tag)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "P holds D's gate", func() bool { _, n := s.p.GatesOpen(); return n == 1 })
}

func waitFor(t *testing.T, what string, ok func() bool) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); !ok(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting until %s", what)
		}
	}
}

// A WRITE inside an open gate goes one-sided: one gated launch by P, no
// part at D, every byte where it belongs and nothing else in D's memory
// changed, and D hears the notification. A WRITE that strays outside the
// grant, or names another request, goes the two-sided way.
func TestGateOneSided(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	if mine, _ := s.dd.GatesOpen(); mine != 1 || s.f.open() != 1 {
		t.Fatalf("D has %d gates open, its fence %d admissions; want 1 and 1", mine, s.f.open())
	}
	r := rand.New(rand.NewPCG(1, 2))
	write := func(l Layout, notif string) {
		t.Helper()
		before := s.g.view(s.pb, 1<<20)
		id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{l}, []byte(notif))
		if err != nil {
			t.Fatal(err)
		}
		if st, err := wait(t, s.p, id); st != Done {
			t.Fatalf("%v, %v", st, err)
		}
		ds := ExpandLayouts(nil, []Layout{l})
		checkGPUMoved(t, s.g, Write, ds)
		checkUntouched(t, s.g.view(s.pb, 1<<20), before, s.pb, ds)
		if n := waitNotif(t, s.dd); len(n) != 1 || string(n[0].Msg) != notif {
			t.Fatalf("D heard %v, want the one notification %q", n, notif)
		}
	}
	write(s.layout(r, []int{3, 9, 30}), "req-1")
	if s.p.OneSidedWrites() != 1 || s.dd.LayoutParts() != 0 || s.d.gated.Load() != 1 {
		t.Fatalf("one-sided %d, layout parts at D %d, gated launches %d; want 1, 0, 1", s.p.OneSidedWrites(), s.dd.LayoutParts(), s.d.gated.Load())
	}
	write(s.layout(r, []int{4, 17}), "req-1")
	if s.p.OneSidedWrites() != 2 || s.dd.LayoutParts() != 0 {
		t.Fatalf("second write: one-sided %d, layout parts %d", s.p.OneSidedWrites(), s.dd.LayoutParts())
	}
	// Block 5 was not granted: two-sided (D checks it).
	write(s.layout(r, []int{3, 5}), "req-1")
	// Another request's WRITE into the same blocks: two-sided.
	write(s.layout(r, []int{3}), "req-2")
	if s.p.OneSidedWrites() != 2 || s.dd.LayoutParts() != 2 {
		t.Fatalf("outside the gate: one-sided %d, layout parts at D %d; want 2 and 2", s.p.OneSidedWrites(), s.dd.LayoutParts())
	}
	// The grant's end shuts the gate; the next WRITE goes two-sided.
	s.f.revoke()
	if mine, _ := s.dd.GatesOpen(); mine != 0 {
		t.Fatalf("%d gates open after the grant ended", mine)
	}
	waitFor(t, "P forgets the shut gate", func() bool { _, n := s.p.GatesOpen(); return n == 0 })
	s.f.regrant() // granted again (no gate offered): the WRITE goes two-sided
	write(s.layout(r, []int{9}), "req-1")
	if s.p.OneSidedWrites() != 2 || s.dd.LayoutParts() != 3 {
		t.Fatalf("after the gate shut: one-sided %d, layout parts %d", s.p.OneSidedWrites(), s.dd.LayoutParts())
	}
}

// A gated launch the device refuses to post loses nothing: the WRITE goes
// two-sided (D's process copies it; every byte lands, D hears it once),
// and that device's later WRITEs go two-sided without trying again.
func TestGatePostFails(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	s.d.failGated.Store(true)
	r := rand.New(rand.NewPCG(9, 10))
	for i, blocks := range [][]int{{3, 9, 30}, {4, 17}} {
		before := s.g.view(s.pb, 1<<20)
		l := s.layout(r, blocks)
		id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{l}, []byte("req-1"))
		if err != nil {
			t.Fatal(err)
		}
		if st, err := wait(t, s.p, id); st != Done {
			t.Fatalf("write %d after a refused gated launch: %v, %v; want done (two-sided)", i, st, err)
		}
		ds := ExpandLayouts(nil, []Layout{l})
		checkGPUMoved(t, s.g, Write, ds)
		checkUntouched(t, s.g.view(s.pb, 1<<20), before, s.pb, ds)
		if n := waitNotif(t, s.dd); len(n) != 1 || string(n[0].Msg) != "req-1" {
			t.Fatalf("D heard %v, want the one notification", n)
		}
		if got := s.dd.LayoutParts(); got != uint64(i+1) {
			t.Fatalf("write %d: %d layout parts at D, want %d (two-sided)", i, got, i+1)
		}
	}
	if s.p.OneSidedWrites() != 0 || s.d.gated.Load() != 1 {
		t.Fatalf("one-sided writes %d, gated posts tried %d; want 0 and 1", s.p.OneSidedWrites(), s.d.gated.Load())
	}
}

// No memory for D's gate area: the grant is offered no gate (ErrNoGate:
// not a failure) and its WRITE goes two-sided, every byte landing; the
// next grant, with memory again, gets its gate and goes one-sided.
func TestGateAreaAllocFails(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.d.allocFails.Store(1)
	if err := s.dd.OpenGate(s.p.Name(), []LayoutSpan{s.grant}, []byte("req-1")); !errors.Is(err, ErrNoGate) {
		t.Fatalf("OpenGate without memory for the gates: %v, want ErrNoGate", err)
	}
	if mine, _ := s.dd.GatesOpen(); mine != 0 || s.f.open() != 0 {
		t.Fatalf("%d gates open, %d admissions standing after a gate that could not be made", mine, s.f.open())
	}
	r := rand.New(rand.NewPCG(11, 12))
	write := func(tag string) {
		t.Helper()
		l := s.layout(r, []int{3, 9})
		id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{l}, []byte(tag))
		if err != nil {
			t.Fatal(err)
		}
		if st, err := wait(t, s.p, id); st != Done {
			t.Fatalf("%v, %v", st, err)
		}
		checkGPUMoved(t, s.g, Write, ExpandLayouts(nil, []Layout{l}))
		if n := waitNotif(t, s.dd); len(n) != 1 || string(n[0].Msg) != tag {
			t.Fatalf("D heard %v", n)
		}
	}
	write("req-1")
	if s.p.OneSidedWrites() != 0 || s.dd.LayoutParts() != 1 {
		t.Fatalf("without a gate: one-sided %d, layout parts at D %d; want 0 and 1", s.p.OneSidedWrites(), s.dd.LayoutParts())
	}
	s.open(t, "req-2")
	write("req-2")
	if s.p.OneSidedWrites() != 1 {
		t.Fatalf("with memory again: one-sided %d, want 1", s.p.OneSidedWrites())
	}
}

// A grant that ends while P's launch is queued (not yet run) returns at
// once (nothing is inside the gate), and the launch, run after, copies
// nothing: P's transfer fails, saying why, D's memory is untouched and D
// hears nothing.
func TestGateShutBeforeLaunch(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	r := rand.New(rand.NewPCG(3, 4))
	before := s.g.view(s.pb, 1<<20)
	s.d.mu.Lock()
	s.d.hold = true
	s.d.mu.Unlock()
	id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{s.layout(r, []int{3, 4, 9})}, []byte("req-1"))
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "the launch is queued", func() bool { return s.d.gated.Load() == 1 })
	s.f.revoke()
	s.d.release()
	st, err := wait(t, s.p, id)
	if st != Failed || err == nil || !strings.Contains(err.Error(), "gate shut") {
		t.Fatalf("a launch behind a shut gate: %v, %v; want failed, the gate shut", st, err)
	}
	if !bytes.Equal(s.g.view(s.pb, 1<<20), before) {
		t.Fatal("a launch behind a shut gate wrote D's memory")
	}
	time.Sleep(20 * time.Millisecond)
	if n := s.dd.Drain(nil); len(n) != 0 {
		t.Fatalf("D heard %v of a WRITE that failed", n)
	}
}

// A grant's end waits for a CTA already inside the gate: the revocation
// returns only after that CTA's bytes landed, and the launch's later CTAs
// copy nothing (the transfer fails).
func TestGateShutWaitsForCTA(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	r := rand.New(rand.NewPCG(5, 6))
	s.d.pause = make(chan chan struct{})
	l := s.layout(r, []int{3, 4, 9})
	id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{l}, []byte("req-1"))
	if err != nil {
		t.Fatal(err)
	}
	inside := <-s.d.pause // the first CTA is inside, its copy not done
	var once sync.Once
	letGo := func() { once.Do(func() { close(inside) }) }
	t.Cleanup(letGo) // a failure below must not leave the launch stuck
	revoked := make(chan struct{})
	go func() {
		s.f.revoke()
		close(revoked)
	}()
	select {
	case <-revoked:
		t.Fatal("the grant ended while a CTA was inside its gate")
	case <-time.After(50 * time.Millisecond):
	}
	first := ExpandLayouts(nil, []Layout{l})[0]
	letGo()
	<-revoked
	if !bytes.Equal(s.g.view(first.Local, first.Len), s.g.view(first.Remote, first.Len)) {
		t.Fatal("the grant's end returned before the CTA inside its gate had copied")
	}
	if st, err := wait(t, s.p, id); st != Failed || !strings.Contains(err.Error(), "gate shut") {
		t.Fatalf("%v, %v; want failed, the gate shut", st, err)
	}
}

// Unmapping D's memory shuts the gates over it (their admissions end) and
// P forgets them; a peer of a build without gates is offered none.
func TestGateUnmapAndOlderPeer(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	if !s.dd.Gateable() {
		t.Fatal("an agent with GPU memory of a device that gates says it cannot gate")
	}
	if err := s.dd.Unmap(s.pb); err != nil {
		t.Fatal(err)
	}
	if mine, _ := s.dd.GatesOpen(); mine != 0 || s.f.open() != 0 {
		t.Fatalf("after Unmap: %d gates open, %d admissions", mine, s.f.open())
	}
	if err := s.dd.Map(0x5000_0000, make([]byte, 4096)); err != nil {
		t.Fatal(err)
	}
	if s.dd.Gateable() {
		t.Fatal("an agent with host memory only says it can gate")
	}
	waitFor(t, "P forgets the gate", func() bool { _, n := s.p.GatesOpen(); return n == 0 })

	old := newGateSetup(t, Config{noGates: true}, Config{})
	if err := old.dd.OpenGate(old.p.Name(), []LayoutSpan{old.grant}, []byte("req-1")); !errors.Is(err, ErrNoGate) {
		t.Fatalf("a gate offered to a build without gates: %v", err)
	}
	if old.f.open() != 0 {
		t.Fatal("a gate not made left its admission open")
	}
	off := newGateSetup(t, Config{}, Config{DisableGates: true})
	if off.dd.Gateable() {
		t.Fatal("DisableGates: the agent says it can gate")
	}
	if err := off.dd.OpenGate(off.p.Name(), []LayoutSpan{off.grant}, []byte("req-1")); !errors.Is(err, ErrNoGate) {
		t.Fatalf("DisableGates: %v", err)
	}
	denied := newGateSetup(t, Config{}, Config{})
	denied.f.deny = true
	if err := denied.dd.OpenGate(denied.p.Name(), []LayoutSpan{denied.grant}, []byte("req-1")); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("a gate its fence refused: %v", err)
	}
}

// shortGPU is a gateGPU whose imports map half what their exporter
// claims (AllocSize): a peer that says its GPU memory is larger than it is.
type shortGPU struct{ *gateGPU }

func (d shortGPU) AllocSize(ptr uint64) (uint64, error) {
	d.fakeGPU.mu.Lock()
	defer d.fakeGPU.mu.Unlock()
	for base, m := range d.fakeGPU.maps {
		if ptr >= base && ptr-base < uint64(len(m)) {
			return (uint64(len(m)) - (ptr - base)) / 2, nil
		}
	}
	return 0, errors.New("fake: not mapped")
}

// GPU memory a peer claims larger than its allocation is refused where it
// is imported, on both paths: a two-sided WRITE fails (the receiver drops
// the connection, naming the claim) and nothing lands; the sender of a
// gate's claim gets no gate held (its WRITEs go two-sided).
func TestImportLargerThanClaimed(t *testing.T) {
	g := newFakeGPU()
	d := shortGPU{newGateGPU(g)}
	p, dd, pa, pb := batchPairCfgs(t, d, d, Config{}, Config{})
	r := rand.New(rand.NewPCG(7, 8))
	ds := blockDescs(r, pa, pb, 8, 4096)
	before := g.view(pb, 1<<20)
	id, err := p.Post(Write, dd.Name(), ds, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, p, id); st != Failed {
		t.Fatalf("a WRITE from memory claimed larger than it is: %v, %v; want failed", st, err)
	}
	if !bytes.Equal(g.view(pb, 1<<20), before) {
		t.Fatal("bytes landed from memory claimed larger than it is")
	}
	var grant LayoutSpan
	grant.Bases = []uint64{pb}
	grant.Entries = []Region{{0, 4096}}
	if err := dd.OpenGate(p.Name(), []LayoutSpan{grant}, []byte("req-1")); err != nil && !errors.Is(err, ErrNoGate) {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond)
	if _, held := p.GatesOpen(); held != 0 {
		t.Fatalf("P holds %d gates over memory claimed larger than it is", held)
	}
}

// A peer's gates are bounded here (the bases and entries they hold): one
// that would pass the bound drops the connection it came on, as a
// protocol error; the gates it held there are forgotten, the peer's shut,
// and transfers go on two-sided.
func TestGateItemsBounded(t *testing.T) {
	defer func(n int) { maxGateItems = n }(maxGateItems)
	maxGateItems = 40 // a gate below is 8 bases and 12 entries, counted twice (as listed, and merged): 32
	s := newGateSetup(t, Config{}, Config{})
	grant := func(first int) LayoutSpan {
		sp := LayoutSpan{Bases: s.grant.Bases}
		for b := first; b < first+24; b += 2 { // apart: not merged
			sp.Entries = append(sp.Entries, Region{uint64(b * 4096), 4096})
		}
		return sp
	}
	if err := s.dd.OpenGate(s.p.Name(), []LayoutSpan{grant(0)}, []byte("req-1")); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "P holds the first gate", func() bool { _, n := s.p.GatesOpen(); return n == 1 })
	// ErrNoGate where P dropped the connection before D noted the gate
	// announced on it.
	if err := s.dd.OpenGate(s.p.Name(), []LayoutSpan{grant(0)}, []byte("req-2")); err != nil && !errors.Is(err, ErrNoGate) {
		t.Fatal(err)
	}
	waitFor(t, "P drops the connection and forgets its gates", func() bool { _, n := s.p.GatesOpen(); return n == 0 })
	waitFor(t, "D's gates shut with the connection", func() bool { mine, _ := s.dd.GatesOpen(); return mine == 0 && s.f.open() == 0 })
	r := rand.New(rand.NewPCG(9, 9))
	l := s.layout(r, []int{3, 4})
	id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{l}, []byte("req-1"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, s.p, id); st != Done {
		t.Fatalf("a WRITE after the connection dropped: %v, %v", st, err)
	}
	checkGPUMoved(t, s.g, Write, ExpandLayouts(nil, []Layout{l}))
	if s.p.OneSidedWrites() != 0 {
		t.Fatal("a WRITE went through a gate dropped with its connection")
	}
}

// A producer that died with CTAs counted in a gate cannot count them out:
// the grant's end stops waiting once its process is gone (its launches
// went with its GPU context), and clears the counts for the slot's next
// gate.
func TestGateDeadProducer(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Skipf("no process to outlive: %v", err)
	}
	st := &s.dd.gates
	st.mu.Lock()
	var g *gate
	for x := range st.open {
		g = x
	}
	g.pid = cmd.Process.Pid // gone (and reaped)
	_ = g.proc.Release()
	var err error
	if g.proc, err = os.FindProcess(g.pid); err != nil {
		t.Fatal(err)
	}
	at := g.area.ptr + uint64(g.slot)*GateSize
	st.mu.Unlock()
	revokeDeadCTA(t, s, at, "")
}

// revokeDeadCTA leaves a CTA of the gate at at counted (its process is
// dead), ends the grant, and checks the end returned within 10 s and
// cleared the dead producer's counts (why: what the failure adds).
func revokeDeadCTA(t *testing.T, s *gateSetup, at uint64, why string) {
	t.Helper()
	stuck := make([]byte, 4)
	binary.LittleEndian.PutUint32(stuck, 1)
	if err := s.d.CopyIn(at+gateActiveOff+8, stuck); err != nil { // a CTA of the dead process
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() {
		s.f.revoke()
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("the grant's end waited on a dead producer's CTA" + why)
	}
	cnt := make([]byte, gateShards*4)
	if err := s.d.CopyOut(cnt, at+gateActiveOff); err != nil {
		t.Fatal(err)
	}
	if !allZero(cnt) {
		t.Fatalf("the dead producer's counts were left in the gate: %x", cnt)
	}
}

// Grants ended at random points of one-sided WRITEs in flight (four at a
// time, their CTAs interleaved with the consumer's shut), round after
// round: once a grant's end returns, the engine reuses the blocks, and
// nothing of the WRITEs still running lands in them; each WRITE ends
// done or failed (the gate shut), none hangs.
func TestGateShutRacesWrites(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.d.jitter = true
	r := rand.New(rand.NewPCG(11, 12))
	for round := range 30 {
		tag := fmt.Sprintf("req-%d", round)
		s.f.regrant()
		s.open(t, tag)
		var ids []XferID
		for range 4 {
			id, err := s.p.PostLayout(Write, s.dd.Name(), []Layout{s.layout(r, []int{3, 4, 9, 17, 30})}, []byte(tag))
			if err != nil {
				t.Fatal(err)
			}
			ids = append(ids, id)
		}
		time.Sleep(time.Duration(r.IntN(300)) * time.Microsecond)
		s.f.revoke()
		// Reused: the engine writes its own bytes into the blocks.
		s.g.fill(s.pb, 1<<20)
		reused := s.g.view(s.pb, 1<<20)
		done := 0
		for _, id := range ids {
			st, err := wait(t, s.p, id)
			switch {
			case st == Done:
				done++
			case st == Failed && strings.Contains(fmt.Sprint(err), "gate shut"):
			case st == Failed && errors.Is(err, ErrNotGranted): // posted after the grant's end: two-sided, refused
			default:
				t.Fatalf("round %d: a WRITE ended %v, %v", round, st, err)
			}
			_ = s.p.Release(id)
		}
		if !bytes.Equal(s.g.view(s.pb, 1<<20), reused) {
			t.Fatalf("round %d: bytes landed in blocks after their grant ended (%d of 4 WRITEs done; one-sided %d, parts at D %d)", round, done, s.p.OneSidedWrites(), s.dd.LayoutParts())
		}
		waitFor(t, "P forgets the shut gate", func() bool { _, n := s.p.GatesOpen(); return n == 0 })
		_ = s.dd.Drain(nil)
	}
}

// A consumer's notification after a gate reaches the producer after the
// gate, whatever connection it could have gone on: a registration that
// follows its grant's gate never finds the producer without it (its
// WRITE would go two-sided).
func TestGateBeforeNotification(t *testing.T) {
	s := newGateSetup(t, Config{Conns: 4}, Config{Conns: 4})
	for i := range 40 {
		tag := fmt.Sprintf("req-%d", i)
		if err := s.dd.OpenGate(s.p.Name(), []LayoutSpan{s.grant}, []byte(tag)); err != nil {
			t.Fatal(err)
		}
		if err := s.dd.Notify(s.p.Name(), []byte(tag)); err != nil {
			t.Fatal(err)
		}
		if n := waitNotif(t, s.p); len(n) != 1 || string(n[0].Msg) != tag {
			t.Fatalf("P heard %v, want %q", n, tag)
		}
		s.p.gates.mu.Lock()
		held := s.p.gates.views[s.dd.Name()][tag] != nil
		s.p.gates.mu.Unlock()
		if !held {
			t.Fatalf("round %d: the notification reached P before the gate sent ahead of it", i)
		}
	}
}

// inOrder accepts a WRITE's entries only where every byte of each lies in
// the gate's entries as listed, and accepts the shapes a WRITE of the
// request's blocks in the grant's order takes: entry for entry, adjacent
// blocks coalesced into one entry, a block cut into several.
func TestInOrder(t *testing.T) {
	order := []Region{{0x1000, 0x1000}, {0x2000, 0x1000}, {0x8000, 0x1000}, {0x5000, 0x800}}
	le := func(pairs ...uint64) []LayoutEntry {
		var es []LayoutEntry
		for i := 0; i < len(pairs); i += 2 {
			es = append(es, LayoutEntry{Remote: pairs[i], Len: pairs[i+1]})
		}
		return es
	}
	for _, c := range []struct {
		name  string
		es    []LayoutEntry
		delta uint64
		want  bool
	}{
		{"entry for entry", le(0x1000, 0x1000, 0x2000, 0x1000, 0x8000, 0x1000, 0x5000, 0x800), 0, true},
		{"adjacent blocks coalesced", le(0x1000, 0x2000, 0x8000, 0x1000), 0, true},
		{"a prefix of the grant", le(0x1000, 0x1000), 0, true},
		{"blocks cut", le(0x1000, 0x400, 0x1400, 0xc00, 0x2000, 0x1000, 0x8000, 0x10, 0x8010, 0xff0, 0x5000, 0x800), 0, true},
		{"moved by delta", le(0x0, 0x1000), 0x1000, true},
		{"no bytes", le(0x1000, 0), 0, true},
		{"past the last entry's end", le(0x1000, 0x2000, 0x8000, 0x1000, 0x5000, 0x801), 0, false},
		{"coalesced over a gap", le(0x1000, 0x2000, 0x8000, 0x2000), 0, false},
		{"another order", le(0x2000, 0x1000, 0x1000, 0x1000), 0, false},
		{"a block skipped", le(0x1000, 0x1000, 0x8000, 0x1000), 0, false},
		{"a block not granted", le(0x3000, 0x1000), 0, false},
		{"the middle of a block first", le(0x1800, 0x800), 0, false},
		{"beyond the grant", le(0x1000, 0x2000, 0x8000, 0x1000, 0x5000, 0x800, 0x5800, 0x800), 0, false},
		{"delta wraps", le(0x1000, 0x1000), ^uint64(0) - 0x10, false},
		{"length wraps", le(0x1000, ^uint64(0)), 0, false},
	} {
		if got := inOrder(order, c.es, c.delta); got != c.want {
			t.Errorf("%s: inOrder = %v, want %v", c.name, got, c.want)
		}
	}
	// Never more than covers grants: random grants and WRITEs built from
	// them (in order, cut, coalesced, shifted, out of order).
	r := rand.New(rand.NewPCG(21, 22))
	accepted := 0
	for range 20000 {
		var grant []Region
		at := uint64(r.IntN(4)) * 0x100
		for range 1 + r.IntN(6) {
			if r.IntN(3) > 0 {
				at += uint64(r.IntN(3)) * 0x100 // apart, or adjacent
			}
			n := uint64(1+r.IntN(4)) * 0x80
			grant = append(grant, Region{at, n})
			at += n
		}
		var es []LayoutEntry
		for _, g := range grant {
			switch r.IntN(4) {
			case 0:
				es = append(es, LayoutEntry{Remote: g.Addr, Len: g.Len})
			case 1: // cut
				k := uint64(r.IntN(int(g.Len)))
				es = append(es, LayoutEntry{Remote: g.Addr, Len: k}, LayoutEntry{Remote: g.Addr + k, Len: g.Len - k})
			case 2: // coalesced with the previous one, when it ends here
				if n := len(es); n > 0 && es[n-1].Remote+es[n-1].Len == g.Addr {
					es[n-1].Len += g.Len
				} else {
					es = append(es, LayoutEntry{Remote: g.Addr, Len: g.Len})
				}
			default: // off by a little
				es = append(es, LayoutEntry{Remote: g.Addr + uint64(r.IntN(0x40)), Len: g.Len + uint64(r.IntN(0x40))})
			}
		}
		if r.IntN(4) == 0 {
			r.Shuffle(len(es), func(i, j int) { es[i], es[j] = es[j], es[i] })
		}
		delta := uint64(r.IntN(2)) * 0x80
		for i := range es {
			es[i].Remote -= min(delta, es[i].Remote)
		}
		if !inOrder(grant, es, delta) {
			continue
		}
		accepted++
		merged := mergeRegions(slices.Clone(grant))
		for _, e := range es {
			if e.Len > 0 && !covers(merged, delta+e.Remote, e.Len) {
				t.Fatalf("inOrder accepted [%#x, +%#x) (delta %#x), which grant %v does not cover", e.Remote, e.Len, delta, grant)
			}
		}
	}
	if accepted < 1000 {
		t.Fatalf("only %d of the random WRITEs were accepted: the check above tried too little", accepted)
	}
}
