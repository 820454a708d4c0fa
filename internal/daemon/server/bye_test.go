package server_test

import (
	"context"
	"runtime"
	"strconv"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A bye right after step_refs of steps that were never published still
// brings the engine each step's dropped StepError, naming its requests,
// before the stream ends: a bye means every outcome left is sent
// (RankStream.Close), and a dropped step's error is the only word of its
// requests the engine gets. The old stream's sender, stopped for the bye,
// left what the receiver had queued for it unsent whenever its select
// picked the stop first: the engine waited on those requests for ever.
func TestByeSendsEveryQueuedStepError(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runByeSendsQueued(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

func runByeSendsQueued(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemon(t, shmDir)
	e := attachSmall(t, d, shmDir, "E", 1)
	_, c, ctx := schedulerClientOn(t, d)
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "E", Mode: pb.Mode_MODE_PUSH, TpSize: 1, LogicalBlockSize: 16}}); err != nil {
		t.Fatal(err)
	}
	// Step 2 published, step 1 never: a step_ref of step 1 is dropped at
	// once.
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "E", PublishStep: 2}); err != nil {
		t.Fatal(err)
	}
	const rounds, refs = 8, 12 // each round loses some on the old code about always
	rs := e.streams[0][0]
	for round := range rounds {
		if round > 0 {
			var err error
			if rs, err = connectRank(t, e.client, shmDir, "E", e.ranks[0][0], kvxfer.ModePush); err != nil {
				t.Fatalf("round %d: reattach: %v", round, err)
			}
		}
		want := map[string]bool{}
		for i := range refs {
			id := "d-" + strconv.Itoa(round) + "-" + strconv.Itoa(i)
			want[id] = true
			if err := rs.StepRef(1, []string{id}, nil); err != nil {
				t.Fatal(err)
			}
		}
		got := map[string]int{}
		count := func(se *stream.StepError) {
			if !se.Dropped || se.Step != 1 {
				t.Errorf("round %d: StepError %+v, want step 1 dropped", round, se)
			}
			for _, id := range se.Recv {
				got[id]++
			}
		}
		errs := rs.StepErrors()
		ended := make(chan struct{})
		collected := make(chan struct{})
		go func() {
			defer close(collected)
			for {
				select {
				case se := <-errs:
					count(se)
				case <-ended: // the stream's reader is gone: what it delivered is buffered
					for {
						select {
						case se := <-errs:
							count(se)
						default:
							return
						}
					}
				}
			}
		}()
		fin := rs.Finished()
		go func() { // none expected; read so the stream never waits
			for range fin {
			}
		}()
		cctx, cancel := context.WithTimeout(ctx, 5*time.Second)
		err := rs.Close(cctx)
		cancel()
		close(ended)
		<-collected
		if err != nil {
			t.Fatalf("round %d: Close = %v", round, err)
		}
		for id := range want {
			if got[id] != 1 {
				t.Errorf("round %d: %s named by %d dropped StepErrors before the stream ended, want 1", round, id, got[id])
			}
		}
		if t.Failed() {
			return
		}
	}
}
