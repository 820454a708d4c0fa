package server_test

import (
	"context"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A step_ref naming a step the rank took in already (an engine repeating
// it: a retry, a bug) is refused, naming step_ref.step and its value, and
// counted; the step's requests keep the one outcome the first took them to.
// One naming a step the rank dropped is dropped again, published since or
// not.
// On the old code the published metadata was applied again: each request
// of the step was taken in anew, and one whose transfer had ended got a
// second outcome (a consumer's, a second READ or registration into blocks
// its engine had freed after the first).
func TestStepRefRepeated(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runStepRefRepeated(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runStepRefRepeated(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.DrainTimeout = 100 * time.Millisecond
		c.PublishWait = 200 * time.Millisecond
	})
	D := attachSmall(t, d, shmDir, "D", 1)
	rs := D.streams[0][0]
	_, c, ctx := schedulerClientOn(t, d)
	openPushD(t, c, ctx)
	// d-1 is a full prefix hit: nothing to receive, done at once (its
	// producer told so).
	req := &pb.EngineRequest{RequestId: "d-1", PromptTokens: 40, Params: &pb.TransferParams{TransferId: "t1", DoRemotePrefill: true,
		RemoteEngineId: "P", RemoteAddr: d.peerAddr, RemoteTpSize: 1}}
	step := &pb.StepRequest{EngineId: "D", PublishStep: 1, Ops: []*pb.SchedulerOp{{Op: &pb.SchedulerOp_AfterAlloc{AfterAlloc: &pb.AfterAllocRequest{
		Request: req, Computed: 40}}}}}
	if r, err := c.Step(ctx, step); err != nil || len(r.Results) > 0 {
		t.Fatalf("Step = %v, %v", r, err)
	}
	got := map[string]int{}
	wait := func(n int) {
		t.Helper()
		for sum := 0; sum < n; {
			select {
			case f := <-rs.Finished():
				for _, o := range f.Recving {
					got[o.ReqID]++
					sum++
				}
			case <-ctx.Done():
				t.Fatalf("outcomes %v, want %d", got, n)
			}
		}
	}
	if err := rs.StepRef(1, []string{"d-1"}, nil); err != nil {
		t.Fatal(err)
	}
	wait(1)
	before := d.srv.Refusals()["bad_step"]
	// The same step again, then a later one (nothing in it) that the rank
	// takes in as usual.
	if err := rs.StepRef(1, []string{"d-1"}, nil); err != nil {
		t.Fatal(err)
	}
	select {
	case se := <-rs.StepErrors():
		if se.Step != 1 || se.Dropped || !strings.Contains(se.Message, "step_ref.step = 1") {
			t.Errorf("StepError = %+v, want step 1 refused (not dropped), naming step_ref.step = 1", se)
		}
	case <-time.After(10 * time.Second): // an answer due at once; the wait only bounds a missing one
		t.Error("no StepError for a repeated step_ref")
	}
	if n := d.srv.Refusals()["bad_step"]; n != before+1 {
		t.Errorf("bad_step refusals %d, want %d", n, before+1)
	}
	// Step 2 is dropped (not published in time): the engine fails d-2 on
	// this rank. Published later, its step_ref again is dropped again:
	// taking it in now would hold d-2 after its engine ended it.
	if err := rs.StepRef(2, []string{"d-2"}, nil); err != nil {
		t.Fatal(err)
	}
	// Named again, the drop names none of the requests it named the first
	// time (the engine ended them then: a second naming is a second
	// outcome).
	dropped := func(named ...string) {
		t.Helper()
		select {
		case se := <-rs.StepErrors():
			if se.Step != 2 || !se.Dropped || !slices.Equal(se.Recv, named) {
				t.Errorf("StepError = %+v, want step 2 dropped, naming %q", se, named)
			}
		case <-ctx.Done():
			t.Fatal("no StepError for step 2")
		}
	}
	dropped("d-2")
	req.RequestId, req.Params.TransferId = "d-2", "t2"
	step.PublishStep = 2
	if r, err := c.Step(ctx, step); err != nil || len(r.Results) > 0 {
		t.Fatalf("Step = %v, %v", r, err)
	}
	if err := rs.StepRef(2, []string{"d-2"}, nil); err != nil {
		t.Fatal(err)
	}
	dropped()
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "D", PublishStep: 3}); err != nil {
		t.Fatal(err)
	}
	if err := rs.StepRef(3, nil, nil); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	collected := make(chan struct{})
	go func() {
		defer close(collected)
		for f := range rs.Finished() {
			for _, o := range f.Recving {
				got[o.ReqID]++
			}
		}
	}()
	if err := rs.Close(cctx); err != nil {
		t.Fatal(err)
	}
	<-collected
	if got["d-1"] != 1 || len(got) != 1 {
		t.Errorf("outcomes %v, want one for d-1 (none for d-2, which its engine failed)", got)
	}
	select {
	case se := <-rs.StepErrors():
		t.Errorf("unexpected StepError %+v", se)
	default:
	}
}
