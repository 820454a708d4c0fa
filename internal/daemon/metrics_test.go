package daemon

import (
	"bufio"
	"bytes"
	"context"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/lograte"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// scrapeAll returns the value of every series at addr's /metrics whose
// line starts with prefix (name and labels, as exposed), by line.
func scrapeAll(t *testing.T, addr string) string {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("/metrics: %s: %s", resp.Status, body)
	}
	return string(body)
}

// value is the value of series (name and labels, exactly as exposed) in
// body, and whether it is there.
func value(body, series string) (float64, bool) {
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(series) + ` (\S+)$`).FindStringSubmatch(body)
	if m == nil {
		return 0, false
	}
	v, _ := strconv.ParseFloat(m[1], 64)
	return v, true
}

// A rank's counters (outcomes, failures, bad input, transfers) survive
// its detach: the outcomes its worker reports as it closes (the requests
// it held fail, worker_closed) are the ones an operator most needs, and
// before they were never exported: the collector read attached ranks
// only, and a rank is unpublished before its worker closes, so every
// counter of the rank vanished with it (what it had counted too, which
// Prometheus then read as a counter reset). A rank attached again under
// the same engine id and ranks carries on counting from there.
func TestDetachedRankCountersKept(t *testing.T) {
	c := testConfig(t)
	c.metricsListen = freePort(t)
	in := startTest(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	const (
		aborted = `kvxfer_outcomes_total{engine="E1",pp_rank="0",result="aborted",side="producer",tp_rank="0"}`
		failed  = `kvxfer_outcomes_total{engine="E1",pp_rank="0",result="failed",side="producer",tp_rank="0"}`
		closed  = `kvxfer_failures_total{engine="E1",kind="worker_closed",pp_rank="0",side="producer",tp_rank="0"}`
		dup     = `kvxfer_bad_input_total{engine="E1",field="send_req.duplicate",pp_rank="0",tp_rank="0"}`
	)
	for round := 1; round <= 2; round++ {
		rs, closeRank, err := connectTinyRank(t, ctx, c.socket, c.shmDir, "E1")
		if err != nil {
			t.Fatal(err)
		}
		now := time.Now()
		send := func(id string) kvxfer.SendReq {
			return kvxfer.SendReq{ReqID: id, Deadline: now.Add(time.Hour), Blocks: []topology.Span{{IDs: []topology.BlockID{0}}}, Tokens: 16}
		}
		// p1 aborted by its engine; p2 held (no consumer comes), then
		// failed by the close; a duplicate SendReq of p2 refused.
		if err := rs.Step(&kvxfer.StepMeta{Step: 1, SchedulerClock: now, Send: []kvxfer.SendReq{send("p1"), send("p2")}}); err != nil {
			t.Fatal(err)
		}
		if err := rs.Step(&kvxfer.StepMeta{Step: 2, SchedulerClock: now, Send: []kvxfer.SendReq{send("p2")}, NotProcessed: []string{"p1"}}); err != nil {
			t.Fatal(err)
		}
		got := map[string]kvxfer.Outcome{}
		for got["p1"].ReqID == "" {
			select {
			case f := <-rs.Finished():
				for _, o := range f.Sending {
					got[o.ReqID] = o
				}
			case <-ctx.Done():
				t.Fatal("no outcome for p1")
			}
		}
		body := scrapeAll(t, c.metricsListen)
		if v, _ := value(body, aborted); v != float64(round) {
			t.Errorf("round %d, attached: %s = %v, want %d", round, aborted, v, round)
		}
		go func() { _ = rs.Close(ctx) }()
		for f := range rs.Finished() {
			for _, o := range f.Sending {
				got[o.ReqID] = o
			}
		}
		closeRank()
		_ = os.Remove(filepath.Join(c.shmDir, "kv")) // connectTinyRank's file, made again next round
		if o := got["p2"]; o.Result != kvxfer.ResultFailed || o.Kind != kvxfer.FailureClosed {
			t.Errorf("round %d: p2's outcome = %+v, want failed, worker_closed", round, o)
		}
		for deadline := time.Now().Add(10 * time.Second); in.srv.Workers()["E1"] != nil; time.Sleep(5 * time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatal("E1 not detached after 10 s")
			}
		}
		body = scrapeAll(t, c.metricsListen)
		for _, s := range []string{aborted, failed, closed, dup} {
			if v, ok := value(body, s); v != float64(round) {
				t.Errorf("round %d, detached: %s = %v (exposed: %v), want %d", round, s, v, ok, round)
			}
		}
	}
}

// A rank's stream reports the TransferStats of its own worker only: with
// a rank's counters carried over its detach (RankStats), a rank attached
// again must not hand its engine what the earlier worker counted (the
// vLLM connector adds every stream's stats up: they would count twice).
func TestReattachedRankStatsNotRepeated(t *testing.T) {
	c := testConfig(t)
	c.metricsListen = freePort(t)
	startTest(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cc, hello := oneRankEngine(t, c)
	for round := 1; round <= 2; round++ {
		sctx, scancel := context.WithCancel(ctx)
		st, err := pb.NewWorkerServiceClient(cc).Connect(sctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := st.Send(hello); err != nil {
			t.Fatal(err)
		}
		if m, err := st.Recv(); err != nil || m.GetReady() == nil {
			t.Fatalf("round %d: hello answered %v, %v", round, m, err)
		}
		// x's lease ends at once: expired, counted.
		now := time.Now()
		var enc stream.StepEncoder
		meta := &kvxfer.StepMeta{Step: 1, SchedulerClock: now, Send: []kvxfer.SendReq{{ReqID: "x", Deadline: now.Add(50 * time.Millisecond),
			Blocks: []topology.Span{{IDs: []topology.BlockID{0}}}, Tokens: 16}}}
		if err := st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: enc.Encode(meta)}}); err != nil {
			t.Fatal(err)
		}
		var expired uint64
		for done := false; !done; {
			m, err := st.Recv()
			if err != nil {
				t.Fatalf("round %d: %v", round, err)
			}
			f := m.GetFinished()
			if f == nil {
				continue
			}
			expired += f.GetStats().GetExpired()
			for _, o := range f.Sending {
				done = done || o.RequestId == "x"
			}
		}
		if err := st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Bye{Bye: &pb.Bye{}}}); err != nil {
			t.Fatal(err)
		}
		_ = st.CloseSend()
		for {
			m, err := st.Recv()
			if err != nil {
				break
			}
			expired += m.GetFinished().GetStats().GetExpired()
		}
		scancel()
		if expired != 1 {
			t.Errorf("round %d: the stream's TransferStats say %d expired, want 1 (this stream's)", round, expired)
		}
		body := scrapeAll(t, c.metricsListen)
		if v, _ := value(body, `kvxfer_num_kv_expired_reqs_total{engine="E1",pp_rank="0",tp_rank="0"}`); v != float64(round) {
			t.Errorf("round %d: kvxfer_num_kv_expired_reqs_total = %v, want %d (the rank's, over its attaches)", round, v, round)
		}
	}
}

// The metrics endpoint bounds the connections it holds, as the peer
// listener does: before, any client that could reach it held as many
// as it opened, each kept alive for ever after one scrape (no idle
// timeout), and scraped as many at once (each scrape builds the whole
// metric set in memory). A connection past the bound is closed at once,
// counted (kvxfer_refused_total{reason="metrics_conns_per_addr"}); one
// closed makes room again.
func TestMetricsConnectionsBounded(t *testing.T) {
	c := testConfig(t)
	c.metricsListen = freePort(t)
	startTest(t, c)
	get := func(conn net.Conn) error {
		_ = conn.SetDeadline(time.Now().Add(10 * time.Second))
		if _, err := io.WriteString(conn, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"); err != nil {
			return err
		}
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			return err
		}
		defer resp.Body.Close()
		if _, err := io.Copy(io.Discard, resp.Body); err != nil {
			return err
		}
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("%s", resp.Status)
		}
		return nil
	}
	var held []net.Conn
	defer func() {
		for _, conn := range held {
			conn.Close()
		}
	}()
	for i := 0; i < metricsConnsPerAddr+4; i++ {
		conn, err := net.Dial("tcp", c.metricsListen)
		if err != nil {
			t.Fatal(err)
		}
		held = append(held, conn)
		err = get(conn) // kept alive after
		if i < metricsConnsPerAddr && err != nil {
			t.Fatalf("scrape %d: %v", i, err)
		}
		if i >= metricsConnsPerAddr && err == nil {
			t.Fatalf("connection %d from one address served while %d are held open (bound %d)", i+1, i, metricsConnsPerAddr)
		}
	}
	held[0].Close()
	held = held[1:]
	var v float64
	refusedMore := 0 // tries refused before the server saw the close
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		// Room is made once the server saw the close.
		body := ""
		if resp, err := http.Get("http://" + c.metricsListen + "/metrics"); err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			body = string(b)
		} else {
			refusedMore++
		}
		var ok bool
		if v, ok = value(body, `kvxfer_refused_total{reason="metrics_conns_per_addr"}`); ok {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("no room made by closing a connection")
		}
	}
	if v != float64(4+refusedMore) {
		t.Errorf(`kvxfer_refused_total{reason="metrics_conns_per_addr"} = %v, want %d`, v, 4+refusedMore)
	}
	http.DefaultClient.CloseIdleConnections()
}

// oneRankEngine is a client of c's engine socket and the hello of engine
// E1's one rank (push, one 1 KiB memory file it creates), both closed
// with the test.
func oneRankEngine(t *testing.T, c *config) (*grpc.ClientConn, *pb.ConnectRequest) {
	t.Helper()
	cc, err := grpc.NewClient("unix://"+c.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	mp, err := shm.Create(c.shmDir, "kv", 1024)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { mp.Close() })
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	return cc, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: &pb.WorkerHello{EngineId: "E1", Mode: pb.Mode_MODE_PUSH, Layout: stream.LayoutToProto(&l),
		CompatHash: "m", MaxMessageBytes: stream.DefaultMaxMessage, Memory: []*pb.SharedMemory{{Path: filepath.Join(c.shmDir, "kv"), Base: 1 << 20, Size: 1024}}}}}
}

// syncBuffer is a log destination safe for concurrent writers.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// Whoever reaches the peer port cannot flood the daemon's log: every
// connection that failed authentication was logged, one line each, with
// no bound (an unauthenticated client looping connect-and-close wrote
// lines as fast as it connected), and to the process's default logger,
// not the daemon's (in the in-process placement, the engine's). Each is
// still counted (kvxfer_peer_auth_failures_total); the log says the first
// few of a kind in a while, then how many it left out.
func TestPeerConnectionFloodLogBounded(t *testing.T) {
	var buf syncBuffer
	log := slog.New(slog.NewTextHandler(&buf, nil))
	old := slog.Default()
	slog.SetDefault(log)
	defer slog.SetDefault(old)
	c := testConfig(t)
	c.metricsListen = freePort(t)
	in, err := start(c, log, false)
	if err != nil {
		t.Fatal(err)
	}
	defer in.shutdown()
	const n = 200
	for range n {
		conn, err := net.Dial("tcp", in.advertise)
		if err != nil {
			t.Fatal(err)
		}
		_, _ = conn.Write([]byte("not the exchange"))
		// Refused: the daemon closes it (one at a time, well within the
		// peer listener's bound of connections per address).
		_ = conn.SetReadDeadline(time.Now().Add(10 * time.Second))
		_, _ = io.Copy(io.Discard, conn)
		conn.Close()
	}
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		if v := scrape(t, c.metricsListen, "kvxfer_peer_auth_failures_total"); v == n {
			break
		} else if time.Now().After(deadline) {
			t.Fatalf("kvxfer_peer_auth_failures_total = %v, want %d", v, n)
		}
	}
	http.DefaultClient.CloseIdleConnections()
	if got := strings.Count(buf.String(), "refused a Peer service connection"); got == 0 || got > 2*lograte.Burst {
		t.Errorf("%d connections refused: %d log lines say so, want between 1 and %d", n, got, 2*lograte.Burst)
	}
}

// Every refusal of an engine's or a peer's input is counted: before, a
// step the rank dropped whole (a step_ref naming no published step), a message that ended the rank's stream (empty, or a
// second hello) and a Peer service handshake naming no engine were
// refused, the caller told, and counted nowhere.
func TestStreamAndPeerRefusalsCounted(t *testing.T) {
	c := testConfig(t)
	c.metricsListen = freePort(t)
	c.insecurePeers = true
	in := startTest(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	refused := func(reason string) float64 {
		v, _ := value(scrapeAll(t, c.metricsListen), `kvxfer_refused_total{reason="`+reason+`"}`)
		return v
	}
	// A handshake naming no engine.
	pc, err := grpc.NewClient(in.advertise, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer pc.Close()
	if _, err := pb.NewPeerServiceClient(pc).Handshake(ctx, &pb.HandshakeRequest{}); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("handshake naming no engine: %v, want InvalidArgument", err)
	}
	if v := refused("bad_handshake"); v != 1 {
		t.Errorf(`kvxfer_refused_total{reason="bad_handshake"} = %v, want 1`, v)
	}

	cc, hello := oneRankEngine(t, c)
	open := func() pb.WorkerService_ConnectClient {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
			st, err := pb.NewWorkerServiceClient(cc).Connect(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := st.Send(hello); err != nil {
				t.Fatal(err)
			}
			m, err := st.Recv()
			if err == nil && m.GetReady() != nil {
				return st
			}
			if status.Code(err) != codes.AlreadyExists || time.Now().After(deadline) { // the last stream's rank still let go
				t.Fatalf("hello answered %v, %v", m, err)
			}
		}
	}
	stepError := func(st pb.WorkerService_ConnectClient) *pb.StepError {
		t.Helper()
		for {
			m, err := st.Recv()
			if err != nil {
				t.Fatalf("no step error: %v", err)
			}
			if e := m.GetStepError(); e != nil {
				return e
			}
		}
	}
	st := open()
	// A step_ref naming a step no scheduler published: dropped whole.
	if err := st.Send(&pb.ConnectRequest{Msg: &pb.ConnectRequest_StepRef{StepRef: &pb.StepRef{Step: 7, RecvRequestIds: []string{"d"}}}}); err != nil {
		t.Fatal(err)
	}
	if e := stepError(st); !e.Dropped {
		t.Errorf("a step_ref naming no published step: %+v, want dropped", e)
	}
	if v := refused("bad_step"); v != 1 {
		t.Errorf(`kvxfer_refused_total{reason="bad_step"} = %v, want 1`, v)
	}
	// An empty message, and a second hello: each ends the stream.
	for i, m := range []*pb.ConnectRequest{{}, hello} {
		if i > 0 {
			st = open()
		}
		if err := st.Send(m); err != nil {
			t.Fatal(err)
		}
		for {
			if _, err := st.Recv(); err != nil {
				if status.Code(err) != codes.InvalidArgument {
					t.Errorf("message %d: the stream ended with %v, want InvalidArgument", i, err)
				}
				break
			}
		}
	}
	if v := refused("bad_message"); v != 2 {
		t.Errorf(`kvxfer_refused_total{reason="bad_message"} = %v, want 2`, v)
	}
}
