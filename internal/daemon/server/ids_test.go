package server_test

import (
	"context"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// An engine's request id, or an id or address of its transfer params,
// longer than kvxfer.MaxIDBytes is refused by the scheduler call (a Step
// op, a column row, or the call alone), InvalidArgument naming the field
// and the length with only the start of the value quoted, counted as
// bad_request, and the step's other requests carry on. Before, the daemon
// kept such requests (up to -max-requests of them, each as long as a
// message: gigabytes for one engine), an op's error echoed a megabyte id
// back whole, and the rank refused the request only at its step.
func TestSchedulerIDsBounded(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	for _, id := range []string{"P", "D"} {
		if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: id, Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
			t.Fatal(err)
		}
	}
	long := strings.Repeat("x", 1<<20)
	finished := func(id, tid string) *pb.SchedulerOp {
		return &pb.SchedulerOp{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{
			Request: &pb.EngineRequest{RequestId: id, PromptTokens: 32, Params: &pb.TransferParams{DoRemoteDecode: true, TransferId: tid}},
			Status:  pb.FinishStatus_FINISH_STATUS_STOPPED, Blocks: []*pb.BlockList{{BlockIds: []int32{1, 2}}}, Computed: 32}}}
	}
	alloc := func(id string, mut func(*pb.TransferParams)) *pb.SchedulerOp {
		p := &pb.TransferParams{DoRemotePrefill: true, RemoteEngineId: "P", RemoteAddr: "127.0.0.1:1", RemoteRequestId: "p-" + id,
			RemoteTpSize: 1, RemoteNumTokens: 32}
		mut(p)
		return &pb.SchedulerOp{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{
			Request: &pb.EngineRequest{RequestId: id, PromptTokens: 32, Params: p}, Blocks: []*pb.BlockList{{BlockIds: []int32{4, 5}}}, External: 32}}}
	}
	tests := []struct {
		name, engine, field string
		op                  *pb.SchedulerOp
		good                *pb.SchedulerOp
	}{
		{"request_id", "P", "request.request_id", finished(long, ""), finished("p1", "")},
		{"transfer_id", "P", "params.transfer_id", finished("p2", long), finished("p3", "")},
		{"remote_engine_id", "D", "params.remote_engine_id", alloc("d1", func(p *pb.TransferParams) { p.RemoteEngineId = long }), alloc("d2", func(*pb.TransferParams) {})},
		{"remote_request_id", "D", "params.remote_request_id", alloc("d3", func(p *pb.TransferParams) { p.RemoteRequestId = long }), alloc("d4", func(*pb.TransferParams) {})},
		{"remote_addr", "D", "params.remote_addr", alloc("d5", func(p *pb.TransferParams) { p.RemoteAddr = long }), alloc("d6", func(*pb.TransferParams) {})},
		{"after_alloc request_id", "D", "request.request_id", alloc(long, func(*pb.TransferParams) {}), alloc("d7", func(*pb.TransferParams) {})},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := d.srv.Refusals()["bad_request"]
			resp, err := c.Step(ctx, &pb.StepRequest{EngineId: tc.engine, Ops: []*pb.SchedulerOp{tc.op, tc.good}, BuildMeta: true})
			if err != nil {
				t.Fatal(err)
			}
			var bad *pb.OpResult
			for _, r := range resp.Results {
				switch {
				case r.Index == 0:
					bad = r
				case r.Code != 0:
					t.Errorf("the good op: %v, want it applied", r)
				}
			}
			want := "1048576 bytes, want at most 1024"
			if bad == nil || bad.Code != int32(codes.InvalidArgument) || !strings.Contains(bad.Error, tc.field) || !strings.Contains(bad.Error, want) {
				t.Fatalf("op with %s of %d bytes: %.300v, want InvalidArgument naming %s and %q", tc.field, len(long), bad, tc.field, want)
			}
			if len(bad.Error) > 256 {
				t.Errorf("error has %d bytes, want the value quoted in part only", len(bad.Error))
			}
			if got := d.srv.Refusals()["bad_request"] - before; got != 1 {
				t.Errorf("bad_request refusals counted %d, want 1", got)
			}
			if n := len(resp.Meta.GetRecv()) + len(resp.Meta.GetSend()); n != 1 {
				t.Errorf("step staged %d requests, want the good op's 1", n)
			}
			for _, e := range resp.Meta.GetRecv() {
				if len(e.RequestId) > kvxfer.MaxIDBytes || len(e.GetRemote().GetEngineId()) > kvxfer.MaxIDBytes {
					t.Errorf("step staged a receive with an id past MaxIDBytes")
				}
			}
		})
	}
	// Columns rows and a call alone are refused alike.
	resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "P", ErrorsOnly: true, Columns: &pb.StepColumns{RequestFinished: &pb.RequestColumns{
		RequestId: []string{"c1", long}, Status: []pb.FinishStatus{1, 1}, Flags: []uint32{2, 2}, BlockLens: []int32{1, 1}, BlockIds: []int32{7, 8}}}})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Results) != 1 || resp.Results[0].Index != 1 || !strings.Contains(resp.Results[0].Error, "request.request_id") {
		t.Errorf("columns with one long request id: %v, want row 1 refused naming request.request_id", resp.Results)
	}
	_, err = c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: &pb.EngineRequest{RequestId: long, PromptTokens: 32}})
	if err == nil || !strings.Contains(err.Error(), "request.request_id") || len(err.Error()) > 256 {
		t.Errorf("MatchedTokens with a long request id: %.300v, want InvalidArgument naming request.request_id", err)
	}
}

// A peer's handshake naming an engine id longer than any engine may have
// (MaxEngineID) is refused as bad input, naming the field and its length,
// counted as bad_handshake; before, it was answered as an unknown engine,
// uncounted, with the whole id (up to a message) echoed in the error.
func TestHandshakeEngineIDBounded(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	long := strings.Repeat("e", 1<<20)
	_, err := d.srv.Handshake(context.Background(), &pb.HandshakeRequest{EngineId: long})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "handshake.engine_id") || !strings.Contains(err.Error(), "1048576 bytes") {
		t.Errorf("handshake for an engine id of %d bytes: %.300v, want InvalidArgument naming handshake.engine_id and its length", len(long), err)
	}
	if err != nil && len(err.Error()) > 256 {
		t.Errorf("error has %d bytes, want the id quoted in part only", len(err.Error()))
	}
	if got := d.srv.Refusals()["bad_handshake"]; got != 1 {
		t.Errorf("bad_handshake refusals = %d, want 1", got)
	}
}

// A scheduler call naming an engine id longer than any scheduler may have
// is refused as bad input naming engine_id and its length, counted as
// bad_request; before, it was answered as an unknown engine, uncounted,
// with the whole id echoed in the error.
func TestSchedulerEngineIDBounded(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	long := strings.Repeat("e", 1<<20)
	_, err := c.BuildMeta(ctx, &pb.BuildMetaRequest{EngineId: long})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "engine_id") || !strings.Contains(err.Error(), "1048576 bytes") {
		t.Errorf("BuildMeta for an engine id of %d bytes: %.300v, want InvalidArgument naming engine_id and its length", len(long), err)
	}
	if err != nil && len(err.Error()) > 256 {
		t.Errorf("error has %d bytes, want the id quoted in part only", len(err.Error()))
	}
	if got := d.srv.Refusals()["bad_request"]; got != 1 {
		t.Errorf("bad_request refusals = %d, want 1", got)
	}
}
