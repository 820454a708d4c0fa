package kvxfer_test

import (
	"context"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// gatedResolver holds a rank's handshakes until its gate opens.
type gatedResolver struct {
	kvxfer.Resolver
	gate chan struct{}
}

func (g gatedResolver) Handshake(ctx context.Context, id, addr string) (kvxfer.HandshakeResult, error) {
	select {
	case <-g.gate:
	case <-ctx.Done():
		return kvxfer.HandshakeResult{}, ctx.Err()
	}
	return g.Resolver.Handshake(ctx, id, addr)
}

// Push, P TP1 -> D TP2: P's WRITE into rank 1 fails, so P fails the
// request before rank 0 registers. Rank 0 must still end promptly: from
// P's failure notice when it arrives while rank 0's handshake is held back,
// or, when rank 0 takes the request only after P's notice came and went,
// from P's answer to the registration it then sends (not left to its
// deadline).
func TestLateRankGetsTheFailure(t *testing.T) {
	for _, late := range []bool{false, true} {
		name := "notice during the handshake"
		if late {
			name = "rank steps late, its registration answered"
		}
		t.Run(name, func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				gate := make(chan struct{})
				if late {
					close(gate)
				}
				x := newPair(t, kvxfer.ModePush, 1, 2, func(side string, c *kvxfer.WorkerConfig) {
					if side == "D" && c.Layout.TPRank == 0 {
						c.Resolver = gatedResolver{c.Resolver, gate}
					}
				})
				q := x.req("a", 40, 0)
				x.fab.Faults().FailTransfers(1)
				now := time.Now()
				meta := &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))}}
				if late {
					if err := x.d.workers[0][1].Step(meta); err != nil {
						t.Fatal(err)
					}
				} else {
					x.d.step(t, meta)
				}
				x.sendP(q)
				time.Sleep(100 * time.Millisecond)
				x.settle()
				wantResult(t, "P", x.sendResult(q), kvxfer.ResultFailed, "consumer rank 1")
				if late {
					if err := x.d.workers[0][0].Step(meta); err != nil {
						t.Fatal(err)
					}
				} else {
					close(gate)
				}
				time.Sleep(time.Second)
				x.settle()
				got := x.recvResult(q)
				if len(got) != 2 {
					t.Fatalf("D outcomes %+v, want one per rank within a second", got)
				}
				for _, o := range got {
					if o.Result != kvxfer.ResultFailed {
						t.Errorf("D outcome %+v, want failed", o)
					}
				}
				for _, stage := range x.d.workers {
					for _, w := range stage {
						if s, _ := w.State(); s.Recvs != 0 {
							t.Errorf("D rank %d still holds %d requests", w.Layout().TPRank, s.Recvs)
						}
					}
				}
			})
		})
	}
}

// Push, P TP1 -> D TP2: D rank 0 registers, P's WRITE into it is held in
// flight, then rank 1 registers. P posts exactly one WRITE per rank: a
// second into rank 0 could land after D handed its blocks back.
func TestOneWritePerRank(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 2, nil)
		q := x.req("a", 40, 0)
		now := time.Now()
		meta := &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))}}
		rank0 := x.d.agents[0][0].Name()
		x.fab.Faults().Stall(rank0)
		if err := x.d.workers[0][0].Step(meta); err != nil {
			t.Fatal(err)
		}
		x.sendP(q)
		time.Sleep(10 * time.Millisecond)
		x.settle()
		if n := x.posted(); n != 1 {
			t.Fatalf("%d WRITEs posted after rank 0 registered, want 1", n)
		}
		if err := x.d.workers[0][1].Step(meta); err != nil { // rank 1 registers while rank 0's WRITE is in flight
			t.Fatal(err)
		}
		time.Sleep(10 * time.Millisecond)
		x.settle()
		x.fab.Faults().Unstall(rank0)
		time.Sleep(time.Second)
		x.settle()
		if n := x.posted(); n != 2 {
			t.Errorf("%d WRITEs posted, want one per D rank (2)", n)
		}
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultDone, "")
		if got := x.recvResult(q); len(got) != 2 {
			t.Errorf("D outcomes %+v, want one per rank", got)
		}
	})
}
