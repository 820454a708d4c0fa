package kvxfer

import (
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/kvxfer/kvxfer/topology"
)

// ErrIncompatibleLayouts is why a peer engine is refused at handshake
// when KV cannot move between its ranks' layouts and this rank's: every
// request that needs it fails at once with an error that matches this one
// and names both layouts (see WorkerConfig.MaxSegments).
var ErrIncompatibleLayouts = errors.New("kvxfer: incompatible KV layouts")

// The roles a rank plays toward a peer engine, as an index.
const (
	asProducer = iota // this rank is the source: a push producer
	asConsumer        // the peer is the source: a consumer, push or pull
	numRoles
)

var roleNames = [numRoles]string{"producer", "consumer"}

// layoutError is a refusal: KV cannot move from the src rank to the dst
// rank. It matches ErrIncompatibleLayouts and wraps topology's reason.
type layoutError struct {
	src, dst             string // "engine P rank tp 0 pp 0"
	srcLayout, dstLayout string // describeLayout
	maxSegments          int
	err                  error
}

func (e *layoutError) Unwrap() []error { return []error{ErrIncompatibleLayouts, e.err} }

func (e *layoutError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%v: producer %s [%s] -> consumer %s [%s]: ", ErrIncompatibleLayouts, e.src, e.srcLayout, e.dst, e.dstLayout)
	var seg *topology.SegmentsError
	if errors.As(e.err, &seg) {
		fmt.Fprintf(&b, "exact placement needs more than %d descriptors per %d-token unit of region %d; "+
			"make both engines use the same KV cache layout (HND on both, as vLLM sets it for P/D disaggregation), "+
			"or raise the bound on both engines (WorkerConfig.MaxSegments, kvxferd -max-segments or KVXFERD_MAX_SEGMENTS; now %d) "+
			"at the cost of up to that many descriptors per block", seg.Max, seg.UnitTokens, seg.Region, e.maxSegments)
		return b.String()
	}
	fmt.Fprintf(&b, "%v; the engines' KV caches must agree on what it names (same model and cache configuration; "+
		"KV layout and packing may differ)", e.err)
	return b.String()
}

// describeLayout renders what decides whether two layouts are compatible
// in a compact, human-readable form.
func describeLayout(l *topology.Layout) string {
	var b strings.Builder
	if l.KVLayout != 0 {
		fmt.Fprintf(&b, "%v/%v, ", l.KVLayout, l.Packing)
	}
	fmt.Fprintf(&b, "block %d", l.LogicalBlockSize)
	if l.KernelBlockSize != l.LogicalBlockSize {
		fmt.Fprintf(&b, " (kernel %d)", l.KernelBlockSize)
	}
	if l.HeadSize > 0 {
		fmt.Fprintf(&b, ", head size %d", l.HeadSize)
	}
	if l.TotalKVHeads > 0 {
		fmt.Fprintf(&b, ", %d KV heads", l.TotalKVHeads)
	}
	fmt.Fprintf(&b, ", TP %d", l.TPSize)
	if l.PPSize > 1 {
		fmt.Fprintf(&b, ", PP %d", l.PPSize)
	}
	return b.String()
}

func rankName(engine string, r rankRef) string {
	return fmt.Sprintf("engine %s rank tp %d pp %d", engine, r.tp, r.pp)
}

func (st *loopState) planOptions() topology.PlanOptions {
	return topology.PlanOptions{MaxSegments: st.cfg.MaxSegments}
}

// checkPlans builds, when a handshake with e completes, the plans between
// this rank and every peer rank it exchanges with, in both directions,
// and records why a direction is refused. A refused direction fails every
// request that needs it at once (refusal); the other works as usual.
// Both directions are checked because a rank may be a producer for some
// requests and a consumer for others; which one it is for e is known only
// once a request needs e, which is when a refusal is logged and counted.
func (st *loopState) checkPlans(e *engine) {
	e.refused, e.refusalSeen = [numRoles]error{}, [numRoles]bool{}
	local := rankRef{tp: st.layout.TPRank, pp: st.layout.PPRank}
	anyPeer := func() rankRef {
		if refs := sortedRefs(e.peers); len(refs) > 0 {
			return refs[0]
		}
		return rankRef{}
	}
	// As a consumer: every producer rank we take KV from must place it in
	// our layout.
	targets, err := st.targets(e.tpSize, e.ppSize)
	if err != nil {
		e.refused[asConsumer] = st.layoutError(e, anyPeer(), local, err, asConsumer)
	}
	for _, to := range targets {
		sl := e.layouts[to]
		if sl == nil {
			continue // a rank the peer lacks fails its requests as before
		}
		if st.cfg.Mode == ModePull {
			_, err = st.plan(e, to, local.tp) // the plan READs use: cache it
		} else {
			_, err = topology.NewPlan(sl, st.layout, st.planOptions())
		}
		if err != nil {
			e.refused[asConsumer] = st.layoutError(e, to, local, err, asConsumer)
			break
		}
	}
	if e.refused[asConsumer] == nil {
		// The producer's stages, checked one by one above, must between
		// them hold each of our regions once.
		if err := st.checkStages(e, targets); err != nil {
			e.refused[asConsumer] = err
		}
	}
	if st.cfg.Mode != ModePush {
		return // a pull producer builds no plan: its consumers do
	}
	// As a push producer: we WRITE into the consumer ranks we serve.
	tps, err := topology.TargetRanks(nil, st.layout.TPSize, e.tpSize, st.layout.TPRank)
	if err != nil {
		e.refused[asProducer] = st.layoutError(e, local, anyPeer(), err, asProducer)
	}
	for _, tp := range tps {
		if e.layouts[rankRef{tp: tp}] == nil {
			continue
		}
		if _, err := st.plan(e, local, tp); err != nil {
			e.refused[asProducer] = st.layoutError(e, local, rankRef{tp: tp}, err, asProducer)
			break
		}
	}
}

// checkStages checks, for each producer TP rank we take KV from, that
// its pipeline stages hold our regions exactly once (topology.CheckStages).
// A rank the peer lacks is left to fail its requests as before.
func (st *loopState) checkStages(e *engine, targets []rankRef) error {
	stages := make([]*topology.Layout, e.ppSize)
	for _, to := range targets {
		if to.pp != 0 {
			continue
		}
		for pp := range stages {
			stages[pp] = e.layouts[rankRef{pp: pp, tp: to.tp}]
		}
		if slices.Contains(stages, nil) {
			continue
		}
		if err := topology.CheckStages(stages, st.layout); err != nil {
			return st.layoutError(e, to, rankRef{tp: st.layout.TPRank, pp: st.layout.PPRank}, err, asConsumer)
		}
	}
	return nil
}

// layoutError describes a refusal between this rank and peer rank peer
// of e: src and dst are the producer and consumer ranks (one of them is
// this rank, as role says).
func (st *loopState) layoutError(e *engine, src, dst rankRef, err error, role int) error {
	le := &layoutError{maxSegments: st.cfg.MaxSegments, err: err}
	if le.maxSegments == 0 {
		le.maxSegments = topology.DefaultMaxSegments
	}
	self, peer := rankName(st.cfg.EngineID, rankRef{tp: st.layout.TPRank, pp: st.layout.PPRank}), "engine "+e.id
	selfL, peerL := describeLayout(st.layout), "layout unknown"
	if role == asProducer {
		if pl := e.layouts[dst]; pl != nil {
			peer, peerL = rankName(e.id, dst), describeLayout(pl)
		}
		le.src, le.srcLayout, le.dst, le.dstLayout = self, selfL, peer, peerL
	} else {
		if pl := e.layouts[src]; pl != nil {
			peer, peerL = rankName(e.id, src), describeLayout(pl)
		}
		le.src, le.srcLayout, le.dst, le.dstLayout = peer, peerL, self, selfL
	}
	return le
}

// refusal returns why e is refused in role (nil: it is not), logging and
// counting the refusal the first time a request needs e in that role,
// once per handshake (peer generation).
func (st *loopState) refusal(e *engine, role int) error {
	err := e.refused[role]
	if err == nil || e.refusalSeen[role] {
		return err
	}
	e.refusalSeen[role] = true
	st.metrics.BadInput("handshake.layout")
	st.log.Warn("kvxfer: peer engine refused: incompatible KV layouts; every request with it in this role fails",
		"failure_type", "handshake_setup_failed", "engine", e.id, "generation", e.gen, "role", roleNames[role], "err", err)
	return err
}
