package netxfer

import (
	"bytes"
	"crypto/tls"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/peerauth"
	"github.com/kvxfer/kvxfer/internal/peerauth/pkitest"
)

func tlsConfigs(t testing.TB, ca *pkitest.CA, dir, name string) (client, server *tls.Config) {
	t.Helper()
	f, err := ca.Issue(dir, name)
	if err != nil {
		t.Fatal(err)
	}
	client, server, err = peerauth.LoadTLS(f.Cert, f.Key, f.CA)
	if err != nil {
		t.Fatal(err)
	}
	return client, server
}

func tlsAgent(t testing.TB, name string, client, server *tls.Config, size int) (*Agent, []byte) {
	t.Helper()
	ag, err := New(Config{Name: fmt.Sprintf("%s-%d", name, rand.Uint64()), DisableLocal: true, Conns: 2, ClientTLS: client, ServerTLS: server})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = ag.Close() })
	mem := make([]byte, size)
	if err := ag.Map(base, mem); err != nil {
		t.Fatal(err)
	}
	if err := ag.Register([]Region{{base, uint64(size)}}); err != nil {
		t.Fatal(err)
	}
	return ag, mem
}

// Mutual TLS on the data plane: agents with certificates of one CA move
// bytes; a certificate of another CA, or none, moves nothing.
func TestMutualTLS(t *testing.T) {
	dir := t.TempDir()
	ca, err := pkitest.NewCA(dir, "cluster")
	if err != nil {
		t.Fatal(err)
	}
	rogue, err := pkitest.NewCA(dir, "rogue")
	if err != nil {
		t.Fatal(err)
	}
	ac, as := tlsConfigs(t, ca, dir, "a")
	bc, bs := tlsConfigs(t, ca, dir, "b")
	a, am := tlsAgent(t, "a", ac, as, 1<<16)
	b, bm := tlsAgent(t, "b", bc, bs, 1<<16)
	if _, err := a.LoadPeer(b.Metadata()); err != nil {
		t.Fatal(err)
	}
	fill(am, 5)
	id, err := a.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 1 << 15}}, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	if st, err := wait(t, a, id); st != Done || !bytes.Equal(bm[:1<<15], am[:1<<15]) {
		t.Fatalf("write over mutual TLS: %v, %v", st, err)
	}
	if n := waitNotif(t, b); len(n) != 1 || string(n[0].Msg) != "done" {
		t.Fatalf("notifications: %+v", n)
	}
	// A certificate of another CA.
	rc, rs := tlsConfigs(t, rogue, dir, "r")
	r, rm := tlsAgent(t, "r", rc, rs, 1<<16)
	fill(rm, 6)
	before := bytes.Clone(bm)
	if _, err := r.LoadPeer(b.Metadata()); err != nil {
		t.Fatal(err)
	}
	id, err = r.Post(Write, b.Name(), []Desc{{Local: base, Remote: base, Len: 4096}}, []byte("x"))
	if err == nil {
		var st State
		if st, err = wait(t, r, id); st != Failed {
			t.Fatalf("write with a rogue certificate: %v", st)
		}
	}
	if !errors.Is(err, ErrXferFailed) {
		t.Errorf("write with a rogue certificate: %v", err)
	}
	// No TLS at all.
	nc, err := net.Dial("tcp", b.Addr())
	if err != nil {
		t.Fatal(err)
	}
	_, _ = nc.Write([]byte("KVXN\x01\x04\x00evil"))
	_ = nc.SetReadDeadline(time.Now().Add(10 * time.Second))
	for buf := make([]byte, 512); ; {
		if _, err := nc.Read(buf); err != nil {
			break
		}
	}
	nc.Close()
	time.Sleep(50 * time.Millisecond)
	if !bytes.Equal(bm, before) || len(b.Drain(nil)) != 0 {
		t.Error("bytes or notifications landed without a certificate of the cluster's CA")
	}
	if b.TLSFailures() < 2 {
		t.Errorf("TLS failures counted: %d, want 2", b.TLSFailures())
	}
}
