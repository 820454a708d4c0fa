package server_test

import (
	"context"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// schedulerClient starts a daemon and returns a SchedulerService client on
// its unix socket, and a context bounded for the test.
func schedulerClient(t *testing.T) (*daemon, pb.SchedulerServiceClient, context.Context) {
	t.Helper()
	return schedulerClientOn(t, startDaemon(t, t.TempDir()))
}

// schedulerClientOn is schedulerClient on a daemon the test started.
// openPushD opens engine D's scheduler (push, TP 1, blocks of 16) on c.
func openPushD(t *testing.T, c pb.SchedulerServiceClient, ctx context.Context) {
	t.Helper()
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "D", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
}

func schedulerClientOn(t *testing.T, d *daemon) (*daemon, pb.SchedulerServiceClient, context.Context) {
	t.Helper()
	cc, err := grpc.NewClient("unix://"+d.sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	t.Cleanup(cancel)
	return d, pb.NewSchedulerServiceClient(cc), ctx
}

// The SchedulerService runs SPEC §7's push flow for a P and a D engine.
func TestSchedulerService(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	for _, e := range []string{"P", "D"} {
		resp, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: e, Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}})
		if err != nil || resp.Addr != d.peerAddr {
			t.Fatalf("OpenScheduler(%s) = %v, %v", e, resp, err)
		}
	}
	// D: the router hands it the request with P's coordinates.
	dreq := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t1", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteTpSize: 1}}
	mt, err := c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: dreq})
	if err != nil || mt.Tokens != 40 || !mt.Async {
		t.Fatalf("MatchedTokens = %v, %v", mt, err)
	}
	aa, err := c.AfterAlloc(ctx, &pb.AfterAllocRequest{EngineId: "D", Request: dreq, Blocks: []*pb.BlockList{{BlockIds: []int32{4, 5, 6}}}, External: 40})
	if err != nil || aa.Params.DoRemotePrefill {
		t.Fatalf("AfterAlloc = %v, %v; want do_remote_prefill consumed", aa, err)
	}
	// P finishes.
	preq := &pb.EngineRequest{RequestId: "p-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t1", DoRemoteDecode: true}}
	rf, err := c.RequestFinished(ctx, &pb.RequestFinishedRequest{EngineId: "P", Request: preq, Status: pb.FinishStatus_FINISH_STATUS_STOPPED,
		Blocks: []*pb.BlockList{{BlockIds: []int32{1, 2, 3}}}, Computed: 40})
	if err != nil || !rf.Delay || rf.Params.Mode != pb.Mode_MODE_PUSH || rf.Params.RemoteNumTokens != 40 {
		t.Fatalf("RequestFinished = %v, %v", rf, err)
	}
	pm, err := c.BuildMeta(ctx, &pb.BuildMetaRequest{EngineId: "P"})
	if err != nil || len(pm.Meta.Send) != 1 || pm.Meta.Send[0].RequestId != "p-1" {
		t.Fatalf("P BuildMeta = %v, %v", pm, err)
	}
	dm, err := c.BuildMeta(ctx, &pb.BuildMetaRequest{EngineId: "D"})
	if err != nil || len(dm.Meta.Recv) != 1 || dm.Meta.Recv[0].Remote.EngineId != "P" || len(dm.Meta.Recv[0].Local[0].BlockIds) != 3 {
		t.Fatalf("D BuildMeta = %v, %v", dm, err)
	}
	up, err := c.Update(ctx, &pb.UpdateRequest{EngineId: "P", Finished: &pb.Finished{Sending: []*pb.Outcome{{RequestId: "p-1", Result: pb.Outcome_RESULT_DONE}}}})
	if err != nil || up.Pending {
		t.Fatalf("Update = %v, %v; want nothing pending", up, err)
	}
	// Bad input and unknown engines.
	for _, tc := range []struct {
		name string
		err  error
		code codes.Code
		want string
	}{
		{"unknown engine", func() error { _, err := c.BuildMeta(ctx, &pb.BuildMetaRequest{EngineId: "X"}); return err }(), codes.NotFound, "OpenScheduler"},
		{"no engine", func() error { _, err := c.BuildMeta(ctx, &pb.BuildMetaRequest{}); return err }(), codes.InvalidArgument, "engine_id"},
		{"bad status", func() error {
			_, err := c.RequestFinished(ctx, &pb.RequestFinishedRequest{EngineId: "P", Request: preq})
			return err
		}(), codes.InvalidArgument, "status"},
		{"no request id", func() error {
			_, err := c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "P", Request: &pb.EngineRequest{}})
			return err
		}(), codes.InvalidArgument, "request_id"},
		{"bad config", func() error {
			_, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "Y", Mode: pb.Mode_MODE_PUSH}})
			return err
		}(), codes.InvalidArgument, "LogicalBlockSize"},
		{"missing params field", func() error {
			bad := &pb.EngineRequest{RequestId: "d-2", Params: &pb.TransferParams{DoRemotePrefill: true, RemoteAddr: "x"}}
			_, err := c.AfterAlloc(ctx, &pb.AfterAllocRequest{EngineId: "D", Request: bad, Blocks: []*pb.BlockList{{BlockIds: []int32{1}}}, External: 16})
			return err
		}(), codes.InvalidArgument, "RemoteEngineID"},
	} {
		if status.Code(tc.err) != tc.code || !strings.Contains(tc.err.Error(), tc.want) {
			t.Errorf("%s: error = %v, want %v naming %q", tc.name, tc.err, tc.code, tc.want)
		}
	}
	if _, err := c.CloseScheduler(ctx, &pb.CloseSchedulerRequest{EngineId: "P"}); err != nil {
		t.Fatal(err)
	}
}

// Layer-wise push through the SchedulerService: Prefill lists a producer
// request in the metadata of the step that completes its prompt, with its
// sliding-window group clipped; bad input is InvalidArgument naming the
// field.
func TestSchedulerServicePrefill(t *testing.T) {
	_, c, ctx := schedulerClient(t)
	groups := []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}, {Kind: pb.CacheKind_CACHE_KIND_SLIDING_WINDOW, Window: 32}}
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "P", Mode: pb.Mode_MODE_PUSH, TpSize: 1,
		LogicalBlockSize: 16, Groups: groups, Layerwise: true}}); err != nil {
		t.Fatal(err)
	}
	preq := &pb.EngineRequest{RequestId: "p-1", PromptTokens: 96, Params: &pb.TransferParams{TransferId: "t1", DoRemoteDecode: true}}
	blocks := []*pb.BlockList{{BlockIds: []int32{1, 2, 3, 4, 5, 6}}, {BlockIds: []int32{11, 12, 13, 14, 15, 16}}}
	build := func() *pb.StepMeta {
		t.Helper()
		m, err := c.BuildMeta(ctx, &pb.BuildMetaRequest{EngineId: "P"})
		if err != nil {
			t.Fatal(err)
		}
		return m.Meta
	}
	// A first chunk: the prompt is not complete yet.
	if _, err := c.Prefill(ctx, &pb.PrefillRequest{EngineId: "P", Request: preq, Blocks: blocks, Computed: 0, Scheduled: 64}); err != nil {
		t.Fatal(err)
	}
	if m := build(); len(m.Prefill) != 0 {
		t.Fatalf("prefill after a first chunk = %v, want none", m.Prefill)
	}
	if _, err := c.Prefill(ctx, &pb.PrefillRequest{EngineId: "P", Request: preq, Blocks: blocks, Computed: 64, Scheduled: 32}); err != nil {
		t.Fatal(err)
	}
	m := build()
	if len(m.Prefill) != 1 {
		t.Fatalf("prefill of the completing step = %v, want p-1", m.Prefill)
	}
	got := m.Prefill[0]
	if got.RequestId != "p-1" || got.TransferId != "t1" || got.Tokens != 96 ||
		!slices.Equal(got.Blocks[0].BlockIds, []int32{1, 2, 3, 4, 5, 6}) ||
		!slices.Equal(got.Blocks[1].BlockIds, []int32{14, 15, 16}) || got.Blocks[1].Start != 48 {
		t.Errorf("prefill = %v, want p-1 (t1, 96 tokens) with group 1 clipped to blocks 14..16 from token 48", got)
	}
	if _, err := c.Prefill(ctx, &pb.PrefillRequest{EngineId: "P", Request: preq, Blocks: blocks, Computed: 96, Scheduled: 1}); err != nil {
		t.Fatal(err)
	}
	if m := build(); len(m.Prefill) != 0 {
		t.Errorf("prefill of a decode step = %v, want none (listed once)", m.Prefill)
	}
	for _, tc := range []struct {
		name string
		req  *pb.PrefillRequest
		code codes.Code
		want string
	}{
		{"group count", &pb.PrefillRequest{EngineId: "P", Request: &pb.EngineRequest{RequestId: "p-2", PromptTokens: 16,
			Params: &pb.TransferParams{DoRemoteDecode: true}}, Blocks: blocks[:1], Scheduled: 16}, codes.InvalidArgument, "blocks has 1 groups, want 2"},
		{"negative scheduled", &pb.PrefillRequest{EngineId: "P", Request: &pb.EngineRequest{RequestId: "p-2", PromptTokens: 16,
			Params: &pb.TransferParams{DoRemoteDecode: true}}, Blocks: blocks, Scheduled: -1}, codes.InvalidArgument, "scheduled"},
		{"computed out of range", &pb.PrefillRequest{EngineId: "P", Request: preq, Blocks: blocks, Computed: 1 << 40}, codes.InvalidArgument, "computed"},
		{"no request id", &pb.PrefillRequest{EngineId: "P", Request: &pb.EngineRequest{}}, codes.InvalidArgument, "request_id"},
		{"no engine", &pb.PrefillRequest{Request: preq}, codes.InvalidArgument, "engine_id"},
		{"unknown engine", &pb.PrefillRequest{EngineId: "X", Request: preq}, codes.NotFound, "OpenScheduler"},
	} {
		_, err := c.Prefill(ctx, tc.req)
		if status.Code(err) != tc.code || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: Prefill error = %v, want %v naming %q", tc.name, err, tc.code, tc.want)
		}
	}
	_, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "Q", Mode: pb.Mode_MODE_PULL, TpSize: 1,
		LogicalBlockSize: 16, Layerwise: true}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "Layerwise") {
		t.Errorf("OpenScheduler(pull, layerwise) error = %v, want InvalidArgument naming Layerwise", err)
	}
}

// SchedulerConfig.prefill_backoff reaches the engine's Scheduler: a
// consumer loads the prompt less the backoff (vLLM's MTP lookahead less
// one here), and a negative backoff is refused naming the field.
func TestSchedulerServicePrefillBackoff(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "D", Mode: pb.Mode_MODE_PUSH,
		TpSize: 1, LogicalBlockSize: 16, PrefillBackoff: 2}}); err != nil {
		t.Fatal(err)
	}
	dreq := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 64, Params: &pb.TransferParams{TransferId: "t1", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteTpSize: 1}}
	if mt, err := c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: dreq}); err != nil || mt.Tokens != 62 || !mt.Async {
		t.Errorf("MatchedTokens = %v, %v; want 62 tokens, async", mt, err)
	}
	_, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH,
		TpSize: 1, LogicalBlockSize: 16, PrefillBackoff: -1}})
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "PrefillBackoff = -1") {
		t.Errorf("OpenScheduler(prefill_backoff -1) = %v, want InvalidArgument naming PrefillBackoff", err)
	}
}
