package kvxfer

import (
	"fmt"
	"slices"
	"testing"

	"github.com/kvxfer/kvxfer/topology"
)

// A pull producer rank ends a request at the last completion notice of
// the consumer ranks that read from it, whatever the TP sizes (2:1, 1:2,
// 2:2: the trace core's model has two KV heads; TestByteSweep's pull cases
// run TP 1..8 each side end to end), and for every producer rank: a
// consumer rank that reads from another producer rank is refused
// (done.tp_rank) and never counted, and none is waited for that does not
// read from it (it would hold its blocks until its lease). MLA, GQA
// duplicates and pipelined producers use the same ranks: a consumer rank
// that moves no bytes from this rank (notify-only) still sends it its
// notice, and each pipeline stage is told by the same consumer ranks.
func TestPullNoticeReadersByMapping(t *testing.T) {
	for _, c := range []struct{ p, d int }{{1, 1}, {2, 1}, {1, 2}, {2, 2}} {
		for pr := range c.p {
			t.Run(fmt.Sprintf("P%d-D%d/rank%d", c.p, c.d, pr), func(t *testing.T) {
				readers, err := topology.TargetRanks(nil, c.p, c.d, pr)
				if err != nil {
					t.Fatal(err)
				}
				tc := &traceCore{now: traceEpoch, fail: map[opKind]int{}}
				tc.run(t, fmt.Sprintf("core mode=pull engine=P tp=%d/%d", pr, c.p))
				tc.run(t, "step send=p-1 tid=t1 blocks=1,2 tokens=32 deadline=30s")
				// The first reader's notice asks for D's handshake, which
				// admits it.
				first := tc.run(t, fmt.Sprintf("notif from=D/%d kind=done tid=t1 dreq=d-1 preq=p-1 tp=%d", readers[0], c.d))
				if first != "handshake D at D:1" {
					t.Fatalf("first notice: %q, want D's handshake asked for", first)
				}
				got := tc.run(t, fmt.Sprintf("handshake D tp=%d", c.d))
				if want := map[bool]string{true: "outcome send p-1 done", false: "(nothing)"}[len(readers) == 1]; got != want {
					t.Errorf("after consumer rank %d's notice (readers %v): %q, want %q", readers[0], readers, got, want)
				}
				refused := 0
				for dr := range c.d {
					if slices.Contains(readers, dr) {
						continue
					}
					refused++
					if got := tc.run(t, fmt.Sprintf("notif from=D/%d kind=done tid=t1 dreq=d-1 preq=p-1 tp=%d", dr, c.d)); got != "(nothing)" {
						t.Errorf("notice of consumer rank %d (reads from %v, not %d): %q, want refused", dr, readers, pr, got)
					}
				}
				for i, dr := range readers {
					if i == 0 {
						continue
					}
					got := tc.run(t, fmt.Sprintf("notif from=D/%d kind=done tid=t1 dreq=d-1 preq=p-1 tp=%d", dr, c.d))
					want := "(nothing)"
					if i == len(readers)-1 {
						want = "outcome send p-1 done"
					}
					if got != want {
						t.Errorf("after consumer rank %d's notice (readers %v): %q, want %q", dr, readers, got, want)
					}
				}
				if got := tc.st.metrics.Snapshot().BadInput["done.tp_rank"]; got != uint64(refused) {
					t.Errorf(`bad_input{field="done.tp_rank"} = %d, want %d`, got, refused)
				}
			})
		}
	}
}
