package proxy

import (
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"reflect"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

const (
	goodP = "http://10.0.0.1:8100,engine=p0,kv=10.0.0.1:7400,tp=2"
	goodD = "http://10.0.0.2:8200"
)

func TestParseFlags(t *testing.T) {
	f, err := parseFlags([]string{"-prefill", goodP, "-prefill", "https://p1.example:443/base/,engine=p1,kv=[fd00::1]:7401",
		"-decode", goodD, "-decode", "http://d1:8200/", "-policy", "least-loaded", "-timeout", "0", "-max-body", "1000"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	wantP := []Prefill{
		{URL: "http://10.0.0.1:8100", Engine: "p0", KVHost: "10.0.0.1", KVPort: 7400, TP: 2},
		{URL: "https://p1.example:443/base", Engine: "p1", KVHost: "fd00::1", KVPort: 7401, TP: 1},
	}
	if !reflect.DeepEqual(f.cfg.Prefill, wantP) {
		t.Errorf("Prefill = %+v, want %+v", f.cfg.Prefill, wantP)
	}
	if want := []string{goodD, "http://d1:8200"}; !reflect.DeepEqual(f.cfg.Decode, want) {
		t.Errorf("Decode = %v, want %v", f.cfg.Decode, want)
	}
	if f.cfg.Mode != ModePush || f.cfg.Policy != PolicyLeastLoaded || f.cfg.Timeout != -1 || f.cfg.MaxBody != 1000 || f.listen != "127.0.0.1:8000" {
		t.Errorf("flags = %+v", f)
	}
}

// Bad flags are refused with the flag and the value named.
func TestParseFlagsErrors(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want []string // substrings of the error
	}{
		{"bad mode", []string{"-mode", "sideways", "-prefill", goodP, "-decode", goodD}, []string{"-mode", "sideways"}},
		{"bad policy", []string{"-policy", "random", "-prefill", goodP, "-decode", goodD}, []string{"-policy", "random"}},
		{"no prefill", []string{"-decode", goodD}, []string{"-prefill"}},
		{"no decode", []string{"-prefill", goodP}, []string{"-decode"}},
		{"push needs engine", []string{"-prefill", "http://p:1,kv=h:2", "-decode", goodD}, []string{"-prefill", "http://p:1,kv=h:2", "engine"}},
		{"push needs kv", []string{"-prefill", "http://p:1,engine=e", "-decode", goodD}, []string{"-prefill", "kv=HOST:PORT"}},
		{"pull needs neither", []string{"-mode", "pull", "-prefill", "http://p:1", "-decode", goodD}, nil},
		{"prefill scheme", []string{"-prefill", "ftp://p:1,engine=e,kv=h:2", "-decode", goodD}, []string{"-prefill", "ftp://p:1", "scheme"}},
		{"prefill no host", []string{"-prefill", "http://,engine=e,kv=h:2", "-decode", goodD}, []string{"-prefill", "no host"}},
		{"prefill unknown key", []string{"-prefill", "http://p:1,engine=e,kv=h:2,dp=2", "-decode", goodD}, []string{"-prefill", `"dp"`}},
		{"prefill duplicate key", []string{"-prefill", "http://p:1,engine=e,engine=f,kv=h:2", "-decode", goodD}, []string{"-prefill", "engine given twice"}},
		{"prefill tp 0", []string{"-prefill", "http://p:1,engine=e,kv=h:2,tp=0", "-decode", goodD}, []string{"-prefill", "tp=0"}},
		{"prefill tp not a number", []string{"-prefill", "http://p:1,engine=e,kv=h:2,tp=two", "-decode", goodD}, []string{"-prefill", "tp=two"}},
		{"prefill kv without port", []string{"-prefill", "http://p:1,engine=e,kv=h", "-decode", goodD}, []string{"-prefill", "kv=h"}},
		{"prefill kv port range", []string{"-prefill", "http://p:1,engine=e,kv=h:70000", "-decode", goodD}, []string{"-prefill", "70000"}},
		{"prefill item without =", []string{"-prefill", "http://p:1,engine", "-decode", goodD}, []string{"-prefill", `"engine"`}},
		{"decode credentials", []string{"-prefill", goodP, "-decode", "http://u:pw@d:1"}, []string{"-decode", "credentials"}},
		{"decode query", []string{"-prefill", goodP, "-decode", "http://d:1/?x=1"}, []string{"-decode", "query"}},
		{"decode port", []string{"-prefill", goodP, "-decode", "http://d:0"}, []string{"-decode", `port "0"`}},
		{"listen", []string{"-listen", "8000", "-prefill", goodP, "-decode", goodD}, []string{"-listen", "8000"}},
		{"timeout", []string{"-timeout", "-1s", "-prefill", goodP, "-decode", goodD}, []string{"-timeout", "-1s"}},
		{"max body", []string{"-max-body", "0", "-prefill", goodP, "-decode", goodD}, []string{"-max-body", "0"}},
		{"max concurrent", []string{"-max-concurrent", "-3", "-prefill", goodP, "-decode", goodD}, []string{"-max-concurrent", "-3"}},
		{"log level", []string{"-log-level", "loud", "-prefill", goodP, "-decode", goodD}, []string{"-log-level", "loud"}},
		{"argument", []string{"-prefill", goodP, "-decode", goodD, "extra"}, []string{"extra"}},
		{"etcd alone", []string{"-etcd", "127.0.0.1:2379"}, nil},
		{"etcd with fixed lists", []string{"-etcd", "127.0.0.1:2379", "-prefill", goodP}, []string{"-etcd", "-prefill"}},
		{"etcd max fleet", []string{"-etcd", "127.0.0.1:2379", "-max-fleet", "0"}, []string{"-max-fleet", "0"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := parseFlags(tc.args, io.Discard)
			if tc.want == nil {
				if err != nil {
					t.Errorf("parseFlags(%q) = %v, want no error", tc.args, err)
				}
				return
			}
			if err == nil {
				t.Fatalf("parseFlags(%q) = nil, want an error naming %q", tc.args, tc.want)
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("parseFlags(%q) = %q, want it to name %q", tc.args, err, w)
				}
			}
		})
	}
}

func TestFlagsFromEnvironment(t *testing.T) {
	t.Setenv("KVXFERD_PROXY_MODE", "pull")
	t.Setenv("KVXFERD_PROXY_PREFILL", "http://p0:1 http://p1:1")
	t.Setenv("KVXFERD_PROXY_DECODE", goodD)
	t.Setenv("KVXFERD_PROXY_MAX_CONCURRENT", "7")
	f, err := parseFlags([]string{"-decode", "http://d9:1"}, io.Discard) // a flag replaces the environment's list
	if err != nil {
		t.Fatal(err)
	}
	if f.cfg.Mode != ModePull || len(f.cfg.Prefill) != 2 || f.cfg.MaxConcurrent != 7 {
		t.Errorf("cfg = %+v, want pull, 2 P servers, 7 at once", f.cfg)
	}
	if want := []string{"http://d9:1"}; !reflect.DeepEqual(f.cfg.Decode, want) {
		t.Errorf("Decode = %v, want %v", f.cfg.Decode, want)
	}
	t.Setenv("KVXFERD_PROXY_POLICY", "nope")
	if _, err := parseFlags(nil, io.Discard); err == nil || !strings.Contains(err.Error(), "KVXFERD_PROXY_POLICY") {
		t.Errorf("bad environment: err = %v, want it to name KVXFERD_PROXY_POLICY", err)
	}
}

// A KVXFERD_PROXY_ variable that names no flag is refused, naming it, as
// kvxferd serve refuses a KVXFERD_ one (README: "Running kvxferd"; serve
// leaves KVXFERD_PROXY_* to the proxy): before, a misspelt one
// (KVXFERD_PROXY_PREFIL) was ignored by both, its flag left at the default.
func TestUnknownEnvironmentRefused(t *testing.T) {
	t.Setenv("KVXFERD_PROXY_PREFIL", "http://p0:1")
	_, err := parseFlags([]string{"-prefill", "http://p0:1", "-decode", goodD, "-mode", "pull"}, io.Discard)
	if err == nil || !strings.Contains(err.Error(), "KVXFERD_PROXY_PREFIL ") {
		t.Errorf("KVXFERD_PROXY_PREFIL set: err = %v, want an error naming the variable", err)
	}
}

func TestHelp(t *testing.T) {
	if _, err := parseFlags([]string{"-h"}, io.Discard); !errors.Is(err, flag.ErrHelp) {
		t.Errorf("parseFlags(-h) = %v, want flag.ErrHelp", err)
	}
}

// New names the bad Config field.
func TestNewErrors(t *testing.T) {
	good := Config{Prefill: []Prefill{{URL: "http://p:1", Engine: "e", KVHost: "h", KVPort: 1}}, Decode: []string{goodD}}
	for _, tc := range []struct {
		name string
		edit func(*Config)
		want string
	}{
		{"mode", func(c *Config) { c.Mode = "x" }, "Config.Mode"},
		{"policy", func(c *Config) { c.Policy = "x" }, "Config.Policy"},
		{"no prefill", func(c *Config) { c.Prefill = nil }, "Config.Prefill"},
		{"no decode", func(c *Config) { c.Decode = nil }, "Config.Decode"},
		{"push without engine", func(c *Config) { c.Prefill = []Prefill{{URL: "http://p:1", KVHost: "h", KVPort: 1}} }, "Config.Prefill[0]"},
		{"bad decode URL", func(c *Config) { c.Decode = []string{goodD, "d:1"} }, "Config.Decode[1]"},
		{"max body", func(c *Config) { c.MaxBody = -1 }, "Config.MaxBody"},
		{"max concurrent", func(c *Config) { c.MaxConcurrent = -1 }, "Config.MaxConcurrent"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := good
			tc.edit(&c)
			if _, err := New(c); err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("New = %v, want an error naming %s", err, tc.want)
			}
		})
	}
}

// serve answers until its context ends, then drains and returns, leaving
// no goroutine behind.
func TestServeShutdown(t *testing.T) {
	before := runtime.NumGoroutine()
	d := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, `{"object":"list","data":[]}`)
	}))
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cfg := Config{Mode: ModePull, Prefill: []Prefill{{URL: "http://127.0.0.1:1"}}, Decode: []string{d.URL},
		Logger: discardLogger()}
	done := make(chan error, 1)
	go func() { done <- serve(ctx, ln, cfg, 5*time.Second) }()
	tr := &http.Transport{}
	client := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	resp, err := client.Get("http://" + ln.Addr().String() + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK || !strings.Contains(string(body), `"list"`) {
		t.Errorf("GET /v1/models = %d %s", resp.StatusCode, body)
	}
	cancel()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("serve = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("serve did not return 10 s after its context ended")
	}
	tr.CloseIdleConnections()
	d.Close()
	leakcheck.Check(t, before, 0, 10*time.Second)
}

// The proxy's -etcd-* flags without -etcd do nothing: they are named (a
// warning at start), so an -etcd left out is seen; with -etcd, none is.
func TestEtcdFlagsWithoutEtcdNamed(t *testing.T) {
	f, err := parseFlags([]string{"-prefill", goodP, "-decode", goodD, "-etcd-ca", "/ca.pem", "-etcd-prefix", "/fleet"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := f.etcdIgnored(), []string{"-etcd-ca", "-etcd-prefix"}; !reflect.DeepEqual(got, want) {
		t.Errorf("ignored = %q, want %q", got, want)
	}
	if f, err := parseFlags([]string{"-prefill", goodP, "-decode", goodD}, io.Discard); err != nil || len(f.etcdIgnored()) != 0 {
		t.Errorf("none given: ignored = %q, %v; want none", f.etcdIgnored(), err)
	}
	// Given their default values, on the command line or in the
	// environment, they are given all the same: before, -etcd-prefix
	// /kvxfer and -max-fleet at its default went unnamed.
	t.Setenv("KVXFERD_PROXY_MAX_FLEET", strconv.Itoa(DefaultMaxFleet))
	f, err = parseFlags([]string{"-prefill", goodP, "-decode", goodD, "-etcd-prefix", "/kvxfer", "-etcd-insecure=false"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := f.etcdIgnored(), []string{"-etcd-insecure", "-etcd-prefix", "-max-fleet"}; !reflect.DeepEqual(got, want) {
		t.Errorf("ignored, given defaults = %q, want %q", got, want)
	}
	f, err = parseFlags([]string{"-etcd", "127.0.0.1:2379", "-etcd-prefix", "/fleet"}, io.Discard)
	if err != nil {
		t.Fatal(err)
	}
	if got := f.etcdIgnored(); len(got) != 0 {
		t.Errorf("ignored with -etcd = %q, want none", got)
	}
}
