package server_test

import (
	"strconv"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// The steps an engine's scheduler keeps published are bounded in bytes as
// well as in count: the oldest go first (a rank that far behind has its
// step_ref dropped, naming its requests). On the old code only the count
// was bounded (1,024 steps): an engine publishing large steps held up to
// 1,024 times the largest on the daemon (about 4 GiB).
func TestPublishedStepsBoundedInBytes(t *testing.T) {
	const budget = 1 << 20
	server.SetMaxPublishedBytesForTest(t, budget)
	d, c, ctx := schedulerClient(t)
	openPushD(t, c, ctx)
	const steps, blocks = 40, 16 << 10 // each step about 32 KiB encoded, more in memory
	ids := make([]int32, blocks)
	for i := range ids {
		ids[i] = int32(i + 1)
	}
	for s := 1; s <= steps; s++ {
		id := "d-" + strconv.Itoa(s)
		req := &pb.EngineRequest{RequestId: id, PromptTokens: 16 * blocks, Params: &pb.TransferParams{TransferId: "t" + id,
			DoRemotePrefill: true, RemoteEngineId: "P", RemoteAddr: "127.0.0.1:1", RemoteTpSize: 1}}
		r, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", PublishStep: uint64(s), Ops: []*pb.SchedulerOp{{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{
			Request: req, Blocks: []*pb.BlockList{{BlockIds: ids}}, External: 16 * blocks}}}}})
		if err != nil || len(r.Results) > 0 {
			t.Fatalf("step %d: %v, %v", s, r.GetResults(), err)
		}
	}
	kept := d.srv.PublishedStepsForTest("D")
	size, newest := 0, false
	for _, m := range kept {
		size += proto.Size(m)
		newest = newest || m.Step == steps
	}
	if !newest {
		t.Errorf("the newest step is not kept")
	}
	if size > budget {
		t.Errorf("%d steps kept, %d bytes encoded, want at most %d bytes", len(kept), size, budget)
	}
}
