package kvxfer

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/topology"
)

// FuzzCores drives the cores of a producer engine and a consumer engine,
// one per rank, wired by a simulated fabric, through an order of events
// and faults the input picks: steps arriving (at each rank in its own
// time), layers saved, aborts, handshakes answered late or failing, an
// engine restarting (its ranks answer with a new generation and new
// agents), notifications delivered out of order, lost or twice, posts and
// notifications refused, transfers failing, time passing.
//
// The input's first byte says what is simulated. Below 0x40 it is the
// first format, kept so that its corpus entries replay as they did: push,
// TP 1:1, one block per request, transfer ids set, no restart, no grants.
// From 0x40 on it picks the mode (push, pull, layer-wise push), the TP
// sizes (1:1, P 1 with D 2, P 2 with D 1), whether the data plane's
// grants are in force, and the number of requests; a byte per request
// then picks its transfer id (or none), how D names P's request (its id,
// nothing, or its base id), its base id (two requests may share one) and
// its blocks (one to three).
//
// Memory is modelled byte by byte. Each producer request's blocks hold
// bytes unique to it (to its rank and position; a layer-wise layer only
// once saved); a transfer copies them when it lands; a consumer
// request's blocks start blank; engines reuse a request's blocks once
// every rank reported it. With grants, the simulated driver applies the
// cores' grant ops to a model of the Worker's table (per block and peer,
// as accessTable keeps them) and refuses what it refuses.
//
// At every step it checks fencing: a consumer rank reports a request
// only when nothing it posted (a READ) or granted (a WRITE, without
// grants) can still land in its blocks, and with grants only after it
// revoked its grant; a producer rank only when none of its WRITEs still
// reads its blocks, and with grants (pull) after it let go its hold; no
// WRITE is posted into a consumer's blocks after the producer confirmed
// that request's cancel. Every transfer that lands must read the blocks
// of the request it is for (not blocks a producer released) and land in
// the blocks of the request it is for, before that rank reported it. A
// consumer rank that reports a request done holds, in every byte of its
// blocks, bytes of one producer request the pairing rule allows (its
// transfer id's, the one it names, or, by base id, one of that base),
// each once; across its ranks, all of them. At the end, with every
// message delivered and time run out, each request has exactly one
// outcome on each rank that was handed it, and none more ever.
//
// Documented limits, not checked: without grants, a consumer whose fence
// timed out reports while a WRITE may still land; a pull READ that names
// no producer request (the consumer does not know its id), reaching the
// producer after its lease ran out (or its abort, or its restart), may
// read blocks the engine reused (simREADLate). With grants a WRITE is
// admitted only for the consumer request it names and a READ only where
// the producer request it names holds the blocks.
//
// -coresim.v logs what the simulated ranks post, land, hold and report:
// go test ./kvxfer -run FuzzCores/NAME -coresim.v -v.
func FuzzCores(f *testing.F) {
	for _, in := range coreSimSeeds() {
		f.Add(in)
	}
	f.Fuzz(func(t *testing.T, in []byte) {
		s := newCoreSim(t, in)
		for !s.done() {
			s.event()
		}
		s.drain()
		s.checkAll()
	})
}

// coreSimSeeds are FuzzCores' seeds: the first format's, then scripts
// of the second that exercise each of its dimensions (TestCoreSimSeeds
// checks that they do). The drain at the end runs every request
// through, so each lands bytes and checks them.
func coreSimSeeds() [][]byte {
	// The first format (push, TP 1:1, one block, transfer ids).
	seeds := [][]byte{
		{},
		{1, 0, 2, 0, 3, 0, 4, 0, 5, 0, 6, 0},
		{3, 2, 1, 0, 9, 9, 9, 7, 7, 7, 4, 4, 4, 8, 8, 2, 2, 5, 5},
		{0, 1, 0, 1, 0, 1, 10, 3, 11, 6, 12, 5, 13, 2, 7, 7, 1, 1},
	}
	const (
		tp11, tp12, tp21 = 0, 1, 2 // P TP : D TP
		a, b             = 0, 1    // base ids
	)
	tid := simReqByte(true, simNameID, a, 1)
	scripts := []*simScript{
		// Every mode and TP pair, with and without grants; ranks taking
		// their steps at different times.
		newSimScript(simPull, tp11, false, simReqByte(true, simNameID, a, 2), simReqByte(false, simNameID, b, 1)),
		newSimScript(simPull, tp12, true, tid, simReqByte(false, simNameID, a, 3)).
			send(1).recv(1).hs().hs().deliver(0).land(0).wait(40).wait(40).wait(40),
		newSimScript(simPull, tp21, true, tid, simReqByte(true, simNameID, b, 2), simReqByte(false, simNameID, a, 3)).
			send(1).send(2).sendLag(3, 1).recv(1).recv(2).hs().hs().land(1).catchUp("P", 1).recv(3).hs().land(0).land(2).wait(8),
		newSimScript(simLayer, tp11, false, simReqByte(true, simNameID, a, 2), tid).
			send(1).recv(1).hs().hs().deliver(0).save(0, 0, 0).land(0).save(0, 0, 1).land(0).send(1),
		newSimScript(simLayer, tp12, true, simReqByte(true, simNameID, a, 3), tid).
			send(1).recvLag(1, 1).hs().hs().deliver(0).save(0, 0, 1).catchUp("D", 1).deliver(0).deliver(0).save(0, 0, 0).land(0).land(0),
		newSimScript(simLayer, tp21, false, tid, simReqByte(true, simNameID, b, 2), simReqByte(false, simNameID, a, 1)).
			send(1).send(2).recv(1).hs().hs().hs().save(0, 1, 0).save(0, 0, 0).deliver(0).deliver(0).abort(2).save(0, 1, 1),
		newSimScript(simPush, tp12, false, tid, simReqByte(true, simNameID, a, 3), simReqByte(true, simNameID, b, 2)).
			recvLag(1, 2).send(1).hs().hs().catchUp("D", 0).deliver(1).deliver(0).land(0),
		newSimScript(simPush, tp21, true, tid, simReqByte(true, simNameID, a, 3), simReqByte(true, simNameID, b, 2)).
			sendLag(1, 1).recv(1).hs().hs().hs().deliver(0).deliver(0).catchUp("P", 1).land(0).failPost("P").send(2).recv(2),
		// No transfer ids, base ids shared. Exact beats base: D1 names
		// nothing (its base pairs), D2 names P2; P2 arrives with both
		// waiting, and must take D2's blocks; then P1 takes D1's.
		newSimScript(simPush, tp11, false, simReqByte(false, simNameNone, a, 1), simReqByte(false, simNameID, a, 2)).
			recv(1).recv(2).hs().deliver(0).deliver(0).hs().send(2).send(1),
		newSimScript(simPush, tp12, true, simReqByte(false, simNameNone, a, 2), simReqByte(false, simNameID, a, 2), simReqByte(false, simNameBase, b, 1)).
			recv(1).recv(2).recv(3).hs().deliver(0).deliver(0).deliver(0).deliver(0).deliver(0).deliver(0).hs().send(2).send(1).send(3),
		newSimScript(simLayer, tp21, true, simReqByte(false, simNameNone, a, 1), simReqByte(false, simNameID, a, 1)).
			recv(1).recv(2).hs().deliver(0).deliver(0).hs().hs().send(2).send(1),
		// Ambiguous: two consumer requests that name nothing share a base
		// with a producer request: nothing is guessed, both fail.
		newSimScript(simPush, tp11, false, simReqByte(false, simNameNone, a, 1), simReqByte(false, simNameNone, a, 1), tid).
			recv(1).recv(2).hs().deliver(0).deliver(0).hs().send(1).send(3).recv(3),
		// Restarts: the producer with WRITEs in flight (grants), the
		// consumer with registrations out; pull's producer with READs.
		newSimScript(simPush, tp11, true, tid, simReqByte(true, simNameID, b, 2)).
			recv(1).send(1).hs().hs().deliver(0).restart("P").wait(8).hs().hs().hs().recv(2).send(2).hs().hs(),
		newSimScript(simPush, tp12, false, tid, simReqByte(false, simNameID, b, 1)).
			recv(1).send(1).hs().hs().deliver(0).deliver(0).restart("D").send(2).recv(2).hs().hs().hs(),
		newSimScript(simPull, tp21, true, tid, simReqByte(true, simNameID, b, 2)).
			send(1).recv(1).hs().land(0).restart("P").wait(8).hs().hs().hs().send(2).recv(2).hs(),
		// Without grants, the producer restarts (its process, and every
		// WRITE it had posted, gone) while the consumer waits: a notice
		// to its old agent says its process exited, and the consumer
		// fences it without the confirmation nobody can send.
		newSimScript(simPush, tp21, false, tid, simReqByte(true, simNameID, b, 2)).
			recv(1).send(1).hs().hs().deliver(0).deliver(0).restart("P").wait(40).wait(40).hs().hs().recv(2).send(2).hs().hs(),
		// The producer falls silent with a WRITE in flight: the consumer
		// gives up and, grants or not, waits for its confirmation (the
		// engine would register the blocks again with it).
		newSimScript(simPush, tp11, true, tid, simReqByte(true, simNameID, b, 2)).
			recv(1).send(1).hs().deliver(0).hs().wait(24).hsFail().land(0).recv(2).send(2),
		// The producer falls silent with a READ in flight: the consumer
		// gives it up, and its bytes land while it is being released.
		newSimScript(simPull, tp11, true, tid, simReqByte(true, simNameID, b, 2)).
			send(1).recv(1).hs().hs().wait(24).hsFail().land(0).send(2).recv(2),
		// A READ reaches a producer rank that has not taken the step
		// holding the blocks yet: refused by the grants, read again.
		newSimScript(simPull, tp21, true, tid, simReqByte(false, simNameID, b, 2)).
			sendLag(1, 1).recv(1).hs().land(0).land(0).wait(1).catchUp("P", 1).wait(1).land(0).send(2).recv(2),
		// Layer-wise preemption: with a layer's WRITE in flight, prefilled
		// again in new blocks (the freed ones taken by another request
		// sharing its first step), a late signal of the first attempt's
		// step; every layer written again before the consumer is done.
		newSimScript(simLayer, tp11, false, tid|0xc0, tid).
			send(1).recv(1).recv(2).hs().hs().deliver(0).deliver(0).save(0, 0, 0).preempt(1).ev(0, 0, 0, 0).
			save(0, 0, 0x30).land(0).save(1, 0, 0).save(1, 0, 1).land(0).land(0).send(2).send(1),
		// Aborts, failures and time.
		newSimScript(simLayer, tp21, true, tid, tid, tid).
			send(1).recv(1).abort(2).hs().hs().deliver(0).failNotify("D").save(0, 1, 0).landFail(0).wait(40).wait(40).send(3).recv(3),
	}
	for _, sc := range scripts {
		seeds = append(seeds, sc.b)
	}
	return seeds
}

// TestCoreSimSeeds checks that FuzzCores' seeds exercise what they are
// there for: bytes landed and checked in every mode and TP pair, with
// grants and without, requests paired by base id and refused as
// ambiguous, writes refused by the grants, each engine restarting, layers
// saved, aborts, ranks taking a step late.
func TestCoreSimSeeds(t *testing.T) {
	got := map[string]int{}
	for i, in := range coreSimSeeds() {
		s := newCoreSim(t, in)
		s.stats = map[string]int{}
		for !s.done() {
			s.event()
		}
		s.drain()
		s.checkAll()
		if !s.legacy && s.stats[s.checkedKey()] == 0 {
			t.Errorf("seed %d (%x) checks no consumer's bytes", i, in)
		}
		for k, n := range s.stats {
			got[k] += n
		}
	}
	var want []string
	for mode := range 3 {
		for _, tp := range simTP {
			want = append(want, fmt.Sprintf("bytes checked, mode %d, TP %d:%d", mode, tp[0], tp[1]))
		}
		for _, g := range []bool{false, true} {
			want = append(want, fmt.Sprintf("bytes checked, mode %d, grants %v", mode, g))
		}
	}
	want = append(want, "paired by base id", "ambiguous pairing refused", "refused by grants", "restart P", "restart D",
		"layer saved", "aborted", "rank caught up", "abandoned transfer landed", "writer exited", "preempted", "prefilled again",
		"prefills share a step", "stale layer signal")
	for _, k := range want {
		if got[k] == 0 {
			t.Errorf("no seed exercises %q", k)
		}
	}
	if t.Failed() {
		t.Logf("the seeds exercise %v", got)
	}
}

func (s *coreSim) checkedKey() string {
	return fmt.Sprintf("bytes checked, mode %d, TP %d:%d", s.mode, s.p.tp, s.d.tp)
}

// How a consumer request names its producer request (without a
// transfer id): by its id, by nothing (its own id's base pairs), or by
// its base id.
const (
	simNameID = iota
	simNameNone
	simNameBase
)

// simReqByte is the byte of a request in an input of the second format.
func simReqByte(tid bool, naming, base, blocks int) byte {
	b := byte(naming<<1 | base<<3 | (blocks-1)<<4)
	if tid {
		b |= 1
	}
	return b
}

// simScript writes an input of the second format, event by event.
type simScript struct {
	ptp, dtp int
	b        []byte
}

func newSimScript(mode, tp int, grants bool, reqs ...byte) *simScript {
	return &simScript{ptp: simTP[tp][0], dtp: simTP[tp][1], b: append([]byte{simHeader(mode, tp, grants, len(reqs))}, reqs...)}
}

func (s *simScript) ev(b ...byte) *simScript {
	s.b = append(s.b, b...)
	return s
}

// send: P's engine steps request i (layer-wise: prefill, then finish);
// every rank takes it at once (sendLag: the ranks in mask).
func (s *simScript) send(i int) *simScript               { return s.sendLag(i, 0xff) }
func (s *simScript) sendLag(i int, mask byte) *simScript { return s.stepOn(s.ptp, byte(i-1), 0, mask) }
func (s *simScript) recv(i int) *simScript               { return s.recvLag(i, 0xff) }
func (s *simScript) recvLag(i int, mask byte) *simScript { return s.stepOn(s.dtp, byte(i-1), 1, mask) }

func (s *simScript) stepOn(tp int, i, side, mask byte) *simScript {
	s.ev(0, i, side)
	if tp > 1 {
		s.ev(mask)
	}
	return s
}

func (s *simScript) hs() *simScript                { return s.ev(9, 1) }
func (s *simScript) hsFail() *simScript            { return s.ev(9, 0) }
func (s *simScript) deliver(pick byte) *simScript  { return s.ev(2, pick) }
func (s *simScript) land(pick byte) *simScript     { return s.ev(7, pick, 1) }
func (s *simScript) landFail(pick byte) *simScript { return s.ev(7, pick, 0) }
func (s *simScript) wait(quarters byte) *simScript { return s.ev(12, quarters-1) }
func (s *simScript) save(pick, rank, layer byte) *simScript {
	return s.ev(14, pick, rank, layer)
}
func (s *simScript) abort(i int) *simScript              { return s.ev(15, byte(i-1)) }
func (s *simScript) preempt(i int) *simScript            { return s.ev(18, byte(i-1)) }
func (s *simScript) restart(engine string) *simScript    { return s.ev(16, simEngineByte(engine)) }
func (s *simScript) failNotify(engine string) *simScript { return s.ev(10, simEngineByte(engine)) }
func (s *simScript) failPost(engine string) *simScript   { return s.ev(11, simEngineByte(engine)) }
func (s *simScript) catchUp(engine string, rank byte) *simScript {
	return s.ev(17, simEngineByte(engine), rank)
}

func simEngineByte(engine string) byte {
	if engine == "D" {
		return 1
	}
	return 0
}

var simVerbose = flag.Bool("coresim.v", false, "FuzzCores: log what the simulated ranks post, land, hold and report")

// Simulated modes.
const (
	simPush = iota
	simPull
	simLayer // layer-wise push
)

// simTP are the (P, D) TP sizes a header picks.
var simTP = [3][2]int{{1, 1}, {1, 2}, {2, 1}}

// simHeader is the first byte of an input of the second format.
func simHeader(mode, tp int, grants bool, n int) byte {
	g := 0
	if grants {
		g = 1
	}
	return byte(0x40 + mode + 3*tp + 9*g + 18*(n-1))
}

const (
	simBlocks      = 16      // blocks per region
	simRegions     = 2       // regions, one per layer
	simRegionGap   = 1 << 16 // between region bases
	simMaxRestarts = 2
	simFenceTO     = "fence timed out"
)

// simLayout is every simulated rank's layout: the traces' model (2 KV
// heads of size 4, 2-byte elements, blocks of 16 tokens) over two layers.
func simLayout(tp, tpSize int, base uint64) topology.Layout {
	l := topology.Layout{TPRank: tp, TPSize: tpSize, PPSize: 1, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2,
		KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16}
	for g := range simRegions {
		l.Regions = append(l.Regions, topology.Region{Kind: topology.KindFullAttention, Base: base + uint64(g)*simRegionGap,
			BlockLen: int64(2 * 16 * 4 * 2 * 2 / tpSize), NumBlocks: simBlocks})
	}
	return l
}

// simQuiet logs nothing: the fuzzer checks outcomes, not logs.
var simQuiet = slog.New(slog.NewTextHandler(io.Discard, &slog.HandlerOptions{Level: slog.LevelError + 1}))

// A memory cell (one per byte) holds what a producer request put there:
// its tag (which request, on which incarnation of P), the P rank and the
// byte's position in that rank's share of the request. 0: blank.
const (
	cellTagShift  = 14
	cellRankShift = 12
	cellPosMask   = 1<<cellTagShift - 1
)

// simEngine is one engine: its ranks' cores (the live incarnation's) and
// which request holds each block.
type simEngine struct {
	name, addr string
	tp         int
	gen        uint64
	base       uint64
	cores      []*simCore
	owner      [simBlocks]string
}

// simCore is one rank's core and its driver's state.
type simCore struct {
	eng   *simEngine
	rank  int
	agent PeerName
	st    *loopState
	dead  bool
	asks  []hsAsk
	queue []*StepMeta // steps the engine issued that this rank has not taken yet
	// preempting: layer-wise requests its engine preempted whose
	// preemption this rank has not taken yet.
	preempting map[string]bool
	blockLen   int
	mem        []uint32
	// The data plane's grants (guarded): a consumer's WRITE grants by
	// block, a producer's pull holds.
	writeTo [simBlocks]uint32
	grants  map[uint32]*simGrant
	held    [simBlocks]int32
	holders [simBlocks][]string // the producer requests holding each block
	// Requests this rank was handed, and what it reported.
	handed   map[string]bool
	reported map[string]int
	doneTag  map[string]uint32
	timedOut map[string]bool // consumer: reported at its fence timeout
	results  map[string]Result
	tainted  map[string]bool // pull: a READ came after the producer let go (simREADLate)
}

type simGrant struct {
	peers []PeerName
	live  bool
	dreq  string
}

// simReq is request i on both sides.
type simReq struct {
	i                   int
	pid, did, tid, name string // name: what D calls P's request
	base                string
	byTID, exact        bool // how D's registration names P's request
	nblocks             int
	batch               bool // layer-wise: its prefill step prefills the next request too, if it can
	pState              int  // 0 not stepped, 1 prefilling (layer-wise), 2 finished, 3 aborted, 4 preempted (layer-wise)
	pGen                uint64
	pStep               uint64
	oldStep             uint64 // layer-wise: the prefill step of an attempt its engine preempted
	pBlocks             []topology.BlockID
	tag                 uint32
	saved               [2][simRegions]bool // by P rank, layer
	dStepped            bool
	dGen                uint64
	dBlocks             []topology.BlockID
}

// simMsg is a notification on its way.
type simMsg struct {
	to PeerName
	n  Notif
}

// simXfer is a transfer in flight: a WRITE posted by a producer rank, or
// a READ posted by a consumer rank.
type simXfer struct {
	id     XferID // its poster's name for it
	poster *simCore
	peer   PeerName
	read   bool
	descs  []hotpath.Desc
	notif  []byte
	posted time.Time
	// stale: a layer-wise WRITE of an attempt its engine preempted (in
	// flight then, or posted before its rank took the preemption): it
	// may read blocks the engine gave another request; what it lands
	// must be written again before the consumer reports done.
	stale      bool
	preq, dreq string
	// abandoned: its poster gave it up and is releasing it; it ends
	// (landing its bytes or not) as the release returns.
	abandoned bool
}

type simAck struct {
	p, d *simCore
	dreq string
}

type coreSim struct {
	t        *testing.T
	in       []byte
	legacy   bool
	mode     int
	grants   bool
	layouts  bool
	now      time.Time
	p, d     *simEngine
	agents   map[PeerName]*simCore
	n        int
	reqs     []*simReq
	byPID    map[string]*simReq
	byDID    map[string]*simReq
	tags     []*simReq // by tag-1
	msgs     []simMsg
	xfers    []*simXfer
	acked    map[simAck]bool
	steps    int
	stepNo   uint64
	restarts int
	// faults to inject into the next ops of an engine's ranks
	failNotify, failPost map[string]int
	seen                 []bool // scratch for the byte checks
	stats                map[string]int
}

func (s *coreSim) byte() byte {
	if len(s.in) == 0 {
		return 0
	}
	b := s.in[0]
	s.in = s.in[1:]
	return b
}

func newCoreSim(t *testing.T, in []byte) *coreSim {
	s := &coreSim{t: t, in: in, now: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC), agents: map[PeerName]*simCore{},
		byPID: map[string]*simReq{}, byDID: map[string]*simReq{}, acked: map[simAck]bool{},
		failNotify: map[string]int{}, failPost: map[string]int{}}
	ptp, dtp := 1, 1
	if len(in) == 0 || in[0] < 0x40 {
		s.legacy = true
		s.n = 1 + int(s.byte())%3
	} else {
		v := int(s.byte() - 0x40)
		s.mode, ptp, dtp = v%3, simTP[v/3%3][0], simTP[v/3%3][1]
		s.grants = v/9%2 == 1
		s.n = 1 + v/18%5
	}
	// Transfers go as layouts with an even number of requests.
	s.layouts = s.n%2 == 0
	baseBlocks := map[string]int{}
	for i := 1; i <= s.n; i++ {
		r := &simReq{i: i, nblocks: 1}
		if s.legacy {
			r.pid, r.did, r.tid, r.base = fmt.Sprintf("p-%d", i), fmt.Sprintf("d-%d", i), fmt.Sprintf("t%d", i), ""
			r.name, r.byTID = r.pid, true
		} else {
			b := s.byte()
			r.base = string(rune('a' + b>>3&1))
			r.nblocks = 1 + int(b>>4)%3
			r.batch = b>>6 == 3
			r.pid, r.did = fmt.Sprintf("%s-%08x", r.base, 0xa0000000+i), fmt.Sprintf("%s-%08x", r.base, 0xd0000000+i)
			if b&1 != 0 {
				r.tid, r.byTID = fmt.Sprintf("t%d", i), true
			} else if n, ok := baseBlocks[r.base]; ok {
				// Requests a base id may pair are one request to the
				// router, suffixed by each engine: as long on both sides.
				r.nblocks = n
			} else {
				baseBlocks[r.base] = r.nblocks
			}
			switch naming := int(b >> 1 & 3); {
			case s.mode == simPull || naming == simNameID || naming == 3:
				r.name, r.exact = r.pid, true
			case naming == simNameNone:
				r.name = "" // its own id's base pairs
			default:
				r.name = r.base
			}
		}
		s.reqs = append(s.reqs, r)
		s.byPID[r.pid], s.byDID[r.did] = r, r
	}
	s.p = &simEngine{name: "P", addr: "P:1", tp: ptp, gen: 1, base: 1 << 20}
	s.d = &simEngine{name: "D", addr: "D:1", tp: dtp, gen: 1, base: 1 << 30}
	for _, e := range []*simEngine{s.p, s.d} {
		s.startEngine(e)
	}
	s.seen = make([]bool, 1<<cellTagShift)
	return s
}

// startEngine gives e a fresh core per rank, at new agents.
func (s *coreSim) startEngine(e *simEngine) {
	e.cores, e.owner = nil, [simBlocks]string{}
	mode := ModePush
	if s.mode == simPull {
		mode = ModePull
	}
	for rank := range e.tp {
		l := simLayout(rank, e.tp, e.base)
		w, err := newWorker(WorkerConfig{EngineID: e.name, Addr: e.addr, Mode: mode, Layout: l, CompatHash: "h",
			Backend: panicBackend{}, Resolver: noResolver{}, Lease: 30 * time.Second, Layerwise: s.mode == simLayer && e.name == "P",
			Logger: simQuiet, Metrics: NewMetrics()})
		if err != nil {
			s.t.Fatal(err)
		}
		w.st.init(w)
		w.st.now, w.st.guarded = s.now, s.grants
		// Transfers are posted as layouts in half the cases (as the
		// built-in backend's Workers do), as descriptors in the others.
		w.st.layouts = s.layouts
		agent := PeerName(fmt.Sprintf("%s/%d", e.name, rank))
		if e.gen > 1 {
			agent = PeerName(fmt.Sprintf("%s/%d.%d", e.name, rank, e.gen))
		}
		c := &simCore{eng: e, rank: rank, agent: agent, st: &w.st, blockLen: int(l.Regions[0].BlockLen),
			grants: map[uint32]*simGrant{}, handed: map[string]bool{}, reported: map[string]int{},
			doneTag: map[string]uint32{}, timedOut: map[string]bool{}, results: map[string]Result{}, tainted: map[string]bool{}}
		c.mem = make([]uint32, simRegions*simBlocks*c.blockLen)
		e.cores = append(e.cores, c)
		s.agents[agent] = c
	}
}

// cores are the live ranks: P's, then D's.
func (s *coreSim) cores() []*simCore {
	return append(slices.Clip(s.p.cores), s.d.cores...)
}

// step runs one input on a core and plays its driver.
func (s *coreSim) step(c *simCore, in input) {
	if c.dead {
		return
	}
	st := c.st
	st.Step(s.now, in)
	carryOut(st, nil, nil, func(_ int, o *op) error { return s.do(c, o) })
	c.asks = append(c.asks, st.fx.asks...)
	for _, id := range st.fx.releases {
		// Released at once: it never lands.
		s.xfers = slices.DeleteFunc(s.xfers, func(x *simXfer) bool { return x.poster == c && x.id == id })
	}
	for _, id := range st.fx.abandon {
		// Being released: it may still land until that returns (land).
		for _, x := range s.xfers {
			if x.poster == c && x.id == id {
				x.abandoned = true
			}
		}
	}
	st.fx.asks, st.fx.releases, st.fx.abandon, st.fx.invalidate, st.fx.unprepare = nil, nil, nil, nil, nil
	out := st.out
	st.out = Finished{}
	for _, o := range out.Sending {
		s.report(c, o)
	}
	for _, o := range out.Recving {
		s.report(c, o)
	}
}

// do carries out one op on the simulated fabric.
func (s *coreSim) do(c *simCore, o *op) error {
	name := c.eng.name
	switch o.kind {
	case opNotify:
		if s.failNotify[name] > 0 {
			s.failNotify[name]--
			return fmt.Errorf("injected notify failure")
		}
		m, err := decodeMsg(o.msg)
		if err != nil {
			s.t.Fatalf("%s sent a malformed message: %v", c.agent, err)
		}
		to := s.agents[o.peer]
		if to == nil {
			return fmt.Errorf("%w: %s", ErrUnknownPeer, o.peer)
		}
		if to.dead {
			// Its process is gone, and its transfers with it (restart):
			// as NIXL's peer watch says of a peer on this host.
			return fmt.Errorf("%w: %w: %w: %s", ErrXferFailed, ErrPeerLost, ErrPeerExited, o.peer)
		}
		if name == "P" && m.Kind == msgAck {
			s.acked[simAck{c, to, m.DReq}] = true
		}
		s.msgs = append(s.msgs, simMsg{to: o.peer, n: Notif{From: c.agent, Msg: o.msg}})
		return nil
	case opPost, opPostLayout:
		read := s.mode == simPull
		if (name == "D") != read || o.xop != opFor(c.st.cfg.Mode) {
			s.t.Fatalf("%s posted op %v in mode %d", c.agent, o.xop, s.mode)
		}
		if s.failPost[name] > 0 {
			s.failPost[name]--
			return fmt.Errorf("injected post failure")
		}
		to := s.agents[o.peer]
		if to == nil || to.dead {
			return fmt.Errorf("%w: %s", ErrUnknownPeer, o.peer)
		}
		h := c.st.handles[o.id]
		if h == nil {
			s.t.Fatalf("%s posted transfer %d it does not hold", c.agent, o.id)
		}
		var descs []hotpath.Desc
		if o.kind == opPostLayout {
			descs = c.st.fx.lays.Expand(nil, c.st.fx.lays.Spans[o.from:o.to])
		} else {
			descs = slices.Clone(c.st.fx.descs[o.from:o.to])
		}
		x := &simXfer{id: o.id, poster: c, peer: o.peer, read: read, descs: descs, notif: o.msg, posted: s.now}
		x.stale = !read && c.preempting[h.send]
		if read {
			x.dreq = h.recv
			if r := c.st.recvs[h.recv]; r != nil {
				x.preq = r.req.Remote.ReqID
			}
		} else {
			sr := c.st.sends.get(h.send)
			if sr == nil || sr.match == nil {
				s.t.Fatalf("%s posted a WRITE for %s, which it holds unmatched", c.agent, h.send)
			}
			x.preq, x.dreq = h.send, sr.match.key.dreq
			if s.acked[simAck{c, to, x.dreq}] {
				s.t.Fatalf("%s posted a WRITE into %s's blocks on %s after confirming its cancel", c.agent, x.dreq, to.agent)
			}
			if !s.grants && to.reported[x.dreq] > 0 && !to.timedOut[x.dreq] {
				s.t.Fatalf("%s posted a WRITE into %s's blocks after %s reported it", c.agent, x.dreq, to.agent)
			}
		}
		if *simVerbose {
			s.t.Logf("%v %s posts %s %d (%s/%s) to %s", s.now.Format("04:05.000"), c.agent, kindOf(x), x.id, x.preq, x.dreq, x.peer)
		}
		s.xfers = append(s.xfers, x)
		return nil
	case opGrant, opRevoke, opHold:
		if !s.grants {
			s.t.Fatalf("%s asked for grant op %d without grants", c.agent, o.kind)
		}
		switch o.kind {
		case opGrant:
			g := &simGrant{peers: slices.Clone(o.peers), live: true}
			for _, r := range c.st.recvs {
				if r.grant == o.grant {
					g.dreq = r.req.ReqID
				}
			}
			c.grants[o.grant] = g
			for _, b := range o.spans[0].IDs {
				c.writeTo[b] = o.grant
			}
		case opRevoke:
			if g := c.grants[o.grant]; g != nil {
				g.live = false
			}
		case opHold:
			if *simVerbose {
				s.t.Logf("%v %s holds %v %+d", s.now.Format("04:05.000"), c.agent, o.spans[0].IDs, o.delta)
			}
			for _, b := range o.spans[0].IDs {
				c.held[b] = max(c.held[b]+o.delta, 0)
				if o.delta > 0 {
					c.holders[b] = append(c.holders[b], o.req)
				} else if i := slices.Index(c.holders[b], o.req); i >= 0 {
					c.holders[b] = slices.Delete(c.holders[b], i, i+1)
				}
			}
		}
		return nil
	}
	s.t.Fatalf("%s asked for op %d", c.agent, o.kind)
	return nil
}

// report checks one outcome: once per request and rank, and fenced.
func (s *coreSim) report(c *simCore, o Outcome) {
	id := o.ReqID
	if *simVerbose {
		s.t.Logf("%v %s reports %s %v %s", s.now.Format("04:05.000"), c.agent, id, o.Result, o.Reason)
	}
	c.reported[id]++
	c.results[id] = o.Result
	if s.stats != nil && strings.Contains(o.Reason, "ambiguous") {
		s.stats["ambiguous pairing refused"]++
	}
	if s.stats != nil && strings.Contains(o.Reason, "the process posting its WRITEs") {
		s.stats["writer exited"]++
	}
	if c.reported[id] > 1 {
		s.t.Fatalf("%s reported %s twice (now %v)", c.agent, id, o.Result)
	}
	if !c.handed[id] {
		s.t.Fatalf("%s reported %s (%v), which it was never handed", c.agent, id, o.Result)
	}
	if (o.Result == ResultFailed || o.Result == ResultExpired) && o.Kind == FailureNone {
		s.t.Fatalf("%s: %v outcome of %s without a failure kind", c.agent, o.Result, id)
	}
	if c.eng == s.d {
		s.reportD(c, o)
	} else {
		s.reportP(c, o)
	}
}

func (s *coreSim) reportD(c *simCore, o Outcome) {
	id := o.ReqID
	if strings.Contains(o.Reason, simFenceTO) {
		c.timedOut[id] = true
	}
	for _, x := range s.xfers {
		switch {
		case x.dreq != id:
		case x.read && x.poster == c:
			s.t.Fatalf("%s reported %s (%v) with its READ into its blocks in flight", c.agent, id, o.Result)
		case !x.read && s.agents[x.peer] == c && !s.grants && !c.timedOut[id]:
			s.t.Fatalf("%s reported %s (%v) with a WRITE into its blocks in flight", c.agent, id, o.Result)
		}
	}
	for gid, g := range c.grants {
		if g.live && g.dreq == id {
			s.t.Fatalf("%s reported %s (%v) with its WRITE grant %d still live", c.agent, id, o.Result, gid)
		}
	}
	r := s.byDID[id]
	if o.Result == ResultDone && !c.tainted[id] {
		c.doneTag[id] = s.checkBytes(c, r)
	}
	if !s.allReported(s.d, id) {
		return
	}
	// Every rank reported: the engine takes the blocks back (after
	// checking the request whole, if every rank has it done).
	whole := true
	for _, dc := range s.d.cores {
		whole = whole && dc.doneTag[id] != 0
	}
	if whole {
		s.checkWhole(r)
	}
	s.free(s.d, r.dBlocks, id)
}

func (s *coreSim) reportP(c *simCore, o Outcome) {
	id := o.ReqID
	for _, x := range s.xfers {
		if !x.read && x.poster == c && x.preq == id {
			s.t.Fatalf("%s reported %s (%v) with its WRITE still reading its blocks", c.agent, id, o.Result)
		}
	}
	r := s.byPID[id]
	if s.grants && s.mode == simPull {
		for _, b := range r.pBlocks {
			if c.held[b] > 0 {
				s.t.Fatalf("%s reported %s (%v) still holding its block %d for READs", c.agent, id, o.Result, b)
			}
		}
	}
	if s.allReported(s.p, id) {
		s.free(s.p, r.pBlocks, id)
	}
}

// allReported: every rank of e reported id.
func (s *coreSim) allReported(e *simEngine, id string) bool {
	for _, c := range e.cores {
		if c.reported[id] == 0 {
			return false
		}
	}
	return true
}

// free gives a request's blocks back to its engine, which reuses them:
// blank until the next request writes them.
func (s *coreSim) free(e *simEngine, blocks []topology.BlockID, id string) {
	for _, b := range blocks {
		if e.owner[b] != id {
			continue // an earlier incarnation's
		}
		e.owner[b] = ""
		for _, c := range e.cores {
			for g := range simRegions {
				clear(c.blockCells(g, b))
			}
		}
	}
}

func (c *simCore) blockCells(region int, b topology.BlockID) []uint32 {
	at := (region*simBlocks + int(b)) * c.blockLen
	return c.mem[at : at+c.blockLen]
}

// alloc takes n free blocks of e for request id, lowest first (so
// blocks are reused as soon as they are free); nil if too few are.
func (e *simEngine) alloc(n int, id string) []topology.BlockID {
	var ids []topology.BlockID
	for b := range simBlocks {
		if len(ids) < n && e.owner[b] == "" {
			ids = append(ids, topology.BlockID(b))
		}
	}
	if len(ids) < n {
		return nil
	}
	for _, b := range ids {
		e.owner[b] = id
	}
	return ids
}

// fill writes P's KV of request r for layer (region) g on rank c.
func (s *coreSim) fill(c *simCore, r *simReq, g int) {
	for k, b := range r.pBlocks {
		cells := c.blockCells(g, b)
		pos := (k*simRegions + g) * c.blockLen
		for o := range cells {
			cells[o] = r.tag<<cellTagShift | uint32(c.rank)<<cellRankShift | uint32(pos+o)
		}
	}
}

// checkBytes checks, as rank c reports r done, that every byte of its
// blocks holds a byte of one producer request the pairing rule allows,
// each byte once; it returns that request's tag.
func (s *coreSim) checkBytes(c *simCore, r *simReq) uint32 {
	clear(s.seen)
	var tag uint32
	for g := range simRegions {
		for _, b := range r.dBlocks {
			for o, v := range c.blockCells(g, b) {
				switch {
				case v == 0:
					s.t.Fatalf("%s reported %s done, but byte %d of its block %d (region %d) was never written", c.agent, r.did, o, b, g)
				case tag == 0:
					tag = v >> cellTagShift
				case v>>cellTagShift != tag:
					s.t.Fatalf("%s reported %s done holding KV of two producer requests, %s and %s",
						c.agent, r.did, s.tags[tag-1].pid, s.tags[v>>cellTagShift-1].pid)
				}
				p := v & cellPosMask
				if s.seen[p] {
					s.t.Fatalf("%s reported %s done holding byte %#x of %s twice", c.agent, r.did, p, s.tags[tag-1].pid)
				}
				s.seen[p] = true
			}
		}
	}
	if s.stats != nil {
		s.stats[s.checkedKey()]++
		s.stats[fmt.Sprintf("bytes checked, mode %d, grants %v", s.mode, s.grants)]++
		if !r.exact && !r.byTID {
			s.stats["paired by base id"]++
		}
	}
	if src := s.tags[tag-1]; !s.allowed(r, src) {
		s.t.Fatalf("%s reported %s done holding the KV of producer request %s (tid %q), which it does not name (names %q, tid %q): cross-wired",
			c.agent, r.did, src.pid, src.tid, r.name, r.tid)
	}
	return tag
}

// checkWhole checks, once every consumer rank reported r done, that
// they hold one producer request's KV between them, each byte once, all
// of it where the two requests have as many blocks.
func (s *coreSim) checkWhole(r *simReq) {
	clear(s.seen)
	tag, n := s.d.cores[0].doneTag[r.did], 0
	for _, c := range s.d.cores {
		if c.doneTag[r.did] != tag {
			s.t.Fatalf("%s's ranks hold the KV of different producer requests: %s and %s", r.did, s.tags[tag-1].pid, s.tags[c.doneTag[r.did]-1].pid)
		}
		for g := range simRegions {
			for _, b := range r.dBlocks {
				for _, v := range c.blockCells(g, b) {
					p := v & cellPosMask
					if s.seen[p] {
						s.t.Fatalf("%s's ranks hold byte %#x of %s twice", r.did, p, s.tags[tag-1].pid)
					}
					s.seen[p] = true
					n++
				}
			}
		}
	}
	if src := s.tags[tag-1]; src.nblocks == r.nblocks {
		if want := s.p.tp * src.nblocks * simRegions * s.p.cores[0].blockLen; n != want {
			s.t.Fatalf("%s's ranks hold %d bytes of %s, want %d", r.did, n, src.pid, want)
		}
	}
}

// allowed reports whether the pairing rule lets D's request r take the
// KV of P's request src: its transfer id's; the one it names by id;
// else, by base id, one of its base without a transfer id.
func (s *coreSim) allowed(r, src *simReq) bool {
	if r.byTID || r.exact {
		return src == r
	}
	return src.tid == "" && src.base == r.base
}

// count notes that a seed exercised something (TestCoreSimSeeds).
func (s *coreSim) count(what string) {
	if s.stats != nil {
		s.stats[what]++
	}
}

func (s *coreSim) done() bool { return len(s.in) == 0 || s.steps > 400 }

// event lets the input pick the next thing that happens.
func (s *coreSim) event() {
	s.steps++
	k := s.byte()
	switch {
	case s.legacy:
		k %= 14
	case s.mode == simLayer:
		k %= 19
	default:
		k %= 18
	}
	switch k {
	case 0, 1: // an engine steps a request
		i := 1 + int(s.byte())%s.n
		if s.byte()%2 == 0 {
			s.stepSend(i)
		} else {
			s.stepRecv(i)
		}
	case 2, 3, 4: // a notification is delivered
		s.deliver(int(s.byte()), false)
	case 5: // a notification is lost
		if len(s.msgs) > 0 {
			i := int(s.byte()) % len(s.msgs)
			s.msgs = slices.Delete(s.msgs, i, i+1)
		}
	case 6: // a notification arrives twice
		s.deliver(int(s.byte()), true)
	case 7, 8: // a transfer ends
		pick := int(s.byte())
		s.endXfer(pick, s.byte()%5 != 0)
	case 9: // a handshake is answered
		s.answer(s.byte()%4 != 0)
	case 10:
		s.failNotify[[]string{"P", "D"}[s.byte()%2]]++
	case 11:
		if s.legacy {
			s.failPost["P"]++
		} else {
			s.failPost[[]string{"P", "D"}[s.byte()%2]]++
		}
	case 12, 13: // time passes
		s.advance(time.Duration(1+int(s.byte())%40) * time.Second / 4)
	case 14:
		s.saveLayer()
	case 15:
		s.abort(1 + int(s.byte())%s.n)
	case 16:
		s.restart()
	case 18:
		s.preempt(1 + int(s.byte())%s.n)
	case 17: // a rank takes the steps its engine issued
		e := []*simEngine{s.p, s.d}[s.byte()%2]
		c := e.cores[int(s.byte())%e.tp]
		if len(c.queue) > 0 {
			s.count("rank caught up")
		}
		s.flush(c)
	}
}

func (s *coreSim) nextStep() uint64 {
	s.stepNo++
	return s.stepNo
}

// engineStep issues a step to every rank of e; each takes it now or
// later (the input says which, where there are several).
// finishFilled fills every region of producer request r on every core
// of e with its KV and finishes it (its SendReq, a 30 s lease).
func (s *coreSim) finishFilled(e *simEngine, r *simReq) {
	r.pState = 2
	for _, c := range e.cores {
		for g := range simRegions {
			s.fill(c, r, g)
		}
	}
	s.engineStep(e, &StepMeta{Step: s.nextStep(), SchedulerClock: s.now, Send: []SendReq{r.send(s.now.Add(30 * time.Second))}})
}

func (s *coreSim) engineStep(e *simEngine, meta *StepMeta) {
	if *simVerbose {
		s.t.Logf("%v step %s: %+v", s.now.Format("04:05.000"), e.name, *meta)
	}
	for _, c := range e.cores {
		c.queue = append(c.queue, meta)
	}
	if e.tp == 1 {
		s.flush(e.cores[0])
		return
	}
	now := s.byte()
	for _, c := range e.cores {
		if now>>c.rank&1 != 0 {
			s.flush(c)
		}
	}
}

// flush has rank c take the steps its engine issued.
func (s *coreSim) flush(c *simCore) {
	for len(c.queue) > 0 {
		m := c.queue[0]
		c.queue = c.queue[1:]
		for _, r := range m.Prefill {
			c.handed[r.ReqID] = true
		}
		for _, r := range m.Send {
			c.handed[r.ReqID] = true
		}
		for _, r := range m.Recv {
			c.handed[r.ReqID] = true
		}
		for _, id := range m.Preempted {
			delete(c.preempting, id)
		}
		s.step(c, input{kind: inEvent, ev: &event{kind: evStep, meta: m}})
	}
}

func (r *simReq) send(deadline time.Time) SendReq {
	return SendReq{ReqID: r.pid, TransferID: r.tid, Deadline: deadline, Tokens: 16 * r.nblocks,
		Blocks: []topology.Span{{IDs: r.pBlocks}}}
}

// stepSend: P's engine hands over request i: finished (its KV computed),
// or, layer-wise, prefilling (its layers computed as they are saved),
// then finished.
func (s *coreSim) stepSend(i int) {
	r, e := s.reqs[i-1], s.p
	switch {
	case r.pState == 0:
		blocks := e.alloc(r.nblocks, r.pid)
		if blocks == nil {
			return
		}
		s.tags = append(s.tags, r)
		r.pGen, r.pBlocks, r.tag = e.gen, blocks, uint32(len(s.tags))
		if s.mode == simLayer {
			r.pState, r.pStep = 1, s.nextStep()
			meta := &StepMeta{Step: r.pStep, SchedulerClock: s.now, Prefill: []SendReq{r.send(time.Time{})}}
			// The step may prefill the next request too (the input says):
			// their layers are saved by the same signals.
			if q := s.reqs[i%s.n]; r.batch && q != r && q.pState == 0 {
				if blocks := e.alloc(q.nblocks, q.pid); blocks != nil {
					s.tags = append(s.tags, q)
					q.pGen, q.pBlocks, q.tag = e.gen, blocks, uint32(len(s.tags))
					q.pState, q.pStep = 1, r.pStep
					meta.Prefill = append(meta.Prefill, q.send(time.Time{}))
					s.count("prefills share a step")
				}
			}
			s.engineStep(e, meta)
			return
		}
		s.finishFilled(e, r)
	case r.pState == 4 && r.pGen == e.gen:
		// Preempted: scheduled again, into new blocks (the lowest free:
		// often its old ones). Its prefill is listed again, or (the
		// input says) it finishes without a listing.
		blocks := e.alloc(r.nblocks, r.pid)
		if blocks == nil {
			return
		}
		r.pBlocks = blocks
		if s.byte()%2 == 0 {
			r.pState, r.pStep = 1, s.nextStep()
			s.count("prefilled again")
			s.engineStep(e, &StepMeta{Step: r.pStep, SchedulerClock: s.now, Prefill: []SendReq{r.send(time.Time{})}})
			return
		}
		s.finishFilled(e, r)
	case r.pState == 1 && r.pGen == e.gen:
		r.pState = 2
		for _, c := range e.cores {
			for g := range simRegions {
				if !r.saved[c.rank][g] {
					s.fill(c, r, g)
				}
			}
		}
		s.engineStep(e, &StepMeta{Step: s.nextStep(), SchedulerClock: s.now, Send: []SendReq{r.send(s.now.Add(30 * time.Second))}})
	}
}

// stepRecv: D's engine hands over request i, with blocks for its KV
// (pull: once P's params, naming P's blocks, reached it).
func (s *coreSim) stepRecv(i int) {
	r, e := s.reqs[i-1], s.d
	if r.dStepped || s.mode == simPull && r.pState != 2 {
		return
	}
	blocks := e.alloc(r.nblocks, r.did)
	if blocks == nil {
		return
	}
	r.dStepped, r.dGen, r.dBlocks = true, e.gen, blocks
	q := RecvReq{ReqID: r.did, TransferID: r.tid, Deadline: s.now.Add(20 * time.Second),
		Local:  []topology.Span{{IDs: blocks}},
		Remote: RemoteRef{EngineID: "P", Addr: "P:1", ReqID: r.name, TPSize: s.p.tp, PPSize: 1, Tokens: 16 * r.nblocks}}
	if s.mode == simPull {
		q.Remote.Blocks = []topology.Span{{IDs: r.pBlocks}}
	}
	s.engineStep(e, &StepMeta{Step: s.nextStep(), SchedulerClock: s.now, Recv: []RecvReq{q}})
}

// saveLayer: a P rank saves a layer of a request it prefills.
func (s *coreSim) saveLayer() {
	pick, rank, lb := int(s.byte()), int(s.byte())%s.p.tp, s.byte()
	// The layer byte's high bits say how (0: at once, after its step;
	// 1: before its rank took its step; 2: again if saved; 3: a late
	// signal of a preempted attempt).
	layer, how := int(lb)%simRegions, lb>>4%4
	if s.mode != simLayer {
		return
	}
	if how == 3 {
		// A late signal of a preempted attempt's step (its layer was
		// computed then, into blocks since freed): the rank takes it
		// whenever it comes, before or after the preemption.
		var old []*simReq
		for _, r := range s.reqs {
			if r.oldStep != 0 && r.pGen == s.p.gen {
				old = append(old, r)
			}
		}
		if len(old) > 0 {
			s.count("stale layer signal")
			s.signalLayer(s.p.cores[rank], old[pick%len(old)].oldStep, layer)
		}
		return
	}
	var cands []*simReq
	for _, r := range s.reqs {
		if r.pState == 1 && r.pGen == s.p.gen {
			cands = append(cands, r)
		}
	}
	if len(cands) == 0 {
		return
	}
	r := cands[pick%len(cands)]
	c := s.p.cores[rank]
	if r.saved[rank][layer] {
		if how == 2 {
			s.count("layer signalled twice")
			s.signalLayer(c, r.pStep, layer)
		}
		return
	}
	if how != 1 {
		s.flush(c) // its step reached it before its forward pass
	} else if len(c.queue) > 0 {
		s.count("layer signalled before its step")
	}
	s.count("layer saved")
	s.signalLayer(c, r.pStep, layer)
}

// signalLayer: rank c's engine computed layer of step, for every
// request the step prefills (and still prefills), and says so.
func (s *coreSim) signalLayer(c *simCore, step uint64, layer int) {
	for _, q := range s.reqs {
		if q.pState == 1 && q.pGen == s.p.gen && q.pStep == step && !q.saved[c.rank][layer] {
			q.saved[c.rank][layer] = true
			s.fill(c, q, layer)
		}
	}
	s.step(c, input{kind: inEvent, ev: &event{kind: evLayer, step: step, layer: layer}})
}

// preempt: P's engine preempts layer-wise request i after its prefill
// step: its blocks are freed at once (another request may take them
// before a rank hears of it), and it is scheduled again later (stepSend).
func (s *coreSim) preempt(i int) {
	r, e := s.reqs[i-1], s.p
	if s.mode != simLayer || r.pState != 1 || r.pGen != e.gen {
		return
	}
	s.count("preempted")
	for _, x := range s.xfers {
		if !x.read && x.poster.eng == e && x.preq == r.pid {
			x.stale = true
		}
	}
	for _, c := range e.cores {
		if c.preempting == nil {
			c.preempting = map[string]bool{}
		}
		c.preempting[r.pid] = true
	}
	s.free(e, r.pBlocks, r.pid)
	r.saved = [2][simRegions]bool{}
	r.pState, r.oldStep = 4, r.pStep
	s.engineStep(e, &StepMeta{Step: s.nextStep(), SchedulerClock: s.now, Preempted: []string{r.pid}})
}

// abort: P's engine aborts request i before it finished.
func (s *coreSim) abort(i int) {
	r := s.reqs[i-1]
	if r.pState == 2 || r.pState == 3 || (r.pState == 1 || r.pState == 4) && r.pGen != s.p.gen {
		return
	}
	meta := &StepMeta{Step: s.nextStep(), SchedulerClock: s.now, NotProcessed: []string{r.pid}}
	if r.tid != "" {
		meta.NotProcessedTransferIDs = map[string]string{r.pid: r.tid}
	}
	r.pState = 3
	s.count("aborted")
	s.engineStep(s.p, meta)
}

// restart: an engine restarts: its ranks, requests, transfers and memory
// are gone; new ranks answer at new agents with a new generation.
func (s *coreSim) restart() {
	e := []*simEngine{s.p, s.d}[s.byte()%2]
	if s.restarts >= simMaxRestarts {
		return
	}
	s.restarts++
	s.count("restart " + e.name)
	for _, c := range e.cores {
		c.dead = true
	}
	s.xfers = slices.DeleteFunc(s.xfers, func(x *simXfer) bool { return x.poster.dead })
	e.gen++
	s.startEngine(e)
}

func (s *coreSim) deliver(pick int, twice bool) {
	if len(s.msgs) == 0 {
		return
	}
	i := pick % len(s.msgs)
	m := s.msgs[i]
	if !twice {
		s.msgs = slices.Delete(s.msgs, i, i+1)
	}
	if c := s.agents[m.to]; c != nil && !c.dead {
		if *simVerbose {
			dm, _ := decodeMsg(m.n.Msg)
			s.t.Logf("%v deliver %s -> %s: %+v", s.now.Format("04:05.000"), m.n.From, m.to, dm)
		}
		s.step(c, input{kind: inNotifs, notifs: []Notif{m.n}})
	}
}

// endXfer ends a transfer: on success its bytes land and its
// notification goes after them.
func (s *coreSim) endXfer(pick int, ok bool) {
	if len(s.xfers) == 0 {
		return
	}
	s.land(s.xfers[pick%len(s.xfers)], ok)
}

func (s *coreSim) land(x *simXfer, ok bool) {
	if *simVerbose {
		s.t.Logf("%v %s's %s %d lands (%v)", s.now.Format("04:05.000"), x.poster.agent, kindOf(x), x.id, ok)
	}
	s.xfers = slices.DeleteFunc(s.xfers, func(y *simXfer) bool { return y == x })
	peer := s.agents[x.peer]
	if x.abandoned {
		// Its bytes may land while the release waits for them (NIXL's
		// does), never after: its request reports once it returned.
		if ok && peer != nil && !peer.dead {
			_ = s.copyBytes(x, peer)
			s.count("abandoned transfer landed")
		}
		s.step(x.poster, input{kind: inReleased, xfer: x.id})
		return
	}
	in := input{kind: inXferEnded, xfer: x.id, state: XferDone}
	var err error
	switch {
	case !ok:
		err = fmt.Errorf("%w: injected", ErrXferFailed)
	case peer == nil || peer.dead:
		err = fmt.Errorf("%w: peer %s is gone", ErrXferFailed, x.peer)
	default:
		err = s.copyBytes(x, peer)
	}
	if err != nil {
		in.state, in.err = XferFailed, err
		if s.stats != nil && errors.Is(err, ErrNotGranted) {
			s.stats["refused by grants"]++
		}
	} else if x.notif != nil {
		s.msgs = append(s.msgs, simMsg{to: x.peer, n: Notif{From: x.poster.agent, Msg: x.notif}})
	}
	s.step(x.poster, in)
}

// copyBytes lands a transfer's bytes, checking the grants (where in
// force) and that it reads and lands in the blocks of its requests.
func (s *coreSim) copyBytes(x *simXfer, peer *simCore) error {
	pc, dc := x.poster, peer
	if x.read {
		pc, dc = peer, x.poster
	}
	src := func(d *hotpath.Desc) uint64 {
		if x.read {
			return d.Remote
		}
		return d.Local
	}
	dst := func(d *hotpath.Desc) uint64 {
		if x.read {
			return d.Local
		}
		return d.Remote
	}
	if s.grants {
		for i := range x.descs {
			d := &x.descs[i]
			for _, b := range pc.blocks(s, src(d), d.Len) {
				// A READ names the producer request it reads when the
				// consumer knows its id (its tag), and is admitted only
				// where that request holds the block.
				if x.read && (pc.held[b] == 0 || x.preq != "" && len(pc.holders[b]) > 0 && !slices.Contains(pc.holders[b], x.preq)) {
					return fmt.Errorf("%w: %w: block %d of %s is not held for %q", ErrXferFailed, ErrNotGranted, b, pc.agent, x.preq)
				}
			}
			for _, b := range dc.blocks(s, dst(d), d.Len) {
				// A WRITE names the consumer request it is for (its tag) and
				// lands only under that request's grant.
				if g := dc.grants[dc.writeTo[b]]; !x.read && (g == nil || !g.live || !slices.Contains(g.peers, pc.agent) || g.dreq != "" && g.dreq != x.dreq) {
					return fmt.Errorf("%w: %w: block %d of %s is not granted to %s", ErrXferFailed, ErrNotGranted, b, dc.agent, pc.agent)
				}
			}
		}
	}
	for i := range x.descs {
		d := &x.descs[i]
		for _, b := range pc.blocks(s, src(d), d.Len) {
			if pc.eng.owner[b] == x.preq && pc.reported[x.preq] == 0 {
				continue
			}
			if x.stale {
				continue // documented: written again (preempt)
			}
			if x.read && (!s.grants || x.preq == "") && (pc.reported[x.preq] > 0 && pc.results[x.preq] != ResultDone || !pc.handed[x.preq]) {
				dc.tainted[x.dreq] = true // simREADLate
				continue
			}
			s.t.Fatalf("a %s of %s by %s read block %d of %s, which %s released (now %q's)",
				kindOf(x), x.dreq, x.poster.agent, b, pc.agent, x.preq, pc.eng.owner[b])
		}
		for _, b := range dc.blocks(s, dst(d), d.Len) {
			if dc.eng.owner[b] == x.dreq && dc.reported[x.dreq] == 0 {
				continue
			}
			if !x.read && !s.grants && dc.timedOut[x.dreq] {
				return nil // documented: the grants would refuse it
			}
			s.t.Fatalf("a %s for %s by %s landed in block %d of %s after it reported %s (the block is now %q's)",
				kindOf(x), x.dreq, x.poster.agent, b, dc.agent, x.dreq, dc.eng.owner[b])
		}
	}
	for i := range x.descs {
		d := &x.descs[i]
		copy(dc.cells(s, dst(d), d.Len), pc.cells(s, src(d), d.Len))
	}
	return nil
}

// simREADLate: a pull READ that reaches the producer after its lease ran
// out (or it aborted, or restarted) reads blocks its engine may have
// reused. The lease, extended by the consumer's heartbeats, bounds it;
// the grants refuse it while nothing holds the block, but a hold is by
// block, not by request: once the engine holds the block again for
// another request, the READ is admitted and reads that request's KV.
// Documented, not checked (the consumer's bytes are not); a READ of a
// request the producer reported done is checked.

func kindOf(x *simXfer) string {
	if x.read {
		return "READ"
	}
	return "WRITE"
}

// cells are the memory cells of [addr, addr+n) of c's regions.
func (c *simCore) cells(s *coreSim, addr, n uint64) []uint32 {
	off := addr - c.eng.base
	g, o := off/simRegionGap, off%simRegionGap
	size := uint64(simBlocks * c.blockLen)
	if addr < c.eng.base || g >= simRegions || o >= size || n > size-o {
		s.t.Fatalf("a transfer names [%#x, +%d) outside %s's registered memory", addr, n, c.agent)
	}
	at := g*size + o
	return c.mem[at : at+n]
}

// blocks are the blocks [addr, addr+n) of c's regions touches.
func (c *simCore) blocks(s *coreSim, addr, n uint64) []topology.BlockID {
	c.cells(s, addr, n) // bounds
	o := (addr - c.eng.base) % simRegionGap
	var ids []topology.BlockID
	for b := o / uint64(c.blockLen); b <= (o+n-1)/uint64(c.blockLen); b++ {
		ids = append(ids, topology.BlockID(b))
	}
	return ids
}

// answer answers the oldest handshake (or probe) a core asked for, D's
// ranks first.
func (s *coreSim) answer(ok bool) {
	for _, c := range append(slices.Clip(s.d.cores), s.p.cores...) {
		if len(c.asks) == 0 {
			continue
		}
		a := c.asks[0]
		c.asks = c.asks[1:]
		h := &hsResult{engine: a.engine, probe: a.probe, moves: a.moves}
		e := map[string]*simEngine{"P": s.p, "D": s.d}[a.engine]
		if ok && e != nil {
			h.res.Generation = e.gen
			for _, pc := range e.cores {
				h.res.Ranks = append(h.res.Ranks, RankInfo{EngineID: e.name, CompatHash: "h",
					Layout: simLayout(pc.rank, e.tp, e.base), Agent: []byte(pc.agent)})
			}
			if !a.probe || e.gen != a.gen { // as the driver loads them
				for _, pc := range e.cores {
					h.names, h.loadErrs = append(h.names, pc.agent), append(h.loadErrs, nil)
				}
			}
		} else {
			h.err = fmt.Errorf("injected: %w", context.DeadlineExceeded)
		}
		s.step(c, input{kind: inEvent, ev: &event{kind: evHandshake, hs: h}})
		return
	}
}

// advance moves time on; transfers older than 20 s end first (the fabric
// bounds a transfer's life well inside the consumer's fence timeout).
func (s *coreSim) advance(d time.Duration) {
	for _, x := range slices.Clone(s.xfers) {
		if slices.Contains(s.xfers, x) && s.now.Add(d).Sub(x.posted) > 20*time.Second {
			s.land(x, true)
		}
	}
	s.now = s.now.Add(d)
	for _, c := range s.cores() {
		s.step(c, input{kind: inTimers})
	}
}

// drain steps every request in, then delivers everything and lets time
// run until every live core holds nothing.
func (s *coreSim) drain() {
	for i := 1; i <= s.n; i++ {
		s.stepSend(i)
		s.stepSend(i) // layer-wise: finished
		s.stepRecv(i)
	}
	s.failNotify, s.failPost = map[string]int{}, map[string]int{}
	for range 300 {
		for _, c := range s.cores() {
			s.flush(c)
		}
		for n := 0; s.asked(); n++ {
			if n > 10000 {
				s.t.Fatal("handshakes asked without end")
			}
			s.answer(true)
		}
		for len(s.msgs) > 0 {
			s.deliver(0, false)
		}
		for len(s.xfers) > 0 {
			s.land(s.xfers[0], true)
		}
		if s.settled() {
			return
		}
		s.advance(5 * time.Second)
	}
	for _, c := range s.cores() {
		s.t.Logf("%s holds %d sends, %d receives", c.agent, c.st.sends.len(), len(c.st.recvs))
	}
	s.t.Fatalf("the cores did not settle")
}

func (s *coreSim) asked() bool {
	for _, c := range s.cores() {
		if len(c.asks) > 0 {
			return true
		}
	}
	return false
}

func (s *coreSim) settled() bool {
	for _, c := range s.cores() {
		if c.st.sends.len() != 0 || len(c.st.recvs) != 0 || len(c.queue) != 0 {
			return false
		}
	}
	return len(s.msgs) == 0 && len(s.xfers) == 0
}

func (s *coreSim) checkAll() {
	for _, c := range s.p.cores {
		if p := c.st; p.sendByTID.len()+len(p.sendBase) != 0 {
			s.t.Errorf("settled %s still indexes requests: %d by transfer id, %d base ids", c.agent, p.sendByTID.len(), len(p.sendBase))
		}
	}
	for _, c := range s.cores() {
		for _, id := range slices.Sorted(maps.Keys(c.handed)) {
			if c.reported[id] != 1 {
				s.t.Errorf("%s reported %s %d times, want once", c.agent, id, c.reported[id])
			}
		}
	}
}
