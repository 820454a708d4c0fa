package server_test

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// roundTripStep is a producer step of n requests whose leases ended
// already: kvxferd answers each with an expired outcome at once, so a
// step's round trip (step in, its n outcomes out) is the stream's and the
// daemon's own work, no transfer.
func roundTripStep(iter, n int) *kvxfer.StepMeta {
	m := &kvxfer.StepMeta{Step: uint64(iter + 1), SchedulerClock: time.Now()}
	past := time.Now().Add(-time.Second)
	for i := range n {
		m.Send = append(m.Send, kvxfer.SendReq{ReqID: fmt.Sprintf("s%d-%d", iter, i), TransferID: fmt.Sprintf("t%d-%d", iter, i),
			Deadline: past, Blocks: []topology.Span{{IDs: []topology.BlockID{topology.BlockID(i % 8), topology.BlockID(i%8 + 8)}}}, Tokens: 32})
	}
	return m
}

// bareWorker answers every step on a WorkerService stream with a
// prebuilt Finished: the same kvxfer.v1 messages over gRPC, nothing else.
type bareWorker struct {
	pb.UnimplementedWorkerServiceServer
	reply *pb.ConnectResponse
}

func (b *bareWorker) Connect(st grpc.BidiStreamingServer[pb.ConnectRequest, pb.ConnectResponse]) error {
	for {
		m, err := st.Recv()
		if err != nil {
			if err == io.EOF {
				return nil
			}
			return err
		}
		if _, ok := m.Msg.(*pb.ConnectRequest_Step); ok {
			if err := st.Send(b.reply); err != nil {
				return err
			}
		}
	}
}

// BenchmarkStreamRoundTrip: a step of n requests in through the Go
// client, the n outcomes back (kvxfer: RankStream.Step to kvxferd's
// server and its Worker, Finished back through the client's conversion),
// against a bare gRPC stream over the same kind of socket carrying the
// same messages prebuilt (bare). Reports p50 and p99 per round trip.
func BenchmarkStreamRoundTrip(b *testing.B) {
	for _, n := range []int{16, 256} {
		b.Run(fmt.Sprintf("kvxfer/%d", n), func(b *testing.B) { roundTripKvxfer(b, n) })
		b.Run(fmt.Sprintf("bare/%d", n), func(b *testing.B) { roundTripBare(b, n) })
	}
}

func reportLatencies(b *testing.B, lat []time.Duration) {
	slices.Sort(lat)
	q := func(p float64) float64 {
		return float64(lat[min(len(lat)-1, int(p*float64(len(lat))))].Nanoseconds()) / 1e3
	}
	b.ReportMetric(q(0.5), "p50-µs")
	b.ReportMetric(q(0.99), "p99-µs")
}

func roundTripKvxfer(b *testing.B, n int) { timeRoundTrips(b, kvxferRoundTrip(b, n)) }

func roundTripBare(b *testing.B, n int) { timeRoundTrips(b, bareRoundTrip(b, n)) }

// timeRoundTrips times b.N round trips after one to warm up, and reports
// their p50 and p99.
func timeRoundTrips(b *testing.B, one func()) {
	b.ReportAllocs()
	one()
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		start := time.Now()
		one()
		lat = append(lat, time.Since(start))
	}
	b.StopTimer()
	reportLatencies(b, lat)
}

// kvxferRoundTrip attaches a producer rank to an in-process kvxferd and
// returns a round trip on its stream: a step of n requests whose leases
// ended in, their n outcomes out.
func kvxferRoundTrip(tb testing.TB, n int) func() {
	dir := tb.TempDir()
	// Each outcome here is an expiry, which kvxferd logs at Info; done
	// outcomes, the usual ones, log nothing. Warn level keeps the log out
	// of what is measured.
	d := startDaemonWith(tb, dir, func(c *server.Config) {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	m := kvsim.SmallModel(2, topology.KindFullAttention)
	e := attach(tb, d, dir, "P", &m, kvsim.SmallEngine(1, 1, 16, 16, topology.LayoutHND, topology.PackedKV), kvxfer.ModePush)
	rs := e.streams[0][0]
	// A few steps, sent in turn: every request ends before its step comes
	// round again, and the live heap stays as small as the bare side's
	// (one step per round trip built ahead would be a heap the collector
	// marks, which the bare side does not have).
	steps := make([]*kvxfer.StepMeta, 4)
	for i := range steps {
		steps[i] = roundTripStep(i, n)
	}
	timeout := time.NewTimer(time.Hour)
	i := 0
	return func() {
		if err := rs.Step(steps[i%len(steps)]); err != nil {
			tb.Fatal(err)
		}
		i++
		timeout.Reset(10 * time.Second)
		for got := 0; got < n; {
			select {
			case f, ok := <-rs.Finished():
				if !ok {
					tb.Fatal("stream ended")
				}
				for _, o := range f.Sending {
					if o.Result != kvxfer.ResultExpired {
						tb.Fatalf("outcome %+v, want expired", o)
					}
				}
				got += len(f.Sending)
			case <-timeout.C:
				tb.Fatalf("%d of %d outcomes after 10 s", got, n)
			}
		}
	}
}

// bareRoundTrip serves a bare WorkerService on a unix socket and returns
// a round trip on a stream to it: the step prebuilt in, the Finished
// kvxferd would answer (prebuilt) out.
func bareRoundTrip(tb testing.TB, n int) func() {
	sock := filepath.Join(tb.TempDir(), "bare.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		tb.Fatal(err)
	}
	// The reply: what kvxferd sends for such a step (n expired outcomes,
	// their reason as the producer gives it, and the stats).
	var f kvxfer.Finished
	for i := range n {
		f.Sending = append(f.Sending, kvxfer.Outcome{ReqID: fmt.Sprintf("s0-%d", i), Result: kvxfer.ResultExpired,
			Reason: "producer lease expired", Kind: kvxfer.FailureExpired})
	}
	fp := stream.FinishedToProto(&f)
	fp.Stats = &pb.TransferStats{Expired: uint64(n)}
	g := grpc.NewServer()
	pb.RegisterWorkerServiceServer(g, &bareWorker{reply: &pb.ConnectResponse{Msg: &pb.ConnectResponse_Finished{Finished: fp}}})
	go func() { _ = g.Serve(ln) }()
	tb.Cleanup(g.Stop)
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cc.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	tb.Cleanup(cancel)
	st, err := pb.NewWorkerServiceClient(cc).Connect(ctx)
	if err != nil {
		tb.Fatal(err)
	}
	req := &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: stream.StepToProto(roundTripStep(0, n))}}
	return func() {
		if err := st.Send(req); err != nil {
			tb.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			tb.Fatal(err)
		}
	}
}

// A round trip on kvxfer's stream allocates, per request, nothing more
// than the bare stream carrying the same messages: conversions and
// encoding on both sides (the client's step, the daemon's step and
// finished sets, the client's finished sets) allocate per message, not
// per request, and the Worker reuses its records of requests.
func TestStreamRoundTripAllocsPerRequest(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under -race")
	}
	allocs := func(one func()) float64 {
		one()
		return testing.AllocsPerRun(50, one)
	}
	k16, k256 := allocs(kvxferRoundTrip(t, 16)), allocs(kvxferRoundTrip(t, 256))
	b16, b256 := allocs(bareRoundTrip(t, 16)), allocs(bareRoundTrip(t, 256))
	extra := ((k256 - k16) - (b256 - b16)) / 240
	t.Logf("allocations per round trip: kvxfer %v at 16 requests, %v at 256; bare %v and %v: %.2f more per request", k16, k256, b16, b256, extra)
	if extra > 0.1 {
		t.Errorf("kvxfer's stream allocates %.2f times per request more than the bare stream, want 0", extra)
	}
}
