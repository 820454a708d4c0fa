package stream_test

import (
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// A request's transfer params survive the round trip through kvxfer.v1,
// nil stays nil, and a bad field is refused by name.
func TestRequestConversions(t *testing.T) {
	p := &kvxfer.TransferParams{TransferID: "t-1", DoRemotePrefill: true, RemoteEngineID: "P", RemoteAddr: "10.0.0.1:7600",
		RemoteRequestID: "p-1", RemoteBlockIDs: []topology.Span{{Start: 2, IDs: []topology.BlockID{4, 5}}}, RemoteTPSize: 2,
		RemotePPSize: 1, RemoteNumTokens: 40, RemoteBlocksExpiry: time.Unix(0, 1234567890), Mode: kvxfer.ModePull, RemoteGeneration: 1<<63 + 5}
	back, err := stream.ParamsFromProto(stream.ParamsToProto(p))
	if err != nil || !reflect.DeepEqual(back, p) {
		t.Fatalf("params round trip = %+v, %v; want %+v", back, err, p)
	}
	// The producer's generation the params carry reaches the workers.
	rm := kvxfer.RemoteRef{EngineID: "P", Addr: "p:1", ReqID: "p-1", TPSize: 1, PPSize: 1, Generation: p.RemoteGeneration}
	m, err := stream.StepFromProto(stream.StepToProto(&kvxfer.StepMeta{Recv: []kvxfer.RecvReq{{ReqID: "d-1", Remote: rm}}}))
	if err != nil || len(m.Recv) != 1 || m.Recv[0].Remote.Generation != p.RemoteGeneration {
		t.Fatalf("step round trip = %+v, %v; want a recv from generation %d", m, err, p.RemoteGeneration)
	}
	if got, err := stream.ParamsFromProto(nil); got != nil || err != nil || stream.ParamsToProto(nil) != nil {
		t.Errorf("nil params = %v, %v; want nil both ways", got, err)
	}
	r, err := stream.RequestFromProto(&pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: stream.ParamsToProto(p)})
	if err != nil || r.ID != "d-1" || r.PromptTokens != 40 || !reflect.DeepEqual(r.Params, p) {
		t.Fatalf("RequestFromProto = %+v, %v", r, err)
	}
	for _, tc := range []struct {
		req   *pb.EngineRequest
		field string
	}{
		{&pb.EngineRequest{}, "request.request_id"},
		{&pb.EngineRequest{RequestId: "x", PromptTokens: 1 << 40}, "request.prompt_tokens"},
		{&pb.EngineRequest{RequestId: "x", Params: &pb.TransferParams{Mode: 7}}, "params.mode"},
		{&pb.EngineRequest{RequestId: "x", Params: &pb.TransferParams{RemoteBlockIds: []*pb.Span{nil}}}, "params.remote_block_ids[0]"},
	} {
		if _, err := stream.RequestFromProto(tc.req); !errors.Is(err, stream.ErrInvalid) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("RequestFromProto(%v) = %v, want ErrInvalid naming %s", tc.req, err, tc.field)
		}
	}
	blocks := stream.BlocksFromProto([]*pb.BlockList{{BlockIds: []int32{1, 2}}, {}})
	if want := [][]topology.BlockID{{1, 2}, nil}; !reflect.DeepEqual(blocks, want) {
		t.Errorf("BlocksFromProto = %v, want %v", blocks, want)
	}
}
