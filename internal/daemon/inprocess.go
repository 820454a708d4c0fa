package daemon

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
	"github.com/kvxfer/kvxfer/internal/peerauth"
)

// The in-process placement (libkvxfer): the daemon's server started
// inside the engine's own process, configured by JSON instead of flags.

// inProcessDefaults are the JSON configuration's defaults where they
// differ from kvxferd serve's: an abstract socket of this process's own
// (engines of this process only), a peer port the system picks, no
// metrics endpoint, and a shorter drain so that a process exits promptly.
var inProcessDefaults = map[string]string{
	"peer-listen":      "127.0.0.1:0",
	"metrics-listen":   "",
	"drain-timeout":    "5s",
	"own-process-only": "true",
}

// parseJSON reads libkvxfer's configuration: a JSON object whose keys are
// kvxferd serve's flag names (with "-" or "_"), each value a string, a
// number or a boolean with the flag's meaning; missing keys take the
// flags' defaults, or inProcessDefaults. "socket" unset means an abstract
// socket named after this process. Nothing is read from the environment.
func parseJSON(b []byte) (*config, error) {
	c := &config{}
	fs := flagSet(c)
	for k, v := range inProcessDefaults {
		if err := fs.Set(k, v); err != nil {
			panic(fmt.Sprintf("daemon: in-process default %s=%q: %v", k, v, err))
		}
	}
	c.socket = ""
	b = bytes.TrimSpace(b)
	if len(b) > 0 {
		if err := setJSON(fs, b); err != nil {
			return nil, err
		}
	}
	c.etcd.noteGiven(fs) // (no inProcessDefaults key is the registry's)
	if c.socket == "" {
		c.socket = fmt.Sprintf("@kvxfer-%d-%s", os.Getpid(), randomHex(8))
	}
	if err := c.validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// setJSON sets fs's flags from the JSON object b, key by key in order: a
// key is a flag's name (with "-" or "_"), named once (in one spelling or
// the other), and nothing follows the object.
func setJSON(fs *flag.FlagSet, b []byte) error {
	dec := json.NewDecoder(bytes.NewReader(b))
	dec.UseNumber()
	tok, err := dec.Token()
	if err != nil {
		return fmt.Errorf("want a JSON object: %w", err)
	}
	if d, ok := tok.(json.Delim); !ok || d != '{' {
		if tok == nil {
			return errors.New("want a JSON object, not null")
		}
		return fmt.Errorf("want a JSON object, not %#v", tok)
	}
	seen := map[string]string{} // flag name: the key that set it
	for dec.More() {
		tok, err := dec.Token()
		if err != nil {
			return fmt.Errorf("want a JSON object: %w", err)
		}
		key, _ := tok.(string)
		var raw json.RawMessage
		if err := dec.Decode(&raw); err != nil {
			return fmt.Errorf("key %q: its value is not JSON: %w", key, err)
		}
		name := strings.ReplaceAll(key, "_", "-")
		f := fs.Lookup(name)
		if f == nil {
			return fmt.Errorf("key %q: unknown (the keys are kvxferd serve's flag names)", key)
		}
		if prev, ok := seen[name]; ok {
			return fmt.Errorf("key %q: %s is set already (key %q): name each key once", key, name, prev)
		}
		seen[name] = key
		v, err := jsonScalar(raw)
		if err != nil {
			return fmt.Errorf("key %q: %w", key, err)
		}
		want := flagWants(f.Value)
		if b, ok := f.Value.(interface{ IsBoolFlag() bool }); ok && b.IsBoolFlag() && v != "true" && v != "false" {
			// (Set takes "1", "t", "F"...: a JSON 1 or "yes" for a
			// switch such as insecure_peers is a slip, not a choice.)
			return fmt.Errorf("key %q = %s: want %s", key, raw, want)
		}
		if err := fs.Set(f.Name, v); err != nil { // (fs.Set: what was given, envflag.Given)
			if want != "" {
				return fmt.Errorf("key %q = %s: want %s: %w", key, raw, want, err)
			}
			return fmt.Errorf("key %q = %s: %w", key, raw, err)
		}
	}
	if _, err := dec.Token(); err != nil { // the closing brace
		return fmt.Errorf("want a JSON object: %w", err)
	}
	end := dec.InputOffset()
	if _, err := dec.Token(); err != io.EOF {
		return fmt.Errorf("want one JSON object, and nothing after the JSON object (%s)", trailing(b, end))
	}
	return nil
}

// flagWants says what value a flag of v's type takes, for an error ("":
// its own error says it).
func flagWants(v flag.Value) string {
	g, ok := v.(flag.Getter)
	if !ok {
		return ""
	}
	switch g.Get().(type) {
	case bool:
		return "true or false (a JSON boolean)"
	case int, int64:
		return "a whole number"
	case uint, uint64:
		return "a whole number, 0 or more"
	case float64:
		return "a number"
	case time.Duration:
		return `a duration such as "5s" or "500ms"`
	}
	return ""
}

// trailing is what of b follows offset, cut short.
func trailing(b []byte, offset int64) string {
	rest := strings.TrimSpace(string(b[min(int(offset), len(b)):]))
	if len(rest) > 40 {
		rest = rest[:40] + "..."
	}
	return strconv.Quote(rest)
}

// jsonScalar is a JSON string, number or boolean as a flag's text.
func jsonScalar(raw json.RawMessage) (string, error) {
	var v any
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.UseNumber()
	if err := dec.Decode(&v); err != nil {
		return "", err
	}
	switch x := v.(type) {
	case string:
		return x, nil
	case json.Number:
		return x.String(), nil
	case bool:
		return strconv.FormatBool(x), nil
	default:
		return "", fmt.Errorf("value %s: want a string, a number or a boolean", raw)
	}
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// ErrConfig is the error of a bad in-process configuration (its message
// names the key and the value).
var ErrConfig = errors.New("kvxfer: configuration")

// CheckInProcessConfig checks a JSON configuration as StartInProcess
// reads it (every key known, every value of its flag's type and range,
// the keys together consistent), without starting anything: an engine
// checks its configuration as it is built, long before its server
// starts. Its error wraps ErrConfig and names the key and the value.
func CheckInProcessConfig(configJSON []byte) error {
	_, _, err := checkInProcess(configJSON)
	return err
}

// checkInProcess is the configuration configJSON gives, and its log level.
func checkInProcess(configJSON []byte) (*config, slog.Level, error) {
	var level slog.Level
	c, err := parseJSON(configJSON)
	if err != nil {
		return nil, level, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	if err := level.UnmarshalText([]byte(c.logLevel)); err != nil {
		return nil, level, fmt.Errorf("%w: key \"log-level\" = %q: %w", ErrConfig, c.logLevel, err)
	}
	// The files that secure peers, read as the server's start reads them
	// (small files, nothing kept): one other users may read, a secret too
	// short or a key pair that does not load fails here, not only at the
	// start, which may come long after (a worker rank's, after its model
	// loaded).
	if c.peerSecretFile != "" {
		if _, err := peerauth.LoadSecret(c.peerSecretFile); err != nil {
			return nil, level, fmt.Errorf("%w: -peer-secret-file = %q: %w", ErrConfig, c.peerSecretFile, err)
		}
	}
	if c.tlsCert != "" {
		if _, _, err := peerauth.LoadTLS(c.tlsCert, c.tlsKey, c.tlsCA); err != nil {
			return nil, level, fmt.Errorf("%w: -tls-cert = %q, -tls-key = %q, -tls-ca = %q: %w", ErrConfig,
				c.tlsCert, c.tlsKey, c.tlsCA, err)
		}
	}
	// etcd's TLS files likewise (the registry dials etcd at the start).
	if c.etcd.client.Endpoints != "" {
		if _, err := c.etcd.client.TLSConfig(); err != nil {
			return nil, level, fmt.Errorf("%w: %w", ErrConfig, err)
		}
	}
	// NIXL's C library, found as the start finds it (not loaded: loading
	// it loads UCX, which installs signal handlers, long before a server
	// is wanted): one missing fails here, naming where it was looked for,
	// not at every worker's start after its model loaded.
	if c.backend == "nixl" {
		if _, err := capi.FindLibrary(); err != nil {
			return nil, level, fmt.Errorf("%w: -backend = %q: %w", ErrConfig, c.backend, err)
		}
	}
	// Directories the start needs (nothing created here).
	// (The start listens on a socket file, and writes -ready-file,
	// in theirs.)
	dirs := []struct{ key, value, dir string }{{"shm-dir", c.shmDir, c.shmDir}}
	for _, f := range []struct{ key, value string }{{"hop-trace", c.hopTrace}, {"ready-file", c.readyFile}, {"socket", c.socket}} {
		if f.value != "" && !abstract(f.value) {
			dirs = append(dirs, struct{ key, value, dir string }{f.key, f.value, filepath.Dir(f.value)})
		}
	}
	for _, d := range dirs {
		if st, err := os.Stat(d.dir); err != nil || !st.IsDir() {
			if err == nil {
				err = errors.New("not a directory")
			}
			return nil, level, fmt.Errorf("%w: -%s = %q: %s: %w", ErrConfig, d.key, d.value, d.dir, err)
		}
	}
	return c, level, nil
}

// InProcess is a server started inside this process (libkvxfer). It is
// safe for concurrent use.
type InProcess struct {
	in       *instance
	config   string // the configuration it was started with, as given
	endpoint string
	stopOnce sync.Once
	stopErr  error
	done     chan struct{}
}

// StartInProcess starts the daemon's server in this process from a JSON
// configuration (parseJSON's keys), and returns once it serves. It does
// not touch the process's signals or environment: Stop stops it. Log
// lines go to stderr at the configuration's log-level.
func StartInProcess(configJSON []byte) (*InProcess, error) {
	c, level, err := checkInProcess(configJSON)
	if err != nil {
		return nil, err
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	in, err := start(c, log, true)
	if err != nil {
		return nil, err
	}
	p := &InProcess{in: in, config: string(configJSON), endpoint: endpointOf(c.socket), done: make(chan struct{})}
	go func() {
		// A listener that stops by itself (not by Stop) stops the rest.
		select {
		case err := <-in.serveErr:
			select {
			case <-p.done:
				return // Stop stopped the listeners (it closes done first)
			default:
			}
			log.Error("kvxfer: in-process server stopped", "err", err)
			_ = p.Stop()
		case <-p.done:
		}
	}()
	return p, nil
}

// endpointOf is the gRPC target of a unix socket name: unix-abstract:NAME
// for "@NAME" (grpc-go and gRPC core both read it), else unix:PATH.
func endpointOf(socket string) string {
	if name, ok := strings.CutPrefix(socket, "@"); ok {
		return "unix-abstract:" + name
	}
	return "unix:" + socket
}

// Endpoint is the gRPC target the engine's streams connect to.
func (p *InProcess) Endpoint() string { return p.endpoint }

// PeerAddr is the address of the server's Peer service that peers dial.
func (p *InProcess) PeerAddr() string { return p.in.advertise }

// Config is the JSON configuration p was started with, as given.
func (p *InProcess) Config() string { return p.config }

// OpenDirect opens a worker stream served without gRPC, for an engine of
// this process that calls the library (server.DirectStream: the same
// kvxfer.v1 messages, marshalled; the caller is this process).
func (p *InProcess) OpenDirect() *server.DirectStream { return p.in.srv.OpenDirect() }

// CallDirect makes one SchedulerService call without gRPC
// (server.Server.CallDirect).
func (p *InProcess) CallDirect(method string, req []byte, wait time.Duration) ([]byte, codes.Code, string) {
	return p.in.srv.CallDirect(method, req, wait)
}

// Refusals is the server's refusals by reason (server.Server.Refusals).
func (p *InProcess) Refusals() map[string]uint64 { return p.in.srv.Refusals() }

// Stopped reports whether p was stopped (by Stop, or because a listener
// stopped by itself).
func (p *InProcess) Stopped() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// Stop shuts p down gracefully (transfers in flight finish within the
// configuration's drain-timeout, and 5 s more at most) and returns when
// it has. It is idempotent and safe to call concurrently. Its error says
// when a rank had still not let go of the memory its engine named when
// the server gave up waiting (server.ErrRanksStillClosing): that memory
// must not be freed.
func (p *InProcess) Stop() error {
	p.stopOnce.Do(func() {
		close(p.done)
		p.in.shutdown()
		p.stopErr = p.in.closeErr
	})
	return p.stopErr
}
