package server_test

import (
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// An engine's connector that lost its Steps stream opens its scheduler
// again (the same process: its step numbers go on). A rank's step_ref for
// a step the old scheduler published, arriving after that, is read from
// the old one's steps: the step is taken in (named again, it is refused as
// taken in, not dropped). Before, the rank looked in the new scheduler
// only and dropped the step as soon as the new one published a later one:
// each of its requests failed, the step's work lost. A scheduler opened
// by another process (a restarted engine, numbering its steps anew) does
// not serve the old one's steps: the step is dropped, saying why.
func TestStepRefAcrossSchedulerReopen(t *testing.T) {
	for _, other := range []bool{false, true} {
		name := "same process"
		if other {
			name = "another process"
		}
		t.Run(name, func(t *testing.T) {
			shmDir := t.TempDir()
			d := startDaemonWith(t, shmDir, func(c *server.Config) { c.PublishWait = 5 * time.Second })
			rs := connectLayerwise(t, d, shmDir, "P")
			_, c, ctx := schedulerClientOn(t, d)
			open := func() {
				t.Helper()
				if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "P", Mode: pb.Mode_MODE_PUSH,
					TpSize: 1, LogicalBlockSize: 16, Layerwise: true}}); err != nil {
					t.Fatal(err)
				}
			}
			publish := func(step uint64) {
				t.Helper()
				if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "P", PublishStep: step}); err != nil {
					t.Fatal(err)
				}
			}
			open()
			publish(1)
			if other {
				d.srv.SetSchedulerPIDForTest("P", 1) // as if pid 1 had opened it
			}
			open()
			publish(2)
			var errs []*stream.StepError
			next := func() {
				t.Helper()
				select {
				case se := <-rs.StepErrors():
					errs = append(errs, se)
				case <-time.After(5 * time.Second):
					t.Fatalf("no step error; got %d so far", len(errs))
				}
			}
			if err := rs.StepRef(1, nil, nil); err != nil {
				t.Fatal(err)
			}
			if err := rs.StepRef(1, nil, nil); err != nil {
				t.Fatal(err)
			}
			if !other {
				next() // only the repeat errs
				if e := errs[0]; e.Dropped || !strings.Contains(e.Message, "took the step in already") {
					t.Errorf("step 1 named twice after the scheduler reopened: %+v; want it taken in (the repeat refused as such), not dropped", e)
				}
				return
			}
			next()
			next()
			if e := errs[0]; !e.Dropped || !strings.Contains(e.Message, "opened again by another process") {
				t.Errorf("step 1 of another process's scheduler: %+v; want it dropped, saying the scheduler was opened by another process", e)
			}
		})
	}
}
