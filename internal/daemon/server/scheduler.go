package server

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"math"
	"sync"
	"sync/atomic"
	"time"

	"github.com/puzpuzpuz/xsync/v4"
	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// schedulers are the engines' kvxfer.Schedulers, each used by one call at
// a time. The table is read without a lock by every scheduler call and by
// every rank's step (StepRequest by reference); opening and closing, the
// only writers, take turns under mu.
type schedulers struct {
	pb.UnimplementedSchedulerServiceServer
	addr   string
	owners *owners
	limits *limits
	// publishWait bounds a rank's wait for a step_ref's metadata
	// (Config.PublishWait).
	publishWait time.Duration
	// resolveByID: engines may be named without an address (a registry
	// finds them: Config.PeerLookup).
	resolveByID bool
	// checkAddr checks a remote engine's address as the server's
	// resolver dials it (nil: a resolver of its own kind, unchecked).
	checkAddr func(string) error
	// maxRequests bounds each scheduler's requests (Config.MaxRequests).
	maxRequests int
	// generation returns the source of an engine's generation as a
	// handshake with this server reports it (0: unknown), stamped on a
	// pull producer's params (kvxfer.SchedulerConfig.Generation) and
	// told in each step's answer (StepResponse.generation); nil: none.
	generation func(engine string) *genSource
	mu         sync.Mutex
	m          *xsync.Map[string, *lockedScheduler]
	// byUID counts the open schedulers of each uid (under mu): at most
	// limits.streams.perUID each, limits.streams.max in all, as streams are (a scheduler
	// outlives the call that opened it).
	byUID map[uint32]int
	total int
	// drained is closed once the server's ranks drained (Server.Drain):
	// Steps streams end then.
	drained <-chan struct{}
	log     *slog.Logger
}

type lockedScheduler struct {
	// step is held across a whole Step call (its ops, then its metadata
	// built or published), so that one Step's publish_step, checked
	// before its ops apply, still holds when it publishes: another Step
	// publishing meanwhile (two Steps streams at once) refused this one
	// after its ops applied, and they went out with a step the engine
	// was not told of.
	step sync.Mutex
	mu   sync.Mutex
	s    *kvxfer.Scheduler
	// gen is the engine's generation's source (schedulers.generation;
	// nil: none, or a push scheduler), told in each step's answer.
	gen func() uint64
	uid uint32 // of the engine process that opened it
	// pid is the engine process that opened it, as this process sees it
	// (0: unknown, another pid namespace's): once it is gone the
	// scheduler is reclaimed when it would keep another from opening.
	pid int32
	// pub holds the step metadata published for the engine's ranks
	// (StepRequest.publish_step), the last maxPublished steps within
	// maxPublishedBytes: order lists them oldest first, bytes is their
	// sizes' sum.
	// prev is the scheduler this one replaced, opened by the same engine
	// process (its connector lost its Steps stream and opened again: its
	// step numbers go on from the last one sent), whose published steps
	// stay readable by the engine's ranks, by their numbers, for as long
	// as they would have been kept had the engine kept one scheduler
	// (trimPrev): a rank's step_ref for a step the old one published may
	// arrive after the new one opened. Before, a rank looked the step up
	// in the new one only, and dropped it: each of its requests failed
	// (once), the step's work lost. nil: none (the first, one that
	// replaced another process's, or whose predecessor's steps are gone).
	prev atomic.Pointer[lockedScheduler]
	// replacedOther: this scheduler replaced one that another engine
	// process (or one this process cannot see) opened: that one's steps
	// are not kept for the ranks (a restarted engine numbers its steps
	// from 1 again: a new rank must never read an old step under its
	// number), and a step_ref for one is dropped saying so.
	replacedOther bool
	pub           struct {
		sync.Mutex
		last    uint64
		metas   map[uint64]*pb.StepMeta
		order   []publishedStep
		bytes   int
		changed chan struct{} // closed and replaced at each publish, and when retired
		// retired: the engine opened a new scheduler or closed this one;
		// ranks waiting here look the engine's scheduler up again.
		retired bool
	}
}

// retire marks ls replaced or closed and wakes the ranks waiting for its
// steps (published).
func (ls *lockedScheduler) retire() {
	ls.pub.Lock()
	defer ls.pub.Unlock()
	if !ls.pub.retired {
		ls.pub.retired = true
		close(ls.pub.changed)
		// A Step of the old scheduler still in flight may publish (and
		// close this) after.
		ls.pub.changed = make(chan struct{})
	}
}

// status is Status(err) for a SchedulerService answer, counting one that
// refuses the engine's bad input (InvalidArgument) as bad_request, as a
// bad hello is counted: every answer of the service goes through it. (An
// error that is a status already, a refused op's, was counted when it was
// made.)
func (ss *schedulers) status(err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err
	}
	if errors.Is(err, kvxfer.ErrRequestLimit) {
		ss.limits.refuse("scheduler_requests")
	}
	err = Status(err)
	if status.Code(err) == codes.InvalidArgument {
		ss.limits.refuse("bad_request")
	}
	return err
}

// get returns engine's scheduler for a call from ctx, which must come from
// the uid that opened it.
func (ss *schedulers) get(ctx context.Context, engine string) (*lockedScheduler, error) {
	uid, err := callerUID(ctx)
	if err != nil {
		ss.limits.refuse("permission")
		return nil, err
	}
	ls, err := ss.getAs(engine, uid)
	if errors.Is(err, ErrPermission) {
		ss.limits.refuse("permission")
	}
	return ls, err
}

func (ss *schedulers) getAs(engine string, uid uint32) (*lockedScheduler, error) {
	if engine == "" {
		return nil, stream.Invalid("engine_id is empty")
	}
	if len(engine) > MaxEngineID {
		// No scheduler has such an id (OpenScheduler refuses it); and
		// the error must not echo a megabyte back.
		return nil, stream.Invalid("engine_id = %.32q... has %d bytes, want at most %d", engine, len(engine), MaxEngineID)
	}
	s, _ := ss.m.Load(engine)
	if s == nil {
		return nil, fmt.Errorf("scheduler of engine %q: %w (call OpenScheduler first)", engine, kvxfer.ErrUnknownEngine)
	}
	if s.uid != uid {
		return nil, fmt.Errorf("%w: the scheduler of engine %q belongs to uid %d (uid %d may not use it)", ErrPermission, engine, s.uid, uid)
	}
	return s, nil
}

func (ss *schedulers) OpenScheduler(ctx context.Context, req *pb.OpenSchedulerRequest) (*pb.OpenSchedulerResponse, error) {
	ai, err := caller(ctx)
	if err != nil {
		ss.limits.refuse("permission")
		return nil, ss.status(err)
	}
	uid := ai.UID
	c := req.GetConfig()
	if c == nil {
		return nil, ss.status(stream.Invalid("config is missing"))
	}
	if len(c.EngineId) > MaxEngineID {
		return nil, ss.status(stream.Invalid("config.engine_id has %d bytes, want at most %d", len(c.EngineId), MaxEngineID))
	}
	if c.EngineId != "" { // (NewScheduler refuses an empty one: bad input)
		// An id reserved for another uid is refused before anything
		// else: its holder's scheduler is neither replaced nor reclaimed,
		// and nothing starts for it (a generation source).
		if err := ss.owners.check(c.EngineId, uid); err != nil {
			ss.limits.refuseReserved(err)
			return nil, ss.status(err)
		}
	}
	cfg := kvxfer.SchedulerConfig{EngineID: c.EngineId, Addr: ss.addr, Mode: kvxfer.Mode(c.Mode), TPSize: int(c.TpSize), PPSize: int(c.PpSize),
		LogicalBlockSize: int(c.LogicalBlockSize), SpecBlocks: int(c.SpecBlocks), PrefillBackoff: int(c.PrefillBackoff), Lease: time.Duration(c.LeaseMillis) * time.Millisecond,
		DecoderBlocksTTL: time.Duration(c.DecoderBlocksTtlMillis) * time.Millisecond, RegistrationTimeout: time.Duration(c.RegistrationTimeoutMillis) * time.Millisecond,
		RecomputeThreshold: int(c.RecomputeThreshold), Bidirectional: c.Bidirectional, HostBuffer: c.HostBuffer,
		Layerwise: c.Layerwise, ResolveByID: ss.resolveByID, CheckAddr: ss.checkAddr, MaxRequests: ss.maxRequests}
	for _, f := range []struct {
		name string
		v    int64
	}{{"config.lease_millis", c.LeaseMillis}, {"config.decoder_blocks_ttl_millis", c.DecoderBlocksTtlMillis},
		{"config.registration_timeout_millis", c.RegistrationTimeoutMillis}} {
		// As a time.Duration (nanoseconds) the value must not wrap.
		if f.v > math.MaxInt64/int64(time.Millisecond) {
			return nil, ss.status(stream.Invalid("%s = %d out of range (at most %d)", f.name, f.v, math.MaxInt64/int64(time.Millisecond)))
		}
	}
	for i, g := range c.Groups {
		w, err := stream.FitInt(fmt.Sprintf("config.groups[%d].window", i), g.Window)
		if err != nil {
			return nil, ss.status(err)
		}
		cfg.Groups = append(cfg.Groups, topology.Group{Kind: topology.Kind(g.Kind), Window: w})
	}
	var gen *genSource
	if ss.generation != nil {
		gen = ss.generation(c.EngineId)
		cfg.Generation = gen.get
	}
	s, err := kvxfer.NewScheduler(cfg)
	if err != nil {
		return nil, ss.status(fmt.Errorf("%w: %w", stream.ErrInvalid, err))
	}
	ls := &lockedScheduler{s: s, uid: uid, pid: ai.PID}
	if gen != nil && cfg.Mode == kvxfer.ModePull {
		ls.gen = gen.get
		gen.prime(ctx)
	}
	ls.pub.metas = map[uint64]*pb.StepMeta{}
	ls.pub.changed = make(chan struct{})
	ss.mu.Lock()
	defer ss.mu.Unlock()
	old, _ := ss.m.Load(c.EngineId)
	if old != nil && old.uid != uid && ss.goneLocked(c.EngineId, old) {
		old = nil // another uid's, left open by a process that is gone
	}
	if old == nil {
		// The engine's first scheduler: it claims the engine for uid,
		// within the bounds, which the schedulers of engines gone without
		// closing them (crashed) do not hold.
		if ss.byUID[uid] >= ss.limits.streams.perUID || ss.total >= ss.limits.streams.max {
			ss.reclaimLocked()
		}
		switch {
		case ss.byUID[uid] >= ss.limits.streams.perUID:
			ss.limits.refuse("schedulers_per_uid")
			return nil, ss.status(fmt.Errorf("%w: uid %d has %d schedulers open, the most one user may (kvxferd -max-streams-per-uid)", ErrLimit, uid, ss.byUID[uid]))
		case ss.total >= ss.limits.streams.max:
			ss.limits.refuse("schedulers")
			return nil, ss.status(fmt.Errorf("%w: %d schedulers open, the daemon's most (kvxferd -max-streams)", ErrLimit, ss.total))
		}
		if err := ss.owners.claim(c.EngineId, uid); err != nil {
			ss.limits.refuse("permission")
			return nil, ss.status(err)
		}
		if ss.byUID == nil {
			ss.byUID = map[uint32]int{}
		}
		ss.byUID[uid]++
		ss.total++
	} else if old.uid != uid {
		ss.limits.refuse("permission")
		return nil, ss.status(fmt.Errorf("%w: the scheduler of engine %q belongs to uid %d, whose engine process %d is running (uid %d may not replace it; engine ids are first come, first served: use another one)",
			ErrPermission, c.EngineId, old.uid, old.pid, uid))
	} else {
		defer old.retire() // once the new one is in the table
		if old.pid != 0 && old.pid == ai.PID {
			ls.prev.Store(old)
			ls.trimPrev()
		} else {
			ls.replacedOther = true
		}
	}
	ss.m.Store(c.EngineId, ls) // the same engine process opening again replaces its scheduler
	return &pb.OpenSchedulerResponse{Addr: ss.addr, TakesPreempted: true, TakesNewRequest: true}, nil
}

func (ss *schedulers) MatchedTokens(ctx context.Context, req *pb.MatchedTokensRequest) (*pb.MatchedTokensResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	r, err := stream.RequestFromProto(req.Request)
	if err != nil {
		return nil, ss.status(err)
	}
	computed, err := count("computed", req.Computed)
	if err != nil {
		return nil, ss.status(err)
	}
	ls.mu.Lock()
	n, async := ls.s.MatchedTokens(r, computed)
	ls.mu.Unlock()
	return &pb.MatchedTokensResponse{Tokens: int64(n), Async: async}, nil
}

func (ss *schedulers) AfterAlloc(ctx context.Context, req *pb.AfterAllocRequest) (*pb.AfterAllocResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	r, err := stream.RequestFromProto(req.Request)
	if err != nil {
		return nil, ss.status(err)
	}
	computed, err := stream.FitInt("computed", req.Computed)
	if err != nil {
		return nil, ss.status(err)
	}
	external, err := stream.FitInt("external", req.External)
	if err != nil {
		return nil, ss.status(err)
	}
	ls.mu.Lock()
	err = ls.s.AfterAlloc(r, kvxfer.Alloc{Blocks: stream.BlocksFromProto(req.Blocks), Computed: computed, External: external})
	ls.mu.Unlock()
	if err != nil {
		return nil, ss.status(fmt.Errorf("%w: %w", stream.ErrInvalid, err))
	}
	return &pb.AfterAllocResponse{Params: stream.ParamsToProto(r.Params)}, nil
}

func (ss *schedulers) Scheduled(ctx context.Context, req *pb.ScheduledRequest) (*pb.ScheduledResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	r, err := stream.RequestFromProto(req.Request)
	if err != nil {
		return nil, ss.status(err)
	}
	computed, err := count("computed", req.Computed)
	if err != nil {
		return nil, ss.status(err)
	}
	scheduled, err := count("scheduled", req.Scheduled)
	if err != nil {
		return nil, ss.status(err)
	}
	ls.mu.Lock()
	err = ls.s.Scheduled(r, stream.BlocksFromProto(req.NewBlocks), computed, scheduled)
	ls.mu.Unlock()
	if err != nil {
		return nil, ss.status(err)
	}
	return &pb.ScheduledResponse{}, nil
}

// count converts a token count an engine passed: in range (FitInt) and
// not negative.
func count(name string, v int64) (int, error) {
	n, err := stream.FitInt(name, v)
	if err == nil && n < 0 {
		err = stream.Invalid("%s = %d, want >= 0", name, n)
	}
	return n, err
}

// prefillCall is a converted PrefillRequest.
type prefillCall struct {
	r                   *kvxfer.Request
	blocks              [][]topology.BlockID
	computed, scheduled int
}

func prefillFromProto(req *pb.PrefillRequest) (prefillCall, error) {
	r, err := stream.RequestFromProto(req.Request)
	if err != nil {
		return prefillCall{}, err
	}
	computed, err := stream.FitInt("computed", req.Computed)
	if err != nil {
		return prefillCall{}, err
	}
	scheduled, err := stream.FitInt("scheduled", req.Scheduled)
	if err != nil {
		return prefillCall{}, err
	}
	return prefillCall{r: r, blocks: stream.BlocksFromProto(req.Blocks), computed: computed, scheduled: scheduled}, nil
}

// apply runs the call on s (held by the caller).
func (c *prefillCall) apply(s *kvxfer.Scheduler) error {
	if err := s.Prefill(c.r, c.blocks, c.computed, c.scheduled); err != nil {
		return fmt.Errorf("%w: %w", stream.ErrInvalid, err)
	}
	return nil
}

// newRequest applies a step's new_request op (Scheduler.NewRequest).
func (ss *schedulers) newRequest(ctx context.Context, engine string, req *pb.NewRequestRequest) error {
	ls, err := ss.get(ctx, engine)
	if err != nil {
		return ss.status(err)
	}
	r, err := stream.RequestFromProto(req.GetRequest())
	if err != nil {
		return ss.status(err)
	}
	ls.mu.Lock()
	err = ls.s.NewRequest(r)
	ls.mu.Unlock()
	if err != nil {
		return ss.status(fmt.Errorf("%w: %w", stream.ErrInvalid, err))
	}
	return nil
}

func (ss *schedulers) Prefill(ctx context.Context, req *pb.PrefillRequest) (*pb.PrefillResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	c, err := prefillFromProto(req)
	if err != nil {
		return nil, ss.status(err)
	}
	ls.mu.Lock()
	err = c.apply(ls.s)
	ls.mu.Unlock()
	if err != nil {
		return nil, ss.status(err)
	}
	return &pb.PrefillResponse{}, nil
}

func (ss *schedulers) RequestFinished(ctx context.Context, req *pb.RequestFinishedRequest) (*pb.RequestFinishedResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	r, err := stream.RequestFromProto(req.Request)
	if err != nil {
		return nil, ss.status(err)
	}
	if req.Status < 1 || req.Status > 5 {
		return nil, ss.status(stream.Invalid("status = %v, want stopped, length_capped, aborted, error or preempted", req.Status))
	}
	computed, err := stream.FitInt("computed", req.Computed)
	if err != nil {
		return nil, ss.status(err)
	}
	ls.mu.Lock()
	delay, params, err := ls.s.RequestFinished(r, kvxfer.FinishStatus(req.Status), stream.BlocksFromProto(req.Blocks), computed)
	ls.mu.Unlock()
	if err != nil {
		return nil, ss.status(fmt.Errorf("%w: %w", stream.ErrInvalid, err))
	}
	return &pb.RequestFinishedResponse{Delay: delay, Params: stream.ParamsToProto(params), RequestParams: stream.ParamsToProto(r.Params)}, nil
}

func (ss *schedulers) BuildMeta(ctx context.Context, req *pb.BuildMetaRequest) (*pb.BuildMetaResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	ls.mu.Lock()
	m := ls.s.BuildMeta()
	ls.mu.Unlock()
	return &pb.BuildMetaResponse{Meta: stream.StepToProto(m)}, nil
}

func (ss *schedulers) Update(ctx context.Context, req *pb.UpdateRequest) (*pb.UpdateResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	f, err := stream.FinishedFromProto(req.Finished)
	if err != nil {
		return nil, ss.status(err)
	}
	ls.mu.Lock()
	ls.s.Update(&f)
	pending := ls.s.HasPendingWork()
	ls.mu.Unlock()
	return &pb.UpdateResponse{Pending: pending}, nil
}

func (ss *schedulers) CloseScheduler(ctx context.Context, req *pb.CloseSchedulerRequest) (*pb.CloseSchedulerResponse, error) {
	ls, err := ss.get(ctx, req.EngineId)
	if err != nil {
		return nil, ss.status(err)
	}
	ss.mu.Lock()
	ss.closeLocked(req.EngineId, ls)
	ss.mu.Unlock()
	return &pb.CloseSchedulerResponse{}, nil
}

// closeLocked closes engine's scheduler ls, if it is still the engine's.
// Caller holds ss.mu.
func (ss *schedulers) closeLocked(engine string, ls *lockedScheduler) {
	if cur, _ := ss.m.Load(engine); cur != ls {
		return
	}
	ss.m.Delete(engine)
	ss.owners.release(engine)
	ss.total--
	if ss.byUID[ls.uid]--; ss.byUID[ls.uid] <= 0 {
		delete(ss.byUID, ls.uid)
	}
	ls.retire()
}

// reclaimLocked closes the schedulers whose engine process exited: an
// engine that crashed never called CloseScheduler, and its scheduler
// would hold one of its uid's (and the daemon's) slots for ever. A process
// that cannot be told gone (pid unknown, or a process of that pid exists,
// whoever's it is now) keeps its scheduler. Caller holds ss.mu.
func (ss *schedulers) reclaimLocked() {
	ss.m.Range(func(engine string, ls *lockedScheduler) bool {
		ss.goneLocked(engine, ls)
		return true
	})
}

// goneLocked closes engine's scheduler ls when its engine process exited
// (reclaimLocked), and reports whether it did. Caller holds ss.mu.
func (ss *schedulers) goneLocked(engine string, ls *lockedScheduler) bool {
	if ls.pid <= 0 || unix.Kill(int(ls.pid), 0) != unix.ESRCH {
		return false
	}
	ss.closeLocked(engine, ls)
	if ss.log != nil {
		ss.log.Info("kvxferd: scheduler of an engine whose process exited closed", "engine", engine, "pid", ls.pid, "uid", ls.uid)
	}
	return true
}

// reclaimGone closes engine's scheduler when its engine process exited,
// so that it no longer holds the engine's id (a rank of another uid is
// refused it otherwise), and reports whether it did.
func (ss *schedulers) reclaimGone(engine string) bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	ls, _ := ss.m.Load(engine)
	return ls != nil && ss.goneLocked(engine, ls)
}
