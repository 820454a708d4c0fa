package server_test

import (
	"strings"
	"testing"
	"time"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A step whose metadata has one entry kvxferd cannot read (a receive
// without its remote, a send whose token count is out of range) refuses
// that entry alone, as the worker refuses one it validates: the step is
// not dropped, the entry's request fails naming the field, the refusal is
// counted, and the step's other entries are taken in (a good receive is
// held, an abort of the step applies). Before, one such entry dropped the
// whole step: every other request of it failed, and its aborts were lost.
func TestStepUnreadableEntryRefusedAlone(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	hello := directHello(t)
	ds := d.srv.OpenDirect()
	defer ds.Cancel()
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}})); err != nil {
		t.Fatal(err)
	}
	if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil {
		t.Fatalf("after hello: %v (ended %v: %v %s), want Ready", m, ended, code, msg)
	}
	span := func(ids ...int32) []*pb.Span { return []*pb.Span{{BlockIds: ids}} }
	// A producer engine nobody answers: the good receive, taken in, fails
	// on its handshake (its own outcome, from the worker).
	remote := &pb.RemoteRef{EngineId: "P", Addr: "127.0.0.1:1", RequestId: "p-1"}
	step := &pb.StepMeta{Step: 1,
		Recv: []*pb.RecvRequest{
			{RequestId: "d-good", Local: span(1, 2), Remote: remote, DeadlineUnixNanos: time.Now().Add(time.Hour).UnixNano()},
			{RequestId: "d-bad", Local: span(3)},
		},
		Send: []*pb.SendRequest{{RequestId: "p-bad", Blocks: span(4), Tokens: 1 << 40}},
	}
	if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: step}})); err != nil {
		t.Fatal(err)
	}
	var se *pb.StepError
	outcomes := map[string]*pb.Outcome{}
	for se == nil || len(outcomes) < 3 {
		m, ended, code, msg := take(t, ds)
		if ended {
			t.Fatalf("stream ended: %v %s", code, msg)
		}
		if e := m.GetStepError(); e != nil {
			se = e
		}
		for _, o := range append(m.GetFinished().GetRecving(), m.GetFinished().GetSending()...) {
			if outcomes[o.RequestId] != nil {
				t.Errorf("two outcomes for %s", o.RequestId)
			}
			outcomes[o.RequestId] = o
		}
		if se != nil && se.Dropped {
			t.Fatalf("StepError = %v: the whole step was dropped for one entry it could not read", se)
		}
	}
	for _, w := range []string{"step.recv[1].remote is missing", "step.send[0].tokens"} {
		if !strings.Contains(se.Message, w) {
			t.Errorf("StepError message %q, want it naming %q", se.Message, w)
		}
	}
	for id, w := range map[string]string{"d-bad": "remote is missing", "p-bad": "tokens"} {
		o := outcomes[id]
		if o == nil || o.Result != pb.Outcome_RESULT_FAILED || o.FailureKind != pb.FailureKind_FAILURE_KIND_SETUP || !strings.Contains(o.Reason, w) {
			t.Errorf("outcome of %s = %v, want failed (setup) naming %q", id, o, w)
		}
	}
	if o := outcomes["d-good"]; o.GetFailureKind() != pb.FailureKind_FAILURE_KIND_HANDSHAKE {
		t.Errorf("d-good's outcome = %v, want its own (a failed handshake): the good entry beside the bad ones is taken in", o)
	}
	ws := d.srv.Workers()["direct"]
	if len(ws) != 1 {
		t.Fatalf("workers of engine direct: %d", len(ws))
	}
	bad := ws[0].Metrics().Snapshot().BadInput
	if bad["recv_req.remote"] != 1 || bad["send_req.tokens"] != 1 {
		t.Errorf("BadInput = %v, want recv_req.remote and send_req.tokens counted once", bad)
	}
}
