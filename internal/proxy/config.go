package proxy

import (
	"cmp"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"net/url"
	"strconv"
	"strings"
	"time"
)

// Mode is how P and D are driven for one request.
type Mode string

const (
	// ModePush dispatches P and D at once; P's kvxferd WRITEs the KV into
	// the blocks D registered under the shared transfer id.
	ModePush Mode = "push"
	// ModePull runs P first (max_tokens 1), then hands the
	// kv_transfer_params P returned to D, which READs the KV.
	ModePull Mode = "pull"
)

// Policy picks an upstream among the servers of one role.
type Policy string

const (
	// PolicyRoundRobin takes the servers in turn.
	PolicyRoundRobin Policy = "round-robin"
	// PolicyLeastLoaded takes the server with the fewest requests in
	// flight through this proxy, ties in turn.
	PolicyLeastLoaded Policy = "least-loaded"
)

// Defaults of the Config fields whose zero value means "default".
const (
	DefaultTimeout       = 10 * time.Minute
	DefaultMaxBody       = 32 << 20
	DefaultMaxConcurrent = 1024
	// bodyReadTimeout bounds reading a client's request body (the server's
	// ReadHeaderTimeout bounds the headers). It is not a server
	// ReadTimeout, which would also cut the connection's idle read while a
	// long stream is being relayed and so cancel the request.
	bodyReadTimeout = time.Minute
	// prefillGrace is how long a push request waits for P's answer once
	// D's response is whole (its client's response ends then), before it
	// cancels P's request.
	prefillGrace = time.Second
)

// Prefill is one P server: its OpenAI base URL and, for push mode, where
// D's kvxferd reaches P's kvxferd.
type Prefill struct {
	URL    string // base URL of the vLLM OpenAI server, e.g. http://10.0.0.1:8100
	Engine string // P's engine id (push mode: D's remote_engine_id)
	KVHost string // host of P's kvxferd (push mode: D's remote_host)
	KVPort int    // port of P's kvxferd (push mode: D's remote_port)
	TP     int    // P's tensor-parallel size (push mode: D's tp_size); 0 means 1
}

// String is p as a -prefill spec.
func (p Prefill) String() string {
	var b strings.Builder
	b.WriteString(p.URL)
	if p.Engine != "" {
		b.WriteString(",engine=" + p.Engine)
	}
	if p.KVHost != "" || p.KVPort != 0 {
		b.WriteString(",kv=" + net.JoinHostPort(p.KVHost, strconv.Itoa(p.KVPort)))
	}
	if p.TP != 0 {
		b.WriteString(",tp=" + strconv.Itoa(p.TP))
	}
	return b.String()
}

// ParsePrefill parses a P server spec:
//
//	URL[,engine=ID][,kv=HOST:PORT][,tp=N]
//
// for example http://10.0.0.1:8100,engine=p0,kv=10.0.0.1:7400,tp=2.
// engine and kv are required in push mode (checked by New); tp defaults
// to 1.
func ParsePrefill(spec string) (Prefill, error) {
	items := strings.Split(strings.TrimSpace(spec), ",")
	u, err := checkURL(strings.TrimSpace(items[0]))
	if err != nil {
		return Prefill{}, err
	}
	p := Prefill{URL: u, TP: 1}
	seen := map[string]bool{}
	for _, item := range items[1:] {
		item = strings.TrimSpace(item)
		k, v, ok := strings.Cut(item, "=")
		if !ok || k == "" {
			return Prefill{}, fmt.Errorf("item %q, want key=value (engine, kv or tp)", item)
		}
		if seen[k] {
			return Prefill{}, fmt.Errorf("%s given twice", k)
		}
		seen[k] = true
		switch k {
		case "engine":
			p.Engine = v
		case "kv":
			host, port, err := splitHostPort(v)
			if err != nil {
				return Prefill{}, fmt.Errorf("kv=%s: %w", v, err)
			}
			p.KVHost, p.KVPort = host, port
		case "tp":
			n, err := strconv.Atoi(v)
			if err != nil || n < 1 {
				return Prefill{}, fmt.Errorf("tp=%s: want an integer >= 1", v)
			}
			p.TP = n
		default:
			return Prefill{}, fmt.Errorf("unknown key %q (want engine, kv or tp)", k)
		}
	}
	return p, p.check(false)
}

// check validates p; push requires what D needs to reach P's kvxferd.
func (p Prefill) check(push bool) error {
	if _, err := checkURL(p.URL); err != nil {
		return err
	}
	if strings.ContainsFunc(p.Engine, func(r rune) bool { return r <= ' ' || r == ',' }) {
		return fmt.Errorf("engine %q has a space, a comma or a control character", p.Engine)
	}
	if p.TP < 0 || p.TP > 1<<16 {
		return fmt.Errorf("tp = %d, want 1 to 65536", p.TP)
	}
	if p.KVHost != "" || p.KVPort != 0 {
		if p.KVHost == "" || p.KVPort <= 0 || p.KVPort > 65535 {
			return fmt.Errorf("kv = %q port %d, want host:port with a port of 1 to 65535", p.KVHost, p.KVPort)
		}
	}
	if push {
		if p.Engine == "" {
			return errors.New("engine=ID is required in push mode")
		}
		if p.KVHost == "" {
			return errors.New("kv=HOST:PORT (P's kvxferd) is required in push mode")
		}
	}
	return nil
}

func splitHostPort(hp string) (string, int, error) {
	host, ps, err := net.SplitHostPort(hp)
	if err != nil {
		return "", 0, err
	}
	port, err := strconv.Atoi(ps)
	if err != nil || port <= 0 || port > 65535 {
		return "", 0, fmt.Errorf("port %q, want 1 to 65535", ps)
	}
	if host == "" {
		return "", 0, errors.New("empty host")
	}
	return host, port, nil
}

// checkURL validates an upstream base URL and returns it without a
// trailing slash. Credentials, queries and fragments are refused: the URL
// is logged and is a metric label.
func checkURL(s string) (string, error) {
	u, err := url.Parse(s)
	if err != nil {
		return "", fmt.Errorf("URL %q: %w", s, err)
	}
	switch {
	case u.Scheme != "http" && u.Scheme != "https":
		return "", fmt.Errorf("URL %q: scheme %q, want http or https", s, u.Scheme)
	case u.Host == "" || u.Hostname() == "":
		return "", fmt.Errorf("URL %q: no host", s)
	case u.User != nil:
		return "", fmt.Errorf("URL %q: credentials in a URL are refused (clients' Authorization is forwarded)", s)
	case u.RawQuery != "" || u.ForceQuery || u.Fragment != "":
		return "", fmt.Errorf("URL %q: a base URL has no query or fragment", s)
	}
	if p := u.Port(); p != "" {
		if n, err := strconv.Atoi(p); err != nil || n <= 0 || n > 65535 {
			return "", fmt.Errorf("URL %q: port %q, want 1 to 65535", s, p)
		}
	}
	return strings.TrimRight(u.String(), "/"), nil
}

// Config configures a Proxy. Zero fields mean the documented defaults.
type Config struct {
	Mode    Mode      // ModePush (default) or ModePull
	Prefill []Prefill // P servers; at least one
	Decode  []string  // D servers' OpenAI base URLs; at least one
	Policy  Policy    // PolicyRoundRobin (default) or PolicyLeastLoaded, for P and D alike
	// Timeout bounds each upstream request, reading its response included.
	// 0 means DefaultTimeout; negative means no limit.
	Timeout time.Duration
	// MaxBody bounds a client's request body in bytes (413 above it) and
	// P's response body. 0 means DefaultMaxBody.
	MaxBody int64
	// MaxConcurrent bounds the requests served at once; more are refused
	// with 503. 0 means DefaultMaxConcurrent.
	MaxConcurrent int
	// Transport sends the upstream requests; nil means a transport of our
	// own that ignores HTTP_PROXY (upstreams are cluster-internal).
	Transport http.RoundTripper
	Logger    *slog.Logger // nil means slog.Default()
	// Fleet, when set, is what the proxy routes over instead of Prefill
	// and Decode (which must then be empty): instances that come and go
	// (kvxferd proxy -etcd). MaxFleet bounds the instances it takes
	// (0 means DefaultMaxFleet).
	Fleet    Fleet
	MaxFleet int
	// now is the clock of upstream health (tests move it); nil means
	// time.Now.
	now func() time.Time
}

// fill validates c and fills its defaults, naming the bad field.
func (c *Config) fill() error {
	switch c.Mode {
	case "":
		c.Mode = ModePush
	case ModePush, ModePull:
	default:
		return fmt.Errorf("proxy: Config.Mode = %q, want push or pull", c.Mode)
	}
	switch c.Policy {
	case "":
		c.Policy = PolicyRoundRobin
	case PolicyRoundRobin, PolicyLeastLoaded:
	default:
		return fmt.Errorf("proxy: Config.Policy = %q, want round-robin or least-loaded", c.Policy)
	}
	switch {
	case c.Fleet != nil && (len(c.Prefill) > 0 || len(c.Decode) > 0):
		return errors.New("proxy: Config.Fleet with Config.Prefill or Config.Decode: route over a fleet or fixed lists, not both")
	case c.MaxFleet < 0:
		return fmt.Errorf("proxy: Config.MaxFleet = %d, want >= 0", c.MaxFleet)
	case c.Fleet != nil:
		c.MaxFleet = cmp.Or(c.MaxFleet, DefaultMaxFleet)
	case len(c.Prefill) == 0:
		return errors.New("proxy: Config.Prefill is empty, want at least one P server")
	case len(c.Decode) == 0:
		return errors.New("proxy: Config.Decode is empty, want at least one D server")
	}
	c.Prefill = append([]Prefill(nil), c.Prefill...)
	for i := range c.Prefill {
		p := &c.Prefill[i]
		if err := p.check(c.Mode == ModePush); err != nil {
			return fmt.Errorf("proxy: Config.Prefill[%d] (%s): %w", i, p, err)
		}
		p.URL, _ = checkURL(p.URL)
		if p.TP == 0 {
			p.TP = 1
		}
	}
	c.Decode = append([]string(nil), c.Decode...)
	for i, d := range c.Decode {
		u, err := checkURL(d)
		if err != nil {
			return fmt.Errorf("proxy: Config.Decode[%d]: %w", i, err)
		}
		c.Decode[i] = u
	}
	switch {
	case c.Timeout == 0:
		c.Timeout = DefaultTimeout
	case c.Timeout < 0:
		c.Timeout = 0 // no limit
	}
	switch {
	case c.MaxBody == 0:
		c.MaxBody = DefaultMaxBody
	case c.MaxBody < 0:
		return fmt.Errorf("proxy: Config.MaxBody = %d, want > 0", c.MaxBody)
	}
	switch {
	case c.MaxConcurrent == 0:
		c.MaxConcurrent = DefaultMaxConcurrent
	case c.MaxConcurrent < 0:
		return fmt.Errorf("proxy: Config.MaxConcurrent = %d, want > 0", c.MaxConcurrent)
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	if c.now == nil {
		c.now = time.Now
	}
	return nil
}
