package netxfer

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/peerauth/pkitest"
)

// Two agents of one process (kvxferd: two engines' ranks on one daemon)
// copy directly between their memories. An engine's file that shrinks
// under the daemon's mapping (the engine truncates it) faults that copy
// (SIGBUS): the transfer fails and the process stays up, as on the
// same-host path (TestSameHostShrunkFile). Before, the fault killed the
// daemon, and every other engine's requests with it.
func TestDirectCopyShrunkFile(t *testing.T) {
	for _, op := range []Op{Write, Read} {
		t.Run(map[Op]string{Write: "write", Read: "read"}[op], func(t *testing.T) {
			const size = 1 << 16
			mk := func(name string) (*Agent, []byte, func(int64) error) {
				ag, err := New(Config{Name: fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), Conns: 2})
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ag.Close() })
				mem, f := memFile(t, size)
				if err := ag.MapFile(base, mem, f, 0); err != nil {
					t.Fatal(err)
				}
				if err := ag.Register([]Region{{base, size}}); err != nil {
					t.Fatal(err)
				}
				return ag, mem, f.Truncate
			}
			a, _, _ := mk("a")
			b, _, shrinkB := mk("b")
			if _, err := a.LoadPeer(b.Metadata()); err != nil {
				t.Fatal(err)
			}
			if _, err := b.LoadPeer(a.Metadata()); err != nil {
				t.Fatal(err)
			}
			// b's engine shrinks its file: b's memory is gone past 0.
			if err := shrinkB(0); err != nil {
				t.Fatal(err)
			}
			id, err := a.Post(op, b.Name(), []Desc{{Local: base, Remote: base + 8192, Len: 4096}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if !a.mu.xfers[id].direct {
				t.Fatal("the transfer did not take the direct copy")
			}
			st, err := wait(t, a, id)
			if st != Failed || err == nil || !strings.Contains(err.Error(), "fault") {
				t.Fatalf("%v over a shrunk file: %v, %v; want Failed by a fault", op, st, err)
			}
			// The agents carry on: b's file grows back and a copy lands.
			if err := shrinkB(size); err != nil {
				t.Fatal(err)
			}
			id, err = a.Post(op, b.Name(), []Desc{{Local: base, Remote: base + 8192, Len: 4096}}, nil)
			if err != nil {
				t.Fatal(err)
			}
			if st, err := wait(t, a, id); st != Done {
				t.Fatalf("%v after the file grew back: %v, %v; want Done", op, st, err)
			}
		})
	}
}

// Over TCP the receiver copies what its buffer read ahead into the
// engine's memory in Go code, and over mutual TLS the sender encrypts
// from it and the receiver decrypts into it. An engine's file that
// shrinks under the daemon's mapping faults that code (SIGBUS): the
// transfer fails and the process stays up. Before, the fault killed the
// daemon, and every other engine's requests with it.
func TestTCPShrunkFile(t *testing.T) {
	type tcase struct {
		name   string
		tls    bool
		op     Op
		shrink string // whose file shrinks
	}
	var cases []tcase
	for _, tls := range []bool{false, true} {
		for _, c := range []tcase{
			{"write-sender", false, Write, "a"}, {"write-receiver", false, Write, "b"},
			{"read-server", false, Read, "b"}, {"read-client", false, Read, "a"},
		} {
			c.tls = tls
			c.name = fmt.Sprintf("tls=%v/%s", tls, c.name)
			cases = append(cases, c)
		}
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			ca, err := pkitest.NewCA(dir, "cluster")
			if err != nil {
				t.Fatal(err)
			}
			const size = 1 << 16
			shrink := map[string]func(int64) error{}
			mk := func(name string) *Agent {
				cfg := Config{Name: fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), DisableLocal: true, DisableSameHost: true, Conns: 1}
				if tc.tls {
					cfg.ClientTLS, cfg.ServerTLS = tlsConfigs(t, ca, dir, name)
				}
				ag, err := New(cfg)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = ag.Close() })
				mem, f := memFile(t, size)
				if err := ag.Map(base, mem); err != nil {
					t.Fatal(err)
				}
				if err := ag.Register([]Region{{base, size}}); err != nil {
					t.Fatal(err)
				}
				shrink[name] = f.Truncate
				return ag
			}
			a, b := mk("a"), mk("b")
			if _, err := a.LoadPeer(b.Metadata()); err != nil {
				t.Fatal(err)
			}
			if _, err := b.LoadPeer(a.Metadata()); err != nil {
				t.Fatal(err)
			}
			if err := shrink[tc.shrink](0); err != nil {
				t.Fatal(err)
			}
			id, err := a.Post(tc.op, b.Name(), []Desc{{Local: base, Remote: base + 8192, Len: 4096}}, nil)
			if err == nil {
				if st, werr := wait(t, a, id); st != Failed {
					t.Fatalf("%s over a shrunk file: %v, %v; want Failed", tc.name, st, werr)
				}
			}
			// The agents carry on once the file is whole again.
			if err := shrink[tc.shrink](size); err != nil {
				t.Fatal(err)
			}
			// (A transfer posted before the agent dropped the connection the
			// fault failed goes down with it; the next takes a new one.)
			for try := 0; ; try++ {
				id, err = a.Post(tc.op, b.Name(), []Desc{{Local: base, Remote: base + 8192, Len: 4096}}, nil)
				if err != nil {
					t.Fatal(err)
				}
				st, err := wait(t, a, id)
				if st == Done {
					break
				}
				if try == 3 {
					t.Fatalf("%s after the file grew back: %v, %v; want Done", tc.name, st, err)
				}
				time.Sleep(10 * time.Millisecond)
			}
		})
	}
}
