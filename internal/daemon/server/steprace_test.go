package server_test

import (
	"context"
	"strconv"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A Step refused for its publish_step applies none of its ops, also when
// another Step of the engine published a later step while its ops were
// being applied (two Steps streams at once: a connector that reopened its
// stream while the daemon still worked through the old one's last step).
// On the old code the ops of the refused Step were staged all the same
// and went out with the engine's next published step, after the engine
// was told the step failed (its ranks' step_refs of it dropped, their
// requests failed by the engine, then taken in by the ranks anew).
func TestStepRefusedPublishAppliesNothing(t *testing.T) {
	d, c, _ := schedulerClient(t)
	// Its own bound: 40 rounds of 1,000-op Steps under -race took more
	// than the helper's 10 s on a loaded machine.
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	openPushD(t, c, ctx)
	const rounds, ops = 40, 1000
	var next uint64
	refused := 0
	for round := range rounds {
		big := &pb.StepRequest{EngineId: "D"}
		for i := range ops {
			id := "a-" + strconv.Itoa(round) + "-" + strconv.Itoa(i)
			req := &pb.EngineRequest{RequestId: id, PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t" + id,
				DoRemotePrefill: true, RemoteEngineId: "P", RemoteAddr: "127.0.0.1:1", RemoteTpSize: 1}}
			big.Ops = append(big.Ops, &pb.SchedulerOp{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{
				Request: req, Blocks: []*pb.BlockList{{BlockIds: []int32{int32(3*i + 1), int32(3*i + 2), int32(3*i + 3)}}}, External: 40}}})
		}
		big.PublishStep, next = next+1, next+2
		if round == 0 {
			// Alone, it stages its requests in its step.
			if r, err := c.Step(ctx, big); err != nil || len(r.Results) > 0 {
				t.Fatalf("Step = %v (%d op results, the first %v), want no error", err, len(r.GetResults()), r.GetResults()[0])
			}
			if n := len(d.srv.PublishedForTest("D", big.PublishStep).GetRecv()); n != ops {
				t.Fatalf("step %d stages %d requests, want %d", big.PublishStep, n, ops)
			}
			continue
		}
		small := &pb.StepRequest{EngineId: "D", PublishStep: next}
		var wg sync.WaitGroup
		var bigErr error
		wg.Add(2)
		go func() { defer wg.Done(); _, bigErr = c.Step(ctx, big) }()
		go func() {
			defer wg.Done()
			// Most often while big's ops apply, at times before or after.
			time.Sleep(time.Duration(round%10) * 5 * time.Millisecond)
			if _, err := c.Step(ctx, small); err != nil {
				t.Errorf("round %d: Step(publish %d) = %v", round, small.PublishStep, err)
			}
		}()
		wg.Wait()
		if bigErr == nil {
			continue
		}
		if status.Code(bigErr) != codes.InvalidArgument {
			t.Fatalf("round %d: Step(publish %d) = %v, want InvalidArgument or nil", round, big.PublishStep, bigErr)
		}
		refused++
		// Nothing the refused Step staged is in the step published beside
		// it, nor in the next.
		if n := len(d.srv.PublishedForTest("D", small.PublishStep).GetRecv()); n > 0 {
			t.Fatalf("round %d: the refused Step (publish_step %d) staged %d of its requests, which step %d carries",
				round, big.PublishStep, n, small.PublishStep)
		}
		r, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", BuildMeta: true})
		if err != nil {
			t.Fatal(err)
		}
		if n := len(r.Meta.GetRecv()); n > 0 {
			t.Fatalf("round %d: the refused Step (publish_step %d) staged %d of its requests (%s ...), which the next step carries",
				round, big.PublishStep, n, r.Meta.Recv[0].RequestId)
		}
	}
	t.Logf("%d of %d rounds refused the Step with ops", refused, rounds)
}
