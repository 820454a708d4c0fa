// Command soak runs a P and a D kvxferd (child processes) with simulated
// engines transferring real KV bytes (push or pull, over the built-in
// backend or NIXL) for a while, injecting faults at random across the
// processes: the P or the D daemon SIGKILLed and restarted on the same
// address (its engine re-attached under the same id), the P or the D
// daemon frozen (SIGSTOP) for up to three seconds, a graceful P restart,
// the P or the D engine crashed (its streams dropped without a bye) and
// attached again under the same id. Faults come at the rate asked
// (-fault-every): a restart runs beside the soak's loop, which goes on
// driving the other side and injects the next faults on time (one whose
// side is still coming back goes to the other side instead). It
// accounts for every request on both sides and exits non-zero on a
// violation:
//
//   - a request ends more than once on one side, or not within -bound of
//     its issue (45 s: a P request whose consumer died before registering
//     ends only at its 30 s lease; ending means an outcome from kvxferd,
//     or, for requests of an engine whose daemon was killed, that
//     engine's own failure);
//   - a request reported done has a wrong byte (each request's pattern is
//     salted, so stale bytes of an earlier request in its blocks count);
//   - a block stays held by a request that ended;
//   - fewer than half the faults asked were injected (the soak would test
//     less than it says).
//
// The daemons' logs (one per daemon incarnation, P0.log, D1.log, ... in
// the work dir under /dev/shm) are kept on a violation, and with -keep
// also when the soak passes (a slow restart's cause: a closing worker
// logs what it still waits for a second into its close).
//
// Usage: go run ./test/soak -duration 10m [-backend nixl] [-mode pull | -layerwise]
// [-p-tp 2] [-d-tp 2] [-p-block 8|16|32] [-d-block 8|16|32] [-keep]
package main

import (
	"flag"
	"fmt"
	"maps"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

var model = kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention, topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}

const blocks = 64

// tokens is each request's prompt length.
const tokens = 32

func engineOf(id, tp, block int) kvsim.Engine {
	return kvsim.Engine{ID: id, TP: tp, PP: 1, LogicalBlock: block, KernelBlock: block, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: blocks}
}

// side is one engine and the daemon it is attached to.
type side struct {
	name, addr, dir string
	id              int
	d               *daemontest.Proc
	e               *simengine.Engine
	epoch           int
	free            []topology.BlockID
	backend         string
	mode            kvxfer.Mode
	tp, block       int // TP size, block size in tokens
	layerwise       bool
	attachWait      time.Duration // the longest an attach took
	lastAttach      time.Duration // the last one's
	// down: a fault's restart of the side's daemon or engine is under
	// way on its own goroutine, which alone touches d, e, epoch and
	// attachWait until it reports on soak.backs.
	down bool
}

func (s *side) start() error {
	d, err := daemontest.Start(s.dir, fmt.Sprintf("%s%d", s.name, s.epoch), s.backend, "-peer-listen", s.addr, "-lease", "10s")
	if err != nil {
		return err
	}
	s.d = d
	if err := s.attach(); err != nil {
		s.d = nil
		_ = d.Stop()
		return err
	}
	return nil
}

// attach attaches a new incarnation of the side's engine to its daemon.
func (s *side) attach() error {
	d := s.d
	for r := range s.tp {
		_ = os.Remove(filepath.Join(s.dir, fmt.Sprintf("%s-tp%d", s.name, r))) // a killed engine's files
	}
	m := model
	// A crashed engine's ranks are let go once what they moved is
	// fenced; until then the daemon refuses the new incarnation
	// (AlreadyExists, "retry once it has"), as a real engine would retry.
	start := time.Now()
	var e *simengine.Engine
	var err error
	for {
		e, err = simengine.Attach(simengine.Config{Dir: s.dir, Sock: d.Sock, Peer: d.Peer, ID: s.name, Model: &m, Engine: engineOf(s.id, s.tp, s.block),
			Mode: s.mode, Layerwise: s.layerwise, Version: "soak"})
		if status.Code(err) != codes.AlreadyExists || time.Since(start) > 90*time.Second {
			break
		}
		time.Sleep(50 * time.Millisecond)
	}
	if err != nil {
		return err
	}
	s.lastAttach = time.Since(start)
	if s.lastAttach > s.attachWait {
		s.attachWait = s.lastAttach
	}
	s.e = e
	s.epoch++
	return nil
}

func (s *side) take(n int) []topology.BlockID {
	if len(s.free) < n {
		return nil
	}
	ids := slices.Clone(s.free[:n])
	s.free = s.free[n:]
	return ids
}

func (s *side) give(ids []topology.BlockID) { s.free = append(s.free, ids...) }

// request is one transfer and what each side knows of it.
type request struct {
	n                int
	pIDs, dIDs       []topology.BlockID
	issued           time.Time
	pEpoch, dEpoch   int
	pEnded, dEnded   bool
	pResult, dResult kvxfer.Result
}

type soak struct {
	p, d       *side
	start      time.Time
	backs      chan back // restarts that ended
	asked      int       // fault slots that came due
	missed     int       // slots with both sides coming back
	retargeted int       // faults moved to the other side (theirs was coming back)
	slowest    map[string]time.Duration
	reqs       map[string]*request // by D id ("d-N"); P's is "p-N"
	next       int
	faults     map[string]int
	results    map[string]int
	violations []string
	bound      time.Duration
	rng        *rand.Rand
	// prefilling: layer-wise, P's requests whose prefill is staged for
	// P's next step; each layer is saved after that step, then the
	// request finishes.
	prefilling []prefilling
}

type prefilling struct {
	req *kvxfer.Request
	ids []topology.BlockID
}

func (s *soak) violate(format string, args ...any) {
	msg := fmt.Sprintf(format, args...)
	s.violations = append(s.violations, msg)
	fmt.Fprintln(os.Stderr, "VIOLATION:", msg)
}

// issue starts one request: D registers its blocks, P finishes it with
// the request's salted pattern in its blocks.
func (s *soak) issue() {
	pIDs, dIDs := s.p.take(tokens/s.p.block), s.d.take(tokens/s.d.block)
	if pIDs == nil || dIDs == nil {
		s.p.give(pIDs)
		s.d.give(dIDs)
		return
	}
	s.next++
	n := s.next
	r := &request{n: n, pIDs: pIDs, dIDs: dIDs, issued: time.Now(), pEpoch: s.p.epoch, dEpoch: s.d.epoch}
	s.reqs[fmt.Sprintf("d-%d", n)] = r
	tid := fmt.Sprintf("t-%d", n)
	for _, rk := range s.p.e.Ranks {
		rk.FillSalt([]topology.Span{{IDs: pIDs}}, n)
	}
	pReq := &kvxfer.Request{ID: fmt.Sprintf("p-%d", n), PromptTokens: tokens, Params: &kvxfer.TransferParams{TransferID: tid, DoRemoteDecode: true}}
	dParams := &kvxfer.TransferParams{TransferID: tid, DoRemotePrefill: true, RemoteEngineID: "P", RemoteAddr: s.p.d.Peer, RemoteTPSize: s.p.tp}
	if s.p.mode == kvxfer.ModePull {
		// P finishes first: its params name the blocks D reads.
		if err := s.p.e.Sched.AfterAlloc(pReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{pIDs}}); err != nil {
			s.violate("P AfterAlloc %d: %v", n, err)
		}
		_, params, err := s.p.e.Sched.RequestFinished(pReq, kvxfer.FinishLengthCapped, [][]topology.BlockID{pIDs}, tokens)
		if err != nil || params == nil {
			s.violate("P RequestFinished %d: params %v, %v", n, params, err)
			params = dParams
		}
		dParams = params
		dParams.DoRemotePrefill, dParams.DoRemoteDecode = true, false
	}
	dReq := &kvxfer.Request{ID: fmt.Sprintf("d-%d", n), PromptTokens: tokens, Params: dParams}
	ext, _ := s.d.e.Sched.MatchedTokens(dReq, 0)
	if err := s.d.e.Sched.AfterAlloc(dReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{dIDs}, External: ext}); err != nil {
		s.violate("D AfterAlloc %d: %v", n, err)
	}
	if s.p.mode == kvxfer.ModePull {
		return
	}
	if err := s.p.e.Sched.AfterAlloc(pReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{pIDs}}); err != nil {
		s.violate("P AfterAlloc %d: %v", n, err)
	}
	if s.p.layerwise {
		if err := s.p.e.Sched.Prefill(pReq, [][]topology.BlockID{pIDs}, 0, tokens); err != nil {
			s.violate("P Prefill %d: %v", n, err)
		}
		s.prefilling = append(s.prefilling, prefilling{req: pReq, ids: pIDs})
		return
	}
	if _, _, err := s.p.e.Sched.RequestFinished(pReq, kvxfer.FinishLengthCapped, [][]topology.BlockID{pIDs}, tokens); err != nil {
		s.violate("P RequestFinished %d: %v", n, err)
	}
}

// drive steps both engines and takes in their outcomes.
func (s *soak) drive() {
	for _, sd := range []*side{s.p, s.d} {
		if sd.down {
			continue // its old engine's outcomes are not taken in (lose)
		}
		meta := sd.e.Sched.BuildMeta()
		_ = sd.e.Step(meta) // a dead daemon: its loss is handled by the fault
		if sd == s.p && len(s.prefilling) > 0 {
			// The step ran the prefills: each layer saved, in order,
			// then the requests finish.
			for l := range model.Kinds {
				_ = sd.e.LayerSaved(meta.Step, l)
			}
			for _, pf := range s.prefilling {
				if _, _, err := sd.e.Sched.RequestFinished(pf.req, kvxfer.FinishLengthCapped, [][]topology.BlockID{pf.ids}, tokens); err != nil {
					s.violate("P RequestFinished %s: %v", pf.req.ID, err)
				}
			}
			s.prefilling = s.prefilling[:0]
		}
		for i, rs := range sd.e.Streams {
			for more := true; more; {
				select {
				case f, ok := <-rs.Finished():
					if !ok {
						more = false
						break
					}
					out, err := sd.e.Fold(i, &f)
					if err != nil {
						s.violate("%s fold: %v", sd.name, err)
					}
					if out != nil {
						s.outcomes(sd, out)
					}
				default:
					more = false
				}
			}
		}
	}
}

func (s *soak) outcomes(sd *side, f *kvxfer.Finished) {
	for _, o := range append(slices.Clone(f.Sending), f.Recving...) {
		var r *request
		var n int
		if _, err := fmt.Sscanf(o.ReqID[2:], "%d", &n); err == nil {
			r = s.reqs[fmt.Sprintf("d-%d", n)]
		}
		if r == nil {
			s.violate("%s: outcome for an unknown request %q", sd.name, o.ReqID)
			continue
		}
		if sd == s.p {
			s.endP(r, o.Result, "outcome")
		} else {
			s.endD(r, o.Result, "outcome")
		}
	}
}

func (s *soak) endP(r *request, res kvxfer.Result, how string) {
	if r.pEnded {
		s.violate("P request %d ended twice (%s %v after %v)", r.n, how, res, r.pResult)
		return
	}
	r.pEnded, r.pResult = true, res
	s.results["P "+how+" "+res.String()]++
	s.p.give(r.pIDs)
}

func (s *soak) endD(r *request, res kvxfer.Result, how string) {
	if r.dEnded {
		s.violate("D request %d ended twice (%s %v after %v)", r.n, how, res, r.dResult)
		return
	}
	r.dEnded, r.dResult = true, res
	s.results["D "+how+" "+res.String()]++
	if res == kvxfer.ResultDone {
		req := &kvsim.Request{Tokens: tokens, P: []topology.Span{{IDs: r.pIDs}}, D: []topology.Span{{IDs: r.dIDs}}, Salt: r.n}
		for i, rk := range s.d.e.Ranks {
			if err := rk.CheckRequest(req, s.p.block, s.p.block); err != nil {
				s.violate("D request %d done with wrong bytes on rank %d: %v", r.n, i, err)
			}
		}
	}
	s.d.give(r.dIDs)
}

// lose ends, engine side, the requests of an engine whose daemon died
// or that crashed itself (how).
func (s *soak) lose(sd *side, how string) {
	if sd == s.p {
		s.prefilling = s.prefilling[:0] // its engine is gone
	}
	for _, r := range s.reqs {
		if sd == s.p && !r.pEnded && r.pEpoch == sd.epoch {
			s.endP(r, kvxfer.ResultFailed, how)
		}
		if sd == s.d && !r.dEnded && r.dEpoch == sd.epoch {
			s.endD(r, kvxfer.ResultFailed, how)
		}
	}
}

// back is a restart that ended: the side is up again, or err.
type back struct {
	sd        *side
	kind      string
	injected  time.Time
	ended     time.Time
	err       error
	attachFor time.Duration // the attach's share (refusals retried included)
}

// recover takes sd down (the loop no longer drives or faults it) and runs
// how, which brings it back, on a goroutine of its own; its end comes on
// s.backs. The side's requests end, engine side, as how (lost) at once:
// the loop takes in none of the old engine's outcomes from now on.
func (s *soak) recover(sd *side, kind, lost string, how func() (time.Duration, error)) {
	s.lose(sd, lost)
	sd.down = true
	t0 := time.Now()
	go func() {
		a, err := how()
		s.backs <- back{sd: sd, kind: kind, injected: t0, ended: time.Now(), err: err, attachFor: a}
	}()
}

// timedStart is sd.start, returning how long its attach took.
func timedStart(sd *side) (time.Duration, error) {
	err := sd.start()
	return sd.lastAttach, err
}

func (s *soak) kill(sd *side, kind string) {
	d, e := sd.d, sd.e
	_ = d.Kill() // before the goroutine: no outcome of the dead daemon's is taken in (lose)
	s.recover(sd, kind, "lost-with-daemon", func() (time.Duration, error) {
		_ = e.Close()
		return timedStart(sd)
	})
}

func (s *soak) restart(sd *side, kind string) {
	// A graceful stop reports what is left, but the engine says bye
	// first (a pull producer's bye waits for what its consumers read).
	s.recover(sd, kind, "lost-with-daemon", func() (time.Duration, error) {
		_ = sd.e.Close()
		_ = sd.d.Stop()
		return timedStart(sd)
	})
}

// crash kills the side's engine (its streams dropped without a bye) and
// attaches a new one under the same id to the same daemon.
func (s *soak) crash(sd *side, kind string) {
	_ = sd.e.Crash()
	s.recover(sd, kind, "lost-with-engine", func() (time.Duration, error) {
		err := sd.attach()
		return sd.lastAttach, err
	})
}

// backAgain takes in a restart's end: the side is driven and faulted
// again.
func (s *soak) backAgain(b back) error {
	b.sd.down = false
	took := b.ended.Sub(b.injected)
	s.slowest[b.kind] = max(s.slowest[b.kind], took)
	fmt.Printf("soak: %-17s at %6.1fs, back at %6.1fs (%.2fs, attach %.2fs)\n", b.kind, b.injected.Sub(s.start).Seconds(),
		b.ended.Sub(s.start).Seconds(), took.Seconds(), b.attachFor.Seconds())
	if b.err != nil {
		return fmt.Errorf("%s: %w", b.kind, b.err)
	}
	return nil
}

// freeze stops the side's daemon (SIGSTOP) for 0.5 to 3 s.
func (s *soak) freeze(sd *side) {
	d := time.Duration(500+s.rng.IntN(2500)) * time.Millisecond
	_ = sd.d.Signal(syscall.SIGSTOP)
	go func(p *daemontest.Proc) { time.Sleep(d); _ = p.Signal(syscall.SIGCONT) }(sd.d)
}

// faultKinds are the faults, each on its side (nil: none).
var faultKinds = []struct {
	name string
	p    bool // on P (else on D)
	none bool
}{
	{name: "kill P daemon", p: true},
	{name: "kill D daemon"},
	{name: "freeze P daemon", p: true},
	{name: "restart P daemon", p: true},
	{name: "crash P engine", p: true},
	{name: "crash D engine"},
	{name: "freeze D daemon"},
	{name: "none", none: true},
}

// D has no graceful restart of its own: a fault of P's that has no D
// twin goes to the D daemon's kill instead.
var twin = map[int]int{0: 1, 1: 0, 2: 6, 6: 2, 3: 1, 4: 5, 5: 4}

// fault injects one fault, drawn at random among those whose side is
// up (one drawn for a side coming back goes to its twin on the other
// side). It reports false where both sides are coming back.
func (s *soak) fault() bool {
	k := s.rng.IntN(len(faultKinds))
	if f := faultKinds[k]; !f.none && s.sideOf(k).down {
		if s.sideOf(twin[k]).down {
			return false
		}
		k = twin[k]
		s.retargeted++
	}
	f := faultKinds[k]
	s.faults[f.name]++
	sd := s.sideOf(k)
	switch k {
	case 0, 1:
		s.kill(sd, f.name)
	case 2, 6:
		s.freeze(sd)
	case 3:
		s.restart(sd, f.name)
	case 4, 5:
		s.crash(sd, f.name)
	}
	return true
}

func (s *soak) sideOf(k int) *side {
	if faultKinds[k].p {
		return s.p
	}
	return s.d
}

// takeBacks takes in the restarts that ended, and reports whether one
// failed (a violation: the side cannot be driven any more).
func (s *soak) takeBacks() bool {
	for {
		select {
		case b := <-s.backs:
			if err := s.backAgain(b); err != nil {
				s.violate("fault: could not bring a side back: %v", err)
				return true
			}
		default:
			return false
		}
	}
}

// check flags requests past their bound.
func (s *soak) check(now time.Time) {
	for _, r := range s.reqs {
		if (!r.pEnded || !r.dEnded) && now.Sub(r.issued) > s.bound {
			s.violate("request %d not ended %v after its issue (P ended %v, D ended %v)", r.n, s.bound, r.pEnded, r.dEnded)
			r.issued = now.Add(time.Hour) // report once
		}
	}
}

func freePort() string {
	for {
		addr := fmt.Sprintf("127.0.0.1:%d", 20000+rand.IntN(10000))
		if ln, err := net.Listen("tcp", addr); err == nil {
			ln.Close()
			return addr
		}
	}
}

func main() {
	daemontest.ServeIfChild()
	duration := flag.Duration("duration", time.Minute, "how long to inject faults")
	every := flag.Duration("fault-every", 4*time.Second, "mean time between faults")
	// A P request whose consumer died before it registered ends only when
	// its lease (30 s, the scheduler's default) runs out: nothing tells P
	// about a consumer it never heard from.
	bound := flag.Duration("bound", 45*time.Second, "how long a request may take to end on both sides (the lease and a margin)")
	seed := flag.Uint64("seed", uint64(time.Now().UnixNano()), "random seed")
	backend := flag.String("backend", "builtin", "the daemons' -backend: builtin or nixl (NIXL_CAPI_LIB and NIXL_PLUGIN_DIR set)")
	modeName := flag.String("mode", "push", "push or pull")
	pTP := flag.Int("p-tp", 1, "P's TP size (1 or 2: the model has 2 KV heads)")
	dTP := flag.Int("d-tp", 1, "D's TP size (1 or 2)")
	pBlock := flag.Int("p-block", 16, "P's block size in tokens (8, 16 or 32)")
	dBlock := flag.Int("d-block", 16, "D's block size in tokens (8, 16 or 32)")
	layerwise := flag.Bool("layerwise", false, "layer-wise push: P WRITEs each layer as its step saves it")
	keep := flag.Bool("keep", false, "keep the work dir (the daemons' logs) also when the soak passes")
	flag.Parse()
	if *layerwise && *modeName != "push" {
		fmt.Fprintln(os.Stderr, "-layerwise is push only")
		os.Exit(2)
	}
	for _, v := range []struct {
		name string
		v    int
		ok   []int
	}{{"p-tp", *pTP, []int{1, 2}}, {"d-tp", *dTP, []int{1, 2}}, {"p-block", *pBlock, []int{8, 16, 32}}, {"d-block", *dBlock, []int{8, 16, 32}}} {
		if !slices.Contains(v.ok, v.v) {
			fmt.Fprintf(os.Stderr, "-%s %d: want one of %v\n", v.name, v.v, v.ok)
			os.Exit(2)
		}
	}
	mode := kvxfer.ModePush
	switch *modeName {
	case "push":
	case "pull":
		mode = kvxfer.ModePull
	default:
		fmt.Fprintf(os.Stderr, "-mode %q: want push or pull\n", *modeName)
		os.Exit(2)
	}
	dir, err := os.MkdirTemp("/dev/shm", "kvxfer-soak-")
	if err != nil {
		dir, err = os.MkdirTemp("", "kvxfer-soak-")
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(2)
	}
	if !*keep {
		defer os.RemoveAll(dir)
	}
	s := &soak{reqs: map[string]*request{}, faults: map[string]int{}, results: map[string]int{}, bound: *bound, rng: rand.New(rand.NewPCG(*seed, 1)),
		backs: make(chan back, 2), slowest: map[string]time.Duration{}}
	s.p = &side{name: "P", id: 1, addr: freePort(), dir: dir, backend: *backend, mode: mode, tp: *pTP, block: *pBlock, layerwise: *layerwise}
	s.d = &side{name: "D", id: 2, addr: freePort(), dir: dir, backend: *backend, mode: mode, tp: *dTP, block: *dBlock, layerwise: *layerwise}
	for i := range blocks {
		s.p.free = append(s.p.free, topology.BlockID(i))
		s.d.free = append(s.d.free, topology.BlockID(i))
	}
	for _, sd := range []*side{s.p, s.d} {
		if err := sd.start(); err != nil {
			fmt.Fprintln(os.Stderr, "start:", err)
			os.Exit(2)
		}
	}
	if *layerwise {
		*modeName += " layer-wise"
	}
	fmt.Printf("soak: seed %d, %s %s, P tp%d block %d, D tp%d block %d, %v of faults every ~%v, bound %v, work dir %s\n", *seed, *backend, *modeName, *pTP, *pBlock, *dTP, *dBlock, *duration, *every, *bound, dir)
	start := time.Now()
	s.start = start
	// Fault slots come at random, ~every apart, from the schedule: a
	// restart under way delays none.
	nextFault := start.Add(time.Duration(s.rng.Int64N(int64(2 * *every))))
	broken := false
	for time.Since(start) < *duration {
		if broken = s.takeBacks(); broken {
			break
		}
		if !s.p.down && !s.d.down && len(s.p.free) >= tokens/s.p.block && len(s.d.free) >= tokens/s.d.block {
			s.issue()
		}
		s.drive()
		now := time.Now()
		if now.After(nextFault) {
			s.asked++
			if !s.fault() {
				s.missed++
			}
			nextFault = nextFault.Add(time.Duration(s.rng.Int64N(int64(2 * *every))))
		}
		s.check(now)
		time.Sleep(2 * time.Millisecond)
	}
	// Settle: no more faults or requests; the restarts under way end,
	// then every request must.
	for s.p.down || s.d.down {
		b := <-s.backs
		if err := s.backAgain(b); err != nil {
			s.violate("fault: could not bring a side back: %v", err)
			broken = true
		}
	}
	if broken {
		// A side that could not come back has no engine to drive; its
		// daemons go (none is left running), their logs stay.
		for _, sd := range []*side{s.p, s.d} {
			if sd.d != nil {
				_ = sd.d.Kill()
			}
		}
		fmt.Printf("violations: %d (work dir %s kept: the daemons' logs)\n", len(s.violations), dir)
		os.Exit(1)
	}
	for deadline := time.Now().Add(*bound + 10*time.Second); time.Now().Before(deadline); time.Sleep(5 * time.Millisecond) {
		s.drive()
		s.check(time.Now())
		open := 0
		for _, r := range s.reqs {
			if !r.pEnded || !r.dEnded {
				open++
			}
		}
		if open == 0 {
			break
		}
	}
	for _, r := range s.reqs {
		if !r.pEnded || !r.dEnded {
			s.violate("request %d never ended (P %v, D %v)", r.n, r.pEnded, r.dEnded)
		}
	}
	if len(s.p.free) != blocks || len(s.d.free) != blocks {
		s.violate("blocks held after every request ended: P %d of %d free, D %d of %d", len(s.p.free), blocks, len(s.d.free), blocks)
	}
	_ = s.p.e.Close()
	_ = s.d.e.Close()
	_ = s.p.d.Stop()
	_ = s.d.d.Stop()
	fmt.Printf("soak: %d requests in %v\n", s.next, time.Since(start).Round(time.Second))
	injected := 0
	for _, n := range s.faults {
		injected += n
	}
	fmt.Printf("faults: asked %d (every ~%v over %v), injected %d (%d moved to the other side, theirs coming back), missed %d (both sides coming back)\n",
		s.asked, *every, *duration, injected, s.retargeted, s.missed)
	for _, k := range slices.Sorted(maps.Keys(s.faults)) {
		slow := ""
		if d, ok := s.slowest[k]; ok {
			slow = fmt.Sprintf("  (slowest back in %.2fs)", d.Seconds())
		}
		fmt.Printf("  %-20s %d%s\n", k, s.faults[k], slow)
	}
	if injected*2 < s.asked {
		s.violate("only %d of the %d faults asked were injected: the soak tested less than it says", injected, s.asked)
	}
	fmt.Println("endings:")
	for _, k := range slices.Sorted(maps.Keys(s.results)) {
		fmt.Printf("  %-32s %d\n", k, s.results[k])
	}
	fmt.Printf("longest attach: P %v, D %v\n", s.p.attachWait.Round(time.Millisecond), s.d.attachWait.Round(time.Millisecond))
	fmt.Printf("violations: %d\n", len(s.violations))
	if *keep && len(s.violations) == 0 {
		fmt.Printf("work dir %s kept (-keep): the daemons' logs\n", dir)
	}
	if len(s.violations) > 0 {
		fmt.Printf("work dir %s kept: the daemons' logs\n", dir)
		os.Exit(1) // (the deferred removal does not run)
	}
}
