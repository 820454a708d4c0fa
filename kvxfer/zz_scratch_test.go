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

func TestScratchModeMismatch(t *testing.T) {
	for _, pm := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		dm := kvxfer.ModePull
		if pm == kvxfer.ModePull {
			dm = kvxfer.ModePush
		}
		t.Run(fmt.Sprintf("P%v-D%v", pm, dm), func(t *testing.T) {
			synctest.Test(t, func(t *testing.T) {
				fab, dir := newFabricDir()
				model := kvsim.Model{Kinds: []topology.Kind{fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
				pe, de := e2eEngine(1, 1, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
				p := startEngine(t, fab, dir, &model, pe, "P", pm, nil)
				d := startEngine(t, fab, dir, &model, de, "D", dm, nil)
				defer d.close(t)
				defer p.close(t)
				rng := rand.New(rand.NewPCG(1, 2))
				groups := d.ranks[0][0].Layout.GroupList()
				q := makeRequest("x", 40, 0, groups, pe, de, newPool(rng, 1, 96, true), newPool(rng, 1, 96, true))
				for _, r := range p.ranks[0] {
					r.Fill(q.sim.P)
				}
				before := d.ranks[0][0].Snapshot()
				now := time.Now()
				d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(dm, p, now.Add(time.Minute))}})
				p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(30 * time.Second))}})
				out := newOutcomes()
				for range 600 {
					synctest.Wait()
					out.collect(t, p)
					out.collect(t, d)
					time.Sleep(time.Second)
				}
				t.Logf("send %v recv %v", out.send, out.recv)
				var sims []*kvsim.Request
				if o := out.recv["d-x"]; len(o) == 1 && o[0].Result == kvxfer.ResultDone {
					sims = append(sims, &q.sim)
				}
				if err := d.ranks[0][0].CheckValues(before, sims, 16, 16); err != nil {
					t.Error(err)
				}
			})
		})
	}
}
