package server_test

import (
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
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
	e := attachSmall(t, d, shmDir, "E", 1)
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
	if err := rs.StepRef(1, nil, nil); err != nil {
		t.Fatal(err)
	}
	// The rank asks for step 3 before the scheduler published it.
	if err := rs.StepRef(3, nil, nil); err != nil {
		t.Fatal(err)
	}
	time.Sleep(20 * time.Millisecond)
	publish(3)
	// Step 2 was never published: the rank gets a StepError naming it, and
	// nothing else (steps 1 and 3 applied).
	if err := rs.StepRef(2, nil, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case se := <-rs.StepErrors():
		if !strings.Contains(se.Message, "step_ref.step = 2") || se.Step != 2 || !se.Dropped {
			t.Errorf("StepError = %+v, want step 2 dropped, naming step_ref.step = 2", se)
		}
	case <-ctx.Done():
		t.Fatal("no StepError for an unpublished step")
	}
	select {
	case se := <-rs.StepErrors():
		t.Errorf("unexpected StepError %+v", se)
	default:
	}
	// Steps must increase: the stream ends with InvalidArgument.
	if err := st.Send(&pb.StepsRequest{Step: &pb.StepRequest{EngineId: "E", PublishStep: 3}}); err != nil {
		t.Fatal(err)
	}
	if _, err := st.Recv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "publish_step = 3") {
		t.Errorf("publish(3) again: %v, want InvalidArgument naming publish_step", err)
	}
	// A refused publish_step applies none of its ops: the request staged
	// with it is not in the next published step.
	reg := &pb.EngineRequest{RequestId: "d-9", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t9", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteTpSize: 1}}
	stale := &pb.StepRequest{EngineId: "E", PublishStep: 2, Ops: []*pb.SchedulerOp{{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{
		Request: reg, Blocks: []*pb.BlockList{{BlockIds: []int32{1}}}, External: 40}}}}}
	if _, err := c.Step(ctx, stale); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("Step(publish_step 2 after 3) = %v, want InvalidArgument", err)
	}
	if r, err := c.Step(ctx, &pb.StepRequest{EngineId: "E", BuildMeta: true}); err != nil || len(r.Meta.GetRecv()) != 0 {
		t.Errorf("next step = %v, %v; want nothing staged by the refused one", r.GetMeta(), err)
	}
}

// A step a rank's worker never took in (a step_ref whose metadata was not
// published within the daemon's wait, or not at all) is reported dropped,
// naming every request the rank's step_ref said it waits on, so that the
// engine fails them: no outcome will come for them (issue 23: the error
// named only the step, and the engine, which only logged it, waited
// forever). A step whose entries the worker refused in part is not
// dropped: each refused entry's request fails in a Finished message, and
// the error only says why.
func TestDroppedStepNamesItsRequests(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runDroppedStep(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runDroppedStep(t *testing.T) {
	shmDir := t.TempDir()
	const wait = 200 * time.Millisecond
	d := startDaemonWith(t, shmDir, func(c *server.Config) { c.PublishWait = wait })
	e := attachSmall(t, d, shmDir, "E", 1)
	rs := e.streams[0][0]
	_, c, ctx := schedulerClientOn(t, d)
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	next := func() *stream.StepError {
		t.Helper()
		select {
		case se := <-rs.StepErrors():
			return se
		case <-ctx.Done():
			t.Fatal("no StepError")
			return nil
		}
	}
	want := func(se *stream.StepError, step uint64, msg string, recv, send []string) {
		t.Helper()
		if se.Step != step || !se.Dropped || !strings.Contains(se.Message, msg) || !slices.Equal(se.Recv, recv) || !slices.Equal(se.Send, send) {
			t.Errorf("StepError = %+v, want step %d dropped (%q), naming receives %q and sends %q", se, step, msg, recv, send)
		}
	}
	// Nothing published: the rank waits PublishWait, then the step is
	// dropped, naming what its step_ref listed.
	t0 := time.Now()
	if err := rs.StepRef(1, []string{"d-1", "d-2"}, []string{"p-1"}); err != nil {
		t.Fatal(err)
	}
	want(next(), 1, "not published within 200ms", []string{"d-1", "d-2"}, []string{"p-1"})
	if took := time.Since(t0); took < wait {
		t.Errorf("dropped after %v, want after PublishWait (%v)", took, wait)
	}
	// Step 3 published, step 2 never: dropped at once.
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "E", PublishStep: 3}); err != nil {
		t.Fatal(err)
	}
	if err := rs.StepRef(2, nil, []string{"p-2"}); err != nil {
		t.Fatal(err)
	}
	want(next(), 2, "step_ref.step = 2: not published", nil, []string{"p-2"})
	// A step the worker takes in, one entry refused: not dropped; that
	// request fails in a Finished message, naming the field; the good one
	// beside it is held (its outcome comes when its transfer ends).
	good := kvxfer.RecvReq{ReqID: "d-good", Local: []topology.Span{{IDs: []topology.BlockID{1}}}, Remote: kvxfer.RemoteRef{EngineID: "P", Addr: "127.0.0.1:1"}}
	bad := good
	bad.ReqID, bad.Remote.EngineID = "d-bad", ""
	if err := rs.Step(&kvxfer.StepMeta{Step: 4, Recv: []kvxfer.RecvReq{good, bad}}); err != nil {
		t.Fatal(err)
	}
	se := next()
	if se.Dropped || se.Step != 4 || !strings.Contains(se.Message, `RecvReq "d-bad": Remote.EngineID is empty`) || len(se.Recv)+len(se.Send) > 0 {
		t.Errorf("StepError = %+v, want step 4 not dropped, naming d-bad's Remote.EngineID", se)
	}
	for found := false; !found; {
		select {
		case f := <-rs.Finished():
			for _, o := range f.Recving {
				if o.ReqID != "d-bad" {
					continue // d-good's, when its handshake fails
				}
				found = true
				if o.Result != kvxfer.ResultFailed || o.Kind != kvxfer.FailureSetup || !strings.Contains(o.Reason, "Remote.EngineID is empty") {
					t.Errorf("d-bad's outcome = %+v, want failed (setup), naming Remote.EngineID", o)
				}
			}
		case <-ctx.Done():
			t.Fatal("no outcome for the refused entry")
		}
	}
}

// A step a rank takes by reference ends, on that rank, every request its
// step_ref lists that the published metadata does not stage (the engine's
// Scheduler refused the call): the engine may never read the Step answer
// that said so (it is lost with a broken Steps stream), and no worker
// outcome will come. Requests the step stages are held as usual.
func TestStepRefFailsWhatTheStepDoesNotStage(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runStepRefUnstaged(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runStepRefUnstaged(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, nil)
	e := attachSmall(t, d, shmDir, "E", 1)
	rs := e.streams[0][0]
	_, c, ctx := schedulerClientOn(t, d)
	const lease = 500 * time.Millisecond
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16,
		LeaseMillis: lease.Milliseconds()}}); err != nil {
		t.Fatal(err)
	}
	// d-bad's params lack the producer's engine id: refused. p-held
	// finishes normally: its blocks are held for a consumer. p-none's call
	// never reached the scheduler.
	bad := &pb.EngineRequest{RequestId: "d-bad", PromptTokens: 40, Params: &pb.TransferParams{DoRemotePrefill: true, RemoteAddr: "127.0.0.1:1", TransferId: "t-bad"}}
	held := &pb.EngineRequest{RequestId: "p-held", PromptTokens: 32, Params: &pb.TransferParams{DoRemoteDecode: true, TransferId: "t-held"}}
	resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "E", PublishStep: 1, ErrorsOnly: true, Ops: []*pb.SchedulerOp{
		{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: bad, Blocks: []*pb.BlockList{{BlockIds: []int32{1, 2, 3}}}, External: 40}}},
		{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{Request: held, Status: pb.FinishStatus_FINISH_STATUS_LENGTH_CAPPED,
			Blocks: []*pb.BlockList{{BlockIds: []int32{4, 5}}}, Computed: 32}}},
	}})
	if err != nil || len(resp.Results) != 1 || resp.Results[0].Index != 0 {
		t.Fatalf("Step = %v, %v; want op 0 (d-bad) refused", resp.GetResults(), err)
	}
	if err := rs.StepRef(1, []string{"d-bad"}, []string{"p-held", "p-none"}); err != nil {
		t.Fatal(err)
	}
	want := map[string]bool{"d-bad": false, "p-none": true} // id -> a send
	for len(want) > 0 {
		select {
		case f := <-rs.Finished():
			for send, os := range map[bool][]kvxfer.Outcome{false: f.Recving, true: f.Sending} {
				for _, o := range os {
					s, ok := want[o.ReqID]
					if !ok || s != send {
						t.Errorf("outcome %+v (send %v), want only d-bad's receive and p-none's send", o, send)
						continue
					}
					delete(want, o.ReqID)
					if o.Result != kvxfer.ResultFailed || o.Kind != kvxfer.FailureSetup || !strings.Contains(o.Reason, "step 1") {
						t.Errorf("%s's outcome = %+v, want failed (setup), naming step 1", o.ReqID, o)
					}
				}
			}
		case se := <-rs.StepErrors():
			t.Errorf("StepError %+v, want none (the step was taken in)", se)
		case <-ctx.Done():
			t.Fatalf("no outcome for %v", want)
		}
	}
	// p-held is held by the worker until its lease expires (no consumer
	// comes): its outcome is that, and not before.
	t0 := time.Now()
	select {
	case f := <-rs.Finished():
		if len(f.Recving) > 0 || len(f.Sending) != 1 || f.Sending[0].ReqID != "p-held" || f.Sending[0].Result != kvxfer.ResultExpired {
			t.Errorf("Finished %+v, want p-held expired", f)
		}
		if took := time.Since(t0); took < lease/2 {
			t.Errorf("p-held ended after %v, want after its lease (%v)", took, lease)
		}
	case <-ctx.Done():
		t.Fatal("no outcome for p-held")
	}
}

// A rank waiting for a step its engine's scheduler never published stops
// waiting when the engine opens its scheduler again (a connector does
// after its Steps stream broke): the step is dropped as soon as the new
// scheduler publishes a later one, not after PublishWait, which would hold
// up every step the rank takes after it.
func TestStepRefOfAReplacedScheduler(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runStepRefReplaced(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runStepRefReplaced(t *testing.T) {
	shmDir := t.TempDir()
	// PublishWait a minute, far past "at once": a drop that waited for it
	// fails (ctx's 10 s run out first). With 5 s, "at once" had to be
	// within 2.5 s of two scheduler calls, which a loaded machine could
	// miss with nothing wrong.
	const wait = time.Minute
	d := startDaemonWith(t, shmDir, func(c *server.Config) { c.PublishWait = wait })
	e := attachSmall(t, d, shmDir, "E", 1)
	rs := e.streams[0][0]
	_, c, ctx := schedulerClientOn(t, d)
	open := func() {
		t.Helper()
		if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
			t.Fatal(err)
		}
	}
	open()
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "E", PublishStep: 1}); err != nil {
		t.Fatal(err)
	}
	// Step 2 never reaches this scheduler; the rank waits for it.
	if err := rs.StepRef(2, nil, []string{"p-2"}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the rank is waiting
	t0 := time.Now()
	open()
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "E", PublishStep: 3}); err != nil {
		t.Fatal(err)
	}
	select {
	case se := <-rs.StepErrors():
		if se.Step != 2 || !se.Dropped || !slices.Equal(se.Send, []string{"p-2"}) {
			t.Errorf("StepError = %+v, want step 2 dropped, naming p-2", se)
		}
		if took := time.Since(t0); took > wait/2 {
			t.Errorf("step 2 dropped %v after the scheduler was replaced, want at once (PublishWait is %v)", took, wait)
		}
	case <-ctx.Done():
		t.Fatal("no StepError")
	}
	// The rank goes on with the new scheduler's steps.
	if err := rs.StepRef(3, nil, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case se := <-rs.StepErrors():
		t.Errorf("StepError %+v for step 3, want it taken in", se)
	case <-time.After(300 * time.Millisecond):
	}
}

// A dropped step names each of its requests once, from its step_ref and
// its metadata, in as many errors as keep each within the bound.
func TestDroppedStepSplits(t *testing.T) {
	ref := &pb.StepRef{Step: 9, RecvRequestIds: []string{"d-1", "d-2"}, SendRequestIds: []string{"p-1"}}
	meta := &pb.StepMeta{Step: 9, Recv: []*pb.RecvRequest{{RequestId: "d-2"}, {RequestId: "d-3"}, {RequestId: ""}},
		Send: []*pb.SendRequest{{RequestId: "p-1"}, {RequestId: "p-2"}}}
	got := server.DroppedStepForTest(9, "why", ref, meta, nil, nil, 1<<10)
	if len(got) != 1 || !got[0].Dropped || got[0].Message != "why" || !slices.Equal(got[0].RecvRequestIds, []string{"d-1", "d-2", "d-3"}) ||
		!slices.Equal(got[0].SendRequestIds, []string{"p-1", "p-2"}) {
		t.Errorf("droppedStep = %v, want one error naming d-1, d-2, d-3 and p-1, p-2", got)
	}
	// 11 bytes an id at most: two ids an error.
	got = server.DroppedStepForTest(9, "why", ref, meta, nil, nil, 22)
	var recv, send []string
	for i, e := range got {
		if !e.Dropped || e.Step != 9 || (i == 0) != (e.Message == "why") || len(e.RecvRequestIds)+len(e.SendRequestIds) > 2 {
			t.Errorf("droppedStep part %d = %v, want step 9 dropped, at most 2 ids, the message in the first only", i, e)
		}
		recv, send = append(recv, e.RecvRequestIds...), append(send, e.SendRequestIds...)
	}
	if len(got) != 3 || !slices.Equal(recv, []string{"d-1", "d-2", "d-3"}) || !slices.Equal(send, []string{"p-1", "p-2"}) {
		t.Errorf("droppedStep in parts = %v, want 3 errors naming d-1, d-2, d-3 and p-1, p-2 between them", got)
	}
	// A send the rank's worker ends itself (held prefilling) is left out:
	// its outcome is the worker's.
	got = server.DroppedStepForTest(9, "why", ref, meta, []string{"p-1", "d-1"}, nil, 1<<10)
	if len(got) != 1 || !slices.Equal(got[0].RecvRequestIds, []string{"d-1", "d-2", "d-3"}) || !slices.Equal(got[0].SendRequestIds, []string{"p-2"}) {
		t.Errorf("droppedStep(held p-1) = %v, want one error naming d-1, d-2, d-3 and p-2", got)
	}
}

// A step's calls sent as columns do exactly what the same calls sent as
// ops do; malformed columns are refused whole, naming the column.
func TestStepColumns(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	for _, e := range []string{"ops", "cols", "sparse", "quiet"} {
		if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: e, Mode: pb.Mode_MODE_PULL, TpSize: 1, LogicalBlockSize: 16,
			Groups: []*pb.CacheGroup{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION}, {Kind: pb.CacheKind_CACHE_KIND_SLIDING_WINDOW, Window: 16}}}}); err != nil {
			t.Fatal(err)
		}
	}
	recv := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t1", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteRequestId: "p-1", RemoteTpSize: 2, RemoteNumTokens: 40, Mode: pb.Mode_MODE_PULL,
		RemoteBlockIds: []*pb.Span{{BlockIds: []int32{7, 8, 9}}, {Start: 16, BlockIds: []int32{3, 4}}}, RemoteGeneration: 1<<63 + 77,
		RemoteBlocksExpiryUnixNanos: 1<<62 + 5}}
	bad := &pb.EngineRequest{RequestId: "d-2", PromptTokens: 40, Params: &pb.TransferParams{DoRemotePrefill: true, RemoteAddr: "x:1"}}
	send := &pb.EngineRequest{RequestId: "p-9", PromptTokens: 20, Params: &pb.TransferParams{TransferId: "t9", DoRemoteDecode: true}}
	none := &pb.EngineRequest{RequestId: "x-1", PromptTokens: 5}
	two := func(a, b []int32) []*pb.BlockList { return []*pb.BlockList{{BlockIds: a}, {BlockIds: b}} }
	ops := []*pb.SchedulerOp{
		{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{Request: send, Status: pb.FinishStatus_FINISH_STATUS_STOPPED, Blocks: two([]int32{1, 2}, []int32{5, 6}), Computed: 20}}},
		{Op: &pb.SchedulerOp_RequestFinished{RequestFinished: &pb.RequestFinishedRequest{Request: none, Status: pb.FinishStatus_FINISH_STATUS_ABORTED, Blocks: two(nil, nil)}}},
		{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: recv, Blocks: two([]int32{10, 11, 12}, []int32{13, 14}), External: 40}}},
		{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: bad, Blocks: two([]int32{20}, []int32{21}), External: 40}}},
	}
	cols := &pb.StepColumns{
		RequestFinished: &pb.RequestColumns{RequestId: []string{"p-9", "x-1"}, PromptTokens: []int64{20, 5}, Flags: []uint32{2, 4},
			TransferId: []string{"t9", ""}, RemoteEngineId: []string{"", ""}, RemoteAddr: []string{"", ""}, RemoteRequestId: []string{"", ""},
			RemoteTpSize: []int32{0, 0}, RemotePpSize: []int32{0, 0}, RemoteNumTokens: []int64{0, 0}, Mode: []pb.Mode{0, 0},
			BlockLens: []int32{2, 2, 0, 0}, BlockIds: []int32{1, 2, 5, 6}, Computed: []int64{20, 0}, Count: []int64{0, 0},
			Status: []pb.FinishStatus{pb.FinishStatus_FINISH_STATUS_STOPPED, pb.FinishStatus_FINISH_STATUS_ABORTED}},
		AfterAlloc: &pb.RequestColumns{RequestId: []string{"d-1", "d-2"}, PromptTokens: []int64{40, 40}, Flags: []uint32{1, 1},
			TransferId: []string{"t1", ""}, RemoteEngineId: []string{"P", ""}, RemoteAddr: []string{d.peerAddr, "x:1"}, RemoteRequestId: []string{"p-1", ""},
			RemoteTpSize: []int32{2, 0}, RemotePpSize: []int32{0, 0}, RemoteNumTokens: []int64{40, 0}, Mode: []pb.Mode{pb.Mode_MODE_PULL, 0},
			RemoteBlockLens: []int32{3, 2, 0, 0}, RemoteBlockStarts: []int64{0, 16, 0, 0}, RemoteBlockIds: []int32{7, 8, 9, 3, 4},
			BlockLens: []int32{3, 2, 1, 1}, BlockIds: []int32{10, 11, 12, 13, 14, 20, 21}, Computed: []int64{0, 0}, Count: []int64{40, 40},
			RemoteGeneration: []uint64{1<<63 + 77, 0}, RemoteBlocksExpiryUnixNanos: []int64{1<<62 + 5, 0}},
	}
	a, err := c.Step(ctx, &pb.StepRequest{EngineId: "ops", BuildMeta: true, Ops: ops})
	if err != nil {
		t.Fatal(err)
	}
	b, err := c.Step(ctx, &pb.StepRequest{EngineId: "cols", BuildMeta: true, Columns: cols})
	if err != nil {
		t.Fatal(err)
	}
	a.Meta.SchedulerClockUnixNanos, b.Meta.SchedulerClockUnixNanos = 0, 0
	for _, r := range append(a.Meta.Recv, b.Meta.Recv...) {
		r.DeadlineUnixNanos = 0
	}
	for _, r := range append(a.Meta.Send, b.Meta.Send...) {
		r.DeadlineUnixNanos = 0
	}
	// Columns that hold only defaults may be left out.
	sparse := proto.Clone(cols).(*pb.StepColumns)
	rf := sparse.RequestFinished
	rf.RemoteEngineId, rf.RemoteAddr, rf.RemoteRequestId, rf.RemoteTpSize, rf.RemotePpSize, rf.RemoteNumTokens, rf.Mode, rf.Count =
		nil, nil, nil, nil, nil, nil, nil, nil
	sparse.AfterAlloc.RemotePpSize, sparse.AfterAlloc.Computed = nil, nil
	s, err := c.Step(ctx, &pb.StepRequest{EngineId: "sparse", BuildMeta: true, Columns: sparse})
	if err != nil {
		t.Fatal(err)
	}
	s.Meta.SchedulerClockUnixNanos = 0
	for _, r := range s.Meta.Recv {
		r.DeadlineUnixNanos = 0
	}
	for _, r := range s.Meta.Send {
		r.DeadlineUnixNanos = 0
	}
	s.Results[0].Params.RemoteEngineId = "cols"
	a.Results[0].Params.RemoteEngineId = "cols" // the engines' own names
	for _, x := range []*pb.StepResponse{a, b, s} {
		for _, r := range x.Results {
			if r.Params != nil {
				r.Params.RemoteBlocksExpiryUnixNanos = 0 // a pull hold's end, as of each call
			}
		}
	}
	if !proto.Equal(a, b) {
		t.Errorf("columns and ops differ:\nops  %v\ncols %v", a, b)
	}
	if !proto.Equal(s, b) {
		t.Errorf("sparse columns and full ones differ:\nsparse %v\ncols   %v", s, b)
	}
	if len(b.Results) != 3 || b.Results[2].Index != 3 || !strings.Contains(b.Results[2].Error, `request "d-2"`) || len(b.Meta.Recv) != 1 {
		t.Errorf("columns: results %v, recv %v; want request_finished's answer and d-2 refused at index 3", b.Results, b.Meta.Recv)
	} else if g := b.Meta.Recv[0].Remote.GetGeneration(); g != 1<<63+77 {
		// The producer's generation the params carry reaches the
		// receive, which reads nothing of another generation.
		t.Errorf("columns: d-1's receive names the producer's generation %d, want %d (its params' remote_generation)", g, uint64(1<<63+77))
	} else if x := b.Meta.Recv[0].Remote.GetExpiryUnixNanos(); x != 1<<62+5 {
		// So does the producer's hold's end, which bounds the READs:
		// before, the columns had no such field and the receive had no
		// bound (a READ past the hold, into blocks given to another
		// request).
		t.Errorf("columns: d-1's receive has the producer's hold ending at %d, want %d (its params' remote_blocks_expiry_unix_nanos)", x, int64(1<<62+5))
	}
	// errors_only: the failed op alone is answered (on an engine of its
	// own: "cols" would refuse d-1's receive, staged there already).
	quiet, err := c.Step(ctx, &pb.StepRequest{EngineId: "quiet", ErrorsOnly: true, Columns: cols})
	if err != nil || len(quiet.Results) != 1 || quiet.Results[0].Index != 3 {
		t.Errorf("Step(errors_only) = %v, %v; want only op 3's error", quiet.GetResults(), err)
	}
	for _, tc := range []struct {
		name string
		cols *pb.StepColumns
		want string
	}{
		{"short column", &pb.StepColumns{AfterAlloc: &pb.RequestColumns{RequestId: []string{"a", "b"}, PromptTokens: []int64{4}}},
			"columns.after_alloc.prompt_tokens has 1 entries, want 2 (one per request_id) or none"},
		{"short generations", &pb.StepColumns{AfterAlloc: &pb.RequestColumns{RequestId: []string{"a", "b"}, RemoteGeneration: []uint64{4}}},
			"columns.after_alloc.remote_generation has 1 entries, want 2 (one per request_id) or none"},
		{"no status", &pb.StepColumns{RequestFinished: &pb.RequestColumns{RequestId: []string{"a"}}},
			"columns.request_finished.status has 0 entries, want 1"},
		// Columns a client sent that no row reads were dropped unseen.
		{"no rows", &pb.StepColumns{RequestFinished: &pb.RequestColumns{Status: []pb.FinishStatus{1}, BlockLens: []int32{1}, BlockIds: []int32{5}}},
			"columns.request_finished.status has 1 entries, but request_id none (no rows)"},
		{"no rows, ids only", &pb.StepColumns{Prefill: &pb.RequestColumns{BlockIds: []int32{5}}},
			"columns.prefill.block_ids has 1 entries, but request_id none (no rows)"},
		{"status of after_alloc", &pb.StepColumns{AfterAlloc: &pb.RequestColumns{RequestId: []string{"a"}, Status: []pb.FinishStatus{1}}},
			"columns.after_alloc.status has 1 entries, want none (only request_finished rows have a status)"},
		{"unknown flag", &pb.StepColumns{AfterAlloc: &pb.RequestColumns{RequestId: []string{"a", "b"}, Flags: []uint32{1, 9}}},
			"columns.after_alloc.flags[1] = 9, want a sum of 1"},
		{"ids left over", func() *pb.StepColumns {
			x := proto.Clone(cols).(*pb.StepColumns)
			x.AfterAlloc.BlockIds = append(x.AfterAlloc.BlockIds, 99)
			return x
		}(), "left over"},
		{"list too long", func() *pb.StepColumns {
			x := proto.Clone(cols).(*pb.StepColumns)
			x.AfterAlloc.BlockLens[0] = 100
			return x
		}(), "a list of 100 ids"},
	} {
		before := d.srv.Refusals()["bad_request"]
		_, err := c.Step(ctx, &pb.StepRequest{EngineId: "cols", Columns: tc.cols})
		if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error = %v, want InvalidArgument with %q", tc.name, err, tc.want)
		}
		if got := d.srv.Refusals()["bad_request"] - before; got != 1 {
			t.Errorf("%s: bad_request refusals counted %d, want 1", tc.name, got)
		}
	}
}
