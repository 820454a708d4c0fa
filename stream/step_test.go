package stream_test

import (
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// Step applies a step's calls in order in one round trip: the same push
// flow as TestSchedulerService, with a bad op in the middle that is
// reported by index and code while the ops around it still apply.
func TestSchedulerStep(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	for _, e := range []string{"P", "D"} {
		if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: e, Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
			t.Fatal(err)
		}
	}
	dreq := func(id string) *pb.EngineRequest {
		return &pb.EngineRequest{RequestId: id, PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t-" + id, DoRemotePrefill: true,
			RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteTpSize: 1}}
	}
	bad := &pb.EngineRequest{RequestId: "d-bad", PromptTokens: 40, Params: &pb.TransferParams{DoRemotePrefill: true, RemoteAddr: "x"}}
	alloc := func(r *pb.EngineRequest, ids ...int32) *pb.SchedulerOp {
		return &pb.SchedulerOp{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: r, Blocks: []*pb.BlockList{{BlockIds: ids}}, External: 40}}}
	}
	resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", BuildMeta: true, Ops: []*pb.SchedulerOp{
		alloc(dreq("d-1"), 4, 5, 6), alloc(bad, 7, 8, 9), {}, alloc(dreq("d-2"), 10, 11, 12),
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Results) != 2 || resp.Results[0].Index != 1 || resp.Results[0].Code != int32(codes.InvalidArgument) ||
		!strings.Contains(resp.Results[0].Error, "RemoteEngineID") || resp.Results[1].Index != 2 || !strings.Contains(resp.Results[1].Error, "ops[2] is empty") {
		t.Fatalf("Step results = %v, want ops 1 (RemoteEngineID) and 2 (empty) refused", resp.Results)
	}
	if got := resp.GetMeta().GetRecv(); len(got) != 2 || got[0].RequestId != "d-1" || got[1].RequestId != "d-2" || resp.Meta.Step != 1 {
		t.Fatalf("Step meta = %v, want step 1 receiving d-1 and d-2", resp.Meta)
	}
	if resp.Counters.GetBadParams() != 1 {
		t.Errorf("counters = %v, want bad_params 1", resp.Counters)
	}
	// P: a request finishes, then the next step reports it sent; both in
	// one Step each, ops in order.
	preq := &pb.EngineRequest{RequestId: "p-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t-d-1", DoRemoteDecode: true}}
	resp, err = c.Step(ctx, &pb.StepRequest{EngineId: "P", BuildMeta: true, Ops: []*pb.SchedulerOp{
		{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{Request: preq, Status: pb.FinishStatus_FINISH_STATUS_STOPPED,
			Blocks: []*pb.BlockList{{BlockIds: []int32{1, 2, 3}}}, Computed: 40}}},
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Results) != 1 || !resp.Results[0].Delay || resp.Results[0].Params.GetRemoteRequestId() != "p-1" || !resp.Results[0].Params.GetDoRemotePrefill() {
		t.Fatalf("Step results = %v, want request_finished's delay and params", resp.Results)
	}
	if len(resp.Meta.GetSend()) != 1 || !resp.Pending {
		t.Fatalf("Step = meta %v pending %v, want p-1 held and pending", resp.Meta, resp.Pending)
	}
	resp, err = c.Step(ctx, &pb.StepRequest{EngineId: "P", Ops: []*pb.SchedulerOp{
		{Op: &pb.SchedulerOp_Update{Update: &pb.UpdateRequest{Finished: &pb.Finished{Sending: []*pb.Outcome{{RequestId: "p-1", Result: pb.Outcome_RESULT_DONE}}}}}},
	}})
	if err != nil || resp.Pending || resp.Meta != nil {
		t.Fatalf("Step(update) = %v, %v; want nothing pending and no meta", resp, err)
	}
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "nobody"}); err == nil || !strings.Contains(err.Error(), "OpenScheduler") {
		t.Errorf("Step(unknown engine) = %v, want NotFound naming OpenScheduler", err)
	}
}

// Steps applies a stream of steps in order; with publish_step the
// metadata stays on the daemon and the engine's ranks take it by
// reference, even when a rank's step_ref arrives before its step.
func TestStepsPublishAndStepRef(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemon(t, shmDir)
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}
	e := attach(t, d, shmDir, "E", &model, kvsim.Engine{ID: 1, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16,
		Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8}, kvxfer.ModePush)
	rs := e.streams[0][0]
	_, c, ctx := schedulerClientOn(t, d)
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	st, err := c.Steps(ctx)
	if err != nil {
		t.Fatal(err)
	}
	publish := func(step uint64) *pb.StepResponse {
		t.Helper()
		if err := st.Send(&pb.StepsRequest{Step: &pb.StepRequest{EngineId: "E", PublishStep: step}}); err != nil {
			t.Fatal(err)
		}
		r, err := st.Recv()
		if err != nil {
			t.Fatalf("publish %d: %v", step, err)
		}
		return r.Step
	}
	if r := publish(1); r.PublishStep != 1 || r.Meta != nil {
		t.Fatalf("publish(1) = %v, want publish_step 1 and no meta", r)
	}
	if err := rs.StepRef(1); err != nil {
		t.Fatal(err)
	}
	// The rank asks for step 3 before the scheduler published it.
	if err := rs.StepRef(3); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	publish(3)
	// Step 2 was never published: the rank gets a StepError naming it, and
	// nothing else (steps 1 and 3 applied).
	if err := rs.StepRef(2); err != nil {
		t.Fatal(err)
	}
	select {
	case msg := <-rs.StepErrors():
		if !strings.Contains(msg, "step_ref.step = 2") {
			t.Errorf("StepError = %q, want one naming step_ref.step = 2", msg)
		}
	case <-ctx.Done():
		t.Fatal("no StepError for an unpublished step")
	}
	select {
	case msg := <-rs.StepErrors():
		t.Errorf("unexpected StepError %q", msg)
	default:
	}
	// Steps must increase: the stream ends with InvalidArgument.
	if err := st.Send(&pb.StepsRequest{Step: &pb.StepRequest{EngineId: "E", PublishStep: 3}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "publish_step = 3") {
		t.Errorf("publish(3) again: %v, want InvalidArgument naming publish_step", err)
	}
}
