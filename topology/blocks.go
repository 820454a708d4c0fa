package topology

import (
	"fmt"
	"math"
)

// BlockSizeRatio returns how many units of min(src, dst) tokens fit in a
// source and in a destination kernel block. One kernel block size must
// divide the other; the error names both sizes.
//
// The reference supports only source (P) blocks that divide destination
// (D) blocks (SPEC §5). kvxfer places bytes exactly in both directions,
// because transfers happen in units of the smaller block.
func BlockSizeRatio(srcKernel, dstKernel int) (unitTokens, srcUnits, dstUnits int, err error) {
	if srcKernel <= 0 || dstKernel <= 0 {
		return 0, 0, 0, fmt.Errorf("%w: kernel block sizes src = %d, dst = %d, want > 0", ErrInvalidLayout, srcKernel, dstKernel)
	}
	m := min(srcKernel, dstKernel)
	if max(srcKernel, dstKernel)%m != 0 {
		return 0, 0, 0, fmt.Errorf("%w: kernel block sizes src = %d, dst = %d: one must divide the other", ErrIncompatible, srcKernel, dstKernel)
	}
	return m, srcKernel / m, dstKernel / m, nil
}

// ExpandKernel appends the kernel block ids of logical ids: each id b
// becomes b·ppl .. b·ppl+ppl-1 (SPEC §3). Mamba groups are never expanded:
// pass ppl = 1.
func ExpandKernel(dst []BlockID, ids []BlockID, ppl int) []BlockID {
	for _, b := range ids {
		for i := 0; i < ppl; i++ {
			dst = append(dst, b*BlockID(ppl)+BlockID(i))
		}
	}
	return dst
}

// MapToFine appends the positions, in the fine-grained view with r units per
// block, of blocks ids (b -> b·r .. b·r+r-1), truncated to at most limit
// entries (limit < 0: no truncation). This is the reference's
// get_mapped_blocks followed by truncation to the remote count (SPEC §5).
func MapToFine(dst []BlockID, ids []BlockID, r, limit int) []BlockID {
	n := 0
	for _, b := range ids {
		for i := 0; i < r; i++ {
			if limit >= 0 && n == limit {
				return dst
			}
			dst = append(dst, b*BlockID(r)+BlockID(i))
			n++
		}
	}
	return dst
}

// EndTrim keeps the last n ids of a producer list: the reference's
// prefix-hit trim of P's list to D's count (SPEC §6). n == 0 yields an
// empty list (the reference's [-0:] keeps everything: SPEC §14).
func EndTrim(ids []BlockID, n int) []BlockID {
	if n <= 0 {
		return ids[:0]
	}
	if n >= len(ids) {
		return ids
	}
	return ids[len(ids)-n:]
}

// WindowBlocks returns how many trailing blocks a sliding-window group
// keeps: cdiv(window, blockSize) + 1 (SPEC §6). A window or block size
// that is not positive (which Validate rejects) keeps every block: it
// returns math.MaxInt.
func WindowBlocks(window, blockSize int) int {
	if window <= 0 || blockSize <= 0 {
		return math.MaxInt
	}
	n := window / blockSize // cdiv without overflowing on huge windows
	if window%blockSize != 0 {
		n++
	}
	if n == math.MaxInt {
		return n
	}
	return n + 1
}

// ClipWindow keeps the last WindowBlocks(window, blockSize) ids and returns
// them with the number of leading ids dropped (so a caller can advance the
// list's token start by dropped·blockSize).
func ClipWindow(ids []BlockID, window, blockSize int) (kept []BlockID, dropped int) {
	n := WindowBlocks(window, blockSize)
	if len(ids) <= n {
		return ids, 0
	}
	return ids[len(ids)-n:], len(ids) - n
}

// ClipMamba applies the reference's Mamba exchange clipping (SPEC §6): drop
// the trailing min(specBlocks, len-1) ids, then unless keepAll keep only the
// last id (never empty when the input is not).
func ClipMamba(ids []BlockID, specBlocks int, keepAll bool) []BlockID {
	if len(ids) == 0 {
		return ids
	}
	drop := min(max(specBlocks, 0), len(ids)-1)
	ids = ids[:len(ids)-drop]
	if !keepAll {
		ids = ids[len(ids)-1:]
	}
	return ids
}

// Clip applies the exchange clipping for a group kind: sliding-window
// groups keep their window, Mamba groups keep their state blocks (when
// clipSSM), other kinds are unchanged. blockSize is the group's logical
// block size. It returns the kept ids and how many leading ids were dropped.
func Clip(g Group, ids []BlockID, blockSize, specBlocks int, clipSSM, mambaKeepAll bool) ([]BlockID, int) {
	switch g.Kind {
	case KindSlidingWindow:
		return ClipWindow(ids, g.Window, blockSize)
	case KindMamba:
		if !clipSSM {
			return ids, 0
		}
		kept := ClipMamba(ids, specBlocks, mambaKeepAll)
		return kept, 0
	}
	return ids, 0
}

// TailStart returns the token index of the first block of a list of n
// blocks of blockSize tokens whose last block holds the request's last
// token (tokens-1): the anchoring the reference assumes when it end-trims.
func TailStart(tokens, blockSize, n int) int {
	if tokens <= 0 || blockSize <= 0 {
		return 0
	}
	blocks := (tokens + blockSize - 1) / blockSize
	return (blocks - n) * blockSize
}

// Span is one side's block list for one group: logical block ids and the
// token index of the first id's first token. A D list after a prefix-cache
// hit of c tokens starts at c; a clipped sliding-window list starts at
// dropped·blockSize.
type Span struct {
	Start int
	IDs   []BlockID
}

// TrimSSM pairs Mamba state blocks the way the reference does (SPEC §6):
// equal counts pair positionally; otherwise the counts may differ by one:
// a longer source list keeps its tail, a longer destination list loses
// its tail. It returns the first source index, the first destination
// index and the number of pairs.
func TrimSSM(srcLen, dstLen int) (s0, d0, n int, err error) {
	switch {
	case srcLen < 0 || dstLen < 0:
		return 0, 0, 0, fmt.Errorf("%w: Mamba block counts src = %d, dst = %d, want >= 0", ErrInvalidBlocks, srcLen, dstLen)
	case srcLen == dstLen:
		return 0, 0, srcLen, nil
	case srcLen == dstLen+1:
		return 1, 0, dstLen, nil
	case dstLen == srcLen+1:
		return 0, 0, srcLen, nil
	}
	return 0, 0, 0, fmt.Errorf("%w: Mamba block counts src = %d, dst = %d differ by more than one", ErrInvalidBlocks, srcLen, dstLen)
}
