package server

import (
	"fmt"
	"slices"
	"strings"

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
// Errors wrap kvxfer.ErrBadMetadata, but for an answer that lists ranks
// leaving (RankList.leaving): a *kvxfer.PartialHandshakeError whose
// Answered lists every rank, those leaving last (leavingError).
func (d *HandshakeDecoder) Decode(engineID string, resp *pb.HandshakeResponse) (kvxfer.HandshakeResult, error) {
	out, leaving, err := d.decode(engineID, resp)
	if err == nil && len(leaving) > 0 {
		return kvxfer.HandshakeResult{}, leavingError(engineID, "", out.Ranks, leaving)
	}
	return out, err
}

// decode is Decode, with the ranks leaving apart.
func (d *HandshakeDecoder) decode(engineID string, resp *pb.HandshakeResponse) (out kvxfer.HandshakeResult, leaving []kvxfer.RankInfo, err error) {
	payload := resp.GetPayload()
	if resp.GetZstd() {
		if payload, err = d.dec.DecodeAll(payload, nil); err != nil {
			return kvxfer.HandshakeResult{}, nil, fmt.Errorf("%w: handshake %s: payload: %w", kvxfer.ErrBadMetadata, engineID, err)
		}
	}
	var list pb.RankList
	if err := proto.Unmarshal(payload, &list); err != nil {
		return kvxfer.HandshakeResult{}, nil, fmt.Errorf("%w: handshake %s: payload: %w", kvxfer.ErrBadMetadata, engineID, err)
	}
	out = kvxfer.HandshakeResult{Generation: resp.GetGeneration()}
	seen := map[[2]int]bool{}
	for _, part := range []struct {
		name string
		list []*pb.RankInfo
		to   *[]kvxfer.RankInfo
	}{{"ranks", list.Ranks, &out.Ranks}, {"leaving", list.Leaving, &leaving}} {
		for i, ri := range part.list {
			if ri.EngineId != engineID {
				return kvxfer.HandshakeResult{}, nil, fmt.Errorf("%w: handshake %s: %s[%d].engine_id %q", kvxfer.ErrBadMetadata, engineID, part.name, i, ri.EngineId)
			}
			l, err := stream.LayoutFromProto(fmt.Sprintf("%s[%d].layout", part.name, i), ri.Layout)
			if err != nil {
				return kvxfer.HandshakeResult{}, nil, fmt.Errorf("%w: handshake %s: %w", kvxfer.ErrBadMetadata, engineID, err)
			}
			// (A rank listed twice among ranks is the core's to refuse,
			// as ever; one leaving is never also published.)
			if k := [2]int{l.PPRank, l.TPRank}; seen[k] && part.name == "leaving" {
				return kvxfer.HandshakeResult{}, nil, fmt.Errorf("%w: handshake %s: %s[%d]: rank tp %d pp %d listed twice", kvxfer.ErrBadMetadata, engineID, part.name, i, l.TPRank, l.PPRank)
			} else {
				seen[k] = true
			}
			*part.to = append(*part.to, kvxfer.RankInfo{EngineID: ri.EngineId, CompatHash: ri.CompatHash, Layout: l, Agent: ri.Agent})
		}
	}
	return out, leaving, nil
}

// leavingError is the handshake error for an engine (at addr, when
// known) with ranks leaving: the handshake fails (nothing is planned
// against an engine whose rank is being let go), and Answered, the ranks
// published and those leaving, still say who speaks for them: their
// messages are admitted and our notices reach them, which a leaving
// rank's close waits for (a push consumer's cancels confirmed, a pull
// producer's holds let go).
func leavingError(engineID, addr string, published, leaving []kvxfer.RankInfo) error {
	var names []string
	for _, ri := range leaving {
		names = append(names, fmt.Sprintf("tp %d pp %d", ri.Layout.TPRank, ri.Layout.PPRank))
	}
	at := ""
	if addr != "" {
		at = " at " + addr
	}
	return &kvxfer.PartialHandshakeError{Answered: append(slices.Clip(published), leaving...),
		Err: fmt.Errorf("handshake %s%s: rank %s leaving (its engine's stream ended; the rank is being let go): no transfer is planned with the engine until it attaches again",
			engineID, at, strings.Join(names, ", rank "))}
}

// Close releases the decoder's resources.
func (d *HandshakeDecoder) Close() { d.dec.Close() }
