package kvxfer

import (
	"container/heap"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"math"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// SchedulerConfig configures a Scheduler. Zero fields mean the documented
// defaults (SPEC §0).
type SchedulerConfig struct {
	// EngineID names this engine to its peers (required).
	EngineID string
	// Addr is how peers reach this engine's kvxferd (host:port), returned
	// in transfer params (required).
	Addr string
	// Mode is push or pull (required).
	Mode Mode
	// ResolveByID accepts transfer params that name the remote engine
	// without an address (RemoteAddr empty): the workers' Resolver finds
	// it by its id (kvxferd -etcd's registry).
	ResolveByID bool
	// CheckAddr, when set, checks a remote engine's address (transfer
	// params' RemoteAddr) as the workers' Resolver would take it: params
	// with one it refuses are bad input here, refused (named, counted in
	// BadParams) before any block is promised to them, instead of
	// failing the request's handshake at its ranks later. kvxferd sets it
	// to its resolver's host:port check.
	CheckAddr func(addr string) error
	// Generation, when set, returns this engine's current generation as
	// its peers' handshakes report it (HandshakeResult.Generation; 0:
	// unknown). A pull producer's params carry it (RemoteGeneration), so
	// that a consumer whose handshake predates a restart of this engine
	// handshakes again before reading, and one whose params predate it
	// does not read what the restarted engine holds in their blocks. It
	// is called from RequestFinished, under the Scheduler's owner.
	Generation func() uint64
	// TPSize and PPSize are this engine's parallelism (0 means 1).
	TPSize, PPSize int
	// LogicalBlockSize is the scheduler's block size in tokens (required).
	LogicalBlockSize int
	// Groups are the cache groups (kind and window), in the order block
	// lists are given. Empty means one full-attention group.
	Groups []topology.Group
	// SpecBlocks is the number of speculative-decoding blocks a Mamba
	// group keeps beyond its state block (0: none).
	SpecBlocks int
	// PrefillBackoff is how many trailing prompt tokens a producer leaves
	// uncomputed and its consumer computes itself (vLLM's prefill
	// backoff): 1 for a model with Mamba or bounded-replay layers (the
	// recurrent state must come over as of token N-1, so that the
	// consumer derives token N's from it once), the drafter's lookahead
	// less one for multi-module MTP (the producer must not prefill
	// unverified drafts into the MTP layers). The scheduler uses at least
	// 1 when a group is Mamba. See PrefillTokens.
	PrefillBackoff int
	// Lease is how long a producer holds finished blocks without a
	// heartbeat (default 30 s).
	Lease time.Duration
	// DecoderBlocksTTL is how long a consumer holds blocks for a second
	// turn in bidirectional pull (default 480 s).
	DecoderBlocksTTL time.Duration
	// RegistrationTimeout bounds how long a push consumer waits for the
	// producer's WRITE after registering (default DecoderBlocksTTL).
	RegistrationTimeout time.Duration
	// RecomputeThreshold: a second-turn read of fewer tokens than this is
	// recomputed instead (default 64; negative disables).
	RecomputeThreshold int
	// Bidirectional enables multi-turn pull (SPEC §8); refused in push.
	Bidirectional bool
	// HostBuffer stages producer saves to a host buffer (SPEC §11).
	HostBuffer bool
	// Layerwise is layer-wise push: the step metadata lists, in
	// StepMeta.Prefill, the producer requests whose prompt completes in
	// the step (see Prefill), so workers with WorkerConfig.Layerwise
	// WRITE each layer as soon as it is saved. Refused in pull mode.
	Layerwise bool
	// Now is the scheduler clock (default time.Now).
	Now func() time.Time
	// MaxRequests bounds what the scheduler keeps per request, as
	// WorkerConfig.MaxRequests bounds a rank's (default
	// DefaultMaxRequests, negative: none): each of its sets of requests
	// (held for a consumer, receiving, being saved, prefilled; staged for
	// the next BuildMeta) holds at most this many. A call that would add
	// one more fails with an error wrapping ErrRequestLimit, counted in
	// SchedulerCounters.RequestLimit, and adds nothing; the scheduler's
	// other requests carry on, and an outcome handed back (Update), a
	// request finished or a BuildMeta makes room. An engine that never
	// hands back its outcomes would otherwise grow it without bound.
	MaxRequests int
}

// ErrRequestLimit is the error of a Scheduler call refused at
// SchedulerConfig.MaxRequests.
var ErrRequestLimit = errors.New("kvxfer: scheduler request limit reached")

// Alloc is what an engine allocated for a request in a step.
type Alloc struct {
	// Blocks are the logical block ids per cache group that a transfer
	// fills: the blocks past the local prefix-cache hit. With External >
	// 0, a full-attention or MLA group's list holds every external token
	// and no group's is empty (AfterAlloc refuses less).
	Blocks [][]topology.BlockID
	// Computed is the number of tokens already computed locally (the
	// prefix-cache hit); Blocks start at this token.
	Computed int
	// External is the number of tokens the transfer provides
	// (num_external_tokens).
	External int
}

// SchedulerCounters count what a Scheduler rejected or dropped.
type SchedulerCounters struct {
	// BadParams: transfer params missing a field a transfer needs.
	BadParams uint64
	// UnknownUpdates: outcomes for requests the scheduler does not track.
	UnknownUpdates uint64
	// WatchdogExpired: push registrations whose deadline passed.
	WatchdogExpired uint64
	// Recomputed: second-turn reads below the recompute threshold, or
	// of a Mamba state past what the turn's prompt may load.
	Recomputed uint64
	// RequestLimit: calls refused at SchedulerConfig.MaxRequests.
	RequestLimit uint64
}

// Scheduler is the scheduler side of the connector for one engine (SPEC
// §7, §8, §11): it decides per request what to transfer, stages it, and
// builds the per-step metadata the workers consume. It plays P for
// requests whose params ask for a remote decode and D for those that ask
// for a remote prefill, in push or pull mode.
//
// A Scheduler is a synchronous state machine with one owner (the engine's
// scheduler loop): it is not safe for concurrent use and never blocks.
type Scheduler struct {
	cfg  SchedulerConfig
	step uint64
	// mamba: a cache group is Mamba (a recurrent state, which holds
	// every token up to where it was computed and cannot be cut).
	mamba bool

	// Staged for the next BuildMeta.
	recv         []RecvReq
	send         []SendReq
	save         []SaveReq
	prefill      []SendReq
	inBatch      []string
	notProcessed []string
	// preempted: layer-wise producers preempted after their prefill
	// step was built (StepMeta.Preempted).
	preempted []string
	// notProcessedTID: their transfer ids, by request id.
	notProcessedTID map[string]string
	// holdNonce and holds name the pull holds whose request's params
	// carry no transfer id (holdTID): a random prefix drawn once per
	// scheduler, and a count.
	holdNonce string
	holds     uint64

	// held: producer requests whose blocks are held until a worker
	// reports them sending (the reference's _finished_request_blocks).
	held map[string]bool
	// saving: host-buffer requests whose prefill is still being saved.
	saving map[string]bool
	// processed: requests whose remote blocks were already staged.
	processed map[string]bool
	// prefilled: layer-wise producer requests listed in a Prefill
	// already, until they finish.
	prefilled map[string]bool
	// prefilling: layer-wise producer requests whose listing a step
	// carried (the workers hold them prefilling, with no lease), by
	// transfer id, until RequestFinished stages what ends them there.
	prefilling map[string]string
	// watchdog: push registration deadlines by D request id, and a heap
	// of them by deadline.
	watch map[string]time.Time
	// recving: every receive staged and not yet reported (push and pull),
	// so Update knows each consumer outcome it is handed; true marks an
	// empty receive (a full prefix hit), whose outcome an engine need not
	// wait for or hand back: RequestFinished forgets it.
	recving map[string]bool
	// recvKeys: the producer transfer each receive in recving reads or
	// registers for (recvKey), to the request receiving it; recvKeyOf
	// is its inverse. A transfer is received once at a time: a second
	// receive of one producer request would count toward its release,
	// and free the blocks the first is still reading.
	recvKeys  map[recvKey]string
	recvKeyOf map[string]recvKey
	watchQ    deadlineHeap
	counters  SchedulerCounters
	// awaiting: pull consumer requests that arrived (NewRequest) and are
	// not allocated yet, true once a step's Await carried them; await and
	// awaitEnd are staged for the next step (StepMeta.Await, AwaitEnd).
	awaiting map[string]bool
	await    []AwaitReq
	awaitEnd []string
}

// NewScheduler validates cfg, fills its defaults and returns a Scheduler.
func NewScheduler(cfg SchedulerConfig) (*Scheduler, error) {
	if cfg.EngineID == "" {
		return nil, fmt.Errorf("kvxfer: SchedulerConfig.EngineID is empty")
	}
	if cfg.Addr == "" {
		return nil, fmt.Errorf("kvxfer: SchedulerConfig.Addr is empty")
	}
	if cfg.Mode != ModePush && cfg.Mode != ModePull {
		return nil, fmt.Errorf("kvxfer: SchedulerConfig.Mode = %d, want push or pull", cfg.Mode)
	}
	if cfg.LogicalBlockSize <= 0 {
		return nil, fmt.Errorf("kvxfer: SchedulerConfig.LogicalBlockSize = %d, want > 0", cfg.LogicalBlockSize)
	}
	if cfg.Bidirectional && cfg.Mode == ModePush {
		return nil, fmt.Errorf("kvxfer: SchedulerConfig.Bidirectional is not supported in push mode")
	}
	if cfg.Layerwise && cfg.Mode == ModePull {
		return nil, fmt.Errorf("kvxfer: SchedulerConfig.Layerwise is not supported in pull mode (it is layer-wise push)")
	}
	for name, v := range map[string]int{"TPSize": cfg.TPSize, "PPSize": cfg.PPSize, "SpecBlocks": cfg.SpecBlocks, "PrefillBackoff": cfg.PrefillBackoff} {
		if v < 0 {
			return nil, fmt.Errorf("kvxfer: SchedulerConfig.%s = %d, want >= 0", name, v)
		}
	}
	for name, d := range map[string]time.Duration{"Lease": cfg.Lease, "DecoderBlocksTTL": cfg.DecoderBlocksTTL, "RegistrationTimeout": cfg.RegistrationTimeout} {
		if d < 0 {
			return nil, fmt.Errorf("kvxfer: SchedulerConfig.%s = %v, want >= 0", name, d)
		}
	}
	cfg.TPSize, cfg.PPSize = max(cfg.TPSize, 1), max(cfg.PPSize, 1)
	if cfg.Lease == 0 {
		cfg.Lease = 30 * time.Second
	}
	if cfg.DecoderBlocksTTL == 0 {
		cfg.DecoderBlocksTTL = 480 * time.Second
	}
	if cfg.RegistrationTimeout == 0 {
		cfg.RegistrationTimeout = cfg.DecoderBlocksTTL
	}
	if cfg.RecomputeThreshold == 0 {
		cfg.RecomputeThreshold = 64
	}
	if cfg.Now == nil {
		cfg.Now = time.Now
	}
	if cfg.MaxRequests == 0 {
		cfg.MaxRequests = DefaultMaxRequests
	}
	if len(cfg.Groups) == 0 {
		cfg.Groups = []topology.Group{{Kind: topology.KindFullAttention}}
	}
	s := &Scheduler{cfg: cfg, held: map[string]bool{}, saving: map[string]bool{}, processed: map[string]bool{}, prefilled: map[string]bool{}, prefilling: map[string]string{}, watch: map[string]time.Time{}, recving: map[string]bool{}, awaiting: map[string]bool{},
		recvKeys: map[recvKey]string{}, recvKeyOf: map[string]recvKey{}}
	mamba := false
	for i, g := range cfg.Groups {
		switch g.Kind {
		case topology.KindFullAttention, topology.KindMLA:
		case topology.KindSlidingWindow:
			if g.Window <= 0 {
				return nil, fmt.Errorf("kvxfer: SchedulerConfig.Groups[%d].Window = %d, want > 0", i, g.Window)
			}
		case topology.KindMamba:
			mamba = true
		default:
			return nil, fmt.Errorf("kvxfer: SchedulerConfig.Groups[%d].Kind = %v unknown", i, g.Kind)
		}
	}
	if mamba {
		s.mamba = true
		s.cfg.PrefillBackoff = max(s.cfg.PrefillBackoff, 1)
	}
	return s, nil
}

// PrefillTokens returns how many of a prompt's tokens a producer computes
// and its consumer receives: all but the trailing PrefillBackoff, which
// the consumer computes itself, unless the prompt is no longer than the
// backoff (then all of it). A producer engine trims its request's prompt
// to this many tokens (and its output to one token) when the request
// arrives, so that the RemoteNumTokens it returns from RequestFinished is
// what MatchedTokens on the consumer expects. The rule is vLLM 0.32's
// NixlConnector's (_get_remote_prefill_token_count), so kvxfer and vLLM's
// own connector agree on both sides.
func (s *Scheduler) PrefillTokens(promptTokens int) int {
	if b := s.cfg.PrefillBackoff; b > 0 && promptTokens > b {
		return promptTokens - b
	}
	return promptTokens
}

// Counters returns what the scheduler rejected or dropped so far.
func (s *Scheduler) Counters() SchedulerCounters { return s.counters }

// room refuses (counted) request id when a set it would join holds
// MaxRequests already: sizes are the lengths of those sets.
func (s *Scheduler) room(id string, sizes ...int) error {
	if s.cfg.MaxRequests < 0 {
		return nil
	}
	n := 0
	for _, m := range sizes {
		n = max(n, m)
	}
	if n < s.cfg.MaxRequests {
		return nil
	}
	s.counters.RequestLimit++
	return fmt.Errorf("%w: request %q: the scheduler of engine %q keeps %d requests there already (held, receiving, saved or staged for the next step), its limit (SchedulerConfig.MaxRequests, kvxferd -max-requests)",
		ErrRequestLimit, id, s.cfg.EngineID, n)
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// BaseRequestID strips a trailing "-" and 8 hex digits (the random suffix
// an engine appends to a request id; SPEC §7.7), case-insensitively.
func BaseRequestID(id string) string {
	n := len(id)
	if n < 9 || id[n-9] != '-' {
		return id
	}
	for i := n - 8; i < n; i++ {
		if !isHex(id[i]) {
			return id
		}
	}
	return id[:n-9]
}

// clip clips per-group block lists as the exchange does and returns spans
// starting at token start (plus what clipping dropped).
func (s *Scheduler) clip(blocks [][]topology.BlockID, start int, clipSSM bool) ([]topology.Span, error) {
	if len(blocks) != len(s.cfg.Groups) {
		return nil, fmt.Errorf("kvxfer: %d block groups, want %d", len(blocks), len(s.cfg.Groups))
	}
	out := make([]topology.Span, len(blocks))
	for g, ids := range blocks {
		kept, dropped := topology.Clip(s.cfg.Groups[g], slices.Clone(ids), s.cfg.LogicalBlockSize, s.cfg.SpecBlocks, clipSSM, false)
		out[g] = topology.Span{Start: start + dropped*s.cfg.LogicalBlockSize, IDs: kept}
		if s.cfg.Groups[g].Kind == topology.KindMamba {
			out[g].Start = 0
		}
	}
	return out, nil
}

func emptySpans(spans []topology.Span) bool {
	for _, sp := range spans {
		if len(sp.IDs) > 0 {
			return false
		}
	}
	return true
}

// checkIDs refuses a request whose id, or an id or address of its params,
// is longer than MaxIDBytes: its rank would refuse the step entry made of
// it (and a peer the message naming it), and the scheduler would hold it
// meanwhile (MaxRequests of them, each as long as a message allows). The
// error names the field and the length, and quotes the start of the value
// only. Counted in BadParams.
func (s *Scheduler) checkIDs(r *Request) error {
	why := longID("Request.ID", r.ID)
	if p := r.Params; p != nil && why == "" {
		for _, f := range [...]struct{ name, v string }{{"TransferID", p.TransferID}, {"RemoteEngineID", p.RemoteEngineID},
			{"RemoteRequestID", p.RemoteRequestID}, {"RemoteAddr", p.RemoteAddr}} {
			if why = longID("transfer params: "+f.name, f.v); why != "" {
				break
			}
		}
	}
	if why == "" {
		return nil
	}
	s.counters.BadParams++
	return fmt.Errorf("kvxfer: %s", why)
}

// MatchedTokens reports how many tokens a request gets from a remote
// engine beyond the computed ones, and whether they arrive asynchronously
// (SPEC §7.1, §8.2; the reference's get_num_new_matched_tokens). A
// consumer receives PrefillTokens of its prompt and computes the rest (the
// last token for a model with Mamba groups). Params no receive can use
// (a remote coordinate missing, the other mode, pull without the
// producer's blocks) get 0, false and are counted in BadParams once: the
// request is computed locally.
func (s *Scheduler) MatchedTokens(r *Request, computed int) (n int, async bool) {
	p := r.Params
	if p == nil || s.checkIDs(r) != nil {
		return 0, false
	}
	switch {
	case p.DoRemotePrefill:
		if err := s.usableRecvParams(p); err != nil {
			// Never promise a load AfterAlloc would refuse whatever is
			// allocated: the engine would keep the request waiting for a
			// receive never staged. It is computed here instead, as the
			// reference does for params missing a coordinate, and its
			// params are not acted on again (the refusal counted once).
			s.counters.BadParams++
			p.DoRemotePrefill = false
			return 0, false
		}
		n = s.PrefillTokens(r.PromptTokens) - computed
	case s.cfg.Bidirectional && p.DoRemoteDecode && len(p.RemoteBlockIDs) > 0 && !s.cfg.HostBuffer && !s.processed[r.ID]:
		// Turn 2 on P: read back what D holds beyond our prefix, under
		// AfterAlloc's conditions (no host buffer, not read already: a
		// request asked again after a preemption recomputes), so that
		// an asynchronous load promised is one staged.
		if err := s.usableRecvParams(p); err != nil {
			// D's params cannot be read back: this turn is computed
			// here. Marked processed so that neither this nor AfterAlloc
			// acts on them again (counted once).
			s.counters.BadParams++
			s.processed[r.ID] = true
			return 0, false
		}
		n = min(p.RemoteNumTokens, r.PromptTokens) - computed
		if s.mamba && p.RemoteNumTokens > s.PrefillTokens(r.PromptTokens) {
			// D's Mamba state is as of the RemoteNumTokens it computed
			// and cannot be rewound: a prompt no longer than that (plus
			// the backoff this engine computes itself) cannot use it.
			// Loaded, P would take the prompt's tokens as loaded with a
			// state past them (or apply the last token twice).
			if n > 0 {
				s.counters.Recomputed++
			}
			return 0, false
		}
		if n > 0 && s.cfg.RecomputeThreshold > 0 && n < s.cfg.RecomputeThreshold {
			s.counters.Recomputed++
			return 0, false
		}
	default:
		return 0, false
	}
	if n <= 0 {
		return 0, false
	}
	return n, true
}

// usableRecvParams checks what a consumer's params need for any
// receive: the remote coordinates (remoteRef), and in pull the
// producer's blocks.
func (s *Scheduler) usableRecvParams(p *TransferParams) error {
	if _, err := s.remoteRef(p); err != nil {
		return err
	}
	if s.cfg.Mode == ModePull && emptySpans(p.RemoteBlockIDs) {
		return fmt.Errorf("kvxfer: transfer params: RemoteBlockIDs is empty (a pull consumer reads the producer's blocks)")
	}
	return nil
}

func (s *Scheduler) remoteRef(p *TransferParams) (RemoteRef, error) {
	if p.Mode != 0 && p.Mode != s.cfg.Mode {
		// A producer of the other mode (a router mixing push and pull
		// engines): it waits for what this engine never does.
		return RemoteRef{}, fmt.Errorf("kvxfer: transfer params: Mode = %v, but this engine runs %v", p.Mode, s.cfg.Mode)
	}
	if p.RemoteEngineID == "" {
		return RemoteRef{}, fmt.Errorf("kvxfer: transfer params: RemoteEngineID is empty")
	}
	if p.RemoteAddr == "" && !s.cfg.ResolveByID {
		return RemoteRef{}, fmt.Errorf("kvxfer: transfer params: RemoteAddr is empty")
	}
	if p.RemoteAddr != "" && s.cfg.CheckAddr != nil {
		if err := s.cfg.CheckAddr(p.RemoteAddr); err != nil {
			return RemoteRef{}, fmt.Errorf("kvxfer: transfer params: RemoteAddr: %w", err)
		}
	}
	if p.RemoteRequestID == "" && p.TransferID == "" {
		return RemoteRef{}, fmt.Errorf("kvxfer: transfer params: RemoteRequestID and TransferID are both empty")
	}
	if p.RemoteTPSize < 0 || p.RemotePPSize < 0 || p.RemoteNumTokens < 0 {
		return RemoteRef{}, fmt.Errorf("kvxfer: transfer params: RemoteTPSize/RemotePPSize/RemoteNumTokens = %d/%d/%d, want >= 0",
			p.RemoteTPSize, p.RemotePPSize, p.RemoteNumTokens)
	}
	return RemoteRef{EngineID: p.RemoteEngineID, Addr: p.RemoteAddr, ReqID: p.RemoteRequestID,
		TPSize: max(p.RemoteTPSize, 1), PPSize: max(p.RemotePPSize, 1), Tokens: p.RemoteNumTokens, Expiry: p.RemoteBlocksExpiry, Generation: p.RemoteGeneration}, nil
}

// NewRequest tells the scheduler a request arrived (vLLM's
// on_new_request), before it waits in the engine's queue. A pull
// consumer request (params asking for a remote prefill) is published to
// the ranks with the next step (StepMeta.Await), which heartbeat its
// producer from then on: the producer's hold on its blocks lapses after
// its lease otherwise, however long the request waits to be allocated
// (SPEC §9, heartbeat tracking from on_new_request). The heartbeats stop
// when AfterAlloc stages its receive (the rank's receive takes over) or
// when it ends before (RequestFinished, or an AfterAlloc with nothing to
// read). Params a receive could not use are left to AfterAlloc, which
// refuses them (naming the field, counted in BadParams once); past
// MaxRequests the request is not tracked (counted in RequestLimit:
// it loses only its early heartbeats). Other requests are ignored.
func (s *Scheduler) NewRequest(r *Request) error {
	if err := s.checkIDs(r); err != nil {
		return err
	}
	p := r.Params
	if p == nil || !p.DoRemotePrefill || p.DoRemoteDecode || s.cfg.Mode != ModePull {
		return nil
	}
	if _, ok := s.recving[r.ID]; ok {
		return nil // receiving already: its rank heartbeats it
	}
	ref, err := s.remoteRef(p)
	if err != nil {
		// Not tracked, nor refused here: its allocation (AfterAlloc)
		// refuses such params, naming the field, and counts them once.
		return nil
	}
	if _, staged := s.awaiting[r.ID]; staged {
		return nil
	}
	if s.room(r.ID, len(s.awaiting)) != nil {
		return nil
	}
	s.awaiting[r.ID] = false
	s.await = append(s.await, AwaitReq{ReqID: r.ID, TransferID: p.TransferID, Remote: ref})
	return nil
}

// endAwait stops the heartbeats of an arrived request (NewRequest) that
// is no longer waiting: recv says whether its receive was staged (the
// rank's receive takes over, so the ranks need not be told).
func (s *Scheduler) endAwait(id string, recv bool) {
	published, ok := s.awaiting[id]
	if !ok {
		return
	}
	delete(s.awaiting, id)
	if !published {
		s.await = slices.DeleteFunc(s.await, func(a AwaitReq) bool { return a.ReqID == id })
		return
	}
	if !recv {
		s.awaitEnd = append(s.awaitEnd, id)
	}
}

// AfterAlloc stages the transfer of a request the engine just allocated
// blocks for (SPEC §7.1, §8.1-§8.2; update_state_after_alloc). A consumer
// registers (push) or reads (pull) into a.Blocks; a full prefix hit stages
// an empty receive so the producer frees its blocks at once. Bad params
// are an error naming the field; nothing is staged then. A transfer is
// received once at a time: a request already receiving, or params naming
// a producer transfer (TransferID, else RemoteRequestID) another request
// of this engine receives, are refused.
func (s *Scheduler) AfterAlloc(r *Request, a Alloc) error {
	if err := s.checkIDs(r); err != nil {
		return err
	}
	if _, ok := s.awaiting[r.ID]; ok {
		n := len(s.recv)
		defer func() { s.endAwait(r.ID, len(s.recv) > n && s.recv[len(s.recv)-1].ReqID == r.ID) }()
	}
	p := r.Params
	if p == nil {
		return nil
	}
	if p.DoRemoteDecode && !p.DoRemotePrefill {
		if err := s.room(r.ID, len(s.inBatch), len(s.saving)); err != nil {
			return err
		}
		s.inBatch = append(s.inBatch, r.ID)
		if s.cfg.HostBuffer {
			s.saving[r.ID] = true
		}
		if s.cfg.Bidirectional && len(p.RemoteBlockIDs) > 0 && !s.cfg.HostBuffer && !s.processed[r.ID] {
			// Turn 2 on P: read D's held blocks back, or, with nothing to
			// read (a prefix hit, a read recomputed), an empty receive
			// tells D to free them now instead of at its TTL.
			return s.stageRecv(r, a, p.RemoteBlockIDs)
		}
		return nil
	}
	if !p.DoRemotePrefill {
		return nil
	}
	if s.cfg.Bidirectional {
		if err := s.room(r.ID, len(s.inBatch)); err != nil {
			return err
		}
		s.inBatch = append(s.inBatch, r.ID)
	}
	if s.cfg.Mode == ModePull && len(p.RemoteBlockIDs) == 0 {
		if a.External > 0 {
			s.counters.BadParams++
			return fmt.Errorf("kvxfer: request %q: transfer params: RemoteBlockIDs is empty with %d external tokens", r.ID, a.External)
		}
		p.DoRemotePrefill = false
		return nil
	}
	err := s.stageRecv(r, a, p.RemoteBlockIDs)
	if err == nil {
		p.DoRemotePrefill = false
		if s.cfg.Mode == ModePush {
			p.RemoteBlockIDs = nil
		}
	}
	return err
}

func (s *Scheduler) stageRecv(r *Request, a Alloc, remote []topology.Span) error {
	p := r.Params
	ref, err := s.remoteRef(p)
	if err != nil {
		s.counters.BadParams++
		return fmt.Errorf("request %q: %w", r.ID, err)
	}
	if s.cfg.Mode == ModePull {
		ref.Blocks = remote
	}
	if err := s.checkAlloc(a, ref); err != nil {
		s.counters.BadParams++
		return fmt.Errorf("kvxfer: request %q: %w", r.ID, err)
	}
	if _, ok := s.recving[r.ID]; ok {
		s.counters.BadParams++
		return fmt.Errorf("kvxfer: request %q is already receiving (allocated again before its receive ended)", r.ID)
	}
	if err := s.room(r.ID, len(s.recving), len(s.processed), len(s.recv)); err != nil {
		return err
	}
	key, err := s.freeRecvKey(r.ID, p.TransferID, ref)
	if err != nil {
		return err
	}
	rr := RecvReq{ReqID: r.ID, TransferID: p.TransferID, Remote: ref}
	if a.External > 0 {
		rr.Tokens = a.Computed + a.External
		rr.Local, err = s.clip(a.Blocks, a.Computed, true)
		if err != nil {
			s.counters.BadParams++
			return fmt.Errorf("request %q: %w", r.ID, err)
		}
		if len(ref.Blocks) > 0 && len(ref.Blocks) != len(rr.Local) {
			s.counters.BadParams++
			return fmt.Errorf("kvxfer: request %q: transfer params: RemoteBlockIDs has %d groups, want %d", r.ID, len(ref.Blocks), len(rr.Local))
		}
		if emptySpans(rr.Local) {
			rr.Local = nil
		}
	}
	now := s.cfg.Now()
	switch {
	case s.cfg.Mode == ModePush && rr.Local != nil:
		rr.Deadline = now.Add(s.cfg.RegistrationTimeout)
		s.watch[r.ID] = rr.Deadline
		heap.Push(&s.watchQ, deadlineEntry{at: rr.Deadline, id: r.ID})
	}
	// A pull read bounded by the producer's expiry (ref.Expiry, a
	// bidirectional turn 2) is bounded by the worker: the expiry is on the
	// producer's clock, which only the worker's handshake relates to ours
	// (RecvReq.Deadline is on this scheduler's clock). Before, it was
	// copied into Deadline and rebased as our own time: off by the skew
	// between the hosts.
	s.processed[r.ID] = true
	s.recv = append(s.recv, rr)
	s.recving[r.ID] = rr.Local == nil
	s.recvKeys[key] = r.ID
	s.recvKeyOf[r.ID] = key
	return nil
}

// recvKey names a producer transfer a consumer receives: by its transfer
// id where it has one (the key P matches by), else by the producer's
// request id.
type recvKey struct{ engine, tid, req string }

// freeRecvKey returns the key of a receive of ref's transfer by request
// id, refused (counted) while another request receives that transfer.
func (s *Scheduler) freeRecvKey(id, tid string, ref RemoteRef) (recvKey, error) {
	key := recvKey{engine: ref.EngineID, tid: tid}
	if tid == "" {
		key.req = ref.ReqID
	}
	other, ok := s.recvKeys[key]
	if !ok {
		return key, nil
	}
	s.counters.BadParams++
	if tid != "" {
		return key, fmt.Errorf("kvxfer: request %q: transfer params: TransferID = %q of engine %q is already being received by request %q (params replayed)",
			id, tid, key.engine, other)
	}
	return key, fmt.Errorf("kvxfer: request %q: transfer params: RemoteRequestID = %q of engine %q is already being received by request %q (params replayed)",
		id, key.req, key.engine, other)
}

// forgetRecv drops request id's receive from recving and recvKeys.
func (s *Scheduler) forgetRecv(id string) {
	delete(s.recving, id)
	if k, ok := s.recvKeyOf[id]; ok {
		delete(s.recvKeyOf, id)
		if s.recvKeys[k] == id {
			delete(s.recvKeys, k)
		}
	}
}

// checkAlloc checks what an engine allocated for a receive: counts in
// range, a prefix hit on a block boundary, blocks in every full-attention
// and MLA group for every external token (and some in every
// sliding-window and Mamba group), and no more tokens than the producer
// holds where its params say (RemoteNumTokens). Anything less and the transfer would fill part of what
// the engine takes as loaded, and report it done (with no block at all,
// at once, as a full prefix hit).
func (s *Scheduler) checkAlloc(a Alloc, ref RemoteRef) error {
	bs := s.cfg.LogicalBlockSize
	switch {
	case a.Computed < 0 || a.Computed > maxTokens:
		return fmt.Errorf("Alloc.Computed = %d, want 0..%d", a.Computed, maxTokens)
	case a.External < 0 || a.External > maxTokens:
		return fmt.Errorf("Alloc.External = %d, want 0..%d", a.External, maxTokens)
	case a.External == 0:
		return nil
	case a.Computed%bs != 0:
		return fmt.Errorf("Alloc.Computed = %d with Alloc.External = %d, want a multiple of the block size %d (the first block starts there)",
			a.Computed, a.External, bs)
	case len(a.Blocks) != len(s.cfg.Groups):
		return fmt.Errorf("Alloc.Blocks has %d block groups, want %d", len(a.Blocks), len(s.cfg.Groups))
	}
	for g, ids := range a.Blocks {
		if k := s.cfg.Groups[g].Kind; k == topology.KindMamba || k == topology.KindSlidingWindow {
			// A state block, a window's blocks: never none.
			if len(ids) == 0 {
				return fmt.Errorf("Alloc.Blocks[%d] (%v) is empty with Alloc.External = %d", g, k, a.External)
			}
			continue
		}
		if have := len(ids) * bs; have < a.External {
			return fmt.Errorf("Alloc.Blocks[%d] has %d blocks (%d tokens from token %d), fewer than Alloc.External = %d",
				g, len(ids), have, a.Computed, a.External)
		}
	}
	// The producer moves only the tokens it holds (a READ or a WRITE
	// covers no more than RemoteNumTokens, hotpath's bound): in either
	// mode, more would leave the rest of the blocks as they were, taken
	// as loaded.
	if ref.Tokens > 0 && a.Computed+a.External > ref.Tokens {
		return fmt.Errorf("Alloc.Computed + Alloc.External = %d + %d, more than the producer holds (transfer params: RemoteNumTokens = %d)",
			a.Computed, a.External, ref.Tokens)
	}
	// A Mamba group's state block holds the producer's state as of every
	// token it holds: loaded with fewer, the state is past the tokens
	// taken as loaded (a recurrent state cannot be cut).
	if s.mamba && ref.Tokens > 0 && a.Computed+a.External != ref.Tokens {
		return fmt.Errorf("Alloc.Computed + Alloc.External = %d + %d, but the producer's Mamba state is as of token %d (transfer params: RemoteNumTokens = %d); a recurrent state is loaded whole or not at all",
			a.Computed, a.External, ref.Tokens, ref.Tokens)
	}
	return nil
}

// maxTokens bounds the token counts an engine passes (topology's bound on
// token starts).
const maxTokens = 1 << 40

// Scheduled stages host-buffer saves of the new blocks a producer request
// got this step (SPEC §11); computed and scheduled are its token counts.
// It fails when MaxRequests saves are staged for the next BuildMeta
// already (ErrRequestLimit), or for an id longer than MaxIDBytes.
func (s *Scheduler) Scheduled(r *Request, newBlocks [][]topology.BlockID, computed, scheduled int) error {
	if err := s.checkIDs(r); err != nil {
		return err
	}
	if !s.cfg.HostBuffer || !s.saving[r.ID] {
		return nil
	}
	spans, err := s.clip(newBlocks, 0, false)
	if err == nil && !emptySpans(spans) {
		if err := s.room(r.ID, len(s.save)); err != nil {
			return err
		}
		sr := SaveReq{ReqID: r.ID}
		for _, sp := range spans {
			sr.Blocks = append(sr.Blocks, sp.IDs)
		}
		s.save = append(s.save, sr)
	}
	if computed >= r.PromptTokens-scheduled { // computed+scheduled >= PromptTokens, without overflowing
		delete(s.saving, r.ID)
	}
	return nil
}

// Prefill stages, for layer-wise push, a producer request (params with
// DoRemoteDecode) scheduled in the coming step: blocks are all its blocks
// per cache group (the prefix hit included), computed the tokens computed
// before the step and scheduled the tokens the step computes. When the
// step completes the prompt (computed+scheduled >= r.PromptTokens), the
// next BuildMeta lists the request in StepMeta.Prefill with its blocks
// clipped as RequestFinished clips them, so the workers WRITE each layer
// as it is saved; RequestFinished then hands over its lease as usual.
//
// The engine calls it for every producer request of every step; calls for
// other requests, when the scheduler is not layer-wise, for steps that do
// not complete the prompt, or for a request listed already are no-ops.
// Bad input is an error naming the field, counted in BadParams; nothing
// is staged then.
func (s *Scheduler) Prefill(r *Request, blocks [][]topology.BlockID, computed, scheduled int) error {
	if err := s.checkIDs(r); err != nil {
		return err
	}
	p := r.Params
	if !s.cfg.Layerwise || p == nil || !p.DoRemoteDecode || p.DoRemotePrefill || s.prefilled[r.ID] {
		return nil
	}
	var err error
	switch {
	case len(blocks) != len(s.cfg.Groups):
		err = fmt.Errorf("kvxfer: request %q: Prefill: blocks has %d groups, want %d (one per cache group)", r.ID, len(blocks), len(s.cfg.Groups))
	case computed < 0 || scheduled < 0:
		err = fmt.Errorf("kvxfer: request %q: Prefill: computed/scheduled = %d/%d, want >= 0", r.ID, computed, scheduled)
	case computed > math.MaxInt-scheduled:
		err = fmt.Errorf("kvxfer: request %q: Prefill: computed + scheduled = %d + %d overflows", r.ID, computed, scheduled)
	case r.PromptTokens < 0:
		err = fmt.Errorf("kvxfer: request %q: Prefill: PromptTokens = %d, want >= 0", r.ID, r.PromptTokens)
	}
	if err != nil {
		s.counters.BadParams++
		return err
	}
	if computed+scheduled < r.PromptTokens {
		return nil
	}
	spans, err := s.clip(blocks, 0, true)
	if err != nil {
		s.counters.BadParams++
		return fmt.Errorf("request %q: %w", r.ID, err)
	}
	if err := s.room(r.ID, len(s.prefilled), len(s.prefill)); err != nil {
		return err
	}
	s.prefilled[r.ID] = true
	s.prefill = append(s.prefill, SendReq{ReqID: r.ID, TransferID: p.TransferID, Blocks: spans, Tokens: r.PromptTokens})
	return nil
}

// preempt handles a layer-wise producer its engine preempted (its blocks
// freed) after it was listed in a Prefill: the request is not finished,
// and its pairing with its consumer carries over. A listing not built yet
// is dropped (no worker heard of it); one built already is named in the
// next step's StepMeta.Preempted, so the workers write nothing more from
// the freed blocks and write every layer again from the blocks of the
// request's next Prefill (listed anew: it is no longer prefilled) or its
// finish. A request not listed is not the scheduler's to track: no-op.
func (s *Scheduler) preempt(r *Request) error {
	if !s.prefilled[r.ID] {
		return nil
	}
	if i := slices.IndexFunc(s.prefill, func(q SendReq) bool { return q.ReqID == r.ID }); i >= 0 {
		s.prefill = slices.Delete(s.prefill, i, i+1)
		delete(s.prefilled, r.ID)
		return nil
	}
	if err := s.room(r.ID, len(s.preempted)); err != nil {
		return err
	}
	delete(s.prefilled, r.ID)
	s.preempted = append(s.preempted, r.ID)
	return nil
}

// abandonPrefill names in NotProcessed a request the workers hold
// prefilling whose finish stages nothing that ends it there. Not bounded
// by room: it was bounded when it was listed, and the workers hold it.
func (s *Scheduler) abandonPrefill(id, tid string) {
	if slices.Contains(s.notProcessed, id) {
		return
	}
	s.notProcessed = append(s.notProcessed, id)
	if tid != "" {
		if s.notProcessedTID == nil {
			s.notProcessedTID = map[string]string{}
		}
		s.notProcessedTID[id] = tid
	}
}

// RequestFinished handles a finished request (SPEC §7.4, §8.1;
// request_finished). A producer that finished normally with blocks holds
// them under a lease (delay = true) and returns the params a consumer
// needs; an abnormal finish frees them at once. A consumer aborted before
// its transfer was staged tells its producer at once. FinishPreempted is
// no finish: see preempt.
func (s *Scheduler) RequestFinished(r *Request, status FinishStatus, blocks [][]topology.BlockID, computed int) (delay bool, params *TransferParams, err error) {
	if err := s.checkIDs(r); err != nil {
		return false, nil, err
	}
	if status == FinishPreempted {
		return false, nil, s.preempt(r)
	}
	s.endAwait(r.ID, false)
	if tid, ok := s.prefilling[r.ID]; ok {
		// The workers hold it prefilling (a step listed it): whatever
		// this finish stages, something must end it there. A finish that
		// stages no SendReq or NotProcessed (no blocks: vLLM stops a
		// request it preempted after its prefill step, its blocks freed;
		// or a finish refused) names it in NotProcessed, as an abort.
		// Without, each worker held it for ever.
		delete(s.prefilling, r.ID)
		sends, aborts := len(s.send), len(s.notProcessed)
		defer func() {
			// (Not where an earlier request under its id holds its blocks
			// and no transfer id tells the two apart: the abort would end
			// that one on the workers.)
			if len(s.send) == sends && len(s.notProcessed) == aborts && !(s.held[r.ID] && tid == "") {
				s.abandonPrefill(r.ID, tid)
			}
		}()
	}
	p := r.Params
	received := s.processed[r.ID]
	if empty, ok := s.recving[r.ID]; ok && empty {
		// A full prefix hit's outcome: nothing waits for it.
		s.forgetRecv(r.ID)
	}
	delete(s.saving, r.ID)
	delete(s.processed, r.ID)
	if s.prefilled[r.ID] {
		// A prefill staged for the coming step is dropped: the request
		// finished first (aborted, its blocks freed; or done, and its
		// SendReq below hands its blocks over whole).
		s.prefill = slices.DeleteFunc(s.prefill, func(q SendReq) bool { return q.ReqID == r.ID })
	}
	delete(s.prefilled, r.ID)
	if p == nil {
		return false, nil, nil
	}
	if p.DoRemotePrefill {
		// Consumer aborted before it was scheduled: receive nothing, so
		// the producer frees its blocks now (in push too: SPEC §14).
		p.DoRemotePrefill = false
		ref, err := s.remoteRef(p)
		if err != nil {
			s.counters.BadParams++
			return false, nil, fmt.Errorf("request %q: %w", r.ID, err)
		}
		if _, err := s.freeRecvKey(r.ID, p.TransferID, ref); err != nil {
			// Another request receives this transfer (params replayed):
			// releasing the producer would free its blocks under it.
			return false, nil, err
		}
		if err := s.room(r.ID, len(s.recv)); err != nil {
			return false, nil, err
		}
		s.recv = append(s.recv, RecvReq{ReqID: r.ID, TransferID: p.TransferID, Remote: ref, Aborted: true})
		return false, nil, nil
	}
	producer := p.DoRemoteDecode || s.cfg.Bidirectional && received
	if !producer {
		return false, nil, nil
	}
	if !status.normal() {
		if p.DoRemoteDecode {
			if err := s.room(r.ID, len(s.notProcessed), len(s.recv)); err != nil {
				return false, nil, err
			}
			s.releaseTurn(r, received)
			s.notProcessed = append(s.notProcessed, r.ID)
			if p.TransferID != "" {
				if s.notProcessedTID == nil {
					s.notProcessedTID = map[string]string{}
				}
				s.notProcessedTID[r.ID] = p.TransferID
			}
		}
		return false, nil, nil
	}
	if computed < 0 || computed > maxTokens {
		s.counters.BadParams++
		return false, nil, fmt.Errorf("kvxfer: request %q: RequestFinished: computed = %d, want 0..%d", r.ID, computed, maxTokens)
	}
	spans, err := s.clip(blocks, 0, true)
	if err != nil {
		s.counters.BadParams++
		return false, nil, fmt.Errorf("request %q: %w", r.ID, err)
	}
	out := &TransferParams{TransferID: p.TransferID, RemoteEngineID: s.cfg.EngineID, RemoteAddr: s.cfg.Addr,
		RemoteRequestID: r.ID, RemoteBlockIDs: spans, RemoteTPSize: s.cfg.TPSize, RemotePPSize: s.cfg.PPSize,
		RemoteNumTokens: computed, Mode: s.cfg.Mode}
	ttl := s.cfg.Lease
	if p.DoRemoteDecode {
		out.DoRemotePrefill = true
	} else {
		// Bidirectional consumer at the end of a turn: hold our blocks
		// for the producer's next turn (no heartbeats in this direction).
		out.DoRemoteDecode = true
		ttl = s.cfg.DecoderBlocksTTL
	}
	if emptySpans(spans) {
		// Nothing is held, so nothing can be read from us (the
		// reference returns 0 too).
		out.RemoteNumTokens = 0
		return false, out, nil
	}
	if !s.held[r.ID] {
		if err := s.room(r.ID, len(s.held), len(s.send)); err != nil {
			return false, nil, err
		}
	}
	if s.held[r.ID] {
		// The request under this id before still holds its blocks for a
		// transfer (its outcome has not come back). Staged, the new one
		// would be dropped by the workers as a duplicate and never
		// report, and the old one's outcome would end it.
		s.counters.BadParams++
		return false, nil, fmt.Errorf("kvxfer: request %q: RequestFinished: an earlier request under this id still holds its blocks for its transfer (no outcome yet); a producer's request ids must be unique among the requests it holds", r.ID)
	}
	deadline := s.cfg.Now().Add(ttl)
	if out.DoRemoteDecode || s.cfg.Mode == ModePull {
		// When the hold ends unless heartbeats extend it: a pull
		// consumer's READ must end before it, or it may read blocks the
		// producer freed and reused (NIXL has no grant to refuse such a
		// READ). Before, plain pull params carried none: a consumer whose
		// request waited in its queue past the lease (its heartbeats begin
		// with its read), or whose handshake was slow, read another
		// request's KV over NIXL and reported it loaded.
		out.RemoteBlocksExpiry = deadline
	}
	if out.TransferID == "" && s.cfg.Mode == ModePull {
		out.TransferID = s.holdTID()
	}
	if s.cfg.Generation != nil && s.cfg.Mode == ModePull {
		out.RemoteGeneration = s.cfg.Generation()
	}
	s.held[r.ID] = true
	s.send = append(s.send, SendReq{ReqID: r.ID, TransferID: out.TransferID, Deadline: deadline, Blocks: spans, Tokens: computed})
	return true, out, nil
}

// holdTID is the transfer id of a pull hold whose request's params carry
// none (a router that names no transfer, an older engine's params): one
// of its own, unique to the hold, handed to its consumer in the params,
// which every consumer build names in its READs, completion notices and
// heartbeats. Before, such a hold was known by its request id alone, and
// a producer request id is used again once its request ended: the
// earlier request's consumer, reading after that request's lease lapsed,
// was admitted into the new request's hold of the same blocks (it read
// another request's KV as its own), its completion notice counted as the
// new request's (whose blocks the engine then freed before its own
// consumer read them), and its heartbeats extended the new request's
// lease. Random per scheduler, so a restarted engine's holds are not
// named as its crashed one's were. Pull only: a push consumer gets its
// transfer id from the router, not from these params.
func (s *Scheduler) holdTID() string {
	if s.holdNonce == "" {
		var b [8]byte
		_, _ = rand.Read(b[:]) // never fails (crypto/rand)
		s.holdNonce = hex.EncodeToString(b[:])
	}
	s.holds++
	return "kvxfer-" + s.holdNonce + "-" + strconv.FormatUint(s.holds, 16)
}

// releaseTurn stages, for a bidirectional producer's turn ended before
// it read back what its consumer holds for it (aborted before it was
// scheduled), an empty receive that tells the consumer to free those
// blocks now instead of at its DecoderBlocksTTL. Params no receive can
// use, or naming a transfer another request receives, release nothing.
func (s *Scheduler) releaseTurn(r *Request, received bool) {
	p := r.Params
	if !s.cfg.Bidirectional || s.cfg.HostBuffer || received || emptySpans(p.RemoteBlockIDs) {
		return
	}
	ref, err := s.remoteRef(p)
	if err != nil {
		return
	}
	key := recvKey{engine: ref.EngineID, tid: p.TransferID}
	if p.TransferID == "" {
		key.req = ref.ReqID
	}
	if _, ok := s.recvKeys[key]; ok {
		return // another request reads them (params replayed)
	}
	s.recv = append(s.recv, RecvReq{ReqID: r.ID, TransferID: p.TransferID, Remote: ref, Aborted: true})
}

// BuildMeta drains what was staged into the step's metadata (SPEC §1) and
// runs the registration watchdog.
func (s *Scheduler) BuildMeta() *StepMeta {
	s.step++
	now := s.cfg.Now()
	m := &StepMeta{Step: s.step, SchedulerClock: now, Recv: s.recv, Send: s.send, Prefill: s.prefill, Save: s.save,
		InBatch: s.inBatch, NotProcessed: s.notProcessed, NotProcessedTransferIDs: s.notProcessedTID, Preempted: s.preempted}
	for _, q := range s.prefill {
		s.prefilling[q.ReqID] = q.TransferID
	}
	s.recv, s.send, s.prefill, s.save, s.inBatch, s.notProcessed, s.notProcessedTID = nil, nil, nil, nil, nil, nil, nil
	s.preempted = nil
	m.Await, m.AwaitEnd = s.await, s.awaitEnd
	for _, a := range s.await {
		s.awaiting[a.ReqID] = true
	}
	s.await, s.awaitEnd = nil, nil
	slices.SortFunc(m.Recv, func(a, b RecvReq) int { return strings.Compare(a.ReqID, b.ReqID) })
	slices.SortFunc(m.Send, func(a, b SendReq) int { return strings.Compare(a.ReqID, b.ReqID) })
	slices.SortFunc(m.Prefill, func(a, b SendReq) int { return strings.Compare(a.ReqID, b.ReqID) })
	slices.SortFunc(m.Save, func(a, b SaveReq) int { return strings.Compare(a.ReqID, b.ReqID) })
	slices.Sort(m.InBatch)
	slices.Sort(m.NotProcessed)
	slices.Sort(m.Preempted)
	// Watchdog: by deadline, so one long deadline holds back nothing.
	for len(s.watchQ) > 0 && !s.watchQ[0].at.After(now) {
		e := heap.Pop(&s.watchQ).(deadlineEntry)
		if d, ok := s.watch[e.id]; ok && d.Equal(e.at) {
			delete(s.watch, e.id)
			s.counters.WatchdogExpired++
		}
	}
	return m
}

// Update takes the engine-wide finished sets (SPEC §1
// update_connector_output): sending outcomes release held blocks,
// receiving outcomes clear the watchdog. Unknown ids are counted.
func (s *Scheduler) Update(f *Finished) {
	if f == nil {
		return
	}
	for _, o := range f.Sending {
		if !s.held[o.ReqID] {
			s.counters.UnknownUpdates++
			continue
		}
		delete(s.held, o.ReqID)
	}
	for _, o := range f.Recving {
		if _, ok := s.recving[o.ReqID]; !ok {
			s.counters.UnknownUpdates++
			continue
		}
		s.forgetRecv(o.ReqID)
		delete(s.watch, o.ReqID)
	}
	s.compactWatch()
}

// compactWatch rebuilds the watchdog heap from the armed deadlines when
// most of its entries are for receives that ended already (they would
// otherwise stay until their deadline: with a long registration timeout,
// one per request for that long).
func (s *Scheduler) compactWatch() {
	if len(s.watchQ) <= 64 || len(s.watchQ) <= 2*len(s.watch) {
		return
	}
	q := s.watchQ[:0]
	for id, at := range s.watch {
		q = append(q, deadlineEntry{at: at, id: id})
	}
	clear(s.watchQ[len(q):])
	s.watchQ = q
	heap.Init(&s.watchQ)
}

// HasPendingWork reports whether the engine must keep stepping for
// kvxfer's sake: blocks held for a transfer, or staged work not built yet
// (SPEC §7.12). Staged work is anything the next BuildMeta drains for the
// workers, an abort (NotProcessed) or a save included: an idle engine that
// stopped stepping would hold it back, and the workers (and, through
// them, a consumer registered for the request) would wait on it.
func (s *Scheduler) HasPendingWork() bool {
	return len(s.held) > 0 || len(s.recv) > 0 || len(s.send) > 0 || len(s.prefill) > 0 || len(s.preempted) > 0 ||
		len(s.notProcessed) > 0 || len(s.save) > 0 || len(s.await) > 0 || len(s.awaitEnd) > 0
}

// Watching returns the push registrations whose watchdog is armed.
func (s *Scheduler) Watching() int { return len(s.watch) }

// Held returns the producer requests whose blocks are held.
func (s *Scheduler) Held() int { return len(s.held) }

type deadlineEntry struct {
	at time.Time
	id string
}

type deadlineHeap []deadlineEntry

func (h deadlineHeap) Len() int           { return len(h) }
func (h deadlineHeap) Less(i, j int) bool { return h[i].at.Before(h[j].at) }
func (h deadlineHeap) Swap(i, j int)      { h[i], h[j] = h[j], h[i] }
func (h *deadlineHeap) Push(x any)        { *h = append(*h, x.(deadlineEntry)) }
func (h *deadlineHeap) Pop() any {
	old := *h
	e := old[len(old)-1]
	*h = old[:len(old)-1]
	return e
}
