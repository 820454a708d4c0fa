package kvxfer

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// Role is the side of a transfer an engine plays for a request.
type Role uint8

const (
	// RoleProducer is P: it computes the prefill and owns the source KV.
	RoleProducer Role = iota + 1
	// RoleConsumer is D: it decodes and owns the destination blocks.
	RoleConsumer
)

func (r Role) String() string {
	switch r {
	case RoleProducer:
		return "producer"
	case RoleConsumer:
		return "consumer"
	}
	return fmt.Sprintf("Role(%d)", uint8(r))
}

// Mode is how KV moves: push (P WRITEs into blocks D registered) or pull
// (D READs blocks P holds under a lease).
type Mode uint8

const (
	// ModePush: D registers its blocks with P; P WRITEs (SPEC §7).
	ModePush Mode = iota + 1
	// ModePull: P leases its blocks; D READs them (SPEC §8).
	ModePull
)

func (m Mode) String() string {
	switch m {
	case ModePush:
		return "push"
	case ModePull:
		return "pull"
	}
	return fmt.Sprintf("Mode(%d)", uint8(m))
}

// FinishStatus is why an engine finished a request.
type FinishStatus uint8

const (
	// FinishStopped: a stop condition (EOS, stop string) ended the request.
	FinishStopped FinishStatus = iota + 1
	// FinishLengthCapped: the length limit ended the request.
	FinishLengthCapped
	// FinishAborted: the client or the engine aborted the request.
	FinishAborted
	// FinishError: the engine failed the request.
	FinishError
	// FinishPreempted is not a finish: a layer-wise producer whose prefill
	// step was listed (Scheduler.Prefill) was preempted by its engine, its
	// blocks freed. Its pairing with its consumer carries over: the
	// workers write nothing more from the freed blocks, and write every
	// layer again from the blocks of its next prefill (or its finish), into
	// the same consumer blocks. See Scheduler.RequestFinished.
	FinishPreempted
)

func (s FinishStatus) String() string {
	switch s {
	case FinishStopped:
		return "stopped"
	case FinishLengthCapped:
		return "length_capped"
	case FinishAborted:
		return "aborted"
	case FinishError:
		return "error"
	case FinishPreempted:
		return "preempted"
	}
	return fmt.Sprintf("FinishStatus(%d)", uint8(s))
}

// normal reports whether blocks of a request finished this way are kept
// for a transfer (the reference's LENGTH_CAPPED or STOPPED).
func (s FinishStatus) normal() bool { return s == FinishStopped || s == FinishLengthCapped }

// TransferParams are the reference's kv_transfer_params: what a request
// carries between engines through the router. P's Scheduler returns them
// from RequestFinished; the router hands them to D with the request.
type TransferParams struct {
	// TransferID, set by the router, names the transfer on both engines.
	// When present it is the only key P and D are matched by. A pull
	// producer's params (RequestFinished) name a hold the router gave
	// none by one of the hold's own, which its consumer echoes.
	TransferID string
	// DoRemotePrefill is set on a request D must receive KV for;
	// DoRemoteDecode on a request P must keep KV for.
	DoRemotePrefill, DoRemoteDecode bool
	// RemoteEngineID, RemoteAddr and RemoteRequestID name the other engine,
	// how its kvxferd is reached, and the request's id there.
	RemoteEngineID, RemoteAddr, RemoteRequestID string
	// RemoteBlockIDs are the other side's logical block ids per cache
	// group (pull: P's blocks for D to READ).
	RemoteBlockIDs []topology.Span
	// RemoteTPSize and RemotePPSize are the other engine's parallelism
	// (0 means 1).
	RemoteTPSize, RemotePPSize int
	// RemoteNumTokens is how many tokens of KV the other side holds.
	RemoteNumTokens int
	// RemoteBlocksExpiry is when the other side frees its blocks, on its
	// scheduler clock (bidirectional pull only; zero: no expiry).
	RemoteBlocksExpiry time.Time
	// Mode is the transfer mode the sender used.
	Mode Mode
	// RemoteGeneration is the producer engine's generation when it issued
	// these params (pull: SchedulerConfig.Generation; 0: unknown, as from
	// an older build). Its consumer handshakes again before reading when
	// its loaded handshake is of another generation, and does not read
	// blocks these params name from another generation of the engine
	// (they may hold another request's KV since it restarted).
	RemoteGeneration uint64
}

// Request is what the Scheduler needs of an engine's request. The engine
// owns it; the Scheduler updates Params in place as the reference does
// (DoRemotePrefill is consumed once the transfer is staged).
type Request struct {
	ID           string
	PromptTokens int
	Params       *TransferParams
}

// RemoteRef names the other side of a transfer in per-step metadata.
type RemoteRef struct {
	EngineID, Addr, ReqID string
	TPSize, PPSize        int
	// Blocks are the other side's block lists (pull: P's lists to READ,
	// as its engine handed them to P in the SendReq: the hold check of
	// params without a generation compares them with those exactly;
	// empty in push).
	Blocks []topology.Span
	// Tokens is the number of KV tokens the producer holds (0: unbounded).
	Tokens int
	// Expiry is when the remote blocks are freed, on the remote
	// scheduler's clock (zero: unknown).
	Expiry time.Time
	// Generation is the producer engine's generation its params were
	// issued under (TransferParams.RemoteGeneration; 0: unknown).
	Generation uint64
}

// RecvReq is a request a rank must receive KV for (SPEC §1 reqs_to_recv):
// pull D READs it; push D registers Local with P and waits for the WRITE.
// An empty Local means nothing is transferred (full prefix hit, or an
// abort before the request was scheduled): the producer is told at once
// so it frees its blocks.
type RecvReq struct {
	ReqID      string
	TransferID string
	// Local are this engine's logical block lists per group, each with the
	// token index of its first block.
	Local  []topology.Span
	Remote RemoteRef
	// Aborted marks an abort before the request was scheduled.
	Aborted bool
	// Tokens is how many tokens of KV the engine takes as loaded once the
	// transfer ends, from token 0 (its allocation's computed and external
	// tokens; 0: unsaid). A push registration carries it: a producer that
	// holds fewer refuses it, since its WRITE would leave the blocks past
	// its tokens as they were, taken as loaded (pull checks the same at
	// the allocation, against the params' RemoteNumTokens).
	Tokens int
	// Deadline is when a push consumer gives up waiting for the producer
	// (the registration watchdog); on this engine's scheduler clock (zero:
	// none), never the remote's. A pull read is also bounded by
	// Remote.Expiry, which the worker moves onto its clock with the
	// handshake's clock offset.
	Deadline time.Time
}

// SendReq is a request a producer holds blocks for after it finished (SPEC
// §1 reqs_to_send plus push_finished_blocks): its lease deadline on the
// scheduler clock and, for push, the blocks to WRITE.
type SendReq struct {
	ReqID      string
	TransferID string
	Deadline   time.Time
	// Blocks are the producer's logical block lists per group.
	Blocks []topology.Span
	// Tokens is the number of KV tokens held (remote_num_tokens).
	Tokens int
}

// SaveReq names new blocks a producer must save to its host buffer this
// step (SPEC §11 reqs_to_save).
type SaveReq struct {
	ReqID  string
	Blocks [][]topology.BlockID
}

// StepMeta is the per-step metadata the Scheduler builds and every worker
// rank consumes (SPEC §1). Each build drains what it reports.
type StepMeta struct {
	// Step numbers builds from 1.
	Step uint64
	// SchedulerClock is the scheduler's clock at build time; deadlines in
	// this metadata are on it. Zero means "do not rebase".
	SchedulerClock time.Time
	Recv           []RecvReq
	Send           []SendReq
	// Prefill lists, for layer-wise push, the producer requests whose
	// prefill completes in this step, with their blocks (Scheduler.Prefill
	// stages them, with SchedulerConfig.Layerwise): the worker
	// WRITEs each layer as soon as Worker.LayerSaved reports it, before
	// the request finishes (Deadline is ignored; the lease starts with
	// the request's SendReq).
	Prefill []SendReq
	Save    []SaveReq
	// InBatch lists the transfer requests allocated this step.
	InBatch []string
	// NotProcessed lists producer requests that finished abnormally; their
	// blocks are freed at once. It applies before Prefill and Send: a
	// request id listed there too names a new request under the id of the
	// one that ended (Scheduler.RequestFinished drops a Prefill entry
	// staged before its request's own finish, so it is never listed).
	NotProcessed []string
	// NotProcessedTransferIDs maps those of NotProcessed that carry a
	// transfer id to it, so that consumer ranks that registered by transfer
	// id alone hear of the abort at once.
	NotProcessedTransferIDs map[string]string
	// Preempted lists layer-wise producer requests listed in an earlier
	// step's Prefill that their engine preempted (their blocks are freed):
	// nothing more is written from those blocks, and the request, still
	// paired with its consumer, writes every layer again from the blocks
	// of its next Prefill entry or its SendReq. It applies after
	// NotProcessed and before Prefill and Send.
	Preempted []string
	// Await lists pull consumer requests that arrived (Scheduler.
	// NewRequest) and wait in the engine's queue, not allocated yet: the
	// ranks heartbeat their producers from now on (the producer's hold
	// lapses otherwise while they wait), until the request's RecvReq
	// takes over or AwaitEnd names it. Each carries no blocks.
	Await []AwaitReq
	// AwaitEnd lists requests of an earlier step's Await that ended
	// before they were allocated (finished, aborted, or allocated with
	// nothing to read): their heartbeats stop. It applies before Await
	// and Recv.
	AwaitEnd []string
}

// AwaitReq is a pull consumer request waiting in its engine's queue for
// the producer hold its params name (StepMeta.Await).
type AwaitReq struct {
	ReqID      string
	TransferID string
	// Remote names the producer and its request (no blocks).
	Remote RemoteRef
}

// Result is a terminal outcome kind.
type Result uint8

const (
	// ResultDone: every byte moved (or none had to).
	ResultDone Result = iota + 1
	// ResultFailed: the transfer could not complete; Outcome.Reason says why.
	ResultFailed
	// ResultExpired: a lease or registration deadline passed first.
	ResultExpired
	// ResultAborted: the engine aborted the request.
	ResultAborted
)

func (r Result) String() string {
	switch r {
	case ResultDone:
		return "done"
	case ResultFailed:
		return "failed"
	case ResultExpired:
		return "expired"
	case ResultAborted:
		return "aborted"
	}
	return fmt.Sprintf("Result(%d)", uint8(r))
}

// Outcome is the one terminal outcome of a request on one side. When it
// is reported, no transfer into or out of the request's blocks on this
// rank can still land.
type Outcome struct {
	ReqID  string
	Result Result
	// Kind says why a failed or expired outcome did not complete
	// (FailureNone for done and aborted ones).
	Kind   FailureKind
	Reason string
}

// Finished is what a rank reports after a step (SPEC §1 KVConnectorOutput):
// requests whose blocks may be freed, and blocks whose contents are bad.
type Finished struct {
	// Sending are producer requests whose blocks may be freed.
	Sending []Outcome
	// Recving are consumer requests whose transfer ended.
	Recving []Outcome
	// InvalidBlocks are logical block ids (of group 0) of failed receives
	// whose contents must not be used.
	InvalidBlocks []topology.BlockID
}

// maxKeptOutcomes bounds the lists Clear keeps for reuse: past a burst
// bigger than that, they go.
const maxKeptOutcomes = 4096

// Clear empties f's lists, keeping their memory (up to 4096 entries each;
// bigger lists go) for appending to again, as AppendFinished does.
func (f *Finished) Clear() {
	f.Sending, f.Recving = reuseOutcomes(f.Sending), reuseOutcomes(f.Recving)
	if cap(f.InvalidBlocks) > maxKeptOutcomes {
		f.InvalidBlocks = nil
	}
	f.InvalidBlocks = f.InvalidBlocks[:0]
}

func reuseOutcomes(os []Outcome) []Outcome {
	if cap(os) > maxKeptOutcomes {
		return nil
	}
	clear(os) // their strings
	return os[:0]
}

// Clone returns a deep copy of m: no slice of the copy shares memory with
// m, so either may be modified without affecting the other. Nil slices
// stay nil. Clone of a nil StepMeta is nil.
func (m *StepMeta) Clone() *StepMeta {
	if m == nil {
		return nil
	}
	c := *m
	c.Recv = cloneEach(m.Recv, func(r RecvReq) RecvReq {
		r.Local = cloneSpans(r.Local)
		r.Remote.Blocks = cloneSpans(r.Remote.Blocks)
		return r
	})
	c.Send = cloneEach(m.Send, cloneSendReq)
	c.Prefill = cloneEach(m.Prefill, cloneSendReq)
	c.Save = cloneEach(m.Save, func(s SaveReq) SaveReq {
		s.Blocks = cloneEach(s.Blocks, slices.Clone[[]topology.BlockID])
		return s
	})
	c.InBatch = slices.Clone(m.InBatch)
	c.NotProcessed = slices.Clone(m.NotProcessed)
	c.NotProcessedTransferIDs = maps.Clone(m.NotProcessedTransferIDs)
	c.Await = slices.Clone(m.Await)
	c.AwaitEnd = slices.Clone(m.AwaitEnd)
	c.Preempted = slices.Clone(m.Preempted)
	return &c
}

func cloneSendReq(s SendReq) SendReq {
	s.Blocks = cloneSpans(s.Blocks)
	return s
}

func cloneSpans(spans []topology.Span) []topology.Span {
	return cloneEach(spans, func(s topology.Span) topology.Span {
		s.IDs = slices.Clone(s.IDs)
		return s
	})
}

// cloneEach copies s (nil stays nil) and applies deep to every element.
func cloneEach[T any](s []T, deep func(T) T) []T {
	if s == nil {
		return nil
	}
	out := make([]T, len(s))
	for i, v := range s {
		out[i] = deep(v)
	}
	return out
}
