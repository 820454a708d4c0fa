package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

// expand is what the kernel copies for a staged slot: for each section,
// each region, each entry, (region + entry offsets, length), in launch
// order. It is the kernel's addressing written in Go.
func expand(s *slot) []Piece {
	var ps []Piece
	for _, sec := range s.secs {
		for r := range uint64(sec.nreg) {
			g := s.words[uint64(sec.reg)+r*regionWords:]
			for e := range uint64(sec.nent) {
				x := s.words[uint64(sec.ent)+e*entryWords:]
				if x[2] == 0 || x[2] > MaxEntry {
					panic(fmt.Sprintf("entry of %d bytes", x[2]))
				}
				ps = append(ps, Piece{g[0] + x[0], g[1] + x[1], x[2]})
			}
		}
	}
	return ps
}

// merge joins pieces contiguous on both sides (what cutting at MaxEntry
// split), so that two stagings of the same bytes compare equal.
func merge(ps []Piece) []Piece {
	var out []Piece
	for _, p := range ps {
		if p.Len == 0 {
			continue
		}
		if n := len(out); n > 0 && out[n-1].Dst+out[n-1].Len == p.Dst && out[n-1].Src+out[n-1].Len == p.Src {
			out[n-1].Len += p.Len
			continue
		}
		out = append(out, p)
	}
	return out
}

func TestBatchStaging(t *testing.T) {
	b := &Batch{s: &slot{words: make([]uint64, 64)}}
	for _, p := range []Piece{{1, 2, MaxEntry}, {3, 4, 0}, {5, 6, MaxEntry + 1}, {7, 8, 1}} {
		if !b.Add(p.Dst, p.Src, p.Len) {
			t.Fatalf("Add %v: no room", p)
		}
	}
	// One section of one region at 0: four entries (the piece of no
	// bytes left out, the one over MaxEntry cut in two).
	want := []uint64{0, 0, 1, 2, MaxEntry, 5, 6, MaxEntry, 5 + MaxEntry, 6 + MaxEntry, 1, 7, 8, 1}
	if got := b.s.words[:b.w]; fmt.Sprint(got) != fmt.Sprint(want) || len(b.s.secs) != 1 || b.s.secs[0] != (section{0, 1, 2, 4}) {
		t.Fatalf("staged %v in %v; want %v in one section of 4 entries", got, b.s.secs, want)
	}
	// A layout: its own section, regions then entries.
	if !b.AddLayout([]Region{{100, 200}, {300, 400}}, []Entry{{10, 20, 30}, {0, 0, 0}, {40, 50, 60}}) {
		t.Fatal("AddLayout: no room")
	}
	if got := b.s.secs[1]; got != (section{14, 2, 18, 2}) {
		t.Fatalf("the layout's section %v, want regions at 14 and 2 entries at 18", got)
	}
	want2 := []Piece{{1, 2, MaxEntry}, {5, 6, MaxEntry}, {5 + MaxEntry, 6 + MaxEntry, 1}, {7, 8, 1},
		{110, 220, 30}, {140, 250, 60}, {310, 420, 30}, {340, 450, 60}}
	if got := expand(b.s); fmt.Sprint(got) != fmt.Sprint(want2) {
		t.Fatalf("the kernel would copy %v, want %v", got, want2)
	}
	// Add after a layout opens a section of its own.
	if !b.Add(9, 9, 9) || len(b.s.secs) != 3 || b.s.secs[2].nreg != 1 {
		t.Fatalf("Add after AddLayout: sections %v", b.s.secs)
	}
	// No room (and no device to grow on): false, nothing staged.
	w, secs := b.w, len(b.s.secs)
	if b.Add(1, 2, 20*MaxEntry) || b.AddLayout([]Region{{1, 2}}, []Entry{{0, 0, 20 * MaxEntry}}) {
		t.Fatal("a batch without room took more")
	}
	if b.w != w || len(b.s.secs) != secs {
		t.Fatalf("a refused Add staged something: %d words, %d sections; had %d, %d", b.w, len(b.s.secs), w, secs)
	}
}

// Random batches of Add and AddLayout: the kernel (expand) copies exactly
// the pieces asked for, in order, whatever the cutting at MaxEntry.
func TestBatchStagingRandom(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 200 {
		b := &Batch{s: &slot{words: make([]uint64, 1<<16)}}
		var want []Piece
		for range r.IntN(6) + 1 {
			if r.IntN(2) == 0 {
				for range r.IntN(20) {
					p := Piece{r.Uint64N(1 << 40), r.Uint64N(1 << 40), r.Uint64N(4 * MaxEntry)}
					if !b.Add(p.Dst, p.Src, p.Len) {
						t.Fatal("Add: no room")
					}
					want = append(want, p)
				}
				continue
			}
			regs := make([]Region, r.IntN(5))
			for i := range regs {
				regs[i] = Region{r.Uint64N(1 << 40), r.Uint64N(1 << 40)}
			}
			ents := make([]Entry, r.IntN(20))
			for i := range ents {
				ents[i] = Entry{r.Uint64N(1 << 30), r.Uint64N(1 << 30), r.Uint64N(3 * MaxEntry)}
			}
			if !b.AddLayout(regs, ents) {
				t.Fatal("AddLayout: no room")
			}
			for _, g := range regs {
				for _, e := range ents {
					want = append(want, Piece{g.Dst + e.Dst, g.Src + e.Src, e.Len})
				}
			}
		}
		if got := merge(expand(b.s)); fmt.Sprint(got) != fmt.Sprint(merge(want)) {
			t.Fatalf("the kernel would copy\n%v\nwant\n%v", got, merge(want))
		}
	}
}

func openGPU(t testing.TB) *Device {
	t.Helper()
	d, err := Open(0)
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Close() })
	return d
}

// kernelCase is a batch of pieces between two buffers of one size, and
// what the destination holds after it (every byte, so a write outside
// the pieces shows).
func kernelCase(r *rand.Rand, size uint64, pieces int, maxLen uint64) (ps []Piece, src, want []byte) {
	src = make([]byte, size)
	for i := range src {
		src[i] = byte(r.Uint32())
	}
	want = bytes.Repeat([]byte{0xee}, int(size))
	// Destinations do not overlap: each piece takes the next slice of
	// the destination, at a random gap and alignment.
	var at uint64
	for range pieces {
		n := r.Uint64N(maxLen + 1)
		switch r.IntN(6) { // lengths at the edges
		case 0:
			n = uint64(r.IntN(33))
		case 1:
			n = MaxEntry + uint64(r.IntN(3)) - 1
		}
		at += uint64(r.IntN(40))
		if at+n > size {
			break
		}
		s := r.Uint64N(size - n + 1)
		ps = append(ps, Piece{Dst: at, Src: s, Len: n})
		copy(want[at:at+n], src[s:s+n])
		at += n
	}
	return ps, src, want
}

// TestCopyKernel runs the copy kernel over pieces of every alignment and
// many lengths (none, a few bytes, a tile ± 1, several tiles), scattered,
// and checks every byte of the destination: the pieces hold the source's
// bytes and nothing else changed. The fallback (one copy per piece) is
// checked the same way.
func TestCopyKernel(t *testing.T) {
	d := openGPU(t)
	const size = 24 << 20
	src, dst := allocPair(t, d, size)
	r := rand.New(rand.NewPCG(1, 2))
	cases := []struct {
		name   string
		pieces int
		maxLen uint64
		each   bool
	}{
		{"small", 4000, 300, false},
		{"entries", 600, 3 * MaxEntry, false},
		{"large", 6, 3 << 20, false},
		{"4KiB-8192", 8192, 4096, false},
		{"fallback", 500, 40000, true},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			ps, hs, want := kernelCase(r, size, c.pieces, c.maxLen)
			if c.name == "4KiB-8192" { // aligned 4 KiB pieces, as KV blocks are
				ps = ps[:0]
				want = bytes.Repeat([]byte{0xee}, size)
				for i := range 4096 {
					s, o := uint64(r.IntN(size/4096))*4096, uint64(i)*4096
					ps = append(ps, Piece{o, s, 4096})
					copy(want[o:o+4096], hs[s:s+4096])
				}
			}
			if err := d.CopyIn(src, hs); err != nil {
				t.Fatal(err)
			}
			if err := d.CopyIn(dst, bytes.Repeat([]byte{0xee}, size)); err != nil {
				t.Fatal(err)
			}
			for i := range ps {
				ps[i].Dst += dst
				ps[i].Src += src
			}
			var cp *Copy
			var err error
			if c.each {
				saved := d.copier.fn
				d.copier.fn = nil
				before := CopyFallbacks()
				cp, err = d.Post(ps)
				d.copier.fn = saved
				if CopyFallbacks() != before+1 {
					t.Errorf("fallbacks %d, want %d", CopyFallbacks(), before+1)
				}
			} else {
				cp, err = d.Post(ps)
			}
			if err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(30 * time.Second)
			for {
				done, err := cp.Done()
				if err != nil {
					t.Fatal(err)
				}
				if done {
					break
				}
				if time.Now().After(deadline) {
					t.Fatal("the copy did not end in 30 s")
				}
				time.Sleep(10 * time.Microsecond)
			}
			got := make([]byte, size)
			if err := d.CopyOut(got, dst); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, want) {
				for i := range got {
					if got[i] != want[i] {
						t.Fatalf("%d pieces: byte %d is %#x, want %#x", len(ps), i, got[i], want[i])
					}
				}
			}
			t.Logf("%d pieces checked byte for byte over %d MiB", len(ps), size>>20)
		})
	}
	if kernelLoads.Load() == 0 {
		t.Fatal("the copy kernel never loaded: every batch fell back")
	}
}

// TestCopyKernelLayout runs layouts through the kernel: layers (regions)
// of scattered blocks (entries), blocks of 4 KiB, 64 KiB and of odd
// sizes at odd offsets, with Add's pieces in the same batch, and checks
// every byte of the destination.
func TestCopyKernelLayout(t *testing.T) {
	d := openGPU(t)
	const layers, layer = 8, 3 << 20
	const size = layers * layer
	src, dst := allocPair(t, d, size)
	r := rand.New(rand.NewPCG(5, 6))
	hs := make([]byte, size)
	for i := range hs {
		hs[i] = byte(r.Uint32())
	}
	for _, c := range []struct {
		name  string
		block uint64
		odd   bool
	}{{"4KiB", 4 << 10, false}, {"64KiB", 64 << 10, false}, {"odd", 3001, true}} {
		t.Run(c.name, func(t *testing.T) {
			if err := d.CopyIn(src, hs); err != nil {
				t.Fatal(err)
			}
			if err := d.CopyIn(dst, bytes.Repeat([]byte{0xee}, size)); err != nil {
				t.Fatal(err)
			}
			want := bytes.Repeat([]byte{0xee}, size)
			blocks := int(layer / c.block)
			ls, ds := r.Perm(blocks), r.Perm(blocks)
			var regs []Region
			for l := range uint64(layers) {
				regs = append(regs, Region{dst + l*layer, src + l*layer})
			}
			var ents []Entry
			for i := range blocks / 2 {
				e := Entry{uint64(ds[i]) * c.block, uint64(ls[i]) * c.block, c.block}
				if c.odd {
					e.Dst += uint64(r.IntN(7))
					e.Src += uint64(r.IntN(7))
					e.Len -= 7
				}
				ents = append(ents, e)
				for l := range uint64(layers) {
					copy(want[l*layer+e.Dst:l*layer+e.Dst+e.Len], hs[l*layer+e.Src:l*layer+e.Src+e.Len])
				}
			}
			b, err := d.NewBatch(len(ents))
			if err != nil {
				t.Fatal(err)
			}
			// The last layer's last unmoved block by Add, in the same batch.
			extra := uint64(ds[blocks-1])*c.block + (layers-1)*layer
			if !b.AddLayout(regs, ents) || !b.Add(dst+extra, src+extra, c.block) {
				t.Fatal("no room")
			}
			copy(want[extra:extra+c.block], hs[extra:extra+c.block])
			cp, err := b.Post()
			if err != nil {
				t.Fatal(err)
			}
			if err := cp.Wait(); err != nil {
				t.Fatal(err)
			}
			got := make([]byte, size)
			if err := d.CopyOut(got, dst); err != nil {
				t.Fatal(err)
			}
			if i := firstDiff(got, want); i >= 0 {
				t.Fatalf("byte %d is %#x, want %#x", i, got[i], want[i])
			}
			t.Logf("%d layers x %d blocks checked byte for byte", layers, len(ents))
		})
	}
}

// allocPair allocates a source and a destination of size bytes on d,
// freed when the test ends.
func allocPair(t testing.TB, d *Device, size int) (src, dst uint64) {
	t.Helper()
	for _, p := range []*uint64{&src, &dst} {
		ptr, err := d.Alloc(size)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = d.Free(ptr) })
		*p = ptr
	}
	return src, dst
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

// BenchmarkPost measures the CPU cost of posting a staged batch (the
// copy of its regions and entries to the GPU, the launch, the event), and
// BenchmarkStage that of staging it; the GPU's time is excluded. A batch
// is 32 layers x n/32 blocks of 64 KiB, staged as pieces (Add: n entries)
// or as one layout (AddLayout: 32 regions, n/32 entries).
func BenchmarkPost(b *testing.B) { benchBatch(b, false) }

func BenchmarkStage(b *testing.B) { benchBatch(b, true) }

func benchBatch(b *testing.B, stage bool) {
	d := openGPU(b)
	const piece, layers = 64 << 10, 32
	for _, form := range []string{"pieces", "layout"} {
		for _, n := range []int{256, 8192} {
			b.Run(fmt.Sprintf("%s/%d", form, n), func(b *testing.B) {
				src, err := d.Alloc(n * piece)
				if err != nil {
					b.Fatal(err)
				}
				defer d.Free(src)
				dst, err := d.Alloc(n * piece)
				if err != nil {
					b.Fatal(err)
				}
				defer d.Free(dst)
				blocks := n / layers
				var regs []Region
				for l := range layers {
					regs = append(regs, Region{dst + uint64(l*blocks*piece), src + uint64(l*blocks*piece)})
				}
				var ents []Entry
				for i := range blocks {
					ents = append(ents, Entry{uint64((i*7919)%blocks) * piece, uint64(i) * piece, piece})
				}
				var ps []Piece
				for _, r := range regs {
					for _, e := range ents {
						ps = append(ps, Piece{r.Dst + e.Dst, r.Src + e.Src, e.Len})
					}
				}
				cp, _ := d.Post(ps) // warm: the slot exists
				_ = cp.Wait()
				b.ResetTimer()
				for range b.N {
					if !stage {
						b.StopTimer()
					}
					bt, err := d.NewBatch(n)
					if err != nil {
						b.Fatal(err)
					}
					if form == "layout" {
						bt.AddLayout(regs, ents)
					} else {
						for _, p := range ps {
							bt.Add(p.Dst, p.Src, p.Len)
						}
					}
					if stage {
						b.StopTimer()
					} else {
						b.StartTimer()
					}
					cp, err := bt.Post()
					if err != nil {
						b.Fatal(err)
					}
					if !stage {
						b.StopTimer()
					}
					if err := cp.Wait(); err != nil {
						b.Fatal(err)
					}
					b.StartTimer()
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/1e3, "µs/op")
			})
		}
	}
}

// TestGatedCopy runs the gated kernel: a launch whose gate reads its
// generation copies every piece and is not shut; one whose gate reads
// another copies nothing and is shut; either way no CTA is left counted
// in. Then a gate is shut while a large launch runs: once every count
// reads 0, nothing more lands (the destination read then is what it holds
// after the launch ended), which is what a consumer ending a grant relies
// on.
func TestGatedCopy(t *testing.T) {
	d := openGPU(t)
	// The check a device runs before its first gated launch (gatesWork):
	// it must pass on a GPU, or every one-sided WRITE goes two-sided.
	if err := d.checkGates(); err != nil {
		t.Fatalf("the gated kernel's check: %v", err)
	}
	if !d.gatesWork() || GateCheckFailures() != 0 {
		t.Fatalf("gates work %v, devices that failed the check %d", d.gatesWork(), GateCheckFailures())
	}
	// Every driver kvxfer runs on says how many multiprocessors a device
	// has: the gated grid is sized from it (below it, the launches here
	// have more pieces than CTAs, so each CTA copies several).
	if sms := d.sms(); sms <= 0 || d.copier.gatedGrid != uint64(sms)*gatedCTAsPerSM {
		t.Fatalf("%d multiprocessors, a gated grid of %d CTAs", sms, d.copier.gatedGrid)
	}
	const layers, layer, block = 16, 2 << 20, 4 << 10
	const size = layers * layer
	src, dst := allocPair(t, d, size)
	gates, _ := allocPair(t, d, 2*GateSize)
	r := rand.New(rand.NewPCG(9, 10))
	hs := make([]byte, size)
	for i := range hs {
		hs[i] = byte(r.Uint32())
	}
	if err := d.CopyIn(src, hs); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyIn(gates, make([]byte, 2*GateSize)); err != nil {
		t.Fatal(err)
	}
	setGen := func(gen uint32) {
		t.Helper()
		if err := d.SideCopyIn(gates, []byte{byte(gen), byte(gen >> 8), byte(gen >> 16), byte(gen >> 24)}); err != nil {
			t.Fatal(err)
		}
	}
	inside := func() uint32 {
		t.Helper()
		var b [GateShards * 4]byte
		if err := d.SideCopyOut(b[:], gates+GateActiveOff); err != nil {
			t.Fatal(err)
		}
		var n uint32
		for i := 0; i < len(b); i += 4 {
			n += uint32(b[i]) | uint32(b[i+1])<<8 | uint32(b[i+2])<<16 | uint32(b[i+3])<<24
		}
		return n
	}
	var regs []Region
	for l := range uint64(layers) {
		regs = append(regs, Region{dst + l*layer, src + l*layer})
	}
	perm := r.Perm(layer / block)
	var ents []Entry
	for i := range layer / block {
		ents = append(ents, Entry{uint64(i) * block, uint64(perm[i]) * block, block})
	}
	post := func(want uint32) *Copy {
		t.Helper()
		b, err := d.NewBatch(len(ents))
		if err != nil {
			t.Fatal(err)
		}
		if !b.AddLayout(regs, ents) {
			t.Fatal("no room")
		}
		if !b.Gate(gates, want) {
			t.Fatal("the device cannot gate a launch")
		}
		c, err := b.Post()
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	read := func() []byte {
		t.Helper()
		got := make([]byte, size)
		if err := d.CopyOut(got, dst); err != nil {
			t.Fatal(err)
		}
		return got
	}
	reset := func() {
		t.Helper()
		if err := d.CopyIn(dst, bytes.Repeat([]byte{0xee}, size)); err != nil {
			t.Fatal(err)
		}
	}
	want := make([]byte, size)
	for l := range layers {
		for i, e := range ents {
			copy(want[l*layer+i*block:][:block], hs[l*layer+int(e.Src):][:block])
		}
	}

	reset()
	setGen(7)
	c := post(7)
	if err := c.Wait(); err != nil {
		t.Fatal(err)
	}
	if c.Shut() || inside() != 0 {
		t.Fatalf("open gate: shut %v, %d CTAs counted in", c.Shut(), inside())
	}
	if i := firstDiff(read(), want); i >= 0 {
		t.Fatalf("open gate: byte %d differs", i)
	}

	reset()
	c = post(6)
	if err := c.Wait(); err != nil {
		t.Fatal(err)
	}
	if !c.Shut() || inside() != 0 {
		t.Fatalf("shut gate: shut %v, %d CTAs counted in", c.Shut(), inside())
	}
	if !bytes.Equal(read(), bytes.Repeat([]byte{0xee}, size)) {
		t.Fatal("a launch behind a shut gate wrote")
	}

	// Shut while running, many times: after the counts read 0, the
	// destination no longer changes.
	for round := range 20 {
		reset()
		setGen(uint32(100 + round))
		c = post(uint32(100 + round))
		time.Sleep(time.Duration(r.IntN(40)) * time.Microsecond)
		setGen(0)
		deadline := time.Now().Add(10 * time.Second)
		for inside() != 0 {
			if time.Now().After(deadline) {
				t.Fatal("CTAs still counted in a shut gate after 10 s")
			}
		}
		drained := read()
		if err := c.Wait(); err != nil {
			t.Fatal(err)
		}
		if i := firstDiff(read(), drained); i >= 0 {
			t.Fatalf("round %d: byte %d landed after the gate drained (shut %v)", round, i, c.Shut())
		}
	}
	t.Logf("gated launches of %d pieces: open, shut, and shut while running (20 rounds) checked byte for byte", layers*len(ents))
}

// A piece whose length is so large that counting its entries overflows
// (the last MaxEntry-1 values of a uint64) is refused, staging nothing:
// it neither panics writing entries past its room nor is dropped as a
// piece of no entries.
func TestBatchStagingLengthOverflow(t *testing.T) {
	for _, n := range []uint64{^uint64(0), ^uint64(0) - MaxEntry + 2} {
		b := &Batch{s: &slot{words: make([]uint64, 64)}}
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("Add of %d bytes panicked: %v", n, r)
				}
			}()
			if b.Add(1, 2, n) {
				t.Errorf("Add of %d bytes: staged (%d words, sections %v)", n, b.w, b.s.secs)
			}
		}()
		if b.w != 0 || len(b.s.secs) != 0 {
			t.Errorf("a refused Add of %d bytes staged %d words, %d sections", n, b.w, len(b.s.secs))
		}
		b = &Batch{s: &slot{words: make([]uint64, 64)}}
		func() {
			defer func() {
				if r := recover(); r != nil {
					t.Fatalf("AddLayout of an entry of %d bytes panicked: %v", n, r)
				}
			}()
			if b.AddLayout([]Region{{1, 2}}, []Entry{{0, 0, 8}, {0, 0, n}}) {
				t.Errorf("AddLayout of an entry of %d bytes: staged (%d words, sections %v)", n, b.w, b.s.secs)
			}
		}()
		if b.w != 0 || len(b.s.secs) != 0 {
			t.Errorf("a refused AddLayout of an entry of %d bytes staged %d words, %d sections", n, b.w, len(b.s.secs))
		}
	}
}
