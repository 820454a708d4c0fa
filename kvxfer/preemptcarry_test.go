package kvxfer_test

import (
	"fmt"
	"math/rand/v2"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// saveLayers reports layers saved in step on every rank of se.
func saveLayers(t *testing.T, se *simEngine, step uint64, layers ...int) {
	t.Helper()
	for _, stage := range se.workers {
		for _, w := range stage {
			for _, l := range layers {
				if err := w.LayerSaved(step, l); err != nil {
					t.Fatalf("LayerSaved(%d, %d): %v", step, l, err)
				}
			}
		}
	}
	synctest.Wait()
}

// A layer-wise producer its engine preempts while paired with its
// consumer, after its prefill step was listed and some of its layers were
// written (from blocks that, freed, held another request's KV by then),
// keeps its pairing: its engine says it was preempted (FinishPreempted,
// no finish), prefills it again into other blocks, and every layer is
// written again from those into the same consumer blocks. The consumer
// completes without recomputing, every byte of its blocks is the
// request's (no stale layer of the first attempt), a request beside it is
// untouched, each side has one outcome per request, and nothing is left
// held. Before, the preemption was an abort: the consumer failed and
// recomputed the whole prompt.
func TestLayerwisePreemptedPairingCarriesOver(t *testing.T) {
	for _, ptp := range []int{1, 2} {
		for _, retake := range []string{"prefill", "finish"} {
			t.Run(fmt.Sprintf("P tp %d to 1, retaken by its %s", ptp, retake), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) { runPreemptCarry(t, ptp, retake == "prefill") })
			})
		}
	}
}

func runPreemptCarry(t *testing.T, ptp int, prefillAgain bool) {
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	pe, de := e2eEngine(1, ptp, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
	lw := func(c *kvxfer.WorkerConfig) { c.Layerwise = true }
	P := newStack(t, startEngine(t, fab, dir, &model, pe, "P", kvxfer.ModePush, lw), kvxfer.ModePush)
	D := newStack(t, startEngine(t, fab, dir, &model, de, "D", kvxfer.ModePush, nil), kvxfer.ModePush)
	defer D.se.close(t)
	defer P.se.close(t)
	l := P.se.ranks[0][0].Layout
	ps, err := kvxfer.NewScheduler(kvxfer.SchedulerConfig{EngineID: "P", Addr: "P:1", Mode: kvxfer.ModePush, Layerwise: true,
		TPSize: l.TPSize, PPSize: l.PPSize, LogicalBlockSize: l.LogicalBlockSize, Groups: l.GroupList()})
	if err != nil {
		t.Fatal(err)
	}
	P.sched = ps
	rng := rand.New(rand.NewPCG(7, 8))
	groups := l.GroupList()
	pPool, dPool := newPool(rng, len(groups), pe.Blocks, true), newPool(rng, len(groups), de.Blocks, true)
	var before [][]byte
	for _, r := range D.se.ranks[0] {
		r.Scramble(4)
		before = append(before, r.Snapshot())
	}
	const tokens = 40
	type job struct {
		id         string
		p, d       [][]topology.BlockID
		pReq, dReq *kvxfer.Request
		sim        kvsim.Request
	}
	spansOf := func(b [][]topology.BlockID) []topology.Span {
		s := make([]topology.Span, len(b))
		for g := range b {
			s[g] = topology.Span{IDs: b[g]}
		}
		return s
	}
	var jobs []*job
	for _, id := range []string{"a", "b"} {
		j := &job{id: id}
		for g := range groups {
			j.p = append(j.p, pPool.take(g, (tokens+15)/16))
			j.d = append(j.d, dPool.take(g, (tokens+15)/16))
		}
		j.pReq = &kvxfer.Request{ID: "p-" + id, PromptTokens: tokens, Params: &kvxfer.TransferParams{TransferID: "t-" + id, DoRemoteDecode: true}}
		j.dReq = &kvxfer.Request{ID: "d-" + id, PromptTokens: tokens, Params: &kvxfer.TransferParams{TransferID: "t-" + id,
			DoRemotePrefill: true, RemoteEngineID: "P", RemoteAddr: "P:1", RemoteTPSize: ptp}}
		n, async := D.sched.MatchedTokens(j.dReq, 0)
		if !async || n != tokens {
			t.Fatalf("MatchedTokens = %d, %v", n, async)
		}
		if err := D.sched.AfterAlloc(j.dReq, kvxfer.Alloc{Blocks: j.d, External: n}); err != nil {
			t.Fatal(err)
		}
		for _, r := range P.se.ranks[0] {
			r.Fill(spansOf(j.p))
		}
		if err := P.sched.Prefill(j.pReq, j.p, 0, tokens); err != nil {
			t.Fatal(err)
		}
		j.sim = kvsim.Request{Tokens: tokens, D: spansOf(j.d)}
		jobs = append(jobs, j)
	}
	a, b := jobs[0], jobs[1]
	D.step(t) // registrations
	// a's first attempt: its blocks hold another request's KV by the time
	// its layers 0 and 1 are read (freed and reused), so they land stale.
	for _, r := range P.se.ranks[0] {
		r.FillSalt(spansOf(a.p), 9)
	}
	s1 := P.step(t)
	for range 10 { // the handshake and the registrations
		D.step(t)
		P.step(t)
		time.Sleep(10 * time.Millisecond)
	}
	posted := func() int {
		n := 0
		for _, a := range P.se.agents[0] {
			n += a.Posted()
		}
		return n
	}
	saveLayers(t, P.se, s1, 0, 1)
	if n := posted(); n != 4*ptp {
		t.Fatalf("posted %d WRITEs after layers 0 and 1 of two requests were saved, want %d", n, 4*ptp)
	}
	D.step(t)
	// Preempted: not a finish, no outcome, no params.
	if delay, params, err := P.sched.RequestFinished(a.pReq, kvxfer.FinishStatus(5), nil, 0); err != nil || delay || params != nil {
		t.Fatalf("RequestFinished(preempted) = %v, %v, %v; want no delay, no params, no error", delay, params, err)
	}
	P.step(t)
	// The step's last layer, after the preemption: b's is written, a's
	// (from its freed blocks) is not.
	saveLayers(t, P.se, s1, 2)
	D.step(t)
	// a's second attempt, into other blocks, with its own KV.
	old := a.p
	a.p = nil
	for g := range groups {
		a.p = append(a.p, pPool.take(g, (tokens+15)/16))
	}
	for _, r := range P.se.ranks[0] {
		r.Fill(spansOf(a.p))
		r.FillSalt(spansOf(old), 11) // the freed blocks, reused again
	}
	if prefillAgain {
		if err := P.sched.Prefill(a.pReq, a.p, 0, tokens); err != nil {
			t.Fatal(err)
		}
		s3 := P.step(t)
		saveLayers(t, P.se, s3, 2, 0, 1)
		D.step(t)
	}
	for _, j := range jobs {
		delay, params, err := P.sched.RequestFinished(j.pReq, kvxfer.FinishStopped, j.p, tokens)
		if err != nil || !delay {
			t.Fatalf("%s: RequestFinished = %v, %v", j.id, delay, err)
		}
		j.sim.P = params.RemoteBlockIDs
	}
	for range 50 {
		P.step(t)
		D.step(t)
		if len(P.sent) == len(jobs) && len(D.recvd) == len(jobs) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	for _, j := range jobs {
		if o := P.sent["p-"+j.id]; o.Result != kvxfer.ResultDone {
			t.Errorf("P %s = %+v, want done", j.id, o)
		}
		if o := D.recvd["d-"+j.id]; o.Result != kvxfer.ResultDone {
			t.Errorf("D %s = %+v, want done (no recompute)", j.id, o)
		}
	}
	if P.sched.HasPendingWork() || D.sched.Watching() != 0 || P.agg.Pending()+D.agg.Pending() != 0 {
		t.Errorf("left over: P pending %v, D watching %d, aggregators %d/%d", P.sched.HasPendingWork(), D.sched.Watching(), P.agg.Pending(), D.agg.Pending())
	}
	for _, se := range []*simEngine{P.se, D.se} {
		for _, stage := range se.workers {
			for _, w := range stage {
				st, err := w.State()
				if err != nil {
					t.Fatal(err)
				}
				if st.Sends+st.Recvs+st.Matches+st.LayerSteps+st.Handles != 0 {
					t.Errorf("%s: still held: %+v", se.id, st)
				}
			}
		}
	}
	for i, r := range D.se.ranks[0] {
		if err := r.CheckValues(before[i], []*kvsim.Request{&a.sim, &b.sim}, 16, 16); err != nil {
			t.Errorf("D rank %d: %v", i, err)
		}
	}
}
