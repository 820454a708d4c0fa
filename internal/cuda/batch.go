package cuda

import (
	_ "embed"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"unsafe"
)

// The batched copy. A transfer's device-to-device pieces go to the GPU as
// one launch of kvxfer_copy (kernel/copy.cu, compiled to copy.ptx and
// JIT-compiled by the driver when first used on a device): the pieces'
// descriptors are written into a pinned staging slot, copied to the
// device on the device's stream, the kernel runs behind them and an event
// behind it. Post returns once that is queued; Copy.Done polls the event.
// Slots are reused once their event completed, so a warm device posts a
// batch without allocating. Where the kernel does not load (a driver too
// old for its PTX), each piece is an asynchronous copy on the same stream
// instead: logged once, counted (CopyFallbacks).

//go:embed copy.ptx
var copyPTX []byte

const (
	descWords = 3 // dst, src, len | first tile << 32 (kvxfer_piece)
	descBytes = 8 * descWords
	// maxPiece: a descriptor's length is 32 bits; longer pieces are cut.
	maxPiece = 1 << 31
	// tileShift: a piece is cut into tiles of 16 KiB, one CTA's work
	// (256 threads, four 16-byte loads each).
	tileShift = 14
	maxGrid   = 1 << 16 // CTAs per launch; more tiles loop
	minSlot   = 256     // pieces a slot holds at least
)

// Piece is one copy of a batch: Len bytes from Src to Dst, device
// addresses in this process (unified addressing: Src may be memory
// imported from another process, mapped on this device).
type Piece struct{ Dst, Src, Len uint64 }

var (
	fallbacks   atomic.Uint64
	warnedOnce  sync.Once
	kernelLoads atomic.Uint64
)

// CopyFallbacks returns how many batches were copied piece by piece
// because the copy kernel did not load on their device.
func CopyFallbacks() uint64 { return fallbacks.Load() }

// slot is one batch's staging: descriptors in pinned host memory, their
// copy on the device, the event recorded behind the batch.
type slot struct {
	descs []uint64
	dev   uint64
	ev    unsafe.Pointer
}

func (s *slot) cap() int { return len(s.descs) / descWords }

// copier is a device's batched copy: its stream, its kernel (nil where it
// did not load) and its free slots.
type copier struct {
	once   sync.Once
	err    error // no stream: nothing can be posted
	fn     unsafe.Pointer
	stream unsafe.Pointer
	mu     sync.Mutex
	free   []*slot
}

func (d *Device) initCopier() error {
	c := &d.copier
	c.once.Do(func() {
		fn, stream, err := d.loadKernel(copyPTX)
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
		c.fn = fn
		kernelLoads.Add(1)
	})
	return c.err
}

// take returns a free slot for n pieces, or a new one.
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
	d    *Device
	s    *slot
	done bool
	err  error
}

// Batch is a batch being staged: its pieces written straight into its
// pinned staging slot as they are added, so that posting it costs the
// same whatever its number of pieces. Used by one goroutine.
type Batch struct {
	d     *Device
	s     *slot
	n     int
	tiles uint64
}

// NewBatch returns a batch with room for n pieces (of at most 2 GiB each;
// Add cuts longer ones and takes the room they need).
func (d *Device) NewBatch(n int) (*Batch, error) {
	if err := d.initCopier(); err != nil {
		return nil, err
	}
	if n > 1<<30 {
		return nil, fmt.Errorf("cuda: a batch of %d pieces", n)
	}
	s, err := d.take(max(n, 1))
	if err != nil {
		return nil, err
	}
	return &Batch{d: d, s: s}, nil
}

// Add stages one piece: n bytes from src to dst (device addresses in
// this process). It reports false, staging nothing, when the batch has no
// room left for it.
func (b *Batch) Add(dst, src, n uint64) bool {
	const tile = 1 << tileShift
	if n == 0 {
		return true
	}
	need := int((n + maxPiece - 1) / maxPiece)
	if b.s == nil || b.n+need > b.s.cap() {
		return false
	}
	for n > 0 {
		l := min(n, maxPiece)
		e := b.s.descs[b.n*descWords : b.n*descWords+descWords : b.n*descWords+descWords]
		e[0], e[1], e[2] = dst, src, l|b.tiles<<32
		b.tiles += (l + tile - 1) / tile
		b.n++
		dst, src, n = dst+l, src+l, n-l
	}
	return true
}

// Post queues the batch as one kernel launch (or, where the kernel did
// not load, one asynchronous copy per piece) and returns at once: Done or
// Wait say when the bytes landed. Nothing is checked here: the caller
// keeps every piece within memory it may write (destination) and read
// (source) until the copy is done. The batch is spent.
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
	if b.tiles >= 1<<32 {
		d.give(s)
		return nil, fmt.Errorf("cuda: a batch of %d tiles of %d bytes, over 2^32", b.tiles, 1<<tileShift)
	}
	if b.n == 0 {
		d.give(s)
		return &Copy{done: true}, nil
	}
	c := &d.copier
	var err error
	switch {
	case c.fn != nil && !each:
		err = d.launch(c.fn, c.stream, s, b.n, b.tiles, int(min(b.tiles, maxGrid)))
	case each:
		err = d.launchEach(c.stream, s, b.n)
	default:
		fallbacks.Add(1)
		err = d.launchEach(c.stream, s, b.n)
	}
	if err != nil {
		// What was queued before the failure may still run: the slot
		// is freed only once its work ends.
		d.freeSlot(s)
		return nil, err
	}
	return &Copy{d: d, s: s}, nil
}

// Post stages pieces as one batch and posts it (see Batch).
func (d *Device) Post(pieces []Piece) (*Copy, error) { return d.post(pieces, false) }

// PostEach queues pieces as one asynchronous copy each, on the stream
// Post uses (the fallback, and what the kernel is measured against).
func (d *Device) PostEach(pieces []Piece) (*Copy, error) { return d.post(pieces, true) }

func (d *Device) post(pieces []Piece, each bool) (*Copy, error) {
	need := 0
	for _, p := range pieces {
		need += int((p.Len + maxPiece - 1) / maxPiece)
	}
	b, err := d.NewBatch(need)
	if err != nil {
		return nil, err
	}
	for _, p := range pieces {
		b.Add(p.Dst, p.Src, p.Len)
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

func (c *Copy) finish(err error) {
	c.done, c.err = true, err
	if err == nil {
		c.d.give(c.s)
	} else {
		c.d.freeSlot(c.s) // a failed context: do not reuse
	}
	c.s = nil
}
