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

func roundTripKvxfer(b *testing.B, n int) {
	dir := b.TempDir()
	// Each outcome here is an expiry, which kvxferd logs at Info; done
	// outcomes, the usual ones, log nothing. Warn level keeps the log out
	// of what is measured.
	d := startDaemonWith(b, dir, func(c *server.Config) {
		c.Logger = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
	})
	m := kvsim.SmallModel(2, topology.KindFullAttention)
	e := attach(b, d, dir, "P", &m, kvsim.SmallEngine(1, 1, 16, 16, topology.LayoutHND, topology.PackedKV), kvxfer.ModePush)
	rs := e.streams[0][0]
	steps := make([]*kvxfer.StepMeta, b.N+1)
	for i := range steps {
		steps[i] = roundTripStep(i, n)
	}
	lat := make([]time.Duration, 0, b.N)
	one := func(i int) time.Duration {
		start := time.Now()
		if err := rs.Step(steps[i]); err != nil {
			b.Fatal(err)
		}
		for got := 0; got < n; {
			select {
			case f, ok := <-rs.Finished():
				if !ok {
					b.Fatal("stream ended")
				}
				for _, o := range f.Sending {
					if o.Result != kvxfer.ResultExpired {
						b.Fatalf("outcome %+v, want expired", o)
					}
				}
				got += len(f.Sending)
			case <-time.After(10 * time.Second):
				b.Fatalf("%d of %d outcomes after 10 s", got, n)
			}
		}
		return time.Since(start)
	}
	one(b.N) // warm up
	b.ResetTimer()
	for i := range b.N {
		lat = append(lat, one(i))
	}
	b.StopTimer()
	reportLatencies(b, lat)
}

func roundTripBare(b *testing.B, n int) {
	sock := filepath.Join(b.TempDir(), "bare.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		b.Fatal(err)
	}
	// The reply: what kvxferd sends for such a step (n expired outcomes
	// and the stats).
	var f kvxfer.Finished
	for i := range n {
		f.Sending = append(f.Sending, kvxfer.Outcome{ReqID: fmt.Sprintf("s0-%d", i), Result: kvxfer.ResultExpired,
			Reason: "lease expired before D registered", Kind: kvxfer.FailureExpired})
	}
	fp := stream.FinishedToProto(&f)
	fp.Stats = &pb.TransferStats{}
	g := grpc.NewServer()
	pb.RegisterWorkerServiceServer(g, &bareWorker{reply: &pb.ConnectResponse{Msg: &pb.ConnectResponse_Finished{Finished: fp}}})
	go func() { _ = g.Serve(ln) }()
	defer g.Stop()
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		b.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := pb.NewWorkerServiceClient(cc).Connect(ctx)
	if err != nil {
		b.Fatal(err)
	}
	req := &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: stream.StepToProto(roundTripStep(0, n))}}
	one := func() time.Duration {
		start := time.Now()
		if err := st.Send(req); err != nil {
			b.Fatal(err)
		}
		if _, err := st.Recv(); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	one()
	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for range b.N {
		lat = append(lat, one())
	}
	b.StopTimer()
	reportLatencies(b, lat)
}
