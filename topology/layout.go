package topology

import (
	"errors"
	"fmt"
)

// BlockID is the index of a block inside a region, as an engine's block
// allocator hands it out. Unlike kvxfer's opaque ids, zero is a valid block
// index here (engines number their block pool from zero); validity is a
// bounds check against the region's block count.
type BlockID int32

// Kind is the kind of a KV-cache region or cache group.
type Kind uint8

const (
	// KindFullAttention is an attention cache sharded by KV heads over TP.
	KindFullAttention Kind = iota + 1
	// KindSlidingWindow is an attention cache of a sliding-window layer:
	// sharded like full attention, clipped to the window at exchange.
	KindSlidingWindow
	// KindMLA is a replicated latent cache (MLA): every TP rank holds the
	// whole block, so any one rank is a complete source.
	KindMLA
	// KindMamba is a state-space cache: per logical block, conv-state
	// parts followed by the temporal SSM state, each sharded over TP.
	KindMamba
)

func (k Kind) String() string {
	switch k {
	case KindFullAttention:
		return "full_attention"
	case KindSlidingWindow:
		return "sliding_window"
	case KindMLA:
		return "mla"
	case KindMamba:
		return "mamba"
	}
	return fmt.Sprintf("Kind(%d)", uint8(k))
}

func (k Kind) valid() bool { return k >= KindFullAttention && k <= KindMamba }

// attention reports whether the kind is sharded by heads (full or sliding).
func (k Kind) attention() bool { return k == KindFullAttention || k == KindSlidingWindow }

// KVLayout is the order of heads and tokens inside an attention block.
type KVLayout uint8

const (
	// LayoutHND stores [heads][tokens] inside a block: one head's tokens
	// are contiguous.
	LayoutHND KVLayout = iota + 1
	// LayoutNHD stores [tokens][heads] inside a block: one token's heads
	// are contiguous.
	LayoutNHD
)

func (l KVLayout) String() string {
	switch l {
	case LayoutHND:
		return "HND"
	case LayoutNHD:
		return "NHD"
	}
	return fmt.Sprintf("KVLayout(%d)", uint8(l))
}

// KVPacking says where K and V live relative to each other.
type KVPacking uint8

const (
	// PackedKV stores, for each (head, token) cell, the K vector then the V
	// vector: a block is [H][N][2·D] (HND) or [N][H][2·D] (NHD). This is
	// the reference's current layout (SPEC §3: K and V are not split).
	PackedKV KVPacking = iota + 1
	// SplitKV stores a K plane then a V plane in every block:
	// [2][H][N][D] or [2][N][H][D].
	SplitKV
	// SeparateKV means each region holds only K or only V (engines that
	// register the K and V caches of a layer as two regions).
	SeparateKV
)

func (p KVPacking) String() string {
	switch p {
	case PackedKV:
		return "packed"
	case SplitKV:
		return "split"
	case SeparateKV:
		return "separate"
	}
	return fmt.Sprintf("KVPacking(%d)", uint8(p))
}

// Region is one registered memory region of a rank: one layer's cache (or,
// with memory pooling, one tensor shared by one layer of each group).
type Region struct {
	Kind Kind
	// Window is the sliding window in tokens (KindSlidingWindow only).
	Window int
	// Base is the region's address in the owning process's address space
	// (or device address space for device memory).
	Base uint64
	// BlockLen is the byte size of one block: one kernel block for
	// attention and MLA regions, one logical block (page) for Mamba.
	BlockLen int64
	// NumBlocks is the number of blocks in the region, at the granularity
	// of BlockLen.
	NumBlocks int
	// DeviceID is the device the memory lives on (0 for host memory).
	DeviceID int32
	// ConvBytes are the byte sizes, on this rank, of the conv-state parts
	// at the start of a Mamba page (Mamba1: x; Mamba2: x, B, C; GDN: Q, K, V).
	ConvBytes []int64
	// SSMBytes is the byte size, on this rank, of the temporal SSM state
	// that follows the conv parts.
	SSMBytes int64
}

// Group is a KV-cache group (the reference's HMA groups): block ids are
// given per group, and one group's ids index the blocks of every region
// it lists.
type Group struct {
	Kind Kind
	// Window is the sliding window in tokens (KindSlidingWindow only).
	Window int
	// Regions lists the indices (into Layout.Regions) that this group's
	// block ids address.
	Regions []int
}

// Layout describes the KV cache of one rank of one engine: everything the
// mapping math needs about the memory on one side of a transfer.
//
// A Layout is plain data; after Validate succeeds it must not be mutated
// while plans built from it are in use.
type Layout struct {
	TPRank, TPSize int
	PPRank, PPSize int
	// TotalKVHeads is the model's number of KV heads over all TP ranks.
	TotalKVHeads int
	// HeadSize is the number of elements of one head's K (or V) vector.
	HeadSize int
	// ElemBytes is the byte size of one cache element.
	ElemBytes int
	KVLayout  KVLayout
	Packing   KVPacking
	// LogicalBlockSize is the engine scheduler's block size in tokens;
	// KernelBlockSize is the attention kernel's, which must divide it.
	// Block ids given to kvxfer are logical; attention regions are laid
	// out in kernel blocks (SPEC §3).
	LogicalBlockSize, KernelBlockSize int
	// RegionOffset is the global index of Regions[0] in the model's full
	// region list: nonzero for a pipeline-parallel stage after the first.
	// Regions of two sides are matched by global index.
	RegionOffset int
	Regions      []Region
	// Groups are the cache groups. Empty means one group of kind
	// Regions[0].Kind over every region.
	Groups []Group
}

// Errors returned by topology. Errors carry more detail; match with errors.Is.
var (
	ErrInvalidLayout = errors.New("topology: invalid layout")
	ErrIncompatible  = errors.New("topology: incompatible layouts")
	ErrUnsupported   = errors.New("topology: unsupported combination")
	ErrInvalidBlocks = errors.New("topology: invalid block ids")
)

func layoutErr(format string, args ...any) error {
	return fmt.Errorf("%w: "+format, append([]any{ErrInvalidLayout}, args...)...)
}

// PagesPerBlock returns the number of kernel blocks per logical block
// (the reference's physical_blocks_per_logical_kv_block).
func (l *Layout) PagesPerBlock() int {
	if l.KernelBlockSize <= 0 {
		return 0
	}
	return l.LogicalBlockSize / l.KernelBlockSize
}

// LocalHeads returns the number of KV heads one rank of this layout holds:
// TotalKVHeads/TPSize, or 1 when heads are replicated (TPSize > heads).
// It returns 0 for a TPSize that is not positive (an invalid layout).
func (l *Layout) LocalHeads() int {
	if l.TPSize <= 0 {
		return 0
	}
	if l.TPSize >= l.TotalKVHeads {
		return 1
	}
	return l.TotalKVHeads / l.TPSize
}

// GroupList returns the layout's groups, with the default single group
// filled in when Groups is empty. It allocates for the default case; it
// is not for the hot path.
func (l *Layout) GroupList() []Group {
	if len(l.Groups) > 0 || len(l.Regions) == 0 {
		return l.Groups
	}
	g := Group{Kind: l.Regions[0].Kind, Window: l.Regions[0].Window, Regions: make([]int, len(l.Regions))}
	for i := range l.Regions {
		g.Regions[i] = i
	}
	return []Group{g}
}

// maxBlockTokens bounds block sizes so products stay far from overflow.
const (
	maxBlockTokens = 1 << 16
	maxHeads       = 1 << 12
	maxHeadSize    = 1 << 16
	maxTP          = 1 << 12
	maxRegions     = 1 << 16
)

// AttentionBlockLen is the byte length of one kernel block of an
// attention region of l: K and V (or one of them, SeparateKV) for the
// rank's heads, KernelBlockSize tokens, HeadSize elements of ElemBytes.
func (l *Layout) AttentionBlockLen() int64 {
	kv := int64(2)
	if l.Packing == SeparateKV {
		kv = 1
	}
	return kv * int64(l.LocalHeads()) * int64(l.KernelBlockSize) * int64(l.HeadSize) * int64(l.ElemBytes)
}

// Validate checks the layout on its own: every size positive, divisibility
// of TP and heads, block sizes, per-region byte sizes, groups. Errors wrap
// ErrInvalidLayout and name the field and its value.
func (l *Layout) Validate() error {
	switch {
	case l.TPSize <= 0 || l.TPSize > maxTP:
		return layoutErr("TPSize = %d, want 1..%d", l.TPSize, maxTP)
	case l.TPRank < 0 || l.TPRank >= l.TPSize:
		return layoutErr("TPRank = %d, want 0..%d", l.TPRank, l.TPSize-1)
	case l.PPSize <= 0 || l.PPSize > maxTP:
		return layoutErr("PPSize = %d, want 1..%d", l.PPSize, maxTP)
	case l.PPRank < 0 || l.PPRank >= l.PPSize:
		return layoutErr("PPRank = %d, want 0..%d", l.PPRank, l.PPSize-1)
	case l.LogicalBlockSize <= 0 || l.LogicalBlockSize > maxBlockTokens:
		return layoutErr("LogicalBlockSize = %d, want 1..%d", l.LogicalBlockSize, maxBlockTokens)
	case l.KernelBlockSize <= 0 || l.KernelBlockSize > l.LogicalBlockSize:
		return layoutErr("KernelBlockSize = %d, want 1..LogicalBlockSize (%d)", l.KernelBlockSize, l.LogicalBlockSize)
	case l.LogicalBlockSize%l.KernelBlockSize != 0:
		return layoutErr("LogicalBlockSize = %d is not a multiple of KernelBlockSize = %d", l.LogicalBlockSize, l.KernelBlockSize)
	case l.RegionOffset < 0 || l.RegionOffset > maxRegions:
		return layoutErr("RegionOffset = %d, want 0..%d", l.RegionOffset, maxRegions)
	case l.PPRank > 0 && l.RegionOffset == 0:
		// Every stage holds regions (Regions is never empty), so a later
		// stage's start past the earlier ones'; at 0 its layers would
		// land in the first stage's.
		return layoutErr("RegionOffset = 0 with PPRank = %d: a later pipeline stage's regions start past the earlier stages' (their count)", l.PPRank)
	case len(l.Regions) == 0:
		return layoutErr("Regions is empty")
	case len(l.Regions) > maxRegions:
		return layoutErr("len(Regions) = %d, want at most %d", len(l.Regions), maxRegions)
	}
	hasAttention := false
	for i := range l.Regions {
		if l.Regions[i].Kind.attention() {
			hasAttention = true
		}
	}
	if hasAttention {
		switch {
		case l.TotalKVHeads <= 0 || l.TotalKVHeads > maxHeads:
			return layoutErr("TotalKVHeads = %d, want 1..%d", l.TotalKVHeads, maxHeads)
		case l.TotalKVHeads%l.TPSize != 0 && l.TPSize%l.TotalKVHeads != 0:
			return layoutErr("TotalKVHeads = %d and TPSize = %d: one must divide the other", l.TotalKVHeads, l.TPSize)
		case l.HeadSize <= 0 || l.HeadSize > maxHeadSize:
			return layoutErr("HeadSize = %d, want 1..%d", l.HeadSize, maxHeadSize)
		case l.ElemBytes <= 0 || l.ElemBytes > 16:
			return layoutErr("ElemBytes = %d, want 1..16", l.ElemBytes)
		case l.KVLayout != LayoutHND && l.KVLayout != LayoutNHD:
			return layoutErr("KVLayout = %v, want HND or NHD", l.KVLayout)
		case l.Packing < PackedKV || l.Packing > SeparateKV:
			return layoutErr("Packing = %v, want packed, split or separate", l.Packing)
		}
	}
	for i := range l.Regions {
		if err := l.validateRegion(i); err != nil {
			return err
		}
	}
	return l.validateGroups()
}

func (l *Layout) validateRegion(i int) error {
	r := &l.Regions[i]
	if !r.Kind.valid() {
		return layoutErr("Regions[%d].Kind = %v, want a known kind", i, r.Kind)
	}
	if r.NumBlocks <= 0 || r.NumBlocks > 1<<30 {
		return layoutErr("Regions[%d].NumBlocks = %d, want 1..%d", i, r.NumBlocks, 1<<30)
	}
	if r.BlockLen <= 0 || r.BlockLen > 1<<34 {
		return layoutErr("Regions[%d].BlockLen = %d, want 1..%d", i, r.BlockLen, int64(1)<<34)
	}
	size := r.BlockLen * int64(r.NumBlocks)
	if size/int64(r.NumBlocks) != r.BlockLen || size > 1<<50 {
		return layoutErr("Regions[%d] size BlockLen·NumBlocks = %d·%d overflows", i, r.BlockLen, r.NumBlocks)
	}
	if r.Base+uint64(size) < r.Base {
		return layoutErr("Regions[%d].Base = %#x with size %d wraps the address space", i, r.Base, size)
	}
	switch r.Kind {
	case KindSlidingWindow:
		if r.Window <= 0 {
			return layoutErr("Regions[%d].Window = %d, want > 0 for a sliding-window region", i, r.Window)
		}
		fallthrough
	case KindFullAttention:
		if want := l.AttentionBlockLen(); r.BlockLen != want {
			return layoutErr("Regions[%d].BlockLen = %d, want %d (%s: %d local heads · %d tokens · head size %d · %d bytes)",
				i, r.BlockLen, want, l.Packing, l.LocalHeads(), l.KernelBlockSize, l.HeadSize, l.ElemBytes)
		}
	case KindMLA:
		if r.BlockLen%int64(l.KernelBlockSize) != 0 {
			return layoutErr("Regions[%d].BlockLen = %d is not a multiple of KernelBlockSize = %d (MLA)", i, r.BlockLen, l.KernelBlockSize)
		}
	case KindMamba:
		if len(r.ConvBytes) > 16 {
			return layoutErr("Regions[%d].ConvBytes has %d parts, want at most 16", i, len(r.ConvBytes))
		}
		total := r.SSMBytes
		if r.SSMBytes < 0 || r.SSMBytes > r.BlockLen {
			return layoutErr("Regions[%d].SSMBytes = %d, want 0..BlockLen (%d)", i, r.SSMBytes, r.BlockLen)
		}
		for j, c := range r.ConvBytes {
			if c <= 0 || c > r.BlockLen {
				return layoutErr("Regions[%d].ConvBytes[%d] = %d, want 1..BlockLen (%d)", i, j, c, r.BlockLen)
			}
			total += c
		}
		if total <= 0 || total > r.BlockLen {
			return layoutErr("Regions[%d]: conv and SSM bytes total %d, want 1..BlockLen (%d)", i, total, r.BlockLen)
		}
	}
	return nil
}

func (l *Layout) validateGroups() error {
	groups := l.GroupList()
	// seen[i] is 1 + the last group listing region i (0: none yet), so a
	// repeat inside one group is found without a quadratic scan.
	seen := make([]int, len(l.Regions))
	for g := range groups {
		gr := &groups[g]
		if !gr.Kind.valid() {
			return layoutErr("Groups[%d].Kind = %v, want a known kind", g, gr.Kind)
		}
		if gr.Kind == KindSlidingWindow && gr.Window <= 0 {
			return layoutErr("Groups[%d].Window = %d, want > 0 for a sliding-window group", g, gr.Window)
		}
		if len(gr.Regions) == 0 {
			return layoutErr("Groups[%d].Regions is empty", g)
		}
		for j, ri := range gr.Regions {
			if ri < 0 || ri >= len(l.Regions) {
				return layoutErr("Groups[%d].Regions[%d] = %d, want 0..%d", g, j, ri, len(l.Regions)-1)
			}
			if seen[ri] == g+1 {
				// A repeat would move the region's blocks twice per request.
				first := 0
				for gr.Regions[first] != ri {
					first++
				}
				return layoutErr("Groups[%d].Regions[%d] = %d repeats Groups[%d].Regions[%d]", g, j, ri, g, first)
			}
			rk := l.Regions[ri].Kind
			if (gr.Kind == KindMamba) != (rk == KindMamba) {
				return layoutErr("Groups[%d] (%v) lists Regions[%d] of kind %v", g, gr.Kind, ri, rk)
			}
			seen[ri] = g + 1
		}
	}
	for i, s := range seen {
		if s == 0 {
			return layoutErr("Regions[%d] belongs to no group", i)
		}
	}
	return nil
}

// HeadRange returns the first global KV head and the number of heads that
// TP rank `rank` of `tp` ranks holds when a model has `heads` KV heads.
// With more ranks than heads, heads are replicated: rank r holds the single
// head r·heads/tp. A tp that is not positive yields no heads.
func HeadRange(heads, tp, rank int) (first, count int) {
	if tp <= 0 {
		return 0, 0
	}
	if tp >= heads {
		return rank * heads / tp, 1
	}
	n := heads / tp
	return rank * n, n
}
