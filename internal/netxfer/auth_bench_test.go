package netxfer

import (
	"crypto/tls"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/peerauth"
	"github.com/kvxfer/kvxfer/internal/peerauth/pkitest"
)

// BenchmarkAuth: what peer authentication (shared secret: psk; mutual
// TLS: mtls) costs the built-in backend over loopback TCP, against none: steady-state bandwidth (one
// 8 MiB WRITE in 1 MiB pieces, or 4 KiB pieces, over connections already
// open) and connection setup (a fresh peer: dial, authenticate, hello and
// a 4 KiB WRITE).
func BenchmarkAuth(b *testing.B) {
	dir := b.TempDir()
	ca, err := pkitest.NewCA(dir, "bench")
	if err != nil {
		b.Fatal(err)
	}
	for _, mode := range []string{"insecure", "psk", "mtls"} {
		sec := func(b *testing.B) security {
			switch mode {
			case "psk":
				return security{auth: auth(b, "0123456789abcdef-bench")}
			case "mtls":
				c, s := tlsConfigs(b, ca, dir, "bench")
				return security{client: c, server: s}
			}
			return security{}
		}
		for _, piece := range []uint64{1 << 20, 4 << 10} {
			b.Run(mode+"/write-"+sizeName(piece), func(b *testing.B) { benchWrite(b, sec(b), sec(b), piece) })
		}
		b.Run(mode+"/connect", func(b *testing.B) { benchConnect(b, sec(b), sec(b)) })
	}
}

// security is one agent's way of securing its connections.
type security struct {
	auth           *peerauth.Authenticator
	client, server *tls.Config
}

func sizeName(n uint64) string {
	if n >= 1<<20 {
		return "1MiB"
	}
	return "4KiB"
}

func benchPair(b *testing.B, aa, ba security, size int) (a, c *Agent) {
	b.Helper()
	mk := func(name string, s security) *Agent {
		ag, err := New(Config{Name: name + "-" + time.Now().Format("150405.000000000"), DisableLocal: true, Conns: 4, Auth: s.auth,
			ClientTLS: s.client, ServerTLS: s.server})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = ag.Close() })
		if err := ag.Map(base, make([]byte, size)); err != nil {
			b.Fatal(err)
		}
		if err := ag.Register([]Region{{base, uint64(size)}}); err != nil {
			b.Fatal(err)
		}
		return ag
	}
	a, c = mk("src", aa), mk("dst", ba)
	if _, err := a.LoadPeer(c.Metadata()); err != nil {
		b.Fatal(err)
	}
	return a, c
}

func post(b *testing.B, a *Agent, peer string, descs []Desc) {
	id, err := a.Post(Write, peer, descs, nil)
	if err != nil {
		b.Fatal(err)
	}
	for {
		s, err := a.State(id)
		if s == Done {
			break
		}
		if s == Failed || err != nil {
			b.Fatalf("state %v: %v", s, err)
		}
		<-a.Events()
	}
	_ = a.Release(id)
}

func benchWrite(b *testing.B, aa, ba security, piece uint64) {
	const size = 8 << 20
	a, c := benchPair(b, aa, ba, size)
	var descs []Desc
	for off := uint64(0); off < size; off += piece {
		descs = append(descs, Desc{Local: base + off, Remote: base + off, Len: piece})
	}
	post(b, a, c.Name(), descs) // connections open before timing
	b.SetBytes(size)
	for b.Loop() {
		post(b, a, c.Name(), descs)
	}
}

func benchConnect(b *testing.B, aa, ba security) {
	a, c := benchPair(b, aa, ba, 1<<16)
	descs := []Desc{{Local: base, Remote: base, Len: 4096}}
	for b.Loop() {
		if err := a.InvalidatePeer(c.Name()); err != nil {
			b.Fatal(err)
		}
		if _, err := a.LoadPeer(c.Metadata()); err != nil {
			b.Fatal(err)
		}
		post(b, a, c.Name(), descs)
	}
}
