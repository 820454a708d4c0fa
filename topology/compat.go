package topology

import "fmt"

func incompat(field string, src, dst any) error {
	return fmt.Errorf("%w: %s: src %v, dst %v", ErrIncompatible, field, src, dst)
}

// CheckCompatible validates both layouts and checks that KV can move from
// src (a P rank) to dst (a D rank): the handshake validation of SPEC §4,
// generalised. Errors name the field and both values.
//
// Unlike the reference, a KV layout (HND/NHD) or packing mismatch is not an
// error by itself: plans place every cell where dst's layout wants it. A
// combination is refused only when it would need too many descriptors per
// block (see PlanOptions.MaxSegments).
func CheckCompatible(src, dst *Layout) error {
	if err := src.Validate(); err != nil {
		return fmt.Errorf("src: %w", err)
	}
	if err := dst.Validate(); err != nil {
		return fmt.Errorf("dst: %w", err)
	}
	if dst.PPSize != 1 {
		return fmt.Errorf("%w: dst PPSize = %d: a pipeline-parallel consumer is not supported (src PPSize = %d)", ErrUnsupported, dst.PPSize, src.PPSize)
	}
	if _, err := TPRatio(src.TPSize, dst.TPSize); err != nil {
		return err
	}
	if src.hasAttention() || dst.hasAttention() {
		switch {
		case src.TotalKVHeads != dst.TotalKVHeads:
			return incompat("TotalKVHeads", src.TotalKVHeads, dst.TotalKVHeads)
		case src.HeadSize != dst.HeadSize:
			return incompat("HeadSize", src.HeadSize, dst.HeadSize)
		case src.ElemBytes != dst.ElemBytes:
			return incompat("ElemBytes", src.ElemBytes, dst.ElemBytes)
		case (src.Packing == SeparateKV) != (dst.Packing == SeparateKV):
			return incompat("Packing", src.Packing, dst.Packing)
		}
	}
	sg, dg := src.GroupList(), dst.GroupList()
	if len(sg) != len(dg) {
		return incompat("len(Groups)", len(sg), len(dg))
	}
	for g := range sg {
		if sg[g].Kind != dg[g].Kind {
			return incompat(fmt.Sprintf("Groups[%d].Kind", g), sg[g].Kind, dg[g].Kind)
		}
		if sg[g].Window != dg[g].Window {
			return incompat(fmt.Sprintf("Groups[%d].Window", g), sg[g].Window, dg[g].Window)
		}
	}
	// Regions pair by global index. With a single stage on both sides the
	// region lists must match one to one; a pipeline stage of src must fall
	// inside dst's list.
	if src.PPSize == 1 {
		if len(src.Regions) != len(dst.Regions) {
			return incompat("len(Regions)", len(src.Regions), len(dst.Regions))
		}
		if src.RegionOffset != 0 || dst.RegionOffset != 0 {
			return incompat("RegionOffset", src.RegionOffset, dst.RegionOffset)
		}
	}
	if dst.RegionOffset != 0 {
		return incompat("RegionOffset", src.RegionOffset, dst.RegionOffset)
	}
	if src.RegionOffset+len(src.Regions) > len(dst.Regions) {
		return fmt.Errorf("%w: src regions %d..%d (RegionOffset %d, %d regions) fall outside dst's %d regions",
			ErrIncompatible, src.RegionOffset, src.RegionOffset+len(src.Regions)-1, src.RegionOffset, len(src.Regions), len(dst.Regions))
	}
	for i := range src.Regions {
		j := src.RegionOffset + i
		if err := checkRegionPair(src, dst, i, j); err != nil {
			return err
		}
	}
	// Every src region must sit in the same group on both sides.
	for g := range sg {
		for _, i := range sg[g].Regions {
			if !contains(dg[g].Regions, src.RegionOffset+i) {
				return fmt.Errorf("%w: src Regions[%d] (global %d) is in Groups[%d] on src but not on dst",
					ErrIncompatible, i, src.RegionOffset+i, g)
			}
		}
	}
	for g := range dg {
		for _, j := range dg[g].Regions {
			i := j - src.RegionOffset
			if i >= 0 && i < len(src.Regions) && !contains(sg[g].Regions, i) {
				return fmt.Errorf("%w: dst Regions[%d] is in Groups[%d] on dst but src Regions[%d] is not",
					ErrIncompatible, j, g, i)
			}
		}
	}
	return nil
}

func contains(s []int, v int) bool {
	for _, x := range s {
		if x == v {
			return true
		}
	}
	return false
}

func (l *Layout) hasAttention() bool {
	for i := range l.Regions {
		if l.Regions[i].Kind.attention() {
			return true
		}
	}
	return false
}

func checkRegionPair(src, dst *Layout, i, j int) error {
	rs, rd := &src.Regions[i], &dst.Regions[j]
	field := func(f string) string { return fmt.Sprintf("Regions[%d].%s", j, f) }
	if rs.Kind != rd.Kind {
		return incompat(field("Kind"), rs.Kind, rd.Kind)
	}
	if rs.Window != rd.Window {
		return incompat(field("Window"), rs.Window, rd.Window)
	}
	switch rs.Kind {
	case KindFullAttention, KindSlidingWindow, KindMLA:
		if _, _, _, err := BlockSizeRatio(src.KernelBlockSize, dst.KernelBlockSize); err != nil {
			return err
		}
		if rs.Kind == KindMLA {
			// A replicated block holds the same bytes per token on every rank.
			cs, cd := rs.BlockLen/int64(src.KernelBlockSize), rd.BlockLen/int64(dst.KernelBlockSize)
			if cs != cd {
				return incompat(field("BlockLen per token (MLA)"), cs, cd)
			}
		}
	case KindMamba:
		if len(rs.ConvBytes) != len(rd.ConvBytes) {
			return incompat(field("len(ConvBytes)"), len(rs.ConvBytes), len(rd.ConvBytes))
		}
		for k := range rs.ConvBytes {
			if rs.ConvBytes[k]*int64(src.TPSize) != rd.ConvBytes[k]*int64(dst.TPSize) {
				return incompat(field(fmt.Sprintf("ConvBytes[%d]·TPSize", k)),
					fmt.Sprintf("%d·%d", rs.ConvBytes[k], src.TPSize), fmt.Sprintf("%d·%d", rd.ConvBytes[k], dst.TPSize))
			}
		}
		if rs.SSMBytes*int64(src.TPSize) != rd.SSMBytes*int64(dst.TPSize) {
			return incompat(field("SSMBytes·TPSize"),
				fmt.Sprintf("%d·%d", rs.SSMBytes, src.TPSize), fmt.Sprintf("%d·%d", rd.SSMBytes, dst.TPSize))
		}
	}
	return nil
}

// CheckSameEngine checks that two ranks' layouts can belong to one engine:
// the same TP and PP sizes, block sizes, KV layout, region count and,
// region by region, the same kind, block length and block count (the
// reference asserts equal num_blocks across a remote engine's ranks).
func CheckSameEngine(a, b *Layout) error {
	switch {
	case a.TPSize != b.TPSize:
		return incompat("TPSize", a.TPSize, b.TPSize)
	case a.PPSize != b.PPSize:
		return incompat("PPSize", a.PPSize, b.PPSize)
	case a.LogicalBlockSize != b.LogicalBlockSize:
		return incompat("LogicalBlockSize", a.LogicalBlockSize, b.LogicalBlockSize)
	case a.KernelBlockSize != b.KernelBlockSize:
		return incompat("KernelBlockSize", a.KernelBlockSize, b.KernelBlockSize)
	case a.KVLayout != b.KVLayout:
		return incompat("KVLayout", a.KVLayout, b.KVLayout)
	case a.Packing != b.Packing:
		return incompat("Packing", a.Packing, b.Packing)
	case a.PPRank == b.PPRank && len(a.Regions) != len(b.Regions):
		return incompat("len(Regions)", len(a.Regions), len(b.Regions))
	}
	if a.PPRank != b.PPRank {
		return nil
	}
	for i := range a.Regions {
		ra, rb := &a.Regions[i], &b.Regions[i]
		switch {
		case ra.Kind != rb.Kind:
			return incompat(fmt.Sprintf("Regions[%d].Kind", i), ra.Kind, rb.Kind)
		case ra.BlockLen != rb.BlockLen:
			return incompat(fmt.Sprintf("Regions[%d].BlockLen", i), ra.BlockLen, rb.BlockLen)
		case ra.NumBlocks != rb.NumBlocks:
			return incompat(fmt.Sprintf("Regions[%d].NumBlocks", i), ra.NumBlocks, rb.NumBlocks)
		}
	}
	return nil
}

// CheckStages checks that the pipeline stages of a source engine hold
// dst's regions exactly once between them: stages[p] is a layout of stage
// p (any of its TP ranks), stage 0's regions start at dst's region 0, each
// later stage's where the one before it ends (its RegionOffset), and the
// last ends at dst's last region. CheckCompatible sees one stage at a
// time: a stage whose RegionOffset is off lands its layers in other
// layers' regions (another stage's, or a gap no stage writes), and a
// region no stage holds is never written. Errors name the stage, its
// regions and the region it must start at.
func CheckStages(stages []*Layout, dst *Layout) error {
	next := 0
	for p, s := range stages {
		if s.RegionOffset != next {
			return fmt.Errorf("%w: regions %d..%d of stage pp %d start at %d, want %d (stages pp 0..%d hold %d of dst's %d regions)",
				ErrIncompatible, s.RegionOffset, s.RegionOffset+len(s.Regions)-1, p, s.RegionOffset, next, p-1, next, len(dst.Regions))
		}
		next += len(s.Regions)
	}
	if next != len(dst.Regions) {
		return fmt.Errorf("%w: the %d stages hold regions 0..%d, dst has %d regions", ErrIncompatible, len(stages), next-1, len(dst.Regions))
	}
	return nil
}
