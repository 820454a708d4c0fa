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
// rank whose producer is handshaken, each registered (the driver sends
// the registrations and hands their results back), then done by its
// completion notice, per request: the Worker core's share of a
// consumer's step, the consumer's side of BenchmarkProducerMatchedWrites.
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
			var ops []op
			var errs []error
			sent := func(int, *op) error { return nil }
			one := func(k int) {
				st.Step(now, input{kind: inEvent, ev: &event{kind: evStep, meta: &metas[k]}})
				ops, errs = carryOut(st, ops, errs, sent)
				if st.engines["P"].state == hsPending {
					st.Step(now, input{kind: inEvent, ev: &event{kind: evHandshake, hs: hs}})
					ops, errs = carryOut(st, ops, errs, sent)
				}
				st.Step(now, input{kind: inNotifs, notifs: dones[k]})
				ops, errs = carryOut(st, ops, errs, sent)
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

// BenchmarkProducerMatchedWrites: the producer's push path, per request,
// on a rank whose consumer is handshaken: n consumer registrations
// arrive (one notice per input, as the driver hands them over), a step
// of the n requests matches each and posts its WRITE (the driver carries
// the posts out and hands their results back), then each WRITE ends and
// its request reports done. The Worker core's share of a push transfer
// on the producer (BenchmarkProducerRequests: requests that never match).
func BenchmarkProducerMatchedWrites(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			now := time.Unix(1000, 0)
			st := quietCore(b, "P", 1<<20, now)
			// Enough steps that a request's id comes back only once its
			// tombstone aged out (RegistrationTTL, 31 s a step).
			metas := make([]StepMeta, 20)
			regs := make([][]Notif, len(metas))
			for k := range metas {
				for i := range n {
					id, tid, did := fmt.Sprintf("p%d-%d", k, i), fmt.Sprintf("t%d-%d", k, i), fmt.Sprintf("d%d-%d", k, i)
					blocks := []topology.Span{{IDs: []topology.BlockID{topology.BlockID(i % 16)}}}
					metas[k].Send = append(metas[k].Send, SendReq{ReqID: id, TransferID: tid, Blocks: blocks, Tokens: 16})
					m := &msg{Kind: msgReg, Engine: "D", Addr: "D:1", TPSize: 1, PPSize: 1, TransferID: tid, DReq: did, PReq: id, Spans: blocks}
					regs[k] = append(regs[k], Notif{From: "D/0", Msg: appendMsg(nil, m)})
				}
			}
			hs := &hsResult{engine: "D", names: []PeerName{"D/0"}, loadErrs: []error{nil}}
			hs.res.Generation = 1
			hs.res.Ranks = []RankInfo{{EngineID: "D", CompatHash: "h", Layout: traceLayout(0, 1, 1<<30), Agent: []byte("D/0")}}
			var ops []op
			var errs []error
			var posted []XferID
			post := func(_ int, o *op) error {
				if o.kind == opPost || o.kind == opPostLayout {
					posted = append(posted, o.id)
				}
				return nil
			}
			one := func(k int) {
				for i := range regs[k] {
					st.Step(now, input{kind: inNotifs, notifs: regs[k][i : i+1]})
					ops, errs = carryOut(st, ops, errs, post)
					if e := st.engines["D"]; e != nil && e.state == hsPending {
						// The first registration asks who D/0 is.
						st.Step(now, input{kind: inEvent, ev: &event{kind: evHandshake, hs: hs}})
						ops, errs = carryOut(st, ops, errs, post)
						st.fx.asks = st.fx.asks[:0]
					}
				}
				st.Step(now, input{kind: inEvent, ev: &event{kind: evStep, meta: &metas[k]}})
				ops, errs = carryOut(st, ops, errs, post)
				for _, id := range posted {
					st.Step(now, input{kind: inXferEnded, xfer: id, state: XferDone})
					ops, errs = carryOut(st, ops, errs, post)
				}
				if len(posted) != n || len(st.out.Sending) != n {
					b.Fatalf("%d WRITEs, %d outcomes, want %d (dropped: %v)", len(posted), len(st.out.Sending), n, st.metrics.Snapshot().Dropped)
				}
				for _, o := range st.out.Sending {
					if o.Result != ResultDone {
						b.Fatalf("outcome %+v, want done", o)
					}
				}
				posted = posted[:0]
				st.out.Clear()
				// Time passes, as between steps: the stale lease timers
				// fire and the tombstones age out, as in a Worker.
				now = now.Add(st.cfg.Lease + time.Second)
				st.Step(now, input{kind: inTimers})
			}
			one(0)
			b.ReportAllocs()
			i := 1
			for b.Loop() {
				one(i % len(metas))
				i++
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
