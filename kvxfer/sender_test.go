package kvxfer_test

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// A peer message counts only from the agent that speaks for the rank it
// names: forged completion and failure notices from another agent (an
// authenticated peer naming the producer, or the consumer) change no
// request, are counted, and the real transfer still ends right.
func TestForgedNoticesRefused(t *testing.T) {
	t.Run("push: forged producer notices at D", func(t *testing.T) {
		inSynctest(t, func(t *testing.T) {
			x := newPair(t, kvxfer.ModePush, 1, 1, nil)
			q := x.req("a", 40, 0)
			x.recvD(q) // D handshakes with P and registers
			x.settle()
			time.Sleep(2 * time.Second) // D's handshake is not fresh: the forger makes it handshake again
			forge := x.forge(x.d)
			forge(kvxfer.AppendDoneMsg("P", 0, 1, "t-a", "d-a", "p-a"))
			forge(kvxfer.AppendFailMsg("P", 0, 1, "t-a", "d-a", "p-a", "forged"))
			time.Sleep(time.Second)
			x.settle()
			if got := x.recvResult(q); len(got) != 0 {
				t.Fatalf("D reported %+v on forged notices", got)
			}
			x.sendP(q)
			time.Sleep(time.Second)
			x.settle()
			wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
			wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
			if err := x.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
				t.Error(err)
			}
			if n := x.d.workers[0][0].Metrics().Snapshot().Dropped["sender_mismatch"]; n != 2 {
				t.Errorf("D dropped %d notices as sender_mismatch, want 2", n)
			}
		})
	})
	t.Run("pull: forged consumer notices at P", func(t *testing.T) {
		inSynctest(t, func(t *testing.T) {
			x := newPair(t, kvxfer.ModePull, 1, 1, nil)
			first := x.req("first", 40, 0)
			x.sendP(first)
			x.recvD(first) // D's done notice pins its agent at P
			time.Sleep(time.Second)
			x.settle()
			wantResult(t, "P", x.sendResult(first), kvxfer.ResultDone, "")
			q := x.req("a", 40, 0)
			x.sendP(q)
			x.settle()
			forge := x.forge(x.p)
			forge(kvxfer.AppendDoneMsg("D", 0, 1, "t-a", "d-a", "p-a"))
			forge(kvxfer.AppendFailMsg("D", 0, 1, "t-a", "d-a", "p-a", "forged"))
			time.Sleep(time.Second)
			x.settle()
			if got := x.sendResult(q); len(got) != 0 {
				t.Fatalf("P let go of its blocks on forged notices: %+v", got)
			}
			x.recvD(q)
			time.Sleep(time.Second)
			x.settle()
			wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
			wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
			if err := x.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
				t.Error(err)
			}
			if n := x.p.workers[0][0].Metrics().Snapshot().Dropped["sender_mismatch"]; n != 2 {
				t.Errorf("P dropped %d notices as sender_mismatch, want 2", n)
			}
		})
	})
}

// A consumer that restarts under the same engine id speaks from new
// agents: the producer's loaded handshake names the old ones, so it
// handshakes again when the new agent's registration arrives, and the
// request goes through (not dropped, not left to its timeout).
func TestRestartedPeerHandshakenAgain(t *testing.T) {
	model := kvsim.Model{Kinds: []topology.Kind{fa, fa}, TotalKVHeads: 2, HeadSize: 4, ElemBytes: 2}
	dir := kvxfertest.NewDirectory()
	p := startNetEngine(t, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePush, nil)
	defer p.close(t)
	run := func(d *simEngine, id string) {
		t.Helper()
		groups := d.ranks[0][0].Layout.GroupList()
		rng := rand.New(rand.NewPCG(3, uint64(len(id))))
		q := makeRequest(id, 40, 0, groups, p.eng, d.eng, newPool(rng, len(groups), 96, true), newPool(rng, len(groups), 96, true))
		p.ranks[0][0].Fill(q.sim.P)
		now := time.Now()
		d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, p, now.Add(time.Minute))}})
		p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{q.send(now.Add(time.Minute))}})
		out := awaitOutcomes(t, 2, p, d)
		if o := out.recv["d-"+id]; len(o) != 1 || o[0].Result != kvxfer.ResultDone {
			t.Fatalf("D outcome %+v, want done", o)
		}
		if err := d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
			t.Fatal(err)
		}
	}
	d := startNetEngine(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePush, nil)
	run(d, "before")
	d.close(t)
	time.Sleep(1100 * time.Millisecond) // P's handshake with D is past handshakeRetry
	d = startNetEngine(t, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePush, nil)
	defer d.close(t)
	run(d, "after")
	if n := p.workers[0][0].Metrics().Snapshot().Dropped["sender_mismatch"]; n != 0 {
		t.Errorf("P dropped %d messages of the restarted consumer", n)
	}
}

// Messages that wait for a handshake to say who sent them are bounded per
// engine: past maxParked they are dropped and counted, and once the
// handshake answers, the parked ones from an agent it does not list are
// refused; the real transfer still ends done.
func TestParkedMessagesBounded(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		release := x.dir.Hold("P")
		q := x.req("a", 40, 0)
		x.recvD(q) // D's handshake with P now waits
		x.settle()
		forge := x.forge(x.d)
		for range kvxfer.MaxParked + 76 {
			forge(kvxfer.AppendDoneMsg("P", 0, 1, "t-a", "d-a", "p-a"))
		}
		x.settle()
		dropped := x.d.workers[0][0].Metrics().Snapshot().Dropped
		if dropped["sender_parked_full"] != 76 {
			t.Errorf("dropped %v, want 76 sender_parked_full", dropped)
		}
		release()
		x.settle()
		if n := x.d.workers[0][0].Metrics().Snapshot().Dropped["sender_mismatch"]; n != kvxfer.MaxParked {
			t.Errorf("%d parked forgeries refused once the handshake answered, want %d", n, kvxfer.MaxParked)
		}
		if got := x.recvResult(q); len(got) != 0 {
			t.Fatalf("D reported %+v on forged notices", got)
		}
		x.sendP(q)
		time.Sleep(time.Second)
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
	})
}

// An authenticated agent cannot claim an engine it does not speak for,
// even before this rank's first handshake with that engine: it is never
// taken at its word, only as a handshake with the engine lists it. A
// forger naming consumer D registers blocks for D's request with a push
// producer that never handshook with D: P must not WRITE D's KV to it,
// and D's own registration must still go through.
func TestForgedIdentityBeforeHandshake(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("a", 40, 0)
		forge := x.forge(x.p)
		forge(kvxfer.AppendRegMsg("D", 0, 1, "t-a", "d-a", "p-a", q.sim.D))
		time.Sleep(time.Second)
		x.settle()
		x.sendP(q)
		time.Sleep(time.Second)
		x.settle()
		if n := x.posted(); n != 0 {
			t.Fatalf("P posted %d WRITEs on a forged registration", n)
		}
		if n := x.p.workers[0][0].Metrics().Snapshot().Dropped["sender_mismatch"]; n != 1 {
			t.Errorf("P dropped %d messages as sender_mismatch, want 1", n)
		}
		x.recvD(q)
		time.Sleep(time.Second)
		x.settle()
		wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		if err := x.d.ranks[0][0].CheckRequest(&q.sim, 16, 16); err != nil {
			t.Error(err)
		}
	})
}
