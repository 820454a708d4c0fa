package main

import (
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"unsafe"
)

// xcase is one shape: a WRITE of total bytes in pieces of piece bytes.
// Source piece i lies at slot 2i of the source mapping and destination
// piece i at slot 2i+1 of the destination mapping (slots are piece-sized),
// so neither side's pieces touch and nothing can coalesce.
type xcase struct{ total, piece int }

func (c xcase) n() int           { return c.total / c.piece }
func (c xcase) srcOff(i int) int { return 2 * i * c.piece }
func (c xcase) dstOff(i int) int { return (2*i + 1) * c.piece }
func (c xcase) span() int        { return 2 * c.total }
func (c xcase) String() string   { return fmtSize(c.total) + "/" + fmtSize(c.piece) }
func (c xcase) src(m []byte, i int) []byte {
	return m[c.srcOff(i) : c.srcOff(i)+c.piece : c.srcOff(i)+c.piece]
}
func (c xcase) dst(m []byte, i int) []byte {
	return m[c.dstOff(i) : c.dstOff(i)+c.piece : c.dstOff(i)+c.piece]
}

// golden spreads a transfer's seed over the words of its pattern.
const golden = 0x9e3779b97f4a7c15

// word is the pattern's value at byte offset off (a multiple of 8) of
// the transfer's payload: unique per seed and per position, so a stale
// byte, a piece landed in the wrong slot or a torn piece all show.
func word(seed uint64, off int) uint64 { return seed*golden ^ uint64(off) }

// fill writes seed's pattern into c's source pieces.
func fill(src []byte, c xcase, seed uint64) {
	for i := range c.n() {
		p, off := c.src(src, i), i*c.piece
		for w := 0; w+8 <= len(p); w += 8 {
			binary.LittleEndian.PutUint64(p[w:], word(seed, off+w))
		}
	}
}

// gapMark is written into a sample of the destination's gaps before a
// transfer; finding anything else there after it means a write outside
// the pieces.
const gapMark = 0xa5

// gapSample returns the destination gaps (piece-sized slots 2i) checked
// around each transfer: the first, the last and every 61st.
func gapSample(c xcase) []int {
	var out []int
	for i := 0; i < c.n(); i += 61 {
		out = append(out, i)
	}
	if last := c.n() - 1; out[len(out)-1] != last {
		out = append(out, last)
	}
	return out
}

// markGaps writes gapMark into c's sampled destination gaps.
func markGaps(dst []byte, c xcase) {
	for _, i := range gapSample(c) {
		g := dst[2*i*c.piece : (2*i+1)*c.piece]
		for k := range g {
			g[k] = gapMark
		}
	}
}

// verify checks every byte of c's destination pieces against seed's
// pattern, and the sampled gaps against gapMark.
func verify(dst []byte, c xcase, seed uint64) error {
	for i := range c.n() {
		p, off := c.dst(dst, i), i*c.piece
		for w := 0; w+8 <= len(p); w += 8 {
			if got, want := binary.LittleEndian.Uint64(p[w:]), word(seed, off+w); got != want {
				return fmt.Errorf("destination piece %d of %d, byte %d: %#016x, want %#016x", i, c.n(), w, got, want)
			}
		}
	}
	for _, i := range gapSample(c) {
		g := dst[2*i*c.piece : (2*i+1)*c.piece]
		for k, b := range g {
			if b != gapMark {
				return fmt.Errorf("destination gap before piece %d, byte %d: %#x, want %#x untouched", i, k, b, gapMark)
			}
		}
	}
	return nil
}

// addr is the virtual address of m's first byte: the base both backends
// are given, the one NIXL needs.
func addr(m []byte) uint64 { return uint64(uintptr(unsafe.Pointer(unsafe.SliceData(m)))) }

// parseSize reads 512, 512B, 4K, 4KiB, 1M, 1MiB, 64MiB.
func parseSize(s string) (int, error) {
	t := strings.TrimSuffix(strings.TrimSpace(s), "B")
	t = strings.TrimSuffix(t, "i")
	mul := 1
	switch {
	case strings.HasSuffix(t, "K"):
		mul, t = 1<<10, strings.TrimSuffix(t, "K")
	case strings.HasSuffix(t, "M"):
		mul, t = 1<<20, strings.TrimSuffix(t, "M")
	case strings.HasSuffix(t, "G"):
		mul, t = 1<<30, strings.TrimSuffix(t, "G")
	}
	v, err := strconv.Atoi(t)
	if err != nil || v <= 0 || v > (1<<40)/mul {
		return 0, fmt.Errorf("size %q: want a positive count of bytes such as 512, 4KiB or 64MiB", s)
	}
	return v * mul, nil
}

// parseSizes reads a comma-separated list of sizes.
func parseSizes(flagName, list string) ([]int, error) {
	var out []int
	for _, s := range strings.Split(list, ",") {
		if strings.TrimSpace(s) == "" {
			continue
		}
		v, err := parseSize(s)
		if err != nil {
			return nil, fmt.Errorf("-%s: %w", flagName, err)
		}
		out = append(out, v)
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("-%s %q: no sizes", flagName, list)
	}
	return out, nil
}

func fmtSize(n int) string {
	switch {
	case n >= 1<<30 && n%(1<<30) == 0:
		return strconv.Itoa(n>>30) + " GiB"
	case n >= 1<<20 && n%(1<<20) == 0:
		return strconv.Itoa(n>>20) + " MiB"
	case n >= 1<<10 && n%(1<<10) == 0:
		return strconv.Itoa(n>>10) + " KiB"
	}
	return strconv.Itoa(n) + " B"
}
