package topology

import (
	"fmt"
	"slices"
	"testing"
)

// tpSizes are the TP sizes and head counts the reference sweeps use.
var tpSizes = []int{1, 2, 4, 8, 16}

func TestTPRatio(t *testing.T) {
	for _, tc := range []struct {
		name          string
		local, remote int
		want          int
		wantIs        error
		wantMsg       []string
		reason        string
	}{
		{name: "equal sizes give 1", local: 4, remote: 4, want: 1},
		{name: "pull D TP4 from P TP2: local >= remote is positive local/remote", local: 4, remote: 2, want: 2,
			reason: "positive on the pull D means D_TP >= P_TP"},
		{name: "pull D TP2 from P TP8: local < remote is negative remote/local", local: 2, remote: 8, want: -4},
		{name: "push P TP2 to D TP8: local is P, negative", local: 2, remote: 8, want: -4,
			reason: "for the push P, local is P: P_TP < D_TP gives -(D/P)"},
		{name: "push P TP8 to D TP2: local is P, positive", local: 8, remote: 2, want: 4},
		{name: "one rank against sixteen", local: 1, remote: 16, want: -16},
		{name: "local not a multiple of remote", local: 6, remote: 4, wantIs: ErrIncompatible,
			wantMsg: []string{"local TP 6 is not a multiple of remote TP 4"}},
		{name: "remote not a multiple of local", local: 4, remote: 6, wantIs: ErrIncompatible,
			wantMsg: []string{"remote TP 6 is not a multiple of local TP 4"}},
		{name: "zero local size", local: 0, remote: 2, wantIs: ErrInvalidLayout, wantMsg: []string{"local = 0", "remote = 2"}},
		{name: "negative remote size", local: 2, remote: -1, wantIs: ErrInvalidLayout, wantMsg: []string{"local = 2", "remote = -1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TPRatio(tc.local, tc.remote)
			if tc.wantIs != nil {
				wantErr(t, "TPRatio", err, tc.wantIs, tc.wantMsg...)
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("TPRatio(%d, %d) = %d, %v, want %d (%s)", tc.local, tc.remote, got, err, tc.want, tc.reason)
			}
		})
	}
}

// TestTPRatioAntisymmetric: seen from the other side, the ratio flips sign
// (except 1, which is its own mirror).
func TestTPRatioAntisymmetric(t *testing.T) {
	for _, a := range tpSizes {
		for _, b := range tpSizes {
			ab, err1 := TPRatio(a, b)
			ba, err2 := TPRatio(b, a)
			if err1 != nil || err2 != nil {
				t.Fatalf("TPRatio(%d, %d) = %v, %v", a, b, err1, err2)
			}
			if a == b && (ab != 1 || ba != 1) || a != b && ab != -ba {
				t.Fatalf("TPRatio(%d, %d) = %d, TPRatio(%d, %d) = %d, want opposite signs", a, b, ab, b, a, ba)
			}
		}
	}
}

func TestTargetRanks(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		localTP, remoteTP, r int
		want                 []int
	}{
		{name: "pull D TP4 rank 3 reads P TP2 rank 1", localTP: 4, remoteTP: 2, r: 3, want: []int{1}},
		{name: "pull D TP4 rank 0 reads P TP2 rank 0", localTP: 4, remoteTP: 2, r: 0, want: []int{0}},
		{name: "pull D TP1 reads every P rank of TP4", localTP: 1, remoteTP: 4, r: 0, want: []int{0, 1, 2, 3}},
		{name: "pull D TP2 rank 1 reads P TP8 ranks 4-7", localTP: 2, remoteTP: 8, r: 1, want: []int{4, 5, 6, 7}},
		{name: "push P TP2 rank 1 writes D TP8 ranks 4-7", localTP: 2, remoteTP: 8, r: 1, want: []int{4, 5, 6, 7}},
		{name: "push P TP8 rank 5 writes D TP4 rank 2", localTP: 8, remoteTP: 4, r: 5, want: []int{2}},
		{name: "equal TP is one to one", localTP: 4, remoteTP: 4, r: 2, want: []int{2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TargetRanks(nil, tc.localTP, tc.remoteTP, tc.r)
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("TargetRanks(nil, %d, %d, %d) = %v, %v, want %v", tc.localTP, tc.remoteTP, tc.r, got, err, tc.want)
			}
		})
	}
	t.Run("appends to dst", func(t *testing.T) {
		got, err := TargetRanks([]int{99}, 1, 2, 0)
		if want := []int{99, 0, 1}; err != nil || !slices.Equal(got, want) {
			t.Fatalf("TargetRanks([99], 1, 2, 0) = %v, %v, want %v", got, err, want)
		}
	})
}

func TestTargetRanksErrors(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		localTP, remoteTP, r int
		is                   error
		want                 []string
	}{
		{"rank past the local size", 4, 2, 4, ErrInvalidLayout, []string{"rank 4", "0..3"}},
		{"negative rank", 4, 2, -1, ErrInvalidLayout, []string{"rank -1"}},
		{"non-divisible TP sizes", 4, 6, 0, ErrIncompatible, []string{"remote TP 6", "local TP 4"}},
		{"zero local size", 0, 2, 0, ErrInvalidLayout, []string{"local = 0"}},
		{"negative remote size", 2, -2, 0, ErrInvalidLayout, []string{"remote = -2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TargetRanks([]int{7}, tc.localTP, tc.remoteTP, tc.r)
			wantErr(t, "TargetRanks", err, tc.is, tc.want...)
			if !slices.Equal(got, []int{7}) {
				t.Fatalf("TargetRanks on error returned %v, want dst unchanged [7]", got)
			}
		})
	}
}

// TestTargetRanksSymmetric: P rank p targets D rank d exactly when D rank d
// targets P rank p, for every size pair (the same rule serves pull and
// push).
func TestTargetRanksSymmetric(t *testing.T) {
	for _, tp := range tpSizes {
		for _, td := range tpSizes {
			for p := 0; p < tp; p++ {
				fwd, err := TargetRanks(nil, tp, td, p)
				if err != nil {
					t.Fatal(err)
				}
				for d := 0; d < td; d++ {
					back, err := TargetRanks(nil, td, tp, d)
					if err != nil {
						t.Fatal(err)
					}
					if slices.Contains(fwd, d) != slices.Contains(back, p) {
						t.Fatalf("P %d/%d -> D %d/%d: TargetRanks forward %v, backward %v", p, tp, d, td, fwd, back)
					}
				}
			}
		}
	}
}

func TestHeadRange(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		heads, tp, rank      int
		wantFirst, wantCount int
	}{
		{name: "sharded heads", heads: 8, tp: 4, rank: 2, wantFirst: 4, wantCount: 2},
		{name: "last rank's shard", heads: 8, tp: 2, rank: 1, wantFirst: 4, wantCount: 4},
		{name: "one head per rank", heads: 4, tp: 4, rank: 3, wantFirst: 3, wantCount: 1},
		{name: "replication when TP > heads: rank 5 of 8 holds head 1 of 2", heads: 2, tp: 8, rank: 5, wantFirst: 1, wantCount: 1},
		{name: "replication when TP > heads: rank 3 of 8 holds head 0 of 2", heads: 2, tp: 8, rank: 3, wantFirst: 0, wantCount: 1},
		{name: "single rank holds all", heads: 8, tp: 1, rank: 0, wantFirst: 0, wantCount: 8},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f, n := HeadRange(tc.heads, tc.tp, tc.rank)
			if f != tc.wantFirst || n != tc.wantCount {
				t.Fatalf("HeadRange(%d, %d, %d) = %d, %d, want %d, %d", tc.heads, tc.tp, tc.rank, f, n, tc.wantFirst, tc.wantCount)
			}
		})
	}
}

func TestAttentionSlices(t *testing.T) {
	type hs = HeadSlice
	for _, tc := range []struct {
		name                string
		heads, srcTP, dstTP int
		want                [][]HeadSlice // per D rank
		reason              string
	}{
		{name: "equal TP: one source, the whole block", heads: 8, srcTP: 2, dstTP: 2,
			want: [][]hs{{{0, 0, 0, 4}}, {{1, 0, 0, 4}}}},
		{name: "D_TP > P_TP: each D rank gets a slice of a P block at its offset", heads: 8, srcTP: 2, dstTP: 4,
			want:   [][]hs{{{0, 0, 0, 2}}, {{0, 2, 0, 2}}, {{1, 0, 0, 2}}, {{1, 2, 0, 2}}},
			reason: "SrcHead = rank_offset_factor (t mod 2) · 2 local heads"},
		{name: "P_TP > D_TP: several sources, one slice each", heads: 8, srcTP: 4, dstTP: 2,
			want: [][]hs{{{0, 0, 0, 2}, {1, 0, 2, 2}}, {{2, 0, 0, 2}, {3, 0, 2, 2}}}},
		{name: "GQA dedup K=2, P TP4 -> D TP1: sources 0 and 2 write, 1 and 3 notify only", heads: 2, srcTP: 4, dstTP: 1,
			want:   [][]hs{{{0, 0, 0, 1}, {1, 0, 0, 0}, {2, 0, 1, 1}, {3, 0, 0, 0}}},
			reason: "P ranks 0,1 both hold head 0 and 2,3 head 1; the first holder writes"},
		{name: "GQA dedup K=2, P TP4 -> D TP2", heads: 2, srcTP: 4, dstTP: 2,
			want: [][]hs{{{0, 0, 0, 1}, {1, 0, 0, 0}}, {{2, 0, 0, 1}, {3, 0, 0, 0}}}},
		{name: "GQA dedup K=4, P TP8 -> D TP2", heads: 4, srcTP: 8, dstTP: 2,
			want: [][]hs{
				{{0, 0, 0, 1}, {1, 0, 0, 0}, {2, 0, 1, 1}, {3, 0, 0, 0}},
				{{4, 0, 0, 1}, {5, 0, 0, 0}, {6, 0, 1, 1}, {7, 0, 0, 0}},
			}},
		{name: "GQA, D replicates heads: K=2, P TP1 -> D TP4", heads: 2, srcTP: 1, dstTP: 4,
			want:   [][]hs{{{0, 0, 0, 1}}, {{0, 0, 0, 1}}, {{0, 1, 0, 1}}, {{0, 1, 0, 1}}},
			reason: "D ranks 0,1 hold head 0, ranks 2,3 head 1 (SrcHead 1 of P's 2)"},
		{name: "GQA, both replicate, D_TP > P_TP: K=2, P TP4 -> D TP8", heads: 2, srcTP: 4, dstTP: 8,
			want: [][]hs{{{0, 0, 0, 1}}, {{0, 0, 0, 1}}, {{1, 0, 0, 1}}, {{1, 0, 0, 1}},
				{{2, 0, 0, 1}}, {{2, 0, 0, 1}}, {{3, 0, 0, 1}}, {{3, 0, 0, 1}}}},
		{name: "GQA, both replicate, P_TP > D_TP: K=2, P TP8 -> D TP4", heads: 2, srcTP: 8, dstTP: 4,
			want: [][]hs{{{0, 0, 0, 1}, {1, 0, 0, 0}}, {{2, 0, 0, 1}, {3, 0, 0, 0}},
				{{4, 0, 0, 1}, {5, 0, 0, 0}}, {{6, 0, 0, 1}, {7, 0, 0, 0}}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if len(tc.want) != tc.dstTP {
				t.Fatalf("bad case: %d rows for D TP %d", len(tc.want), tc.dstTP)
			}
			for d := range tc.dstTP {
				got, err := AttentionSlices(nil, tc.heads, tc.srcTP, tc.dstTP, d)
				if err != nil || !slices.Equal(got, tc.want[d]) {
					t.Fatalf("AttentionSlices(nil, %d, %d, %d, %d) = %+v, %v, want %+v (%s)",
						tc.heads, tc.srcTP, tc.dstTP, d, got, err, tc.want[d], tc.reason)
				}
			}
		})
	}
}

func TestAttentionSlicesErrors(t *testing.T) {
	for _, tc := range []struct {
		name                         string
		heads, srcTP, dstTP, dstRank int
		is                           error
		want                         []string
	}{
		{"zero heads", 0, 2, 2, 0, ErrInvalidLayout, []string{"TotalKVHeads = 0"}},
		{"negative heads", -4, 2, 2, 0, ErrInvalidLayout, []string{"TotalKVHeads = -4"}},
		{"heads not divisible by the source TP", 6, 4, 2, 0, ErrInvalidLayout, []string{"TotalKVHeads = 6 and TP 4"}},
		{"heads not divisible by the destination TP", 6, 2, 4, 0, ErrInvalidLayout, []string{"TotalKVHeads = 6 and TP 4"}},
		{"non-divisible TP sizes", 12, 4, 6, 0, ErrIncompatible, []string{"TP 6", "TP 4"}},
		{"destination rank out of range", 8, 2, 4, 4, ErrInvalidLayout, []string{"rank 4"}},
		{"zero source TP", 8, 0, 2, 0, ErrInvalidLayout, []string{"remote = 0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := AttentionSlices(nil, tc.heads, tc.srcTP, tc.dstTP, tc.dstRank)
			wantErr(t, "AttentionSlices", err, tc.is, tc.want...)
		})
	}
}

// refMapping is the reference's compute_tp_mapping (SPEC §4), written from
// the spec for a model with k KV heads: local (D) TP size T, remote (P) TP
// size R, local rank t.
type refMapping struct {
	attn   []int       // attention source ranks (GQA dedup)
	ssm    []int       // SSM source ranks
	slot   map[int]int // rank_to_attention_slot
	offset int         // rank_offset_factor
}

func refTPMapping(k, T, R, t int, mla bool) refMapping {
	m := refMapping{slot: map[int]int{}}
	if mla || T >= R {
		m.attn = []int{t * R / T}
	} else {
		a := R / T
		seen := map[int]bool{}
		for r := t * a; r < t*a+a; r++ {
			if h := r * k / R; !seen[h] {
				seen[h] = true
				m.attn = append(m.attn, r)
			}
		}
	}
	if T < R {
		a := R / T
		for r := t * a; r < (t+1)*a; r++ {
			m.ssm = append(m.ssm, r)
		}
	} else {
		m.ssm = m.attn
	}
	for r := range R {
		for i, s := range m.attn {
			if s*k/R == r*k/R {
				m.slot[r] = i
				break
			}
		}
	}
	switch {
	case mla || T <= R:
		m.offset = 0
	case T > k:
		m.offset = t*k/T - m.attn[0]*k/R
	default:
		m.offset = t % (T / R)
	}
	return m
}

// TestAttentionSlicesMatchReference sweeps K, P TP and D TP over
// {1,2,4,8,16}: the ranks that write (Heads > 0) are the reference's
// deduplicated source ranks, in order; with D_TP > P_TP the source head
// offset is rank_offset_factor local blocks; with P_TP > D_TP each source
// lands in chunk rank_to_attention_slot of D's block, of len/fa_splits.
func TestAttentionSlicesMatchReference(t *testing.T) {
	n := 0
	for _, k := range tpSizes {
		for _, R := range tpSizes { // P
			for _, T := range tpSizes { // D
				for d := range T {
					ref := refTPMapping(k, T, R, d, false)
					got, err := AttentionSlices(nil, k, R, T, d)
					if err != nil {
						t.Fatalf("AttentionSlices(nil, %d, %d, %d, %d) = %v", k, R, T, d, err)
					}
					peers, _ := TargetRanks(nil, T, R, d)
					var ranks, writers []int
					for _, s := range got {
						ranks = append(ranks, s.SrcRank)
						if s.Heads > 0 {
							writers = append(writers, s.SrcRank)
						}
					}
					where := func() string { return fmt.Sprintf("K=%d P TP %d -> D TP %d rank %d", k, R, T, d) }
					if !slices.Equal(ranks, peers) {
						t.Fatalf("%s: slices for ranks %v, want one per connected rank %v", where(), ranks, peers)
					}
					if !slices.Equal(writers, ref.attn) {
						t.Fatalf("%s: writing ranks %v, reference attention sources %v", where(), writers, ref.attn)
					}
					lhD := max(1, k/T)
					switch {
					case T > R:
						s := got[0]
						if s.SrcHead != ref.offset*lhD || s.DstHead != 0 || s.Heads != lhD {
							t.Fatalf("%s: %+v, want SrcHead rank_offset_factor %d · %d local heads, all %d heads", where(), s, ref.offset, lhD, lhD)
						}
					case T < R:
						chunk := lhD / len(ref.attn)
						for _, s := range got {
							if s.Heads == 0 {
								continue
							}
							if s.SrcHead != 0 || s.Heads != chunk || s.DstHead != ref.slot[s.SrcRank]*chunk {
								t.Fatalf("%s: %+v, want chunk %d at slot %d", where(), s, chunk, ref.slot[s.SrcRank])
							}
						}
					default:
						if s := got[0]; len(got) != 1 || s.SrcHead != 0 || s.DstHead != 0 || s.Heads != lhD {
							t.Fatalf("%s: %+v, want the whole block", where(), got)
						}
					}
					n++
				}
			}
		}
	}
	if n != 5*5*31 {
		t.Fatalf("swept %d cases, want %d", n, 5*5*31)
	}
}

func TestSourceRanksPerKind(t *testing.T) {
	for _, tc := range []struct {
		name                       string
		kind                       Kind
		heads, srcTP, dstTP, dRank int
		want                       []int
		reason                     string
	}{
		{name: "attention dedups GQA duplicates", kind: KindFullAttention, heads: 2, srcTP: 4, dstTP: 1, want: []int{0, 2}},
		{name: "attention with distinct heads reads every connected rank", kind: KindFullAttention, heads: 8, srcTP: 4, dstTP: 2, dRank: 1, want: []int{2, 3}},
		{name: "attention with D_TP > P_TP reads one rank", kind: KindFullAttention, heads: 8, srcTP: 2, dstTP: 8, dRank: 5, want: []int{1}},
		{name: "sliding window follows attention", kind: KindSlidingWindow, heads: 4, srcTP: 8, dstTP: 2, dRank: 1, want: []int{4, 6}},
		{name: "MLA reads exactly one, the first connected rank", kind: KindMLA, srcTP: 4, dstTP: 1, want: []int{0}},
		{name: "MLA with P_TP > D_TP: first of D rank 1's group", kind: KindMLA, srcTP: 8, dstTP: 2, dRank: 1, want: []int{4}},
		{name: "MLA with D_TP > P_TP maps each D rank to its one P rank", kind: KindMLA, srcTP: 2, dstTP: 8, dRank: 5, want: []int{1}},
		{name: "Mamba: every connected rank is an SSM source", kind: KindMamba, srcTP: 4, dstTP: 2, dRank: 1, want: []int{2, 3},
			reason: "each P rank holds a distinct shard; GQA dedup does not apply"},
		{name: "Mamba with D_TP > P_TP reads the one rank", kind: KindMamba, srcTP: 1, dstTP: 4, dRank: 3, want: []int{0}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SourceRanks(nil, tc.kind, tc.heads, tc.srcTP, tc.dstTP, tc.dRank)
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("SourceRanks(nil, %v, %d, %d, %d, %d) = %v, %v, want %v (%s)",
					tc.kind, tc.heads, tc.srcTP, tc.dstTP, tc.dRank, got, err, tc.want, tc.reason)
			}
		})
	}
}

func TestSourceRanksErrors(t *testing.T) {
	for _, tc := range []struct {
		name                       string
		kind                       Kind
		heads, srcTP, dstTP, dRank int
		is                         error
		want                       []string
	}{
		{"unknown kind", Kind(9), 8, 2, 2, 0, ErrInvalidLayout, []string{"kind Kind(9)"}},
		{"attention with heads not dividing TP", KindFullAttention, 3, 2, 2, 0, ErrInvalidLayout, []string{"TotalKVHeads = 3"}},
		{"MLA with non-divisible TP", KindMLA, 0, 4, 6, 0, ErrIncompatible, []string{"TP 6", "TP 4"}},
		{"Mamba with a rank out of range", KindMamba, 0, 2, 2, 2, ErrInvalidLayout, []string{"rank 2"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := SourceRanks(nil, tc.kind, tc.heads, tc.srcTP, tc.dstTP, tc.dRank)
			wantErr(t, "SourceRanks", err, tc.is, tc.want...)
		})
	}
}

// TestSourceRanksMatchReference sweeps every kind against the reference's
// source_ranks_per_group: the SSM list for Mamba groups, the attention
// list (MLA: [t·R/T]) for the others.
func TestSourceRanksMatchReference(t *testing.T) {
	for _, k := range tpSizes {
		for _, R := range tpSizes {
			for _, T := range tpSizes {
				for d := range T {
					for _, kind := range []Kind{KindFullAttention, KindSlidingWindow, KindMLA, KindMamba} {
						ref := refTPMapping(k, T, R, d, kind == KindMLA)
						want := ref.attn
						if kind == KindMamba {
							want = ref.ssm
						}
						got, err := SourceRanks(nil, kind, k, R, T, d)
						if err != nil || !slices.Equal(got, want) {
							t.Fatalf("SourceRanks(nil, %v, %d, %d, %d, %d) = %v, %v, reference %v", kind, k, R, T, d, got, err, want)
						}
					}
				}
			}
		}
	}
}

func TestNotificationsAtDst(t *testing.T) {
	for _, tc := range []struct {
		name                string
		srcTP, srcPP, dstTP int
		want                int
		reason              string
	}{
		{name: "equal TP: one notif", srcTP: 4, srcPP: 1, dstTP: 4, want: 1},
		{name: "push D hears every P rank of its group (P_TP > D_TP)", srcTP: 8, srcPP: 1, dstTP: 2, want: 4},
		{name: "D_TP > P_TP: one P rank per D rank", srcTP: 2, srcPP: 1, dstTP: 8, want: 1},
		{name: "pp 2, P TP4, D TP2: pp·max(1, P_tp/D_tp) = 4", srcTP: 4, srcPP: 2, dstTP: 2, want: 4,
			reason: "SPEC §4 push D; §12 item 36"},
		{name: "pp 2 with equal TP: one per stage", srcTP: 2, srcPP: 2, dstTP: 2, want: 2},
		{name: "pp 3, D_TP > P_TP", srcTP: 1, srcPP: 3, dstTP: 4, want: 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := NotificationsAtDst(tc.srcTP, tc.srcPP, tc.dstTP)
			if err != nil || got != tc.want {
				t.Fatalf("NotificationsAtDst(%d, %d, %d) = %d, %v, want %d (%s)", tc.srcTP, tc.srcPP, tc.dstTP, got, err, tc.want, tc.reason)
			}
		})
	}
	for _, tc := range []struct {
		name                string
		srcTP, srcPP, dstTP int
		is                  error
		want                []string
	}{
		{"zero PP size", 4, 0, 2, ErrInvalidLayout, []string{"PPSize = 0"}},
		{"negative PP size", 4, -1, 2, ErrInvalidLayout, []string{"PPSize = -1"}},
		{"non-divisible TP", 4, 1, 6, ErrIncompatible, []string{"TP 6", "TP 4"}},
		{"zero TP", 0, 1, 2, ErrInvalidLayout, []string{"local = 0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := NotificationsAtDst(tc.srcTP, tc.srcPP, tc.dstTP)
			wantErr(t, "NotificationsAtDst", err, tc.is, tc.want...)
		})
	}
}

func TestNotificationsAtSrc(t *testing.T) {
	for _, tc := range []struct {
		name         string
		srcTP, dstTP int
		want         int
		reason       string
	}{
		{name: "equal TP: one consumer", srcTP: 4, dstTP: 4, want: 1},
		{name: "pull P TP2, D TP8: four consumers per producer", srcTP: 2, dstTP: 8, want: 4,
			reason: "-tp_ratio(8) from P's side = 8/2"},
		{name: "pull P TP8, D TP2: one consumer", srcTP: 8, dstTP: 2, want: 1},
		{name: "pull P TP1, D TP16", srcTP: 1, dstTP: 16, want: 16},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := NotificationsAtSrc(tc.srcTP, tc.dstTP)
			if err != nil || got != tc.want {
				t.Fatalf("NotificationsAtSrc(%d, %d) = %d, %v, want %d (%s)", tc.srcTP, tc.dstTP, got, err, tc.want, tc.reason)
			}
		})
	}
	t.Run("non-divisible TP", func(t *testing.T) {
		_, err := NotificationsAtSrc(6, 4)
		wantErr(t, "NotificationsAtSrc(6, 4)", err, ErrIncompatible, "TP 6", "TP 4")
	})
}

// TestNotificationsMatchConnections: with one stage, a D rank hears from
// exactly its connected P ranks and a P rank from exactly the D ranks
// connected to it.
func TestNotificationsMatchConnections(t *testing.T) {
	for _, tp := range tpSizes {
		for _, td := range tpSizes {
			atDst, err := NotificationsAtDst(tp, 1, td)
			if err != nil {
				t.Fatal(err)
			}
			atSrc, err := NotificationsAtSrc(tp, td)
			if err != nil {
				t.Fatal(err)
			}
			for d := range td {
				if peers, _ := TargetRanks(nil, td, tp, d); len(peers) != atDst {
					t.Fatalf("P TP %d -> D TP %d: NotificationsAtDst = %d, D rank %d has %d connected P ranks", tp, td, atDst, d, len(peers))
				}
			}
			for p := range tp {
				if peers, _ := TargetRanks(nil, tp, td, p); len(peers) != atSrc {
					t.Fatalf("P TP %d -> D TP %d: NotificationsAtSrc = %d, P rank %d has %d connected D ranks", tp, td, atSrc, p, len(peers))
				}
			}
		}
	}
}
