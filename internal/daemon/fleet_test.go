package daemon

import (
	"context"
	"log/slog"
	"net"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

// The registry's flags are kvxferd serve's and the in-process JSON's
// alike; bad values are refused naming the flag; without -etcd nothing
// of the registry starts.
func TestEtcdFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string // error substring; "" for valid
	}{
		{name: "off by default", args: nil},
		{name: "on", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-role", "producer", "-etcd-url", "http://127.0.0.1:8100"}},
		{name: "bad role", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-role", "kv_producer"}, want: `-etcd-role = "kv_producer"`},
		{name: "short ttl", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-ttl", "1s"}, want: "-etcd-ttl = 1s"},
		{name: "fractional ttl", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-ttl", "2500ms"}, want: "-etcd-ttl = 2.5s"},
		{name: "bad url", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-url", "ftp://x"}, want: `-etcd-url = "ftp://x"`},
		{name: "remote plain text", args: []string{"-etcd", "10.1.2.3:2379"}, want: "-etcd-insecure"},
		{name: "max engines", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-max-engines", "0"}, want: "-etcd-max-engines = 0"},
		// What the registry's entries refuse is refused at start, naming
		// the flag: before, the daemon started and published no engine at
		// all (each entry refused, the flag never named).
		{name: "url with a fragment", args: []string{"-etcd", "127.0.0.1:2379", "-etcd-url", "http://127.0.0.1:8100/#top"}, want: `-etcd-url = "http://127.0.0.1:8100/#top"`},
		{name: "advertised peer no entry holds", args: []string{"-etcd", "127.0.0.1:2379", "-peer-advertise", "kv~0:7600"}, want: `-peer-advertise = "kv~0:7600"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c, err := parseFlags(tc.args)
			if tc.want == "" {
				if err != nil {
					t.Fatalf("parseFlags(%q) = %v", tc.args, err)
				}
				if len(tc.args) == 0 && (c.etcd.client.Endpoints != "" || c.etcd.ttl != registry.DefaultTTL) {
					t.Errorf("defaults: %+v", c.etcd)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("parseFlags(%q) = %v, want an error with %q", tc.args, err, tc.want)
			}
		})
	}
	c, err := parseJSON([]byte(`{"etcd": "127.0.0.1:2379", "etcd_role": "consumer", "etcd-ttl": "3s"}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.etcd.client.Endpoints != "127.0.0.1:2379" || c.etcd.role != "consumer" || c.etcd.ttl.String() != "3s" {
		t.Errorf("parseJSON: %+v", c.etcd)
	}
}

// A lookup in the registry is bounded by the handshake that asked for it:
// with etcd unreachable (here a listener that never answers), a handshake
// of an engine named by its id alone ends within its own context (a
// probe's, a closing worker's), not after the lookup's own bound. Before,
// the lookup took no context and held every such handshake, and the
// Close of a worker waiting for it, for its full 2 s.
func TestFleetLookupEndsWithTheHandshake(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", runFleetLookup)
	leakcheck.Check(t, before, 0, 10*time.Second)
}

func runFleetLookup(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var held []net.Conn
	var mu sync.Mutex
	accepting := make(chan struct{})
	defer func() { ln.Close(); <-accepting }()
	go func() {
		defer close(accepting)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c) // accepted, never answered
			mu.Unlock()
		}
	}()
	defer func() {
		mu.Lock()
		for _, c := range held {
			c.Close()
		}
		mu.Unlock()
	}()
	c := etcdConfig{client: registry.ClientConfig{Endpoints: ln.Addr().String()}, prefix: "/kvxfer", ttl: registry.DefaultTTL,
		role: registry.RoleBoth, maxEngines: 10}
	f, err := startFleet(&c, "127.0.0.1:7001", slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer f.close()
	r := server.NewPeerResolver(server.ResolverConfig{Lookup: f.lookup})
	defer r.Close()
	// The lookup's own bound far past the handshake's: a lookup that
	// outlived the handshake's context would take it (a minute), not the
	// context's 100 ms and slack for a loaded machine.
	was := lookupTimeout
	t.Cleanup(func() { lookupTimeout = was })
	lookupTimeout = time.Minute
	const within = 100 * time.Millisecond
	ctx, cancel := context.WithTimeout(context.Background(), within)
	defer cancel()
	t0 := time.Now()
	_, err = r.Handshake(ctx, "P", "")
	took := time.Since(t0)
	if err == nil || !strings.Contains(err.Error(), "etcd could not be asked") {
		t.Errorf("Handshake(P) with etcd unreachable = %v, want an error saying etcd could not be asked", err)
	}
	if took > within+10*time.Second {
		t.Errorf("Handshake(P) with a context of %v returned after %v: the registry lookup outlived it", within, took.Round(time.Millisecond))
	}
}

// The registry's flags without -etcd do nothing: the daemon says so at
// start, naming them. Before, an -etcd left out (or misspelt in the
// environment) went unnoticed: the daemon published nothing and resolved
// no engine by id, and no line said why.
func TestEtcdFlagsWithoutEtcdWarned(t *testing.T) {
	// None given, none named.
	if p, err := parseFlags(nil); err != nil || len(p.etcd.ignored()) != 0 {
		t.Errorf("no registry flag given: ignored = %q, %v; want none", p.etcd.ignored(), err)
	}
	// -etcd-prefix and -etcd-ttl are given their defaults: given all the
	// same (before, a value equal to its default went unnamed), and
	// KVXFERD_ETCD_MAX_ENGINES counts as given too.
	t.Setenv("KVXFERD_ETCD_MAX_ENGINES", strconv.Itoa(registry.DefaultMaxEntries))
	p, err := parseFlags([]string{"-etcd-role", "producer", "-etcd-url", "http://127.0.0.1:8100", "-etcd-prefix", registry.DefaultPrefix,
		"-etcd-ttl", registry.DefaultTTL.String()})
	if err != nil {
		t.Fatal(err)
	}
	c := testConfig(t)
	c.etcd = p.etcd
	var buf syncBuffer
	in, err := start(c, slog.New(slog.NewTextHandler(&buf, nil)), false)
	if err != nil {
		t.Fatal(err)
	}
	defer in.shutdown()
	log := buf.String()
	if !strings.Contains(log, "without -etcd are ignored") ||
		!strings.Contains(log, `flags="-etcd-max-engines -etcd-prefix -etcd-role -etcd-ttl -etcd-url"`) {
		t.Fatalf("start's log does not name the registry flags ignored without -etcd:\n%s", log)
	}
	// libkvxfer's JSON keys likewise.
	if p, err := parseJSON([]byte(`{"etcd-role": "producer", "etcd_prefix": "/kvxfer"}`)); err != nil ||
		strings.Join(p.etcd.ignored(), " ") != "-etcd-prefix -etcd-role" {
		t.Errorf("in-process JSON without etcd: ignored = %q, %v; want -etcd-prefix -etcd-role", p.etcd.ignored(), err)
	}
	// With -etcd, none is ignored.
	if p, err := parseFlags([]string{"-etcd", "127.0.0.1:2379", "-etcd-prefix", "/fleet"}); err != nil || len(p.etcd.ignored()) != 0 {
		t.Errorf("with -etcd: ignored = %q, %v; want none", p.etcd.ignored(), err)
	}
}
