package server_test

import (
	"fmt"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A consumer request whose params name the producer at an address the
// peer resolver would never dial (no port, a port out of range, a gRPC
// scheme, a host with spaces) is bad input at the scheduler: refused
// there, naming RemoteAddr and the value, counted in bad_params, before
// any block is promised to it (MatchedTokens gives 0: computed locally).
// Before, the scheduler staged it, and the request failed later at its
// ranks' handshake. Well-formed addresses beside them still stage.
func TestSchedulerRefusesMalformedRemoteAddr(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "D", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	dreq := func(id, addr string) *pb.EngineRequest {
		return &pb.EngineRequest{RequestId: id, PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t-" + id, DoRemotePrefill: true,
			RemoteEngineId: "P", RemoteAddr: addr, RemoteTpSize: 1}}
	}
	blocks := func(first int) []int32 { return []int32{int32(first), int32(first + 1), int32(first + 2)} }
	bad := []string{"127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "unix:///tmp/x.sock", "dns:///h:1", "a host:7600", "h:76x0", ":7600"}
	var counted uint64
	for i, addr := range bad {
		r, ok := dreq("d-bad", addr), fmt.Sprintf("d-ok-%d", i)
		m, err := c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: r})
		if err != nil {
			t.Fatal(err)
		}
		if m.Tokens != 0 || m.Async {
			t.Errorf("MatchedTokens(RemoteAddr %q) = %v, want 0 tokens, not async (computed locally)", addr, m)
		}
		resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", BuildMeta: true, Ops: []*pb.SchedulerOp{
			{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: dreq(ok, d.peerAddr), Blocks: []*pb.BlockList{{BlockIds: blocks(6 * i)}}, External: 40}}},
			{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: r, Blocks: []*pb.BlockList{{BlockIds: blocks(6*i + 3)}}, External: 40}}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Results) != 1 || resp.Results[0].Index != 1 || resp.Results[0].Code != int32(codes.InvalidArgument) ||
			!strings.Contains(resp.Results[0].Error, "RemoteAddr") || !strings.Contains(resp.Results[0].Error, addr) {
			t.Errorf("RemoteAddr %q: Step results = %v, want op 1 refused naming RemoteAddr and the value", addr, resp.Results)
		}
		if got := resp.GetMeta().GetRecv(); len(got) != 1 || got[0].RequestId != ok {
			t.Errorf("RemoteAddr %q: Step meta recv = %v, want %s alone", addr, got, ok)
		}
		// MatchedTokens and AfterAlloc each count it once.
		if got := resp.Counters.GetBadParams(); got != counted+2 {
			t.Errorf("RemoteAddr %q: counters = %v, want bad_params %d", addr, resp.Counters, counted+2)
		}
		counted = resp.Counters.GetBadParams()
	}
}
