package server_test

import (
	"context"
	"runtime"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// A step_ref naming requests its step does not stage fails each of them
// once, and only those the rank does not hold: one the rank holds from an
// earlier step (an engine naming it in two steps) keeps its blocks and
// gets its own outcome when its transfer ends, and an id listed twice
// gets one outcome. On the old code the rank answered the step_ref itself,
// beside the worker: a held request got a failed outcome (the engine
// freed its blocks while the producer's WRITE into them could still land)
// and then its worker's, and a repeated id one failed outcome per mention.
func TestStepRefUnstagedOncePerRequest(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runStepRefOnce(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runStepRefOnce(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) { c.DrainTimeout = 100 * time.Millisecond })
	attachSmall(t, d, shmDir, "P", 1) // holds D's registration: d-held waits for its WRITE
	D := attachSmall(t, d, shmDir, "D", 2)
	rs := D.streams[0][0]
	_, c, ctx := schedulerClientOn(t, d)
	now := time.Now()
	D.step(t, &kvxfer.StepMeta{Step: 1, SchedulerClock: now, Recv: []kvxfer.RecvReq{{ReqID: "d-held", Local: []topology.Span{{IDs: []topology.BlockID{1, 2}}},
		Deadline: now.Add(time.Hour), Remote: kvxfer.RemoteRef{EngineID: "P", Addr: d.peerAddr, ReqID: "p-held", TPSize: 1}}}})
	w := d.srv.Workers()["D"][0]
	tick := time.NewTicker(5 * time.Millisecond)
	defer tick.Stop()
	for {
		st, err := w.State()
		if err != nil {
			t.Fatal(err)
		}
		if st.Recvs == 1 {
			break
		}
		select {
		case <-ctx.Done():
			t.Fatal("d-held never held")
		case <-tick.C:
		}
	}
	openPushD(t, c, ctx)
	// Step 2 stages nothing.
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", PublishStep: 2}); err != nil {
		t.Fatal(err)
	}
	if err := rs.StepRef(2, []string{"d-held", "d-twice", "d-twice"}, []string{"p-twice", "p-twice"}); err != nil {
		t.Fatal(err)
	}
	// The bye's drain gives up on d-held (its producer never prefills): the
	// rank's close fails it, the one outcome it gets.
	got := map[string]int{}
	collected := make(chan struct{})
	go func() {
		defer close(collected)
		for f := range rs.Finished() {
			for _, o := range f.Recving {
				got["recv "+o.ReqID]++
			}
			for _, o := range f.Sending {
				got["send "+o.ReqID]++
			}
		}
	}()
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	if err := rs.Close(cctx); err != nil {
		t.Fatal(err)
	}
	<-collected
	for _, k := range []string{"recv d-held", "recv d-twice", "send p-twice"} {
		if got[k] != 1 {
			t.Errorf("%s: %d outcomes, want 1", k, got[k])
		}
	}
	if len(got) != 3 {
		t.Errorf("outcomes %v, want one each for d-held, d-twice and p-twice", got)
	}
	bad := w.Metrics().Snapshot().BadInput
	if bad["step_ref.recv_request_ids"] != 2 || bad["step_ref.send_request_ids"] != 1 {
		t.Errorf("bad input counted %v, want step_ref.recv_request_ids 2 (d-held, d-twice) and step_ref.send_request_ids 1", bad)
	}
}
