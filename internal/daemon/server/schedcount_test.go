package server_test

import (
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// Every SchedulerService call refused for the engine's bad input
// (InvalidArgument) is counted, as a bad hello is: kvxfer_refused_total
// {reason="bad_request"}. Before, only their answers named them: a
// negative token count, an unknown finish status, a config out of range or
// an empty op were refused and counted nowhere in kvxferd's metrics.
func TestSchedulerBadRequestsCounted(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	openPushD(t, c, ctx)
	req := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40}
	calls := []struct {
		name string
		call func() error
	}{
		{"OpenScheduler(lease_millis huge)", func() error {
			_, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH, TpSize: 1,
				LogicalBlockSize: 16, LeaseMillis: 1 << 62}})
			return err
		}},
		{"MatchedTokens(computed -100)", func() error {
			_, err := c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: req, Computed: -100})
			return err
		}},
		{"RequestFinished(status 9)", func() error {
			_, err := c.RequestFinished(ctx, &pb.RequestFinishedRequest{EngineId: "D", Request: req, Status: 9})
			return err
		}},
		{"Step(an empty op)", func() error {
			r, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", Ops: []*pb.SchedulerOp{{}}})
			if err == nil && len(r.Results) == 1 {
				return status.Error(codes.Code(r.Results[0].Code), r.Results[0].Error)
			}
			return err
		}},
	}
	for i, tc := range calls {
		if err := tc.call(); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("%s = %v, want InvalidArgument", tc.name, err)
		}
		if n := d.srv.Refusals()["bad_request"]; n != uint64(i+1) {
			t.Errorf("after %s: Refusals()[bad_request] = %d, want %d (%v)", tc.name, n, i+1, d.srv.Refusals())
		}
	}
}
