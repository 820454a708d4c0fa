package kvxfer_test

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
	"github.com/kvxfer/kvxfer/topology"
)

// Tests of SPEC §14 (the reference's defects kvxfer must not copy) in the
// shapes the older tests of each item do not cover.

// held sums what every rank of an engine still holds.
func (x *pair) held(se *simEngine) kvxfer.WorkerState {
	x.t.Helper()
	var sum kvxfer.WorkerState
	for _, stage := range se.workers {
		for _, w := range stage {
			s, err := w.State()
			if err != nil {
				x.t.Fatal(err)
			}
			sum.Sends += s.Sends
			sum.PendingRegs += s.PendingRegs
			sum.Matches += s.Matches
			sum.Tombstones += s.Tombstones
			sum.Recvs += s.Recvs
			sum.Handles += s.Handles
		}
	}
	return sum
}

// SPEC §14 (full prefix hit or abort before schedule in push), with more D
// ranks than P ranks and in both orders: every D rank's empty
// registration reaches P's one rank, which frees its blocks at once, even
// when D's release comes before P's request; neither side keeps anything
// for the request (the reference leaves D's _recving_metadata entry).
func TestSpec14PushNothingToReceiveMoreDRanks(t *testing.T) {
	for _, abort := range []bool{false, true} {
		for _, dFirst := range []bool{false, true} {
			t.Run(fmt.Sprintf("aborted=%v/dfirst=%v", abort, dFirst), func(t *testing.T) {
				inSynctest(t, func(t *testing.T) {
					x := newPair(t, kvxfer.ModePush, 1, 2, nil)
					q := x.req("r1", 40, 48) // D already holds every token
					now := time.Now()
					r := q.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
					r.Aborted = abort
					if !dFirst {
						x.sendP(q)
						x.settle()
					}
					x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
					x.settle()
					if dFirst {
						if got := x.sendResult(q); len(got) != 0 {
							t.Fatalf("P outcomes = %+v before P held the request", got)
						}
						x.sendP(q)
						x.settle()
					}
					want := kvxfer.ResultDone
					if abort {
						want = kvxfer.ResultAborted
					}
					got := x.recvResult(q)
					if len(got) != 2 || got[0].Result != want || got[1].Result != want {
						t.Errorf("D outcomes = %+v, want %v on both ranks", got, want)
					}
					wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
					if x.posted() != 0 {
						t.Errorf("posted %d transfers, want 0", x.posted())
					}
					if s := x.held(x.p); s.Sends+s.PendingRegs+s.Matches+s.Handles != 0 {
						t.Errorf("P holds %+v after the request ended, want nothing", s)
					}
					if s := x.held(x.d); s.Recvs+s.Handles != 0 {
						t.Errorf("D holds %+v after the request ended, want nothing", s)
					}
				})
			})
		}
	}
}

// SPEC §14 (D_TP > P_TP in push): both D ranks register with P's one
// rank, each copy delivered twice, under ids that differ by their random
// suffix. P writes each D rank once, keeps no registration after the
// match, drops a late retransmission from either rank, never pairs one
// with a later request of the same base id, and forgets the pair after
// RegistrationTTL.
func TestSpec14MoreDRanksDuplicateRegistrations(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 2, func(_ string, c *kvxfer.WorkerConfig) { c.RegistrationTTL = 2 * time.Minute })
		now := time.Now()
		old := x.req("old", 40, 0)
		s := old.send(now.Add(30 * time.Second))
		s.ReqID, s.TransferID = "req-1-aaaaaaaa", ""
		r := old.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
		r.ReqID, r.TransferID, r.Remote.ReqID = "req-1-11111111", "", "req-1-aaaaaaaa"
		x.fab.Faults().DuplicateNotifs(2)
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
		x.settle()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{s}})
		x.settle()
		if n := x.posted(); n != 2 {
			t.Errorf("posted %d WRITEs, want one per D rank", n)
		}
		if got := x.out.send["req-1-aaaaaaaa"]; len(got) != 1 || got[0].Result != kvxfer.ResultDone {
			t.Fatalf("P outcomes = %+v, want one done", got)
		}
		if got := x.out.recv["req-1-11111111"]; len(got) != 2 || got[0].Result != kvxfer.ResultDone || got[1].Result != kvxfer.ResultDone {
			t.Fatalf("D outcomes = %+v, want done on both ranks", got)
		}
		for tp, rank := range x.d.ranks[0] {
			if err := rank.CheckRequest(&old.sim, 16, 16); err != nil {
				t.Errorf("D rank %d: %v", tp, err)
			}
		}
		if st := x.held(x.p); st.PendingRegs+st.Matches+st.Sends != 0 {
			t.Fatalf("P holds %+v after the request ended, want no registration", st)
		}
		// Each D rank's registration arrives once more, late.
		meta, _ := x.p.agents[0][0].LocalMetadata()
		for tp := range 2 {
			a := x.d.agents[0][tp]
			peer, err := a.LoadPeer(meta)
			if err != nil {
				t.Fatal(err)
			}
			if err := a.Notify(peer, kvxfer.AppendRegMsg("D", tp, 2, "", "req-1-11111111", "req-1-aaaaaaaa", r.Local)); err != nil {
				t.Fatal(err)
			}
		}
		x.settle()
		if st := x.held(x.p); st.PendingRegs+st.Matches != 0 {
			t.Fatalf("P kept a late duplicate: %+v", st)
		}
		// A new P request with the same base id waits for its own D.
		newer := x.req("new", 40, 0)
		ns := newer.send(time.Now().Add(30 * time.Second))
		ns.ReqID, ns.TransferID = "req-1-bbbbbbbb", ""
		posted := x.posted()
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), Send: []kvxfer.SendReq{ns}})
		x.settle()
		if st := x.held(x.p); st.Matches != 0 || st.Sends != 1 || x.posted() != posted {
			t.Fatalf("P state = %+v, posted %d, after a new request with the old base id; want it unmatched", st, x.posted()-posted)
		}
		nr := newer.recv(kvxfer.ModePush, x.p, time.Now().Add(time.Minute))
		nr.ReqID, nr.TransferID, nr.Remote.ReqID = "req-1-22222222", "", "req-1-bbbbbbbb"
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: time.Now(), Recv: []kvxfer.RecvReq{nr}})
		x.settle()
		if x.posted() != posted+2 {
			t.Errorf("new request posted %d WRITEs, want one per D rank", x.posted()-posted)
		}
		for tp, rank := range x.d.ranks[0] {
			if err := rank.CheckRequest(&newer.sim, 16, 16); err != nil {
				t.Errorf("D rank %d: %v", tp, err)
			}
		}
		time.Sleep(5 * time.Minute) // past RegistrationTTL
		x.settle()
		if st := x.held(x.p); st.PendingRegs+st.Matches+st.Sends+st.Tombstones != 0 {
			t.Errorf("P holds %+v long after both requests ended, want nothing", st)
		}
	})
}

// newHybridPair is newPair (one rank each side) for a model with a full
// attention and a sliding-window group.
func newHybridPair(t *testing.T, mode kvxfer.Mode) *pair {
	t.Helper()
	pe, de := e2eEngine(1, 1, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
	x := &pair{t: t, mode: mode, fab: kvxfertest.NewFabric(), dir: kvxfertest.NewDirectory(), out: newOutcomes()}
	model := kvsim.Model{Kinds: []topology.Kind{fa, swa}, Window: 40, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
	x.p = startEngine(t, x.fab, x.dir, &model, pe, "P", mode, nil)
	x.d = startEngine(t, x.fab, x.dir, &model, de, "D", mode, nil)
	t.Cleanup(func() { x.d.close(t); x.p.close(t) })
	x.groups = x.d.ranks[0][0].Layout.GroupList()
	rng := rand.New(rand.NewPCG(3, 4))
	x.pp = newPool(rng, len(x.groups), pe.Blocks, false)
	x.dp = newPool(rng, len(x.groups), de.Blocks, false)
	return x
}

// SPEC §14 (zero-count end-trim): D holds no block of a group for which P
// has some. That group moves nothing (the reference's [-0:] takes P's
// whole list and fails its length check): the request completes, D's
// blocks of the other group receive their bytes, and no other byte of D
// changes.
func TestSpec14ZeroCountGroupTakesNothing(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newHybridPair(t, mode)
				q := x.req("r1", 40, 0)
				g := slices.IndexFunc(x.groups, func(g topology.Group) bool { return g.Kind == swa })
				if len(x.groups) != 2 || g < 0 || len(q.sim.P[g].IDs) == 0 {
					t.Fatalf("groups %+v, P spans %+v: want a window group that P fills", x.groups, q.sim.P)
				}
				q.sim.D[g] = topology.Span{}
				before := x.d.ranks[0][0].Snapshot()
				x.recvD(q)
				x.sendP(q)
				x.settle()
				wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
				wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
				if err := x.d.ranks[0][0].CheckValues(before, []*kvsim.Request{&q.sim}, 16, 16); err != nil {
					t.Error(err)
				}
			})
		})
	}
}

// SPEC §14 (wake event): input handed to a worker after its loop took its
// inbox and before it waits (the window in which the reference's cleared
// Event loses a set) still wakes it: the request goes through with no
// other input to nudge the loop.
func TestSpec14WakeBetweenDrainAndWait(t *testing.T) {
	for _, side := range []string{"D", "P"} {
		t.Run(side, func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, kvxfer.ModePush, 1, 1, func(_ string, c *kvxfer.WorkerConfig) { c.EngineTTL = -1 })
				q := x.req("r1", 40, 0)
				// The other side goes first; this side's input comes last.
				first, last, w := x.sendP, x.recvD, x.d.workers[0][0]
				if side == "P" {
					first, last, w = x.recvD, x.sendP, x.p.workers[0][0]
				}
				first(q)
				x.settle()
				release := kvxfer.StallLoop(w) // the loop is about to wait
				last(q)
				if n := kvxfer.Queued(w); n != 1 {
					t.Fatalf("%d events queued while the loop was held, want 1", n)
				}
				release()
				x.settle()
				wantResult(t, "D", x.recvResult(q), kvxfer.ResultDone, "")
				wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
			})
		})
	}
}

// SPEC §14 (double report): P's lease runs out while its WRITE to a D
// rank is held in flight (D's heartbeats, every Lease/6 of D's, come too
// late to extend it). P reports once, after that WRITE ends, and each D
// rank once. (TestLeaseExpiryDuringWriteReportsOnce keeps D's default
// heartbeats, which extend the lease, so it never expires there.)
func TestSpec14LeaseExpiryDuringWrite(t *testing.T) {
	for _, dtp := range []int{1, 2} {
		t.Run(fmt.Sprintf("dtp=%d", dtp), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				x := newPair(t, kvxfer.ModePush, 1, dtp, func(side string, c *kvxfer.WorkerConfig) {
					if side == "D" {
						c.Lease = time.Hour
					}
				})
				q := x.req("r1", 40, 0)
				now := time.Now()
				r := q.recv(kvxfer.ModePush, x.p, now.Add(time.Hour))
				x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{r}})
				x.settle()
				stalled := x.d.agents[0][dtp-1].Name()
				x.fab.Faults().Stall(stalled)
				x.sendP(q) // a 30 s lease
				time.Sleep(45 * time.Second)
				x.settle()
				if got := x.sendResult(q); len(got) != 0 {
					t.Fatalf("P reported %+v while a WRITE was in flight", got)
				}
				x.fab.Faults().Unstall(stalled)
				time.Sleep(10 * time.Millisecond)
				x.settle()
				time.Sleep(10 * time.Minute) // whatever else could report
				x.settle()
				if got := x.sendResult(q); len(got) != 1 {
					t.Fatalf("P outcomes = %+v, want exactly one", got)
				}
				if got := x.recvResult(q); len(got) != dtp {
					t.Fatalf("D outcomes = %+v, want one per rank", got)
				}
				t.Logf("P %+v, D %+v", x.sendResult(q), x.recvResult(q))
				if s := x.held(x.p); s.Sends+s.Matches+s.Handles != 0 {
					t.Errorf("P holds %+v, want nothing", s)
				}
			})
		})
	}
}

// SPEC §14 (P WRITE completion failure), with two D ranks: one of P's two
// WRITEs fails. P reports the request once, as a failed send, and never
// as a receive (the reference queues P's id as a failed recv and then
// trips its own assertion); the D rank written into fails at once with
// its blocks marked invalid, the other completes; nothing stays held.
func TestSpec14FailedWriteMoreDRanks(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 2, nil)
		q := x.req("r1", 40, 0)
		x.recvD(q)
		x.settle()
		x.fab.Faults().FailTransfers(1)
		x.sendP(q)
		time.Sleep(10 * time.Millisecond)
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultFailed, "WRITE failed")
		wantKind(t, "P", x.sendResult(q), kvxfer.FailureTransfer)
		if got := x.out.recv["p-r1"]; len(got) != 0 {
			t.Errorf("P reported receive outcomes %+v for its own request", got)
		}
		got := x.recvResult(q)
		var failed, done int
		for _, o := range got {
			switch o.Result {
			case kvxfer.ResultFailed:
				failed++
			case kvxfer.ResultDone:
				done++
			}
		}
		if len(got) != 2 || failed != 1 || done != 1 {
			t.Errorf("D outcomes = %+v, want one rank failed and one done", got)
		}
		if len(x.out.invalid) == 0 {
			t.Error("no invalid blocks reported for the failed receive")
		}
		if s := x.held(x.p); s.Sends+s.Matches+s.Handles+s.PendingRegs != 0 {
			t.Errorf("P holds %+v, want nothing", s)
		}
		if s := x.held(x.d); s.Recvs+s.Handles != 0 {
			t.Errorf("D holds %+v, want nothing", s)
		}
	})
}
