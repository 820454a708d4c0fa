package server_test

import (
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// nextDropped returns rs's next dropped StepError (failing after 5 s).
func nextDropped(t *testing.T, rs *stream.RankStream) *stream.StepError {
	t.Helper()
	deadline := time.After(5 * time.Second)
	for {
		select {
		case se := <-rs.StepErrors():
			if se.Dropped {
				return se
			}
		case <-deadline:
			t.Fatal("no dropped StepError within 5 s")
			return nil
		}
	}
}

// A step_ref naming a step the rank dropped already (an engine repeating
// it) is dropped again, counted, but names none of the requests its first
// drop named: the engine ended each then, and a second naming is a second
// outcome. A request only the repeat names is named, once.
// On the old code the repeat named d-2 again.
func TestRepeatedDroppedStepNamesOnce(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		d := startDaemonWith(t, shmDir, func(c *server.Config) {
			c.DrainTimeout = 100 * time.Millisecond
			c.PublishWait = 100 * time.Millisecond
		})
		D := attachSmall(t, d, shmDir, "D", 1)
		rs := D.streams[0][0]
		_, c, ctx := schedulerClientOn(t, d)
		openPushD(t, c, ctx)
		if err := rs.StepRef(2, []string{"d-2"}, []string{"p-2"}); err != nil {
			t.Fatal(err)
		}
		if se := nextDropped(t, rs); !slices.Equal(se.Recv, []string{"d-2"}) || !slices.Equal(se.Send, []string{"p-2"}) {
			t.Fatalf("step 2's drop named %q %q, want d-2, p-2", se.Recv, se.Send)
		}
		if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", PublishStep: 3}); err != nil {
			t.Fatal(err)
		}
		bad := d.srv.Refusals()["bad_step"]
		for i, want := range [][]string{{"d-3"}, nil} {
			if err := rs.StepRef(2, []string{"d-2", "d-3"}, []string{"p-2"}); err != nil {
				t.Fatal(err)
			}
			se := nextDropped(t, rs)
			if !slices.Equal(se.Recv, want) || len(se.Send) != 0 || !strings.Contains(se.Message, "step_ref.step = 2") {
				t.Errorf("repeat %d of step 2: dropped naming %q %q (%q), want %q alone, naming step_ref.step = 2", i+1, se.Recv, se.Send, se.Message, want)
			}
		}
		if n := d.srv.Refusals()["bad_step"]; n != bad+2 {
			t.Errorf("bad_step refusals %d, want %d (each repeat)", n, bad+2)
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// A dropped step naming a receive the rank's worker holds (the engine
// named it in an earlier step too) leaves it out: its outcome is the
// worker's. Before, the dropped StepError named it, and the worker's
// outcome came later: two.
func TestDroppedStepSparesHeldRecv(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		d := startDaemonWith(t, shmDir, func(c *server.Config) { c.DrainTimeout = 100 * time.Millisecond })
		P := attach(t, d, shmDir, "P", &isoModel, isoEngine(1), kvxfer.ModePush)
		D := attach(t, d, shmDir, "D", &isoModel, isoEngine(2), kvxfer.ModePush)
		now := time.Now()
		D.step(t, &kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{{ReqID: "d-1", Local: []topology.Span{{IDs: []topology.BlockID{1}}},
			Deadline: now.Add(time.Hour), Remote: kvxfer.RemoteRef{EngineID: "P", Addr: d.peerAddr, ReqID: "p-d-1", TPSize: 1, Tokens: 16}}}})
		w := d.srv.Workers()["D"][0]
		for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
			if st, err := w.State(); err == nil && st.Recvs == 1 {
				break
			} else if time.Now().After(deadline) {
				t.Fatalf("D's state = %+v, %v; want d-1 held", st, err)
			}
		}
		rs := D.streams[0][0]
		// No scheduler: the step_ref is dropped at once.
		if err := rs.StepRef(5, []string{"d-1", "d-new"}, nil); err != nil {
			t.Fatal(err)
		}
		if se := nextDropped(t, rs); !slices.Equal(se.Recv, []string{"d-new"}) {
			t.Errorf("the dropped step named %q, want d-new alone (d-1 is the worker's: it holds it)", se.Recv)
		}
		P.close(t)
		D.close(t)
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// A step_ref naming a step the rank took in so long ago that it no longer
// remembers it (more than maxPublished steps before its newest) is
// refused, counted, and names none of its requests: they had their
// outcomes then. Before, the scheduler no longer kept it, so it was
// dropped, naming them: a second outcome.
func TestStepRefForgottenStepNamesNone(t *testing.T) {
	if testing.Short() {
		t.Skip()
	}
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		d := startDaemonWith(t, shmDir, func(c *server.Config) { c.DrainTimeout = 100 * time.Millisecond })
		D := attachSmall(t, d, shmDir, "D", 1)
		rs := D.streams[0][0]
		_, c, ctx := schedulerClientOn(t, d)
		openPushD(t, c, ctx)
		// d-1 is a full prefix hit: done at once.
		req := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t1", DoRemotePrefill: true,
			RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteTpSize: 1}}
		if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", PublishStep: 1, Ops: []*pb.SchedulerOp{{Op: &pb.SchedulerOp_AfterAlloc{
			AfterAlloc: &pb.AfterAllocRequest{Request: req, Computed: 40}}}}}); err != nil {
			t.Fatal(err)
		}
		if err := rs.StepRef(1, []string{"d-1"}, nil); err != nil {
			t.Fatal(err)
		}
		go func() {
			for range rs.Finished() { // read, or the rank waits for its engine
			}
		}()
		// More steps than the rank remembers (2 maxPublished, 1024 each).
		const n = 2*1024 + 2
		for s := uint64(2); s <= n; s++ {
			if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", PublishStep: s}); err != nil {
				t.Fatal(err)
			}
			if err := rs.StepRef(s, nil, nil); err != nil {
				t.Fatal(err)
			}
		}
		bad := d.srv.Refusals()["bad_step"]
		if err := rs.StepRef(1, []string{"d-1"}, nil); err != nil {
			t.Fatal(err)
		}
		select {
		case se := <-rs.StepErrors():
			if se.Step != 1 || se.Dropped || len(se.Recv)+len(se.Send) != 0 || !strings.Contains(se.Message, "step_ref.step = 1") {
				t.Errorf("StepError = %+v, want step 1 refused (not dropped), naming no request, naming step_ref.step = 1", se)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no StepError for the forgotten step's step_ref")
		}
		if n := d.srv.Refusals()["bad_step"]; n != bad+1 {
			t.Errorf("bad_step refusals %d, want %d", n, bad+1)
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}
