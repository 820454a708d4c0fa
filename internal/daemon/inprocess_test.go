package daemon

import (
	"context"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

// libkvxfer's JSON configuration: kvxferd serve's flag names ("-" or
// "_"), strings, numbers and booleans, the in-process defaults, and bad
// keys and values named.
func TestParseJSON(t *testing.T) {
	t.Setenv("KVXFERD_CONNS", "0") // the environment is not read
	c, err := parseJSON([]byte(`{"peer_listen": "127.0.0.1:0", "conns": 3, "insecure-peers": true, "lease": "45s", "log_level": "warn"}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.conns != 3 || !c.insecurePeers || c.lease != 45*time.Second || c.logLevel != "warn" || !c.ownProcessOnly ||
		c.metricsListen != "" || c.drainTimeout != 5*time.Second || !strings.HasPrefix(c.socket, "@kvxfer-") {
		t.Errorf("parseJSON = %+v, want the values given and the in-process defaults", c)
	}
	for _, empty := range []string{"", "{}", "  "} {
		if _, err := parseJSON([]byte(empty)); err != nil {
			t.Errorf("parseJSON(%q) = %v, want the defaults", empty, err)
		}
	}
	for _, tc := range []struct{ in, want string }{
		{`{"no_such": 1}`, `key "no_such": unknown`},
		{`{"conns": "x"}`, `key "conns"`},
		{`{"conns": 0}`, "-conns = 0"},
		{`{"conns": [1]}`, "want a string, a number or a boolean"},
		// A value of the wrong type says what the key takes.
		{`{"conns": 1.5}`, `key "conns" = 1.5: want a whole number`},
		{`{"lease": 30}`, `key "lease" = 30: want a duration`},
		{`{"insecure_peers": 1}`, `key "insecure_peers" = 1: want true or false`},
		{`{"insecure_peers": "yes"}`, `key "insecure_peers" = "yes": want true or false`},
		{`{"peer_allow": "???"}`, `"???"`},
		{`[1]`, "want a JSON object"},
		{`null`, "want a JSON object"},
		// What follows the object is no configuration to drop unread.
		{`{"insecure_peers": true} {"no_such": 1}`, "after the JSON object"},
		{`{"insecure_peers": true} garbage`, "after the JSON object"},
		// One flag named twice (its two spellings, or one spelling
		// twice) has no one value: which won was up to map order.
		{`{"insecure_peers": true, "insecure-peers": false}`, `key "insecure-peers"`},
		{`{"conns": 3, "conns": 4}`, `key "conns"`},
		// An address that cannot be one is refused as configuration,
		// naming the key and the value, not found at listen time (then
		// KVXFER_EFAIL "peer listener: ...", or, for an advertised
		// address without a port, a server that starts and names its
		// engines by an address no peer can dial).
		{`{"peer_listen": "nonsense"}`, `-peer-listen = "nonsense"`},
		{`{"peer_listen": "127.0.0.1:70000"}`, `-peer-listen = "127.0.0.1:70000"`},
		{`{"peer_advertise": "nohost"}`, `-peer-advertise = "nohost"`},
		{`{"peer_advertise": "10.0.0.1:0"}`, `-peer-advertise = "10.0.0.1:0"`},
		// The built-in backend's data host is listened on at each rank's
		// attach: one that is no host failed every engine's attach, long
		// after the start (kvxferd's too).
		{`{"data_host": "10.0.0.1:7600"}`, `-data-host = "10.0.0.1:7600"`},
		{`{"data_host": "a b"}`, `-data-host = "a b"`},
		{`{"data_host": "[::1]"}`, `-data-host = "[::1]"`},
		{`{"peer_advertise": ":7600"}`, `-peer-advertise = ":7600"`},
		{`{"metrics_listen": "9600"}`, `-metrics-listen = "9600"`},
		// A per-rank server's port is the base plus its rank's index: one
		// below the base could serve no rank (every hello refused).
		{`{"rank_port_base": 5000, "peer_listen": "127.0.0.1:4000"}`, `-rank-port-base = 5000`},
		{`{"rank_port_base": 5000, "peer_listen": "127.0.0.1:0", "peer_advertise": "10.0.0.1:4999"}`, `-rank-port-base = 5000`},
	} {
		if _, err := parseJSON([]byte(tc.in)); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("parseJSON(%s) = %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
}

// CheckInProcessConfig refuses what StartInProcess would, naming the key
// and the value, and accepts what it would start with.
func TestCheckInProcessConfig(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{`{"no_such_key": 1}`, `"no_such_key": unknown`},
		{`{"drain_timeout": 5}`, `"drain_timeout" = 5`},
		{`{"log_level": "loud"}`, `"log-level" = "loud"`},
		{`{"conns": 0}`, `-conns = 0`},
		{`[]`, `want a JSON object`},
	} {
		if err := CheckInProcessConfig([]byte(tc.in)); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CheckInProcessConfig(%s) = %v, want ErrConfig containing %q", tc.in, err, tc.want)
		}
	}
	// The files that secure peers are read as the start reads them.
	dir := t.TempDir()
	open := filepath.Join(dir, "open.secret")
	if err := os.WriteFile(open, []byte("0123456789abcdef0123456789abcdef\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	junk := filepath.Join(dir, "junk.pem")
	if err := os.WriteFile(junk, []byte("junk\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct{ in, want string }{
		{`{"peer_secret_file": "` + open + `"}`, `-peer-secret-file = "` + open + `": peer secret file ` + open + `: mode 0644`},
		{`{"peer_secret_file": "` + dir + `/none"}`, `-peer-secret-file = "` + dir + `/none"`},
		{`{"tls_cert": "` + junk + `", "tls_key": "` + junk + `", "tls_ca": "` + junk + `"}`, `-tls-cert = "` + junk + `"`},
		{`{"hop_trace": "` + dir + `/no/such/dir/trace"}`, `-hop-trace = "` + dir + `/no/such/dir/trace"`},
		{`{"shm_dir": "` + dir + `/none"}`, `-shm-dir = "` + dir + `/none"`},
		// Files the start writes or listens on in a directory, and etcd's
		// TLS files: each failed only at the start, after an engine's
		// check had passed it (its model loaded meanwhile).
		{`{"ready_file": "` + dir + `/none/ready"}`, `-ready-file = "` + dir + `/none/ready"`},
		{`{"socket": "` + dir + `/none/k.sock"}`, `-socket = "` + dir + `/none/k.sock"`},
		{`{"etcd": "127.0.0.1:2379", "etcd_ca": "` + dir + `/none.pem"}`, `-etcd-ca: open ` + dir + `/none.pem`},
		{`{"etcd": "127.0.0.1:2379", "etcd_ca": "` + junk + `"}`, `-etcd-ca ` + junk + `: no PEM certificate`},
	} {
		if err := CheckInProcessConfig([]byte(tc.in)); !errors.Is(err, ErrConfig) || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("CheckInProcessConfig(%s) = %v, want ErrConfig containing %q", tc.in, err, tc.want)
		}
	}
	// NIXL's library is looked for (not loaded) where the start looks.
	t.Setenv("NIXL_CAPI_LIB", filepath.Join(dir, "missing.so"))
	if err := CheckInProcessConfig([]byte(`{"backend": "nixl"}`)); !errors.Is(err, ErrConfig) ||
		!strings.Contains(err.Error(), `-backend = "nixl"`) || !strings.Contains(err.Error(), "NIXL_CAPI_LIB") {
		t.Errorf("CheckInProcessConfig(nixl, no library) = %v, want ErrConfig naming -backend and NIXL_CAPI_LIB", err)
	}
	if err := CheckInProcessConfig([]byte(`{"insecure_peers": true, "log_level": "error", "peer_timeout": "2s"}`)); err != nil {
		t.Errorf("CheckInProcessConfig(a good one) = %v", err)
	}
}

// An in-process server serves its own process on an abstract socket
// (engines may name memory by address there), stops idempotently, and
// changes no environment variable.
func TestStartInProcess(t *testing.T) {
	env := os.Environ()
	if _, err := StartInProcess([]byte(`{"conns": -1}`)); !errors.Is(err, ErrConfig) {
		t.Errorf("StartInProcess(conns -1) = %v, want ErrConfig", err)
	}
	p, err := StartInProcess([]byte(`{"insecure_peers": true, "log_level": "error"}`))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(p.Endpoint(), "unix-abstract:kvxfer-") || p.PeerAddr() == "" {
		t.Errorf("Endpoint() = %q, PeerAddr() = %q", p.Endpoint(), p.PeerAddr())
	}
	cc, err := grpc.NewClient(p.Endpoint(), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if h, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{}); err != nil || h.Status != healthpb.HealthCheckResponse_SERVING {
		t.Errorf("health on the in-process endpoint = %v, %v; want SERVING", h, err)
	}
	done := make(chan error, 2)
	go func() { done <- p.Stop() }()
	go func() { done <- p.Stop() }()
	for range 2 {
		select {
		case err := <-done:
			if err != nil {
				t.Error(err)
			}
		case <-time.After(20 * time.Second):
			t.Fatal("Stop did not return in 20 s")
		}
	}
	if got := os.Environ(); strings.Join(got, "\n") != strings.Join(env, "\n") {
		t.Error("the in-process server changed the environment")
	}
}

// The hop trace is the JSON key hop_trace as it is kvxferd's -hop-trace:
// the server opens the file at start (an error naming the flag when it
// cannot) and closes it, its last line trace.end, when it stops.
func TestHopTraceConfig(t *testing.T) {
	dir := t.TempDir()
	if _, err := StartInProcess([]byte(`{"insecure_peers": true, "log_level": "error", "hop_trace": "` + dir + `/no/such/dir"}`)); err == nil ||
		!strings.Contains(err.Error(), "-hop-trace") {
		t.Errorf("StartInProcess with hop_trace in a missing directory = %v, want an error naming -hop-trace", err)
	}
	path := dir + "/hops.jsonl"
	p, err := StartInProcess([]byte(`{"insecure_peers": true, "log_level": "error", "hop_trace": "` + path + `"}`))
	if err != nil {
		t.Fatal(err)
	}
	if err := p.Stop(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], `"ev":"trace.start"`) || !strings.Contains(lines[1], `"ev":"trace.end"`) {
		t.Errorf("trace of a server that served nothing = %q, want trace.start and trace.end", lines)
	}
	c, err := parseFlags([]string{"-hop-trace", path})
	if err != nil || c.hopTrace != path {
		t.Errorf("parseFlags(-hop-trace %s) = %+v, %v", path, c, err)
	}
}

// A server stopped by Stop logs no error: the watcher of its listeners
// took their return after Stop as a listener that stopped by itself
// (about one stop in two logged "in-process server stopped" at ERROR).
func TestInProcessStopLogsNoError(t *testing.T) {
	r, w, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	old := os.Stderr
	os.Stderr = w // the server's log, made at start
	got := make(chan string)
	go func() {
		b, _ := io.ReadAll(r)
		got <- string(b)
	}()
	for range 10 {
		p, err := StartInProcess([]byte(`{"insecure_peers": true, "log_level": "error"}`))
		if err != nil {
			os.Stderr = old
			t.Fatal(err)
		}
		_ = p.Stop()
	}
	time.Sleep(100 * time.Millisecond) // a watcher's late line
	os.Stderr = old
	w.Close()
	if log := <-got; strings.Contains(log, "level=ERROR") {
		t.Fatalf("10 starts and stops logged errors:\n%s", log)
	}
}
