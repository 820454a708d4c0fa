package topology

import (
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

var update = flag.Bool("update", false, "rewrite golden files under testdata/golden")

func mustPlan(t *testing.T, src, dst *Layout, opts PlanOptions) *Plan {
	t.Helper()
	p, err := NewPlan(src, dst, opts)
	if err != nil {
		t.Fatalf("NewPlan: %v", err)
	}
	return p
}

func segs(p *Plan) []Segment { return p.Groups[0].Regions[0].Segs }

// Geometry of tinyLayout: a K or V vector is 4 bytes; a packed cell (K+V)
// is 8 bytes. A block of h local heads and n tokens is h·n·8 bytes.
func TestPlanAttentionRules(t *testing.T) {
	hnd, nhd := LayoutHND, LayoutNHD
	// The reference's D_TP > P_TP slice is rank_offset_factor · local
	// block_len (SPEC §3, §4); for K=8, D TP4 rank 3 reading P TP2 the
	// factor is t mod (T/R) = 3 mod 2 = 1.
	const offsetFactor = 1
	for _, tc := range []struct {
		name                 string
		src, dst             *Layout
		want                 []Segment
		whole                bool
		srcStride, dstStride int64
		srcUnits, dstUnits   int
		reason               string
	}{
		{name: "equal TP HND packed moves one whole segment per block",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV),
			want: []Segment{{0, 0, 512}}, whole: true, srcStride: 512, dstStride: 512, srcUnits: 1, dstUnits: 1},
		{name: "equal TP NHD packed moves one whole segment per block",
			src: tinyLayout(2, 0, 16, 16, 8, nhd, PackedKV), dst: tinyLayout(2, 0, 16, 16, 8, nhd, PackedKV),
			want: []Segment{{0, 0, 512}}, whole: true, srcStride: 512, dstStride: 512, srcUnits: 1, dstUnits: 1},
		{name: "equal TP split K/V planes moves one whole segment per block",
			src: tinyLayout(1, 0, 16, 16, 2, hnd, SplitKV), dst: tinyLayout(1, 0, 16, 16, 2, hnd, SplitKV),
			want: []Segment{{0, 0, 256}}, whole: true, srcStride: 256, dstStride: 256, srcUnits: 1, dstUnits: 1},
		{name: "D_TP > P_TP HND: D rank 3 reads its head slice at rank_offset_factor·block_len",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(4, 3, 16, 16, 8, hnd, PackedKV),
			want: []Segment{{int64(offsetFactor) * 256, 0, 256}}, srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 1,
			reason: "D rank 3 holds heads 6-7 = local heads 2-3 of P rank 1; D's block_len is 256"},
		{name: "D_TP > P_TP HND: D rank 2 reads the first half of P rank 1's block",
			src: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(4, 2, 16, 16, 8, hnd, PackedKV),
			want: []Segment{{0, 0, 256}}, srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 1},
		{name: "P_TP > D_TP HND: P rank 3 lands at its head slot in D's block",
			src: tinyLayout(4, 3, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV),
			want: []Segment{{0, 256, 256}}, srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 1,
			reason: "rank_to_attention_slot 1 of 2: chunk len/2 = 256 at 1·256"},
		{name: "P_TP > D_TP HND: P rank 2 lands at slot 0",
			src: tinyLayout(4, 2, 16, 16, 8, hnd, PackedKV), dst: tinyLayout(2, 1, 16, 16, 8, hnd, PackedKV),
			want: []Segment{{0, 0, 256}}, srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 1},
		{name: "GQA dedup K=2 P TP4 -> D TP1: P rank 0 writes head 0",
			src: tinyLayout(4, 0, 16, 16, 2, hnd, PackedKV), dst: tinyLayout(1, 0, 16, 16, 2, hnd, PackedKV),
			want: []Segment{{0, 0, 128}}, srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 1},
		{name: "GQA dedup K=2 P TP4 -> D TP1: P rank 2 writes head 1",
			src: tinyLayout(4, 2, 16, 16, 2, hnd, PackedKV), dst: tinyLayout(1, 0, 16, 16, 2, hnd, PackedKV),
			want: []Segment{{0, 128, 128}}, srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 1},
		{name: "GQA replication on D: K=2 P TP1 -> D TP4 rank 3 reads head 1",
			src: tinyLayout(1, 0, 16, 16, 2, hnd, PackedKV), dst: tinyLayout(4, 3, 16, 16, 2, hnd, PackedKV),
			want: []Segment{{128, 0, 128}}, srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 1},
		{name: "NHD with D_TP > P_TP places one segment per token",
			src: tinyLayout(1, 0, 4, 4, 4, nhd, PackedKV), dst: tinyLayout(2, 1, 4, 4, 4, nhd, PackedKV),
			want:      []Segment{{16, 0, 16}, {48, 16, 16}, {80, 32, 16}, {112, 48, 16}},
			srcStride: 128, dstStride: 64, srcUnits: 1, dstUnits: 1,
			reason: "token t of P holds 4 heads·8 bytes; D rank 1 needs heads 2-3 of every token"},
		{name: "NHD with P_TP > D_TP places one segment per token",
			src: tinyLayout(2, 0, 4, 4, 4, nhd, PackedKV), dst: tinyLayout(1, 0, 4, 4, 4, nhd, PackedKV),
			want:      []Segment{{0, 0, 16}, {16, 32, 16}, {32, 64, 16}, {48, 96, 16}},
			srcStride: 64, dstStride: 128, srcUnits: 1, dstUnits: 1},
		{name: "block 16 -> 32 HND with 4 local heads: 4 segments per unit, DstSlotStride 16 tokens",
			src: tinyLayout(1, 0, 16, 16, 4, hnd, PackedKV), dst: tinyLayout(1, 0, 32, 32, 4, hnd, PackedKV),
			want:      []Segment{{0, 0, 128}, {128, 256, 128}, {256, 512, 128}, {384, 768, 128}},
			srcStride: 128, dstStride: 128, srcUnits: 1, dstUnits: 2,
			reason: "P head h (128 bytes) lands in D head h's row (256 bytes); unit 1 is 128 bytes further"},
		{name: "block 32 -> 16 HND with 4 local heads: SrcSlotStride 16 tokens",
			src: tinyLayout(1, 0, 32, 32, 4, hnd, PackedKV), dst: tinyLayout(1, 0, 16, 16, 4, hnd, PackedKV),
			want:      []Segment{{0, 0, 128}, {256, 128, 128}, {512, 256, 128}, {768, 384, 128}},
			srcStride: 128, dstStride: 128, srcUnits: 2, dstUnits: 1},
		{name: "block 16 -> 32 NHD with equal heads stays one whole segment per unit",
			src: tinyLayout(1, 0, 16, 16, 4, nhd, PackedKV), dst: tinyLayout(1, 0, 32, 32, 4, nhd, PackedKV),
			want: []Segment{{0, 0, 512}}, whole: true, srcStride: 512, dstStride: 512, srcUnits: 1, dstUnits: 2},
		{name: "logical 32 kernel 16 against logical 16: units are kernel blocks",
			src: tinyLayout(1, 0, 32, 16, 4, hnd, PackedKV), dst: tinyLayout(1, 0, 16, 16, 4, hnd, PackedKV),
			want: []Segment{{0, 0, 512}}, whole: true, srcStride: 512, dstStride: 512, srcUnits: 1, dstUnits: 1},
		{name: "split K/V planes with D_TP > P_TP HND: one segment per plane",
			src: tinyLayout(1, 0, 4, 4, 2, hnd, SplitKV), dst: tinyLayout(2, 1, 4, 4, 2, hnd, SplitKV),
			want: []Segment{{16, 0, 16}, {48, 16, 16}}, srcStride: 16, dstStride: 16, srcUnits: 1, dstUnits: 1},
		{name: "separate K and V regions with D_TP > P_TP HND",
			src: tinyLayout(1, 0, 4, 4, 2, hnd, SeparateKV), dst: tinyLayout(2, 1, 4, 4, 2, hnd, SeparateKV),
			want: []Segment{{16, 0, 16}}, srcStride: 16, dstStride: 16, srcUnits: 1, dstUnits: 1},
		{name: "packed to split K/V planes places K and V apart",
			src: tinyLayout(1, 0, 2, 2, 1, hnd, PackedKV), dst: tinyLayout(1, 0, 2, 2, 1, hnd, SplitKV),
			want: []Segment{{0, 0, 4}, {4, 8, 4}, {8, 4, 4}, {12, 12, 4}}, srcStride: 16, dstStride: 8, srcUnits: 1, dstUnits: 1},
		{name: "HND to NHD places every cell",
			src: tinyLayout(1, 0, 2, 2, 2, hnd, PackedKV), dst: tinyLayout(1, 0, 2, 2, 2, nhd, PackedKV),
			want: []Segment{{0, 0, 8}, {8, 16, 8}, {16, 8, 8}, {24, 24, 8}}, srcStride: 16, dstStride: 32, srcUnits: 1, dstUnits: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustPlan(t, tc.src, tc.dst, PlanOptions{})
			if p.NotifyOnly || len(p.Groups) != 1 || len(p.Groups[0].Regions) != 1 {
				t.Fatalf("NewPlan() = %d groups, NotifyOnly %v, want one group with one region pair", len(p.Groups), p.NotifyOnly)
			}
			g, rp := p.Groups[0], p.Groups[0].Regions[0]
			if !slices.Equal(rp.Segs, tc.want) || rp.Whole != tc.whole {
				t.Fatalf("NewPlan().Segs = %v whole=%v, want %v whole=%v (%s)", rp.Segs, rp.Whole, tc.want, tc.whole, tc.reason)
			}
			if rp.SrcSlotStride != tc.srcStride || rp.DstSlotStride != tc.dstStride {
				t.Fatalf("NewPlan() slot strides = %d, %d, want %d, %d", rp.SrcSlotStride, rp.DstSlotStride, tc.srcStride, tc.dstStride)
			}
			if g.SrcUnits != tc.srcUnits || g.DstUnits != tc.dstUnits || g.UnitTokens != min(tc.src.KernelBlockSize, tc.dst.KernelBlockSize) {
				t.Fatalf("NewPlan() units = %d, %d of %d tokens, want %d, %d", g.SrcUnits, g.DstUnits, g.UnitTokens, tc.srcUnits, tc.dstUnits)
			}
			var sum int64
			for _, s := range rp.Segs {
				sum += s.Len
			}
			if rp.UnitBytes != sum || p.MaxUnitSegments != len(tc.want) {
				t.Fatalf("NewPlan() UnitBytes %d, MaxUnitSegments %d, want %d, %d", rp.UnitBytes, p.MaxUnitSegments, sum, len(tc.want))
			}
			if rp.SrcBase != tc.src.Regions[0].Base || rp.DstBase != tc.dst.Regions[0].Base ||
				rp.SrcBlockLen != tc.src.Regions[0].BlockLen || rp.DstBlockLen != tc.dst.Regions[0].BlockLen {
				t.Fatalf("NewPlan() region geometry %+v does not copy the layouts' regions", rp)
			}
		})
	}
}

func TestPlanGroupGeometry(t *testing.T) {
	src := validLayout() // logical 32, kernel 16: ppl 2; attention regions 64 kernel blocks, Mamba 32
	dst := validLayout()
	dst.LogicalBlockSize, dst.KernelBlockSize = 64, 64
	dst.Regions[0].BlockLen, dst.Regions[1].BlockLen = dst.AttentionBlockLen(), dst.AttentionBlockLen()
	dst.Regions[2].BlockLen = 64 * 24
	dst.Regions[0].NumBlocks = 40 // the group limit is the smallest region's
	p := mustPlan(t, src, dst, PlanOptions{})
	type geo struct {
		kind                     Kind
		window, unit, sPPL, dPPL int
		sUnits, dUnits, sBT, dBT int
		sLimit, dLimit           BlockID
		regions                  int
	}
	var got []geo
	for _, g := range p.Groups {
		got = append(got, geo{g.Kind, g.Window, g.UnitTokens, g.SrcPPL, g.DstPPL, g.SrcUnits, g.DstUnits,
			g.SrcBlockTokens, g.DstBlockTokens, g.SrcLimit, g.DstLimit, len(g.Regions)})
	}
	want := []geo{
		{KindFullAttention, 0, 16, 2, 1, 1, 4, 32, 64, 32, 40, 2},
		{KindSlidingWindow, 64, 16, 2, 1, 1, 4, 32, 64, 32, 64, 1},
		{KindMamba, 0, 0, 1, 1, 1, 1, 32, 64, 32, 32, 1},
	}
	if !slices.Equal(got, want) {
		t.Fatalf("NewPlan() groups =\n%+v\nwant\n%+v", got, want)
	}
}

func TestPlanNotifyOnly(t *testing.T) {
	for _, tc := range []struct {
		name       string
		src, dst   *Layout
		notifyOnly bool
		reason     string
	}{
		{"GQA dedup K=2 P TP4 -> D TP1: P rank 1 duplicates head 0", tinyLayout(4, 1, 16, 16, 2, LayoutHND, PackedKV), tinyLayout(1, 0, 16, 16, 2, LayoutHND, PackedKV), true, ""},
		{"GQA dedup K=2 P TP4 -> D TP1: P rank 3 duplicates head 1", tinyLayout(4, 3, 16, 16, 2, LayoutHND, PackedKV), tinyLayout(1, 0, 16, 16, 2, LayoutHND, PackedKV), true, ""},
		{"GQA dedup K=4 P TP8 -> D TP2: P rank 5 duplicates head 2", tinyLayout(8, 5, 16, 16, 4, LayoutHND, PackedKV), tinyLayout(2, 1, 16, 16, 4, LayoutHND, PackedKV), true, ""},
		{"GQA dedup K=4 P TP8 -> D TP2: P rank 6 writes head 3", tinyLayout(8, 6, 16, 16, 4, LayoutHND, PackedKV), tinyLayout(2, 1, 16, 16, 4, LayoutHND, PackedKV), false, ""},
		{"MLA: the first connected P rank writes the whole block", mlaLayout(4, 2, 16, 16, 24), mlaLayout(2, 1, 16, 16, 24), false, ""},
		{"MLA: the other connected P ranks only notify", mlaLayout(4, 3, 16, 16, 24), mlaLayout(2, 1, 16, 16, 24), true,
			"SPEC §4: pull with ratio < 0 makes exactly one read; the rest get a notif"},
		{"MLA push fan-out: P TP1 writes D rank 0", mlaLayout(1, 0, 16, 16, 24), mlaLayout(2, 0, 16, 16, 24), false, ""},
		{"MLA push fan-out: P TP1 writes D rank 1 too", mlaLayout(1, 0, 16, 16, 24), mlaLayout(2, 1, 16, 16, 24), false,
			"SPEC §4: the push P writes every D rank and never notifies without writing"},
		{"Mamba: every connected P rank writes its shard", mambaLayout(2, 1, []int64{32}, 128), mambaLayout(1, 0, []int64{64}, 256), false, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustPlan(t, tc.src, tc.dst, PlanOptions{})
			if p.NotifyOnly != tc.notifyOnly {
				t.Fatalf("NewPlan().NotifyOnly = %v, want %v (%s)", p.NotifyOnly, tc.notifyOnly, tc.reason)
			}
			n := 0
			for _, g := range p.Groups {
				n += len(g.Regions)
			}
			if tc.notifyOnly && (n != 0 || p.MaxUnitSegments != 0) {
				t.Fatalf("notify-only plan has %d region pairs, MaxUnitSegments %d, want none", n, p.MaxUnitSegments)
			}
			if !tc.notifyOnly && n == 0 {
				t.Fatalf("writing plan has no region pairs")
			}
			if len(p.Groups) != 1 || p.SrcTPRank != tc.src.TPRank || p.DstTPRank != tc.dst.TPRank {
				t.Fatalf("NewPlan() = %d groups, ranks %d -> %d, want 1 group, ranks %d -> %d", len(p.Groups), p.SrcTPRank, p.DstTPRank, tc.src.TPRank, tc.dst.TPRank)
			}
		})
	}
}

func TestPlanMLA(t *testing.T) {
	for _, tc := range []struct {
		name               string
		src, dst           *Layout
		want               []Segment
		srcUnits, dstUnits int
	}{
		{"MLA equal block size moves the whole replicated block", mlaLayout(4, 0, 16, 16, 24), mlaLayout(2, 0, 16, 16, 24), []Segment{{0, 0, 384}}, 1, 1},
		{"MLA block 16 -> 64: one whole 16-token unit per P block", mlaLayout(1, 0, 16, 16, 24), mlaLayout(2, 1, 64, 64, 24), []Segment{{0, 0, 384}}, 1, 4},
		{"MLA block 64 -> 16: one whole 16-token unit per D block", mlaLayout(2, 0, 64, 64, 24), mlaLayout(1, 0, 16, 16, 24), []Segment{{0, 0, 384}}, 4, 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustPlan(t, tc.src, tc.dst, PlanOptions{})
			g := p.Groups[0]
			rp := g.Regions[0]
			if !slices.Equal(rp.Segs, tc.want) || !rp.Whole || rp.SrcSlotStride != tc.want[0].Len || rp.DstSlotStride != tc.want[0].Len {
				t.Fatalf("NewPlan() = %v whole=%v strides %d/%d, want %v whole, strides %d", rp.Segs, rp.Whole, rp.SrcSlotStride, rp.DstSlotStride, tc.want, tc.want[0].Len)
			}
			if g.SrcUnits != tc.srcUnits || g.DstUnits != tc.dstUnits {
				t.Fatalf("NewPlan() units = %d/%d, want %d/%d", g.SrcUnits, g.DstUnits, tc.srcUnits, tc.dstUnits)
			}
		})
	}
}

// Mamba tests use global conv parts x, B, C of 64, 32, 32 bytes and a
// 128-byte SSM state, sharded over TP.
func mambaShard(tp, rank int) *Layout {
	n := int64(tp)
	return mambaLayout(tp, rank, []int64{64 / n, 32 / n, 32 / n}, 128/n)
}

func TestPlanMambaSlicesPerTP(t *testing.T) {
	for _, tc := range []struct {
		name   string
		src    *Layout
		dst    *Layout
		want   []Segment
		reason string
	}{
		{"Mamba equal TP moves the conv parts and state as one segment", mambaShard(2, 1), mambaShard(2, 1), []Segment{{0, 0, 128}}, ""},
		{"Mamba D_TP > P_TP: D rank 1 reads its slice of each P part", mambaShard(1, 0), mambaShard(2, 1),
			[]Segment{{32, 0, 32}, {80, 32, 16}, {112, 48, 16}, {192, 64, 64}},
			"local_offset 1: x at 0+1·32, B at 64+1·16, C at 96+1·16, SSM at 128+1·64"},
		{"Mamba D_TP > P_TP: D rank 0 reads the first slices", mambaShard(1, 0), mambaShard(2, 0),
			[]Segment{{0, 0, 32}, {64, 32, 16}, {96, 48, 16}, {128, 64, 64}}, "local_offset 0"},
		{"Mamba P_TP > D_TP: P rank 1's parts land at p_idx·chunk of D's parts", mambaShard(2, 1), mambaShard(1, 0),
			[]Segment{{0, 32, 32}, {32, 80, 16}, {48, 112, 16}, {64, 192, 64}},
			"P rank 1's x chunk at 1·32, B at 64+16, C at 96+16, SSM at 128+64"},
		{"Mamba P_TP > D_TP: P rank 2 of 4 into D rank 1 of 2 is p_idx 0", mambaShard(4, 2), mambaShard(2, 1),
			[]Segment{{0, 0, 16}, {16, 32, 8}, {24, 48, 8}, {32, 64, 32}}, "P rank 2 holds the first half of each of D rank 1's parts (x 0, B 32, C 48, SSM 64)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := mustPlan(t, tc.src, tc.dst, PlanOptions{})
			if got := segs(p); !slices.Equal(got, tc.want) {
				t.Fatalf("NewPlan().Segs = %v, want %v (%s)", got, tc.want, tc.reason)
			}
			g := p.Groups[0]
			if g.SrcPPL != 1 || g.DstPPL != 1 || g.UnitTokens != 0 || g.SrcUnits != 1 || g.DstUnits != 1 {
				t.Fatalf("Mamba group expanded: %+v", g)
			}
			if rp := g.Regions[0]; rp.Whole {
				t.Fatalf("Mamba region marked whole: %+v (the page holds more than the state)", rp)
			}
		})
	}
}

// refMambaSegs is the reference's SSM descriptor rule (SPEC §6) seen from
// D rank dr reading P rank pr, before merging: with ratio r = D_TP/P_TP >=
// 1, local_offset = dr mod r and D reads its own size of each part at
// base_k + local_offset·size_k (SSM after P's conv bytes); with ratio < 0,
// D's parts are split into |r| chunks and P's whole part fills chunk p_idx.
func refMambaSegs(sConv []int64, sSSM int64, dConv []int64, dSSM int64, sTP, dTP, pr, dr int) []Segment {
	parts := func(conv []int64, ssm int64) []int64 { return append(slices.Clone(conv), ssm) }
	sp, dp := parts(sConv, sSSM), parts(dConv, dSSM)
	var out []Segment
	var sBase, dBase int64
	for k := range sp {
		if dTP >= sTP {
			off := int64(dr % (dTP / sTP))
			out = append(out, Segment{sBase + off*dp[k], dBase, dp[k]})
		} else {
			pIdx := int64(pr - dr*(sTP/dTP))
			out = append(out, Segment{sBase, dBase + pIdx*sp[k], sp[k]})
		}
		sBase += sp[k]
		dBase += dp[k]
	}
	// Merge runs contiguous on both sides, as plans do.
	var merged []Segment
	for _, s := range out {
		if n := len(merged); n > 0 && merged[n-1].SrcOff+merged[n-1].Len == s.SrcOff && merged[n-1].DstOff+merged[n-1].Len == s.DstOff {
			merged[n-1].Len += s.Len
			continue
		}
		merged = append(merged, s)
	}
	return merged
}

func TestPlanMambaMatchesReference(t *testing.T) {
	sizes := []int{1, 2, 4, 8}
	for _, sTP := range sizes {
		for _, dTP := range sizes {
			for dr := 0; dr < dTP; dr++ {
				peers, err := TargetRanks(nil, dTP, sTP, dr)
				if err != nil {
					t.Fatal(err)
				}
				for _, pr := range peers {
					src, dst := mambaShard(sTP, pr), mambaShard(dTP, dr)
					p := mustPlan(t, src, dst, PlanOptions{})
					want := refMambaSegs(src.Regions[0].ConvBytes, src.Regions[0].SSMBytes, dst.Regions[0].ConvBytes, dst.Regions[0].SSMBytes, sTP, dTP, pr, dr)
					if got := segs(p); !slices.Equal(got, want) {
						t.Fatalf("Mamba P TP%d rank %d -> D TP%d rank %d: NewPlan().Segs = %v, reference %v", sTP, pr, dTP, dr, got, want)
					}
				}
			}
		}
	}
}

// testCellOff is the byte offset of (local head h, token t, kv) in an
// attention block, written from the layout definitions: packed [H][N][2·D]
// or [N][H][2·D], split [2][H][N][D] or [2][N][H][D], separate [H][N][D] or
// [N][H][D].
func testCellOff(l *Layout, h, t, kv int) int64 {
	heads, tokens := l.LocalHeads(), l.KernelBlockSize
	cell := int64(l.HeadSize * l.ElemBytes)
	idx := int64(h*tokens + t)
	if l.KVLayout == LayoutNHD {
		idx = int64(t*heads + h)
	}
	switch l.Packing {
	case PackedKV:
		return (idx*2 + int64(kv)) * cell
	case SplitKV:
		return int64(kv*heads*tokens)*cell + idx*cell
	}
	return idx * cell
}

// TestPlanPlacesEveryCellExactly sweeps heads, TP sizes, KV layouts,
// packings and block sizes. For every D rank it fills each connected P
// rank's blocks with labels (global head, token, K/V, byte), moves every
// unit of a token range through the plans, and checks that every byte of
// D's blocks holds the label D's own layout wants there, written exactly
// once: bytes land in D's layout with no post-processing.
func TestPlanPlacesEveryCellExactly(t *testing.T) {
	heads := []int{1, 2, 4, 8}
	tps := []int{1, 2, 4}
	kernels := []int{2, 4}
	if testing.Short() {
		heads, tps = []int{2, 8}, []int{1, 4}
	}
	type pack struct{ s, d KVPacking }
	packs := []pack{{PackedKV, PackedKV}, {PackedKV, SplitKV}, {SplitKV, PackedKV}, {SplitKV, SplitKV}, {SeparateKV, SeparateKV}}
	configs := 0
	for _, k := range heads {
		for _, sTP := range tps {
			for _, dTP := range tps {
				for _, sKV := range []KVLayout{LayoutHND, LayoutNHD} {
					for _, dKV := range []KVLayout{LayoutHND, LayoutNHD} {
						for _, pk := range packs {
							for _, sK := range kernels {
								for _, dK := range kernels {
									checkPlacement(t, k, sTP, dTP, sKV, dKV, pk.s, pk.d, sK, dK)
									configs++
								}
							}
						}
					}
				}
			}
		}
	}
	if configs == 0 {
		t.Fatal("no configurations swept")
	}
}

func checkPlacement(t *testing.T, heads, sTP, dTP int, sKV, dKV KVLayout, sPack, dPack KVPacking, sK, dK int) {
	t.Helper()
	name := fmt.Sprintf("K=%d P TP%d %v/%v block %d -> D TP%d %v/%v block %d", heads, sTP, sKV, sPack, sK, dTP, dKV, dPack, dK)
	nkv := 2
	if sPack == SeparateKV {
		nkv = 1
	}
	span := max(sK, dK) * 2 // tokens moved: two of the larger blocks
	label := func(h, tok, kv, b int) int32 { return int32(((h*1024+tok)*2+kv)*8 + b + 1) }
	for dr := 0; dr < dTP; dr++ {
		dst := tinyLayout(dTP, dr, dK, dK, heads, dKV, dPack)
		dBlock := dst.Regions[0].BlockLen
		dMem := make([]int32, int(dBlock)*span/dK)
		peers, err := TargetRanks(nil, dTP, sTP, dr)
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		for _, pr := range peers {
			src := tinyLayout(sTP, pr, sK, sK, heads, sKV, sPack)
			p, err := NewPlan(src, dst, PlanOptions{MaxSegments: 1 << 12})
			if err != nil {
				t.Fatalf("%s: NewPlan(P rank %d, D rank %d) = %v", name, pr, dr, err)
			}
			sBlock := src.Regions[0].BlockLen
			sMem := make([]int32, int(sBlock)*span/sK)
			p0, pn := HeadRange(heads, sTP, pr)
			for h := 0; h < pn; h++ {
				for tok := 0; tok < span; tok++ {
					for kv := 0; kv < nkv; kv++ {
						for b := 0; b < 4; b++ {
							sMem[int64(tok/sK)*sBlock+testCellOff(src, h, tok%sK, kv)+int64(b)] = label(p0+h, tok, kv, b)
						}
					}
				}
			}
			g := p.Groups[0]
			for _, rp := range g.Regions {
				for u := 0; u < span/g.UnitTokens; u++ {
					so := int64(u/g.SrcUnits)*rp.SrcBlockLen + int64(u%g.SrcUnits)*rp.SrcSlotStride
					do := int64(u/g.DstUnits)*rp.DstBlockLen + int64(u%g.DstUnits)*rp.DstSlotStride
					for _, s := range rp.Segs {
						for i := int64(0); i < s.Len; i++ {
							if dMem[do+s.DstOff+i] != 0 {
								t.Fatalf("%s: P rank %d unit %d writes D byte %d twice", name, pr, u, do+s.DstOff+i)
							}
							dMem[do+s.DstOff+i] = sMem[so+s.SrcOff+i]
						}
					}
				}
			}
		}
		d0, dn := HeadRange(heads, dTP, dr)
		for h := 0; h < dn; h++ {
			for tok := 0; tok < span; tok++ {
				for kv := 0; kv < nkv; kv++ {
					for b := 0; b < 4; b++ {
						at := int64(tok/dK)*dBlock + testCellOff(dst, h, tok%dK, kv) + int64(b)
						if got, want := dMem[at], label(d0+h, tok, kv, b); got != want {
							t.Fatalf("%s: D rank %d byte %d (head %d token %d kv %d byte %d) holds label %d, want %d", name, dr, at, d0+h, tok, kv, b, got, want)
						}
					}
				}
			}
		}
	}
}

func TestPlanPipelineStageSlicesRegions(t *testing.T) {
	// SPEC §12 item 38: a P stage with 2 local regions writes regions
	// [2:4] of a D with 4.
	for _, tc := range []struct {
		name  string
		stage int
		want  [][2]int
	}{
		{"PP>1 producer stage 1 maps its regions to dst regions [2:4]", 1, [][2]int{{0, 2}, {1, 3}}},
		{"PP>1 producer stage 0 maps its regions to dst regions [0:2]", 0, [][2]int{{0, 0}, {1, 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			src, dst := ppLayouts(tc.stage, 2, 4)
			p := mustPlan(t, src, dst, PlanOptions{})
			if p.SrcPPRank != tc.stage {
				t.Fatalf("NewPlan().SrcPPRank = %d, want %d", p.SrcPPRank, tc.stage)
			}
			var got [][2]int
			for _, r := range p.Groups[0].Regions {
				got = append(got, [2]int{r.Src, r.Dst})
				if r.SrcBase != src.Regions[r.Src].Base || r.DstBase != dst.Regions[r.Dst].Base {
					t.Fatalf("region %d -> %d: bases %#x -> %#x, want %#x -> %#x", r.Src, r.Dst, r.SrcBase, r.DstBase, src.Regions[r.Src].Base, dst.Regions[r.Dst].Base)
				}
			}
			if !slices.Equal(got, tc.want) {
				t.Fatalf("NewPlan() region pairs = %v, want %v", got, tc.want)
			}
		})
	}
}

func TestPlanHMAPooledRegions(t *testing.T) {
	// HMA pooling: one tensor is shared by a full-attention and a
	// sliding-window group; each group plans it for its own block ids.
	pooled := func(tp, rank int) *Layout {
		l := tinyLayout(tp, rank, 16, 16, 4, LayoutHND, PackedKV)
		l.Regions = append(l.Regions, l.Regions[0])
		l.Regions[1].Base = 8 << 20
		l.Groups = []Group{{Kind: KindFullAttention, Regions: []int{0, 1}}, {Kind: KindSlidingWindow, Window: 32, Regions: []int{0, 1}}}
		return l
	}
	p := mustPlan(t, pooled(1, 0), pooled(2, 1), PlanOptions{})
	for g, gp := range p.Groups {
		var got [][2]int
		for _, r := range gp.Regions {
			got = append(got, [2]int{r.Src, r.Dst})
			if !slices.Equal(r.Segs, []Segment{{256, 0, 256}}) {
				t.Fatalf("group %d region %d: NewPlan().Segs = %v, want [{256 0 256}] (D rank 1's heads 2-3, 128 bytes each)", g, r.Src, r.Segs)
			}
		}
		if !slices.Equal(got, [][2]int{{0, 0}, {1, 1}}) {
			t.Fatalf("group %d: NewPlan() region pairs = %v, want both pooled regions", g, got)
		}
	}
	if len(p.Groups) != 2 || p.Groups[1].Window != 32 {
		t.Fatalf("NewPlan() = %d groups (window %d), want 2 with the sliding group's window 32", len(p.Groups), p.Groups[1].Window)
	}
}

// TestPlanRepeats checks Repeats on regions placed at equal and unequal
// steps, on two devices, with a region of another shape in the group, and
// MaxDescs.
func TestPlanRepeats(t *testing.T) {
	const mib = 1 << 20
	layout := func(tp, rank int, base uint64) *Layout {
		l := tinyLayout(tp, rank, 16, 16, 4, LayoutHND, PackedKV)
		reg := l.Regions[0]
		l.Regions = nil
		// Steps: 1, 1, 3 (same shape), 1, then a region on device 1
		// (its own shape), 1 to the next on device 1, an MLA region
		// (another shape) and one more attention region back on device 0.
		for i, off := range []uint64{0, 1, 2, 5, 6, 7, 8, 9} {
			r := reg
			r.Base = base + off*mib
			if i == 5 || i == 6 {
				r.DeviceID = 1
			}
			if i == 7 {
				r.Kind, r.BlockLen = KindMLA, 16*24
			}
			l.Regions = append(l.Regions, r)
		}
		l.Regions = append(l.Regions, reg)
		l.Regions[8].Base = base + 10*mib
		l.Groups = []Group{{Kind: KindFullAttention, Regions: []int{0, 1, 2, 3, 4, 5, 6, 7, 8}}}
		return l
	}
	// P TP 1 -> D TP 2: D's regions are half as large, at its own steps.
	p := mustPlan(t, layout(1, 0, 1<<30), layout(2, 1, 1<<32), PlanOptions{})
	type rep struct {
		n      int
		ss, ds uint64
	}
	var got []rep
	for _, rp := range p.Groups[0].Regions {
		n, ss, ds := rp.Repeats()
		got = append(got, rep{n, ss, ds})
	}
	want := []rep{{2, mib, mib}, {1, mib, mib}, {1, 3 * mib, 3 * mib}, {1, mib, mib}, {}, {1, mib, mib}, {}, {}, {}}
	if !slices.Equal(got, want) {
		t.Fatalf("Repeats() = %v, want %v", got, want)
	}
	// Descending bases: the step wraps.
	src, dst := layout(1, 0, 1<<30), layout(2, 1, 1<<32)
	for _, l := range []*Layout{src, dst} {
		slices.Reverse(l.Groups[0].Regions[:3])
	}
	p = mustPlan(t, src, dst, PlanOptions{})
	back := ^uint64(mib - 1) // -1 MiB mod 2^64
	if n, ss, ds := p.Groups[0].Regions[0].Repeats(); n != 2 || ss != back || ds != back {
		t.Fatalf("descending: Repeats() = %d, %#x, %#x, want 2, -1 MiB, -1 MiB", n, ss, ds)
	}
	// Not made by NewPlan: no repeats, and MaxDescs sums region by region.
	byHand := p.Groups[0]
	byHand.Regions = slices.Clone(byHand.Regions)
	byHand.sized = false
	for i := range byHand.Regions {
		byHand.Regions[i] = RegionPlan{Segs: byHand.Regions[i].Segs, Whole: byHand.Regions[i].Whole}
		if n, _, _ := byHand.Regions[i].Repeats(); n != 0 {
			t.Fatalf("a RegionPlan not made by NewPlan reports %d repeats", n)
		}
	}
	// 8 attention pairs with one 128-byte segment (not whole: D holds
	// half the heads) and one whole MLA pair: 8·units + runs.
	if got, loop := p.Groups[0].MaxDescs(3, 7), byHand.MaxDescs(3, 7); got != 8*7+3 || loop != got {
		t.Fatalf("MaxDescs(3, 7) = %d, region by region %d, want %d", got, loop, 8*7+3)
	}
}

func TestPlanErrors(t *testing.T) {
	for _, tc := range []struct {
		name     string
		src, dst *Layout
		opts     PlanOptions
		wantIs   error
		want     []string
	}{
		{"ranks not connected (D_TP > P_TP)", tinyLayout(2, 0, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(4, 3, 16, 16, 8, LayoutHND, PackedKV), PlanOptions{},
			ErrIncompatible, []string{"src TP rank 0 is not connected to dst TP rank 3 (TP 2 -> 4 connects it to [1])"}},
		{"ranks not connected (P_TP > D_TP)", tinyLayout(4, 1, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV), PlanOptions{},
			ErrIncompatible, []string{"src TP rank 1 is not connected to dst TP rank 1", "[2 3]"}},
		{"exact placement past MaxSegments is refused, naming both layouts", tinyLayout(1, 0, 32, 32, 8, LayoutHND, PackedKV), tinyLayout(1, 0, 32, 32, 8, LayoutNHD, PackedKV), PlanOptions{},
			ErrUnsupported, []string{"region 0 needs more than 128 descriptors per 32-token unit (src HND/packed TP 1 block 32 -> dst NHD/packed TP 1 block 32)", "raise PlanOptions.MaxSegments"}},
		{"NHD hetero TP past a small MaxSegments is refused", tinyLayout(1, 0, 16, 16, 4, LayoutNHD, PackedKV), tinyLayout(2, 0, 16, 16, 4, LayoutNHD, PackedKV), PlanOptions{MaxSegments: 8},
			ErrUnsupported, []string{"more than 8 descriptors per 16-token unit"}},
		{"negative MaxSegments", tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), PlanOptions{MaxSegments: -1},
			ErrInvalidLayout, []string{"MaxSegments = -1"}},
		{"incompatible layouts", tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(1, 0, 16, 16, 4, LayoutHND, PackedKV), PlanOptions{},
			ErrIncompatible, []string{"TotalKVHeads: src 8, dst 4"}},
		{"invalid dst layout", tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), withBlockLen(tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), 7), PlanOptions{},
			ErrInvalidLayout, []string{"dst: ", "Regions[0].BlockLen = 7"}},
		{"non-divisible block sizes", tinyLayout(1, 0, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(1, 0, 24, 24, 8, LayoutHND, PackedKV), PlanOptions{},
			ErrIncompatible, []string{"src = 16, dst = 24"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p, err := NewPlan(tc.src, tc.dst, tc.opts)
			wantErr(t, "NewPlan()", err, tc.wantIs, tc.want...)
			if p != nil {
				t.Fatalf("NewPlan() = %+v with an error, want nil", p)
			}
		})
	}
}

// renderPlan prints a plan in a stable text form for golden files.
func renderPlan(p *Plan) string {
	var b strings.Builder
	fmt.Fprintf(&b, "src tp %d pp %d -> dst tp %d notify_only=%v max_unit_segments=%d\n", p.SrcTPRank, p.SrcPPRank, p.DstTPRank, p.NotifyOnly, p.MaxUnitSegments)
	for g, gp := range p.Groups {
		fmt.Fprintf(&b, "group %d %v window=%d unit_tokens=%d ppl=%d/%d units=%d/%d block_tokens=%d/%d limit=%d/%d\n",
			g, gp.Kind, gp.Window, gp.UnitTokens, gp.SrcPPL, gp.DstPPL, gp.SrcUnits, gp.DstUnits,
			gp.SrcBlockTokens, gp.DstBlockTokens, gp.SrcLimit, gp.DstLimit)
		for _, r := range gp.Regions {
			fmt.Fprintf(&b, "  region %d -> %d base %#x/%#x dev %d/%d blocks %d/%d block %d/%d slot_stride %d/%d whole=%v unit_bytes=%d\n",
				r.Src, r.Dst, r.SrcBase, r.DstBase, r.SrcDev, r.DstDev, r.SrcNumBlocks, r.DstNumBlocks,
				r.SrcBlockLen, r.DstBlockLen, r.SrcSlotStride, r.DstSlotStride, r.Whole, r.UnitBytes)
			for _, s := range r.Segs {
				fmt.Fprintf(&b, "    src +%d -> dst +%d len %d\n", s.SrcOff, s.DstOff, s.Len)
			}
		}
	}
	return b.String()
}

func TestPlanGolden(t *testing.T) {
	hybrid := func(tp, rank, bs int, kv KVLayout) *Layout {
		l := validLayout()
		l.TPSize, l.TPRank, l.LogicalBlockSize, l.KernelBlockSize, l.KVLayout = tp, rank, bs, bs, kv
		n := int64(tp)
		l.Regions[0].BlockLen = l.AttentionBlockLen()
		l.Regions[1].BlockLen = l.AttentionBlockLen()
		l.Regions[2].BlockLen = int64(bs) * 24
		l.Regions[3].ConvBytes = []int64{64 / n, 32 / n, 32 / n}
		l.Regions[3].SSMBytes = 128 / n
		return l
	}
	ppSrc, ppDst := ppLayouts(1, 2, 4)
	for _, tc := range []struct {
		name     string
		src, dst *Layout
	}{
		{"equal_tp_hnd_whole", tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV)},
		{"tp2to4_hnd_head_offset", tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(4, 3, 16, 16, 8, LayoutHND, PackedKV)},
		{"tp4to2_hnd_head_slot", tinyLayout(4, 3, 16, 16, 8, LayoutHND, PackedKV), tinyLayout(2, 1, 16, 16, 8, LayoutHND, PackedKV)},
		{"nhd_tp1to2_per_token", tinyLayout(1, 0, 4, 4, 4, LayoutNHD, PackedKV), tinyLayout(2, 1, 4, 4, 4, LayoutNHD, PackedKV)},
		{"bs16to32_hnd_4heads", tinyLayout(1, 0, 16, 16, 4, LayoutHND, PackedKV), tinyLayout(1, 0, 32, 32, 4, LayoutHND, PackedKV)},
		{"gqa_heads2_tp4to1_rank2", tinyLayout(4, 2, 16, 16, 2, LayoutHND, SplitKV), tinyLayout(1, 0, 32, 16, 2, LayoutHND, SplitKV)},
		{"gqa_heads2_tp4to1_rank3_notify_only", tinyLayout(4, 3, 16, 16, 2, LayoutHND, SplitKV), tinyLayout(1, 0, 32, 16, 2, LayoutHND, SplitKV)},
		{"mla_tp4to2_rank2_writes", mlaLayout(4, 2, 16, 16, 24), mlaLayout(2, 1, 64, 64, 24)},
		{"mamba_tp1to2_rank1", mambaShard(1, 0), mambaShard(2, 1)},
		{"hybrid_tp2to4_bs16to32_hnd", hybrid(2, 1, 16, LayoutHND), hybrid(4, 2, 32, LayoutHND)},
		{"hybrid_tp4to2_bs32to16_nhd", hybrid(4, 3, 32, LayoutNHD), hybrid(2, 1, 16, LayoutNHD)},
		{"pp_stage1_of2", ppSrc, ppDst},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got := renderPlan(mustPlan(t, tc.src, tc.dst, PlanOptions{}))
			path := filepath.Join("testdata", "golden", tc.name+".txt")
			if *update {
				if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
					t.Fatal(err)
				}
				if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
					t.Fatal(err)
				}
			}
			want, err := os.ReadFile(path)
			if err != nil {
				t.Fatalf("%v (run with -update to create it)", err)
			}
			if got != string(want) {
				t.Fatalf("renderPlan(NewPlan()) differs from %s (-update rewrites it):\ngot:\n%s\nwant:\n%s", path, got, want)
			}
		})
	}
}
