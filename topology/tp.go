package topology

import "fmt"

// TPRatio returns the reference's TP ratio seen from the local side (SPEC
// §4): local/remote when local >= remote, else -(remote/local). The larger
// size must be a multiple of the smaller.
func TPRatio(local, remote int) (int, error) {
	if local <= 0 || remote <= 0 || local > maxTP || remote > maxTP {
		return 0, fmt.Errorf("%w: TP sizes local = %d, remote = %d, want 1..%d", ErrInvalidLayout, local, remote, maxTP)
	}
	if local >= remote {
		if local%remote != 0 {
			return 0, fmt.Errorf("%w: local TP %d is not a multiple of remote TP %d", ErrIncompatible, local, remote)
		}
		return local / remote, nil
	}
	if remote%local != 0 {
		return 0, fmt.Errorf("%w: remote TP %d is not a multiple of local TP %d", ErrIncompatible, remote, local)
	}
	return -(remote / local), nil
}

// TargetRanks appends to dst the remote TP ranks that local rank
// localRank talks to: [localRank/r] when the TP ratio r is positive, else
// the |r| ranks localRank·|r| .. localRank·|r|+|r|-1 (SPEC §2, §4). The
// rule is symmetric: a D rank's targets are the P ranks whose KV it needs,
// and a P rank's targets are the D ranks that need its KV.
func TargetRanks(dst []int, localTP, remoteTP, localRank int) ([]int, error) {
	r, err := TPRatio(localTP, remoteTP)
	if err != nil {
		return dst, err
	}
	if localRank < 0 || localRank >= localTP {
		return dst, fmt.Errorf("%w: rank %d, want 0..%d", ErrInvalidLayout, localRank, localTP-1)
	}
	if r > 0 {
		return append(dst, localRank/r), nil
	}
	for i := 0; i < -r; i++ {
		dst = append(dst, localRank*(-r)+i)
	}
	return dst, nil
}

// HeadSlice says which KV heads one source rank supplies to one
// destination rank: Heads heads starting at local head SrcHead on the
// source and at local head DstHead on the destination. Heads == 0 means
// the source holds nothing the destination still needs (GQA duplicate);
// it only notifies.
type HeadSlice struct {
	SrcRank int
	SrcHead int
	DstHead int
	Heads   int
}

// AttentionSlices appends, for destination rank dstRank, one HeadSlice per
// connected source rank (in TargetRanks order). Every head of the
// destination is supplied by exactly one source: the first connected rank
// that holds it (the reference's GQA dedup, SPEC §4).
func AttentionSlices(dst []HeadSlice, heads, srcTP, dstTP, dstRank int) ([]HeadSlice, error) {
	if heads <= 0 {
		return dst, fmt.Errorf("%w: TotalKVHeads = %d, want > 0", ErrInvalidLayout, heads)
	}
	for _, tp := range [2]int{srcTP, dstTP} {
		if tp > 0 && heads%tp != 0 && tp%heads != 0 {
			return dst, fmt.Errorf("%w: TotalKVHeads = %d and TP %d: one must divide the other", ErrInvalidLayout, heads, tp)
		}
	}
	var buf [16]int
	peers, err := TargetRanks(buf[:0], dstTP, srcTP, dstRank)
	if err != nil {
		return dst, err
	}
	d0, dn := HeadRange(heads, dstTP, dstRank)
	covered := d0 // heads [d0, covered) are already supplied
	for _, p := range peers {
		p0, pn := HeadRange(heads, srcTP, p)
		lo, hi := max(p0, covered), min(p0+pn, d0+dn)
		s := HeadSlice{SrcRank: p}
		if lo < hi {
			s.SrcHead, s.DstHead, s.Heads = lo-p0, lo-d0, hi-lo
			covered = hi
		}
		dst = append(dst, s)
	}
	if covered != d0+dn {
		// Unreachable with divisible sizes; kept as a loud guard.
		return dst, fmt.Errorf("%w: heads %d..%d of dst rank %d have no source (heads %d, TP %d -> %d)",
			ErrUnsupported, covered, d0+dn-1, dstRank, heads, srcTP, dstTP)
	}
	return dst, nil
}

// SourceRanks appends the source TP ranks that WRITE (or are READ) for a
// group of the given kind into destination rank dstRank:
//   - attention: the deduplicated head owners (GQA dedup);
//   - MLA: exactly one rank, the first connected one (replicated latent);
//   - Mamba: every connected rank (each holds a distinct shard).
//
// Connected ranks not listed are notify-only for that group.
func SourceRanks(dst []int, kind Kind, heads, srcTP, dstTP, dstRank int) ([]int, error) {
	switch kind {
	case KindMLA:
		var buf [16]int
		peers, err := TargetRanks(buf[:0], dstTP, srcTP, dstRank)
		if err != nil {
			return dst, err
		}
		return append(dst, peers[0]), nil
	case KindMamba:
		return TargetRanks(dst, dstTP, srcTP, dstRank)
	case KindFullAttention, KindSlidingWindow:
		var buf [16]HeadSlice
		sl, err := AttentionSlices(buf[:0], heads, srcTP, dstTP, dstRank)
		if err != nil {
			return dst, err
		}
		for _, s := range sl {
			if s.Heads > 0 {
				dst = append(dst, s.SrcRank)
			}
		}
		return dst, nil
	}
	return dst, fmt.Errorf("%w: kind %v", ErrInvalidLayout, kind)
}

// NotificationsAtDst returns how many completion notifications one
// destination rank must receive for a request: one from every connected
// source rank of every source pipeline stage, whether that rank wrote
// bytes or is notify-only (push D: pp·max(1, P_tp/D_tp), SPEC §4).
func NotificationsAtDst(srcTP, srcPP, dstTP int) (int, error) {
	if srcPP <= 0 {
		return 0, fmt.Errorf("%w: source PPSize = %d, want > 0", ErrInvalidLayout, srcPP)
	}
	r, err := TPRatio(srcTP, dstTP)
	if err != nil {
		return 0, err
	}
	return srcPP * max(1, r), nil
}

// NotificationsAtSrc returns how many notifications one source rank must
// receive from destination ranks before it may free a request's blocks in
// pull mode: one from every destination rank that reads from it
// (consumers per producer, SPEC §4).
func NotificationsAtSrc(srcTP, dstTP int) (int, error) {
	r, err := TPRatio(dstTP, srcTP)
	if err != nil {
		return 0, err
	}
	return max(1, r), nil
}
