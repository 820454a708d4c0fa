package netxfer

import (
	"bytes"
	"testing"
)

// TestIdentOlderBuild: an agent of a build from before versionIdent
// hellos and a new one reach each other over TCP both ways.
func TestIdentOlderBuild(t *testing.T) {
	const size = 1 << 12
	mk := func(name string, old bool) (*Agent, []byte) {
		return newHeapAgent(t, name, size, Config{DisableLocal: true, Conns: 2, noIdent: old})
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
