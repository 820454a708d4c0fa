package fuzz_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/klauspost/compress/zstd"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// handshakeSeed is a valid answer of engine P with tp ranks.
func handshakeSeed(tp int) []byte {
	var list pb.RankList
	for r := range tp {
		l := topology.Layout{TPRank: r, TPSize: tp, PPSize: 1, TotalKVHeads: 8, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND,
			Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
			Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 30, BlockLen: int64(2 * 8 / tp * 16 * 4 * 2), NumBlocks: 64}}}
		list.Ranks = append(list.Ranks, &pb.RankInfo{EngineId: "P", CompatHash: "h", Layout: stream.LayoutToProto(&l), Agent: []byte("agent")})
	}
	b, _ := proto.Marshal(&list)
	return b
}

// FuzzHandshake: a peer's handshake answer, raw or zstd-compressed, never
// makes the decoder panic or allocate without bound; what it refuses is
// kvxfer.ErrBadMetadata with the field named; what it accepts has only
// ranks of the engine asked, with layouts that validate, and so has an
// answer with ranks leaving (a PartialHandshakeError).
func FuzzHandshake(f *testing.F) {
	enc, _ := zstd.NewWriter(nil)
	for _, tp := range []int{1, 2, 8} {
		b := handshakeSeed(tp)
		f.Add(b, false)
		f.Add(enc.EncodeAll(b, nil), true)
	}
	f.Add([]byte{}, false)
	f.Add([]byte{0x0a, 0xff, 0xff, 0xff, 0x0f}, false)
	f.Add([]byte{0x28, 0xb5, 0x2f, 0xfd, 0x00, 0x00}, true)
	dec := server.NewHandshakeDecoder()
	f.Fuzz(func(t *testing.T, payload []byte, compressed bool) {
		res, err := dec.Decode("P", &pb.HandshakeResponse{EngineId: "P", Payload: payload, Zstd: compressed, Generation: 7})
		var partial *kvxfer.PartialHandshakeError
		if errors.As(err, &partial) {
			// An answer listing ranks leaving (RankList.leaving): every
			// rank it lists answered, of the engine asked, with layouts
			// that validate.
			for i, r := range partial.Answered {
				if r.EngineID != "P" {
					t.Fatalf("answered rank %d of engine %q", i, r.EngineID)
				}
				if err := r.Layout.Validate(); err != nil {
					t.Fatalf("answered rank %d: its layout does not validate: %v", i, err)
				}
			}
			return
		}
		if err != nil {
			if !errors.Is(err, kvxfer.ErrBadMetadata) {
				t.Fatalf("refusal %v does not wrap ErrBadMetadata", err)
			}
			if !strings.Contains(err.Error(), "payload") && !strings.Contains(err.Error(), "ranks[") && !strings.Contains(err.Error(), "leaving[") {
				t.Fatalf("refusal %q names no field", err)
			}
			return
		}
		if res.Generation != 7 {
			t.Fatalf("generation %d, want 7", res.Generation)
		}
		for i, r := range res.Ranks {
			if r.EngineID != "P" {
				t.Fatalf("rank %d of engine %q accepted", i, r.EngineID)
			}
			if err := r.Layout.Validate(); err != nil {
				t.Fatalf("rank %d: an accepted layout does not validate: %v", i, err)
			}
		}
	})
}

// The seeds decode: raw and compressed answers of 1, 2 and 8 ranks.
func TestHandshakeSeedsDecode(t *testing.T) {
	enc, _ := zstd.NewWriter(nil)
	dec := server.NewHandshakeDecoder()
	for _, tp := range []int{1, 2, 8} {
		for _, z := range []bool{false, true} {
			p := handshakeSeed(tp)
			if z {
				p = enc.EncodeAll(p, nil)
			}
			res, err := dec.Decode("P", &pb.HandshakeResponse{Payload: p, Zstd: z})
			if err != nil || len(res.Ranks) != tp {
				t.Errorf("tp %d zstd %v: %d ranks, %v", tp, z, len(res.Ranks), err)
			}
		}
		if _, err := dec.Decode("Q", &pb.HandshakeResponse{Payload: handshakeSeed(tp)}); !errors.Is(err, kvxfer.ErrBadMetadata) ||
			!strings.Contains(err.Error(), "ranks[0].engine_id") {
			t.Errorf("ranks of another engine: %v", err)
		}
	}
}
