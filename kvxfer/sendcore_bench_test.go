package kvxfer

import (
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"
)

// BenchmarkProducerRequests: a step of n producer requests (transfer ids
// set) taken in by the core and expired at their lease's end, per
// request: the Worker core's share of a stream round trip.
func BenchmarkProducerRequests(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			now := time.Unix(1000, 0)
			st := newTestCore(b, "P", ModePush, traceLayout(0, 1, 1<<20), now)
			st.w.log = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
			metas := make([]StepMeta, 4)
			for k := range metas {
				for i := range n {
					metas[k].Send = append(metas[k].Send, SendReq{ReqID: fmt.Sprintf("s%d-%d", k, i), TransferID: fmt.Sprintf("t%d-%d", k, i)})
				}
			}
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				st.Step(now, input{kind: inEvent, ev: &event{kind: evStep, meta: &metas[i%len(metas)]}})
				now = now.Add(time.Minute)
				st.Step(now, input{kind: inTimers})
				st.out.Clear()
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/request")
		})
	}
}
