package daemon

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
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

	"github.com/kvxfer/kvxfer/internal/peerauth/pkitest"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// startTest starts c's listeners in this process and shuts them down at
// the test's end.
func startTest(t *testing.T, c *config) *instance {
	t.Helper()
	in, err := start(c, slog.New(slog.NewTextHandler(io.Discard, nil)), false)
	if err != nil {
		t.Fatalf("start: %v", err)
	}
	t.Cleanup(in.shutdown)
	return in
}

func testConfig(t *testing.T) *config {
	dir := t.TempDir()
	return &config{socket: filepath.Join(dir, "k.sock"), peerListen: "127.0.0.1:0", dataHost: "127.0.0.1", conns: 1,
		shmDir: dir, drainTimeout: 2 * time.Second, lease: 30 * time.Second}
}

// scrape returns the value of an unlabelled metric at addr's /metrics.
func scrape(t *testing.T, addr, name string) float64 {
	t.Helper()
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	m := regexp.MustCompile(`(?m)^` + regexp.QuoteMeta(name) + ` (\S+)$`).FindSubmatch(body)
	if m == nil {
		t.Fatalf("/metrics lacks %s", name)
	}
	v, _ := strconv.ParseFloat(string(m[1]), 64)
	return v
}

// With mutual TLS, a connection to the Peer service whose certificate is
// not of the CA (or that brings none), and such a connection to a rank's
// data port, is refused and counted in
// kvxfer_peer_auth_failures_total, as a failed shared-secret exchange is
// (README: "mutual TLS with certificates of another CA ... counts both
// sides").
func TestTLSPeerAuthFailuresCounted(t *testing.T) {
	dir := t.TempDir()
	ca, err := pkitest.NewCA(dir, "fleet")
	if err != nil {
		t.Fatal(err)
	}
	f, err := ca.Issue(dir, "d1")
	if err != nil {
		t.Fatal(err)
	}
	other, err := pkitest.NewCA(dir, "other")
	if err != nil {
		t.Fatal(err)
	}
	stranger, err := other.Issue(dir, "stranger")
	if err != nil {
		t.Fatal(err)
	}
	c := testConfig(t)
	c.tlsCert, c.tlsKey, c.tlsCA = f.Cert, f.Key, f.CA
	c.metricsListen = freePort(t)
	_, dp, _ := net.SplitHostPort(freePort(t))
	c.dataPortBase, _ = strconv.Atoi(dp)
	in := startTest(t, c)
	if got := scrape(t, c.metricsListen, "kvxfer_peer_auth_failures_total"); got != 0 {
		t.Fatalf("kvxfer_peer_auth_failures_total = %v before any connection, want 0", got)
	}
	cert, err := tls.LoadX509KeyPair(stranger.Cert, stranger.Key)
	if err != nil {
		t.Fatal(err)
	}
	caPEM, _ := os.ReadFile(f.CA)
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(caPEM)
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", in.advertise,
		&tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: pool, MinVersion: tls.VersionTLS13})
	if err == nil {
		// TLS 1.3: the client's certificate is checked after the client's
		// handshake returns; the refusal arrives on the first read.
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
	}
	if err == nil {
		t.Fatal("a certificate of another CA was accepted by the Peer service")
	}
	deadline := time.Now().Add(5 * time.Second)
	for scrape(t, c.metricsListen, "kvxfer_peer_auth_failures_total") < 1 && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
	got := scrape(t, c.metricsListen, "kvxfer_peer_auth_failures_total")
	if got < 1 {
		t.Errorf("kvxfer_peer_auth_failures_total = %v after a refused TLS connection, want >= 1", got)
	}
	// The data plane: a rank's data port refuses a connection without a
	// certificate of the CA, counted too.
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, closeRank, err := connectTinyRank(t, ctx, c.socket, c.shmDir, "E1")
	defer closeRank()
	if err != nil {
		t.Fatal(err)
	}
	data := net.JoinHostPort("127.0.0.1", strconv.Itoa(c.dataPortBase))
	conn, err = tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", data, &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS13})
	if err == nil {
		_ = conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		_, err = conn.Read(make([]byte, 1))
		conn.Close()
	}
	if err == nil {
		t.Fatal("the data port accepted a connection without a certificate")
	}
	for deadline := time.Now().Add(5 * time.Second); scrape(t, c.metricsListen, "kvxfer_peer_auth_failures_total") < got+1 && time.Now().Before(deadline); {
		time.Sleep(20 * time.Millisecond)
	}
	if now := scrape(t, c.metricsListen, "kvxfer_peer_auth_failures_total"); now < got+1 {
		t.Errorf("kvxfer_peer_auth_failures_total = %v after a refused data-plane TLS connection, want >= %v", now, got+1)
	}
}

// validate refuses what makes no sense for -drain-timeout (and a zero
// -peer-timeout): a zero or
// negative drain (the ranks would wait the server's 30 s default while
// shutdown gave up after 5 s, or at once), naming the flag and value.
func TestDrainTimeoutFlag(t *testing.T) {
	for _, bad := range []string{"0", "-1s"} {
		if _, err := parseFlags([]string{"-drain-timeout", bad}); err == nil || !strings.Contains(err.Error(), "-drain-timeout = "+bad) {
			t.Errorf("-drain-timeout %s: %v, want an error naming the flag and value", bad, err)
		}
	}
	// -peer-timeout 0 was the worker's 5 s default in disguise.
	if _, err := parseFlags([]string{"-peer-timeout", "0"}); err == nil || !strings.Contains(err.Error(), "-peer-timeout = 0") {
		t.Errorf("-peer-timeout 0: %v, want an error naming the flag and value", err)
	}
	if c, err := parseFlags([]string{"-peer-timeout", "-1s"}); err != nil || c.peerTimeout >= 0 {
		t.Errorf("-peer-timeout -1s (never): %v, %v", c.peerTimeout, err)
	}
	if c, err := parseFlags([]string{"-drain-timeout", "3s"}); err != nil || c.drainTimeout != 3*time.Second {
		t.Errorf("-drain-timeout 3s: %v, %v", c.drainTimeout, err)
	}
}

// -data-port-base equal to the peer port (or the metrics port) on the
// same host: the first rank of every engine could never listen for KV
// bytes. Refused at start, naming the flag and value, not a daemon that
// serves health and then fails every engine's hello.
func TestDataPortBaseCollisionRefused(t *testing.T) {
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-peer-listen", "127.0.0.1:7600", "-data-port-base", "7600"}, "-data-port-base = 7600"},
		{[]string{"-peer-listen", "0.0.0.0:7600", "-data-host", "10.0.0.1", "-data-port-base", "7600"}, "-data-port-base = 7600"},
		{[]string{"-peer-listen", ":7600", "-data-port-base", "7600"}, "-data-port-base = 7600"},
		{[]string{"-metrics-listen", "127.0.0.1:9600", "-data-port-base", "9600"}, "-data-port-base = 9600"},
	} {
		if _, err := parseFlags(tc.args); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: %v, want an error containing %q", tc.args, err, tc.want)
		}
	}
	// Other hosts, or other ports, are fine.
	for _, ok := range [][]string{
		{"-peer-listen", "10.0.0.1:7600", "-data-host", "10.0.0.2", "-data-port-base", "7600"},
		{"-peer-listen", "127.0.0.1:7600", "-data-port-base", "7700"},
		{"-peer-listen", "127.0.0.1:7600", "-data-port-base", "7600", "-backend", "nixl"},
	} {
		if _, err := parseFlags(ok); err != nil {
			t.Errorf("%q: %v, want it accepted", ok, err)
		}
	}
}

// A second daemon started on the socket of one that serves does not take
// it over (the first would go on serving no new engine, and remove the
// second's socket when it stops); and -socket naming a file that is not a
// socket does not delete it. A stale socket (nothing listens) is still
// replaced.
func TestSocketInUseRefused(t *testing.T) {
	c1 := testConfig(t)
	startTest(t, c1)
	st1, err := os.Stat(c1.socket)
	if err != nil {
		t.Fatal(err)
	}
	c2 := testConfig(t)
	c2.socket = c1.socket
	if in, err := start(c2, slog.New(slog.NewTextHandler(io.Discard, nil)), false); err == nil {
		in.shutdown()
		t.Error("a second daemon took over the socket of one that serves")
	} else if !strings.Contains(err.Error(), c1.socket) {
		t.Errorf("second daemon on a served socket: %v, want an error naming the socket", err)
	}
	if st2, err := os.Stat(c1.socket); err != nil || !os.SameFile(st1, st2) {
		t.Errorf("the serving daemon's socket was replaced or removed (%v)", err)
	}

	c3 := testConfig(t)
	file := filepath.Join(t.TempDir(), "precious")
	if err := os.WriteFile(file, []byte("keep me"), 0o600); err != nil {
		t.Fatal(err)
	}
	c3.socket = file
	if in, err := start(c3, slog.New(slog.NewTextHandler(io.Discard, nil)), false); err == nil {
		in.shutdown()
		t.Error("-socket naming a regular file: started")
	} else if !strings.Contains(err.Error(), "-socket") {
		t.Errorf("-socket naming a regular file: %v, want an error naming -socket", err)
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "keep me" {
		t.Errorf("-socket deleted or changed a regular file: %q, %v", b, err)
	}

	// Stale: a socket file nothing listens on.
	c4 := testConfig(t)
	ln, err := net.Listen("unix", c4.socket)
	if err != nil {
		t.Fatal(err)
	}
	ln.(*net.UnixListener).SetUnlinkOnClose(false)
	ln.Close()
	startTest(t, c4)
}

// Shutdown with nothing in flight does not wait out -drain-timeout for an
// engine's scheduler holding its Steps stream open (the vLLM connector's
// relay keeps one for its life): once the ranks drained, the stream ends
// with a clear status, and shutdown returns promptly.
func TestShutdownEndsStepsStream(t *testing.T) {
	c := testConfig(t)
	// A minute: "promptly" is a third of it, against a shutdown that
	// waits the drain-timeout out (with 10 s and 3 s, a loaded machine
	// could take the 3 s with nothing wrong).
	c.drainTimeout = time.Minute
	in, err := start(c, slog.New(slog.NewTextHandler(io.Discard, nil)), false)
	if err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient("unix://"+c.socket, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sc := pb.NewSchedulerServiceClient(cc)
	if _, err := sc.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	st, err := sc.Steps(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&pb.StepsRequest{Step: &pb.StepRequest{EngineId: "E", PublishStep: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); err != nil {
		t.Fatal(err)
	}
	ended := make(chan error, 1)
	go func() {
		_, err := st.Recv()
		ended <- err
	}()
	t0 := time.Now()
	in.shutdown()
	if d := time.Since(t0); d > c.drainTimeout/3 {
		t.Errorf("shutdown with nothing in flight took %v (-drain-timeout %v): it waited for the Steps stream", d.Round(time.Millisecond), c.drainTimeout)
	}
	select {
	case err := <-ended:
		if s, _ := status.FromError(err); s.Code() != codes.Unavailable || !strings.Contains(s.Message(), "shutting down") {
			t.Errorf("the Steps stream ended with %v, want Unavailable saying kvxferd is shutting down", err)
		}
	case <-time.After(15 * time.Second): // ended as shutdown returned; the wait only bounds a stream left open
		t.Error("the Steps stream did not end")
	}
}

// An engine id is a label of every rank metric, repeated on each series
// and histogram bucket of /metrics: an engine (any local user, with
// -socket-mode 0666) naming itself with a megabyte made each scrape
// hundreds of megabytes. hello.engine_id is bounded, refused naming the
// field and counted (kvxfer_refused_total{reason="bad_hello"}: an invalid
// hello was counted nowhere), and the daemon serves on.
func TestLongEngineIDRefused(t *testing.T) {
	c := testConfig(t)
	c.metricsListen = freePort(t)
	startTest(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	_, closeRank, err := connectTinyRank(t, ctx, c.socket, c.shmDir, strings.Repeat("e", 1<<20))
	defer closeRank()
	resp, herr := http.Get("http://" + c.metricsListen + "/metrics")
	if herr != nil {
		t.Fatal(herr)
	}
	n, _ := io.Copy(io.Discard, resp.Body)
	resp.Body.Close()
	if err == nil || !strings.Contains(err.Error(), "hello.engine_id") {
		t.Errorf("a rank with a 1 MiB engine id: %v, want a refusal naming hello.engine_id (/metrics is now %d bytes)", err, n)
	}
	// The refused hello is counted.
	if got := scrape(t, c.metricsListen, `kvxfer_refused_total{reason="bad_hello"}`); got != 1 {
		t.Errorf(`kvxfer_refused_total{reason="bad_hello"} = %v, want 1`, got)
	}
}

// failingListener's Accept fails for good once fail is closed.
type failingListener struct {
	net.Listener
	fail chan struct{}
}

func (l failingListener) Accept() (net.Conn, error) {
	type res struct {
		c   net.Conn
		err error
	}
	ch := make(chan res, 1)
	go func() { c, err := l.Listener.Accept(); ch <- res{c, err} }()
	select {
	case r := <-ch:
		return r.c, r.err
	case <-l.fail:
		l.Listener.Close()
		return nil, errors.New("injected: accept failed")
	}
}

// A listener that fails stops the daemon, and serve says so: Main's error
// is kvxferd's exit status 1, so that a supervisor (systemd's
// Restart=on-failure) restarts a daemon that no longer serves; it exited 0.
func TestServeReportsServerFailure(t *testing.T) {
	fail := make(chan struct{})
	defer func(f func(string, string) (net.Listener, error)) { listenPeers = f }(listenPeers)
	listenPeers = func(network, addr string) (net.Listener, error) {
		ln, err := net.Listen(network, addr)
		if err != nil {
			return nil, err
		}
		return failingListener{ln, fail}, nil
	}
	c := testConfig(t)
	c.readyFile = filepath.Join(c.shmDir, "ready")
	done := make(chan error, 1)
	go func() { done <- serve(context.Background(), c, slog.New(slog.NewTextHandler(io.Discard, nil))) }()
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(10 * time.Millisecond) {
		if _, err := os.Stat(c.readyFile); err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("not ready after 10 s")
		}
	}
	close(fail)
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "injected") {
			t.Errorf("serve after its peer listener failed = %v, want an error naming the failure", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("serve did not stop in 20 s after its peer listener failed")
	}
}

// A daemon listening for peers on the unspecified address without
// -peer-advertise names its engines by an address only this host can
// dial: it says so at start, naming the flag to set; one that advertises
// an address, or listens on a host's address, does not.
func TestUnspecifiedPeerListenWarned(t *testing.T) {
	for _, tc := range []struct {
		listen, advertise string
		warn              bool
	}{{"0.0.0.0:0", "", true}, {"0.0.0.0:0", "127.0.0.1:7600", false}, {"127.0.0.1:0", "", false}} {
		c := testConfig(t)
		c.peerListen, c.peerAdvertise = tc.listen, tc.advertise
		var logs strings.Builder
		in, err := start(c, slog.New(slog.NewTextHandler(&syncWriter{w: &logs}, nil)), false)
		if err != nil {
			t.Fatalf("start(-peer-listen %s -peer-advertise %q): %v", tc.listen, tc.advertise, err)
		}
		in.shutdown()
		if got := strings.Contains(logs.String(), "set -peer-advertise"); got != tc.warn {
			t.Errorf("-peer-listen %s -peer-advertise %q: warned %v, want %v; logs:\n%s", tc.listen, tc.advertise, got, tc.warn, logs.String())
		}
	}
}

// syncWriter serialises writes to w (log records from several goroutines).
type syncWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (s *syncWriter) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.w.Write(p)
}
