package kvxfer_test

import (
	"errors"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
)

// BenchmarkBackend: one 8 MiB WRITE between two agents on this host,
// posted and waited for, through the built-in backend (loopback TCP) and
// NIXL (UCX, its default same-host transports); descriptors coalesced (8
// runs of 1 MiB) or not (2,048 blocks of 4 KiB). Reports the post cost
// (building the request and handing it over) beside the whole transfer.
func BenchmarkBackend(b *testing.B) {
	const size = 8 << 20
	backends := []struct {
		name string
		h    interface {
			New(*testing.T, int) (kvxfer.Backend, kvxfer.MemRegion, []byte)
		}
	}{{"builtin-tcp", netHarness{}}, {"nixl-ucx", &nixlHarness{}}}
	for _, be := range backends {
		for _, shape := range []struct {
			name string
			desc uint64
		}{{"coalesced-1MiB", 1 << 20}, {"uncoalesced-4KiB", 4 << 10}} {
			b.Run(be.name+"/"+shape.name, func(b *testing.B) {
				t := &testing.T{}
				src, sr, _ := newOrSkip(b, t, be.h, size)
				if src == nil {
					return
				}
				dst, dr, _ := newOrSkip(b, t, be.h, size)
				defer src.Close()
				defer dst.Close()
				if err := src.Register([]kvxfer.MemRegion{sr}); err != nil {
					b.Fatal(err)
				}
				if err := dst.Register([]kvxfer.MemRegion{dr}); err != nil {
					b.Fatal(err)
				}
				meta, _ := dst.LocalMetadata()
				peer, err := src.LoadPeer(meta)
				if err != nil {
					b.Fatal(err)
				}
				var descs []hotpath.Desc
				for off := uint64(0); off < size; off += shape.desc {
					descs = append(descs, hotpath.Desc{Local: sr.Addr + off, Remote: dr.Addr + off, Len: shape.desc})
				}
				b.SetBytes(size)
				var post time.Duration
				for b.Loop() {
					t0 := time.Now()
					id, err := src.Post(hotpath.OpWrite, peer, descs, nil)
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
			})
		}
	}
}

// newOrSkip makes a backend through a test harness inside a benchmark,
// skipping when the harness skips (NIXL absent).
func newOrSkip(b *testing.B, t *testing.T, h interface {
	New(*testing.T, int) (kvxfer.Backend, kvxfer.MemRegion, []byte)
}, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
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

var _ = errors.New
