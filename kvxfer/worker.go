package kvxfer

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"runtime/debug"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/invariants"
	"github.com/kvxfer/kvxfer/topology"
)

// WorkerConfig configures a Worker. Zero fields mean the documented
// defaults.
type WorkerConfig struct {
	// EngineID names this engine (required); Addr is how peers reach it.
	EngineID, Addr string
	// Mode is push or pull (required).
	Mode Mode
	// Layout is this rank's KV cache (required; validated).
	Layout topology.Layout
	// Backend moves the bytes (required). The Worker registers the
	// layout's regions with it and deregisters them on Close; it does not
	// close the Backend.
	Backend Backend
	// Resolver performs handshakes with peer engines (required).
	Resolver Resolver
	// CheckAddr, when set, checks a remote engine's address (a receive's
	// Remote.Addr) as Resolver would take it: a step entry with one it
	// refuses is bad input, refused at once (named, counted) instead of
	// failing its handshake later. kvxferd sets it to its resolver's
	// host:port check.
	CheckAddr func(addr string) error
	// CompatHash is this engine's compatibility hash (SPEC §2). A peer
	// whose hash differs is refused unless SkipCompatCheck.
	CompatHash      string
	SkipCompatCheck bool
	// Lease is the producer lease the consumer's heartbeats keep alive
	// (default 30 s): heartbeats go every Lease/6 and extend a lease to
	// now + Lease·2/3.
	Lease time.Duration
	// RegistrationTTL bounds how long a producer keeps a registration it
	// could not match yet, how long it remembers finished matches to
	// drop late duplicates, and how long a pull consumer heartbeats a
	// request waiting in its engine's queue (StepMeta.Await), keeping
	// the producer's hold of its blocks (default 480 s).
	RegistrationTTL time.Duration
	// EngineTTL evicts a peer engine's handshake after this long without
	// activity (default 1 h; negative disables).
	EngineTTL time.Duration
	// HandshakeTimeout bounds one handshake (default 5 s).
	HandshakeTimeout time.Duration
	// PeerTimeout is how long a producer engine that requests wait on may
	// stay silent (its daemon not answering, nothing heard from it) before
	// they fail, naming it (default 5 s; negative: never). It is asked
	// about every PeerTimeout/5 meanwhile (see liveness.go).
	PeerTimeout time.Duration
	// FenceTimeout bounds how long a consumer that gave up on a request
	// waits for every producer rank to confirm that no WRITE into its
	// blocks can still land (default 2·Lease). Cancels are resent every
	// heartbeat interval meanwhile.
	FenceTimeout time.Duration
	// PollInterval is how often in-flight transfers are polled while any
	// exist (default 1 ms). Nothing is polled while idle.
	PollInterval time.Duration
	// CloseTimeout bounds how long Close waits for the transfers in
	// flight to end (default 10 s): a producer's WRITE still reads the
	// engine's blocks, a consumer's READ (or, without grants, a
	// producer's WRITE) still lands in them, so their requests report
	// only once they ended. Past it they are abandoned; close the backend
	// before the memory goes.
	CloseTimeout time.Duration
	// MaxRequests bounds the requests the rank holds at once on each side
	// (producer, consumer; default DefaultMaxRequests, negative: none). A
	// request past it fails at once (FailureSetup, its reason naming the
	// bound) and the others carry on: an engine cannot make its daemon
	// hold an unbounded number.
	MaxRequests int
	// MaxRunBytes caps the bytes of one coalesced descriptor (0: none).
	MaxRunBytes int64
	// MaxSegments bounds the descriptors one unit (a kernel block's worth
	// of one region) may need to land exactly in the consumer's layout
	// (topology.PlanOptions.MaxSegments; 0 means
	// topology.DefaultMaxSegments, 128). Layouts that scatter a block's
	// bytes (HND on one side and NHD on the other, or NHD with a TP
	// mismatch) need one descriptor per token or cell; a peer engine past
	// the bound is refused at handshake (ErrIncompatibleLayouts). Raising
	// it admits such pairs at the cost of that many descriptors per block;
	// set it alike on both engines, since either side may check.
	MaxSegments int
	// Layerwise makes a push producer WRITE each layer as the engine
	// reports it saved (LayerSaved) instead of all at once, for the
	// requests its scheduler lists in StepMeta.Prefill
	// (SchedulerConfig.Layerwise).
	Layerwise bool
	// LayerOf maps a region index of Layout to its layer for layer-wise
	// push (default: FirstLayer + index; under SeparateKV consecutive K
	// and V attention regions share a layer, other regions have one each).
	LayerOf func(region int) int
	// FirstLayer is the model layer of Layout.Regions[0], for the default
	// LayerOf. 0 derives it from Layout.RegionOffset, which is exact when
	// every layer has one region (packed or split K and V), and on the
	// first pipeline stage. Under SeparateKV a later stage's first layer
	// is not its region offset halved: an earlier stage's MLA or Mamba
	// layers have one region each. So a layer-wise Worker of such a stage
	// (SeparateKV, RegionOffset > 0) needs FirstLayer or LayerOf, and is
	// refused without: a guess would WRITE a layer before it is saved.
	FirstLayer int
	// Prepared posts through prepared descriptor lists when the backend
	// has them (PreparedPoster, NIXL): the lists of each peer rank pair
	// are handed over once, and a transfer passes only indices. Where the
	// backend models its post costs (PostCoster), each request goes the
	// cheaper way: prepared, or on the fly with its coalesced
	// descriptors. Layer-wise WRITEs keep the plain path.
	Prepared bool
	// OpenDataPlane turns off the data-plane grants (see Guarded): by
	// default, on a backend that enforces them, a peer may WRITE only into
	// blocks registered for its request (push) or READ only blocks held
	// for a request (pull). Set it only where every peer is trusted with
	// all of this rank's memory.
	OpenDataPlane bool
	// Preconnect lists peer engines to handshake with as soon as the
	// worker starts, so the first request to each pays no handshake.
	Preconnect []PeerRef
	// ContainPanics keeps a panic on the Worker's loop goroutine (a broken
	// invariant of the core, or a panic in a Backend method the loop
	// calls) from ending the process: the Worker logs the panic with its
	// stack, counts it (Stats.Panics), fails every request it held and
	// every request handed to Step that it had not taken in (one outcome
	// each: ResultFailed, FailureClosed, the reason saying the worker hit
	// an internal error), deregisters its memory, and stops: Done is
	// closed and Err says why. Other Workers in the process carry on.
	// kvxferd sets it, so that one engine's broken Worker is not the whole
	// daemon's end.
	//
	// Builds with -tags invariants ignore it: the panic propagates, so
	// tests see every broken invariant.
	ContainPanics bool
	// Metrics receives the worker's statistics (default: a new one).
	Metrics *Metrics
	// HopTrace, when set, receives an event as each request passes each
	// point of its path through the Worker (hoptrace.go): what a trace
	// that times a transfer's hops is made of (kvxferd -hop-trace). Nil,
	// the default: no trace, each point costs a nil check.
	HopTrace HopTracer
	// Logger (default slog.Default()).
	Logger *slog.Logger
}

// PeerRef names a peer engine and where its kvxferd is reached.
type PeerRef struct{ EngineID, Addr string }

func (c *WorkerConfig) fill() error {
	for i, p := range c.Preconnect {
		if p.EngineID == "" {
			return fmt.Errorf("kvxfer: WorkerConfig.Preconnect[%d].EngineID is empty", i)
		}
	}
	if c.EngineID == "" {
		return errors.New("kvxfer: WorkerConfig.EngineID is empty")
	}
	if c.Mode != ModePush && c.Mode != ModePull {
		return fmt.Errorf("kvxfer: WorkerConfig.Mode = %d, want push or pull", c.Mode)
	}
	if c.Backend == nil {
		return errors.New("kvxfer: WorkerConfig.Backend is nil")
	}
	if c.Resolver == nil {
		return errors.New("kvxfer: WorkerConfig.Resolver is nil")
	}
	if err := c.Layout.Validate(); err != nil {
		return fmt.Errorf("kvxfer: WorkerConfig.Layout: %w", err)
	}
	if c.Lease == 0 {
		c.Lease = 30 * time.Second
	}
	if c.RegistrationTTL == 0 {
		c.RegistrationTTL = 480 * time.Second
	}
	if c.MaxRequests == 0 {
		c.MaxRequests = DefaultMaxRequests
	}
	if c.EngineTTL == 0 {
		c.EngineTTL = time.Hour
	}
	if c.HandshakeTimeout == 0 {
		c.HandshakeTimeout = 5 * time.Second
	}
	if c.PeerTimeout == 0 {
		c.PeerTimeout = 5 * time.Second
	}
	if c.FenceTimeout == 0 {
		c.FenceTimeout = 2 * c.Lease
	}
	if c.PollInterval == 0 {
		c.PollInterval = time.Millisecond
	}
	if c.CloseTimeout == 0 {
		c.CloseTimeout = 10 * time.Second
	}
	for name, d := range map[string]time.Duration{"Lease": c.Lease, "RegistrationTTL": c.RegistrationTTL,
		"HandshakeTimeout": c.HandshakeTimeout, "FenceTimeout": c.FenceTimeout, "PollInterval": c.PollInterval, "CloseTimeout": c.CloseTimeout} {
		if d < 0 {
			return fmt.Errorf("kvxfer: WorkerConfig.%s = %v, want > 0", name, d)
		}
	}
	if c.MaxSegments < 0 {
		return fmt.Errorf("kvxfer: WorkerConfig.MaxSegments = %d, want >= 0", c.MaxSegments)
	}
	if c.Lease < 6*time.Millisecond {
		return fmt.Errorf("kvxfer: WorkerConfig.Lease = %v, want at least 6ms", c.Lease)
	}
	if c.FirstLayer < 0 {
		return fmt.Errorf("kvxfer: WorkerConfig.FirstLayer = %d, want >= 0", c.FirstLayer)
	}
	if c.LayerOf == nil {
		// One layer per region, except that under SeparateKV an attention
		// layer's K and V regions (consecutive) share one: an MLA or Mamba
		// layer keeps a single region there too. A later pipeline stage
		// starts at FirstLayer, or at RegionOffset where every layer has
		// one region.
		off, sep := c.Layout.RegionOffset, c.Layout.Packing == topology.SeparateKV
		base := off
		switch {
		case c.FirstLayer > 0:
			base = c.FirstLayer
		case sep && off > 0 && c.Layerwise:
			// RegionOffset counts two regions per attention layer of the
			// earlier stages and one per MLA or Mamba layer: their mix,
			// and so this stage's first layer, is unknown here.
			return fmt.Errorf("kvxfer: WorkerConfig.FirstLayer = 0 with Layerwise, Layout.Packing = %v and Layout.RegionOffset = %d (pipeline stage PPRank = %d): "+
				"the stage's first layer cannot be derived from its region offset when K and V have regions of their own; "+
				"set WorkerConfig.FirstLayer (or LayerOf), or use packed or split K and V", c.Layout.Packing, off, c.Layout.PPRank)
		case sep:
			base = off / 2
		}
		layers := make([]int, len(c.Layout.Regions))
		n, open := 0, false // open: an attention K region waits for its V
		for i := range c.Layout.Regions {
			k := c.Layout.Regions[i].Kind
			attn := k == topology.KindFullAttention || k == topology.KindSlidingWindow
			if sep && attn && open {
				layers[i], open = base+n-1, false
				continue
			}
			layers[i], open = base+n, sep && attn
			n++
		}
		c.LayerOf = func(r int) int {
			if r >= 0 && r < len(layers) {
				return layers[r]
			}
			return base + r
		}
	}
	if c.Metrics == nil {
		c.Metrics = NewMetrics()
	}
	if c.Logger == nil {
		c.Logger = slog.Default()
	}
	return nil
}

// Worker is the connector of one engine rank (SPEC §7-§10): it registers
// the rank's KV memory, consumes per-step metadata, and runs one loop
// goroutine that sends registrations, matches them with finished blocks,
// handshakes with peers, posts WRITEs or READs, counts completion
// notices, sends heartbeats, expires leases and reports exactly one
// outcome per request.
//
// A Worker is safe for concurrent use. Its methods never block on
// transfers: they hand work to the loop and return.
type Worker struct {
	cfg     WorkerConfig
	be      Backend
	log     *slog.Logger
	metrics *Metrics
	regions []MemRegion
	// trace is WorkerConfig.HopTrace (nil: off).
	trace HopTracer
	// groupBlocks is the number of logical blocks of each group.
	groupBlocks []int
	// layers are the layers the rank holds (WorkerConfig.LayerOf of its
	// regions), sorted, each once: what LayerSaved may name.
	layers   []int
	registry *hotpath.Registry
	builder  *hotpath.Builder
	// access is the data-plane grants (nil: the backend does not enforce
	// them, or OpenDataPlane).
	access *accessTable

	wake   chan struct{} // 1-slot: new input for the loop
	ready  chan struct{} // 1-slot: outcomes are waiting
	ctx    context.Context
	cancel context.CancelFunc
	// hsCtx bounds the handshakes the loop starts: they outlive ctx
	// through the close's fence (fenceClose), and no longer.
	hsCtx    context.Context
	hsCancel context.CancelFunc
	stopped  chan struct{}
	hsWG     sync.WaitGroup
	// relWG counts the releases of abandoned transfers under way, each
	// on a goroutine of its own (abandon).
	relWG sync.WaitGroup

	mu struct {
		sync.Mutex
		inbox []event
		// queued: the engine's input (steps, layer signals) in inbox, at
		// most maxQueuedSteps; room, when a Step waits for it to drop, is
		// closed once the loop takes the inbox.
		queued int
		room   chan struct{}
		out    Finished
		closed bool
		// fencing: the loop runs the close's fence (fenceClose), and
		// takes handshake answers still: a consumer's notice from an
		// engine not handshaken yet is admitted only on one.
		fencing bool
		// err is why the loop stopped on its own (ContainPanics).
		err error
		// released are abandoned transfers whose release returned, for
		// the core (inReleased).
		released []XferID
	}
	closeOnce sync.Once
	// dup is validate's scratch for finding a block named twice.
	dup struct {
		mu sync.Mutex
		d  hotpath.Dups
	}

	// Everything below is owned by the loop goroutine: the driver's own
	// state, then the core's.
	awaiting bool                 // told the backend (an Awaiter) that we await peer messages
	notifs   []Notif              // drained notifications, reused
	xfers    map[XferID]xferEntry // posted transfers, by the core's names
	preps    map[PrepID]prepEntry // prepared lists, by the core's names
	opsBuf   []op
	errsBuf  []error
	st       loopState
	// unhandled: the events of the inbox batch being handed to the core,
	// from the one it is handling on (broke fails their requests).
	unhandled []event
	// deregistered: broke deregistered the regions already (read by Close
	// after the loop stopped).
	deregistered bool
	// closedSends: the producer requests whose outcome the stopping loop
	// gives (those it held, and those it reported but had not published,
	// when it began to close or broke). Written by the loop before it
	// stops, read only after (Worker.StepDropped on a closed Worker).
	closedSends map[string]bool
	// closedRecvs: likewise, the consumer requests (Worker.RecvsHeld).
	closedRecvs map[string]bool
}

type eventKind uint8

const (
	evStep eventKind = iota + 1
	evLayer
	evHandshake
	evInspect
)

type event struct {
	kind eventKind
	meta *StepMeta
	// bad are meta's entries Step refused, to fail.
	bad   []rejected
	step  uint64
	layer int
	hs    *hsResult
	fn    func(*loopState)
}

// hsAsk is a handshake (or liveness probe) the core wants run.
type hsAsk struct {
	engine, addr string
	timeout      time.Duration
	probe        bool
	// gen is the generation the core holds: a probe that finds it
	// unchanged needs no agent loaded (most probes).
	gen uint64
	// moves is the engine's addrMoves when asked: an answer from an
	// address it has moved from since is not its word (handshakeDone).
	moves uint64
}

type hsResult struct {
	probe   bool // a liveness probe (liveness.go), not a handshake
	closing bool // the Worker was closing when the answer came
	engine  string
	moves   uint64 // the ask's
	res     HandshakeResult
	err     error
	took    time.Duration
	// names and loadErrs are res.Ranks' agents as the driver loaded them
	// into the backend (LoadPeer), by rank index.
	names    []PeerName
	loadErrs []error
}

// agent is rank i's agent as loaded.
func (h *hsResult) agent(i int) (PeerName, error) {
	if i >= len(h.names) {
		return "", fmt.Errorf("%w: rank %d's agent was not loaded", ErrBadMetadata, i)
	}
	return h.names[i], h.loadErrs[i]
}

// NewWorker validates cfg, registers the layout's regions with the
// backend and starts the worker's loop. Close stops it.
func NewWorker(cfg WorkerConfig) (*Worker, error) {
	w, err := newWorker(cfg)
	if err != nil {
		return nil, err
	}
	cfg = w.cfg
	l := &cfg.Layout
	if err := w.be.Register(w.regions); err != nil {
		return nil, fmt.Errorf("kvxfer: register %d regions: %w", len(w.regions), err)
	}
	if g, ok := w.be.(Guarded); ok && !cfg.OpenDataPlane {
		w.access = newAccessTable(l, w.groupBlocks, cfg.Mode, w.metrics)
		if err := g.SetGuard(w.access); err != nil {
			_ = w.be.Deregister(w.regions)
			return nil, fmt.Errorf("kvxfer: data-plane grants: %w", err)
		}
	}
	w.ctx, w.cancel = context.WithCancel(context.Background())
	w.hsCtx, w.hsCancel = context.WithCancel(context.Background())
	w.st.init(w)
	_, canPrepare := w.be.(PreparedPoster)
	w.st.prepare = canPrepare && cfg.Prepared
	_, canLayout := w.be.(LayoutPoster)
	w.st.layouts = canLayout && !w.st.prepare
	if pc, ok := w.be.(PostCoster); ok && w.st.prepare {
		w.st.cost, w.st.costed = pc.PostCost(), true
	}
	w.st.now = time.Now()
	for _, p := range cfg.Preconnect {
		w.st.ensureEngine(p.EngineID, p.Addr)
	}
	w.apply()
	go w.run()
	return w, nil
}

// newWorker validates cfg and makes a Worker, its core not yet
// initialised and nothing registered with the backend or started.
func newWorker(cfg WorkerConfig) (*Worker, error) {
	if err := cfg.fill(); err != nil {
		return nil, err
	}
	b, err := hotpath.NewBuilder(hotpath.Options{Op: opFor(cfg.Mode), MaxRunBytes: cfg.MaxRunBytes})
	if err != nil {
		return nil, err
	}
	w := &Worker{cfg: cfg, be: cfg.Backend, log: cfg.Logger, metrics: cfg.Metrics, trace: cfg.HopTrace,
		registry: hotpath.NewRegistry(), builder: b, xfers: map[XferID]xferEntry{}, preps: map[PrepID]prepEntry{},
		wake: make(chan struct{}, 1), ready: make(chan struct{}, 1), stopped: make(chan struct{})}
	l := &cfg.Layout
	for i, r := range l.Regions {
		w.regions = append(w.regions, MemRegion{Addr: r.Base, Len: uint64(r.BlockLen) * uint64(r.NumBlocks), Dev: r.DeviceID, Kind: memKindOf(r)})
		w.layers = append(w.layers, cfg.LayerOf(i))
	}
	slices.Sort(w.layers)
	w.layers = slices.Compact(w.layers)
	for _, g := range l.GroupList() {
		n := -1
		for _, ri := range g.Regions {
			r := l.Regions[ri]
			blocks := r.NumBlocks
			if r.Kind != topology.KindMamba {
				blocks /= l.PagesPerBlock()
			}
			if n < 0 || blocks < n {
				n = blocks
			}
		}
		w.groupBlocks = append(w.groupBlocks, n)
	}
	return w, nil
}

func memKindOf(r topology.Region) MemKind {
	if r.DeviceID > 0 {
		return MemVRAM
	}
	return MemDRAM
}

func opFor(m Mode) hotpath.Op {
	if m == ModePull {
		return hotpath.OpRead
	}
	return hotpath.OpWrite
}

// Step hands the loop one step's metadata. A malformed entry is refused:
// counted (Metrics.BadInput, by field), named with its request, field and
// value in the error Step returns, and its request fails (one failed
// outcome, FailureSetup, its reason naming the field and value; a
// consumer's blocks, when valid, reported invalid), unless the rank holds
// a request of that id already (a malformed duplicate is dropped) or the
// entry names no request. A layer-wise Prefill entry is dropped without an
// outcome: the request's SendReq, which follows it, decides the request.
// The rest of the step proceeds.
//
// Step never modifies meta or anything it references, so one StepMeta may
// be handed to the workers of every rank of an engine. The loop reads it
// after Step returns: the caller must not modify it afterwards (Clone
// first to reuse it).
func (w *Worker) Step(meta *StepMeta) error { return w.StepRefusing(meta, nil) }

// Refusal is a step entry its caller could not read into a StepMeta (a
// wire message's malformed entry: stream.StepEntriesFromProto).
// StepRefusing fails its request as Step fails an entry it refuses itself.
type Refusal struct {
	// Role is the entry's side: RoleConsumer (a receive), RoleProducer
	// (a send), 0 (a layer-wise prefill entry: its SendReq decides the
	// request).
	Role Role
	// ReqID is the entry's request ("": it names none; nothing fails).
	ReqID string
	// Local are a receive's blocks, when they could be read: reported
	// invalid with its failure when they are this rank's.
	Local []topology.Span
	// Field is what Metrics.BadInput counts it as ("recv_req.remote",
	// say); Reason names the field and its value.
	Field, Reason string
}

// StepRefusing is Step for a step whose caller left out the entries in
// refused: each is counted (Metrics.BadInput, its Field), named in the
// error returned, and its request fails as a refused entry's does
// (one failed outcome, FailureSetup, unless the rank holds a request of
// that id on that side). The rest of the step proceeds.
func (w *Worker) StepRefusing(meta *StepMeta, refused []Refusal) error {
	if meta == nil {
		if len(refused) == 0 {
			return nil
		}
		meta = &StepMeta{}
	}
	if w.trace != nil {
		w.hopStep(meta, HopRecvStep, HopSendStep)
	}
	meta, bad, err := w.validate(meta)
	if len(refused) > 0 {
		errs := []error{err}
		for _, r := range refused {
			w.metrics.BadInput(r.Field)
			local := r.Local
			if r.Role != RoleConsumer || !w.ownSpans(local) {
				local = nil
			}
			if r.ReqID == "" {
				errs = append(errs, fmt.Errorf("kvxfer: step entry: %s", r.Reason))
			} else {
				errs = append(errs, fmt.Errorf("kvxfer: step entry %q: %s", r.ReqID, r.Reason))
			}
			bad = append(bad, rejected{role: r.Role, id: r.ReqID, reason: "invalid step entry: " + r.Reason, local: local})
		}
		err = errors.Join(errs...)
	}
	if perr := w.post(event{kind: evStep, meta: meta, bad: bad}); perr != nil {
		return perr
	}
	return err
}

// StepDropped tells the worker of a step its caller dropped (could not
// hand it: its metadata was not published, no longer kept, or could not
// be read, or the Worker is closed), naming send, the producer requests
// the step finishes or aborts as far as the caller knows them (an id
// twice is taken once). A layer-wise producer the rank holds prefilling
// from an earlier step has no lease: its finish or abort alone ends it,
// and this step's is lost. Each such one of send ends as a refused finish
// does (StepRefusing): nothing more is written from its blocks, its
// consumer is told it failed, and it fails (FailureSetup, its reason why)
// once its WRITEs in flight end. Any other request of send the rank holds
// keeps its own outcome (a lease, or its transfer, ends it); one it does
// not hold gets none.
//
// StepDropped returns the ids of send whose outcome is the worker's (each
// once): those it ends, and those it holds otherwise. The caller does not
// end them itself, nor name them as ended: the engine, told twice, would
// free blocks a WRITE still reads at the first. The rest are the caller's
// to end.
//
// StepDropped returns once the loop has taken in every step handed to it
// before. Once the Worker is closed (Close, or on its own: Err), which
// ends every request it held, it returns, with ErrClosed (or the loop's
// error), the ids of send the Worker held when it stopped: their outcome
// is its close's. It then waits for the loop to stop first.
func (w *Worker) StepDropped(send []string, why string) ([]string, error) {
	if len(send) == 0 {
		return nil, nil
	}
	return w.askIDs(send, func(st *loopState) []string { return st.stepDropped(nil, send, why) },
		func(id string) bool { return w.closedSends[id] })
}

// RecvsHeld returns the ids of recv, consumer requests a step its caller
// dropped names (StepDropped), whose outcome is the worker's (each once):
// those it holds (an engine that named one in an earlier step too). The
// caller does not end them itself, nor name them as ended: the engine,
// told twice, would free blocks a WRITE or READ may still fill at the
// first. The rest are the caller's to end. Once the Worker is closed
// (Close, or on its own: Err), it returns, with ErrClosed (or the loop's
// error), those of recv it held when it stopped (its close ended them),
// after the loop stopped. The rest, which the caller ends, are no longer
// heartbeaten as waiting requests (StepMeta.Await): the receive that was
// to take over from the wait never comes (before, the wait outlived the
// request, and its heartbeats kept the producer's hold for as long as the
// rank lived). Nothing else changes.
func (w *Worker) RecvsHeld(recv []string) ([]string, error) {
	if len(recv) == 0 {
		return nil, nil
	}
	return w.askIDs(recv, func(st *loopState) []string {
		for _, id := range recv {
			if st.recvs[id] == nil {
				st.endWait(id, FailureCancelled, "the consumer request's step was dropped") // the caller ends it: see above
			}
		}
		return eachOnce(recv, func(id string) bool { return st.recvs[id] != nil })
	}, func(id string) bool { return w.closedRecvs[id] })
}

// askIDs runs ask on the loop and returns its answer: the ids of the
// caller's list ids whose outcome is the worker's. Once the Worker is
// closed (Close, or on its own: Err), it returns, with ErrClosed (or the
// loop's error), the ids of ids that ask named (the loop may have taken
// the inspection in as it closed, or not) or that closed says the loop
// held as it stopped (the loop writes closedSends and closedRecvs before
// it stops: closed is read only after), each once, after the loop
// stopped.
func (w *Worker) askIDs(ids []string, ask func(*loopState) []string, closed func(string) bool) ([]string, error) {
	ch := make(chan []string, 1)
	err := w.post(event{kind: evInspect, fn: func(st *loopState) { ch <- ask(st) }})
	if err == nil {
		select {
		case out := <-ch:
			return out, nil
		case <-w.stopped:
		}
	} else {
		<-w.stopped
	}
	var saw map[string]bool
	select {
	case out := <-ch:
		saw = make(map[string]bool, len(out))
		for _, id := range out {
			saw[id] = true
		}
	default:
	}
	return eachOnce(ids, func(id string) bool { return saw[id] || closed(id) }), cmp.Or(w.Err(), ErrClosed)
}

// eachOnce returns the ids of ids that has holds, each once, in order.
func eachOnce(ids []string, has func(string) bool) []string {
	var out []string
	seen := make(map[string]bool, len(ids))
	for _, id := range ids {
		if !seen[id] && has(id) {
			out = append(out, id)
		}
		seen[id] = true
	}
	return out
}

// noteClosedSends records, as the loop stops (closing, or broken), the
// producer and consumer requests whose outcome it gives: those held, and
// those reported but not yet published (Worker.closedSends, closedRecvs).
func (w *Worker) noteClosedSends() {
	st := &w.st
	m := make(map[string]bool, st.sends.len()+len(st.out.Sending))
	for s := range st.sends.all() {
		if s.ownsOutcome() {
			m[s.req.ReqID] = true
		}
	}
	for _, o := range st.out.Sending {
		if o.Result != ResultAborted {
			m[o.ReqID] = true
		}
	}
	w.closedSends = m
	r := make(map[string]bool, len(st.recvs)+len(st.out.Recving))
	for id := range st.recvs {
		r[id] = true
	}
	for _, o := range st.out.Recving {
		if o.Result != ResultAborted {
			r[o.ReqID] = true
		}
	}
	w.closedRecvs = r
}

// LayerSaved tells a layer-wise push producer that layer of the given step
// is in memory: the WRITEs of that layer for the step's finished requests
// go out at once.
//
// A layer the rank does not hold (WorkerConfig.LayerOf maps none of its
// regions to it) is bad input: counted (Metrics.BadInput
// "layer_saved.layer") and returned as an error naming it; nothing else
// is affected. A signal that no request of its step takes (the step
// listed none on this rank, was dropped or is not taken in yet, or its
// requests ended, were finished or were preempted first) is legitimate and loses nothing
// (a request's unseen layers are written at its finish): it is counted as
// Metrics.Dropped "layer_saved_unknown_step".
func (w *Worker) LayerSaved(step uint64, layer int) error {
	if _, ok := slices.BinarySearch(w.layers, layer); !ok {
		w.metrics.BadInput("layer_saved.layer")
		return fmt.Errorf("kvxfer: LayerSaved step %d: layer = %d, not a layer this rank holds (%s)", step, layer, w.heldLayers())
	}
	return w.post(event{kind: evLayer, step: step, layer: layer})
}

// heldLayers describes the layers the rank holds, for an error.
func (w *Worker) heldLayers() string {
	l := w.layers
	switch {
	case len(l) == 0:
		return "none"
	case l[len(l)-1]-l[0] == len(l)-1:
		return fmt.Sprintf("layers %d..%d", l[0], l[len(l)-1])
	case len(l) <= 8:
		return fmt.Sprintf("layers %v", l)
	}
	return fmt.Sprintf("%d layers from %d to %d", len(l), l[0], l[len(l)-1])
}

// maxQueuedSteps bounds the engine's input (steps and layer signals)
// waiting for the loop to take it in: past it, Step and LayerSaved wait
// for the loop (or the Worker's close), and so does whoever feeds them
// (the daemon's stream receiver, and through gRPC's flow control the
// engine). Without it an engine sending faster than its rank takes steps
// in (or while the loop was held up) queued them without end. The loop
// takes its whole inbox at each turn: a healthy one keeps a few at most.
const maxQueuedSteps = 64

func (w *Worker) post(e event) error {
	engine := e.kind == evStep || e.kind == evLayer
	w.mu.Lock()
	for engine && w.mu.queued >= maxQueuedSteps && !w.mu.closed {
		if w.mu.room == nil {
			w.mu.room = make(chan struct{})
		}
		room := w.mu.room
		w.mu.Unlock()
		w.signal()
		stopped := false
		select {
		case <-room:
		case <-w.stopped:
			stopped = true
		}
		w.mu.Lock()
		if stopped {
			break
		}
	}
	if w.mu.closed && !(w.mu.fencing && e.kind == evHandshake) {
		err := w.mu.err
		w.mu.Unlock()
		return cmp.Or(err, ErrClosed)
	}
	w.mu.inbox = append(w.mu.inbox, e)
	if engine {
		w.mu.queued++
	}
	w.mu.Unlock()
	w.signal()
	return nil
}

// takeInboxLocked takes the inbox, making room for the engine's input
// waiting for it. Caller holds mu.
func (w *Worker) takeInboxLocked() []event {
	inbox := w.mu.inbox
	w.mu.inbox, w.mu.queued = nil, 0
	if w.mu.room != nil {
		close(w.mu.room)
		w.mu.room = nil
	}
	return inbox
}

func (w *Worker) signal() {
	select {
	case w.wake <- struct{}{}:
	default:
	}
}

// Finished drains the outcomes reported since the last call (SPEC §1
// get_finished). Each request appears once per side, ever.
func (w *Worker) Finished() Finished {
	w.mu.Lock()
	defer w.mu.Unlock()
	f := w.mu.out
	w.mu.out = Finished{}
	return f
}

// AppendFinished is Finished appending to dst's lists (the caller owns
// them; the worker keeps none of their memory): a caller that reuses dst
// drains outcomes without allocating, where Finished hands over lists it
// allocated.
func (w *Worker) AppendFinished(dst Finished) Finished {
	w.mu.Lock()
	defer w.mu.Unlock()
	out := &w.mu.out
	dst.Sending = append(dst.Sending, out.Sending...)
	dst.Recving = append(dst.Recving, out.Recving...)
	dst.InvalidBlocks = append(dst.InvalidBlocks, out.InvalidBlocks...)
	out.Clear()
	return dst
}

// Ready receives a value (coalesced) when outcomes are waiting for
// Finished.
func (w *Worker) Ready() <-chan struct{} { return w.ready }

// Metrics returns the worker's statistics recorder.
func (w *Worker) Metrics() *Metrics { return w.metrics }

// Close stops the loop, abandons in-flight transfers (failing their
// requests), deregisters the regions and returns once every goroutine the
// Worker started has exited. It is idempotent. After the Worker stopped
// on its own (Err) it releases what is left and returns nil.
func (w *Worker) Close() error {
	var err error
	w.closeOnce.Do(func() {
		w.mu.Lock()
		w.mu.closed = true
		w.mu.Unlock()
		w.cancel()
		<-w.stopped
		w.hsWG.Wait()
		if w.deregistered {
			return
		}
		err = w.be.Deregister(w.regions)
		if errors.Is(err, ErrClosed) {
			err = nil
		}
	})
	return err
}

// Done is closed once the Worker's loop has stopped: after Close began,
// or on its own after an internal error (WorkerConfig.ContainPanics; Err
// then says why, and every request it held has its outcome in Finished).
// Call Close either way.
func (w *Worker) Done() <-chan struct{} { return w.stopped }

// Err returns why the Worker stopped on its own: an error wrapping
// ErrInternal (and ErrClosed) once its loop panicked with
// WorkerConfig.ContainPanics set, else nil (running, or closed by Close).
// Step, LayerSaved and State return it from then on.
func (w *Worker) Err() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.mu.err
}

// await tells an Awaiter backend when the loop starts and stops awaiting
// messages from its peers.
func (w *Worker) await(on bool) {
	if on == w.awaiting {
		return
	}
	if a, ok := w.be.(Awaiter); ok {
		a.Awaiting(on)
		w.awaiting = on
	}
}

// hookBeforeWait, set only by tests, runs on the loop goroutine before
// each wait.
var hookBeforeWait atomic.Pointer[func(*Worker)]

// hookAfterEvent, set only by tests, runs on the loop goroutine after the
// core handled an event, before its effects are carried out.
var hookAfterEvent atomic.Pointer[func(*Worker, *event)]

// run is the loop goroutine. With ContainPanics (and without -tags
// invariants) a panic in it ends the Worker, not the process (broke).
func (w *Worker) run() {
	defer close(w.stopped) // after broke: Done means every outcome is out
	defer w.hsCancel()
	if w.cfg.ContainPanics && !invariants.Enabled {
		defer func() {
			if v := recover(); v != nil {
				w.broke(v, debug.Stack())
			}
		}()
	}
	w.loop()
}

// loop steps the core until the Worker closes.
func (w *Worker) loop() {
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	st := &w.st
	for {
		st.wakeups++
		w.mu.Lock()
		inbox := w.takeInboxLocked()
		w.mu.Unlock()
		now := time.Now()
		// One input at a time, each followed by its effects (and their
		// results) before the next.
		for i := range inbox {
			w.unhandled = inbox[i:]
			if w.trace != nil && inbox[i].kind == evStep {
				w.hopStep(inbox[i].meta, HopRecvLoop, HopSendLoop)
			}
			st.Step(now, input{kind: inEvent, ev: &inbox[i]})
			if h := hookAfterEvent.Load(); h != nil {
				(*h)(w, &inbox[i])
			}
			w.apply()
		}
		w.unhandled = nil
		w.turn(now)
		w.await(st.busy())
		next, ok := st.nextWake()
		if ok {
			timer.Reset(max(0, time.Until(next)))
		}
		if h := hookBeforeWait.Load(); h != nil {
			(*h)(w)
		}
		select {
		case <-w.ctx.Done():
			timer.Stop()
			// Events accepted before the close (Step returned nil for them)
			// join the state first, so shutdown ends their requests too;
			// none can be accepted after this.
			w.mu.Lock()
			w.mu.closed, w.mu.fencing = true, true
			inbox := w.takeInboxLocked()
			w.mu.Unlock()
			now := time.Now()
			for i := range inbox {
				w.unhandled = inbox[i:]
				st.Step(now, input{kind: inEvent, ev: &inbox[i]})
				w.apply()
			}
			w.unhandled = nil
			w.noteClosedSends()
			st.Step(now, input{kind: inClose})
			w.apply()
			w.publish()
			w.fenceClose(timer)
			w.await(false)
			return
		case <-w.wake:
		case <-w.be.Events():
		case <-timer.C:
		}
		if ok && !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
	}
}

// ErrInternal is the error of a Worker that hit an internal error and
// stopped (WorkerConfig.ContainPanics): a bug in kvxfer or its backend,
// not in the caller's input. errors.Is(err, ErrClosed) holds for it too.
var ErrInternal = errors.New("kvxfer: internal error")

// internalError is Worker.Err after a panic.
type internalError struct {
	engine string
	tp, pp int
	panic  string // the panic value, clipped
}

func (e *internalError) Error() string {
	return fmt.Sprintf("kvxfer: internal error: the worker of engine %q tp rank %d pp rank %d stopped after a panic (%s); its requests failed",
		e.engine, e.tp, e.pp, e.panic)
}

func (e *internalError) Is(target error) bool { return target == ErrInternal || target == ErrClosed }

// maxPanicText bounds the panic value quoted in errors and outcomes (the
// log has all of it, and the stack).
const maxPanicText = 256

// broke ends the Worker after its loop panicked (v, with the loop's stack;
// ContainPanics): nothing of the core's state may be trusted beyond its
// request tables, so it is never stepped again. Every request it held,
// and every one handed to Step that it may not have taken in (the rest of
// the inbox batch, and what is still queued), fails once (abandon); its
// transfers are released and its memory deregistered and closed to peers
// before the outcomes are published, so no peer's WRITE lands in blocks
// the engine gets back. Each part runs on its own (salvage): one that
// panics too is logged and the rest still run.
func (w *Worker) broke(v any, stack []byte) {
	l := &w.cfg.Layout
	text := fmt.Sprint(v)
	if len(text) > maxPanicText {
		text = text[:maxPanicText] + "..."
	}
	err := &internalError{engine: w.cfg.EngineID, tp: l.TPRank, pp: l.PPRank, panic: text}
	w.mu.Lock()
	w.mu.closed, w.mu.err = true, err
	pending := slices.Concat(w.unhandled, w.takeInboxLocked())
	w.mu.Unlock()
	w.unhandled = nil
	w.metrics.Panic()
	w.log.Error("kvxfer: worker hit an internal error and stopped; failing its requests", "engine", w.cfg.EngineID,
		"tp_rank", l.TPRank, "pp_rank", l.PPRank, "panic", fmt.Sprint(v), "stack", string(stack))
	w.salvage("fail its requests", func() {
		w.st.abandon("worker hit an internal error and stopped ("+text+")", pending)
	})
	// abandon reported every request the tables hold, and those pending
	// (its outcomes are not published yet).
	w.salvage("note its requests", w.noteClosedSends)
	w.salvage("release its transfers", func() {
		for id, x := range w.xfers {
			delete(w.xfers, id)
			_ = w.be.Release(x.be)
		}
		w.relWG.Wait() // those abandoned before, released on their own goroutines
		if pp, ok := w.be.(PreparedPoster); ok {
			for id, p := range w.preps {
				delete(w.preps, id)
				if p.err == nil {
					_ = pp.ReleasePrepared(p.be)
				}
			}
		}
	})
	if w.access != nil {
		w.salvage("close its data plane", w.access.closeAll)
	}
	w.salvage("deregister its memory", func() {
		w.deregistered = true // Close does not try again
		_ = w.be.Deregister(w.regions)
	})
	w.publish()
	w.salvage("stop awaiting", func() { w.await(false) })
	w.cancel() // ends the handshakes in flight
}

// salvage runs part of broke, logging a panic in it instead of letting it
// end the process.
func (w *Worker) salvage(what string, f func()) {
	defer func() {
		if v := recover(); v != nil {
			w.log.Error("kvxfer: a broken worker panicked again; going on", "engine", w.cfg.EngineID, "while", what, "panic", fmt.Sprint(v))
		}
	}()
	f()
}

// publish hands the outcomes the core reported to Finished, and signals
// Ready.
func (w *Worker) publish() {
	out := &w.st.out
	if len(out.Sending)+len(out.Recving)+len(out.InvalidBlocks) == 0 {
		return
	}
	if w.trace != nil {
		w.hopOutcomes(out) // before the engine can see them
	}
	w.mu.Lock()
	w.mu.out.Sending = append(w.mu.out.Sending, out.Sending...)
	w.mu.out.Recving = append(w.mu.out.Recving, out.Recving...)
	w.mu.out.InvalidBlocks = append(w.mu.out.InvalidBlocks, out.InvalidBlocks...)
	w.mu.Unlock()
	out.Clear()
	select {
	case w.ready <- struct{}{}:
	default:
	}
}

// apply does what the core asked for after an input (its effects): runs
// handshakes, each on a goroutine of its own whose answer comes back as an
// evHandshake event; releases abandoned transfers and prepared lists;
// forgets peers.
func (w *Worker) apply() {
	st := &w.st
	w.opsBuf, w.errsBuf = carryOut(st, w.opsBuf, w.errsBuf, w.do)
	fx := &st.fx
	for _, id := range fx.releases {
		if x, ok := w.xfers[id]; ok {
			_ = w.be.Release(x.be)
			delete(w.xfers, id)
		}
	}
	for _, id := range fx.abandon {
		w.abandon(id)
	}
	if pp, ok := w.be.(PreparedPoster); ok {
		for _, id := range fx.unprepare {
			if p, ok := w.preps[id]; ok {
				if p.err == nil {
					_ = pp.ReleasePrepared(p.be)
				}
				delete(w.preps, id)
			}
		}
	}
	for _, p := range fx.invalidate {
		_ = w.be.InvalidatePeer(p)
	}
	for _, a := range fx.asks {
		w.hsWG.Add(1)
		go func() {
			defer w.hsWG.Done()
			ctx, cancel := context.WithTimeout(w.hsCtx, a.timeout)
			defer cancel()
			t0 := time.Now()
			res, err := w.cfg.Resolver.Handshake(ctx, a.engine, a.addr)
			h := &hsResult{probe: a.probe, engine: a.engine, moves: a.moves, res: res, err: err, took: time.Since(t0), closing: w.ctx.Err() != nil}
			var partial *PartialHandshakeError
			if err != nil && !a.probe && errors.As(err, &partial) && len(partial.Answered) > 0 {
				// The ranks that answered: their agents admit their
				// messages (handshakeDone, loadAnswered).
				h.res = HandshakeResult{Ranks: partial.Answered}
				h.names, h.loadErrs = make([]PeerName, len(partial.Answered)), make([]error, len(partial.Answered))
				for i := range partial.Answered {
					h.names[i], h.loadErrs[i] = w.be.LoadPeer(partial.Answered[i].Agent)
				}
			}
			if err == nil && (!a.probe || res.Generation != a.gen) {
				h.names, h.loadErrs = make([]PeerName, len(res.Ranks)), make([]error, len(res.Ranks))
				for i := range res.Ranks {
					h.names[i], h.loadErrs[i] = w.be.LoadPeer(res.Ranks[i].Agent)
				}
			}
			_ = w.post(event{kind: evHandshake, hs: h})
		}()
	}
	clear(fx.asks)
	clear(fx.invalidate)
	fx.asks, fx.releases, fx.abandon, fx.invalidate, fx.unprepare = fx.asks[:0], fx.releases[:0], fx.abandon[:0], fx.invalidate[:0], fx.unprepare[:0]
}

// abandon releases a transfer the core gave up while in flight, on a
// goroutine of its own: a backend's release waits for bytes still moving
// (NIXL's, up to its bound, for a peer that hung), and the loop goes on
// meanwhile with every other request. Once it returned the core hears
// (inReleased, in turn), and the request reports.
func (w *Worker) abandon(id XferID) {
	x, ok := w.xfers[id]
	delete(w.xfers, id)
	w.relWG.Add(1)
	go func() {
		defer w.relWG.Done()
		if ok {
			_ = w.be.Release(x.be)
		}
		w.mu.Lock()
		w.mu.released = append(w.mu.released, id)
		w.mu.Unlock()
		w.signal()
	}()
}

// takeReleased hands the core the abandoned transfers released since
// the last call, each followed by its effects.
func (w *Worker) takeReleased(now time.Time) {
	w.mu.Lock()
	ids := w.mu.released
	w.mu.released = nil
	w.mu.Unlock()
	for _, id := range ids {
		w.st.Step(now, input{kind: inReleased, xfer: id})
		w.apply()
	}
}

// carryOut is every driver's loop over the core's ops: it hands each op
// to do (the driver's own call; round counts the hand-backs before it),
// in order, then their results back to the core (inOpsDone, at the
// input's time), until the core asks for nothing more. ops and errs are
// scratch, returned for reuse.
func carryOut(st *loopState, ops []op, errs []error, do func(round int, o *op) error) ([]op, []error) {
	for round := 0; len(st.fx.ops) > 0; round++ {
		ops = append(ops[:0], st.fx.ops...)
		st.fx.ops = st.fx.ops[:0]
		errs = errs[:0]
		for i := range ops {
			errs = append(errs, do(round, &ops[i]))
		}
		// The ops' descriptors were read: the arena is free again.
		st.fx.descs, st.fx.pairs = st.fx.descs[:0], st.fx.pairs[:0]
		st.fx.lays.Reset()
		st.Step(st.now, input{kind: inOpsDone, ops: ops, errs: errs})
		clear(ops)
		clear(errs)
	}
	return ops[:0], errs[:0]
}

// xferEntry is a transfer the driver posted for the core.
type xferEntry struct {
	be   XferID        // the backend's name for it
	post time.Duration // how long the post took
	// note is the notification it carries, kept for the hop trace when
	// on (nil when off), and op its direction.
	note []byte
	op   hotpath.Op
}

// prepEntry is a list the driver prepared for the core.
type prepEntry struct {
	be  PrepID
	err error // Prepare failed: posts through it fail with this
}

// do carries out one op of the core's and returns its error.
func (w *Worker) do(_ int, o *op) error {
	fx := &w.st.fx
	switch o.kind {
	case opNotify:
		if w.trace != nil {
			t0 := time.Now()
			err := w.be.Notify(o.peer, o.msg)
			w.hopMsg(o.msg, true, t0, time.Since(t0), err)
			return err
		}
		return w.be.Notify(o.peer, o.msg)
	case opPost:
		t0 := time.Now()
		id, err := w.be.Post(o.xop, o.peer, fx.descs[o.from:o.to], o.msg)
		if err == nil {
			w.xfers[o.id] = w.posted(id, t0, o)
		}
		return err
	case opPostLayout:
		lp, _ := w.be.(LayoutPoster)
		if lp == nil {
			return fmt.Errorf("kvxfer: %w: the backend takes no layouts", ErrXferFailed)
		}
		view := hotpath.Layouts{Bases: fx.lays.Bases, Entries: fx.lays.Entries, Spans: fx.lays.Spans[o.from:o.to]}
		t0 := time.Now()
		id, err := lp.PostLayouts(o.xop, o.peer, &view, o.msg)
		if err == nil {
			w.xfers[o.id] = w.posted(id, t0, o)
		}
		return err
	case opPostPrepared:
		pp, _ := w.be.(PreparedPoster)
		local, remote := w.preps[o.local], w.preps[o.remote]
		if pp == nil || local.err != nil || remote.err != nil {
			return cmp.Or(local.err, remote.err, fmt.Errorf("kvxfer: %w: no prepared lists", ErrXferFailed))
		}
		t0 := time.Now()
		id, err := pp.PostPrepared(o.xop, local.be, remote.be, fx.pairs[o.from:o.to], o.msg)
		if err == nil {
			w.xfers[o.id] = w.posted(id, t0, o)
		}
		return err
	case opPrepare:
		pp, _ := w.be.(PreparedPoster)
		if pp == nil {
			return fmt.Errorf("kvxfer: the backend has no prepared lists")
		}
		id, err := pp.Prepare(o.peer, o.entries)
		w.preps[o.prep] = prepEntry{be: id, err: err}
		return err
	case opGrant:
		w.access.grantWrite(o.grant, o.peers, o.spans, writeKey(o.req, o.tid))
		w.openGates(o)
		return nil
	case opRevoke:
		w.access.revokeWrite(o.grant) // waits for parts landing under it
		return nil
	case opHold:
		w.access.hold(o.spans, o.delta, o.req, o.tid)
		return nil
	}
	return fmt.Errorf("kvxfer: unknown op %d", o.kind)
}

// openGates offers a WRITE grant to its peers one-sided where the
// backend can (WriteGater). A gate not made costs nothing: the grant is
// served two-sided, as without gates.
func (w *Worker) openGates(o *op) {
	g, ok := w.be.(WriteGater)
	if !ok || o.req == "" || !g.Gateable() {
		return
	}
	lays := w.access.grantLayouts(o.spans)
	if len(lays) == 0 {
		return
	}
	tag := appendMsg(nil, w.st.self(&msg{Kind: msgTag, TransferID: o.tid, DReq: o.req}))
	for _, p := range o.peers {
		err := g.OpenGate(p, lays, tag)
		switch {
		case err == nil:
			w.metrics.GateOpened()
		case !errors.Is(err, ErrNoGate):
			w.metrics.GateFailed()
			w.log.Warn("kvxfer: offering a grant one-sided failed; it is served two-sided", "req", o.req, "peer", p, "err", err)
		}
	}
}

// posted is the entry of a transfer the backend took (id) in a post call
// begun at t0, reported to the hop trace when on.
func (w *Worker) posted(id XferID, t0 time.Time, o *op) xferEntry {
	d := time.Since(t0)
	x := xferEntry{be: id, post: d, op: o.xop}
	if w.trace != nil {
		x.note = append([]byte(nil), o.msg...)
		hop, side := HopWritePost, RoleProducer
		if o.xop == hotpath.OpRead {
			hop, side = HopReadPost, RoleConsumer
		}
		w.hop(HopEvent{Hop: hop, Side: side, Call: d, Began: t0, msg: x.note})
	}
	return x
}

// turn hands the core what the backend brought (notifications, ended
// transfers) and what time fired, each followed by its effects, and
// publishes the outcomes.
func (w *Worker) turn(now time.Time) {
	st := &w.st
	w.notifs = w.be.DrainNotifs(w.notifs[:0])
	if w.trace != nil {
		for i := range w.notifs {
			w.hopMsg(w.notifs[i].Msg, false, time.Time{}, 0, nil)
		}
	}
	for i := range w.notifs {
		st.Step(now, input{kind: inNotifs, notifs: w.notifs[i : i+1]})
		w.apply()
	}
	clear(w.notifs)
	w.pollXfers(now)
	w.takeReleased(now)
	st.Step(now, input{kind: inTimers})
	w.apply()
	w.publish()
}

// fenceClose runs the loop on after the close input while transfers are
// in flight (their requests report as each ends) or consumers wait for
// their producers' confirmations, for up to CloseTimeout; then abandons
// what is left (inCloseNow).
func (w *Worker) fenceClose(timer *time.Timer) {
	st := &w.st
	began := time.Now()
	deadline := began.Add(w.cfg.CloseTimeout)
	logAt := began.Add(time.Second) // what it waits for, logged once past it
	defer func() {
		w.hsCancel() // handshakes under way end (their answers are refused)
		w.mu.Lock()
		w.mu.fencing = false
		_ = w.takeInboxLocked()
		w.mu.Unlock()
	}()
	for st.closeWaits() {
		now := time.Now()
		if !now.Before(deadline) {
			st.logCloseWaits(now, began, true)
			break
		}
		if !logAt.IsZero() && !now.Before(logAt) {
			st.logCloseWaits(now, began, false)
			logAt = time.Time{}
		}
		// Handshake answers: a consumer's notice parked until its
		// engine's handshake says who speaks for its rank.
		w.mu.Lock()
		inbox := w.takeInboxLocked()
		w.mu.Unlock()
		for i := range inbox {
			st.Step(now, input{kind: inEvent, ev: &inbox[i]})
			w.apply()
		}
		w.turn(now)
		w.await(true)
		timer.Reset(min(w.cfg.PollInterval, time.Until(deadline)))
		select {
		case <-w.be.Events():
			if !timer.Stop() {
				<-timer.C
			}
		case <-timer.C:
		}
	}
	st.Step(time.Now(), input{kind: inCloseNow})
	w.apply()
	// Abandoned transfers still being released: their requests report
	// (closed) once no byte of theirs moves.
	w.relWG.Wait()
	w.publish()
}

// pollXfers polls every in-flight transfer once and hands those that
// ended to the core, then releases them.
func (w *Worker) pollXfers(now time.Time) {
	st := &w.st
	if len(w.xfers) == 0 {
		return
	}
	tm, _ := w.be.(Telemeter)
	for _, id := range slices.Sorted(maps.Keys(w.xfers)) {
		x := w.xfers[id]
		s, err := w.be.State(x.be)
		if s == XferInProgress && err == nil {
			continue
		}
		var tel *XferTelemetry
		if tm != nil && s == XferDone && err == nil {
			if t, ok := tm.Telemetry(x.be); ok {
				tel = &t
			}
		}
		delete(w.xfers, id)
		if w.trace != nil {
			w.hopEnded(&x, s, err, tel)
		}
		st.Step(now, input{kind: inXferEnded, xfer: id, state: s, err: err, tel: tel, post: x.post})
		_ = w.be.Release(x.be)
		w.apply()
	}
}

// rejected is a step entry validate refused. The loop fails its request
// (rejectEntry): every entry that names a request ends in one outcome.
type rejected struct {
	role Role // 0: a layer-wise prefill entry (its SendReq decides the request)
	id   string
	// reason names the field and its value.
	reason string
	// local are a consumer's blocks, when they passed the checks: they are
	// reported invalid with the failure, as for any failed receive.
	local []topology.Span
}

// MaxIDBytes bounds the ids and addresses of a step's entries (request
// ids, transfer ids, the peer's engine id, address and request id): the
// longest string a peer message carries (a peer's decoder refuses a longer
// one). An entry past it is refused, naming the field.
const MaxIDBytes = maxWireString

// maxRemoteRanks bounds the producer sizes a consumer request's params
// give (Remote.TPSize, Remote.PPSize and their product): as many ranks as
// a layout may have in TP or PP (topology.Layout.Validate) and an engine
// may register (the daemon's registry). Before the handshake tells the
// producer's own sizes, a request that ends without reading (an abort
// before it was scheduled, a full prefix hit) tells each producer rank
// its params name: before, Remote.PPSize = 2097152 made one such request
// list (and queue a notice to) 2,097,152 ranks, ~800 MB, and 2^31-1 ran
// the worker out of memory.
const maxRemoteRanks = 1 << 12

// longID is why s, field of an entry, is too long ("" when it is not).
func longID(field, s string) string {
	if len(s) <= MaxIDBytes {
		return ""
	}
	return fmt.Sprintf("%s = %.32q... has %d bytes, want at most %d", field, s, len(s), MaxIDBytes)
}

// validate checks a step's entries against the layout and returns the
// metadata to run: meta itself when every entry is good, else a copy
// without the bad entries (meta is never modified: ranks may share it),
// the entries it refused, and why. Each refusal is counted (BadInput, by
// field).
func (w *Worker) validate(meta *StepMeta) (*StepMeta, []rejected, error) {
	var (
		errs []error
		bad  []rejected
	)
	ng := len(w.groupBlocks)
	// spans checks a block list of what; it returns the field it fails on
	// (BadInput's label, under what's) and why, naming the value.
	spans := func(name string, ss []topology.Span) (field, why string) {
		if len(ss) == 0 {
			return "", ""
		}
		if len(ss) != ng {
			return name, fmt.Sprintf("%s has %d block groups, want %d", name, len(ss), ng)
		}
		for g, s := range ss {
			if s.Start < 0 {
				return name, fmt.Sprintf("%s group %d Start = %d, want >= 0", name, g, s.Start)
			}
			for i, b := range s.IDs {
				if b < 0 || int(b) >= w.groupBlocks[g] {
					return name, fmt.Sprintf("%s group %d block %d = %d, want in [0, %d)", name, g, i, b, w.groupBlocks[g])
				}
			}
			if i, j := w.repeated(s.IDs); i >= 0 {
				// Two of the request's blocks would be one: a consumer's
				// lands two producer blocks in it, a producer's sends one
				// block's KV for two.
				return name, fmt.Sprintf("%s group %d block %d = %d, the same block as block %d (want distinct blocks)", name, g, j, s.IDs[j], i)
			}
		}
		return "", ""
	}
	refuse := func(role Role, what, label, id, field, why string, local []topology.Span) {
		w.metrics.BadInput(label + "." + field)
		if id == "" {
			errs = append(errs, fmt.Errorf("kvxfer: %s.%s", what, why))
		} else {
			errs = append(errs, fmt.Errorf("kvxfer: %s %q: %s", what, id, why))
		}
		bad = append(bad, rejected{role: role, id: id, reason: fmt.Sprintf("invalid %s: %s", what, why), local: local})
	}
	recv := keepValid(meta.Recv, func(r *RecvReq) bool {
		field, why := "", ""
		switch {
		case r.ReqID == "":
			field, why = "req_id", "ReqID is empty"
		case r.Remote.EngineID == "":
			field, why = "remote.engine_id", "Remote.EngineID is empty"
		case longID("ReqID", r.ReqID) != "":
			field, why = "req_id", longID("ReqID", r.ReqID)
		case longID("TransferID", r.TransferID) != "":
			field, why = "transfer_id", longID("TransferID", r.TransferID)
		case longID("Remote.EngineID", r.Remote.EngineID) != "":
			field, why = "remote.engine_id", longID("Remote.EngineID", r.Remote.EngineID)
		case longID("Remote.ReqID", r.Remote.ReqID) != "":
			field, why = "remote.req_id", longID("Remote.ReqID", r.Remote.ReqID)
		case longID("Remote.Addr", r.Remote.Addr) != "":
			field, why = "remote.addr", longID("Remote.Addr", r.Remote.Addr)
		case r.Remote.Addr != "" && w.cfg.CheckAddr != nil && w.cfg.CheckAddr(r.Remote.Addr) != nil:
			field, why = "remote.addr", "Remote.Addr: "+w.cfg.CheckAddr(r.Remote.Addr).Error()
		case r.Remote.TPSize < 0 || r.Remote.TPSize > maxRemoteRanks:
			field, why = "remote.tp_size", fmt.Sprintf("Remote.TPSize = %d, want 0..%d", r.Remote.TPSize, maxRemoteRanks)
		case r.Remote.PPSize < 0 || r.Remote.PPSize > maxRemoteRanks:
			field, why = "remote.pp_size", fmt.Sprintf("Remote.PPSize = %d, want 0..%d", r.Remote.PPSize, maxRemoteRanks)
		case r.Remote.TPSize*r.Remote.PPSize > maxRemoteRanks:
			field, why = "remote.pp_size", fmt.Sprintf("Remote.TPSize*PPSize = %d*%d, want at most %d producer ranks",
				r.Remote.TPSize, r.Remote.PPSize, maxRemoteRanks)
		case r.Remote.Tokens < 0:
			field, why = "remote.tokens", fmt.Sprintf("Remote.Tokens = %d, want >= 0", r.Remote.Tokens)
		case r.Tokens < 0 || r.Tokens > maxWireTokens:
			field, why = "tokens", fmt.Sprintf("Tokens = %d, want 0..%d", r.Tokens, maxWireTokens)
		case w.cfg.Mode == ModePull && len(r.Local) > 0 && len(r.Remote.Blocks) != len(r.Local):
			field, why = "remote.blocks", fmt.Sprintf("Remote.Blocks has %d groups, Local %d", len(r.Remote.Blocks), len(r.Local))
		default:
			if _, why = spans("Local", r.Local); why != "" {
				field = "local"
			}
		}
		if why == "" {
			return true
		}
		local := r.Local
		if field == "local" {
			local = nil // not blocks of this rank: nothing to report invalid
		}
		refuse(RoleConsumer, "RecvReq", "recv_req", r.ReqID, field, why, local)
		return false
	})
	sendCheck := func(role Role, what, label string) func(*SendReq) bool {
		return func(s *SendReq) bool {
			field, why := "", ""
			switch {
			case s.ReqID == "":
				field, why = "req_id", "ReqID is empty"
			case longID("ReqID", s.ReqID) != "":
				field, why = "req_id", longID("ReqID", s.ReqID)
			case longID("TransferID", s.TransferID) != "":
				field, why = "transfer_id", longID("TransferID", s.TransferID)
			case s.Tokens < 0:
				field, why = "tokens", fmt.Sprintf("Tokens = %d, want >= 0", s.Tokens)
			default:
				if _, why = spans("Blocks", s.Blocks); why != "" {
					field = "blocks"
				}
			}
			if why == "" {
				return true
			}
			refuse(role, what, label, s.ReqID, field, why, nil)
			return false
		}
	}
	send := keepValid(meta.Send, sendCheck(RoleProducer, "SendReq", "send_req"))
	prefill := keepValid(meta.Prefill, sendCheck(0, "Prefill", "prefill"))
	await := meta.Await
	if w.cfg.CheckAddr != nil {
		// A waiting request at an address Resolver would never dial:
		// taken, it would move its engine there (engineAt), away from
		// the requests it serves. No outcome waits on it: counted and
		// dropped, as the core drops one it cannot use.
		await = keepValid(meta.Await, func(a *AwaitReq) bool {
			if a.Remote.Addr == "" {
				return true
			}
			err := w.cfg.CheckAddr(a.Remote.Addr)
			if err != nil {
				w.metrics.BadInput("await_req")
				w.log.Warn("kvxfer: a waiting request (StepMeta.Await) is not heartbeaten: Remote.Addr: "+err.Error(), "req", a.ReqID)
			}
			return err == nil
		})
	}
	if len(errs) == 0 && len(await) == len(meta.Await) {
		return meta, nil, nil
	}
	// A shallow copy is enough: the loop only reads what the kept
	// entries reference.
	m := *meta
	m.Recv, m.Send, m.Prefill, m.Await = recv, send, prefill, await
	return &m, bad, errors.Join(errs...)
}

// repeated returns the indices i < j of the first block ids of ids that
// are equal (-1, -1: none), with the scratch the callers of Step share
// under dup.mu.
func (w *Worker) repeated(ids []topology.BlockID) (int, int) {
	w.dup.mu.Lock()
	defer w.dup.mu.Unlock()
	return w.dup.d.Repeated(ids)
}

// ownSpans reports whether ss are block lists of this rank (one per
// group, every id in range).
func (w *Worker) ownSpans(ss []topology.Span) bool {
	if len(ss) != len(w.groupBlocks) {
		return false
	}
	for g, s := range ss {
		for _, b := range s.IDs {
			if b < 0 || int(b) >= w.groupBlocks[g] {
				return false
			}
		}
	}
	return true
}

// keepValid returns the entries of s that ok accepts: s itself when it
// accepts them all, else a new slice (s is never modified).
func keepValid[T any](s []T, ok func(*T) bool) []T {
	var kept []T
	for i := range s {
		if !ok(&s[i]) {
			if kept == nil {
				kept = make([]T, i, len(s))
				copy(kept, s[:i])
			}
			continue
		}
		if kept != nil {
			kept = append(kept, s[i])
		}
	}
	if kept == nil {
		return s
	}
	return kept
}

// WorkerState counts what a Worker holds. Once every request has its
// outcome, everything but Engines and Tombstones is zero.
type WorkerState struct {
	// Producer side: held requests, unmatched registrations, live matches.
	Sends, PendingRegs, Matches int
	// Tombstones remember finished matches for RegistrationTTL so late
	// duplicates are dropped; Early are pull completion notices for
	// requests not held yet (kept as long).
	Tombstones, Early int
	// LayerSteps are layer-wise steps with requests still prefilling.
	LayerSteps int
	// Consumer side: requests receiving.
	Recvs int
	// Handles are transfers in flight; Timers are armed deadlines.
	Handles, Timers int
	// Releasing are transfers given up in flight whose release (which
	// waits for their bytes) has not returned yet.
	Releasing int
	// Engines are cached peer handshakes.
	Engines int
	// Wakeups counts the loop's iterations: it stays put while the
	// worker is idle (no polling).
	Wakeups uint64
}

// State returns what the worker holds, as seen by its loop between two
// events. It blocks until the loop answers or the Worker is closed.
func (w *Worker) State() (WorkerState, error) {
	ch := make(chan WorkerState, 1)
	err := w.post(event{kind: evInspect, fn: func(st *loopState) {
		live := 0
		for _, t := range st.timers {
			if st.timerLive(t) {
				live++
			}
		}
		ch <- WorkerState{Sends: st.sends.len(), PendingRegs: len(st.regs), Matches: len(st.matched),
			Tombstones: len(st.tombs), Early: len(st.early), LayerSteps: len(st.layerSteps), Recvs: len(st.recvs), Handles: len(st.handles), Releasing: len(st.abandoned), Timers: live, Engines: len(st.engines), Wakeups: st.wakeups}
	}})
	if err != nil {
		return WorkerState{}, err
	}
	select {
	case s := <-ch:
		return s, nil
	case <-w.stopped:
		return WorkerState{}, cmp.Or(w.Err(), ErrClosed)
	}
}

// LogWaits logs (Warn, with message msg and then args, slog's) what the
// Worker holds, as a
// closing Worker logs what its close waits for a second into it: each
// producer request held, each consumer request open and the transfers in
// flight, and how long since began. It is for a caller that waits for the
// Worker to end them before it closes it (a daemon's graceful drain). It
// returns once the loop logged it, or with ErrClosed (or the loop's
// error) once the Worker is closed.
func (w *Worker) LogWaits(msg string, began time.Time, args ...any) error {
	logged := make(chan struct{})
	err := w.post(event{kind: evInspect, fn: func(st *loopState) {
		st.logWaits(msg, time.Now(), began, args...)
		close(logged)
	}})
	if err != nil {
		return err
	}
	select {
	case <-logged:
		return nil
	case <-w.stopped:
		return cmp.Or(w.Err(), ErrClosed)
	}
}

// Layout returns the rank's layout (read-only).
func (w *Worker) Layout() *topology.Layout { return &w.cfg.Layout }
