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

// engineStack is an engine as kvxfer sees it: a Scheduler, one Worker per
// rank and an Aggregator folding their outcomes for the scheduler.
type engineStack struct {
	se    *simEngine
	sched *kvxfer.Scheduler
	agg   *kvxfer.Aggregator
	// outcomes the engine's scheduler saw, by request id.
	sent, recvd map[string]kvxfer.Outcome
}

func newStack(t *testing.T, se *simEngine, mode kvxfer.Mode) *engineStack {
	t.Helper()
	l := se.ranks[0][0].Layout
	s, err := kvxfer.NewScheduler(kvxfer.SchedulerConfig{EngineID: se.id, Addr: se.id + ":1", Mode: mode,
		TPSize: l.TPSize, PPSize: l.PPSize, LogicalBlockSize: l.LogicalBlockSize, Groups: l.GroupList()})
	if err != nil {
		t.Fatal(err)
	}
	a, err := kvxfer.NewAggregator(l.TPSize * l.PPSize)
	if err != nil {
		t.Fatal(err)
	}
	return &engineStack{se: se, sched: s, agg: a, sent: map[string]kvxfer.Outcome{}, recvd: map[string]kvxfer.Outcome{}}
}

// step builds the scheduler's metadata, hands it to every rank, and feeds
// the ranks' outcomes back through the aggregator. It returns the step's
// number.
func (e *engineStack) step(t *testing.T) uint64 {
	t.Helper()
	m := e.sched.BuildMeta()
	e.se.step(t, m)
	synctest.Wait()
	rank := 0
	for _, stage := range e.se.workers {
		for _, w := range stage {
			f := w.Finished()
			out, err := e.agg.Add(rank, &f)
			if err != nil {
				t.Fatal(err)
			}
			rank++
			if out == nil {
				continue
			}
			for _, o := range out.Sending {
				if _, dup := e.sent[o.ReqID]; dup {
					t.Errorf("%s: %s reported sending twice", e.se.id, o.ReqID)
				}
				e.sent[o.ReqID] = o
			}
			for _, o := range out.Recving {
				if _, dup := e.recvd[o.ReqID]; dup {
					t.Errorf("%s: %s reported receiving twice", e.se.id, o.ReqID)
				}
				e.recvd[o.ReqID] = o
			}
			e.sched.Update(out)
		}
	}
	return m.Step
}

// TestFullStack drives two engines through their Schedulers, Workers and
// Aggregators as a router would: push with concurrent dispatch (D learns
// P's coordinates and the transfer id up front), pull with sequential
// dispatch (D gets P's returned params). Every byte is checked.
func TestFullStack(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { runFullStack(t, mode) })
		})
	}
}

func runFullStack(t *testing.T, mode kvxfer.Mode) {
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa, swa, fa}, Window: 40, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	pe, de := e2eEngine(1, 2, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
	P := newStack(t, startEngine(t, fab, dir, &model, pe, "P", mode, nil), mode)
	D := newStack(t, startEngine(t, fab, dir, &model, de, "D", mode, nil), mode)
	defer D.se.close(t)
	defer P.se.close(t)
	rng := rand.New(rand.NewPCG(5, 6))
	groups := P.se.ranks[0][0].Layout.GroupList()
	pPool, dPool := newPool(rng, len(groups), pe.Blocks, true), newPool(rng, len(groups), de.Blocks, true)
	for _, r := range P.se.ranks[0] {
		r.Scramble(3)
	}
	var before [][]byte
	for _, r := range D.se.ranks[0] {
		r.Scramble(4)
		before = append(before, r.Snapshot())
	}
	type job struct {
		id             string
		tokens, hit    int
		pBlocks, dBlks [][]topology.BlockID
		sim            kvsim.Request
	}
	var jobs []*job
	for i := range 12 {
		j := &job{id: fmt.Sprint(i), tokens: 20 + rng.IntN(60)}
		if i%3 == 1 {
			j.hit = 16
		}
		for g := range groups {
			j.pBlocks = append(j.pBlocks, pPool.take(g, (j.tokens+15)/16))
			j.dBlks = append(j.dBlks, dPool.take(g, (j.tokens-j.hit+15)/16))
		}
		jobs = append(jobs, j)
	}
	for _, j := range jobs {
		pReq := &kvxfer.Request{ID: "p-" + j.id, PromptTokens: j.tokens, Params: &kvxfer.TransferParams{TransferID: "t-" + j.id, DoRemoteDecode: true}}
		dReq := &kvxfer.Request{ID: "d-" + j.id, PromptTokens: j.tokens}
		if mode == kvxfer.ModePush {
			// Concurrent dispatch: D allocates and registers at once.
			dReq.Params = &kvxfer.TransferParams{TransferID: "t-" + j.id, DoRemotePrefill: true, RemoteEngineID: "P", RemoteAddr: "P:1", RemoteTPSize: 2}
			n, async := D.sched.MatchedTokens(dReq, j.hit)
			if !async || n != j.tokens-j.hit {
				t.Fatalf("MatchedTokens = %d, %v", n, async)
			}
			if err := D.sched.AfterAlloc(dReq, kvxfer.Alloc{Blocks: j.dBlks, Computed: j.hit, External: n}); err != nil {
				t.Fatal(err)
			}
		}
		// P prefills and finishes.
		if err := P.sched.AfterAlloc(pReq, kvxfer.Alloc{Blocks: j.pBlocks}); err != nil {
			t.Fatal(err)
		}
		// Fill P's KV for the request as its prefill would.
		spans := make([]topology.Span, len(groups))
		for g := range groups {
			spans[g] = topology.Span{IDs: j.pBlocks[g]}
		}
		for _, r := range P.se.ranks[0] {
			r.Fill(spans)
		}
		delay, params, err := P.sched.RequestFinished(pReq, kvxfer.FinishStopped, j.pBlocks, j.tokens)
		if err != nil || !delay {
			t.Fatalf("P RequestFinished = %v, %v", delay, err)
		}
		j.sim = kvsim.Request{Tokens: j.tokens, P: params.RemoteBlockIDs}
		if mode == kvxfer.ModePull {
			dReq.Params = params
			n, _ := D.sched.MatchedTokens(dReq, j.hit)
			if err := D.sched.AfterAlloc(dReq, kvxfer.Alloc{Blocks: j.dBlks, Computed: j.hit, External: n}); err != nil {
				t.Fatal(err)
			}
		}
	}
	// D's staged lists are what its workers got; rebuild them for the
	// byte check from the same clipping.
	for _, j := range jobs {
		for g, grp := range groups {
			ds := topology.Span{Start: j.hit, IDs: j.dBlks[g]}
			if grp.Kind == swa {
				var drop int
				ds.IDs, drop = topology.ClipWindow(ds.IDs, grp.Window, 16)
				ds.Start += drop * 16
			}
			j.sim.D = append(j.sim.D, ds)
		}
	}
	for range 50 {
		P.step(t)
		D.step(t)
		if len(P.sent) == len(jobs) && len(D.recvd) == len(jobs) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	var sims []*kvsim.Request
	for _, j := range jobs {
		if o := P.sent["p-"+j.id]; o.Result != kvxfer.ResultDone {
			t.Errorf("P %s = %+v, want done", j.id, o)
		}
		if o := D.recvd["d-"+j.id]; o.Result != kvxfer.ResultDone {
			t.Errorf("D %s = %+v, want done", j.id, o)
		}
		sims = append(sims, &j.sim)
	}
	if P.sched.HasPendingWork() || D.sched.Watching() != 0 || P.agg.Pending()+D.agg.Pending() != 0 {
		t.Errorf("left over: P pending %v, D watching %d, aggregators %d/%d", P.sched.HasPendingWork(), D.sched.Watching(), P.agg.Pending(), D.agg.Pending())
	}
	for i, r := range D.se.ranks[0] {
		if err := r.CheckValues(before[i], sims, 16, 16); err != nil {
			t.Errorf("D rank %d: %v", i, err)
		}
	}
}
