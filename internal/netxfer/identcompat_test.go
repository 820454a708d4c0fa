package netxfer

import (
	"bytes"
	"fmt"
	"math/rand/v2"
	"testing"
)

// TestIdentOlderBuild: an agent of a build from before versionIdent
// hellos and a new one reach each other over TCP both ways.
func TestIdentOlderBuild(t *testing.T) {
	const size = 1 << 12
	mk := func(name string, old bool) (*Agent, []byte) {
		ag, err := New(Config{Name: fmt.Sprintf("%s-%s-%d", t.Name(), name, rand.Uint64()), DisableLocal: true, Conns: 2, noIdent: old})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = ag.Close() })
		mem := make([]byte, size)
		if err := ag.Map(base, mem); err != nil {
			t.Fatal(err)
		}
		if err := ag.Register([]Region{{base, size}}); err != nil {
			t.Fatal(err)
		}
		return ag, mem
	}
	a, am := mk("new", false)
	b, bm := mk("old", true)
	for i := range am {
		am[i], bm[i] = byte(i), byte(i+1)
	}
	for _, d := range []struct {
		from, to *Agent
		fm, tm   []byte
	}{{a, b, am, bm}, {b, a, bm, am}} {
		name, err := d.from.LoadPeer(d.to.Metadata())
		if err != nil {
			t.Fatal(err)
		}
		copy(d.fm, bytes.Repeat([]byte{byte(len(name))}, size))
		id, err := d.from.Post(Write, name, []Desc{{base, base, size}}, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, d.from, id); s != Done {
			t.Fatalf("%s to %s: %v (%v)", d.from.Name(), d.to.Name(), s, err)
		}
		if !bytes.Equal(d.fm, d.tm) {
			t.Fatalf("%s to %s: bytes differ", d.from.Name(), d.to.Name())
		}
	}
}
