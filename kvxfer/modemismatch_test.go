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

// Engines whose modes differ (one configured push, the other pull: the
// handshake does not carry modes) fail their requests at once, told why,
// their blocks untouched. A push consumer registering with a pull
// producer was not told: the producer dropped the registration (counted
// only), and the consumer waited for its deadline and then its fence
// (two leases) for a WRITE that never came, reporting the producer late,
// its blocks held all along; and the producer's request waited for its
// lease. A pull consumer of a push producer is told by its hold check
// already.
func TestModesDifferFailAtOnce(t *testing.T) {
	for _, c := range []struct {
		name   string
		pm, dm kvxfer.Mode
		want   string
	}{
		{"push consumer, pull producer", kvxfer.ModePull, kvxfer.ModePush, "runs in pull mode"},
		{"pull consumer, push producer", kvxfer.ModePush, kvxfer.ModePull, "does not hold this request"},
	} {
		for _, ptp := range []int{1, 2} {
			t.Run(c.name+"/P-tp"+string(rune('0'+ptp)), func(t *testing.T) {
				synctest.Test(t, func(t *testing.T) { runModesDiffer(t, c.pm, c.dm, ptp, c.want) })
			})
		}
	}
}

func runModesDiffer(t *testing.T, pm, dm kvxfer.Mode, ptp int, want string) {
	fab, dir := newFabricDir()
	model := kvsim.Model{Kinds: []topology.Kind{fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	pe, de := e2eEngine(1, ptp, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
	p := startEngine(t, fab, dir, &model, pe, "P", pm, nil)
	d := startEngine(t, fab, dir, &model, de, "D", dm, nil)
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
	d.step(t, &kvxfer.StepMeta{SchedulerClock: start, Recv: []kvxfer.RecvReq{q.recv(dm, p, start.Add(time.Minute))}})
	p.step(t, &kvxfer.StepMeta{SchedulerClock: start, Send: []kvxfer.SendReq{q.send(start.Add(30 * time.Second))}})
	out := newOutcomes()
	for len(out.recv["d-x"]) == 0 && time.Since(start) < 2*time.Minute {
		time.Sleep(100 * time.Millisecond)
		synctest.Wait()
		out.collect(t, p)
		out.collect(t, d)
	}
	took := time.Since(start)
	o := out.recv["d-x"]
	if len(o) != 1 || o[0].Result != kvxfer.ResultFailed || !strings.Contains(o[0].Reason, want) {
		t.Fatalf("consumer outcomes %+v, want one failed naming %q", o, want)
	}
	if took > 5*time.Second {
		t.Errorf("consumer request failed after %v, want at once (its deadline was a minute away)", took)
	}
	if err := d.ranks[0][0].CheckValues(before, nil, 16, 16); err != nil {
		t.Error(err)
	}
	if pm == kvxfer.ModePull {
		// A pull producer's request ends at once too: each consumer
		// rank's registration is that rank's failure notice (a push
		// consumer never READs). Before, it waited for its lease (30 s).
		time.Sleep(5*time.Second - time.Since(start))
		synctest.Wait()
		out.collect(t, p)
		if got := out.send["p-x"]; len(got) != ptp || got[0].Result != kvxfer.ResultFailed {
			t.Errorf("producer outcomes 5 s in %+v, want one failed per rank (%d), not at its 30 s lease", got, ptp)
		}
	}
	// The producer's request ends too, once per rank (at the latest when
	// its lease expires).
	time.Sleep(time.Minute)
	synctest.Wait()
	out.collect(t, p)
	out.collect(t, d)
	if got := out.send["p-x"]; len(got) != ptp {
		t.Errorf("producer outcomes %+v, want one per rank (%d)", got, ptp)
	}
}
