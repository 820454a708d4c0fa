// Command streambench times a step's round trip on a worker rank's
// stream against a bare gRPC stream carrying the same kvxfer.v1 messages
// (issue 16, item 4: at 256 requests a step, kvxfer at most 1.5x the bare
// stream at p50 and 2x at p99).
//
// kvxfer's side: an in-process kvxferd (internal/daemon/server, the
// built-in backend) serves its engine socket, a unix socket; a producer
// rank attaches through the Go client (stream.Client, its KV cache a
// shared-memory file) and each round trip is one RankStream.Step of n
// producer requests whose leases ended already, until its n outcomes
// (expired, at once: no transfer) came back on Finished. The daemon logs
// at Warn (expiries log at Info; done outcomes, the usual ones, log
// nothing). The bare side: a gRPC WorkerService over a unix socket of
// its own whose server answers each step with the Finished kvxferd sends
// for it, prebuilt; its client sends the step prebuilt.
//
// Both run in one process, interleaved: each round runs every size on
// both sides, the side that goes first alternating by round. The table
// gives each side's p50 and p99 over every round trip of every round, and
// kvxfer's ratio to the bare stream.
//
// Usage:
//
//	go run ./bench/streambench              # -quick: 16 and 256 requests, 7 rounds of 300 round trips
//	go run ./bench/streambench -full        # 21 rounds of 1,000
//	go run ./bench/streambench -sizes 256 -rounds 3 -iters 2000 -only kvxfer -cpuprofile /tmp/sb.pprof
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"runtime"
	"runtime/pprof"
	"slices"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

func main() {
	if err := run(os.Args[1:], os.Stdout); err != nil {
		fmt.Fprintln(os.Stderr, "streambench:", err)
		os.Exit(1)
	}
}

// config is what the flags select.
type config struct {
	sizes         []int
	rounds, iters int
	cpuprofile    string
	only          string // one side alone ("kvxfer" or "bare"), for profiles
}

func parse(args []string) (config, error) {
	fs := flag.NewFlagSet("streambench", flag.ContinueOnError)
	quick := fs.Bool("quick", false, "7 rounds of 300 round trips per size and side (the default)")
	full := fs.Bool("full", false, "21 rounds of 1,000 round trips per size and side")
	sizes := fs.String("sizes", "16,256", "requests per step, comma-separated")
	rounds := fs.Int("rounds", 0, "rounds (0: as -quick or -full says)")
	iters := fs.Int("iters", 0, "round trips per size, side and round (0: as -quick or -full says)")
	cpuprofile := fs.String("cpuprofile", "", "write a CPU profile of the whole run here")
	only := fs.String("only", "", "run one side alone, kvxfer or bare (for a profile; no ratios)")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if *quick && *full {
		return config{}, errors.New("-quick and -full: pick one")
	}
	if *only != "" && *only != "kvxfer" && *only != "bare" {
		return config{}, fmt.Errorf("-only %q: want kvxfer or bare", *only)
	}
	c := config{rounds: 7, iters: 300, cpuprofile: *cpuprofile, only: *only}
	if *full {
		c.rounds, c.iters = 21, 1000
	}
	if *rounds > 0 {
		c.rounds = *rounds
	}
	if *iters > 0 {
		c.iters = *iters
	}
	for s := range strings.SplitSeq(*sizes, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return config{}, fmt.Errorf("-sizes: %q is not a number of requests", s)
		}
		c.sizes = append(c.sizes, n)
	}
	return c, nil
}

func run(args []string, stdout io.Writer) error {
	c, err := parse(args)
	if err != nil {
		return err
	}
	dir, err := os.MkdirTemp("", "streambench")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	d, err := startDaemon(dir)
	if err != nil {
		return err
	}
	defer d.close()
	type side struct {
		name string
		rt   map[int]*roundTrip
	}
	sides := []side{{name: "kvxfer", rt: map[int]*roundTrip{}}, {name: "bare", rt: map[int]*roundTrip{}}}
	for _, n := range c.sizes {
		k, err := d.rank(fmt.Sprintf("P%d", n), n)
		if err != nil {
			return err
		}
		defer k.close()
		b, err := bare(dir, n)
		if err != nil {
			return err
		}
		defer b.close()
		sides[0].rt[n], sides[1].rt[n] = k, b
	}
	if c.cpuprofile != "" {
		f, err := os.Create(c.cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	lat := map[string][]time.Duration{} // by side and size
	key := func(s string, n int) string { return fmt.Sprintf("%s/%d", s, n) }
	fmt.Fprintf(stdout, "streambench: %d rounds of %d round trips per size and side, sizes %v, %d CPUs\n", c.rounds, c.iters, c.sizes, runtime.GOMAXPROCS(0))
	for r := range c.rounds {
		for _, n := range c.sizes {
			order := sides
			if r%2 == 1 {
				order = []side{sides[1], sides[0]}
			}
			for _, s := range order {
				if c.only != "" && s.name != c.only {
					continue
				}
				rt := s.rt[n]
				if err := rt.one(); err != nil { // warm
					return fmt.Errorf("%s, %d requests: %w", s.name, n, err)
				}
				for range c.iters {
					start := time.Now()
					if err := rt.one(); err != nil {
						return fmt.Errorf("%s, %d requests: %w", s.name, n, err)
					}
					lat[key(s.name, n)] = append(lat[key(s.name, n)], time.Since(start))
				}
			}
		}
	}
	if c.only != "" {
		for _, n := range c.sizes {
			l := lat[key(c.only, n)]
			fmt.Fprintf(stdout, "%s, %d requests: p50 %s, p99 %s\n", c.only, n, us(quantile(l, 0.5)), us(quantile(l, 0.99)))
		}
		return nil
	}
	tw := tabwriter.NewWriter(stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "requests\tp50 kvxfer\tp50 bare\tp50 ratio\tp99 kvxfer\tp99 bare\tp99 ratio\tgoal\t")
	for _, n := range c.sizes {
		k, b := lat[key("kvxfer", n)], lat[key("bare", n)]
		k50, b50, k99, b99 := quantile(k, 0.5), quantile(b, 0.5), quantile(k, 0.99), quantile(b, 0.99)
		r50, r99 := float64(k50)/float64(b50), float64(k99)/float64(b99)
		goal := "(none)"
		if n == 256 {
			goal = fmt.Sprintf("p50 <= 1.5x %s, p99 <= 2x %s", met(r50 <= 1.5), met(r99 <= 2))
		}
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.2fx\t%s\t%s\t%.2fx\t%s\t\n", n, us(k50), us(b50), r50, us(k99), us(b99), r99, goal)
	}
	return tw.Flush()
}

func met(ok bool) string {
	if ok {
		return "met"
	}
	return "MISSED"
}

func us(d time.Duration) string { return fmt.Sprintf("%.1f µs", float64(d.Nanoseconds())/1e3) }

// quantile returns the q-quantile of lat (sorting it).
func quantile(lat []time.Duration, q float64) time.Duration {
	slices.Sort(lat)
	return lat[min(len(lat)-1, int(q*float64(len(lat))))]
}

// roundTrip is one side's stream at one size: one sends a step and waits
// for its outcomes.
type roundTrip struct {
	one   func() error
	close func()
}

// daemon is kvxferd in process: a Server on a unix socket.
type daemon struct {
	dir  string
	srv  *server.Server
	g    *grpc.Server
	sock string
}

func startDaemon(dir string) (*daemon, error) {
	sock := filepath.Join(dir, "kvxferd.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelWarn}))
	srv, err := server.New(server.Config{PeerAddr: "127.0.0.1:1", ShmDir: dir, Logger: quiet,
		NewBackend: func(string, *topology.Layout, bool) (server.Backend, error) {
			b, err := tcp.New(tcp.Config{Logger: quiet, Conns: 1, DisableLocal: true})
			if err != nil {
				return nil, err // not b: a nil *tcp.Backend would be a non-nil server.Backend
			}
			return b, nil
		}})
	if err != nil {
		ln.Close()
		return nil, err
	}
	g := grpc.NewServer(grpc.Creds(server.EngineCredentials()))
	srv.RegisterEngine(g)
	go func() { _ = g.Serve(ln) }()
	return &daemon{dir: dir, srv: srv, g: g, sock: sock}, nil
}

func (d *daemon) close() {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_ = d.srv.Drain(ctx)
	d.g.Stop()
	_ = d.srv.Close()
}

// rank attaches a producer rank of engine id (a small kvsim model, its
// cache in a shared-memory file) and returns round trips of n requests on
// its stream.
func (d *daemon) rank(id string, n int) (*roundTrip, error) {
	m := kvsim.SmallModel(2, topology.KindFullAttention)
	e := kvsim.SmallEngine(1, 1, 16, 16, topology.LayoutHND, topology.PackedKV)
	ranks, err := kvsim.Build(&m, &e)
	if err != nil {
		return nil, err
	}
	r := ranks[0][0]
	mp, err := shm.Create(d.dir, id, uint64(len(r.Mem)))
	if err != nil {
		return nil, err
	}
	copy(mp.Bytes, r.Mem)
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		mp.Close()
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: r.Layout, CompatHash: "m",
		Memory: []stream.Memory{{Path: filepath.Join(d.dir, id), Base: r.Base, Size: uint64(len(r.Mem))}}})
	if err != nil {
		c.Close()
		mp.Close()
		return nil, err
	}
	// A few steps sent in turn: each request ends before its step comes
	// round again.
	steps := make([]*kvxfer.StepMeta, 4)
	for i := range steps {
		steps[i] = expiredStep(i, n)
	}
	timeout := time.NewTimer(time.Hour)
	i := 0
	one := func() error {
		if err := rs.Step(steps[i%len(steps)]); err != nil {
			return err
		}
		i++
		timeout.Reset(10 * time.Second)
		for got := 0; got < n; {
			select {
			case f, ok := <-rs.Finished():
				if !ok {
					return fmt.Errorf("stream ended: %w", rs.Err())
				}
				for _, o := range f.Sending {
					if o.Result != kvxfer.ResultExpired {
						return fmt.Errorf("outcome %+v, want expired", o)
					}
				}
				got += len(f.Sending)
			case <-timeout.C:
				return fmt.Errorf("%d of %d outcomes after 10 s", got, n)
			}
		}
		return nil
	}
	return &roundTrip{one: one, close: func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		go func() {
			for range rs.Finished() {
			}
		}()
		_ = rs.Close(ctx)
		c.Close()
		mp.Close()
	}}, nil
}

// expiredStep is a producer step of n requests whose leases ended a
// second before its scheduler clock: kvxferd answers each with an expired
// outcome at once.
func expiredStep(iter, n int) *kvxfer.StepMeta {
	now := time.Now()
	m := &kvxfer.StepMeta{Step: uint64(iter + 1), SchedulerClock: now}
	for i := range n {
		m.Send = append(m.Send, kvxfer.SendReq{ReqID: fmt.Sprintf("s%d-%d", iter, i), TransferID: fmt.Sprintf("t%d-%d", iter, i),
			Deadline: now.Add(-time.Second), Blocks: []topology.Span{{IDs: []topology.BlockID{topology.BlockID(i % 8), topology.BlockID(i%8 + 8)}}}, Tokens: 32})
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
			if errors.Is(err, io.EOF) {
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

// bare serves a bare WorkerService on a unix socket of its own and
// returns round trips of n requests on a stream to it.
func bare(dir string, n int) (*roundTrip, error) {
	sock := filepath.Join(dir, fmt.Sprintf("bare-%d.sock", n))
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return nil, err
	}
	// What kvxferd sends for such a step: n expired outcomes, the stats.
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
	cc, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(stream.DefaultMaxMessage)))
	if err != nil {
		g.Stop()
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	st, err := pb.NewWorkerServiceClient(cc).Connect(ctx)
	if err != nil {
		cancel()
		cc.Close()
		g.Stop()
		return nil, err
	}
	req := &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: stream.StepToProto(expiredStep(0, n))}}
	one := func() error {
		if err := st.Send(req); err != nil {
			return err
		}
		_, err := st.Recv()
		return err
	}
	return &roundTrip{one: one, close: func() {
		cancel()
		cc.Close()
		g.Stop()
	}}, nil
}
