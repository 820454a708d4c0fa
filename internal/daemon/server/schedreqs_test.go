package server_test

import (
	"context"
	"fmt"
	"runtime"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A producer engine whose requests finish with blocks held, and which
// never hands back their sending outcomes (Update), grew its scheduler in
// the daemon by one entry per request, without bound. The requests one
// scheduler tracks are bounded (-max-requests, as a worker rank's): one
// more is refused (ResourceExhausted naming the bound, counted as
// scheduler_requests) while the engine's others carry on, and an outcome
// handed back makes room.
func TestSchedulerRequestsBounded(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", runSchedulerRequestsBounded) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runSchedulerRequestsBounded(t *testing.T) {
	d, c, _ := schedulerClient(t)
	// Its own bound, not schedulerClient's 10 s for a few calls: the
	// 65,636 requests take some 6 s under -race on a busy 2-core machine
	// and went past 10 s when starved (a CI-only failure, DeadlineExceeded
	// in the middle of the batches).
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "P", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	const total, per = kvxfer.DefaultMaxRequests + 100, 10000
	finished := func(i int) *pb.SchedulerOp {
		r := &pb.EngineRequest{RequestId: fmt.Sprintf("p-%d", i), PromptTokens: 16, Params: &pb.TransferParams{DoRemoteDecode: true}}
		return &pb.SchedulerOp{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{Request: r,
			Status: pb.FinishStatus_FINISH_STATUS_STOPPED, Blocks: []*pb.BlockList{{BlockIds: []int32{1}}}, Computed: 16}}}
	}
	var refused []*pb.OpResult
	for first := 0; first < total; first += per {
		ops := make([]*pb.SchedulerOp, 0, per)
		for i := first; i < min(first+per, total); i++ {
			ops = append(ops, finished(i))
		}
		resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "P", BuildMeta: true, ErrorsOnly: true, Ops: ops})
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range resp.Results {
			if r.Code != 0 {
				refused = append(refused, r)
			}
		}
	}
	if len(refused) != total-kvxfer.DefaultMaxRequests {
		t.Fatalf("%d requests held by one scheduler: %d refused, want %d (past -max-requests %d)", total, len(refused), total-kvxfer.DefaultMaxRequests, kvxfer.DefaultMaxRequests)
	}
	if r := refused[0]; r.Code != int32(codes.ResourceExhausted) || !strings.Contains(r.Error, "-max-requests") {
		t.Errorf("refusal = %v, want ResourceExhausted naming -max-requests", r)
	}
	if r := d.srv.Refusals(); r["scheduler_requests"] != uint64(len(refused)) {
		t.Errorf("refusals = %v, want scheduler_requests %d", r, len(refused))
	}
	// An outcome handed back makes room for one more.
	resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "P", BuildMeta: true, Ops: []*pb.SchedulerOp{
		{Op: &pb.SchedulerOp_Update{Update: &pb.UpdateRequest{Finished: &pb.Finished{Sending: []*pb.Outcome{{RequestId: "p-0", Result: pb.Outcome_RESULT_DONE}}}}}},
		finished(total), finished(total + 1),
	}})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Results) != 2 || !resp.Results[0].Delay || resp.Results[1].Code != int32(codes.ResourceExhausted) {
		t.Errorf("after one outcome: %v, want one more request held and the next refused", resp.Results)
	}
}
