package kvxfer_test

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/topology"
)

// nopDevice is a GPU whose batches move nothing and are done at once:
// what a same-host GPU WRITE costs the CPUs around the GPU's work.
type nopDevice struct{}

type nopDone struct{}

func (nopDone) Done() (bool, error) { return true, nil }

func (nopDevice) Import(h [64]byte) (uint64, error)    { return 0x5000_0000_0000, nil }
func (nopDevice) Unmap(uint64) error                   { return nil }
func (nopDevice) CopyDevice(uint64, uint64, int) error { return nil }
func (nopDevice) CopyIn(uint64, []byte) error          { return nil }
func (nopDevice) CopyOut([]byte, uint64) error         { return nil }
func (nopDevice) NewBatch(int) (tcp.DevBatch, error)   { return nopBatch{}, nil }

type nopBatch struct{}

func (nopBatch) Add(uint64, uint64, uint64) bool                { return true }
func (nopBatch) AddLayout([]tcp.DevRegion, []tcp.DevEntry) bool { return true }
func (nopBatch) Post() (tcp.DevCopy, error)                     { return nopDone{}, nil }
func (nopBatch) Discard()                                       {}

// BenchmarkSameHostGPUWrite: a WRITE of 32 layers x n scattered blocks of
// 64 KiB (256 and 8,192 pieces) between two built-in backends' GPU
// memory on the same host, into blocks D's grant table lets P write, post
// to completion, the GPU's work left out (nopDevice): posted as its
// pieces (Post: P lists them, D checks each against its memory and its
// grants and stages it) and as one layout (PostLayouts: 32 bases and n
// entries on both sides, each entry checked once against the grants).
func BenchmarkSameHostGPUWrite(b *testing.B) {
	const piece, blocks, layers = 64 << 10, 512, 32
	const layer = blocks * piece
	mk := func(base uint64, handle byte) *tcp.Backend {
		n, err := tcp.New(tcp.Config{Name: fmt.Sprintf("bench-%d-%d", handle, rand.Uint64()), DisableLocal: true, Logger: quiet,
			Devices: func([16]byte) (tcp.Device, error) { return nopDevice{}, nil }})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = n.Close() })
		if err := n.MapIPC(base, layers*layer, nopDevice{}, [16]byte{1}, [64]byte{handle}); err != nil {
			b.Fatal(err)
		}
		if err := n.Register([]kvxfer.MemRegion{{Addr: base, Len: layers * layer, Kind: kvxfer.MemVRAM}}); err != nil {
			b.Fatal(err)
		}
		return n
	}
	const sbase, dbase = 0x7000_0000_0000, 0x7100_0000_0000
	src, dst := mk(sbase, 1), mk(dbase, 2)
	l := topology.Layout{LogicalBlockSize: 16, KernelBlockSize: 16}
	for i := range layers {
		l.Regions = append(l.Regions, topology.Region{Kind: topology.KindFullAttention, Base: dbase + uint64(i*layer), BlockLen: piece, NumBlocks: blocks})
	}
	l.Groups = []topology.Group{{Kind: topology.KindFullAttention, Regions: make([]int, layers)}}
	for i := range l.Groups[0].Regions {
		l.Groups[0].Regions[i] = i
	}
	ids := make([]topology.BlockID, blocks)
	for i := range ids {
		ids[i] = topology.BlockID(i)
	}
	if err := dst.SetGuard(kvxfer.WriteGrants(&l, []int{blocks}, src.Name(), ids)); err != nil {
		b.Fatal(err)
	}
	meta, _ := dst.LocalMetadata()
	peer, err := src.LoadPeer(meta)
	if err != nil {
		b.Fatal(err)
	}
	r := rand.New(rand.NewPCG(1, 2))
	sp, dp := r.Perm(blocks), r.Perm(blocks)
	for _, form := range []string{"pieces", "layout"} {
		for _, n := range []int{8, 256} {
			b.Run(fmt.Sprintf("%s/%d", form, layers*n), func(b *testing.B) {
				lays := &hotpath.Layouts{}
				for i := range layers {
					lays.Bases = append(lays.Bases, hotpath.BasePair{Local: sbase + uint64(i*layer), Remote: dbase + uint64(i*layer)})
				}
				for i := range n {
					lays.Entries = append(lays.Entries, hotpath.LayoutEntry{Local: uint64(sp[i] * piece), Remote: uint64(dp[i] * piece), Len: piece})
				}
				lays.Spans = []hotpath.LayoutSpan{{B0: 0, B1: layers, E0: 0, E1: n}}
				descs := lays.Expand(nil, lays.Spans)
				before := dst.LayoutParts()
				for b.Loop() {
					var id kvxfer.XferID
					var err error
					if form == "layout" {
						id, err = src.PostLayouts(hotpath.OpWrite, peer, lays, nil)
					} else {
						id, err = src.Post(hotpath.OpWrite, peer, descs, nil)
					}
					if err != nil {
						b.Fatal(err)
					}
					for {
						s, err := src.State(id)
						if s == kvxfer.XferDone {
							break
						}
						if s != kvxfer.XferInProgress {
							b.Fatalf("%v: %v", s, err)
						}
						<-src.Events()
					}
					_ = src.Release(id)
				}
				if got := dst.LayoutParts() - before; (form == "layout") != (got > 0) {
					b.Fatalf("%s: %d layout parts", form, got)
				}
			})
		}
	}
}
