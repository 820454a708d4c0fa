package kvxfer

import (
	"container/heap"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/internal/invariants"
	"github.com/kvxfer/kvxfer/topology"
)

// loopState is the Worker's core: the per-rank protocol as a state
// machine (Step), split by concern the way raft splits its progress
// tracker from its log: what it may touch outside itself (coreEnv), the
// peer engines it knows (engineCache, engine.go), the producer side
// (producerState, send.go), the consumer side (consumerState, recv.go),
// the transfers and grants it named (xferState), and its periodic work.
// Each part's invariants are documented on its type and read alone; the
// methods that act across them (a producer request posting to an engine,
// say) are on loopState, in the file of their side. Everything here is
// the loop goroutine's: nothing is touched by any other, so none of it is
// locked.
type loopState struct {
	coreEnv
	engineCache
	producerState
	consumerState
	xferState

	timers  timerHeap
	wakeups uint64 // loop iterations, for the idle test
	out     Finished
	// nextTick: the next heartbeat and sweep (ticking: while busy).
	nextTick time.Time
	ticking  bool
	rankBuf  []int
	// lost are failure notices the backend could not send, sent again
	// at each tick (resendLost).
	lost []lostNotice
}

// lostNotice is a failure notice the backend could not send: tries
// sends so far.
type lostNotice struct {
	peer  PeerName
	b     []byte
	m     *msg
	tries int
}

// A failure notice (msgFail) that the backend could not send is sent
// again at each tick, up to lostTries sends in all (about a minute at
// the default lease's heartbeat interval): its receiver would otherwise
// wait for its deadline or lease (minutes, its blocks held) for a word
// the sender had, as when a NIXL connection broke and is being made
// again (kvxfer/backend/nixl's remake). At most maxLost wait at once;
// past either bound a notice is dropped, counted
// (kvxfer_dropped_messages_total{reason="notice_lost"}) and logged.
const (
	lostTries = 12
	maxLost   = 1024
)

// coreEnv is what the core reads and writes beyond its own state: its
// configuration (no backend, no resolver: coreConfig), the hot path's
// builder and layout registry (owned by the loop), where it counts and
// logs, the time of the input being handled, and the effects it asks of
// its driver. It holds nothing of its driver's: no Worker, backend,
// resolver, grant table, channel or lock (TestCoreReachesNothingShared).
type coreEnv struct {
	cfg      *coreConfig
	layout   *topology.Layout
	metrics  *Metrics
	log      *slog.Logger
	builder  *hotpath.Builder
	registry *hotpath.Registry

	// now is the time of the input being handled, set by the driver: the
	// core reads no clock.
	now time.Time
	// prepare: transfers go through prepared lists (WorkerConfig.Prepared
	// and a PreparedPoster backend).
	prepare bool
	// layouts: WRITEs (push) and READs (pull) go as layouts (a
	// LayoutPoster backend, not prepared; see LayoutPoster).
	layouts bool
	// cost is the backend's model of its two kinds of post (PostCoster),
	// when costed: with prepare, each request takes the cheaper kind;
	// without a model every post is prepared.
	cost   PostCost
	costed bool
	// fx is what the core asks the driver to do once it has handled an
	// input: the core calls no backend to start or end anything.
	fx effects
	// closing: the Worker closes (closeDown): nothing new is posted.
	closing bool
	// redriving: a failed handshake's outcome is being dealt out
	// (ownAttempt).
	redriving bool

	// Layer-wise push: layers in order, the layer index of each region,
	// regions sorted by base for address lookups.
	nLayers     int
	regionLayer []int
	byBase      []int
	layerMask   []bool
}

// xferState is what the core named for its driver: transfers in flight
// (handles), prepared lists, and the data plane's grants it changes
// through ops (guarded: the backend enforces them).
type xferState struct {
	handles map[XferID]*handle
	// abandoned are transfers given up while in flight, the driver
	// releasing them (effects.abandon); each still counts in its
	// request's handles, which reports once it is released.
	abandoned map[XferID]*handle
	nextXfer  XferID
	nextPrep  PrepID
	idxBuf    []hotpath.IndexPair
	// guarded: the backend enforces the Worker's grants, which the core
	// changes through ops (opGrant, opRevoke, opHold); nextGrant names
	// the last grant.
	guarded   bool
	nextGrant uint32
}

type regKey struct {
	engine, dreq string
	// moved is set on a group moved aside (supersede): "\x00" and the
	// transfer id it waited for; empty on every other key.
	moved string
}

// earlyNotes are pull completion notices for a request the producer does
// not hold yet; kept for RegistrationTTL.
type earlyNotes struct {
	at   time.Time
	msgs []*msg
	// bytes: what msgs cost (early: noticeCost; earlyAsks: askCost).
	bytes int
}

// maxEarly caps the requests with early notices kept at once.
const maxEarly = 1 << 14

// tomb remembers a finished D request: late registrations are dropped,
// and a cancel from a D rank whose WRITE landed is answered with the
// completion notice again (its first one may have been lost).
type tomb struct {
	at   time.Time
	done []int // D ranks our WRITEs completed into
	tid  string
	preq string
	// fail is why the request failed (empty: done): a D rank that
	// registers only now is told it, instead of waiting for its timeout.
	fail     string
	failKind FailureKind
}

// names reports whether a D rank's message (a registration, a cancel)
// is about the request the tombstone remembers, not a new request of
// its engine under the same id (an id used again once its request
// finished): by transfer id where both have one, else by the producer
// request where both name one, else (nothing tells them apart) yes. A
// consumer may name the producer's request by its base id (pairOf): that
// name is about every request of its base, the remembered one among them
// (namesTransfer, the consumer's rule for the producer's messages).
// (Compared as two requests, the late registration of a rank whose pair
// had ended was taken as a new request's and paired by base with the
// next producer request of that base: its KV written into that rank's
// blocks while the rank, told the pair failed, handed them back.)
func (tb tomb) names(transferID, preq string) bool {
	return namesTransfer(tb.tid, tb.preq, transferID, preq)
}

// regGroup collects the registrations of one D request from its ranks.
type regGroup struct {
	key     regKey
	tid     string
	preq    string
	addr    string
	dTP     int
	ranks   map[int]*msg
	arrived time.Time
	// until: the earliest of its registrations' limits (msg.Until).
	until time.Time
	// gaveUp: not a registration but the consumer's give-up (a cancel
	// before it registered), waiting to fail its producer request when
	// that arrives; why it gave up.
	gaveUp string
	// gaveUpKind: the failure kind the give-up fails its producer
	// request with (FailureNone: FailureCancelled).
	gaveUpKind FailureKind
	// ids: the block ids of the registrations in ranks (counted in
	// loopState.regIDs while the group waits in regs).
	ids int
}

// rank states of one D rank of a matched producer request.
type rankState uint8

const (
	rkWaiting   rankState = iota // no registration from it yet
	rkReady                      // registered, not posted
	rkPosted                     // WRITE in flight
	rkDone                       // bytes landed (or nothing to move)
	rkReleased                   // D needs nothing
	rkFailed                     // WRITE failed or was refused
	rkCancelled                  // D cancelled before anything was posted
)

func (s rankState) settled() bool { return s >= rkDone }

type dRank struct {
	state    rankState
	reg      *msg
	since    time.Time // when it registered (rkReady)
	inflight int       // WRITEs in flight into this rank
	posted   []bool    // layer-wise: layers posted, by layer index
	reason   string    // why it failed (set while WRITEs still drain)
	kind     FailureKind
	ackOwed  bool // D cancelled while a WRITE was in flight
	quiet    bool // its failure is one of many logged once (a refused peer)
}

type sendReq struct {
	req      SendReq
	deadline time.Time
	expired  bool
	aborted  bool
	done     bool
	// prefill: layer-wise, known from the prefill step, not finished yet.
	prefill bool
	step    uint64 // layer-wise: the step it prefilled in
	saved   []bool // layer-wise: layers the engine reported saved
	// preempted: layer-wise, its engine preempted it after its prefill
	// step (StepMeta.Preempted): its blocks are freed, nothing more is
	// written from them; retaken: its blocks are known again (a new
	// Prefill entry, or its SendReq). Once nothing of the first attempt
	// is in flight, every layer is written again (retake).
	preempted, retaken bool

	// push: the matched D request.
	match *regGroup
	// again: registrations from its D ranks that came after the rank's
	// part may have ended at the consumer (onReg), at most one per rank,
	// handled once it ends (replayRegs).
	again  []*msg
	expect []int
	ranks  map[int]*dRank

	// doom: why a request still prefilling (layer-wise) fails when its
	// engine finishes it (its pairing was refused, or its consumer gave
	// up); it pairs with nothing meanwhile (done).
	doom     string
	doomKind FailureKind

	// failReason is why the request failed, once it did (push).
	failReason string
	failKind   FailureKind

	// pull: the consumer ranks that reported, by engine and TP size
	// (pullNote: "" for done, else why it failed); pullEnded: one
	// engine's ranks all did (the outcome is pullFail's: its first
	// failure, "" for done).
	pullSeen  map[pullRank]pullNote
	pullEnded bool
	pullFail  string
	pullKind  FailureKind
	// hbBy and hbAt: the consumer rank whose heartbeat last named it,
	// and when (pull; what a close that waits for it logs).
	hbBy pullRank
	hbAt time.Time

	// prevBase and nextBase are the requests of the same base id before
	// and after this one (sendBase), while inBase (a request with a
	// transfer id is matched by it alone, so only those without one are
	// listed by base id); byTID: the request is
	// sendByTID's for its transfer id. They let forgetSend unindex it
	// without looking it up.
	prevBase, nextBase *sendReq
	inBase, byTID      bool
	// hID and hTID: the request's ids hashed for sends and sendByTID.
	hID, hTID uint64
	// dead: forgotten; the record is cleared and reused once the input
	// that forgot it is handled (recycleSends).
	dead bool
	// next: a new request under this one's id, handed over while this
	// one, aborted, waits for its WRITEs in flight (a layer-wise producer
	// its engine preempted and prefilled again, or an id reused). It is
	// held once this one is forgotten; meanwhile an abort ends it.
	next *pendingSend
}

// pendingSend is a producer request waiting for an aborted one under its
// id to drain (sendReq.next).
type pendingSend struct {
	req      SendReq
	deadline time.Time
	prefill  bool
	step     uint64
}

type recvReq struct {
	req      RecvReq
	deadline time.Time
	// own: its deadline from its engine (zero: none); deadline is it, or
	// earlier once its READs are bounded by the producer's hold (bound).
	own   time.Time
	bound bool
	// holds: the deadlines producer ranks answered its heartbeats with
	// (msgHold), on the producer's clock.
	holds   []rankHold
	since   time.Time // when it came in
	targets []rankRef
	sent    bool // registrations or reads issued
	got     rankSet
	fenced  rankSet
	handles map[XferID]rankRef // pull: READs in flight (nil until one is)
	// gotBuf and fencedBuf hold got and fenced while they are small.
	gotBuf, fencedBuf [rankSetLen]rankRef
	decided           bool
	outcome           Outcome
	fenceBy           time.Time
	canceled          bool
	// failedRank: a producer rank reported a failure (its bytes are
	// missing for good).
	failedRank bool
	// quiet: its failure is one of many logged once (a refused peer).
	quiet bool
	// grant lets the producer ranks WRITE into its blocks (push).
	grant uint32
	// retries and retryAt: READs refused for want of a grant (pull), by
	// producer rank: how many times, and when the next goes.
	retries map[rankRef]int
	retryAt map[rankRef]time.Time
	// giveUpAt: when its READs in flight are given up (tGiveUp; zero:
	// not armed).
	giveUpAt time.Time
	// rehandshook: it was restarted once after a new handshake;
	// rehandshookFrom: the producer's generation it had been sent under.
	rehandshook     bool
	rehandshookFrom uint64
	// knewGen: the producer's generation this rank had loaded when the
	// request came in, from the address its params name (0: none). Its
	// params, when they carry no generation, were issued by that one or
	// an earlier one, as far as this rank can tell.
	knewGen uint64
	// hbFailing: the producer ranks our heartbeats for it did not reach
	// last; hbFailSince: since when one has not (heartbeatSent).
	hbFailing   []rankRef
	hbFailSince time.Time
	// regErrs and regWait: the registration notices' results by target,
	// and how many are still to come (the driver reports them before
	// any other input).
	regErrs []error
	regWait int
	// exited: producer ranks (push) whose agent's process was seen to
	// exit (ErrPeerExited): fenced without their confirmation once the
	// exit grace passes (writerExited); exitWhy says why, for the report.
	exited  rankSet
	exitWhy string
	// hc: its hold check (holdcheck.go; nil: none asked).
	hc *holdCheck
	// elsewhere: it failed as naming its producer engine at an address
	// another engine of that id answers at now (engineAt): its end tells
	// no rank of the engine known here. notRead: it failed by the
	// generation rules before it read anything: its params may be another
	// generation's, so its notices name their blocks (notice), and a
	// producer ends only a request it holds in exactly those.
	elsewhere, notRead bool
	// asked: the producer agents this rank asked to hold the request
	// (pull: heartbeats and hold checks extend their hold), and whether
	// each has been told of its end since (released.go); askedBuf holds
	// them while they are few.
	asked    []askedAgent
	askedBuf [2]askedAgent
}

type rankRef struct{ pp, tp int }

// rankSet is a set of producer ranks: a request has a few, so a list
// searched in order, kept in the request's own storage up to rankSetLen.
type rankSet []rankRef

const rankSetLen = 4

func (s rankSet) has(t rankRef) bool {
	for _, x := range s {
		if x == t {
			return true
		}
	}
	return false
}

// add returns s with t in it.
func (s rankSet) add(t rankRef) rankSet {
	if s.has(t) {
		return s
	}
	return append(s, t)
}

type handle struct {
	id     XferID
	posted time.Time
	bytes  int64
	descs  int
	blocks int
	// producer side
	send string
	dtp  int
	// consumer side
	recv string
	src  rankRef
	// giveUp: a pull READ its request gave up while it was in flight
	// (abandonReads): once it is released, its producer rank is told,
	// so that it lets its blocks go then and not before.
	giveUp bool
}

// coreConfig is what the core reads of its Worker's configuration
// (WorkerConfig, defaults applied): nothing that reaches a backend, a
// resolver or user code.
type coreConfig struct {
	EngineID, Addr, CompatHash string
	Mode                       Mode
	Layout                     topology.Layout
	Layerwise, SkipCompatCheck bool
	// LayerOf: WorkerConfig.LayerOf of each region, computed at start.
	LayerOf []int

	Lease, RegistrationTTL, EngineTTL, HandshakeTimeout, PeerTimeout, FenceTimeout, PollInterval time.Duration

	MaxRequests, MaxSegments int
}

func newCoreConfig(c *WorkerConfig) *coreConfig {
	cc := &coreConfig{EngineID: c.EngineID, Addr: c.Addr, CompatHash: c.CompatHash, Mode: c.Mode, Layout: c.Layout,
		Layerwise: c.Layerwise, SkipCompatCheck: c.SkipCompatCheck,
		Lease: c.Lease, RegistrationTTL: c.RegistrationTTL, EngineTTL: c.EngineTTL, HandshakeTimeout: c.HandshakeTimeout,
		PeerTimeout: c.PeerTimeout, FenceTimeout: c.FenceTimeout, PollInterval: c.PollInterval,
		MaxRequests: c.MaxRequests, MaxSegments: c.MaxSegments}
	for i := range c.Layout.Regions {
		cc.LayerOf = append(cc.LayerOf, c.LayerOf(i))
	}
	return cc
}

// init readies the core of w: the only place it sees its Worker.
func (st *loopState) init(w *Worker) {
	st.cfg = newCoreConfig(&w.cfg)
	st.layout = &st.cfg.Layout
	st.metrics, st.log, st.builder, st.registry = w.metrics, w.log, w.builder, w.registry
	st.guarded = w.access != nil
	st.engines = map[string]*engine{}
	st.sends = newSendTable(false)
	st.sendByTID = newSendTable(true)
	st.sendBase = map[string]*sendReq{}
	st.regs = map[regKey]*regGroup{}
	st.regByTID = map[string][]regKey{}
	st.regByBase = map[string][]regKey{}
	st.matched = map[regKey]*sendReq{}
	st.tombs = map[regKey]tomb{}
	st.early = map[string]*earlyNotes{}
	st.earlyAsks = map[string]*earlyNotes{}
	st.recvs = map[string]*recvReq{}
	st.waits = map[string]*waitReq{}
	st.handles = map[XferID]*handle{}
	st.abandoned = map[XferID]*handle{}
	st.layerSteps = map[uint64][]string{}
	layers := map[int]int{}
	var order []int
	for i := range st.layout.Regions {
		l := st.cfg.LayerOf[i]
		if _, ok := layers[l]; !ok {
			layers[l] = 0
			order = append(order, l)
		}
	}
	slices.Sort(order)
	for i, l := range order {
		layers[l] = i
	}
	st.nLayers = len(order)
	for i := range st.layout.Regions {
		st.regionLayer = append(st.regionLayer, layers[st.cfg.LayerOf[i]])
		st.byBase = append(st.byBase, i)
	}
	slices.SortFunc(st.byBase, func(a, b int) int {
		return cmpU64(st.layout.Regions[a].Base, st.layout.Regions[b].Base)
	})
	st.layerMask = make([]bool, st.nLayers)
}

func cmpU64(a, b uint64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// layerIndexOf returns the layer index of the local region holding addr.
func (st *loopState) layerIndexOf(addr uint64) int {
	regs := st.layout.Regions
	i, _ := slices.BinarySearchFunc(st.byBase, addr, func(r int, a uint64) int {
		if regs[r].Base > a {
			return 1
		}
		return -1
	})
	// i is the first region whose base is above addr.
	return st.regionLayer[st.byBase[max(i-1, 0)]]
}

// self fills the sender fields of a message.
func (st *loopState) self(m *msg) *msg {
	l := st.layout
	m.Engine, m.Addr = st.cfg.EngineID, st.cfg.Addr
	m.TPRank, m.TPSize, m.PPRank, m.PPSize = l.TPRank, l.TPSize, l.PPRank, l.PPSize
	return m
}

func (st *loopState) handle(e *event) {
	switch e.kind {
	case evStep:
		st.step(e.meta)
		for i := range e.bad {
			st.rejectEntry(&e.bad[i])
		}
	case evLayer:
		st.layerSaved(e.step, e.layer)
	case evHandshake:
		st.handshakeDone(e.hs)
	case evInspect:
		e.fn(st)
	}
}

// rebase moves a scheduler-clock deadline onto our clock (SPEC §9).
func rebase(d, clock time.Time, now time.Time) time.Time {
	if d.IsZero() {
		return d
	}
	if clock.IsZero() {
		return d
	}
	return now.Add(d.Sub(clock))
}

func (st *loopState) step(meta *StepMeta) {
	now := st.now
	// NotProcessed ends requests held before this step; Prefill and Send
	// are this step's. A request id in both is an earlier request that
	// ended and a new one under its id (a layer-wise producer its engine
	// preempted after its prefill and prefilled again, or an id reused):
	// the new one is held (the Scheduler never lists a prefill whose
	// request finished after it was staged: it drops the entry).
	for _, id := range meta.NotProcessed {
		st.producerAborted(id, meta.NotProcessedTransferIDs[id])
	}
	for _, id := range meta.Preempted {
		st.producerPreempted(id)
	}
	for i := range meta.Prefill {
		st.newPrefill(&meta.Prefill[i], meta.Step)
	}
	for i := range meta.Send {
		if !st.overLimit(RoleProducer, meta.Send[i].ReqID, "", nil) {
			st.newSend(&meta.Send[i], rebase(meta.Send[i].Deadline, meta.SchedulerClock, now))
		}
	}
	for _, id := range meta.AwaitEnd {
		// Told of its end after this step's receives: one of them may be
		// its own (an empty receive releases its producer itself).
		if w := st.waits[id]; w != nil {
			delete(st.waits, id)
			if w.untold() {
				st.endedWaits = append(st.endedWaits, w)
			}
		}
	}
	for i := range meta.Await {
		st.newWait(&meta.Await[i])
	}
	for i := range meta.Recv {
		if !st.overLimit(RoleConsumer, meta.Recv[i].ReqID, meta.Recv[i].Remote.EngineID, meta.Recv[i].Local) {
			st.newRecv(&meta.Recv[i], rebase(meta.Recv[i].Deadline, meta.SchedulerClock, now))
		}
	}
	for _, w := range st.endedWaits {
		st.releaseWait(w, FailureCancelled, "the consumer request ended while it waited in its engine's queue")
	}
	clear(st.endedWaits)
	st.endedWaits = st.endedWaits[:0]
}

// DefaultMaxRequests is WorkerConfig.MaxRequests' default: requests held
// at once per rank and side.
const DefaultMaxRequests = 1 << 16

// maxEngines bounds the peer engines a rank knows at once; a consumer
// request naming one more fails (idle engines leave after EngineTTL).
const maxEngines = 1 << 12

// overLimit fails a new request at once when the rank already holds
// WorkerConfig.MaxRequests on its side, or, for a consumer, when it names
// a producer engine past the bound on peer engines (maxEngines). One the
// rank holds already (a duplicate, a layer-wise request's finish) passes,
// to be handled as such.
//
// Below the bounds, as almost always, it looks nothing up: the request's
// own handling does.
func (st *loopState) overLimit(role Role, id, remote string, local []topology.Span) bool {
	held, field := st.sends.len(), "send_req.limit"
	if role == RoleConsumer {
		held, field = len(st.recvs), "recv_req.limit"
	}
	limit := st.cfg.MaxRequests
	full := limit >= 0 && held >= limit && (role == RoleProducer || len(local) > 0) // an empty list holds nothing
	if !full && (role == RoleProducer || len(st.engines) < maxEngines) {
		return false
	}
	newEngine := role == RoleConsumer && len(st.engines) >= maxEngines && st.engines[remote] == nil
	if !newEngine && !full {
		return false
	}
	if role == RoleProducer && st.sends.get(id) != nil || role == RoleConsumer && st.recvs[id] != nil {
		return false // a duplicate, handled as such
	}
	if newEngine {
		// A producer engine past the bound on peer engines known: the
		// engine names them, each a handshake and an entry kept until
		// EngineTTL.
		st.refuse(role, id, local, "recv_req.remote.engine_id.limit", FailureHandshake,
			fmt.Sprintf("producer engine %q would be the rank's peer engine number %d, past its limit %d", remote, len(st.engines)+1, maxEngines))
		return true
	}
	st.refuse(role, id, local, field, FailureSetup,
		fmt.Sprintf("the rank holds %d %s requests, its limit (WorkerConfig.MaxRequests, kvxferd -max-requests)", held, role))
	return true
}

// refuse fails a request the rank does not take in, counting field; a
// consumer's blocks are reported invalid, as for any failure.
func (st *loopState) refuse(role Role, id string, local []topology.Span, field string, kind FailureKind, why string) {
	st.metrics.BadInput(field)
	st.failUntaken(role, id, local, kind, why)
}

// failUntaken reports the one outcome of a request the rank never took in:
// failed; a consumer's blocks are reported invalid, as for any failure.
func (st *loopState) failUntaken(role Role, id string, local []topology.Span, kind FailureKind, why string) {
	if role == RoleConsumer {
		st.out.InvalidBlocks = append(st.out.InvalidBlocks, group0(local)...)
	}
	st.report(role, Outcome{ReqID: id, Result: ResultFailed, Kind: kind, Reason: why})
}

// rejectEntry fails the request of a step entry Worker.Step refused (and
// counted), after the step's good entries. An entry that names no request
// has nothing to fail, and a layer-wise prefill entry leaves its request
// to its SendReq; a malformed entry for a request the rank holds on that
// side (a duplicate) does not end that request: the outcome is the held
// request's to give. Step's error reports all three.
func (st *loopState) rejectEntry(b *rejected) {
	if b.id == "" || b.role == 0 {
		return
	}
	if b.role == RoleProducer {
		if s := st.sends.get(b.id); s != nil && s.prefill && !s.aborted {
			// Its finish (a layer-wise request holds no lease while it
			// prefills: its finish or abort ends it). The engine hears
			// the entry was refused, waits for its outcome (a failure,
			// as for any refused entry) and frees the blocks. Dropped,
			// it prefilled for ever and the engine held its blocks
			// waiting for an outcome that never came.
			st.log.Warn("kvxfer: malformed finish of a layer-wise request prefilling: it fails", "req", b.id, "why", b.reason)
			st.failPrefilling(s, b.reason)
			return
		}
	}
	if b.role == RoleProducer && st.sends.get(b.id) != nil || b.role == RoleConsumer && st.recvs[b.id] != nil {
		st.log.Warn("kvxfer: malformed step entry for a request the rank holds: dropped", "req", b.id, "role", b.role, "why", b.reason)
		return
	}
	st.failUntaken(b.role, b.id, b.local, FailureSetup, b.reason)
}

// failPrefilling ends a layer-wise producer held prefilling whose finish
// will not come (refused, or in a step dropped): nothing more is written
// from its blocks, its consumer is told it failed, and it fails
// (FailureSetup, why, unless its pairing failed first: that reason) once
// its WRITEs in flight end; unpaired and doomed, at once.
func (st *loopState) failPrefilling(s *sendReq, why string) {
	kind := FailureSetup
	if s.doom != "" {
		why, kind = s.doom, s.doomKind
	}
	if s.done {
		// Doomed, unpaired: it fails now.
		s.prefill = false
		st.failUnmatched(s, kind, why)
		return
	}
	s.aborted, s.prefill = true, false
	s.failReason, s.failKind = why, kind
	st.settleSend(s)
}

// stepDropped ends each layer-wise producer of ids the rank holds
// prefilling (Worker.StepDropped) and returns the ids of those it holds
// whose outcome is the engine's news (dst appended, each once): the ones
// it ends here as the others (ownsOutcome).
func (st *loopState) stepDropped(dst, ids []string, why string) []string {
	seen := make(map[string]bool, len(ids))
	for _, id := range ids {
		s := st.sends.get(id)
		if s == nil || seen[id] || !s.ownsOutcome() {
			continue
		}
		seen[id] = true
		if s.prefill && !s.aborted {
			st.log.Warn("kvxfer: a layer-wise request prefilling named by a dropped step: it fails", "req", id, "why", why)
			st.failPrefilling(s, why)
		}
		dst = append(dst, id)
	}
	return dst
}

// ownsOutcome reports whether the outcome s will give is that of the
// request its engine holds under its id: not so for one its engine aborted
// (ResultAborted, which the engine takes for no request of its own: it
// freed that one) unless a new request under its id waits for it (next),
// whose outcome comes too.
func (s *sendReq) ownsOutcome() bool {
	return !s.aborted || s.failReason != "" || s.next != nil
}

// report queues one terminal outcome.
func (st *loopState) report(role Role, o Outcome) {
	if invariants.Enabled && (o.Result == ResultFailed || o.Result == ResultExpired) && o.Kind == FailureNone {
		panic(fmt.Sprintf("kvxfer: %v outcome of %s without a failure kind: %q", o.Result, o.ReqID, o.Reason))
	}
	st.metrics.Outcome(role, o.Result, o.Kind)
	if role == RoleProducer {
		st.out.Sending = append(st.out.Sending, o)
	} else {
		st.out.Recving = append(st.out.Recving, o)
		// A request waiting (StepMeta.Await) whose receive ended untaken
		// (refused past a bound, a malformed entry) is heartbeaten no
		// more: its engine is done with the receive (no AwaitEnd comes:
		// the receive was to take over). Before, the wait outlived it:
		// each heartbeat extended P's hold and P's answer the wait's
		// estimate of it, so P held the blocks as long as this rank lived.
		// The agents its heartbeats reached are told.
		kind, reason := o.Kind, o.Reason
		if o.Result == ResultDone || kind == FailureNone {
			kind, reason = FailurePeerGone, "the consumer request ended without reading from this agent"
		}
		st.endWait(o.ReqID, kind, reason)
	}
}

// notify sends a bare message; a failure is counted and logged.
func (st *loopState) notify(peer PeerName, m *msg) {
	st.notifyOp(peer, appendMsg(nil, st.self(m)), noticePlain, "", 0, m)
}

// onNotifs handles peer messages that arrived.
func (st *loopState) onNotifs(notifs []Notif) {
	for _, n := range notifs {
		m, err := decodeMsg(n.Msg)
		if err != nil {
			st.metrics.Dropped("malformed")
			st.log.Warn("kvxfer: dropped a peer message", "from", n.From, "err", err)
			continue
		}
		m.from = PeerName(n.From)
		if !st.admit(parkedMsg{from: m.from, m: m}) {
			continue
		}
		st.dispatch(m)
	}
}

// dispatch handles one admitted peer message.
func (st *loopState) dispatch(m *msg) {
	if e := st.engines[m.Engine]; e != nil {
		e.lastActive = st.now
		e.spoke(rankRef{tp: m.TPRank, pp: m.PPRank}, st.now)
	}
	switch m.Kind {
	case msgReg:
		st.onReg(m)
	case msgDone:
		if st.cfg.Mode == ModePush {
			st.onPushDone(m)
		} else {
			st.onPullDone(m, "", FailureNone)
		}
	case msgFail:
		if st.cfg.Mode == ModePush {
			st.onPushFail(m)
		} else {
			st.onPullDone(m, m.Reason, m.failKind())
		}
	case msgHeartbeat:
		st.onHeartbeat(m)
	case msgHold:
		st.onHold(m)
	case msgCancel:
		if st.cfg.Mode == ModePull {
			// A cancel is push's (a pull consumer gives up with a
			// failure notice). One that comes anyway (a push consumer
			// refused at its handshake by a pull producer: the modes
			// differ) is that consumer rank's failure notice, under the
			// rules of any (onPullDone: from a rank that reads from ours,
			// counted with its consumer request's other ranks). Before,
			// it was push's give-up: the request failed at once, and its
			// blocks were let go, whichever rank sent it and whoever
			// still read them.
			st.metrics.BadInput("cancel.mode")
			st.onPullDone(m, "consumer cancelled: "+m.Reason, FailureCancelled)
			return
		}
		st.onCancel(m)
	case msgAck:
		st.onAck(m)
	case msgTag:
		// A layer's WRITE landed; the request's completion follows the
		// last one.
	}
}

// xferEnded handles the end of an in-flight transfer the driver saw
// leave XferInProgress (tm: the backend's own figures, when it keeps
// them). The driver releases it.
func (st *loopState) xferEnded(id XferID, s XferState, err error, tm *XferTelemetry, post time.Duration) {
	h := st.handles[id]
	if h == nil {
		return
	}
	delete(st.handles, id)
	ok := s == XferDone && err == nil
	xfer := st.now.Sub(h.posted)
	if tm != nil && ok && tm.Transfer > 0 {
		xfer, post = tm.Transfer, tm.Post
		if h.bytes == 0 {
			h.bytes = int64(tm.Bytes)
		}
	}
	if ok {
		st.metrics.Transfer(xfer, post, h.bytes, h.descs, h.blocks)
	} else {
		if err == nil {
			err = fmt.Errorf("%w: state %v", ErrXferFailed, s)
		}
		if h.send != "" || !errors.Is(err, ErrNotGranted) {
			st.metrics.FailedTransfer() // a refused READ: recvSettled counts it if not retried
		}
	}
	if h.send != "" {
		st.sendSettled(h, ok, err)
	} else {
		st.recvSettled(h, ok, err)
	}
}

// effects are what the core asks its driver to do after an input: the
// core starts, ends and waits for nothing itself.
//
// The driver carries out ops in order and hands their results back
// (opsDone) before it gives the core any other input, so a continuation
// runs as if the call had returned in place; until then, what an op
// started counts as in flight (a post's transfer, a completion notice).
type effects struct {
	// ops are posts, notifications and list preparations, in order.
	ops []op
	// descs and pairs hold the ops' descriptors and index pairs
	// (op.from:op.to), reused from input to input.
	descs []hotpath.Desc
	pairs []hotpath.IndexPair
	// lays holds the layout posts' layouts (op.from:op.to of its Spans).
	lays hotpath.Layouts
	// asks are handshakes and probes to run; each answer comes back as
	// an evHandshake event.
	asks []hsAsk
	// releases are transfers to release at once, their requests ended
	// (the Worker closes).
	releases []XferID
	// abandon are transfers in flight whose requests no longer want them
	// (their producer is gone): the driver releases each, which may take
	// long (a backend waits for bytes still moving, up to its bound), and
	// hands back inReleased once it has; their requests report then, and
	// nothing else waits meanwhile.
	abandon []XferID
	// invalidate are peers to forget (an evicted engine's agents).
	invalidate []PeerName
	// unprepare are prepared descriptor lists to release.
	unprepare []PrepID
}

// runTimers fires due deadlines and the periodic tick.
func (st *loopState) runTimers() {
	now := st.now
	for len(st.timers) > 0 && !st.timers[0].at.After(now) {
		e := st.timers.pop()
		switch e.kind {
		case tLease:
			st.leaseTimer(e)
		case tRecvDeadline:
			st.recvDeadline(e)
		case tFence:
			st.fenceTimer(e)
		case tReadRetry:
			st.readRetry(e)
		case tGiveUp:
			st.abandonReads(e)
		case tProbe:
			st.probeTimer(e)
		case tRehandshake:
			st.rehandshake(e)
		case tHoldCheck:
			st.holdCheckTimer(e)
		}
	}
	if st.busy() {
		if !st.ticking {
			st.ticking = true
			st.nextTick = now.Add(st.cfg.Lease / 6)
		} else if !now.Before(st.nextTick) {
			st.tick(now)
			st.nextTick = now.Add(st.cfg.Lease / 6)
		}
	} else {
		if st.ticking {
			st.evictEngines(now) // going idle: note when engines fall due
		}
		st.ticking = false
	}
	if !st.nextEvict.IsZero() && !now.Before(st.nextEvict) {
		st.evictEngines(now)
	}
}

// busy reports whether periodic work (heartbeats, resends, sweeps) is due.
func (st *loopState) busy() bool {
	return len(st.recvs) > 0 || len(st.waits) > 0 || len(st.regs) > 0 || len(st.tombs) > 0 || st.sends.len() > 0 || st.abortedP.len() > 0 || st.abortedT.len() > 0 || len(st.early) > 0 || len(st.earlyAsks) > 0 ||
		len(st.lost) > 0
}

// nextWake is when the loop must run again without other input.
func (st *loopState) nextWake() (time.Time, bool) {
	var at time.Time
	ok := false
	set := func(t time.Time) {
		if !ok || t.Before(at) {
			at, ok = t, true
		}
	}
	if len(st.handles) > 0 {
		set(st.now.Add(st.cfg.PollInterval))
	}
	for len(st.timers) > 0 && !st.timerLive(st.timers[0]) {
		st.timers.pop()
	}
	if n := len(st.timers); n > 64 && n > 4*(st.sends.len()+2*len(st.recvs)) {
		live := st.timers[:0]
		for _, t := range st.timers {
			if st.timerLive(t) {
				live = append(live, t)
			}
		}
		st.timers = live
		heap.Init(&st.timers)
	}
	if len(st.timers) > 0 {
		set(st.timers[0].at)
	}
	if st.ticking {
		set(st.nextTick)
	}
	if !st.nextEvict.IsZero() {
		set(st.nextEvict)
	}
	return at, ok
}

// tick sends heartbeats, resends cancels and sweeps stale state.
func (st *loopState) tick(now time.Time) {
	st.resendLost()
	st.failUnheard()
	st.sendHeartbeats()
	if len(st.recvs) > 0 { // a producer's tick allocates nothing
		for _, id := range slices.Sorted(maps.Keys(st.recvs)) {
			r := st.recvs[id]
			if r.decided && r.canceled {
				st.sendCancels(r)
			}
		}
	}
	for k, g := range st.regs {
		if now.Sub(g.arrived) > st.cfg.RegistrationTTL {
			st.dropReg(k)
			if g.gaveUp == "" {
				st.metrics.Dropped("registration_expired")
			}
		}
	}
	for k, t := range st.tombs {
		if now.Sub(t.at) > st.cfg.RegistrationTTL {
			delete(st.tombs, k)
		}
	}
	st.ended.sweep(now, st.cfg.RegistrationTTL)
	st.endedPaired.sweep(now, st.cfg.RegistrationTTL)
	st.abortedP.sweep(now, st.cfg.RegistrationTTL)
	st.abortedT.sweep(now, st.cfg.RegistrationTTL)
	for k, e := range st.earlyAsks {
		if now.Sub(e.at) > 2*holdCheckBound() { // (its asker gave up)
			st.forgetAsks(k, e)
		}
	}
	for k, e := range st.early {
		if now.Sub(e.at) > st.cfg.RegistrationTTL {
			st.forgetEarly(k, e)
			st.metrics.Dropped("done_unknown_request")
			st.log.Warn("kvxfer: completion for an unknown request; its blocks may have expired", "key", k)
		}
	}
	st.evictEngines(now)
}

// shutdown fails every request still open and abandons transfers.
// closeDown ends every request as the Worker closes, fencing what moves
// bytes: a producer request with WRITEs in flight (they read the engine's
// blocks) tells its consumer ranks and reports once they ended; a pull
// consumer with READs in flight (they land in its blocks) reports once
// they ended; a push consumer that registered cancels, and without the
// data plane's grants waits for its producers to confirm, as after any
// failure (with grants, revoking them suffices); a pull producer request
// reports once its consumers said they read it (or gave up), its lease
// lapses, or the fence times out. The rest report at once.
// What still waits when the close's fence times out is abandoned
// (shutdown).
func (st *loopState) closeDown() {
	st.closing = true
	const why = "worker closed"
	st.endWaits(FailureClosed, why) // (not heartbeaten through the close)
	for _, id := range st.sendIDs() {
		s := st.sends.get(id)
		if s.next != nil {
			// The new request waiting for the aborted one under its id
			// to drain fails now; the aborted one ends as aborted once
			// its WRITEs end, or at the fence's timeout (shutdown).
			s.next = nil
			st.report(RoleProducer, Outcome{ReqID: id, Result: ResultFailed, Kind: FailureClosed, Reason: why})
		}
		inflight := false
		for _, r := range s.ranks {
			inflight = inflight || r.inflight > 0
		}
		if s.match != nil {
			for _, tp := range s.expect {
				switch r := s.ranks[tp]; {
				case r.inflight > 0:
					// It fails when its WRITEs end (sendSettled), posting
					// nothing more (layer-wise).
					r.reason, r.kind = why, FailureClosed
				case !r.state.settled():
					r.state, r.reason, r.kind = rkFailed, why, FailureClosed
					st.tellD(s, tp, &msg{Kind: msgFail, Reason: why, FailKind: FailureClosed})
				}
			}
		}
		if inflight {
			s.prefill = false
			continue // settleSend reports it once its WRITEs ended
		}
		if st.cfg.Mode == ModePull {
			// Its consumers may be reading its blocks: it reports once
			// they said their READs ended (onPullDone), or its lease
			// lapsed, or the close's fence timed out (shutdown), so that
			// its blocks go back to the engine, and the backend's agent
			// goes, only then; meanwhile its consumers get their bytes.
			continue
		}
		s.done = true
		st.report(RoleProducer, Outcome{ReqID: id, Result: ResultFailed, Kind: FailureClosed, Reason: why})
		st.forgetSend(s)
	}
	for _, id := range slices.Sorted(maps.Keys(st.recvs)) {
		r := st.recvs[id]
		st.decide(r, ResultFailed, FailureClosed, why)
		if st.guarded && st.cfg.Mode == ModePush {
			st.revoke(r) // no WRITE lands once this returns
			for _, t := range r.targets {
				r.fenced = r.fenced.add(t)
			}
		}
		st.tryReport(r)
	}
}

// closeWaits reports whether a closing Worker still waits for transfers
// or confirmations.
func (st *loopState) closeWaits() bool {
	return len(st.handles) > 0 || len(st.abandoned) > 0 || len(st.recvs) > 0 || st.sends.len() > 0
}

// logCloseWaits logs (Warn) what a closing Worker still waits for, since
// when (timedOut: its fence timed out, and it abandons it), as logWaits.
func (st *loopState) logCloseWaits(now, began time.Time, timedOut bool) {
	what := "kvxfer: a closing worker still waits"
	if timedOut {
		what = "kvxfer: a closing worker's fence timed out; it abandons what it waited for"
	}
	st.logWaits(what, now, began)
}

// logWaits logs (Warn, as what) what the Worker holds, which one that
// waits for it to end them has waited for since began (a closing Worker;
// a daemon's drain, Worker.LogWaits): each producer request held (its
// lease's end, the consumer ranks that reported, the last one whose
// heartbeat extended it), each consumer request open and the transfers in
// flight, after args (slog's). An operator whose engine cannot attach
// again until the close ends, or whose daemon's shutdown waits, sees which
// requests and consumer engines hold it.
func (st *loopState) logWaits(what string, now, began time.Time, args ...any) {
	const most = 16 // requests named (the count says how many more)
	var sends, recvs []string
	for _, id := range st.sendIDs() {
		if len(sends) == most {
			break
		}
		s := st.sends.get(id)
		d := fmt.Sprintf("%s (transfer %q", id, s.req.TransferID)
		if !s.deadline.IsZero() {
			d += fmt.Sprintf(", lease ends in %v", s.deadline.Sub(now).Round(time.Millisecond))
		}
		if !s.hbAt.IsZero() {
			b := s.hbBy
			d += fmt.Sprintf(", last heartbeat %v ago, of engine %q request %q rank %d/%d", now.Sub(s.hbAt).Round(time.Millisecond), b.engine, b.dreq, b.tp, b.tpSize)
		}
		if len(s.pullSeen) > 0 {
			var seen []string
			for k, n := range s.pullSeen {
				r := "done"
				if n.fail != "" {
					r = "failed"
				}
				seen = append(seen, fmt.Sprintf("engine %q request %q rank %d/%d %s", k.engine, k.dreq, k.tp, k.tpSize, r))
			}
			slices.Sort(seen)
			d += ", reported: " + strings.Join(seen, "; ")
		} else if st.cfg.Mode == ModePull {
			if s.hbAt.IsZero() {
				d += ", no consumer heartbeat"
			}
			d += ", no consumer reported"
		}
		inflight := 0
		for _, r := range s.ranks {
			inflight += r.inflight
		}
		if inflight > 0 {
			d += fmt.Sprintf(", %d WRITEs in flight", inflight)
		}
		sends = append(sends, d+")")
	}
	for _, id := range slices.Sorted(maps.Keys(st.recvs)) {
		if len(recvs) == most {
			break
		}
		r := st.recvs[id]
		recvs = append(recvs, fmt.Sprintf("%s (producer engine %q request %q, %d READs in flight)", id, r.req.Remote.EngineID, r.req.Remote.ReqID, len(r.handles)))
	}
	st.log.Warn(what, append(args, "for", now.Sub(began).Round(time.Millisecond),
		"producer_requests", st.sends.len(), "held", sends, "consumer_requests", len(st.recvs), "open", recvs,
		"transfers", len(st.handles), "abandoned", len(st.abandoned))...)
}

func (st *loopState) shutdown() {
	for id := range st.handles {
		st.fx.releases = append(st.fx.releases, id)
	}
	clear(st.handles)
	clear(st.abandoned) // the driver waits for their releases before the outcomes go out
	for _, id := range st.sendIDs() {
		s := st.sends.get(id)
		for _, r := range s.ranks {
			r.inflight = 0 // abandoned above
		}
		o := Outcome{ReqID: id, Result: ResultFailed, Kind: FailureClosed, Reason: "worker closed"}
		if s.aborted {
			o = Outcome{ReqID: id, Result: ResultAborted, Reason: "producer aborted"} // its engine ended it
		}
		st.report(RoleProducer, o)
		st.forgetSend(s)
	}
	for _, id := range slices.Sorted(maps.Keys(st.recvs)) {
		r := st.recvs[id]
		st.out.InvalidBlocks = append(st.out.InvalidBlocks, group0(r.req.Local)...)
		st.report(RoleConsumer, Outcome{ReqID: id, Result: ResultFailed, Kind: FailureClosed, Reason: "worker closed"})
		st.revoke(r)
		delete(st.recvs, id)
	}
	for _, id := range sortedKeys(st.engines) {
		st.dropEngine(st.engines[id])
	}
}

// abandon ends every request once the core broke: a panic left its state
// midway through an input (WorkerConfig.ContainPanics), so it reads
// nothing but the request tables and out, and changes nothing but out.
// Each request the tables hold, and each one pending names (events the
// core may not have taken in: the rest of the inbox batch and the queue),
// gets one failed outcome with reason, unless it has one already (out
// holds outcomes reported before the panic, not yet published) or gets
// one from an earlier entry; a consumer's blocks are reported invalid. It
// tells no peer and starts nothing: the driver releases the transfers and
// deregisters the memory before the outcomes go out.
func (st *loopState) abandon(reason string, pending []event) {
	ended := [2]map[string]bool{{}, {}} // [producer, consumer]
	for _, o := range st.out.Sending {
		ended[0][o.ReqID] = true
	}
	for _, o := range st.out.Recving {
		ended[1][o.ReqID] = true
	}
	fail := func(role Role, id string, local []topology.Span) {
		side := 0
		if role == RoleConsumer {
			side = 1
		}
		if ended[side][id] {
			return
		}
		ended[side][id] = true
		if role == RoleConsumer {
			st.out.InvalidBlocks = append(st.out.InvalidBlocks, group0(local)...)
		}
		st.report(role, Outcome{ReqID: id, Result: ResultFailed, Kind: FailureClosed, Reason: reason})
	}
	var sends []*sendReq
	for s := range st.sends.all() {
		sends = append(sends, s)
	}
	slices.SortFunc(sends, func(a, b *sendReq) int { return strings.Compare(a.req.ReqID, b.req.ReqID) })
	for _, s := range sends {
		if s.next != nil && !ended[0][s.req.ReqID] {
			// An aborted request still draining, and a new one under its
			// id waiting for it (sendReq.next): the aborted one ends as
			// aborted, the new one fails as the others do.
			st.report(RoleProducer, Outcome{ReqID: s.req.ReqID, Result: ResultAborted, Reason: "producer aborted"})
		}
		fail(RoleProducer, s.req.ReqID, nil)
	}
	for _, id := range slices.Sorted(maps.Keys(st.recvs)) {
		fail(RoleConsumer, id, st.recvs[id].req.Local)
	}
	for i := range pending {
		m := pending[i].meta
		if pending[i].kind != evStep || m == nil {
			continue
		}
		if st.cfg.Layerwise && st.cfg.Mode == ModePush { // else the core ignores Prefill
			for j := range m.Prefill {
				fail(RoleProducer, m.Prefill[j].ReqID, nil)
			}
		}
		for j := range m.Send {
			fail(RoleProducer, m.Send[j].ReqID, nil)
		}
		for j := range m.Recv {
			fail(RoleConsumer, m.Recv[j].ReqID, m.Recv[j].Local)
		}
		// The entries Step refused: their one outcome was still to come
		// (rejectEntry).
		for j := range pending[i].bad {
			if b := &pending[i].bad[j]; b.id != "" && b.role != 0 {
				fail(b.role, b.id, b.local)
			}
		}
	}
}

func group0(spans []topology.Span) []topology.BlockID {
	if len(spans) == 0 {
		return nil
	}
	return spans[0].IDs
}

type opKind uint8

const (
	opNotify       opKind = iota + 1 // a bare notification
	opPost                           // a transfer of descs
	opPostPrepared                   // a transfer of index pairs of prepared lists
	opPostLayout                     // a transfer of layouts (LayoutPoster)
	opPrepare                        // a prepared descriptor list
	// The data plane's grants (WorkerConfig's backend Guarded), applied
	// in order with the other ops: a grant before the registration that
	// lets the producer WRITE, a revocation before anything that follows
	// it, and before the outcome it precedes is published.
	opGrant  // grant (core's name) lets peers WRITE into spans
	opRevoke // grant ends, once nothing admitted under it moves bytes
	opHold   // pull: delta holds on spans (a hold let go waits for READs)
)

// notice says what a notification's result means to the core.
type notice uint8

const (
	noticePlain          notice = iota // a failure is counted and logged
	noticeHeartbeat                    // heartbeatSent: a failure is retried once at once
	noticeHeartbeatRetry               // that retry
	noticeReg                          // a registration (recv req, target tp)
	noticeDone                         // a completion notice (send req, D rank tp)
	noticeResent                       // a lost failure notice sent again (tp: the sends so far)
)

// op is one call the core asks of the backend. Transfers and prepared
// lists are named by the core (id, prep, local, remote); the driver maps
// those names to the backend's.
type op struct {
	kind   opKind
	peer   PeerName
	msg    []byte // the notification; a post's notification after the bytes
	notice notice
	req    string  // noticeReg, noticeDone: the request's id; opGrant: the consumer request; opHold: the producer request
	tid    string  // opHold: the producer request's transfer id; opGrant: the consumer request's
	tp     int     // noticeReg: the target's index; noticeDone: the D rank
	m      *msg    // noticePlain: the message, for the log; heartbeats: the message
	ref    rankRef // heartbeats: the producer rank

	xop           hotpath.Op
	id            XferID // posts: the core's name for the transfer
	from, to      int    // posts: fx.descs[from:to], fx.pairs[from:to] or fx.lays.Spans[from:to]
	local, remote PrepID // opPostPrepared: the lists (core names)

	prep    PrepID          // opPrepare: the core's name for the list
	entries []hotpath.Entry // opPrepare: the list

	grant uint32          // opGrant, opRevoke: the core's name for the grant
	peers []PeerName      // opGrant: who may WRITE
	spans []topology.Span // opGrant, opHold: the blocks
	delta int32           // opHold
}

// grantOp asks for a WRITE grant to peers on spans, for consumer request
// req of transfer tid ("": none), and returns its name.
func (st *loopState) grantOp(peers []PeerName, spans []topology.Span, req, tid string) uint32 {
	st.nextGrant++
	if st.nextGrant == 0 {
		st.nextGrant++
	}
	st.fx.ops = append(st.fx.ops, op{kind: opGrant, grant: st.nextGrant, peers: peers, spans: spans, req: req, tid: tid})
	return st.nextGrant
}

// revokeOp ends a grant.
func (st *loopState) revokeOp(id uint32) {
	st.fx.ops = append(st.fx.ops, op{kind: opRevoke, grant: id})
}

// holdOp adds or lets go pull holds on spans for producer request req of
// transfer tid ("": none).
func (st *loopState) holdOp(spans []topology.Span, delta int32, req, tid string) {
	st.fx.ops = append(st.fx.ops, op{kind: opHold, spans: spans, delta: delta, req: req, tid: tid})
}

// notifyOp asks for a notification.
func (st *loopState) notifyOp(peer PeerName, b []byte, n notice, req string, tp int, m *msg) {
	st.fx.ops = append(st.fx.ops, op{kind: opNotify, peer: peer, msg: b, notice: n, req: req, tp: tp, m: m})
}

// postOp asks for a transfer of the descriptors built at fx.descs[from:]
// (built there in place: no copy) and returns the core's name for it.
func (st *loopState) postOp(xop hotpath.Op, peer PeerName, from int, notif []byte) XferID {
	st.nextXfer++
	st.fx.ops = append(st.fx.ops, op{kind: opPost, xop: xop, peer: peer, msg: notif, id: st.nextXfer, from: from, to: len(st.fx.descs)})
	return st.nextXfer
}

// postLayoutOp asks for a transfer of the layouts built at
// fx.lays.Spans[from:] and returns the core's name for it.
func (st *loopState) postLayoutOp(xop hotpath.Op, peer PeerName, from int, notif []byte) XferID {
	st.nextXfer++
	st.fx.ops = append(st.fx.ops, op{kind: opPostLayout, xop: xop, peer: peer, msg: notif, id: st.nextXfer, from: from, to: len(st.fx.lays.Spans)})
	return st.nextXfer
}

// postPreparedOp asks for a transfer of index pairs between prepared
// lists and returns the core's name for it.
func (st *loopState) postPreparedOp(xop hotpath.Op, local, remote PrepID, pairs []hotpath.IndexPair, notif []byte) XferID {
	st.nextXfer++
	from := len(st.fx.pairs)
	st.fx.pairs = append(st.fx.pairs, pairs...)
	st.fx.ops = append(st.fx.ops, op{kind: opPostPrepared, xop: xop, msg: notif, id: st.nextXfer, from: from, to: len(st.fx.pairs),
		local: local, remote: remote})
	return st.nextXfer
}

// prepareOp asks for a prepared list (peer "": of local memory) and
// returns the core's name for it.
func (st *loopState) prepareOp(peer PeerName, entries []hotpath.Entry) PrepID {
	st.nextPrep++
	st.fx.ops = append(st.fx.ops, op{kind: opPrepare, peer: peer, prep: st.nextPrep, entries: entries})
	return st.nextPrep
}

// opsDone takes the results of the ops the driver carried out (errs[i]
// of ops[i]) and continues what each started.
func (st *loopState) opsDone(ops []op, errs []error) {
	// exited: the agents whose process a failed notice proved gone, each
	// once: every notice to a dead agent fails alike (a batch of cancels
	// to one), and writerExited scans every waiting request.
	var exited []PeerName
	var exitErr []error
	for i := range ops {
		o, err := &ops[i], errs[i]
		switch o.kind {
		case opNotify:
			st.noticeDone(o, err)
			if errors.Is(err, ErrPeerExited) && !slices.Contains(exited, o.peer) {
				exited, exitErr = append(exited, o.peer), append(exitErr, err)
			}
		case opPost, opPostPrepared, opPostLayout:
			if err != nil {
				st.postFailed(o.id, err)
			}
		case opPrepare:
			if err != nil {
				st.prepFailed(o.prep)
			}
		}
	}
	for i, p := range exited {
		st.writerExited(p, exitErr[i])
	}
}

// keepLost keeps a failure notice that the backend could not send after
// tries sends, to send it again at the next tick (see lostTries).
func (st *loopState) keepLost(o *op, tries int, err error) {
	if o.m == nil || o.m.Kind != msgFail {
		return
	}
	if tries >= lostTries || len(st.lost) >= maxLost || st.closing {
		st.metrics.Dropped("notice_lost")
		st.log.Warn("kvxfer: failure notice not delivered; given up", "peer", o.peer, "d_req", o.m.DReq, "p_req", o.m.PReq,
			"sends", tries, "err", err)
		return
	}
	st.lost = append(st.lost, lostNotice{peer: o.peer, b: o.msg, m: o.m, tries: tries})
}

// resendLost sends the lost failure notices again.
func (st *loopState) resendLost() {
	if len(st.lost) == 0 {
		return
	}
	for i, l := range st.lost {
		st.notifyOp(l.peer, l.b, noticeResent, "", l.tries+1, l.m)
		st.lost[i] = lostNotice{}
	}
	st.lost = st.lost[:0]
}

// noticeDone continues after a notification was sent or failed.
func (st *loopState) noticeDone(o *op, err error) {
	switch o.notice {
	case noticePlain:
		if err != nil {
			st.metrics.FailedNotification()
			st.log.Warn("kvxfer: transfer failure", "failure_type", "notification_failed", "kind", o.m.Kind, "peer", o.peer,
				"d_req", o.m.DReq, "p_req", o.m.PReq, "err", err)
			st.keepLost(o, 1, err)
		}
	case noticeResent:
		if err != nil {
			st.keepLost(o, o.tp, err)
		}
	case noticeHeartbeat, noticeHeartbeatRetry:
		st.heartbeatSent(o, err)
	case noticeReg:
		st.registered(o.req, o.tp, err)
	case noticeDone:
		st.completionSent(o.req, o.tp, err)
	}
}
