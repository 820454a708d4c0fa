package kvxfer_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/topology"
)

// BenchmarkGrants: what the data-plane grants cost the built-in backend:
// one 8 MiB WRITE over loopback TCP into a rank of 2,048 blocks of 4 KiB,
// all granted to the writer ("granted") or with no table ("open"), in
// pieces of 1 MiB, 4 KiB (one check per block) and 512 B (eight checks
// per block).
func BenchmarkGrants(b *testing.B) {
	for _, granted := range []bool{false, true} {
		for _, piece := range []uint64{1 << 20, 4 << 10, 512} {
			name := "open"
			if granted {
				name = "granted"
			}
			b.Run(name+"/"+map[uint64]string{1 << 20: "1MiB", 4 << 10: "4KiB", 512: "512B"}[piece], func(b *testing.B) {
				benchGrants(b, granted, piece)
			})
		}
	}
}

func benchGrants(b *testing.B, granted bool, piece uint64) {
	const size, block = 8 << 20, 4 << 10
	mk := func(base uint64) *tcp.Backend {
		n, err := tcp.New(tcp.Config{DisableLocal: true, Conns: 4})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = n.Close() })
		if err := n.Map(base, make([]byte, size)); err != nil {
			b.Fatal(err)
		}
		if err := n.Register([]kvxfer.MemRegion{{Addr: base, Len: size, Kind: kvxfer.MemDRAM}}); err != nil {
			b.Fatal(err)
		}
		return n
	}
	const sbase, dbase = 1 << 32, 2 << 32
	src, dst := mk(sbase), mk(dbase)
	if granted {
		l := topology.Layout{LogicalBlockSize: 16, KernelBlockSize: 16,
			Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: dbase, BlockLen: block, NumBlocks: size / block}}}
		ids := make([]topology.BlockID, size/block)
		for i := range ids {
			ids[i] = topology.BlockID(i)
		}
		tab := kvxfer.WriteGrants(&l, []int{size / block}, src.Name(), ids)
		if err := dst.SetGuard(tab); err != nil {
			b.Fatal(err)
		}
	}
	meta, _ := dst.LocalMetadata()
	peer, err := src.LoadPeer(meta)
	if err != nil {
		b.Fatal(err)
	}
	var descs []hotpath.Desc
	for off := uint64(0); off < size; off += piece {
		descs = append(descs, hotpath.Desc{Local: sbase + off, Remote: dbase + off, Len: piece})
	}
	b.SetBytes(size)
	b.ResetTimer()
	for range b.N {
		id, err := src.Post(hotpath.OpWrite, peer, descs, nil)
		if err != nil {
			b.Fatal(err)
		}
		for {
			s, err := src.State(id)
			if s == kvxfer.XferDone {
				break
			}
			if s == kvxfer.XferFailed {
				b.Fatal(err)
			}
			select {
			case <-src.Events():
			case <-time.After(time.Millisecond):
			}
		}
		_ = src.Release(id)
	}
}
