package daemon

import (
	"context"
	"errors"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/internal/peerauth"
	"github.com/kvxfer/kvxfer/internal/testport"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	"github.com/kvxfer/kvxfer/topology"
)

// connectTinyRank attaches one rank of a one-layer push engine named
// engine to the daemon at socket, its four blocks in a memory file of
// shmDir: the stream (or Connect's error) and what to close after (once,
// however often it is called).
func connectTinyRank(t *testing.T, ctx context.Context, socket, shmDir, engine string) (*stream.RankStream, func(), error) {
	t.Helper()
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 20, BlockLen: 256, NumBlocks: 4}}}
	mp, err := shm.Create(shmDir, "kv", 1024)
	if err != nil {
		t.Fatal(err)
	}
	client, err := stream.Dial("unix://" + socket)
	if err != nil {
		mp.Close()
		t.Fatal(err)
	}
	rs, err := client.Connect(ctx, stream.Hello{EngineID: engine, Mode: kvxfer.ModePush, Layout: l, CompatHash: "m",
		Memory: []stream.Memory{{Path: filepath.Join(shmDir, "kv"), Base: 1 << 20, Size: 1024}}})
	var once sync.Once
	return rs, func() { once.Do(func() { _ = client.Close(); _ = mp.Close() }) }, err
}

// freePort is a loopback port below the ephemeral range (testport): one
// picked by listening on :0 may become another connection's source port
// before the daemon binds it.
func freePort(t *testing.T) string { return testport.Free(t) }

// The daemon serves engines on a 0600 unix socket, reports health,
// exports metrics, and shuts down gracefully on its context (SIGTERM),
// leaving no goroutine behind.
func TestServe(t *testing.T) {
	before := runtime.NumGoroutine()
	dir := t.TempDir()
	c := &config{socket: filepath.Join(dir, "k.sock"), peerListen: "127.0.0.1:0", dataHost: "127.0.0.1", conns: 2,
		metricsListen: freePort(t), shmDir: dir, readyFile: filepath.Join(dir, "ready"), drainTimeout: 5 * time.Second, lease: 30 * time.Second}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- serve(ctx, c, slog.New(slog.NewTextHandler(io.Discard, nil))) }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(c.readyFile); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("not ready after 10 s")
		}
	}
	st, err := os.Stat(c.socket)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("socket mode = %v, %v; want 0600", st.Mode().Perm(), err)
	}
	cc, err := grpc.NewClient("unix://"+c.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	hctx, hcancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer hcancel()
	h, err := healthpb.NewHealthClient(cc).Check(hctx, &healthpb.HealthCheckRequest{})
	if err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health = %v, %v; want SERVING", h, err)
	}
	// Attach a rank and see it in /metrics.
	rs, closeRank, err := connectTinyRank(t, hctx, c.socket, dir, "E1")
	defer closeRank()
	if err != nil {
		t.Fatal(err)
	}
	resp, err := http.Get("http://" + c.metricsListen + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	for _, want := range []string{`kvxfer_outcomes_total{engine="E1",pp_rank="0",result="done",side="producer",tp_rank="0"} 0`,
		`kvxfer_failures_total{engine="E1",kind="peer_gone",pp_rank="0",side="consumer",tp_rank="0"} 0`,
		"kvxfer_xfer_time_seconds_bucket", "kvxfer_num_failed_transfers_total", "kvxfer_num_kv_expired_reqs_total",
		"kvxfer_worker_panics_total 0", "kvxfer_gpu_copy_fallback_total 0", "kvxfer_gpu_gate_check_failures_total 0",
		"kvxfer_nixl_released_in_flight_total 0", "kvxfer_nixl_connections_remade_total 0"} {
		if !strings.Contains(string(body), want) {
			t.Errorf("/metrics lacks %q", want)
		}
	}
	// SIGTERM: the attached stream is drained and ended, serve returns.
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("serve = %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop in 20 s")
	}
	select {
	case _, ok := <-rs.Finished():
		for ok {
			_, ok = <-rs.Finished()
		}
	case <-time.After(10 * time.Second):
		t.Error("the rank's stream did not end on shutdown")
	}
	if _, err := os.Stat(c.socket); !os.IsNotExist(err) {
		t.Errorf("socket left behind: %v", err)
	}
	closeRank() // before the leak check (the deferred call then closes nothing more)
	_ = cc.Close()
	http.DefaultClient.CloseIdleConnections()
	leakcheck.Check(t, before, 0, 10*time.Second)
}

func TestFlagsFromEnvironment(t *testing.T) {
	t.Setenv("KVXFERD_CONNS", "7")
	t.Setenv("KVXFERD_SOCKET", "/tmp/x.sock")
	c, err := parseFlags([]string{"-socket", "/tmp/y.sock"})
	if err != nil {
		t.Fatal(err)
	}
	if c.conns != 7 || c.socket != "/tmp/y.sock" {
		t.Errorf("conns %d socket %s; want 7 from the environment and the flag's socket", c.conns, c.socket)
	}
	t.Setenv("KVXFERD_CONNS", "x")
	if _, err := parseFlags(nil); err == nil || !strings.Contains(err.Error(), "KVXFERD_CONNS") {
		t.Errorf("bad env error = %v, want one naming KVXFERD_CONNS", err)
	}
	t.Setenv("KVXFERD_CONNS", "2")
	if _, err := parseFlags([]string{"-conns", "0"}); err == nil {
		t.Error("-conns 0 accepted")
	}
	c, err = parseFlags([]string{"-preconnect", "E1=h:1, E2=h:2"})
	if p, _ := c.peers(); err != nil || len(p) != 2 || p[1] != (kvxfer.PeerRef{EngineID: "E2", Addr: "h:2"}) {
		t.Errorf("-preconnect parsed to %v, %v", p, err)
	}
	if _, err := parseFlags([]string{"-preconnect", "E1"}); err == nil || !strings.Contains(err.Error(), "engine=host:port") {
		t.Errorf("bad -preconnect error = %v", err)
	}
}

// -nixl-progress-delay: 100 µs by default, 0 asks for a spinning progress
// thread (nixl.Config's negative), out-of-range values are refused.
func TestNixlProgressDelayFlag(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want time.Duration
	}{{nil, 100 * time.Microsecond}, {[]string{"-nixl-progress-delay", "0"}, -1}, {[]string{"-nixl-progress-delay", "2ms"}, 2 * time.Millisecond}} {
		c, err := parseFlags(tc.args)
		if err != nil || c.progressDelay() != tc.want {
			t.Errorf("%q: progress delay %v, %v; want %v", tc.args, c.progressDelay(), err, tc.want)
		}
	}
	for _, bad := range []string{"-1us", "2s"} {
		if _, err := parseFlags([]string{"-nixl-progress-delay", bad}); err == nil || !strings.Contains(err.Error(), "-nixl-progress-delay") {
			t.Errorf("-nixl-progress-delay %s: %v, want an error naming the flag", bad, err)
		}
	}
}

// -nixl-poll-interval: NIXL's default (50 µs), what is asked for within
// 10 µs to 100 ms, nothing else.
func TestNixlPollIntervalFlag(t *testing.T) {
	if c, err := parseFlags(nil); err != nil || c.nixlPoll != nixl.DefaultPollInterval {
		t.Errorf("default poll interval %v, %v; want %v", c.nixlPoll, err, nixl.DefaultPollInterval)
	}
	if c, err := parseFlags([]string{"-nixl-poll-interval", "200us"}); err != nil || c.nixlPoll != 200*time.Microsecond {
		t.Errorf("-nixl-poll-interval 200us: %v, %v", c.nixlPoll, err)
	}
	for _, bad := range []string{"0", "5us", "1s"} {
		if _, err := parseFlags([]string{"-nixl-poll-interval", bad}); err == nil || !strings.Contains(err.Error(), "-nixl-poll-interval = ") {
			t.Errorf("-nixl-poll-interval %s: %v, want an error naming the flag and value", bad, err)
		}
	}
}

// -rank-port-base: off by default, a port or refused naming the flag.
func TestRankPortBaseFlag(t *testing.T) {
	if c, err := parseFlags(nil); err != nil || c.rankPortBase != 0 {
		t.Fatalf("default -rank-port-base %d, %v; want 0", c.rankPortBase, err)
	}
	if c, err := parseFlags([]string{"-rank-port-base", "7600"}); err != nil || c.rankPortBase != 7600 {
		t.Errorf("-rank-port-base 7600: %d, %v", c.rankPortBase, err)
	}
	for _, bad := range []string{"-1", "65536"} {
		if _, err := parseFlags([]string{"-rank-port-base", bad}); err == nil || !strings.Contains(err.Error(), "-rank-port-base") {
			t.Errorf("-rank-port-base %s: %v, want an error naming the flag", bad, err)
		}
	}
}

// -max-segments and -max-requests (KVXFERD_MAX_SEGMENTS,
// KVXFERD_MAX_REQUESTS): their packages' defaults, read from the
// environment, overridden by the flag, positive only.
func TestPositiveIntFlags(t *testing.T) {
	for _, tc := range []struct {
		flag, env string
		def       int
		get       func(*config) int
	}{
		{"-max-segments", "KVXFERD_MAX_SEGMENTS", topology.DefaultMaxSegments, func(c *config) int { return c.maxSegments }},
		{"-max-requests", "KVXFERD_MAX_REQUESTS", kvxfer.DefaultMaxRequests, func(c *config) int { return c.maxRequests }},
		{"-max-engine-conns", "KVXFERD_MAX_ENGINE_CONNS", 4096, func(c *config) int { return c.maxEngineConns }},
		{"-max-engine-conns-per-uid", "KVXFERD_MAX_ENGINE_CONNS_PER_UID", 1024, func(c *config) int { return c.maxEngineConnsPerUID }},
	} {
		t.Run(tc.flag, func(t *testing.T) {
			c, err := parseFlags(nil)
			if err != nil || tc.get(c) != tc.def {
				t.Fatalf("default %s = %d, %v; want %d", tc.flag, tc.get(c), err, tc.def)
			}
			t.Setenv(tc.env, "512")
			if c, err := parseFlags(nil); err != nil || tc.get(c) != 512 {
				t.Errorf("%s=512: %s = %d, %v; want 512", tc.env, tc.flag, tc.get(c), err)
			}
			if c, err := parseFlags([]string{tc.flag, "1024"}); err != nil || tc.get(c) != 1024 {
				t.Errorf("%s 1024 over the environment's 512 = %d, %v; want 1024", tc.flag, tc.get(c), err)
			}
			for _, bad := range []string{"0", "-3"} {
				if _, err := parseFlags([]string{tc.flag, bad}); err == nil || !strings.Contains(err.Error(), tc.flag) {
					t.Errorf("%s %s: %v, want an error naming the flag", tc.flag, bad, err)
				}
			}
		})
	}
}

// A backend that does not open is an error and no backend, for NIXL and
// the built-in backend alike: the server Closes the backend it holds, and
// a nil *nixl.Backend in a non-nil server.Backend crashed kvxferd there.
func TestBackendFactoryOpenFails(t *testing.T) {
	errOpen := errors.New("injected: the agent did not open")
	defer func(f func(nixl.Config) (*nixl.Backend, error)) { openNixl = f }(openNixl)
	openNixl = func(nixl.Config) (*nixl.Backend, error) { return nil, errOpen }
	tests := []struct {
		name string
		c    *config
		want string
	}{
		{"nixl", &config{backend: "nixl"}, "-backend=nixl: agent E-pp0-tp1-"},
		{"builtin", &config{backend: "builtin", dataHost: "256.0.0.1", conns: 1}, "built-in backend: "},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			newBackend := tc.c.backendFactory(peerauth.Insecure(), peerSecurity{}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil, nil)
			be, err := newBackend("E", &topology.Layout{TPRank: 1}, false)
			if be != nil || err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("NewBackend with a backend that does not open = %#v, %v; want a nil server.Backend and an error containing %q", be, err, tc.want)
			}
		})
	}
}

// -data-port-base: the built-in backend of rank (pp, tp) listens at the
// base + pp*tp_size + tp, so a firewall can name the data ports.
func TestDataPortBase(t *testing.T) {
	var base int
	for try := 0; ; try++ {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		base = l.Addr().(*net.TCPAddr).Port
		l.Close()
		if base+3 <= 65535 || try > 20 {
			break
		}
	}
	c := &config{backend: "builtin", dataHost: "127.0.0.1", conns: 1, dataPortBase: base}
	newBackend := c.backendFactory(peerauth.Insecure(), peerSecurity{}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil, nil)
	be, err := newBackend("E", &topology.Layout{TPRank: 1, TPSize: 2, PPRank: 1, PPSize: 2}, false)
	if err != nil {
		t.Skipf("port %d taken meanwhile: %v", base+3, err)
	}
	defer be.Close()
	if got, want := be.(*tcp.Backend).Addr(), net.JoinHostPort("127.0.0.1", strconv.Itoa(base+3)); got != want {
		t.Errorf("rank tp 1 pp 1 of tp 2 listens at %s, want %s", got, want)
	}
	c.dataPortBase = 65535
	if _, err := newBackend("E", &topology.Layout{TPRank: 1, TPSize: 2}, false); err == nil || !strings.Contains(err.Error(), "-data-port-base") {
		t.Errorf("a rank past port 65535: %v, want an error naming -data-port-base", err)
	}
}

// -max-calls and -max-calls-per-uid: 0 (twice -max-streams and
// -max-streams-per-uid in the server), a count, never negative.
func TestMaxCallsFlags(t *testing.T) {
	c, err := parseFlags([]string{"-max-calls-per-uid", "64"})
	if err != nil || c.maxCalls != 0 || c.maxCallsPerUID != 64 {
		t.Fatalf("-max-calls-per-uid 64: %d, %d, %v; want 0, 64", c.maxCalls, c.maxCallsPerUID, err)
	}
	for _, f := range []string{"-max-calls", "-max-calls-per-uid"} {
		if _, err := parseFlags([]string{f, "-1"}); err == nil || !strings.Contains(err.Error(), f+" -1") {
			t.Errorf("%s -1: %v, want an error naming the flag", f, err)
		}
	}
}

// -max-peer-calls and -max-peer-calls-per-conn: their defaults, a count,
// never 0 or negative (an error naming the flag).
func TestMaxPeerCallsFlags(t *testing.T) {
	c, err := parseFlags(nil)
	if err != nil || c.maxPeerCalls != server.DefaultMaxPeerCalls || c.maxPeerCallsPerConn != server.DefaultMaxPeerCallsPerConn {
		t.Fatalf("defaults: %d, %d, %v", c.maxPeerCalls, c.maxPeerCallsPerConn, err)
	}
	for _, f := range []string{"-max-peer-calls", "-max-peer-calls-per-conn"} {
		for _, v := range []string{"0", "-1"} {
			if _, err := parseFlags([]string{f, v}); err == nil || !strings.Contains(err.Error(), f+" "+v) {
				t.Errorf("%s %s: %v, want an error naming the flag", f, v, err)
			}
		}
	}
}

// -hello-timeout of a nanosecond was taken: every engine's hello came too
// late and the daemon served no engine, with nothing said at its start.
// Below its least value it is refused, naming the flag.
func TestHelloTimeoutFlagBounded(t *testing.T) {
	for _, v := range []string{"1ns", "1ms", "99ms"} {
		if _, err := parseFlags([]string{"-hello-timeout", v}); err == nil || !strings.Contains(err.Error(), "-hello-timeout") {
			t.Errorf("-hello-timeout %s: %v, want an error naming the flag", v, err)
		}
	}
	if c, err := parseFlags([]string{"-hello-timeout", "100ms"}); err != nil || c.helloTimeout != 100*time.Millisecond {
		t.Errorf("-hello-timeout 100ms: %v, %v", c, err)
	}
}

// The built-in backend's data port takes -max-peer-conns-per-addr
// connections from one IP that have not authenticated (and -max-peer-conns
// in all): one past it is closed at once and counted (data_conns_per_addr).
func TestDataPortConnsFlags(t *testing.T) {
	secret, err := peerauth.New([]byte("0123456789abcdef0123456789abcdef"))
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	refused := map[string]int{}
	c := &config{backend: "builtin", dataHost: "127.0.0.1", conns: 1, maxPeerConns: 2, maxPeerConnsTotal: 100}
	newBackend := c.backendFactory(secret, peerSecurity{}, slog.New(slog.NewTextHandler(io.Discard, nil)), nil,
		func(reason string) { mu.Lock(); refused[reason]++; mu.Unlock() })
	be, err := newBackend("E", &topology.Layout{TPSize: 1, PPSize: 1}, false)
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	var conns []net.Conn
	for range 3 {
		conn, err := net.Dial("tcp", be.(*tcp.Backend).Addr())
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conns = append(conns, conn)
	}
	// The last one is refused (read first: each read waits until the
	// shared deadline at most), the first two held.
	closed := 0
	deadline := time.Now().Add(3 * time.Second)
	for i := range conns {
		conn := conns[len(conns)-1-i]
		_ = conn.SetReadDeadline(deadline)
		if _, err := conn.Read(make([]byte, 1)); err != nil && !errors.Is(err, os.ErrDeadlineExceeded) {
			closed++
		}
	}
	mu.Lock()
	defer mu.Unlock()
	if closed != 1 || refused["data_conns_per_addr"] != 1 {
		t.Errorf("3 idle connections, -max-peer-conns-per-addr 2: %d closed, refusals %v; want 1, data_conns_per_addr 1", closed, refused)
	}
}
