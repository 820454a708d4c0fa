package cuda

import (
	_ "embed"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The batched copy. A transfer's device-to-device pieces go to the GPU as
// one launch of kvxfer_copy (kernel/copy.cu, compiled to copy.ptx and
// JIT-compiled by the driver when first used on a device). What is staged
// is regions and entries (kernel/copy.cu): piece (r, e) of a section
// copies entry e of region r, so a KV transfer of L layers of n blocks
// stages L + n descriptors, not L·n (AddLayout); a plain list of pieces
// (Add) is a section of one region at bases 0. They are written into a
// pinned staging slot, copied to the device on the device's stream, one
// launch per section runs behind them and an event behind the last. Post
// returns once that is queued; Copy.Done polls the event. Slots are
// reused once their event completed, so a warm device posts a batch
// without allocating. Where the kernel does not load (a driver too old
// for its PTX), each piece is an asynchronous copy on the same stream
// instead: logged once, counted (CopyFallbacks).

//go:embed copy.ptx
var copyPTX []byte

const (
	regionWords = 2 // dst, src (kvxfer_region)
	entryWords  = 3 // dst, src, len (kvxfer_entry)
	// MaxEntry is the most bytes one entry copies (one CTA's piece:
	// 256 threads, sixteen 16-byte loads each); longer pieces are cut.
	MaxEntry = 64 << 10
	maxGrid  = 1 << 16 // CTAs per launch; more pieces loop
	// gatedCTAsPerSM is how many CTAs of a gated launch there are per
	// multiprocessor at most (gatedGrid): as many as one can hold (2,048
	// threads, 256 each), so that each CTA pays its gate's atomics and
	// fences once for the several pieces it copies instead of once per
	// piece; with no more CTAs than run at once, fewer do not copy faster.
	gatedCTAsPerSM = 8
	// gatedGridUnknown is the gated grid where the driver does not say
	// how many multiprocessors the device has.
	gatedGridUnknown = 1024
	minSlot          = 1024 // words a slot holds at least
	// maxSections bounds the launches of one batch.
	maxSections = 1 << 12
)

// Piece is one copy of a batch: Len bytes from Src to Dst, device
// addresses in this process (unified addressing: Src may be memory
// imported from another process, mapped on this device).
type Piece struct{ Dst, Src, Len uint64 }

// Region is a base pair of a layout: the device addresses an entry's
// offsets are from.
type Region struct{ Dst, Src uint64 }

// Entry is a piece of a layout, at the same offsets from every region's
// bases: Len bytes from Src to Dst.
type Entry struct{ Dst, Src, Len uint64 }

var (
	fallbacks   atomic.Uint64
	warnedOnce  sync.Once
	kernelLoads atomic.Uint64
)

// CopyFallbacks returns how many batches were copied piece by piece
// because the copy kernel did not load on their device.
func CopyFallbacks() uint64 { return fallbacks.Load() }

// slot is one batch's staging: regions and entries in pinned host
// memory, their copy on the device, the event recorded behind the batch,
// and its sections (kept for reuse).
type slot struct {
	words []uint64
	dev   uint64
	ev    unsafe.Pointer
	secs  []section
	// shut is the pinned word a gated launch sets when its gate was shut
	// (shutDev: its address on the device).
	shut    *uint32
	shutDev uint64
}

// gateArgs are a gated launch's last arguments (gate 0: not gated).
type gateArgs struct {
	gate, shut uint64
	want       uint32
}

func (s *slot) cap() int { return len(s.words) }

// section is one launch: nreg regions from word reg of the slot, nent
// entries from word ent (the kernel's arguments; cu_post reads them).
type section struct{ reg, nreg, ent, nent uint32 }

// copier is a device's batched copy: its stream, its kernel (nil where it
// did not load) and its free slots.
type copier struct {
	once  sync.Once
	err   error // no stream: nothing can be posted
	fn    unsafe.Pointer
	gated unsafe.Pointer // kvxfer_copy_gated
	// gatedGrid is the most CTAs of a gated launch (gatedCTAsPerSM).
	gatedGrid uint64
	stream    unsafe.Pointer
	mu        sync.Mutex
	free      []*slot
	// gate is the gated kernel's check on the device (gatesWork): its
	// verdict (gateUnchecked until one), the memory it runs in, and
	// whether a check that could not run was logged.
	gate struct {
		mu     sync.Mutex
		state  atomic.Int32 // a gateState; set under mu, read without it once decided
		buf    uint64
		warned bool
	}
}

type gateState = int32

const (
	gateUnchecked gateState = iota
	gateWorks
	gateBroken
)

// gateFault is a gated launch that misbehaved in the check (as opposed to
// a check that could not run for want of memory).
type gateFault struct{ msg string }

func (e *gateFault) Error() string { return e.msg }

func faultf(format string, args ...any) error { return &gateFault{fmt.Sprintf(format, args...)} }

func (d *Device) initCopier() error {
	c := &d.copier
	c.once.Do(func() {
		fn, gated, stream, err := d.loadKernel(copyPTX)
		if stream == nil {
			c.err = err
			return
		}
		c.stream = stream
		if err != nil {
			warnedOnce.Do(func() {
				slog.Warn("cuda: the copy kernel did not load: GPU pieces are copied one by one (slower)",
					"device", d.ordinal, "err", err)
			})
			return
		}
		c.fn, c.gated = fn, gated
		c.gatedGrid = gatedGrid(d.sms())
		kernelLoads.Add(1)
	})
	return c.err
}

// gatedGrid is the most CTAs of a gated launch on a device of sms
// multiprocessors (0: unknown).
func gatedGrid(sms int) uint64 {
	if sms <= 0 {
		return gatedGridUnknown
	}
	return min(uint64(sms)*gatedCTAsPerSM, maxGrid)
}

// take returns a free slot of at least n words, or a new one.
func (d *Device) take(n int) (*slot, error) {
	c := &d.copier
	c.mu.Lock()
	best := -1
	for i, s := range c.free {
		if s.cap() >= n && (best < 0 || s.cap() < c.free[best].cap()) {
			best = i
		}
	}
	if best >= 0 {
		s := c.free[best]
		c.free[best] = c.free[len(c.free)-1]
		c.free = c.free[:len(c.free)-1]
		c.mu.Unlock()
		return s, nil
	}
	c.mu.Unlock()
	size := minSlot
	for size < n {
		size *= 2
	}
	return d.newSlot(size)
}

func (d *Device) give(s *slot) {
	c := &d.copier
	c.mu.Lock()
	c.free = append(c.free, s)
	c.mu.Unlock()
}

// Copy is a batch Post queued on its device.
type Copy struct {
	d     *Device
	s     *slot
	done  bool
	err   error
	gated bool
	shut  bool
}

// Batch is a batch being staged: its regions and entries written straight
// into its pinned staging slot as they are added, so that posting it
// costs the same whatever its number of pieces. Used by one goroutine.
type Batch struct {
	d    *Device
	s    *slot
	w    int  // words staged
	abs  bool // the last section is Add's (one region at bases 0)
	gate gateArgs
}

// GateSize is the bytes of one gate (kernel/copy.cu's kvxfer_gate): its
// generation (a uint32 at offset 0) and, from GateActiveOff, the counts
// of the CTAs inside it (GateShards uint32s, all 0 when none is).
const (
	GateSize      = 128
	GateActiveOff = 64
	GateShards    = 16
)

// Gate makes the batch a one-sided write guarded by the gate at device
// address gate (GateSize bytes of the receiving process's memory, mapped
// here): every CTA of its launches copies only if the gate's generation
// reads want when it starts, and counts itself in the gate while it
// copies (kernel/copy.cu). Copy.Shut then reports whether any CTA found
// it shut. It reports false, leaving the batch ungated, where the device
// cannot run it gated (the kernel did not load, the slot's shut word
// has no device address, or the device failed the gated kernel's check:
// gatesWork).
func (b *Batch) Gate(gate uint64, want uint32) bool {
	if b.d == nil || b.d.copier.gated == nil || b.s == nil || b.s.shutDev == 0 || !b.d.gatesWork() {
		return false
	}
	b.gate = gateArgs{gate: gate, want: want}
	return true
}

var gateCheckFails atomic.Uint64

// GateCheckFailures returns how many devices failed the gated kernel's
// check (their one-sided writes are off).
func GateCheckFailures() uint64 { return gateCheckFails.Load() }

// gatesWork reports whether the gated kernel behaves on this device. The
// first time it is asked, it checks it on memory of its own (checkGates):
// a device where it misbehaves is logged, counted, and gates nothing from
// then on, so each one-sided write goes the two-sided way instead of
// trusting a launch that might report bytes written that were not, or
// write through a shut gate. A check that could not run (no memory for
// it: an engine's process may hold most of its GPU's) says false this
// time, logged once, and runs again when next asked. A millisecond or so,
// once per device and process, in the first one-sided write's post.
func (d *Device) gatesWork() bool {
	g := &d.copier.gate
	if st := g.state.Load(); st != gateUnchecked { // every gated post but the first
		return st == gateWorks
	}
	g.mu.Lock()
	defer g.mu.Unlock()
	if st := g.state.Load(); st != gateUnchecked {
		return st == gateWorks
	}
	err := checkGates(d)
	var fault *gateFault
	switch {
	case err == nil:
		g.state.Store(gateWorks)
	case errors.As(err, &fault):
		g.state.Store(gateBroken)
		gateCheckFails.Add(1)
		slog.Error("cuda: the gated copy kernel failed its check on this device: its one-sided writes go two-sided",
			"device", d.ordinal, "err", err)
	case !g.warned:
		g.warned = true
		slog.Warn("cuda: the gated copy kernel's check could not run on this device: one-sided writes go two-sided until it can",
			"device", d.ordinal, "err", err)
	}
	return g.state.Load() == gateWorks
}

// checkGates is the check gatesWork runs (a variable for tests).
var checkGates = (*Device).checkGates

// checkGates runs two gated launches in memory of its own: through a gate
// of their generation (every byte of both pieces lands, nothing else, not
// shut) and through a gate of another (nothing lands, shut); after each,
// no CTA may be left counted in. Its words move on the side stream: in an
// engine's own process nothing here waits for the engine's kernels.
func (d *Device) checkGates() error {
	const (
		srcOff, dstOff, span = 1024, 3072, 2048
		gen                  = 0x5a7e0001
	)
	// Kept for the process's life (5 KiB, once per device, d.copier.gate
	// held): freeing device memory may wait for the whole device, in an
	// engine's own process for its queued kernels.
	buf := d.copier.gate.buf
	if buf == 0 {
		var err error
		if buf, err = d.Alloc(srcOff + 2*span); err != nil {
			return err
		}
		d.copier.gate.buf = buf
	}
	src, dst := buf+srcOff, buf+dstOff
	pat := make([]byte, span)
	for i := range pat {
		pat[i] = byte(i*7 + 1)
	}
	if err := d.SideCopyIn(src, pat); err != nil {
		return err
	}
	var g [GateSize]byte
	binary.LittleEndian.PutUint32(g[:], gen)
	if err := d.SideCopyIn(buf, g[:]); err != nil {
		return err
	}
	// Two pieces: one whose ends are both 16-byte aligned, one at odd
	// addresses (the kernel's widest and narrowest paths).
	pieces := []Piece{{Dst: dst, Src: src, Len: 1024}, {Dst: dst + 1024 + 3, Src: src + 1024 + 5, Len: 997}}
	got := make([]byte, span)
	for _, open := range []bool{true, false} {
		if err := d.SideCopyIn(dst, make([]byte, span)); err != nil {
			return err
		}
		b, err := d.NewBatch(len(pieces))
		if err != nil {
			return err
		}
		for _, p := range pieces {
			if !b.Add(p.Dst, p.Src, p.Len) {
				b.Discard()
				return fmt.Errorf("no room for the check's pieces")
			}
		}
		if b.s.shutDev == 0 {
			b.Discard()
			return faultf("no device address for the launch's shut word")
		}
		want := uint32(gen)
		if !open {
			want++
		}
		b.gate = gateArgs{gate: buf, want: want}
		cp, err := b.Post()
		if err != nil {
			return fmt.Errorf("a gated launch (gate open %v): %w", open, err)
		}
		if err := cp.Wait(); err != nil {
			return faultf("a gated launch (gate open %v): %v", open, err)
		}
		if cp.Shut() == open {
			return faultf("a gated launch through a gate open %v reported shut %v", open, cp.Shut())
		}
		if err := d.SideCopyOut(got, dst); err != nil {
			return err
		}
		exp := make([]byte, span)
		if open {
			for _, p := range pieces {
				copy(exp[p.Dst-dst:], pat[p.Src-src:p.Src-src+p.Len])
			}
		}
		for i := range got {
			if got[i] != exp[i] {
				return faultf("a gated launch through a gate open %v: byte %d of its destination reads %#x, want %#x", open, i, got[i], exp[i])
			}
		}
		if err := d.SideCopyOut(g[:], buf); err != nil {
			return err
		}
		for i := GateActiveOff; i < GateSize; i++ {
			if g[i] != 0 {
				return faultf("a gated launch through a gate open %v left CTAs counted in it", open)
			}
		}
	}
	return nil
}

// NewBatch returns a batch with room for n pieces of at most MaxEntry
// bytes (it grows for more, or longer ones).
func (d *Device) NewBatch(n int) (*Batch, error) {
	if err := d.initCopier(); err != nil {
		return nil, err
	}
	if n > 1<<30 {
		return nil, fmt.Errorf("cuda: a batch of %d pieces", n)
	}
	s, err := d.take(max(n*entryWords+regionWords, minSlot))
	if err != nil {
		return nil, err
	}
	s.secs = s.secs[:0]
	return &Batch{d: d, s: s}, nil
}

// room makes room for n more words, moving the staging to a larger slot
// if need be; false where none can be had.
func (b *Batch) room(n int) bool {
	if b.s == nil {
		return false
	}
	if b.w+n <= b.s.cap() {
		return true
	}
	if b.d == nil || b.w+n > 1<<34 {
		return false
	}
	size := b.s.cap()
	for size < b.w+n {
		size *= 2
	}
	s, err := b.d.take(size)
	if err != nil {
		return false
	}
	copy(s.words, b.s.words[:b.w])
	s.secs = append(s.secs[:0], b.s.secs...)
	b.d.give(b.s)
	b.s = s
	return true
}

// entries reports how many entries a piece of n bytes takes.
// (Not (n+MaxEntry-1)/MaxEntry: that wraps for n near 1<<64, counting
// a piece of no entries whose staging then runs past its room.)
func entries(n uint64) uint64 {
	k := n / MaxEntry
	if n%MaxEntry != 0 {
		k++
	}
	return k
}

// Add stages one piece: n bytes from src to dst (device addresses in
// this process). It reports false, staging nothing, when the batch can
// take no more.
func (b *Batch) Add(dst, src, n uint64) bool {
	if n == 0 {
		return true
	}
	k := entries(n)
	need := k * entryWords
	if !b.abs {
		need += regionWords
	}
	if k > 1<<31 || !b.room(int(need)) {
		return false
	}
	w := b.s.words
	if !b.abs {
		if len(b.s.secs) == maxSections {
			return false
		}
		w[b.w], w[b.w+1] = 0, 0
		b.s.secs = append(b.s.secs, section{reg: uint32(b.w), nreg: 1, ent: uint32(b.w + regionWords)})
		b.w += regionWords
		b.abs = true
	}
	sec := &b.s.secs[len(b.s.secs)-1]
	if uint64(sec.nent)+k > 1<<32-1 {
		return false
	}
	b.putEntry(dst, src, n)
	sec.nent += uint32(k)
	return true
}

// putEntry stages n bytes from src to dst as entries of at most MaxEntry
// (the room for entries(n) of them made already).
func (b *Batch) putEntry(dst, src, n uint64) {
	w := b.s.words
	for n > 0 {
		l := min(n, MaxEntry)
		x := w[b.w : b.w+entryWords : b.w+entryWords]
		x[0], x[1], x[2] = dst, src, l
		b.w += entryWords
		dst, src, n = dst+l, src+l, n-l
	}
}

// AddLayout stages every entry at every region's bases (as one launch):
// for each region r and entry e, e.Len bytes from r.Src+e.Src to
// r.Dst+e.Dst. It reports false, staging nothing, when the batch can take
// no more.
func (b *Batch) AddLayout(regions []Region, ents []Entry) bool {
	var k uint64
	for _, e := range ents {
		if k += entries(e.Len); k > 1<<32-1 { // and the sum cannot wrap
			return false
		}
	}
	if k == 0 || len(regions) == 0 {
		return true
	}
	if k > 1<<32-1 || uint64(len(regions)) > 1<<32-1 || b.s != nil && len(b.s.secs) == maxSections {
		return false
	}
	if !b.room(len(regions)*regionWords + int(k)*entryWords) {
		return false
	}
	w := b.s.words
	sec := section{reg: uint32(b.w), nreg: uint32(len(regions))}
	for _, r := range regions {
		w[b.w], w[b.w+1] = r.Dst, r.Src
		b.w += regionWords
	}
	sec.ent, sec.nent = uint32(b.w), uint32(k)
	for _, e := range ents {
		b.putEntry(e.Dst, e.Src, e.Len)
	}
	b.s.secs = append(b.s.secs, sec)
	b.abs = false
	return true
}

// Post queues the batch as one kernel launch per section (or, where the
// kernel did not load, one asynchronous copy per piece) and returns at
// once: Done or Wait say when the bytes landed. Nothing is checked here:
// the caller keeps every piece within memory it may write (destination)
// and read (source) until the copy is done. The batch is spent.
func (b *Batch) Post() (*Copy, error) { return b.post(false) }

// Discard gives the batch's staging back unposted.
func (b *Batch) Discard() {
	if b.s != nil {
		b.d.give(b.s)
		b.s = nil
	}
}

func (b *Batch) post(each bool) (*Copy, error) {
	d, s := b.d, b.s
	if s == nil {
		return nil, fmt.Errorf("cuda: a batch posted twice")
	}
	b.s = nil
	if len(s.secs) == 0 {
		d.give(s)
		return &Copy{done: true}, nil
	}
	c := &d.copier
	gate := b.gate
	if gate.gate != 0 {
		if c.gated == nil || each {
			d.give(s)
			return nil, fmt.Errorf("cuda: a gated copy needs the copy kernel, which did not load on device %d", d.ordinal)
		}
		*s.shut = 0
		gate.shut = s.shutDev
	}
	var err error
	switch {
	case gate.gate != 0:
		err = d.launch(c.gated, c.stream, s, b.w, c.gatedGrid, gate)
	case c.fn != nil && !each:
		err = d.launch(c.fn, c.stream, s, b.w, maxGrid, gateArgs{})
	case each:
		err = d.launchEach(c.stream, s)
	default:
		fallbacks.Add(1)
		err = d.launchEach(c.stream, s)
	}
	if err != nil {
		// What was queued before the failure (a batch of several
		// sections launches one by one) may still run: it ends before
		// the slot is freed and the error returned, so that the
		// caller, told nothing was posted, may let go of the memory
		// the batch named (a peer's import among it).
		_ = d.drain(c.stream)
		d.freeSlot(s)
		return nil, err
	}
	return &Copy{d: d, s: s, gated: gate.gate != 0}, nil
}

// Post stages pieces as one batch and posts it (see Batch).
func (d *Device) Post(pieces []Piece) (*Copy, error) { return d.post(pieces, false) }

// PostEach queues pieces as one asynchronous copy each, on the stream
// Post uses (the fallback, and what the kernel is measured against).
func (d *Device) PostEach(pieces []Piece) (*Copy, error) { return d.post(pieces, true) }

func (d *Device) post(pieces []Piece, each bool) (*Copy, error) {
	b, err := d.NewBatch(len(pieces))
	if err != nil {
		return nil, err
	}
	for i, p := range pieces {
		if !b.Add(p.Dst, p.Src, p.Len) {
			b.Discard()
			return nil, fmt.Errorf("cuda: a batch took no piece past %d of %d", i, len(pieces))
		}
	}
	return b.post(each)
}

// Done reports whether the copy ended and, once it has, its error (the
// same from then on).
func (c *Copy) Done() (bool, error) {
	if c.done {
		return true, c.err
	}
	ok, err := c.d.query(c.s)
	if !ok {
		return false, nil
	}
	c.finish(err)
	return true, c.err
}

// Wait blocks until the copy ended (the calling thread waits on the
// GPU: for tests and tools, not for goroutines that serve others).
func (c *Copy) Wait() error {
	if !c.done {
		c.finish(c.d.wait(c.s))
	}
	return c.err
}

// Shut reports, once Done reported the copy ended without error, whether
// a gated copy found its gate shut (some or all of its pieces were not
// copied).
func (c *Copy) Shut() bool { return c.shut }

func (c *Copy) finish(err error) {
	c.done, c.err = true, err
	if c.gated && c.s != nil {
		c.shut = atomic.LoadUint32(c.s.shut) != 0
	}
	if err == nil {
		c.d.give(c.s)
	} else {
		c.d.freeSlot(c.s) // a failed context: do not reuse
	}
	c.s = nil
}
