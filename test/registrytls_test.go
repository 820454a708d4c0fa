package test

import (
	"os"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/peerauth/pkitest"
)

// A daemon that cannot reach etcd for want of the right TLS settings says
// why in its log: etcd's certificate of a CA other than -etcd-ca's, its
// client certificate refused, or plain text to an etcd that speaks TLS.
// Before, each failed call logged only "context deadline exceeded" (etcd's
// client waits for a connection until a call's time runs out, and drops
// why it had none), as if etcd were down.
func TestRegistryTLSMistakesExplained(t *testing.T) {
	if _, err := etcdtest.Binary(); err != nil {
		t.Skip(err.Error())
	}
	pki := t.TempDir()
	ca, err := pkitest.NewCA(pki, "etcd")
	if err != nil {
		t.Fatal(err)
	}
	srv, _ := ca.Issue(pki, "server")
	other, _ := pkitest.NewCA(pki, "other")
	stranger, _ := other.Issue(pki, "stranger")
	etcd := etcdtest.Start(t, "--cert-file", srv.Cert, "--key-file", srv.Key, "--trusted-ca-file", ca.Path, "--client-cert-auth")
	dir := world(t)
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"wrong CA", []string{"-etcd-ca", other.Path}, "certificate signed by unknown authority"},
		{"plain text to TLS", nil, "speaks TLS"},
		{"client certificate of another CA", []string{"-etcd-ca", ca.Path, "-etcd-cert", stranger.Cert, "-etcd-key", stranger.Key}, "refused this client's certificate"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			d := startDaemon(t, dir, "D"+strings.ReplaceAll(tc.name, " ", ""), append([]string{"-etcd", etcd.Endpoint(), "-etcd-ttl", "2s"}, tc.args...)...)
			for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
				b, _ := os.ReadFile(d.Log)
				if strings.Contains(string(b), tc.want) {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("20 s on, the daemon's log does not say %q:\n%s", tc.want, b)
				}
			}
		})
	}
}
