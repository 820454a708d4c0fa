package kvxfer

import (
	"fmt"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// BenchmarkProducerRequests: a step of n producer requests (transfer ids
// set) taken in by the core and expired at their lease's end, per
// request: the Worker core's share of a stream round trip.
func BenchmarkProducerRequests(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			now := time.Unix(1000, 0)
			st := quietCore(b, "P", 1<<20, now)
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

// BenchmarkConsumerRequests: a step of n push consumer requests on a
// rank whose producer is handshaken, each registered, then done by its
// completion notice, per request: the Worker core's share of a
// consumer's step.
func BenchmarkConsumerRequests(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			now := time.Unix(1000, 0)
			st := quietCore(b, "D", 1<<30, now)
			metas := make([]StepMeta, 4)
			dones := make([][]Notif, 4)
			for k := range metas {
				for i := range n {
					id, tid, pid := fmt.Sprintf("d%d-%d", k, i), fmt.Sprintf("t%d-%d", k, i), fmt.Sprintf("p%d-%d", k, i)
					metas[k].Recv = append(metas[k].Recv, RecvReq{ReqID: id, TransferID: tid,
						Local:  []topology.Span{{IDs: []topology.BlockID{topology.BlockID(i % 16)}}},
						Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: pid, TPSize: 1, PPSize: 1, Tokens: 16}})
					m := &msg{Kind: msgDone, Engine: "P", Addr: "P:1", TPSize: 1, PPSize: 1, TransferID: tid, DReq: id, PReq: pid}
					dones[k] = append(dones[k], Notif{From: "P/0", Msg: appendMsg(nil, m)})
				}
			}
			hs := &hsResult{engine: "P", names: []PeerName{"P/0"}, loadErrs: []error{nil}}
			hs.res.Generation = 1
			hs.res.Ranks = []RankInfo{{EngineID: "P", CompatHash: "h", Layout: traceLayout(0, 1, 1<<20), Agent: []byte("P/0")}}
			one := func(k int) {
				st.Step(now, input{kind: inEvent, ev: &event{kind: evStep, meta: &metas[k]}})
				if st.engines["P"].state == hsPending {
					st.Step(now, input{kind: inEvent, ev: &event{kind: evHandshake, hs: hs}})
				}
				st.fx.ops = st.fx.ops[:0]
				st.Step(now, input{kind: inNotifs, notifs: dones[k]})
				if len(st.out.Recving) != n {
					b.Fatalf("%d outcomes, want %d", len(st.out.Recving), n)
				}
				st.out.Clear()
			}
			one(0)
			b.ReportAllocs()
			b.ResetTimer()
			for i := range b.N {
				one(i % len(metas))
			}
			b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*n), "ns/request")
		})
	}
}

// quietCore is a push core logging at Warn, as kvxferd's benchmarks run
// (expiries log at Info).
func quietCore(b *testing.B, engine string, base uint64, now time.Time) *loopState {
	st := newTestCore(b, engine, ModePush, traceLayout(0, 1, base), now)
	st.log = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
	return st
}
