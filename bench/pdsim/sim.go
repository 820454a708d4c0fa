package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// mode is how KV gets from P to D.
type mode int

const (
	// modeBaseline moves no KV: D may decode as soon as P's prefill ends
	// (the KV is as good as colocated). It bounds what any transfer can
	// reach.
	modeBaseline mode = iota
	// modePull: sequential dispatch (P, then D with P's params); D READs.
	modePull
	// modePush: concurrent dispatch; D registers its blocks while P
	// prefills; P WRITEs after the prefill.
	modePush
	// modeLayerwise: push, with each layer WRITTEN as P saves it.
	modeLayerwise
)

var modeNames = []string{"baseline", "pull", "push", "layerwise"}

func (m mode) String() string { return modeNames[m] }

func parseMode(s string) (mode, error) {
	for i, n := range modeNames {
		if s == n {
			return mode(i), nil
		}
	}
	return 0, fmt.Errorf("mode %q, want one of %s", s, strings.Join(modeNames, ", "))
}

// shape is one workload.
type shape struct {
	PTP, DTP      int
	Input, Output int     // tokens
	Rate          float64 // requests per second (Poisson)
	Hit           float64 // fraction of the prompt in D's prefix cache
	Frag          bool    // engines start with shuffled free block queues
	Requests      int
}

func (s shape) String() string {
	tp := fmt.Sprintf("tp%d", s.PTP)
	if s.PTP != s.DTP {
		tp = fmt.Sprintf("p%dd%d", s.PTP, s.DTP)
	}
	kv := "fresh"
	if s.Frag {
		kv = "frag"
	}
	return fmt.Sprintf("%s/in%d/out%d/%gqps/hit%d/%s", tp, s.Input, s.Output, s.Rate, int(math.Round(s.Hit*100)), kv)
}

// timeModel is the simulated compute. Times at TP t scale as 1/t^TPExp.
type timeModel struct {
	PrefillPerToken time.Duration // prefill time per token at TP 1
	DecodeStep      time.Duration // a decode step's fixed time at TP 1 (weights)
	DecodePerSeq    time.Duration // a decode step's time per sequence at TP 1 (KV reads)
	TPExp           float64
	MaxBatchTokens  int // a prefill step's token budget
	MaxSeqs         int // D's decode batch limit
}

// model32B is a 32B-class dense model (64 layers, 8 KV heads of 128,
// bf16: 256 KiB of KV per token) on H100s: prefill about 0.16 ms per
// token on one GPU (64 GFLOP per token at about 400 TFLOP/s effective), a
// decode step reading 64 GB of weights at about 2.3 TB/s effective (28 ms
// on one GPU), plus the KV each sequence reads (about 0.1 ms on one GPU);
// TP t divides times by t^0.9. At TP 4 a 1024-token prompt prefills in
// about 47 ms and a decode step of 32 sequences takes about 9 ms, so 4-16
// requests per second load P moderately to heavily, as in the seeds'
// benchmark.
var model32B = timeModel{PrefillPerToken: 160 * time.Microsecond, DecodeStep: 28 * time.Millisecond,
	DecodePerSeq: 100 * time.Microsecond, TPExp: 0.9, MaxBatchTokens: 8192, MaxSeqs: 256}

func (tm *timeModel) scale(tp int) float64 { return math.Pow(float64(tp), tm.TPExp) }

func (tm *timeModel) prefill(tokens, tp int) time.Duration {
	return time.Duration(float64(tm.PrefillPerToken) * float64(tokens) / tm.scale(tp))
}

func (tm *timeModel) decode(seqs, tp int) time.Duration {
	return time.Duration((float64(tm.DecodeStep) + float64(tm.DecodePerSeq)*float64(seqs)) / tm.scale(tp))
}

// runConfig is one run: a shape in a mode.
type runConfig struct {
	shape     shape
	mode      mode
	seed      uint64
	time      timeModel
	model     kvsim.Model
	block     int
	dir       string
	p, d      *daemontest.Proc
	corrupt   bool          // corrupt one source byte of one request (tests)
	hop       time.Duration // the router's latency per dispatch
	progress  io.Writer     // nil: quiet
	timeLimit time.Duration
}

type run struct {
	runConfig
	P, D *engine
	reqs []*simReq
}

func (r *run) kvMode() kvxfer.Mode {
	if r.mode == modePull {
		return kvxfer.ModePull
	}
	return kvxfer.ModePush
}

// result is what a run (or, merged, several runs of a shape and mode)
// measured.
type result struct {
	shape                  shape
	mode                   mode
	runs                   int
	requests, done, failed int
	bad                    int
	ttft                   []time.Duration // per finished request, sorted
	tpot                   []time.Duration
	runTTFT                []time.Duration // mean TTFT of each run merged in
	elapsed                time.Duration   // summed over runs
	kvBytes                int64           // bytes D received and verified
	failures               []string
	// Per finished request: arrival to P's prefill start (queue), the
	// prefill, P's prefill end to the KV complete on every D rank as
	// reported to D's engine (kvIn), from there to D's loop taking it
	// (notice: the rest of D's current step), and to the end of D's step
	// that emits the first token (tok1).
	queue, prefill, kvIn, notice, tok1 []time.Duration
	// modelled is the compute time the time model asked of each engine;
	// overrun how much longer the engines' steps took: the simulator's own
	// CPU work and the machine's load. A few percent is timer noise; more
	// means the machine did not keep up and the run's times are inflated.
	modelledP, overrunP, modelledD, overrunD time.Duration
}

func (res *result) reqPerSec() float64 {
	if res.elapsed <= 0 {
		return 0
	}
	return float64(res.done) / res.elapsed.Seconds()
}

func frac(over, of time.Duration) float64 {
	if of <= 0 {
		return 0
	}
	return float64(over) / float64(of)
}

func (res *result) lagP() float64 { return frac(res.overrunP, res.modelledP) }
func (res *result) lagD() float64 { return frac(res.overrunD, res.modelledD) }

// merge pools the runs of one shape and mode (repeats with other seeds).
func merge(rs []*result) *result {
	m := &result{shape: rs[0].shape, mode: rs[0].mode}
	for _, r := range rs {
		m.runs += r.runs
		m.requests += r.requests
		m.done += r.done
		m.failed += r.failed
		m.bad += r.bad
		m.ttft = append(m.ttft, r.ttft...)
		m.tpot = append(m.tpot, r.tpot...)
		m.runTTFT = append(m.runTTFT, r.runTTFT...)
		m.elapsed += r.elapsed
		m.kvBytes += r.kvBytes
		m.failures = append(m.failures, r.failures...)
		m.queue = append(m.queue, r.queue...)
		m.prefill = append(m.prefill, r.prefill...)
		m.kvIn = append(m.kvIn, r.kvIn...)
		m.notice = append(m.notice, r.notice...)
		m.tok1 = append(m.tok1, r.tok1...)
		m.modelledP += r.modelledP
		m.overrunP += r.overrunP
		m.modelledD += r.modelledD
		m.overrunD += r.overrunD
	}
	slices.Sort(m.ttft)
	slices.Sort(m.tpot)
	return m
}

func pct(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	return ds[min(len(ds)-1, int(q*float64(len(ds))))]
}

func mean(ds []time.Duration) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	var s time.Duration
	for _, d := range ds {
		s += d
	}
	return s / time.Duration(len(ds))
}

// blocksFor sizes an engine's cache: every request of the run could be
// resident at once (runs are short), plus the prefix.
func blocksFor(s shape, block int) int {
	per := (s.Input + s.Output + block - 1) / block
	return per*s.Requests + per + 16
}

// simulate runs one shape in one mode against the two daemons.
func simulate(ctx context.Context, cfg runConfig) (*result, error) {
	r := &run{runConfig: cfg}
	s := cfg.shape
	rng := rand.New(rand.NewPCG(cfg.seed, uint64(cfg.mode)+1))
	wrng := rand.New(rand.NewPCG(cfg.seed, 1000)) // the workload: the same in every mode
	nb := blocksFor(s, cfg.block)
	eng := func(id, tp int) kvsim.Engine {
		return kvsim.Engine{ID: id, TP: tp, PP: 1, LogicalBlock: cfg.block, KernelBlock: cfg.block, Layout: topology.LayoutHND,
			Packing: topology.PackedKV, Blocks: nb}
	}
	tag := fmt.Sprintf("%s-%d-%d", cfg.mode, cfg.seed, time.Now().UnixNano()%1e9)
	var err error
	if r.P, err = newEngine(r, cfg.p, "P-"+tag, s.PTP, eng(1, s.PTP), cfg.mode == modeLayerwise, rng); r.P != nil {
		defer r.P.close()
	}
	if err != nil {
		return nil, err
	}
	if r.D, err = newEngine(r, cfg.d, "D-"+tag, s.DTP, eng(2, s.DTP), false, rng); r.D != nil {
		defer r.D.close()
	}
	if err != nil {
		return nil, err
	}
	// D's prefix cache: the shared prefix every request's hit comes from,
	// pinned for the run.
	hitTokens := min(int(s.Hit*float64(s.Input))/cfg.block*cfg.block, (s.Input-1)/cfg.block*cfg.block)
	// (Its bytes are D's own; only the transferred tail is checked.)
	if r.D.blocks.alloc(hitTokens/cfg.block) == nil {
		return nil, fmt.Errorf("no blocks for a %d-token prefix", hitTokens)
	}
	// The workload: Poisson arrivals, from the seed.
	at := time.Duration(0)
	offsets := make([]time.Duration, s.Requests)
	for i := range s.Requests {
		at += time.Duration(wrng.ExpFloat64() / s.Rate * float64(time.Second))
		offsets[i] = at
		r.reqs = append(r.reqs, &simReq{n: i, id: fmt.Sprintf("r%d", i), tid: fmt.Sprintf("%s-x%d", tag, i),
			prompt: s.Input, output: s.Output, hit: hitTokens})
	}
	limit := cfg.timeLimit
	if limit == 0 {
		limit = at + 2*time.Minute
	}
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	wg.Add(3)
	go func() { defer wg.Done(); errs <- r.runP(ctx) }()
	go func() { defer wg.Done(); errs <- r.runD(ctx) }()
	go func() { // the router
		defer wg.Done()
		for i, q := range r.reqs {
			if err := sleepUntil(ctx, start.Add(offsets[i])); err != nil {
				errs <- nil
				return
			}
			q.arrive = time.Now()
			r.dispatch(r.P, q)
			if cfg.mode != modePull { // concurrent dispatch
				r.dispatch(r.D, q)
			}
		}
		errs <- nil
	}()
	if cfg.progress != nil {
		tick := time.NewTicker(2 * time.Second)
		quit := make(chan struct{})
		defer func() { tick.Stop(); close(quit) }()
		go func() {
			for {
				select {
				case <-tick.C:
					fmt.Fprintf(cfg.progress, "\r  %-52s %-9s %5.1fs", s, cfg.mode, time.Since(start).Seconds())
				case <-quit:
					return
				}
			}
		}()
	}
	var firstErr error
	for range 3 {
		if err := <-errs; err != nil && firstErr == nil {
			firstErr = err
			cancel()
		}
	}
	wg.Wait()
	elapsed := time.Since(start)
	if cfg.progress != nil {
		fmt.Fprintf(cfg.progress, "\r%80s\r", "")
	}
	res := r.collect(elapsed)
	if firstErr != nil {
		if errors.Is(firstErr, context.DeadlineExceeded) {
			firstErr = fmt.Errorf("run did not finish within %v (%d of %d requests done)", limit, res.done, res.requests)
		}
		return res, firstErr
	}
	return res, nil
}

// collect turns the requests into a result.
func (r *run) collect(elapsed time.Duration) *result {
	res := &result{shape: r.shape, mode: r.mode, runs: 1, requests: len(r.reqs), elapsed: elapsed,
		modelledP: r.P.modelled, overrunP: r.P.overrun, modelledD: r.D.modelled, overrunD: r.D.overrun}
	bpt := int64(len(r.model.Kinds) * r.model.TotalKVHeads * r.model.HeadSize * r.model.ElemBytes * 2)
	var last time.Time
	for _, x := range r.reqs {
		switch {
		case x.bad != nil:
			res.bad++
			res.failures = append(res.failures, fmt.Sprintf("%s: WRONG BYTES: %v", x.id, x.bad))
		case x.end.IsZero():
			res.failed++
			res.failures = append(res.failures, fmt.Sprintf("%s: not finished (P outcome %v %v %s, D outcome %v %v %s)",
				x.id, x.pGot, x.pResult, x.pReason, x.dGot, x.dResult, x.dReason))
		default:
			res.done++
			res.ttft = append(res.ttft, x.first.Sub(x.arrive))
			if x.output > 1 {
				res.tpot = append(res.tpot, x.end.Sub(x.first)/time.Duration(x.output-1))
			}
			res.queue = append(res.queue, x.pStart.Sub(x.arrive))
			res.prefill = append(res.prefill, x.pEnd.Sub(x.pStart))
			res.kvIn = append(res.kvIn, x.landed.Sub(x.pEnd))
			res.notice = append(res.notice, x.kvAt.Sub(x.landed))
			res.tok1 = append(res.tok1, x.first.Sub(x.kvAt))
			if r.mode != modeBaseline {
				res.kvBytes += int64(x.prompt-x.hit) * bpt
			}
			if x.end.After(last) {
				last = x.end
			}
		}
		if r.mode != modeBaseline && x.pGot && x.pResult != kvxfer.ResultDone && x.bad == nil {
			res.failures = append(res.failures, fmt.Sprintf("%s: producer outcome %v %s", x.id, x.pResult, x.pReason))
		}
	}
	if len(r.reqs) > 0 && !last.IsZero() {
		res.elapsed = last.Sub(r.reqs[0].arrive)
	}
	if len(res.ttft) > 0 {
		res.runTTFT = []time.Duration{mean(res.ttft)}
	}
	slices.Sort(res.ttft)
	slices.Sort(res.tpot)
	return res
}

// runP is the prefill engine's loop: FCFS prefill batches under a token
// budget; a finished prefill ends the request on P (its first token goes
// to the router) and hands its KV on.
func (r *run) runP(ctx context.Context) error {
	en := r.P
	pending := len(r.reqs) // requests without their P-side end
	layers := len(r.model.Kinds)
	for pending > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		en.drainInbox()
		out, err := en.outcomes()
		if err != nil {
			return err
		}
		pending -= r.producerOutcomes(out)
		if err := en.stepErrors(); err != nil {
			return err
		}
		// Admit a prefill batch.
		var batch []*simReq
		tokens := 0
		for len(en.waiting) > 0 {
			x := en.waiting[0]
			if len(batch) > 0 && tokens+x.prompt > r.time.MaxBatchTokens {
				break
			}
			ids := en.blocks.alloc((x.prompt + r.block - 1) / r.block)
			if ids == nil {
				break
			}
			x.pIDs, x.pAdmit = ids, time.Now()
			x.pReq = &kvxfer.Request{ID: "p-" + x.id, PromptTokens: x.prompt,
				Params: &kvxfer.TransferParams{TransferID: x.tid, DoRemoteDecode: true}}
			if en.se != nil {
				if err := en.se.Sched.AfterAlloc(x.pReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}}); err != nil {
					return err
				}
			}
			en.byID[x.pReq.ID] = x
			batch = append(batch, x)
			tokens += x.prompt
			en.waiting = en.waiting[1:]
		}
		if len(batch) == 0 && !en.needStep {
			if err := en.idle(ctx); err != nil {
				return err
			}
			continue
		}
		// The step: metadata out, then the forward pass. Each prefill
		// completes its prompt in this step: a layer-wise scheduler lists
		// it in the step's metadata (a no-op in the other modes).
		if en.se != nil {
			for _, x := range batch {
				if err := en.se.Sched.Prefill(x.pReq, [][]topology.BlockID{x.pIDs}, 0, x.prompt); err != nil {
					return err
				}
			}
		}
		step, err := en.step()
		if err != nil {
			return err
		}
		if len(batch) == 0 {
			continue
		}
		begin := time.Now()
		for _, x := range batch {
			x.pStart = begin
			if r.mode != modeBaseline {
				for _, kr := range en.se.Ranks {
					kr.FillSalt([]topology.Span{{IDs: x.pIDs}}, x.n+1)
				}
				if r.corrupt && x.n == len(r.reqs)/2 {
					// One source byte of one request goes bad before it
					// moves: the run must fail on it.
					kr := en.se.Ranks[0]
					reg := kr.Layout.Regions[0]
					kr.Mem[reg.Base-kr.Base+uint64(x.pIDs[len(x.pIDs)-1])*uint64(reg.BlockLen)] ^= 0x5a
				}
			}
		}
		dur := r.time.prefill(tokens, en.tp)
		for l := range layers {
			if err := sleepUntil(ctx, begin.Add(dur*time.Duration(l+1)/time.Duration(layers))); err != nil {
				return err
			}
			if r.mode == modeLayerwise {
				if err := en.se.LayerSaved(step, l); err != nil {
					return err
				}
			}
		}
		end := time.Now()
		en.lag(dur, end.Sub(begin))
		for _, x := range batch {
			x.pEnd = end
			if r.mode == modeBaseline {
				en.blocks.release(x.pIDs)
				x.pGot, x.pResult = true, kvxfer.ResultDone
				pending--
				r.D.kvReady <- x
				continue
			}
			delay, params, err := en.se.Sched.RequestFinished(x.pReq, kvxfer.FinishLengthCapped, [][]topology.BlockID{x.pIDs}, x.prompt)
			if err != nil {
				return err
			}
			if !delay {
				return fmt.Errorf("producer request %s: RequestFinished did not hold the blocks", x.id)
			}
			en.needStep = true
			if r.mode == modePull { // sequential dispatch: now D gets it
				x.params = params
				r.dispatch(r.D, x)
			}
		}
	}
	return nil
}

// dispatch hands a request to an engine after the router's latency.
func (r *run) dispatch(en *engine, x *simReq) {
	if r.hop <= 0 {
		en.inbox <- x
		return
	}
	time.AfterFunc(r.hop, func() { en.inbox <- x })
}

// producerOutcomes applies P's sending outcomes; it returns how many
// requests ended on P.
func (r *run) producerOutcomes(out *kvxfer.Finished) int {
	n := 0
	for _, o := range out.Sending {
		x := r.P.byID[o.ReqID]
		if x == nil || x.pGot {
			continue // kvxfer reports each request once; the check is the D side's
		}
		delete(r.P.byID, o.ReqID)
		x.pGot, x.pResult, x.pReason = true, o.Result, o.Reason
		r.P.blocks.release(x.pIDs)
		n++
	}
	return n
}

func (en *engine) drainInbox() {
	for {
		select {
		case x := <-en.inbox:
			en.waiting = append(en.waiting, x)
		default:
			return
		}
	}
}

// idle waits for new work: a request, an outcome, KV made ready
// (baseline), or a watchdog tick.
func (en *engine) idle(ctx context.Context) error {
	t := time.NewTimer(100 * time.Millisecond)
	defer t.Stop()
	select {
	case x := <-en.inbox:
		en.waiting = append(en.waiting, x)
	case rf := <-en.fin:
		en.finBuf = append(en.finBuf, rf)
	case x := <-en.kvReady:
		en.readyBuf = append(en.readyBuf, x)
	case <-t.C:
	case <-ctx.Done():
		return ctx.Err()
	}
	return nil
}

// outcomes folds every rank's finished sets received so far and returns
// the engine-wide outcomes.
func (en *engine) outcomes() (*kvxfer.Finished, error) {
	all := &kvxfer.Finished{}
	add := func(rf rankFin) error {
		out, err := en.fold(rf)
		if out != nil {
			all.Sending = append(all.Sending, out.Sending...)
			all.Recving = append(all.Recving, out.Recving...)
		}
		return err
	}
	for _, rf := range en.finBuf {
		if err := add(rf); err != nil {
			return nil, err
		}
	}
	en.finBuf = en.finBuf[:0]
	for {
		select {
		case rf := <-en.fin:
			if err := add(rf); err != nil {
				return nil, err
			}
		default:
			return all, nil
		}
	}
}

// runD is the decode engine's loop: requests wait for their KV, join the
// decode batch at the next step, emit a token per step and leave after
// their output.
func (r *run) runD(ctx context.Context) error {
	en := r.D
	remaining := len(r.reqs)
	var running, ready []*simReq
	kvIn := map[*simReq]bool{} // baseline: prefill ended before admission
	for remaining > 0 {
		if err := ctx.Err(); err != nil {
			return err
		}
		en.drainInbox()
		for more := true; more; {
			select {
			case x := <-en.kvReady:
				en.readyBuf = append(en.readyBuf, x)
			default:
				more = false
			}
		}
		now := time.Now()
		for _, x := range en.readyBuf {
			if x.dAdmit.IsZero() {
				kvIn[x] = true
				continue
			}
			x.landed, x.kvAt, x.dGot, x.dResult = x.pEnd, now, true, kvxfer.ResultDone
			ready = append(ready, x)
		}
		en.readyBuf = en.readyBuf[:0]
		if en.se != nil {
			out, err := en.outcomes()
			if err != nil {
				return err
			}
			for _, o := range out.Recving {
				x, landed := en.byID[o.ReqID], en.landed[o.ReqID]
				delete(en.landed, o.ReqID)
				if x == nil || x.dGot {
					continue
				}
				delete(en.byID, o.ReqID)
				x.landed = landed
				x.kvAt, x.dGot, x.dResult, x.dReason = now, true, o.Result, o.Reason
				if o.Result != kvxfer.ResultDone {
					en.blocks.release(x.dIDs)
					remaining--
					continue
				}
				x.verified = make(chan error, 1)
				go r.verify(x)
				ready = append(ready, x)
			}
			if err := en.stepErrors(); err != nil {
				return err
			}
		}
		// Admit waiting requests: blocks for what the transfer fills.
		for len(en.waiting) > 0 && len(running)+len(ready) < r.time.MaxSeqs {
			x := en.waiting[0]
			nb := (x.prompt+r.block-1)/r.block - x.hit/r.block
			ids := en.blocks.alloc(nb)
			if ids == nil {
				break
			}
			en.waiting = en.waiting[1:]
			x.dIDs, x.dAdmit = ids, time.Now()
			if r.mode == modeBaseline {
				if kvIn[x] {
					delete(kvIn, x)
					x.landed, x.kvAt, x.dGot, x.dResult = x.pEnd, x.dAdmit, true, kvxfer.ResultDone
					ready = append(ready, x)
				}
				continue
			}
			x.dReq = &kvxfer.Request{ID: "d-" + x.id, PromptTokens: x.prompt}
			if r.mode == modePull {
				p := *x.params
				x.dReq.Params = &p
			} else {
				x.dReq.Params = &kvxfer.TransferParams{TransferID: x.tid, DoRemotePrefill: true, RemoteEngineID: r.P.id,
					RemoteAddr: r.p.Peer, RemoteTPSize: r.shape.PTP}
			}
			ext, _ := en.se.Sched.MatchedTokens(x.dReq, x.hit)
			if err := en.se.Sched.AfterAlloc(x.dReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}, Computed: x.hit, External: ext}); err != nil {
				return err
			}
			en.byID[x.dReq.ID] = x
			en.needStep = true
		}
		if len(running) == 0 && len(ready) == 0 && !en.needStep {
			if err := en.idle(ctx); err != nil {
				return err
			}
			continue
		}
		if _, err := en.step(); err != nil {
			return err
		}
		if len(running) == 0 && len(ready) == 0 {
			continue // metadata only: no forward pass
		}
		begin := time.Now()
		running = append(running, ready...)
		ready = ready[:0]
		dur := r.time.decode(len(running), en.tp)
		if err := sleepUntil(ctx, begin.Add(dur)); err != nil {
			return err
		}
		end := time.Now()
		en.lag(dur, end.Sub(begin))
		kept := running[:0]
		for _, x := range running {
			x.generated++
			if x.generated == 1 {
				x.first = end
			}
			if x.generated < x.output {
				kept = append(kept, x)
				continue
			}
			if x.verified != nil {
				x.bad = <-x.verified
			}
			x.end = end
			en.blocks.release(x.dIDs)
			remaining--
		}
		clear(running[len(kept):])
		running = kept
	}
	return nil
}

// verify checks every byte D received for x on every rank.
func (r *run) verify(x *simReq) {
	nb := (x.prompt + r.block - 1) / r.block
	req := &kvsim.Request{Tokens: x.prompt, Salt: x.n + 1,
		P: []topology.Span{{IDs: make([]topology.BlockID, nb)}}, D: []topology.Span{{Start: x.hit, IDs: x.dIDs}}}
	var errs []error
	for _, kr := range r.D.se.Ranks {
		if err := kr.CheckRequest(req, r.block, r.block); err != nil {
			errs = append(errs, err)
		}
	}
	x.verified <- errors.Join(errs...)
}
