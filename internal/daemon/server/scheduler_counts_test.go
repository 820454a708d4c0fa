package server_test

import (
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// Counts out of range from an engine are InvalidArgument naming the
// field: a negative computed count made MatchedTokens promise more tokens
// than the prompt holds (prompt - computed), a negative prompt or a
// negative computed/scheduled count at Scheduled went through unchecked.
func TestSchedulerServiceRefusesNegativeCounts(t *testing.T) {
	_, c, ctx := schedulerClient(t)
	openPushD(t, c, ctx)
	dreq := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t1", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: "127.0.0.1:1", RemoteTpSize: 1}}
	mt, err := c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: dreq, Computed: -100})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "computed = -100") {
		t.Errorf("MatchedTokens(computed -100) = %v, %v; want InvalidArgument naming computed", mt, err)
	}
	neg := &pb.EngineRequest{RequestId: "d-2", PromptTokens: -5, Params: dreq.Params}
	mt, err = c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: neg})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "prompt_tokens = -5") {
		t.Errorf("MatchedTokens(prompt_tokens -5) = %v, %v; want InvalidArgument naming prompt_tokens", mt, err)
	}
	preq := &pb.EngineRequest{RequestId: "p-1", PromptTokens: 40, Params: &pb.TransferParams{DoRemoteDecode: true}}
	for _, tc := range []struct {
		computed, scheduled int64
		want                string
	}{{-1, 16, "computed = -1"}, {0, -16, "scheduled = -16"}, {1 << 40, 0, "computed = 1099511627776"}} {
		_, err = c.Scheduled(ctx, &pb.ScheduledRequest{EngineId: "D", Request: preq, Computed: tc.computed, Scheduled: tc.scheduled})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("Scheduled(%d, %d) = %v; want InvalidArgument naming %q", tc.computed, tc.scheduled, err, tc.want)
		}
	}
}
