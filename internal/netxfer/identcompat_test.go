package netxfer

import (
	"bytes"
	"testing"
)

// TestIdentOlderBuild: an agent of a build from before versionIdent
// hellos and a new one reach each other over TCP both ways.
func TestIdentOlderBuild(t *testing.T) {
	olderBuild(t, Config{noIdent: true})
}

// Agents of a build from before bound names and new ones reach each
// other both ways (the old one's name is taken as given).
func TestBoundNamesOlderBuild(t *testing.T) {
	olderBuild(t, Config{noBind: true})
}

// olderBuild checks that an agent acting as an older build (old) and a
// new one WRITE to each other over TCP, every byte landing.
func olderBuild(t *testing.T, old Config) {
	const size = 1 << 12
	old.DisableLocal, old.Conns = true, 2
	a, am := newHeapAgent(t, "new", size, Config{DisableLocal: true, Conns: 2})
	b, bm := newHeapAgent(t, "old", size, old)
	if !isBound(a.Name()) || isBound(b.Name()) {
		t.Fatalf("names %q and %q: want the new one's bound, the old one's not", a.Name(), b.Name())
	}
	for _, d := range []struct {
		from, to *Agent
		fm, tm   []byte
	}{{a, b, am, bm}, {b, a, bm, am}} {
		fill(d.fm, uint64(len(d.from.Name()))) // a pattern of its own each way
		name, err := d.from.LoadPeer(d.to.Metadata())
		if err != nil {
			t.Fatal(err)
		}
		id, err := d.from.Post(Write, name, []Desc{{base, base, size}}, []byte("n"))
		if err != nil {
			t.Fatal(err)
		}
		if s, err := wait(t, d.from, id); s != Done {
			t.Fatalf("%s to %s: %v (%v)", d.from.Name(), d.to.Name(), s, err)
		}
		if !bytes.Equal(d.fm, d.tm) || bytes.Equal(d.tm, make([]byte, size)) {
			t.Fatalf("%s to %s: bytes differ", d.from.Name(), d.to.Name())
		}
	}
}
