package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// BenchmarkBackend: one 8 MiB WRITE (and, as "-read", READ) between two
// agents on this host, posted and waited for, through the built-in backend
// (loopback TCP) and NIXL (UCX, its default same-host transports);
// descriptors coalesced (8 runs of 1 MiB) or not (2,048 blocks of 4 KiB,
// or 16,384 of 512 B: one head's slice of a block in a small model, or a
// P rank's half of a D block under heterogeneous TP). Reports the post
// cost (building the request and handing it over) beside the whole
// transfer.
func BenchmarkBackend(b *testing.B) {
	backends := []struct {
		name string
		h    harness
	}{{"builtin-tcp", kvxfertest.TCPHarness{}}, {"nixl-ucx", &kvxfertest.NixlHarness{}}}
	for _, be := range backends {
		for _, op := range []hotpath.Op{hotpath.OpWrite, hotpath.OpRead} {
			for _, shape := range []struct {
				name string
				desc uint64
			}{{"coalesced-1MiB", 1 << 20}, {"uncoalesced-4KiB", 4 << 10}, {"uncoalesced-512B", 512}} {
				name := be.name
				if op == hotpath.OpRead {
					name += "-read"
				}
				b.Run(name+"/"+shape.name, func(b *testing.B) { benchTransfer(b, be.h, op, shape.desc) })
			}
		}
	}
}

type harness interface {
	New(*testing.T, int) (kvxfer.Backend, kvxfer.MemRegion, []byte)
}

// benchTransfer times one 8 MiB transfer in descriptors of desc bytes.
func benchTransfer(b *testing.B, h harness, op hotpath.Op, desc uint64) {
	const size = 8 << 20
	t := &testing.T{}
	src, sr, _ := newOrSkip(b, t, h, size)
	if src == nil {
		return
	}
	dst, dr, _ := newOrSkip(b, t, h, size)
	defer src.Close()
	defer dst.Close()
	peer := kvxfertest.Link(b, src, dst, sr, dr)
	var descs []hotpath.Desc
	for off := uint64(0); off < size; off += desc {
		descs = append(descs, hotpath.Desc{Local: sr.Addr + off, Remote: dr.Addr + off, Len: desc})
	}
	b.SetBytes(size)
	var post time.Duration
	for b.Loop() {
		t0 := time.Now()
		id, err := src.Post(op, peer, descs, nil)
		post += time.Since(t0)
		if err != nil {
			b.Fatal(err)
		}
		for {
			s, err := src.State(id)
			if s == kvxfer.XferDone {
				break
			}
			if s == kvxfer.XferFailed || err != nil {
				b.Fatalf("state %v: %v", s, err)
			}
		}
		_ = src.Release(id)
	}
	b.ReportMetric(float64(post.Nanoseconds())/float64(b.N), "post-ns/op")
	b.ReportMetric(float64(len(descs)), "descs")
}

// newOrSkip makes a backend through a test harness inside a benchmark,
// skipping when the harness skips (NIXL absent).
func newOrSkip(b *testing.B, t *testing.T, h harness, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	var be kvxfer.Backend
	var r kvxfer.MemRegion
	var mem []byte
	done := make(chan struct{})
	go func() {
		defer close(done)
		be, r, mem = h.New(t, n)
	}()
	<-done
	if be == nil {
		b.Skip("backend unavailable here")
	}
	return be, r, mem
}
