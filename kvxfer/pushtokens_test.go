package kvxfer_test

import (
	"math/rand/v2"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A push consumer that takes more tokens as loaded than its producer's
// request holds (a router that gave D a longer prompt than P's) is
// refused at once, naming both counts, and nothing is written into its
// blocks; the producer's request fails too. Before, a registration
// carried no token count: P WRITEs its 40 tokens, and D's request,
// taking 48 as loaded, was reported done with its last 8 tokens' KV
// never written (zeros, or a former request's bytes in a reused pool).
// A consumer taking as many or fewer is served as ever.
func TestPushConsumerTakingMoreTokensIsRefused(t *testing.T) {
	for _, layerwise := range []bool{false, true} {
		for _, ptp := range []int{1, 2} {
			for _, dTokens := range []int{48, 40, 0} {
				name := map[bool]string{false: "whole", true: "layerwise"}[layerwise] + "/" + map[int]string{1: "P-tp1", 2: "P-tp2"}[ptp] + "/" +
					map[int]string{48: "more", 40: "same", 0: "unsaid"}[dTokens]
				t.Run(name, func(t *testing.T) {
					synctest.Test(t, func(t *testing.T) { runPushTokens(t, layerwise, ptp, dTokens) })
				})
			}
		}
	}
}

// Layer-wise, P's prefill entry gives the prompt's tokens (48 here) and
// its finish those it holds (40: a prefill backoff of 8): the consumer is
// refused at the finish, its blocks taken as not loaded though layers
// were written into them.
func runPushTokens(t *testing.T, layerwise bool, ptp, dTokens int) {
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	pe, de := e2eEngine(1, ptp, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
	var tweak func(*kvxfer.WorkerConfig)
	if layerwise {
		tweak = func(c *kvxfer.WorkerConfig) { c.Layerwise = true }
	}
	p := startEngine(t, fab, dir, &model, pe, "P", kvxfer.ModePush, tweak)
	d := startEngine(t, fab, dir, &model, de, "D", kvxfer.ModePush, nil)
	defer d.close(t)
	defer p.close(t)
	rng := rand.New(rand.NewPCG(1, 2))
	groups := d.ranks[0][0].Layout.GroupList()
	q := makeRequest("x", 40, 0, groups, pe, de, newPool(rng, 1, pe.Blocks, true), newPool(rng, 1, de.Blocks, true))
	for _, r := range p.ranks[0] {
		r.Fill(q.sim.P)
	}
	before := d.ranks[0][0].Snapshot()
	start := time.Now()
	rr := q.recv(kvxfer.ModePush, p, start.Add(time.Minute))
	rr.Tokens = dTokens // its 3 blocks of 16 hold 48
	d.step(t, &kvxfer.StepMeta{SchedulerClock: start, Recv: []kvxfer.RecvReq{rr}})
	if layerwise {
		pre := q.send(time.Time{})
		pre.Tokens = 48
		p.step(t, &kvxfer.StepMeta{Step: 7, SchedulerClock: start, Prefill: []kvxfer.SendReq{pre}})
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		for _, w := range p.workers[0] {
			if err := w.LayerSaved(7, 0); err != nil {
				t.Fatal(err)
			}
		}
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
	}
	p.step(t, &kvxfer.StepMeta{Step: 8, SchedulerClock: start, Send: []kvxfer.SendReq{q.send(start.Add(30 * time.Second))}})
	out := newOutcomes()
	for (len(out.recv["d-x"]) == 0 || len(out.send["p-x"]) < ptp) && time.Since(start) < 2*time.Minute {
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		out.collect(t, p)
		out.collect(t, d)
	}
	took := time.Since(start)
	o, ps := out.recv["d-x"], out.send["p-x"]
	if dTokens <= 40 {
		if len(o) != 1 || o[0].Result != kvxfer.ResultDone || len(ps) != ptp || ps[0].Result != kvxfer.ResultDone {
			t.Fatalf("consumer taking %d tokens of 40: outcomes %+v, producer %+v; want done on both sides", dTokens, o, ps)
		}
		if err := d.ranks[0][0].CheckValues(before, []*kvsim.Request{&q.sim}, 16, 16); err != nil {
			t.Error(err)
		}
		return
	}
	const want = `consumer request "d-x" takes 48 tokens as loaded (its registration's token count), but producer request "p-x" holds 40`
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || !strings.Contains(o[0].Reason, want) {
		t.Fatalf("consumer outcomes %+v, want one failed naming %q", o, want)
	}
	if len(ps) != ptp || ps[0].Result != kvxfer.ResultFailed {
		t.Errorf("producer outcomes %+v, want one failed per rank (%d)", ps, ptp)
	}
	if took > 5*time.Second {
		t.Errorf("outcomes after %v, want at once (the deadline was a minute away, the lease 30 s)", took)
	}
	if err := d.ranks[0][0].CheckValues(before, nil, 16, 16); err != nil && !layerwise {
		t.Errorf("the refused consumer's blocks were written: %v", err)
	}
	for i, w := range p.workers[0] {
		if n := w.Metrics().Snapshot().BadInput["reg.tokens"]; n != 1 {
			t.Errorf("P rank %d counted reg.tokens %d times, want 1", i, n)
		}
	}
}
