package server_test

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A consumer request whose params name the producer at an address the
// peer resolver would never dial (no port, a port out of range, a gRPC
// scheme, a host with spaces) is bad input at the scheduler: refused
// there, naming RemoteAddr and the value, counted in bad_params, before
// any block is promised to it (MatchedTokens gives 0: computed locally).
// Before, the scheduler staged it, and the request failed later at its
// ranks' handshake. Well-formed addresses beside them still stage.
func TestSchedulerRefusesMalformedRemoteAddr(t *testing.T) {
	d, c, ctx := schedulerClient(t)
	openPushD(t, c, ctx)
	dreq := func(id, addr string) *pb.EngineRequest {
		return &pb.EngineRequest{RequestId: id, PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t-" + id, DoRemotePrefill: true,
			RemoteEngineId: "P", RemoteAddr: addr, RemoteTpSize: 1}}
	}
	blocks := func(first int) []int32 { return []int32{int32(first), int32(first + 1), int32(first + 2)} }
	bad := []string{"127.0.0.1", "127.0.0.1:0", "127.0.0.1:70000", "unix:///tmp/x.sock", "dns:///h:1", "a host:7600", "h:76x0", ":7600"}
	var counted uint64
	for i, addr := range bad {
		r, ok := dreq("d-bad", addr), fmt.Sprintf("d-ok-%d", i)
		m, err := c.MatchedTokens(ctx, &pb.MatchedTokensRequest{EngineId: "D", Request: r})
		if err != nil {
			t.Fatal(err)
		}
		if m.Tokens != 0 || m.Async {
			t.Errorf("MatchedTokens(RemoteAddr %q) = %v, want 0 tokens, not async (computed locally)", addr, m)
		}
		resp, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", BuildMeta: true, Ops: []*pb.SchedulerOp{
			{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: dreq(ok, d.peerAddr), Blocks: []*pb.BlockList{{BlockIds: blocks(6 * i)}}, External: 40}}},
			{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{Request: r, Blocks: []*pb.BlockList{{BlockIds: blocks(6*i + 3)}}, External: 40}}},
		}})
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Results) != 1 || resp.Results[0].Index != 1 || resp.Results[0].Code != int32(codes.InvalidArgument) ||
			!strings.Contains(resp.Results[0].Error, "RemoteAddr") || !strings.Contains(resp.Results[0].Error, addr) {
			t.Errorf("RemoteAddr %q: Step results = %v, want op 1 refused naming RemoteAddr and the value", addr, resp.Results)
		}
		if got := resp.GetMeta().GetRecv(); len(got) != 1 || got[0].RequestId != ok {
			t.Errorf("RemoteAddr %q: Step meta recv = %v, want %s alone", addr, got, ok)
		}
		// MatchedTokens and AfterAlloc each count it once.
		if got := resp.Counters.GetBadParams(); got != counted+2 {
			t.Errorf("RemoteAddr %q: counters = %v, want bad_params %d", addr, resp.Counters, counted+2)
		}
		counted = resp.Counters.GetBadParams()
	}
}

// A rank's step receive naming its producer at an address the peer
// resolver would never dial is refused at once, as the scheduler refuses
// it: the request fails (setup) naming Remote.Addr and the value, counted
// as recv_req.remote.addr, and the good receive beside it is taken in.
// Before, it was held and failed later on its handshake.
func TestStepRefusesMalformedRemoteAddr(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	ds := d.srv.OpenDirect()
	defer ds.Cancel()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: directHello(t)}})); err != nil {
		t.Fatal(err)
	}
	if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil {
		t.Fatalf("after hello: %v (ended %v: %v %s), want Ready", m, ended, code, msg)
	}
	deadline := time.Now().Add(time.Hour).UnixNano()
	recv := func(id, addr string, block int32) *pb.RecvRequest {
		return &pb.RecvRequest{RequestId: id, Local: []*pb.Span{{BlockIds: []int32{block}}}, DeadlineUnixNanos: deadline,
			Remote: &pb.RemoteRef{EngineId: "P", Addr: addr, RequestId: "p-" + id}}
	}
	bad := map[string]string{"d-noport": "127.0.0.1", "d-scheme": "unix:///tmp/x.sock", "d-space": "a host:7600", "d-port": "h:70000"}
	step := &pb.StepMeta{Step: 1, Recv: []*pb.RecvRequest{recv("d-good", "127.0.0.1:1", 1)}}
	block := int32(2)
	for _, id := range []string{"d-noport", "d-scheme", "d-space", "d-port"} {
		step.Recv = append(step.Recv, recv(id, bad[id], block))
		block++
	}
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: step}})); err != nil {
		t.Fatal(err)
	}
	outcomes := map[string]*pb.Outcome{}
	for len(outcomes) < len(bad)+1 {
		m, ended, code, msg := take(t, ds)
		if ended {
			t.Fatalf("stream ended: %v %s", code, msg)
		}
		if e := m.GetStepError(); e != nil && e.Dropped {
			t.Fatalf("StepError = %v: the whole step was dropped", e)
		}
		for _, o := range m.GetFinished().GetRecving() {
			if outcomes[o.RequestId] != nil {
				t.Errorf("two outcomes for %s", o.RequestId)
			}
			outcomes[o.RequestId] = o
		}
	}
	for id, addr := range bad {
		o := outcomes[id]
		if o.GetResult() != pb.Outcome_RESULT_FAILED || o.GetFailureKind() != pb.FailureKind_FAILURE_KIND_SETUP ||
			!strings.Contains(o.GetReason(), "Remote.Addr") || !strings.Contains(o.GetReason(), addr) {
			t.Errorf("outcome of %s (Remote.Addr %q) = %v, want failed (setup) naming Remote.Addr and the value", id, addr, o)
		}
	}
	if o := outcomes["d-good"]; o.GetFailureKind() != pb.FailureKind_FAILURE_KIND_HANDSHAKE {
		t.Errorf("d-good's outcome = %v, want its own (a failed handshake)", o)
	}
	ws := d.srv.Workers()["direct"]
	if len(ws) != 1 {
		t.Fatalf("workers of engine direct: %d", len(ws))
	}
	if got := ws[0].Metrics().Snapshot().BadInput["recv_req.remote.addr"]; got != uint64(len(bad)) {
		t.Errorf("BadInput = %v, want recv_req.remote.addr counted %d times", ws[0].Metrics().Snapshot().BadInput, len(bad))
	}
}

// A step's waiting request (StepMeta.await) naming its producer at an
// address the resolver would never dial is dropped and counted
// (await_req): taken, it would move a known producer engine there, away
// from the requests it serves. One at a good address beside it is kept.
func TestStepAwaitMalformedRemoteAddrDropped(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	ds := d.srv.OpenDirect()
	defer ds.Cancel()
	hello := directHello(t)
	hello.Mode = pb.Mode_MODE_PULL
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}})); err != nil {
		t.Fatal(err)
	}
	if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil {
		t.Fatalf("after hello: %v (ended %v: %v %s), want Ready", m, ended, code, msg)
	}
	await := func(id, addr string) *pb.RecvRequest {
		return &pb.RecvRequest{RequestId: id, TransferId: "t-" + id, Remote: &pb.RemoteRef{EngineId: "P", Addr: addr, RequestId: "p-" + id}}
	}
	step := &pb.StepMeta{Step: 1, Await: []*pb.RecvRequest{await("d-good", "127.0.0.1:1"), await("d-bad", "unix:///tmp/x.sock")}}
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: step}})); err != nil {
		t.Fatal(err)
	}
	ws := d.srv.Workers()["direct"]
	if len(ws) != 1 {
		t.Fatalf("workers of engine direct: %d", len(ws))
	}
	for deadline := time.Now().Add(10 * time.Second); ws[0].Metrics().Snapshot().BadInput["await_req"] != 1; time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("BadInput = %v, want await_req counted once", ws[0].Metrics().Snapshot().BadInput)
		}
	}
}
