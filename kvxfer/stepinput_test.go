package kvxfer_test

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A block list naming one block twice is refused at Step, naming the
// field and value, counted, its request failed once: a consumer's
// duplicate block would take two of the producer's blocks (one lost, the
// request reported done with the wrong KV), a producer's would send one
// block's KV for two. The good request beside it transfers as usual.
func TestStepRefusesDuplicateBlocks(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q, dup := x.req("r1", 40, 0), x.req("r2", 40, 0)
		now := time.Now()
		bad := dup.recv(kvxfer.ModePush, x.p, now.Add(time.Minute))
		bad.Local = slices.Clone(bad.Local)
		ids := slices.Clone(bad.Local[0].IDs)
		ids[1] = ids[0]
		bad.Local[0] = topology.Span{Start: bad.Local[0].Start, IDs: ids}
		w := x.d.workers[0][0]
		err := w.Step(&kvxfer.StepMeta{Step: 1, SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(kvxfer.ModePush, x.p, now.Add(time.Minute)), bad}})
		if err == nil || !strings.Contains(err.Error(), `"d-r2"`) || !strings.Contains(err.Error(), "Local group 0 block 1") {
			t.Errorf("Step error = %v, want d-r2's Local group 0 block 1 refused (a duplicate)", err)
		}
		// P: a producer request whose blocks repeat one.
		pb := dup.send(now.Add(time.Minute))
		pb.ReqID = "p-dup"
		pb.Blocks = slices.Clone(pb.Blocks)
		pids := slices.Clone(pb.Blocks[0].IDs)
		pids[2] = pids[1]
		pb.Blocks[0] = topology.Span{Start: pb.Blocks[0].Start, IDs: pids}
		if err := x.p.workers[0][0].Step(&kvxfer.StepMeta{Step: 1, SchedulerClock: now, Send: []kvxfer.SendReq{pb}}); err == nil ||
			!strings.Contains(err.Error(), "Blocks group 0 block 2") {
			t.Errorf("P Step error = %v, want p-dup's Blocks group 0 block 2 refused (a duplicate)", err)
		}
		x.sendP(q)
		x.settle()
		wantResult(t, "D r1", x.recvResult(q), kvxfer.ResultDone, "")
		wantResult(t, "P r1", x.sendResult(q), kvxfer.ResultDone, "")
		if got := x.recvResult(dup); len(got) != 1 || got[0].Result != kvxfer.ResultFailed || got[0].Kind != kvxfer.FailureSetup {
			t.Errorf("D r2 outcomes = %+v, want one failed (setup)", got)
		}
		if got := x.out.send["p-dup"]; len(got) != 1 || got[0].Result != kvxfer.ResultFailed {
			t.Errorf("P p-dup outcomes = %+v, want one failed", got)
		}
		if n := w.Metrics().Snapshot().BadInput["recv_req.local"]; n != 1 {
			t.Errorf(`D BadInput["recv_req.local"] = %d, want 1`, n)
		}
		if n := x.p.workers[0][0].Metrics().Snapshot().BadInput["send_req.blocks"]; n != 1 {
			t.Errorf(`P BadInput["send_req.blocks"] = %d, want 1`, n)
		}
	})
}

// A consumer that registers only after the producer's lease on the
// request ran out (its scheduler was slow to take the request in, so no
// heartbeat kept the lease) is told at once that the producer request
// expired: it fails within moments, instead of holding its blocks until
// its own deadline (the registration watchdog, 480 s by default).
func TestLateRegistrationAfterExpiryToldAtOnce(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePush, 1, 1, nil)
		q := x.req("r1", 40, 0)
		x.sendP(q)
		time.Sleep(31 * time.Second) // P's lease (30 s) runs out: no consumer heard of it yet
		x.settle()
		wantResult(t, "P", x.sendResult(q), kvxfer.ResultExpired, "")
		now := time.Now()
		x.d.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{q.recv(x.mode, x.p, now.Add(time.Hour))}})
		time.Sleep(time.Second)
		x.settle()
		got := x.recvResult(q)
		if len(got) != 1 || got[0].Result != kvxfer.ResultFailed && got[0].Result != kvxfer.ResultExpired {
			t.Fatalf("D outcomes a second after registering = %+v, want one failed (the producer's lease expired)", got)
		}
		if !strings.Contains(got[0].Reason, "lease expired") {
			t.Errorf("D outcome %+v, want its reason to say the producer's lease expired", got[0])
		}
	})
}

// The producer's block list a pull consumer reads from (RecvReq
// Remote.Blocks, the producer's ids handed on by the router) naming one
// block twice is refused like the consumer's own: the READ would land one
// producer block in two consumer blocks (the second one's KV lost, the
// request reported done). Both sides fail the request, the refusal is
// counted, and the good request beside it moves.
func TestPullRefusesDuplicateRemoteBlocks(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		x := newPair(t, kvxfer.ModePull, 1, 1, nil)
		now := time.Now()
		good, dup := x.req("good", 40, 0), x.req("dup", 40, 0)
		r := dup.recv(kvxfer.ModePull, x.p, now.Add(time.Minute))
		if len(r.Remote.Blocks[0].IDs) < 2 {
			t.Fatalf("the producer's list has %d blocks, want 2 or more", len(r.Remote.Blocks[0].IDs))
		}
		r.Remote.Blocks = slices.Clone(r.Remote.Blocks)
		ids := slices.Clone(r.Remote.Blocks[0].IDs)
		ids[1] = ids[0]
		r.Remote.Blocks[0] = topology.Span{Start: r.Remote.Blocks[0].Start, IDs: ids}
		x.p.step(t, &kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{good.send(now.Add(30 * time.Second)), dup.send(now.Add(30 * time.Second))}})
		w := x.d.workers[0][0]
		err := w.Step(&kvxfer.StepMeta{Step: 1, SchedulerClock: now, Recv: []kvxfer.RecvReq{good.recv(kvxfer.ModePull, x.p, now.Add(time.Minute)), r}})
		x.settle()
		if err != nil {
			t.Errorf("Step = %v, want nil (the producer's lists are checked when read)", err)
		}
		wantResult(t, "good D", x.recvResult(good), kvxfer.ResultDone, "")
		wantResult(t, "good P", x.sendResult(good), kvxfer.ResultDone, "")
		wantResult(t, "dup D", x.recvResult(dup), kvxfer.ResultFailed, fmt.Sprintf("remote group 0 block 1: id %d, the same block as block 0", ids[0]))
		wantKind(t, "dup D", x.recvResult(dup), kvxfer.FailureSetup)
		wantResult(t, "dup P", x.sendResult(dup), kvxfer.ResultFailed, "")
		if n := w.Metrics().Snapshot().BadInput["recv_req.remote.blocks"]; n != 1 {
			t.Errorf(`D BadInput["recv_req.remote.blocks"] = %d, want 1`, n)
		}
	})
}
