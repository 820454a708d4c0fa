package netxfer

import (
	"fmt"
	"testing"
	"time"
)

// BenchmarkSameHost: 8 MiB WRITEs and READs between two agents of this
// process (no direct copy), their memory memfd-backed, over the
// same-host path (one copy by the side whose memory changes) and over
// TCP, in pieces of 1 MiB, 4 KiB and 512 B every other slot (nothing
// coalesces).
func BenchmarkSameHost(b *testing.B) {
	const total = 8 << 20
	for _, path := range []struct {
		name string
		cfg  Config
	}{{"samehost", Config{Conns: 4}}, {"tcp", Config{Conns: 4, DisableSameHost: true}}} {
		for _, op := range []Op{Write, Read} {
			for _, pc := range []struct {
				name  string
				piece int
			}{{"1MiB", 1 << 20}, {"4KiB", 4 << 10}, {"512B", 512}} {
				piece := pc.piece
				name := fmt.Sprintf("%s/%s/%s", path.name, map[Op]string{Write: "write", Read: "read"}[op], pc.name)
				b.Run(name, func(b *testing.B) {
					a, p, _, _ := localPair(b, 2*total+2*piece, path.cfg)
					ds := scattered(total/piece, piece)
					b.SetBytes(total)
					b.ResetTimer()
					for b.Loop() {
						postDone(b, a, op, p.Name(), ds)
					}
				})
			}
		}
	}
}

// postDone posts a transfer, waits for it to be done (a benchmark's
// loop: it fails the benchmark otherwise) and releases it.
func postDone(b *testing.B, a *Agent, op Op, peer string, ds []Desc) {
	id, err := a.Post(op, peer, ds, nil)
	if err != nil {
		b.Fatal(err)
	}
	waitID(b, a, id)
}

// waitID waits for a posted transfer to be done and releases it.
func waitID(b *testing.B, a *Agent, id XferID) {
	for {
		s, err := a.State(id)
		if s == Done {
			break
		}
		if s != InProgress {
			b.Fatalf("%v, %v", s, err)
		}
		select {
		case <-a.Events():
		case <-time.After(time.Second):
		}
	}
	_ = a.Release(id)
}
