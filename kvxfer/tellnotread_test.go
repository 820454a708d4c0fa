package kvxfer_test

import (
	"math/rand/v2"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// A pull consumer request failed by the generation rules before it read
// anything tells the producer ranks of the generation loaded, which may
// hold it all the same: they end it at once (naming the params' blocks,
// so only a rank holding it in exactly those does), and a close of the
// producer has nothing of it to wait for.
//
//   - Params without a generation, issued by a producer that restarted,
//     reaching a consumer rank that knew the old generation: it fails
//     them ("restarted ... before this request's READ reached it"), and
//     the new producer, which issued them, held the request. Seen in the
//     daemon soak (NIXL pull, TP 2): a P engine that crashed right after
//     it came back with requests issued had its next incarnation refused
//     for 10 s, its worker's close waiting for those holds until
//     CloseTimeout.
//   - Params of another generation than the producer's (a rank of it
//     re-attached since): its ranks that hold the request end it.
//
// Before, no producer rank was told: each held the request for its whole
// lease (a minute here), and its close waited for it until CloseTimeout
// (a minute here too).
func TestPullNotReadByGenerationTellsProducer(t *testing.T) {
	for _, b := range []string{"nixl", "builtin-no-grants"} {
		t.Run(b, func(t *testing.T) {
			start, long := noGrants[0].start, func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine {
				return startNixlEngine(t, dir, m, e, id, kvxfer.ModePull, kvxfer.PostCost{}, func(c *kvxfer.WorkerConfig) { c.CloseTimeout = time.Minute })
			}
			if b != "nixl" {
				start = openPlane
				long = func(t *testing.T, dir *kvxfertest.Directory, m *kvsim.Model, e kvsim.Engine, id string) *simEngine {
					return startNetEngine(t, dir, m, e, id, kvxfer.ModePull, func(c *kvxfer.WorkerConfig) { c.OpenDataPlane, c.CloseTimeout = true, time.Minute })
				}
			}
			dir, p, d, dPool, _ := holdPair(t, start)
			defer d.close(t)
			gen1 := generationOf(t, dir, "P")
			stopProducer(t, p) // (it holds nothing: it goes at once)
			model := pairModel
			p2 := long(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P")
			closed := false
			defer func() {
				if !closed {
					p2.close(t)
				}
			}()
			groups := d.ranks[0][0].Layout.GroupList()
			rng := rand.New(rand.NewPCG(9, 10))
			now := time.Now()
			lease := now.Add(time.Minute)

			// x: the new producer's, params without a generation; D knew
			// the old one when it came in.
			qx := makeRequest("x", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), dPool)
			p2.ranks[0][0].Fill(qx.sim.P)
			p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{qx.send(lease)}})
			d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{qx.recv(kvxfer.ModePull, p2, lease)}})
			out := awaitOutcomes(t, 2, d, p2)
			wantTold(t, out, "x", "restarted")

			// w: held by the new producer, its params naming the old
			// generation (as a rank's that re-attached, its siblings
			// holding the request).
			qw := makeRequest("w", 40, 0, groups, p2.eng, d.eng, newPool(rng, len(groups), 96, true), dPool)
			p2.ranks[0][0].Fill(qw.sim.P)
			p2.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{qw.send(lease)}})
			rw := qw.recv(kvxfer.ModePull, p2, lease)
			rw.Remote.Generation = gen1
			d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{rw}})
			wantTold(t, awaitOutcomes(t, 2, d, p2), "w", "issued this request's params at generation")

			if s, _ := p2.workers[0][0].State(); s.Sends != 0 {
				t.Errorf("P still holds %d requests", s.Sends)
			}
			if s, _ := d.workers[0][0].State(); s.Recvs != 0 {
				t.Errorf("D still holds %d requests", s.Recvs)
			}
			// Its close has nothing to wait for: it reports nothing more
			// (a request its fence gave up would report "worker closed").
			p2.close(t)
			closed = true
			late := newOutcomes()
			late.collect(t, p2)
			if len(late.seen) != 0 {
				t.Errorf("P reported at its close: %v", late.send)
			}
		})
	}
}

// wantTold checks request id's outcomes: one failed on D (its reason
// containing why), and one on P, failed as D told it (not held until
// its lease or its close).
func wantTold(t *testing.T, out *outcomes, id, why string) {
	t.Helper()
	o := out.recv["d-"+id]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || o[0].Kind != kvxfer.FailurePeerGone || !strings.Contains(o[0].Reason, why) {
		t.Fatalf("D outcomes of d-%s: %+v, want one failed (peer_gone) naming %q", id, o, why)
	}
	p := out.send["p-"+id]
	if len(p) != 1 || p[0].Result != kvxfer.ResultFailed || !strings.Contains(p[0].Reason, why) {
		t.Fatalf("P outcomes of p-%s: %+v, want one failed as its consumer told it (%q)", id, p, why)
	}
}
