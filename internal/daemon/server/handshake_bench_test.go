package server

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"testing"

	"github.com/klauspost/compress/s2"
	"github.com/klauspost/compress/zstd"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// handshakePayload builds the RankList of a big deployment: tp ranks of a
// model with layers layers (K and V separate), each rank's agent blob a
// NIXL-like table of descs registered descriptors plus a 256-byte
// transport address.
func handshakePayload(tp, layers, descs int) []byte {
	rng := rand.New(rand.NewPCG(1, 2))
	var list pb.RankList
	for r := range tp {
		l := topology.Layout{TPRank: r, TPSize: tp, PPSize: 1, TotalKVHeads: 8, HeadSize: 128, ElemBytes: 2, KVLayout: topology.LayoutHND,
			Packing: topology.SeparateKV, LogicalBlockSize: 16, KernelBlockSize: 16}
		for i := range 2 * layers {
			l.Regions = append(l.Regions, topology.Region{Kind: topology.KindFullAttention, Base: uint64(0x7f0000000000 + i<<30), BlockLen: 4096, NumBlocks: 100000})
		}
		agent := make([]byte, 0, descs*20+256)
		for i := range descs {
			agent = binary.LittleEndian.AppendUint64(agent, uint64(0x7f0000000000+i*4096))
			agent = binary.LittleEndian.AppendUint64(agent, 4096)
			agent = binary.LittleEndian.AppendUint32(agent, uint32(r))
		}
		for range 32 {
			agent = binary.LittleEndian.AppendUint64(agent, rng.Uint64())
		}
		list.Ranks = append(list.Ranks, &pb.RankInfo{EngineId: "prefill-0", CompatHash: "3f9a", Layout: stream.LayoutToProto(&l), Agent: agent})
	}
	b, _ := proto.Marshal(&list)
	return b
}

// BenchmarkHandshakePayload: encode + decode of a handshake payload raw,
// with zstd (fastest level) and with s2; reports the wire size.
func BenchmarkHandshakePayload(b *testing.B) {
	for _, sz := range []struct {
		name              string
		tp, layers, descs int
	}{{"tp8-80l-10k", 8, 80, 10000}, {"tp8-80l-100k", 8, 80, 100000}} {
		payload := handshakePayload(sz.tp, sz.layers, sz.descs)
		enc, _ := zstd.NewWriter(nil, zstd.WithEncoderLevel(zstd.SpeedFastest))
		dec, _ := zstd.NewReader(nil, zstd.WithDecoderConcurrency(1))
		for _, c := range []struct {
			name string
			fn   func() (int, error)
		}{
			{"raw", func() (int, error) { return len(payload), nil }},
			{"zstd", func() (int, error) {
				z := enc.EncodeAll(payload, nil)
				_, err := dec.DecodeAll(z, nil)
				return len(z), err
			}},
			{"s2", func() (int, error) {
				z := s2.Encode(nil, payload)
				_, err := s2.Decode(nil, z)
				return len(z), err
			}},
		} {
			b.Run(fmt.Sprintf("%s/%s", sz.name, c.name), func(b *testing.B) {
				b.SetBytes(int64(len(payload)))
				var n int
				for b.Loop() {
					var err error
					if n, err = c.fn(); err != nil {
						b.Fatal(err)
					}
				}
				b.ReportMetric(float64(n), "wire-bytes")
				b.ReportMetric(float64(len(payload)), "raw-bytes")
			})
		}
	}
}
