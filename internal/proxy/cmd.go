package proxy

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/envflag"
)

// flags is `kvxferd proxy`'s command line.
type flags struct {
	cfg          Config
	fleet        FleetFlags
	listen       string
	logLevel     string
	drainTimeout time.Duration
	etcdGiven    []string // the -etcd-* flags and -max-fleet given (envflag.Given)
}

// listFlag is a repeatable flag; one value may also hold several items
// separated by spaces (how KVXFERD_PROXY_PREFILL lists several servers).
// Values from the environment are replaced by the first one on the
// command line.
type listFlag struct {
	items   []string
	fromEnv bool
	check   func(string) error
}

func (l *listFlag) String() string { return strings.Join(l.items, " ") }

func (l *listFlag) Set(v string) error {
	if l.fromEnv {
		l.items, l.fromEnv = nil, false
	}
	fields := strings.Fields(v)
	if len(fields) == 0 {
		return errors.New("empty")
	}
	for _, f := range fields {
		if err := l.check(f); err != nil {
			return fmt.Errorf("%q: %w", f, err)
		}
	}
	l.items = append(l.items, fields...)
	return nil
}

// choiceFlag is a flag with a fixed set of values.
type choiceFlag struct {
	v       *string
	allowed []string
}

func (c choiceFlag) String() string {
	if c.v == nil {
		return ""
	}
	return *c.v
}

func (c choiceFlag) Set(s string) error {
	if !slices.Contains(c.allowed, s) {
		return fmt.Errorf("want %s", strings.Join(c.allowed, " or "))
	}
	*c.v = s
	return nil
}

// parseFlags parses `kvxferd proxy`'s flags, writing usage to usage on
// -h and on errors.
func parseFlags(args []string, usage io.Writer) (*flags, error) {
	f := &flags{}
	fs := flag.NewFlagSet("kvxferd proxy", flag.ContinueOnError)
	fs.SetOutput(usage)
	mode, policy := string(ModePush), string(PolicyRoundRobin)
	var timeout time.Duration
	prefill := &listFlag{check: func(s string) error { _, err := ParsePrefill(s); return err }}
	decode := &listFlag{check: func(s string) error { _, err := checkURL(s); return err }}
	fs.StringVar(&f.listen, "listen", "127.0.0.1:8000", "address of the OpenAI-compatible HTTP front")
	fs.Var(choiceFlag{&mode, []string{string(ModePush), string(ModePull)}}, "mode",
		"push (P and D at once, P WRITEs the KV) or pull (P first, D READs the KV)")
	fs.Var(prefill, "prefill", "P server, repeatable: URL,engine=ID,kv=HOST:PORT[,tp=N] (engine and kv, P's kvxferd, required in push mode; tp default 1)")
	fs.Var(decode, "decode", "D server's base URL, repeatable, e.g. http://10.0.0.2:8200")
	fs.Var(choiceFlag{&policy, []string{string(PolicyRoundRobin), string(PolicyLeastLoaded)}}, "policy",
		"how P and D servers are picked: round-robin or least-loaded (fewest in flight, ties in turn)")
	fs.DurationVar(&timeout, "timeout", DefaultTimeout, "limit on each upstream request, its response read whole included (0: none)")
	fs.Int64Var(&f.cfg.MaxBody, "max-body", DefaultMaxBody, "largest request body in bytes (413 above)")
	fs.IntVar(&f.cfg.MaxConcurrent, "max-concurrent", DefaultMaxConcurrent, "requests served at once (503 above)")
	fs.DurationVar(&f.drainTimeout, "drain-timeout", 30*time.Second, "how long shutdown waits for requests in flight")
	fs.StringVar(&f.logLevel, "log-level", "info", "debug, info, warn or error")
	fs.StringVar(&f.fleet.Endpoints, "etcd", "", "etcd endpoints, comma-separated: route over the P and D instances registered there "+
		"(kvxferd -etcd -etcd-url), learned as they register and forgotten when their lease ends, instead of -prefill and -decode")
	fs.StringVar(&f.fleet.CA, "etcd-ca", "", "CA (PEM) of etcd's certificate: TLS to etcd")
	fs.StringVar(&f.fleet.Cert, "etcd-cert", "", "client certificate (PEM) for etcd, with -etcd-key")
	fs.StringVar(&f.fleet.Key, "etcd-key", "", "the key of -etcd-cert (PEM)")
	fs.BoolVar(&f.fleet.Insecure, "etcd-insecure", false, "allow plain-text -etcd endpoints off loopback")
	fs.StringVar(&f.fleet.Prefix, "etcd-prefix", "/kvxfer", "key prefix of the registry in etcd")
	fs.IntVar(&f.cfg.MaxFleet, "max-fleet", DefaultMaxFleet, "instances of the -etcd fleet routed over at most")
	// Environment first (KVXFERD_PROXY_<FLAG>), flags override.
	if err := envflag.Load(fs, "KVXFERD_PROXY_", "kvxferd proxy", "prefill"); err != nil {
		return nil, err
	}
	prefill.fromEnv, decode.fromEnv = true, true
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	f.etcdGiven = envflag.Given(fs, func(name string) bool { return strings.HasPrefix(name, "etcd-") || name == "max-fleet" })
	if fs.NArg() > 0 {
		return nil, fmt.Errorf("unexpected argument %q (flags only)", fs.Arg(0))
	}
	if _, _, err := net.SplitHostPort(f.listen); err != nil {
		return nil, fmt.Errorf("-listen = %q: %w", f.listen, err)
	}
	f.cfg.Mode, f.cfg.Policy = Mode(mode), Policy(policy) // checked by Set
	switch {
	case f.fleet.Endpoints != "" && (len(prefill.items) > 0 || len(decode.items) > 0):
		return nil, errors.New("-etcd with -prefill or -decode: route over the registry's fleet or over fixed lists, not both")
	case f.fleet.Endpoints != "" && f.cfg.MaxFleet <= 0:
		return nil, fmt.Errorf("-max-fleet = %d, want > 0", f.cfg.MaxFleet)
	case f.fleet.Endpoints != "":
	case len(prefill.items) == 0:
		return nil, errors.New("-prefill: no P server given, want at least one")
	case len(decode.items) == 0:
		return nil, errors.New("-decode: no D server given, want at least one")
	}
	for _, s := range prefill.items {
		pf, _ := ParsePrefill(s) // checked by Set
		if err := pf.check(f.cfg.Mode == ModePush); err != nil {
			return nil, fmt.Errorf("-prefill %q: %w", s, err)
		}
		f.cfg.Prefill = append(f.cfg.Prefill, pf)
	}
	for _, s := range decode.items {
		u, _ := checkURL(s) // checked by Set
		f.cfg.Decode = append(f.cfg.Decode, u)
	}
	switch {
	case timeout < 0:
		return nil, fmt.Errorf("-timeout = %v, want >= 0 (0: no limit)", timeout)
	case timeout == 0:
		f.cfg.Timeout = -1 // Config's "no limit"
	default:
		f.cfg.Timeout = timeout
	}
	if f.cfg.MaxBody <= 0 {
		return nil, fmt.Errorf("-max-body = %d, want > 0", f.cfg.MaxBody)
	}
	if f.cfg.MaxConcurrent <= 0 {
		return nil, fmt.Errorf("-max-concurrent = %d, want > 0", f.cfg.MaxConcurrent)
	}
	if f.drainTimeout < 0 {
		return nil, fmt.Errorf("-drain-timeout = %v, want >= 0", f.drainTimeout)
	}
	var level slog.Level
	if err := level.UnmarshalText([]byte(f.logLevel)); err != nil {
		return nil, fmt.Errorf("-log-level = %q: %w", f.logLevel, err)
	}
	f.cfg.Logger = slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	return f, nil
}

// etcdIgnored names the -etcd-* flags (and -max-fleet) given (on the
// command line or in the environment, whatever their value: one given
// its default counts) while -etcd is not set: they do nothing then.
func (f *flags) etcdIgnored() []string {
	if f.fleet.Endpoints != "" {
		return nil
	}
	return f.etcdGiven
}

// Main runs `kvxferd proxy` with command-line flags (also read from
// KVXFERD_PROXY_<FLAG>) until SIGTERM or SIGINT, then shuts down
// gracefully.
func Main(args []string) error { return MainWithFleet(args, nil) }

// FleetFlags are `kvxferd proxy`'s -etcd flags, for OpenFleet.
type FleetFlags struct {
	Endpoints, CA, Cert, Key, Prefix string
	Insecure                         bool
}

// OpenFleet opens the Fleet of -etcd; stop stops it (after the proxy
// closed).
type OpenFleet func(FleetFlags, *slog.Logger) (f Fleet, stop func(), err error)

// MainWithFleet is Main, with open opening the fleet of -etcd (nil: the
// build has none, and -etcd is an error).
func MainWithFleet(args []string, open OpenFleet) error {
	f, err := parseFlags(args, os.Stderr)
	if err != nil {
		return err
	}
	if names := f.etcdIgnored(); len(names) > 0 {
		f.cfg.Logger.Warn("kvxferd proxy: registry flags given without -etcd are ignored: routing over -prefill and -decode",
			"flags", strings.Join(names, " "))
	}
	if f.fleet.Endpoints != "" {
		if open == nil {
			return errors.New("-etcd: this build of the proxy has no registry")
		}
		fl, stop, err := open(f.fleet, f.cfg.Logger)
		if err != nil {
			return err
		}
		defer stop()
		f.cfg.Fleet = fl
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	ln, err := net.Listen("tcp", f.listen)
	if err != nil {
		return fmt.Errorf("-listen: %w", err)
	}
	return serve(ctx, ln, f.cfg, f.drainTimeout)
}

// serve serves the proxy on ln until ctx ends, then stops taking
// requests, waits up to drain for those in flight, cuts the rest and
// returns once every handler has ended.
func serve(ctx context.Context, ln net.Listener, cfg Config, drain time.Duration) error {
	p, err := New(cfg)
	if err != nil {
		ln.Close()
		return err
	}
	log := p.log
	srv := &http.Server{
		Handler:           p,
		ReadHeaderTimeout: 10 * time.Second,
		IdleTimeout:       2 * time.Minute,
		MaxHeaderBytes:    1 << 20,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
		// No ReadTimeout or WriteTimeout: they would cut long streams.
		// Bodies are read under a deadline of their own (readBody).
	}
	serveErr := make(chan error, 1)
	go func() { serveErr <- srv.Serve(ln) }()
	log.Info("kvxferd proxy: serving", "addr", ln.Addr().String(), "mode", p.cfg.Mode, "policy", p.cfg.Policy,
		"prefill", len(p.prefill), "decode", len(p.decode), "fleet", p.fleet != nil)
	var err2 error
	select {
	case <-ctx.Done():
	case err2 = <-serveErr:
		log.Error("kvxferd proxy: server stopped", "err", err2)
	}
	log.Info("kvxferd proxy: shutting down")
	dctx, cancel := context.WithTimeout(context.Background(), drain)
	defer cancel()
	if err := srv.Shutdown(dctx); err != nil {
		log.Warn("kvxferd proxy: drain timed out, cutting requests in flight", "err", err)
		_ = srv.Close() // cancels the requests' contexts, and so their upstream requests
	}
	_ = p.Close()
	log.Info("kvxferd proxy: stopped")
	if errors.Is(err2, http.ErrServerClosed) {
		err2 = nil
	}
	return err2
}
