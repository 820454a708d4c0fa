package stream

import (
	"context"

	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// maxStepOps bounds the ops of one StepRequest: an engine step staging more
// than this is a bug or an attack, and is refused whole.
const maxStepOps = 1 << 20

// Step applies one engine step's scheduler calls in order, each exactly
// as its own call would (same validation, same errors), then builds the
// step's metadata: an engine makes one round trip per step. An op that
// fails is reported in the response with the code and message its own
// call would have returned; the ops after it still apply, so one bad
// request loses nothing else. A request_finished op's answer (delay and
// params) is returned too, so an engine that computed it locally can
// check it.
func (ss *schedulers) Step(ctx context.Context, req *pb.StepRequest) (*pb.StepResponse, error) {
	ls, err := ss.get(req.GetEngineId())
	if err != nil {
		return nil, Status(err)
	}
	if n := len(req.GetOps()); n > maxStepOps {
		return nil, Status(invalid("ops has %d entries, want at most %d", n, maxStepOps))
	}
	out := &pb.StepResponse{}
	fail := func(i int, err error) {
		st, _ := status.FromError(err)
		out.Results = append(out.Results, &pb.OpResult{Index: int32(i), Code: int32(st.Code()), Error: st.Message()})
	}
	for i, op := range req.GetOps() {
		var err error
		switch x := op.GetOp().(type) {
		case *pb.SchedulerOp_AfterAlloc:
			x.AfterAlloc.EngineId = req.EngineId
			_, err = ss.AfterAlloc(ctx, x.AfterAlloc)
		case *pb.SchedulerOp_Scheduled:
			x.Scheduled.EngineId = req.EngineId
			_, err = ss.Scheduled(ctx, x.Scheduled)
		case *pb.SchedulerOp_RequestFinished:
			x.RequestFinished.EngineId = req.EngineId
			var r *pb.RequestFinishedResponse
			if r, err = ss.RequestFinished(ctx, x.RequestFinished); err == nil {
				out.Results = append(out.Results, &pb.OpResult{Index: int32(i), Delay: r.Delay, Params: r.Params})
			}
		case *pb.SchedulerOp_Update:
			x.Update.EngineId = req.EngineId
			_, err = ss.Update(ctx, x.Update)
		case *pb.SchedulerOp_Prefill:
			x.Prefill.EngineId = req.EngineId
			_, err = ss.Prefill(ctx, x.Prefill)
		default:
			err = status.Errorf(codes.InvalidArgument, "ops[%d] is empty", i)
		}
		if err != nil {
			fail(i, err)
		}
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	if req.BuildMeta {
		out.Meta = StepToProto(ls.s.BuildMeta())
	}
	out.Pending = ls.s.HasPendingWork()
	c := ls.s.Counters()
	out.Counters = &pb.SchedulerCounters{BadParams: c.BadParams, UnknownUpdates: c.UnknownUpdates,
		WatchdogExpired: c.WatchdogExpired, Recomputed: c.Recomputed}
	return out, nil
}
