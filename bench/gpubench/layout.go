package main

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"

	"github.com/kvxfer/kvxfer/internal/netxfer"
)

// xcase is one shape: layers x blocks pieces of piece bytes, each a
// layer-block, from scattered source blocks into scattered destination
// blocks. Both sides hold a pool of 2*blocks blocks per layer; block b of
// layer l lies at (l*pool + b)*piece in a side's region, and a request's
// block ids are the same in every layer (as vLLM's are).
type xcase struct {
	Piece, Blocks, Layers int
}

func (c xcase) String() string {
	return fmt.Sprintf("%s x %d blocks x %d layers", sizeName(c.Piece), c.Blocks, c.Layers)
}

func (c xcase) pool() int    { return 2 * c.Blocks }
func (c xcase) pieces() int  { return c.Layers * c.Blocks }
func (c xcase) total() int   { return c.pieces() * c.Piece }
func (c xcase) span() int    { return c.Layers * c.pool() * c.Piece }
func (c xcase) seed() uint64 { return uint64(c.Piece)<<32 | uint64(c.Blocks)<<8 | uint64(c.Layers) }

// ids returns the source and destination block ids: the first Blocks of
// two random permutations of the pool, fixed by the case.
func (c xcase) ids() (src, dst []int) {
	r := rand.New(rand.NewPCG(c.seed(), 0x6770_7562))
	return r.Perm(c.pool())[:c.Blocks], r.Perm(c.pool())[:c.Blocks]
}

// piecePair is one piece: its offsets in the source and destination
// regions.
type piecePair struct{ src, dst uint64 }

// pairs lists every piece of the case, layer by layer.
func (c xcase) pairs() []piecePair {
	src, dst := c.ids()
	out := make([]piecePair, 0, c.pieces())
	for l := range c.Layers {
		for i := range c.Blocks {
			out = append(out, piecePair{
				src: uint64((l*c.pool() + src[i]) * c.Piece),
				dst: uint64((l*c.pool() + dst[i]) * c.Piece),
			})
		}
	}
	return out
}

// layout is the case as a layout at source and destination bases src and
// dst: a base pair per layer, an entry per block (the same in every layer).
func (c xcase) layout(src, dst uint64) netxfer.Layout {
	s, d := c.ids()
	var l netxfer.Layout
	for i := range c.Layers {
		off := uint64(i * c.pool() * c.Piece)
		l.Bases = append(l.Bases, netxfer.BasePair{Local: src + off, Remote: dst + off})
	}
	for i := range c.Blocks {
		l.Entries = append(l.Entries, netxfer.LayoutEntry{Local: uint64(s[i] * c.Piece), Remote: uint64(d[i] * c.Piece), Len: uint64(c.Piece)})
	}
	return l
}

// pattern fills b with the source pattern of a case, b being the source
// region's bytes from offset off (a multiple of 8): every 8-byte word is a
// hash of the seed and its offset, so a piece that lands in the wrong
// place, or a stale one of another case, is caught.
func pattern(b []byte, seed, off uint64) {
	for i := 0; i+8 <= len(b); i += 8 {
		binary.LittleEndian.PutUint64(b[i:], mix(seed^(off+uint64(i))))
	}
}

// mix is splitmix64's finaliser.
func mix(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// marker is what a destination region holds before a case's transfers.
const marker = 0xee

// verify checks every byte of every destination piece of c in dst (the
// destination region's first c.span() bytes).
func verify(c xcase, dst []byte) error {
	want := make([]byte, c.Piece)
	for i, p := range c.pairs() {
		pattern(want, c.seed(), p.src)
		got := dst[p.dst : p.dst+uint64(c.Piece)]
		if string(got) != string(want) {
			j := 0
			for got[j] == want[j] {
				j++
			}
			return fmt.Errorf("%s: piece %d (source offset %d, destination offset %d) differs from byte %d: got %#x, want %#x",
				c, i, p.src, p.dst, j, got[j], want[j])
		}
	}
	return nil
}

// sizeName prints a byte count as KiB or MiB where it divides.
func sizeName(n int) string {
	switch {
	case n >= 1<<20 && n%(1<<20) == 0:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10 && n%(1<<10) == 0:
		return fmt.Sprintf("%d KiB", n>>10)
	}
	return fmt.Sprintf("%d B", n)
}
