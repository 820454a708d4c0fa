package server

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// maxPublished and maxPublishedBytes bound the published steps kept per
// engine, in count and in bytes (as held in memory, about: publishedSize),
// the oldest going first (the newest is always kept): a rank that falls
// further behind its scheduler than this gets its step_ref dropped.
// Without the bytes' bound an engine publishing large steps held 1,024
// times the largest (gigabytes) on the daemon.
const maxPublished = 1024

var maxPublishedBytes = 64 << 20 // a variable for tests

// defaultPublishWait is Config.PublishWait's default.
const defaultPublishWait = 10 * time.Second

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
	ls, err := ss.get(ctx, req.GetEngineId())
	if err != nil {
		return nil, ss.status(err)
	}
	ls.step.Lock()
	defer ls.step.Unlock()
	if n := len(req.GetOps()) + len(req.GetColumns().GetRequestFinished().GetRequestId()) +
		len(req.GetColumns().GetAfterAlloc().GetRequestId()) + len(req.GetColumns().GetPrefill().GetRequestId()); n > maxStepOps {
		return nil, ss.status(stream.Invalid("ops has %d entries, want at most %d", n, maxStepOps))
	}
	if req.PublishStep > 0 {
		// Refused before any op applies: ops staged for a step that is
		// never published would reach the ranks with the next one, after
		// the engine was told they failed.
		if err := ls.publishable(req.PublishStep); err != nil {
			return nil, ss.status(err)
		}
	}
	colOps, err := columnOps(req.GetColumns())
	if err != nil {
		return nil, ss.status(err)
	}
	ops := req.GetOps()
	if len(colOps) > 0 {
		ops = append(ops[:len(ops):len(ops)], colOps...)
	}
	out := &pb.StepResponse{}
	fail := func(i int, err error) {
		st, _ := status.FromError(err)
		out.Results = append(out.Results, &pb.OpResult{Index: int32(i), Code: int32(st.Code()), Error: st.Message()})
	}
	for i, op := range ops {
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
			if r, err = ss.RequestFinished(ctx, x.RequestFinished); err == nil && !req.ErrorsOnly {
				out.Results = append(out.Results, &pb.OpResult{Index: int32(i), Delay: r.Delay, Params: r.Params})
			}
		case *pb.SchedulerOp_Update:
			x.Update.EngineId = req.EngineId
			_, err = ss.Update(ctx, x.Update)
		case *pb.SchedulerOp_Prefill:
			x.Prefill.EngineId = req.EngineId
			_, err = ss.Prefill(ctx, x.Prefill)
		case *pb.SchedulerOp_NewRequest:
			err = ss.newRequest(ctx, req.EngineId, x.NewRequest)
		default:
			err = ss.status(stream.Invalid("ops[%d] is empty", i))
		}
		if err != nil {
			fail(i, err)
		}
	}
	ls.mu.Lock()
	defer ls.mu.Unlock()
	switch {
	case req.PublishStep > 0:
		if err := ls.publish(req.PublishStep); err != nil {
			return nil, ss.status(err)
		}
		out.PublishStep = req.PublishStep
	case req.BuildMeta:
		out.Meta = stream.StepToProto(ls.s.BuildMeta())
	}
	out.Pending = ls.s.HasPendingWork()
	if ls.gen != nil {
		out.Generation = ls.gen()
	}
	c := ls.s.Counters()
	out.Counters = &pb.SchedulerCounters{BadParams: c.BadParams, UnknownUpdates: c.UnknownUpdates,
		WatchdogExpired: c.WatchdogExpired, Recomputed: c.Recomputed}
	return out, nil
}

// publish builds the step's metadata, numbers it step and keeps it for the
// engine's ranks. ls.mu is held.
func (ls *lockedScheduler) publish(step uint64) error {
	if err := ls.publishable(step); err != nil {
		return err
	}
	ls.pub.Lock()
	defer ls.pub.Unlock()
	m := stream.StepToProto(ls.s.BuildMeta())
	m.Step = step
	ls.pub.metas[step] = m
	size := publishedSize(m)
	ls.pub.order = append(ls.pub.order, publishedStep{step, size})
	ls.pub.bytes += size
	for len(ls.pub.order) > 1 {
		o := ls.pub.order[0]
		if o.step+maxPublished > step && ls.pub.bytes <= maxPublishedBytes {
			break
		}
		delete(ls.pub.metas, o.step)
		ls.pub.bytes -= o.size
		ls.pub.order = ls.pub.order[1:]
	}
	ls.pub.last = step
	close(ls.pub.changed)
	ls.pub.changed = make(chan struct{})
	if p := ls.prev.Load(); p != nil {
		p.pub.Lock()
		prevLast := p.pub.last
		p.pub.Unlock()
		if step <= prevLast {
			// Numbered again from below the one before's last: a step_ref
			// would be ambiguous. Only this one's steps are read from now.
			ls.prev.Store(nil)
		}
	}
	ls.trimPrevLocked()
	return nil
}

// trimPrev keeps the published steps of the schedulers ls replaced (prev)
// for as long as one scheduler would have kept them: ls's and theirs
// together, newest first, within maxPublished steps and maxPublishedBytes;
// the oldest go first, and a predecessor left with none is let go with
// those before it.
func (ls *lockedScheduler) trimPrev() {
	ls.pub.Lock()
	defer ls.pub.Unlock()
	ls.trimPrevLocked()
}

// trimPrevLocked is trimPrev with ls.pub held (a predecessor's lock is
// taken under it: a predecessor never takes its successor's).
func (ls *lockedScheduler) trimPrevLocked() {
	n, b := len(ls.pub.order), ls.pub.bytes
	link := &ls.prev
	for p := link.Load(); p != nil; p = link.Load() {
		p.pub.Lock()
		for len(p.pub.order) > 0 && (n+len(p.pub.order) > maxPublished || b+p.pub.bytes > maxPublishedBytes) {
			o := p.pub.order[0]
			delete(p.pub.metas, o.step)
			p.pub.bytes -= o.size
			p.pub.order = p.pub.order[1:]
		}
		n, b = n+len(p.pub.order), b+p.pub.bytes
		empty := len(p.pub.order) == 0
		p.pub.Unlock()
		if empty {
			link.Store(nil) // and those before it: older still
			return
		}
		link = &p.prev
	}
}

// fromPrev returns step as a scheduler ls replaced published it (nil:
// none kept).
func (ls *lockedScheduler) fromPrev(step uint64) *pb.StepMeta {
	for p := ls.prev.Load(); p != nil; p = p.prev.Load() {
		p.pub.Lock()
		m := p.pub.metas[step]
		p.pub.Unlock()
		if m != nil {
			return m
		}
	}
	return nil
}

// replacedWhy adds to a dropped step_ref's error that ls replaced another
// process's scheduler, whose steps are not kept for its ranks.
func replacedWhy(ls *lockedScheduler) string {
	if !ls.replacedOther {
		return ""
	}
	return "; the engine's scheduler was opened again by another process (or one whose pid kvxferd cannot see), and the steps " +
		"the one before published are not kept for it (a restarted engine numbers its steps anew)"
}

// publishedStep is a step kept published and its size (publishedSize).
type publishedStep struct {
	step uint64
	size int
}

// publishedSize is about the bytes m holds in memory: its strings, 4 per
// block id, and some for each message.
func publishedSize(m *pb.StepMeta) int {
	spans := func(ss []*pb.Span) int {
		n := 0
		for _, s := range ss {
			n += 64 + 4*len(s.GetBlockIds())
		}
		return n
	}
	n := 256
	for _, r := range m.GetRecv() {
		n += 128 + len(r.GetRequestId()) + len(r.GetTransferId()) + spans(r.GetLocal())
		if rm := r.GetRemote(); rm != nil {
			n += 128 + len(rm.GetEngineId()) + len(rm.GetAddr()) + len(rm.GetRequestId()) + spans(rm.GetBlocks())
		}
	}
	for _, ss := range [2][]*pb.SendRequest{m.GetSend(), m.GetPrefill()} {
		for _, s := range ss {
			n += 128 + len(s.GetRequestId()) + len(s.GetTransferId()) + spans(s.GetBlocks())
		}
	}
	for _, id := range m.GetNotProcessed() {
		n += 16 + len(id)
	}
	for _, id := range m.GetPreempted() {
		n += 16 + len(id)
	}
	for _, r := range m.GetAwait() {
		n += 256 + len(r.GetRequestId()) + len(r.GetTransferId()) + len(r.GetRemote().GetEngineId()) + len(r.GetRemote().GetAddr()) +
			len(r.GetRemote().GetRequestId())
	}
	for _, id := range m.GetAwaitEnd() {
		n += 16 + len(id)
	}
	for k, v := range m.GetNotProcessedTransferIds() {
		n += 64 + len(k) + len(v)
	}
	return n
}

// publishable checks that step comes after the last published one.
func (ls *lockedScheduler) publishable(step uint64) error {
	ls.pub.Lock()
	defer ls.pub.Unlock()
	if step <= ls.pub.last {
		return stream.Invalid("publish_step = %d, want > %d (the last published)", step, ls.pub.last)
	}
	return nil
}

// published returns the metadata engine's scheduler published for step
// to a rank of uid, waiting up to Config.PublishWait for it: a rank's
// step_ref may arrive before its scheduler's Step (they travel on
// different streams). When the engine opens its scheduler again meanwhile
// (its connector lost its Steps stream), the wait goes on with the new
// one, whose steps the engine numbers after those it sent before: a step
// the old one published is still read from it (prev, as long as one
// scheduler would have kept it), and a step it never published is dropped
// as soon as the new one publishes a later one. Steps of a scheduler that
// another process opened (a restarted engine, numbering anew) are not
// read: the error says so. The wait ends, too, once stop is closed (the
// rank's worker stopped: the step could not be taken in anyway), with an
// error that wraps kvxfer.ErrClosed. The metadata is the scheduler's:
// read only.
func (ss *schedulers) published(ctx context.Context, stop <-chan struct{}, engine string, uid uint32, step uint64) (*pb.StepMeta, error) {
	ls, err := ss.getAs(engine, uid)
	if err != nil {
		return nil, fmt.Errorf("step_ref.step = %d: %w (a scheduler publishes steps only to ranks attached to its own daemon)", step, err)
	}
	timer := time.NewTimer(ss.publishWait)
	defer timer.Stop()
	for {
		ls.pub.Lock()
		m, ok := ls.pub.metas[step]
		last, changed, retired := ls.pub.last, ls.pub.changed, ls.pub.retired
		ls.pub.Unlock()
		if ok {
			return m, nil
		}
		if m := ls.fromPrev(step); m != nil {
			return m, nil
		}
		if retired {
			if ls, err = ss.getAs(engine, uid); err != nil {
				return nil, fmt.Errorf("step_ref.step = %d: not published, and then %w", step, err)
			}
			continue
		}
		if step <= last {
			return nil, stream.Invalid("step_ref.step = %d: not published, or no longer kept (the last %d steps and %d MiB at most; last %d)%s",
				step, maxPublished, maxPublishedBytes>>20, last, replacedWhy(ls))
		}
		select {
		case <-changed:
		case <-timer.C:
			return nil, fmt.Errorf("step_ref.step = %d: not published within %v (last %d)%s: %w", step, ss.publishWait, last, replacedWhy(ls),
				context.DeadlineExceeded)
		case <-ctx.Done():
			return nil, ctx.Err()
		case <-stop:
			return nil, fmt.Errorf("step_ref.step = %d: not published (last %d) when this rank's worker stopped: %w", step, last, kvxfer.ErrClosed)
		}
	}
}

// Steps is Step over a stream: requests apply in order and are answered
// in order. An error that would end a Step call for the whole engine
// (unknown engine, bad publish_step) ends the stream.
func (ss *schedulers) Steps(st grpc.BidiStreamingServer[pb.StepsRequest, pb.StepsResponse]) error {
	ctx := st.Context()
	uid, err := callerUID(ctx)
	if err != nil {
		ss.limits.refuse("permission")
		return ss.status(err)
	}
	done, err := ss.limits.admit(uid)
	if err != nil {
		return ss.status(err)
	}
	defer done()
	type recvd struct {
		m   *pb.StepsRequest
		err error
	}
	in := make(chan recvd)
	go func() { // ends with the call: its context ends Recv
		for {
			m, err := st.Recv()
			select {
			case in <- recvd{m, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	for {
		var m *pb.StepsRequest
		select {
		case r := <-in:
			if r.err != nil {
				return nil // the engine closed its side, or the stream broke
			}
			m = r.m
		case <-ss.drained:
			// The ranks drained: no step is for anything any more, and
			// the daemon stops without waiting for the engine to hang up.
			return status.Error(codes.Unavailable, "kvxferd is shutting down")
		}
		if m.GetStep() == nil {
			return ss.status(stream.Invalid("step is missing"))
		}
		resp, err := ss.Step(ctx, m.Step)
		if err != nil {
			return err
		}
		if err := st.Send(&pb.StepsResponse{Step: resp}); err != nil {
			return err
		}
	}
}
