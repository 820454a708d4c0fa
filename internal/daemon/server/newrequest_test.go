package server_test

import (
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A step's new_request op tells a pull consumer's Scheduler the request
// arrived: the step's metadata lists it in await (its producer, request
// and expiry, no blocks), which a rank reads back as the same entry, and
// its end before allocation in a later step's await_end. Bad params are
// not awaited, and not refused (after_alloc refuses them, counted once).
func TestStepNewRequestAwaits(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "D", Mode: pb.Mode_MODE_PULL, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	expiry := time.Unix(1_800_000_000, 5)
	req := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t-1", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteRequestId: "p-1", RemoteTpSize: 1, Mode: pb.Mode_MODE_PULL,
		RemoteBlockIds: []*pb.Span{{BlockIds: []int32{1, 2, 3}}}, RemoteNumTokens: 40, RemoteBlocksExpiryUnixNanos: expiry.UnixNano()}}
	bad := &pb.EngineRequest{RequestId: "d-bad", PromptTokens: 40, Params: &pb.TransferParams{DoRemotePrefill: true, RemoteAddr: "x", Mode: pb.Mode_MODE_PULL}}
	newReq := func(r *pb.EngineRequest) *pb.SchedulerOp {
		return &pb.SchedulerOp{Op: &pb.SchedulerOp_NewRequest{NewRequest: &pb.NewRequestRequest{Request: r}}}
	}
	resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", BuildMeta: true, Ops: []*pb.SchedulerOp{newReq(req), newReq(bad)}})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Results) != 0 || resp.Counters.GetBadParams() != 0 {
		t.Fatalf("Step results = %v, counters %v; want none (bad params are left to after_alloc, which refuses them)", resp.Results, resp.Counters)
	}
	m, refused, err := stream.StepEntriesFromProto(resp.GetMeta())
	if err != nil || len(refused) != 0 {
		t.Fatalf("StepEntriesFromProto = %v, %v", refused, err)
	}
	if len(m.Await) != 1 || m.Await[0].ReqID != "d-1" || m.Await[0].TransferID != "t-1" || m.Await[0].Remote.ReqID != "p-1" ||
		m.Await[0].Remote.EngineID != "P" || !m.Await[0].Remote.Expiry.Equal(expiry) || len(m.Recv) != 0 {
		t.Fatalf("step 1 = await %+v, recv %d; want d-1 awaited with P's request and expiry", m.Await, len(m.Recv))
	}
	resp, err = c.Step(ctx, &pb.StepRequest{EngineId: "D", BuildMeta: true, Ops: []*pb.SchedulerOp{
		{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{Request: req, Status: pb.FinishStatus_FINISH_STATUS_ABORTED}}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if got := resp.GetMeta().GetAwaitEnd(); len(got) != 1 || got[0] != "d-1" {
		t.Fatalf("step 2 await_end = %v, want d-1 (ended in the queue)", got)
	}
}
