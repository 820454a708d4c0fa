package registry_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/peerauth/pkitest"
)

// etcd over TLS with client certificates: a registrar and a view with a
// certificate of etcd's CA work; a client with none, or one of another
// CA, is refused.
func TestTLSClientCertificates(t *testing.T) {
	if _, err := etcdtest.Binary(); err != nil {
		t.Skip(err.Error())
	}
	dir := t.TempDir()
	ca, err := pkitest.NewCA(dir, "etcd")
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := ca.Issue(dir, "server")
	cli, _ := ca.Issue(dir, "client")
	other, _ := pkitest.NewCA(dir, "other")
	stranger, _ := other.Issue(dir, "stranger")
	etcd := etcdtest.Start(t, "--cert-file", srv.Cert, "--key-file", srv.Key, "--trusted-ca-file", ca.Path, "--client-cert-auth")
	good := registry.ClientConfig{Endpoints: etcd.Endpoint(), CA: ca.Path, Cert: cli.Cert, Key: cli.Key}
	rcl, err := registry.Dial(good)
	if err != nil {
		t.Fatal(err)
	}
	defer rcl.Close()
	rec := newRecorder()
	vcl, _ := registry.Dial(good)
	defer vcl.Close()
	v, _ := registry.NewView(registry.ViewConfig{Client: vcl, OnChange: rec.on})
	defer v.Close()
	r, _ := registry.NewRegistrar(registry.RegistrarConfig{Client: rcl})
	defer r.Close(context.Background())
	_ = r.Set([]registry.Entry{entry("P", "127.0.0.1:7001", 1)})
	want(t, rec.next(t, 10*time.Second), registry.Join, "P", 1)

	for name, cfg := range map[string]registry.ClientConfig{
		"no client certificate":            {Endpoints: etcd.Endpoint(), CA: ca.Path},
		"a client certificate of other CA": {Endpoints: etcd.Endpoint(), CA: ca.Path, Cert: stranger.Cert, Key: stranger.Key},
	} {
		cl, err := registry.Dial(cfg)
		if err != nil {
			t.Fatalf("%s: Dial = %v", name, err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err = cl.Get(ctx, "/kvxfer/")
		cancel()
		cl.Close()
		if err == nil {
			t.Errorf("%s: etcd answered, want refused", name)
		}
	}
}

func TestClientConfigValidate(t *testing.T) {
	for _, tc := range []struct {
		name string
		cfg  registry.ClientConfig
		want string // "" for valid
	}{
		{name: "loopback plain text", cfg: registry.ClientConfig{Endpoints: "127.0.0.1:2379,localhost:2379"}},
		{name: "remote plain text refused", cfg: registry.ClientConfig{Endpoints: "10.0.0.1:2379"}, want: "not on loopback"},
		{name: "remote plain text, insecure", cfg: registry.ClientConfig{Endpoints: "10.0.0.1:2379", Insecure: true}},
		{name: "remote with TLS", cfg: registry.ClientConfig{Endpoints: "https://10.0.0.1:2379", CA: "ca.pem"}},
		// etcd's client drops TLS for an http:// endpoint, -etcd-ca or not.
		{name: "remote http:// with a CA refused", cfg: registry.ClientConfig{Endpoints: "https://10.0.0.2:2379,http://10.0.0.1:2379", CA: "ca.pem"}, want: "http:// is plain text"},
		{name: "remote http:// with a CA, insecure", cfg: registry.ClientConfig{Endpoints: "http://10.0.0.1:2379", CA: "ca.pem", Insecure: true}},
		{name: "remote host:port with a CA", cfg: registry.ClientConfig{Endpoints: "10.0.0.1:2379", CA: "ca.pem"}},
		{name: "https without a CA", cfg: registry.ClientConfig{Endpoints: "https://127.0.0.1:2379"}, want: "needs -etcd-ca"},
		{name: "no port", cfg: registry.ClientConfig{Endpoints: "127.0.0.1"}, want: `-etcd endpoint "127.0.0.1"`},
		{name: "cert without key", cfg: registry.ClientConfig{Endpoints: "127.0.0.1:2379", Cert: "c.pem"}, want: "needs both"},
		{name: "empty", cfg: registry.ClientConfig{Endpoints: " , "}, want: "no endpoint"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.cfg.Validate()
			if (tc.want == "") != (err == nil) || (err != nil && !strings.Contains(err.Error(), tc.want)) {
				t.Fatalf("Validate() = %v, want %q", err, tc.want)
			}
		})
	}
}

// An endpoint with user info (user:password@host:port) is refused, naming
// the flag and not the password: before, the user info was dropped without
// a word (etcd's client takes no credentials from its endpoints, and
// kvxfer uses no etcd password) and the daemon logged the endpoint as
// given, password included ("kvxferd: fleet registry on etcd"
// endpoints=http://user:s3cret@...).
func TestEndpointUserInfoRefused(t *testing.T) {
	for _, ep := range []string{"http://user:s3cret@127.0.0.1:2379", "user:s3cret@127.0.0.1:2379", "127.0.0.1:2379,https://u:s3cret@10.0.0.1:2379"} {
		c := registry.ClientConfig{Endpoints: ep, CA: map[bool]string{true: "ca.pem"}[strings.Contains(ep, "https")]}
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), "-etcd endpoint") || !strings.Contains(err.Error(), "user info") {
			t.Errorf("-etcd %q: Validate() = %v, want an error naming -etcd and the user info", ep, err)
		}
		if err != nil && strings.Contains(err.Error(), "s3cret") {
			t.Errorf("-etcd %q: the error quotes the password: %v", ep, err)
		}
	}
}

// etcd's client takes one transport for all its endpoints, that of the
// first one's scheme: with an http:// endpoint first, an https:// one
// after it was spoken to in plain text, its certificate never asked for
// (here a plain-text etcd behind the https:// endpoint, as anyone on the
// path could be, answered), and the check that refuses plain text off
// loopback never saw it. Endpoints of both schemes are refused, naming
// them; one scheme for all works as before.
func TestMixedSchemesRefused(t *testing.T) {
	etcd := etcdtest.Start(t) // plain text
	dir := t.TempDir()
	ca, err := pkitest.NewCA(dir, "etcd")
	if err != nil {
		t.Fatal(err)
	}
	dead := "127.0.0.1:1" // nothing listens: the client goes on to the next endpoint
	cfg := registry.ClientConfig{Endpoints: "http://" + dead + ",https://" + etcd.Endpoint(), CA: ca.Path}
	cl, err := registry.Dial(cfg)
	if err == nil {
		defer cl.Close()
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, gerr := cl.Get(ctx, "/kvxfer/")
		cancel()
		if gerr == nil {
			t.Fatalf("Dial(%s) spoke plain text to the https:// endpoint (a plain-text server answered it)", cfg.Endpoints)
		}
		t.Fatalf("Dial(%s) = nil error, want endpoints of both schemes refused", cfg.Endpoints)
	}
	if !strings.Contains(err.Error(), "http://"+dead) || !strings.Contains(err.Error(), "https://"+etcd.Endpoint()) {
		t.Errorf("Dial(%s) = %v, want an error naming both endpoints", cfg.Endpoints, err)
	}
	for _, eps := range []string{"https://10.0.0.2:2379,http://127.0.0.1:2379", "127.0.0.1:2379,http://127.0.0.1:2380"} {
		c := registry.ClientConfig{Endpoints: eps, CA: ca.Path, Insecure: true}
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "one scheme") {
			t.Errorf("Validate(%s, -etcd-ca, -etcd-insecure) = %v, want endpoints of both schemes refused", eps, err)
		}
	}
	for _, c := range []registry.ClientConfig{{Endpoints: "http://127.0.0.1:2379,127.0.0.1:2380"}, {Endpoints: "https://10.0.0.1:2379,10.0.0.2:2379", CA: ca.Path}} {
		if err := c.Validate(); err != nil {
			t.Errorf("Validate(%s) = %v, want nil", c.Endpoints, err)
		}
	}
}

// Explain says what etcd's client does not: an endpoint that refuses the
// connection, or speaks plain text to a TLS client; nothing when an
// endpoint takes the connection as configured.
func TestExplain(t *testing.T) {
	plain := etcdtest.Start(t)
	ctx := context.Background()
	if err := (registry.ClientConfig{Endpoints: plain.Endpoint()}).Explain(ctx); err != nil {
		t.Errorf("Explain with etcd up = %v, want nil", err)
	}
	ca, err := pkitest.NewCA(t.TempDir(), "etcd")
	if err != nil {
		t.Fatal(err)
	}
	if err := (registry.ClientConfig{Endpoints: plain.Endpoint(), CA: ca.Path}).Explain(ctx); err == nil || !strings.Contains(err.Error(), "plain text?") {
		t.Errorf("Explain of TLS to a plain-text etcd = %v, want it named", err)
	}
	plain.Kill()
	if err := (registry.ClientConfig{Endpoints: plain.Endpoint()}).Explain(ctx); err == nil || !strings.Contains(err.Error(), "refused") {
		t.Errorf("Explain with etcd down = %v, want connection refused", err)
	}
}
