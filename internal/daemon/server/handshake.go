package server

import (
	"fmt"

	"github.com/klauspost/compress/zstd"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// maxHandshake caps a decompressed handshake payload.
const maxHandshake = 256 << 20

// HandshakeDecoder decodes PeerService handshake answers: a peer's bytes
// are input, so what a payload may make it allocate is capped
// (decompressed, 256 MiB) and every error names the field. It is safe
// for concurrent use.
type HandshakeDecoder struct{ dec *zstd.Decoder }

// NewHandshakeDecoder returns a decoder.
func NewHandshakeDecoder() *HandshakeDecoder {
	dec, _ := zstd.NewReader(nil, zstd.WithDecoderMaxMemory(maxHandshake), zstd.WithDecoderConcurrency(1))
	return &HandshakeDecoder{dec: dec}
}

// Decode decodes resp, the answer to a handshake with engineID: its
// payload (zstd-compressed when resp.Zstd), every rank of engineID and
// its layout. ClockOffset is left to the caller, who timed the call.
// Errors wrap kvxfer.ErrBadMetadata.
func (d *HandshakeDecoder) Decode(engineID string, resp *pb.HandshakeResponse) (kvxfer.HandshakeResult, error) {
	payload := resp.GetPayload()
	if resp.GetZstd() {
		var err error
		if payload, err = d.dec.DecodeAll(payload, nil); err != nil {
			return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s: payload: %w", kvxfer.ErrBadMetadata, engineID, err)
		}
	}
	var list pb.RankList
	if err := proto.Unmarshal(payload, &list); err != nil {
		return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s: payload: %w", kvxfer.ErrBadMetadata, engineID, err)
	}
	out := kvxfer.HandshakeResult{Generation: resp.GetGeneration()}
	for i, ri := range list.Ranks {
		if ri.EngineId != engineID {
			return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s: ranks[%d].engine_id %q", kvxfer.ErrBadMetadata, engineID, i, ri.EngineId)
		}
		l, err := stream.LayoutFromProto(fmt.Sprintf("ranks[%d].layout", i), ri.Layout)
		if err != nil {
			return kvxfer.HandshakeResult{}, fmt.Errorf("%w: handshake %s: %w", kvxfer.ErrBadMetadata, engineID, err)
		}
		out.Ranks = append(out.Ranks, kvxfer.RankInfo{EngineID: ri.EngineId, CompatHash: ri.CompatHash, Layout: l, Agent: ri.Agent})
	}
	return out, nil
}

// Close releases the decoder's resources.
func (d *HandshakeDecoder) Close() { d.dec.Close() }
