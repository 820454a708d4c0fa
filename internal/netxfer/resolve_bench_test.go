package netxfer

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// resolveAgent maps one chunk of regions × 1 MiB and registers it as that
// many regions (an 80-layer model's K and V: 160), and returns ranges of
// piece bytes covering all of it: in address order, or shuffled.
func resolveAgent(tb testing.TB, regions int, piece uint64, shuffled bool) (*Agent, []Region) {
	a, err := New(Config{Name: "r", DisableLocal: true})
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = a.Close() })
	const base, size = 1 << 40, 1 << 20
	if err := a.Map(base, make([]byte, regions*size)); err != nil {
		tb.Fatal(err)
	}
	var regs []Region
	for i := range regions {
		regs = append(regs, Region{Addr: base + uint64(i)*size, Len: size})
	}
	// Registered out of order, as a layout's K and V regions may be.
	rand.New(rand.NewPCG(1, 2)).Shuffle(len(regs), func(i, j int) { regs[i], regs[j] = regs[j], regs[i] })
	if err := a.Register(regs); err != nil {
		tb.Fatal(err)
	}
	var ranges []Region
	for off := uint64(0); off < uint64(regions)*size; off += piece {
		ranges = append(ranges, Region{Addr: base + off, Len: piece})
	}
	if shuffled {
		rand.New(rand.NewPCG(3, 4)).Shuffle(len(ranges), func(i, j int) { ranges[i], ranges[j] = ranges[j], ranges[i] })
	}
	return a, ranges
}

// BenchmarkResolve: bounds-checking a transfer's ranges against the
// registered regions (every range of every WRITE or READ, on both sides),
// 160 regions of 1 MiB, in 4 KiB or 512 B pieces, in order or shuffled;
// ns per range.
func BenchmarkResolve(b *testing.B) {
	for _, piece := range []uint64{4 << 10, 512} {
		for _, shuffled := range []bool{false, true} {
			order := "sorted"
			if shuffled {
				order = "shuffled"
			}
			b.Run(fmt.Sprintf("%dB/%s", piece, order), func(b *testing.B) {
				a, ranges := resolveAgent(b, 160, piece, shuffled)
				dst := make([][]byte, 0, len(ranges))
				b.ResetTimer()
				for b.Loop() {
					var err error
					if dst, err = a.resolve(dst[:0], ranges); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N)/float64(len(ranges)), "ns/range")
			})
		}
	}
}

// resolve finds each range's region however the regions were registered
// (out of order, overlapping, nested), refuses a range that crosses out of
// every region, and returns the right bytes.
func TestResolveRegions(t *testing.T) {
	a, err := New(Config{Name: "r", DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	const base = 1 << 40
	mem := make([]byte, 1<<16)
	for i := range mem {
		mem[i] = byte(i * 7)
	}
	if err := a.Map(base, mem); err != nil {
		t.Fatal(err)
	}
	// [0,16K) [32K,48K) and, overlapping both, [8K,40K); nested [1K,2K).
	regs := []Region{{Addr: base + 32<<10, Len: 16 << 10}, {Addr: base + 8<<10, Len: 32 << 10}, {Addr: base, Len: 16 << 10},
		{Addr: base + 1<<10, Len: 1 << 10}}
	if err := a.Register(regs); err != nil {
		t.Fatal(err)
	}
	ok := []Region{{Addr: base + 100, Len: 50}, {Addr: base + 12<<10, Len: 8 << 10}, {Addr: base + 1<<10 + 10, Len: 20},
		{Addr: base + 39<<10, Len: 2 << 10}, {Addr: base + 47<<10, Len: 1 << 10}, {Addr: base, Len: 16 << 10}}
	got, err := a.resolve(nil, ok)
	if err != nil {
		t.Fatal(err)
	}
	for i, r := range ok {
		o := r.Addr - base
		if string(got[i]) != string(mem[o:o+r.Len]) || cap(got[i]) != int(r.Len) {
			t.Errorf("range %d: wrong bytes", i)
		}
	}
	for _, bad := range []Region{{Addr: base + 47<<10, Len: 2 << 10}, {Addr: base + 60<<10, Len: 1}, {Addr: base - 1, Len: 2}} {
		if _, err := a.resolve(nil, []Region{{Addr: base, Len: 1}, bad}); err == nil {
			t.Errorf("range %+v outside every region resolved", bad)
		}
	}
	if err := a.Deregister(regs[1:2]); err != nil {
		t.Fatal(err)
	}
	if _, err := a.resolve(nil, []Region{{Addr: base + 20<<10, Len: 1}}); err == nil {
		t.Error("a range of a deregistered region resolved")
	}
}
