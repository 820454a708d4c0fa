package kvxfer_test

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// TestSameRequestIDOnTwoProducers: one D engine receives two requests
// whose producer requests have the same id on two P engines (engines
// name their requests independently), with distinct transfer ids, none,
// or the same one. Each D request is done only once its own producer
// sent, holding that producer's bytes (each P's KV has its own salt), and
// every other byte of D is untouched; one outcome per request per rank.
func TestSameRequestIDOnTwoProducers(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, tids := range []string{"distinct", "none", "same"} {
			for _, ptp := range []int{1, 2} {
				t.Run(fmt.Sprintf("%v/%s/P-tp%d", mode, tids, ptp), func(t *testing.T) {
					synctest.Test(t, func(t *testing.T) { runSameIDTwoProducers(t, mode, tids, ptp) })
				})
			}
		}
	}
}

func runSameIDTwoProducers(t *testing.T, mode kvxfer.Mode, tids string, ptp int) {
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	pe1, pe2, de := e2eEngine(1, ptp, 1, 16, 16), e2eEngine(3, ptp, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
	p1 := startEngine(t, fab, dir, &model, pe1, "P1", mode, nil)
	p2 := startEngine(t, fab, dir, &model, pe2, "P2", mode, nil)
	d := startEngine(t, fab, dir, &model, de, "D", mode, nil)
	defer d.close(t)
	defer p2.close(t)
	defer p1.close(t)
	rng := rand.New(rand.NewPCG(3, 4))
	groups := d.ranks[0][0].Layout.GroupList()
	dp := newPool(rng, len(groups), de.Blocks, true)
	// The same blocks on both producers too.
	q1 := makeRequest("x", 40, 0, groups, pe1, de, newPool(rand.New(rand.NewPCG(5, 6)), len(groups), pe1.Blocks, true), dp)
	q2 := makeRequest("x", 40, 0, groups, pe2, de, newPool(rand.New(rand.NewPCG(5, 6)), len(groups), pe2.Blocks, true), dp)
	q1.sim.Salt, q2.sim.Salt = 1, 2
	for i, p := range []*simEngine{p1, p2} {
		for _, r := range p.ranks[0] {
			r.Scramble(uint64(i + 1))
			r.FillSalt([]*kvsim.Request{&q1.sim, &q2.sim}[i].P, i+1)
		}
	}
	before := d.ranks[0][0].Snapshot()
	now := time.Now()
	r1, r2 := q1.recv(mode, p1, now.Add(time.Minute)), q2.recv(mode, p2, now.Add(time.Minute))
	r1.ReqID, r2.ReqID = "d-1", "d-2"
	s1, s2 := q1.send(now.Add(30*time.Second)), q2.send(now.Add(30*time.Second))
	switch tids {
	case "distinct":
		r1.TransferID, s1.TransferID = "t-1", "t-1"
		r2.TransferID, s2.TransferID = "t-2", "t-2"
	case "none":
		r1.TransferID, s1.TransferID, r2.TransferID, s2.TransferID = "", "", "", ""
	}
	d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r1, r2}})
	p1.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s1}})
	out := newOutcomes()
	settle := func() {
		for range 50 {
			synctest.Wait()
			for _, se := range []*simEngine{p1, p2, d} {
				out.collect(t, se)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	settle()
	if o := out.recv["d-2"]; len(o) > 0 {
		t.Errorf("d-2 ended before its producer P2 sent: %+v", o)
	}
	if o := out.recv["d-1"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Errorf("d-1 outcomes once P1 sent: %+v, want done", o)
	}
	p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s2}})
	settle()
	if o := out.send["p-x"]; len(o) != 2*ptp {
		t.Errorf("producer outcomes of p-x: %+v, want one per rank of each producer (%d)", o, 2*ptp)
	}
	for _, o := range out.send["p-x"] {
		if o.Result != kvxfer.ResultDone {
			t.Errorf("producer outcome %+v, want done", o)
		}
	}
	if o := out.recv["d-2"]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
		t.Errorf("d-2 outcomes: %+v, want done", o)
	}
	if err := d.ranks[0][0].CheckValues(before, []*kvsim.Request{&q1.sim, &q2.sim}, 16, 16); err != nil {
		t.Error(err)
	}
}

// TestTwoConsumersNameOneProducerRequest: two D engines receive the KV of
// one producer request (a router that sent the request twice), with the
// same transfer id, distinct ones or none, in each order. Either may end
// done or not (P refuses to choose between two registrations of one
// transfer; a late one finds it finished), but one done holds P's bytes,
// one not done left every byte of its engine untouched, and each request
// ends once per rank on each side.
func TestTwoConsumersNameOneProducerRequest(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		for _, tids := range []string{"same", "distinct", "none"} {
			for _, order := range []string{"d1 d2 p", "p d1 d2", "d1 p d2"} {
				t.Run(fmt.Sprintf("%v/%s/%s", mode, tids, order), func(t *testing.T) {
					synctest.Test(t, func(t *testing.T) { runTwoConsumers(t, mode, tids, order) })
				})
			}
		}
	}
}

func runTwoConsumers(t *testing.T, mode kvxfer.Mode, tids, order string) {
	_, p, d1, d2, q1, q2, stop := twoConsumerEngines(t, mode)
	defer stop()
	b1, b2 := d1.ranks[0][0].Snapshot(), d2.ranks[0][0].Snapshot()
	now := time.Now()
	r1, r2 := q1.recv(mode, p, now.Add(time.Minute)), q2.recv(mode, p, now.Add(time.Minute))
	r1.ReqID, r2.ReqID = "d-1", "d-2"
	s := q1.send(now.Add(30 * time.Second))
	switch tids {
	case "distinct":
		r2.TransferID = "t-other"
	case "none":
		r1.TransferID, r2.TransferID, s.TransferID = "", "", ""
	}
	out := newOutcomes()
	settle := func() {
		for range 30 {
			synctest.Wait()
			for _, se := range []*simEngine{p, d1, d2} {
				out.collect(t, se)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	for _, c := range strings.Fields(order) {
		switch c {
		case "p":
			p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s}})
		case "d1":
			d1.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r1}})
		case "d2":
			d2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r2}})
			if mode == kvxfer.ModePull && order != "d1 d2 p" && tids != "distinct" {
				// d-2 asks whether P holds p-x once P's request, read by
				// d-1, has ended: P answers at once that it does not, and
				// why, and d-2 fails with no time passing. Before, P kept
				// the question as one about a request not handed over yet,
				// and never answered it: d-2 failed only when its hold
				// check ran out, 1.15 s later (a second or so in which its
				// engine waited for KV nobody would send).
				asked := time.Now()
				for range 5 {
					synctest.Wait()
					for _, se := range []*simEngine{p, d1, d2} {
						out.collect(t, se)
					}
				}
				o := out.recv["d-2"]
				if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailureSetup ||
					!strings.Contains(o[0].Reason, `producer request "p-x"`) || !strings.Contains(o[0].Reason, "ended") {
					t.Errorf("d-2, asking after P's request read by d-1 ended: outcomes %v, want one failed at once (transfer_setup_failed), naming p-x and that it ended", o)
				}
				if d := time.Since(asked); d != 0 {
					t.Errorf("d-2 ended %v after it asked, want at once", d)
				}
				for _, w := range d2.workers[0] {
					if n := w.Metrics().Snapshot().Dropped["pull_params_not_held"]; n != 1 {
						t.Errorf(`D2: dropped{reason="pull_params_not_held"} = %d, want 1`, n)
					}
				}
			}
		}
		settle()
	}
	if mode == kvxfer.ModePush && order == "p d1 d2" && tids != "distinct" {
		// d-2 registers once P's request, paired with d-1, has ended: it
		// is told so at once. Before, it waited for its deadline (a
		// minute), its blocks held, for KV P no longer holds.
		if o := out.recv["d-2"]; len(o) != 1 || o[0].Result != kvxfer.ResultFailed {
			t.Errorf("d-2, registered after P's request paired with d-1 ended: outcomes %v, want one failed at once", o)
		}
	}
	if tids != "distinct" {
		// Every request ends promptly, not at a deadline (the consumers'
		// is a minute, the producer's lease 30 s), and holds nothing on
		// either side once it has: within 2 s (a pull consumer that asks
		// after the producer's request ended is told so at once; one
		// naming it under another transfer learns it from the hold
		// check, within its bound of about a second). Before, two
		// consumer requests that registered under one transfer before
		// the producer's request came (push, d1 d2 p) were told nothing
		// when it refused to choose between them: each waited for its
		// deadline, its blocks held.
		time.Sleep(2 * time.Second)
		settle()
		for _, x := range []struct {
			id  string
			got []kvxfer.Outcome
		}{{"d-1", out.recv["d-1"]}, {"d-2", out.recv["d-2"]}, {"p-x", out.send["p-x"]}} {
			want := 1
			if x.id == "p-x" {
				want = pTP
			}
			if len(x.got) != want {
				t.Errorf("%s, once every request was handed over: outcomes %v, want %d at once", x.id, x.got, want)
			}
		}
		if mode == kvxfer.ModePush && order == "d1 d2 p" {
			for _, w := range p.workers[0] {
				if n := w.Metrics().Snapshot().Dropped["reg_ambiguous"]; n != 2 {
					t.Errorf(`P rank %d: dropped{reason="reg_ambiguous"} = %d, want 2 (d-1's and d-2's registrations)`, w.Layout().TPRank, n)
				}
			}
		}
		checkNothingHeld(t, p, d1, d2)
	}
	time.Sleep(2 * time.Minute)
	settle()
	for _, x := range []struct {
		id     string
		d      *simEngine
		before []byte
		q      *xreq
	}{{"d-1", d1, b1, q1}, {"d-2", d2, b2, q2}} {
		o := out.recv[x.id]
		if len(o) != 1 {
			t.Errorf("%s: outcomes %v, want one", x.id, o)
			continue
		}
		var sims []*kvsim.Request
		if o[0].Result == kvxfer.ResultDone {
			sims = append(sims, &x.q.sim)
		}
		if err := x.d.ranks[0][0].CheckValues(x.before, sims, 16, 16); err != nil {
			t.Errorf("%s (%v): %v", x.id, o[0].Result, err)
		}
	}
	if len(out.send["p-x"]) != pTP {
		t.Errorf("P outcomes %v, want one per rank", out.send["p-x"])
	}
}

// TestTwoConsumersRanksPairApart: push, P at TP 2 holds a request when
// two consumer requests register for its transfer, d-1 naming it by id
// too and d-2 by the transfer id alone, and they reach P's ranks in
// different orders: rank 1 has d-1's registration first, rank 0 d-2's
// (d-1's to rank 0 delayed). Each rank pairs the first that came (a
// registration waiting before the request came would have been told
// apart by the id: namedBy), so the ranks write different consumers,
// and each consumer is refused by the other rank: while that rank's
// WRITE is in flight (reg_taken), or once it ended (the request ended
// paired). Neither consumer holds KV of the whole request: both fail at
// once, naming the consumer the refusing rank paired, and once they have
// nothing is held on any rank of either side (no request, registration,
// match or transfer): no one waits for a deadline (the consumers' a
// minute) or a lease (P's 30 s). P's ranks end once each.
func TestTwoConsumersRanksPairApart(t *testing.T) {
	for _, writing := range []bool{false, true} {
		t.Run(fmt.Sprintf("writing=%v", writing), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) { runRanksPairApart(t, writing) })
		})
	}
}

func runRanksPairApart(t *testing.T, writing bool) {
	fab, p, d1, d2, q1, q2, stop := twoConsumerEngines(t, kvxfer.ModePush)
	defer stop()
	now := time.Now()
	r1, r2 := q1.recv(kvxfer.ModePush, p, now.Add(time.Minute)), q2.recv(kvxfer.ModePush, p, now.Add(time.Minute))
	r1.ReqID, r2.ReqID = "d-1", "d-2"
	r2.Remote.ReqID = "" // named by its transfer id alone
	s := q1.send(now.Add(30 * time.Second))
	if r1.TransferID == "" || r1.TransferID != r2.TransferID || s.TransferID != r1.TransferID {
		t.Fatalf("transfer ids %q, %q, %q: want one for all", r1.TransferID, r2.TransferID, s.TransferID)
	}
	out := newOutcomes()
	settle := func() {
		for range 30 {
			synctest.Wait()
			for _, se := range []*simEngine{p, d1, d2} {
				out.collect(t, se)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	consumers := []kvxfer.PeerName{"D1/pp0/tp0", "D2/pp0/tp0"}
	if writing {
		for _, a := range consumers {
			fab.Faults().Stall(a)
		}
	}
	p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s}})
	settle()
	// d-1's registrations go to P's rank 0, then rank 1: the first is
	// held back.
	fab.Faults().DelayNotifs(1)
	d1.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r1}})
	settle()
	d2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r2}})
	settle()
	start := time.Now()
	if n := fab.Faults().DeliverDelayed(); n != 1 {
		t.Fatalf("%d notifications held back, want d-1's registration to P's rank 0", n)
	}
	settle()
	for _, a := range consumers {
		fab.Faults().Unstall(a)
	}
	settle()
	for _, c := range []struct{ id, other string }{{"d-1", "d-2"}, {"d-2", "d-1"}} {
		o := out.recv[c.id]
		if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || !strings.Contains(o[0].Reason, fmt.Sprintf("%q", c.other)) {
			t.Errorf("%s: outcomes %v, want one failed at once, naming %s (paired at the rank that refused it)", c.id, o, c.other)
		}
	}
	if o := out.send["p-x"]; len(o) != pTP {
		t.Errorf("p-x: outcomes %v, want one per rank at once", o)
	}
	if writing {
		for _, w := range p.workers[0] {
			if n := w.Metrics().Snapshot().Dropped["reg_taken"]; n != 1 {
				t.Errorf(`P rank %d: dropped{reason="reg_taken"} = %d, want 1 (the registration that came second)`, w.Layout().TPRank, n)
			}
		}
	}
	checkNothingHeld(t, p, d1, d2)
	if d := time.Since(start); d > time.Second {
		t.Errorf("%v to settle, want well under a second", d)
	}
	time.Sleep(2 * time.Minute) // past every deadline and lease: nothing more
	settle()
	for _, id := range []string{"d-1", "d-2"} {
		if o := out.recv[id]; len(o) != 1 {
			t.Errorf("%s: outcomes %v, want one", id, o)
		}
	}
	if o := out.send["p-x"]; len(o) != pTP {
		t.Errorf("p-x: outcomes %v, want one per rank", o)
	}
}

// checkNothingHeld checks that no rank of the engines holds a request, a
// match, a transfer or a registered block id once every request ended.
// (A consumer's give-up may wait among the registrations, holding no
// block: a cancel that crossed our failure notice.)
func checkNothingHeld(t *testing.T, engines ...*simEngine) {
	t.Helper()
	for _, se := range engines {
		for _, w := range se.workers[0] {
			st, err := w.State()
			if err != nil {
				t.Fatal(err)
			}
			if n := kvxfer.RegBlockIDs(w); st.Sends+st.Matches+st.Recvs+st.Handles+st.Releasing+n != 0 {
				t.Errorf("%s rank %d once every request ended: holds %+v, %d block ids in registrations; want no request, registered block or transfer",
					se.id, w.Layout().TPRank, st, n)
			}
		}
	}
}

// pTP is P's TP size in twoConsumerEngines.
const pTP = 2

// twoConsumerEngines starts P (TP pTP, its blocks scrambled) and two
// consumer engines D1 and D2 of mode, and request x of 40 tokens: q1
// D1's, q2 D2's, both naming P's same blocks, which hold q1's KV (salt
// 1, both requests' salt), on fab. stop closes the engines.
func twoConsumerEngines(t *testing.T, mode kvxfer.Mode) (fab *kvxfertest.Fabric, p, d1, d2 *simEngine, q1, q2 *xreq, stop func()) {
	t.Helper()
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	pe, de1, de2 := e2eEngine(1, pTP, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16), e2eEngine(3, 1, 1, 16, 16)
	p = startEngine(t, fab, dir, &model, pe, "P", mode, nil)
	d1 = startEngine(t, fab, dir, &model, de1, "D1", mode, nil)
	d2 = startEngine(t, fab, dir, &model, de2, "D2", mode, nil)
	rng := rand.New(rand.NewPCG(3, 4))
	groups := p.ranks[0][0].Layout.GroupList()
	pool := newPool(rng, len(groups), pe.Blocks, true)
	q1 = makeRequest("x", 40, 0, groups, pe, de1, pool, newPool(rng, len(groups), de1.Blocks, true))
	q2 = &xreq{id: "x", tokens: 40, sim: kvsim.Request{Tokens: 40, P: q1.sim.P}}
	q2.sim.D = []topology.Span{{IDs: newPool(rng, len(groups), de2.Blocks, true).take(0, 3)}}
	q1.sim.Salt, q2.sim.Salt = 1, 1
	for _, r := range p.ranks[0] {
		r.Scramble(1)
		r.FillSalt(q1.sim.P, 1)
	}
	return fab, p, d1, d2, q1, q2, func() {
		p.close(t)
		d2.close(t)
		d1.close(t)
	}
}
