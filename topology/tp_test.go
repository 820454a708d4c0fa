package topology

import (
	"errors"
	"slices"
	"strings"
	"testing"
)

func TestTPRatioSignConvention(t *testing.T) {
	for _, tc := range []struct {
		name          string
		local, remote int
		want          int
		wantErr       string
	}{
		{name: "equal sizes give 1", local: 4, remote: 4, want: 1},
		{name: "local larger is positive local/remote", local: 8, remote: 2, want: 4},
		{name: "remote larger is negative remote/local", local: 2, remote: 8, want: -4},
		{name: "local not a multiple of remote", local: 6, remote: 4, wantErr: "local TP 6 is not a multiple of remote TP 4"},
		{name: "remote not a multiple of local", local: 4, remote: 6, wantErr: "remote TP 6 is not a multiple of local TP 4"},
		{name: "zero size", local: 0, remote: 2, wantErr: "local = 0"},
		{name: "negative size", local: 2, remote: -1, wantErr: "remote = -1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TPRatio(tc.local, tc.remote)
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("TPRatio(%d, %d) = %d, %v, want error containing %q", tc.local, tc.remote, got, err, tc.wantErr)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("TPRatio(%d, %d) = %d, %v, want %d", tc.local, tc.remote, got, err, tc.want)
			}
		})
	}
}

func TestTargetRanks(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		localTP, remoteTP, r int
		want                 []int
	}{
		{name: "pull D TP4 rank 3 reads P TP2 rank 1", localTP: 4, remoteTP: 2, r: 3, want: []int{1}},
		{name: "pull D TP1 reads every P rank of TP4", localTP: 1, remoteTP: 4, r: 0, want: []int{0, 1, 2, 3}},
		{name: "push P TP2 rank 1 writes D TP8 ranks 4-7", localTP: 2, remoteTP: 8, r: 1, want: []int{4, 5, 6, 7}},
		{name: "push P TP8 rank 5 writes D TP4 rank 2", localTP: 8, remoteTP: 4, r: 5, want: []int{2}},
		{name: "equal TP is one to one", localTP: 4, remoteTP: 4, r: 2, want: []int{2}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := TargetRanks(nil, tc.localTP, tc.remoteTP, tc.r)
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("TargetRanks(%d, %d, %d) = %v, %v, want %v", tc.localTP, tc.remoteTP, tc.r, got, err, tc.want)
			}
		})
	}
	if _, err := TargetRanks(nil, 4, 2, 4); err == nil || !strings.Contains(err.Error(), "rank 4, want 0..3") {
		t.Fatalf("TargetRanks(rank out of range) = %v, want an error naming the rank", err)
	}
}

// TestTargetRanksSymmetric: P rank p targets D rank d exactly when D rank d
// targets P rank p, for every size pair.
func TestTargetRanksSymmetric(t *testing.T) {
	sizes := []int{1, 2, 4, 8, 16}
	for _, tp := range sizes {
		for _, td := range sizes {
			for p := 0; p < tp; p++ {
				fwd, _ := TargetRanks(nil, tp, td, p)
				for d := 0; d < td; d++ {
					back, _ := TargetRanks(nil, td, tp, d)
					if slices.Contains(fwd, d) != slices.Contains(back, p) {
						t.Fatalf("P %d/%d -> D %d/%d: forward %v, backward %v", p, tp, d, td, fwd, back)
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
		{name: "one head per rank", heads: 4, tp: 4, rank: 3, wantFirst: 3, wantCount: 1},
		{name: "replicated heads when TP exceeds heads", heads: 2, tp: 8, rank: 5, wantFirst: 1, wantCount: 1},
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
	for _, tc := range []struct {
		name                string
		heads, srcTP, dstTP int
		dstRank             int
		want                []HeadSlice
	}{
		{name: "equal TP: the whole block", heads: 8, srcTP: 2, dstTP: 2, dstRank: 1,
			want: []HeadSlice{{SrcRank: 1, SrcHead: 0, DstHead: 0, Heads: 4}}},
		{name: "D_TP > P_TP: each D rank takes its head slice of one P block", heads: 8, srcTP: 2, dstTP: 4, dstRank: 3,
			want: []HeadSlice{{SrcRank: 1, SrcHead: 2, DstHead: 0, Heads: 2}}},
		{name: "P_TP > D_TP: several sources, one slot each", heads: 8, srcTP: 4, dstTP: 2, dstRank: 1,
			want: []HeadSlice{{SrcRank: 2, SrcHead: 0, DstHead: 0, Heads: 2}, {SrcRank: 3, SrcHead: 0, DstHead: 2, Heads: 2}}},
		{name: "GQA dedup: heads 2, P TP4 -> D TP1, ranks 1 and 3 notify only", heads: 2, srcTP: 4, dstTP: 1, dstRank: 0,
			want: []HeadSlice{{SrcRank: 0, Heads: 1}, {SrcRank: 1}, {SrcRank: 2, DstHead: 1, Heads: 1}, {SrcRank: 3}}},
		{name: "GQA dedup: heads 2, P TP4 -> D TP2", heads: 2, srcTP: 4, dstTP: 2, dstRank: 1,
			want: []HeadSlice{{SrcRank: 2, Heads: 1}, {SrcRank: 3}}},
		{name: "GQA dedup: heads 4, P TP8 -> D TP2", heads: 4, srcTP: 8, dstTP: 2, dstRank: 1,
			want: []HeadSlice{{SrcRank: 4, Heads: 1, DstHead: 0}, {SrcRank: 5}, {SrcRank: 6, DstHead: 1, Heads: 1}, {SrcRank: 7}}},
		{name: "GQA replication on D: heads 2, P TP1 -> D TP4 rank 3 gets head 1", heads: 2, srcTP: 1, dstTP: 4, dstRank: 3,
			want: []HeadSlice{{SrcRank: 0, SrcHead: 1, DstHead: 0, Heads: 1}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := AttentionSlices(nil, tc.heads, tc.srcTP, tc.dstTP, tc.dstRank)
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("AttentionSlices(%d, %d, %d, %d) = %+v, %v, want %+v", tc.heads, tc.srcTP, tc.dstTP, tc.dstRank, got, err, tc.want)
			}
		})
	}
	if _, err := AttentionSlices(nil, 6, 4, 2, 0); !errors.Is(err, ErrInvalidLayout) || !strings.Contains(err.Error(), "TotalKVHeads = 6 and TP 4") {
		t.Fatalf("AttentionSlices(6 heads, TP 4) = %v, want an error naming heads and TP", err)
	}
}

// refAttentionSources is the reference's attention source-rank rule (SPEC
// §4) for a non-MLA model: local T (D), remote R (P), rank t.
func refAttentionSources(k, localT, remoteR, t int) []int {
	if localT >= remoteR {
		return []int{t * remoteR / localT}
	}
	a := remoteR / localT
	var out []int
	seen := map[int]bool{}
	for r := t * a; r < t*a+a; r++ {
		h := r * k / remoteR
		if !seen[h] {
			seen[h] = true
			out = append(out, r)
		}
	}
	return out
}

// TestAttentionSourcesMatchReference sweeps heads and TP sizes: the ranks
// that write (Heads > 0) are the reference's deduplicated source ranks.
func TestAttentionSourcesMatchReference(t *testing.T) {
	sizes := []int{1, 2, 4, 8, 16}
	n := 0
	for _, k := range sizes {
		for _, tp := range sizes {
			for _, td := range sizes {
				for d := 0; d < td; d++ {
					got, err := SourceRanks(nil, KindFullAttention, k, tp, td, d)
					if err != nil {
						t.Fatal(err)
					}
					want := refAttentionSources(k, td, tp, d)
					if !slices.Equal(got, want) {
						t.Fatalf("heads %d P TP %d -> D TP %d rank %d: sources %v, reference %v", k, tp, td, d, got, want)
					}
					n++
				}
			}
		}
	}
	if n == 0 {
		t.Fatal("no cases")
	}
}

func TestSourceRanksPerKind(t *testing.T) {
	for _, tc := range []struct {
		name                       string
		kind                       Kind
		heads, srcTP, dstTP, dRank int
		want                       []int
	}{
		{name: "attention dedups GQA duplicates", kind: KindFullAttention, heads: 2, srcTP: 4, dstTP: 1, want: []int{0, 2}},
		{name: "sliding window follows attention", kind: KindSlidingWindow, heads: 8, srcTP: 4, dstTP: 2, dRank: 1, want: []int{2, 3}},
		{name: "MLA reads exactly one, the first connected rank", kind: KindMLA, srcTP: 4, dstTP: 1, want: []int{0}},
		{name: "MLA with D_TP > P_TP maps each D rank to one P rank", kind: KindMLA, srcTP: 2, dstTP: 8, dRank: 5, want: []int{1}},
		{name: "Mamba (SSM) sources are every connected rank", kind: KindMamba, srcTP: 4, dstTP: 2, dRank: 1, want: []int{2, 3}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := SourceRanks(nil, tc.kind, tc.heads, tc.srcTP, tc.dstTP, tc.dRank)
			if err != nil || !slices.Equal(got, tc.want) {
				t.Fatalf("SourceRanks(%v, ...) = %v, %v, want %v", tc.kind, got, err, tc.want)
			}
		})
	}
}

func TestNotificationCounts(t *testing.T) {
	for _, tc := range []struct {
		name                 string
		srcTP, srcPP, dstTP  int
		wantAtDst, wantAtSrc int
	}{
		{name: "equal TP one notif each way", srcTP: 4, srcPP: 1, dstTP: 4, wantAtDst: 1, wantAtSrc: 1},
		{name: "push D hears every P rank of its group (P_TP > D_TP)", srcTP: 8, srcPP: 1, dstTP: 2, wantAtDst: 4, wantAtSrc: 1},
		{name: "pull P hears every D rank reading it (D_TP > P_TP)", srcTP: 2, srcPP: 1, dstTP: 8, wantAtDst: 1, wantAtSrc: 4},
		{name: "one notif per P pipeline stage", srcTP: 4, srcPP: 2, dstTP: 2, wantAtDst: 4, wantAtSrc: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d, err := NotificationsAtDst(tc.srcTP, tc.srcPP, tc.dstTP)
			if err != nil || d != tc.wantAtDst {
				t.Fatalf("NotificationsAtDst(%d, %d, %d) = %d, %v, want %d", tc.srcTP, tc.srcPP, tc.dstTP, d, err, tc.wantAtDst)
			}
			s, err := NotificationsAtSrc(tc.srcTP, tc.dstTP)
			if err != nil || s != tc.wantAtSrc {
				t.Fatalf("NotificationsAtSrc(%d, %d) = %d, %v, want %d", tc.srcTP, tc.dstTP, s, err, tc.wantAtSrc)
			}
		})
	}
	if _, err := NotificationsAtDst(4, 0, 2); err == nil || !strings.Contains(err.Error(), "PPSize = 0") {
		t.Fatalf("NotificationsAtDst(pp 0) = %v, want an error naming PPSize", err)
	}
}
