package server_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A step the daemon received from an engine that died right after
// sending it (its stream's context ended before the receiver handed the
// step on) is taken in: its requests reach the worker, whose close ends
// them (a pull consumer's end tells its producer). Before, the receiver's
// select between a free token and the ended context dropped the step
// about half the time (twice: three times in four): the producer of its
// consumer requests, told nothing, held their blocks for their lease
// (the daemon soak's crashed NIXL pull P waited 10 s for them).
func TestStepReceivedAsTheEngineDiesIsTakenIn(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	span := func(ids ...int32) []*pb.Span { return []*pb.Span{{BlockIds: ids}} }
	const tries = 20
	for i := range tries {
		hello := directHello(t)
		hello.EngineId = fmt.Sprintf("crashed-%d", i)
		step := &pb.StepMeta{Step: 1, Send: []*pb.SendRequest{{RequestId: "p-1", Blocks: span(1), Tokens: 16,
			DeadlineUnixNanos: time.Now().Add(time.Hour).UnixNano()}}}
		_ = d.srv.ServeCrashedForTest([]*pb.ConnectRequest{{Msg: &pb.ConnectRequest_Hello{Hello: hello}}, {Msg: &pb.ConnectRequest_Step{Step: step}}})
		if failed := failedOnceLetGo(d, hello.EngineId); failed != 1 {
			t.Fatalf("try %d of %d: the engine's p-1 has %d failed outcomes once its rank was let go, want 1 (worker closed): its step, received, was not taken in", i+1, tries, failed)
		}
	}
}

// The same in process: a step an engine put on its direct stream just
// before it hung up (Cancel) is taken in. Before, the direct stream's
// Recv chose at random between the step and the stream's end.
func TestDirectStepPutAsTheEngineHangsUpIsTakenIn(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	span := func(ids ...int32) []*pb.Span { return []*pb.Span{{BlockIds: ids}} }
	const tries = 20
	for i := range tries {
		hello := directHello(t)
		hello.EngineId = fmt.Sprintf("hung-up-%d", i)
		ds := d.srv.OpenDirect()
		if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: hello}})); err != nil {
			t.Fatal(err)
		}
		if m, ended, code, msg := take(t, ds); ended || m.GetReady() == nil {
			t.Fatalf("try %d: not ready (%v, ended %v %v %s)", i+1, m, ended, code, msg)
		}
		step := &pb.StepMeta{Step: 1, Send: []*pb.SendRequest{{RequestId: "p-1", Blocks: span(1), Tokens: 16,
			DeadlineUnixNanos: time.Now().Add(time.Hour).UnixNano()}}}
		if err := ds.Put(marshal(t, &pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: step}})); err != nil {
			t.Fatal(err)
		}
		ds.Cancel()
		if failed := failedOnceLetGo(d, hello.EngineId); failed != 1 {
			t.Fatalf("try %d of %d: the engine's p-1 has %d failed outcomes once its rank was let go, want 1 (worker closed): its step, put, was not taken in", i+1, tries, failed)
		}
	}
}

// failedOnceLetGo waits up to 5 s for engine's rank to be let go with a
// failed producer outcome, and returns how many it has.
func failedOnceLetGo(d *daemon, engine string) uint64 {
	failed := uint64(0)
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		for _, rs := range d.srv.RankStats() {
			if rs.Engine == engine && !rs.Attached {
				failed = rs.Stats.Outcomes[kvxfer.RoleProducer][kvxfer.ResultFailed]
			}
		}
		if failed > 0 {
			break
		}
	}
	return failed
}
