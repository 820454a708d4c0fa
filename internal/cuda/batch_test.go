package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"math/rand/v2"
	"testing"
	"time"
)

func TestBatchStaging(t *testing.T) {
	const tile = 1 << tileShift
	b := &Batch{s: &slot{descs: make([]uint64, 8*descWords)}}
	for _, p := range []Piece{{1, 2, tile}, {3, 4, 0}, {5, 6, tile + 1}, {7, 8, 1}} {
		if !b.Add(p.Dst, p.Src, p.Len) {
			t.Fatalf("Add %v: no room", p)
		}
	}
	if b.n != 3 || b.tiles != 4 {
		t.Fatalf("staged %d pieces, %d tiles; want 3 and 4 (a piece of no bytes left out)", b.n, b.tiles)
	}
	want := []uint64{1, 2, tile, 5, 6, tile + 1 | 1<<32, 7, 8, 1 | 3<<32}
	if got := b.s.descs[:b.n*descWords]; fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("descriptors %v, want %v", got, want)
	}
	// A piece over 2 GiB takes several descriptors, cut at 2 GiB.
	if !b.Add(1<<40, 2<<40, 2*maxPiece+5) || b.n != 6 {
		t.Fatalf("a piece of 4 GiB + 5: %d descriptors in all, want 6", b.n)
	}
	if got := b.s.descs[4*descWords : 6*descWords]; got[0] != 1<<40+maxPiece || got[3] != 1<<40+2*maxPiece || got[5]&0xffffffff != 5 {
		t.Fatalf("the cut pieces: %v", got)
	}
	added := 0
	for range 3 {
		if b.Add(1, 2, 3) {
			added++
		}
	}
	if added != 2 {
		t.Fatalf("a batch with room for 2 more pieces took %d", added)
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
			n = 1<<tileShift + uint64(r.IntN(3)) - 1
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
	src, err := d.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(src)
	dst, err := d.Alloc(size)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Free(dst)
	r := rand.New(rand.NewPCG(1, 2))
	cases := []struct {
		name   string
		pieces int
		maxLen uint64
		each   bool
	}{
		{"small", 4000, 300, false},
		{"tiles", 600, 3 << tileShift, false},
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

// BenchmarkPost measures the CPU cost of posting a staged batch (the
// copy of its descriptors to the GPU, the launch, the event), and
// BenchmarkStage that of staging its pieces; the GPU's time is excluded.
func BenchmarkPost(b *testing.B) { benchBatch(b, false) }

func BenchmarkStage(b *testing.B) { benchBatch(b, true) }

func benchBatch(b *testing.B, stage bool) {
	d := openGPU(b)
	const piece = 64 << 10
	for _, n := range []int{256, 8192} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
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
			ps := make([]Piece, n)
			for i := range ps {
				ps[i] = Piece{dst + uint64((i*7919)%n)*piece, src + uint64(i)*piece, piece}
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
				for _, p := range ps {
					bt.Add(p.Dst, p.Src, p.Len)
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
