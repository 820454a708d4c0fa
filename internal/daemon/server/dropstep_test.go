package server_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/shm"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
	"github.com/kvxfer/kvxfer/topology"
)

// A layer-wise producer a rank holds prefilling (an earlier step's
// Prefill entry: no lease, only its finish or abort ends it) whose finish
// comes in a step the rank drops (a step_ref whose metadata was never
// published, or named again after a drop) ends on the worker: its blocks
// are let go there, and the engine gets exactly one terminal outcome for
// it on that rank, the worker's (failed, naming the dropped step), once
// its WRITEs in flight end; the dropped StepError does not name it (the
// engine would free its blocks at once while a WRITE may still read
// them, and then get the worker's outcome as a second one). Requests of
// the dropped step the rank does not hold are named in the StepError, as
// before, and get no worker outcome.
// On the old code the worker never heard of the drop: the request stayed
// held prefilling for ever (its blocks granted, State().Sends 1) and the
// only word of it was the StepError.
func TestDroppedStepEndsHeldPrefilling(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) { runDroppedStepEndsHeldPrefilling(t) }) // its cleanups end with it
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// connectLayerwise attaches one layer-wise push rank of engine id.
func connectLayerwise(t *testing.T, d *daemon, shmDir, id string) *stream.RankStream {
	t.Helper()
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}
	ranks, err := kvsim.Build(&model, &kvsim.Engine{ID: 1, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16,
		Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 8})
	if err != nil {
		t.Fatal(err)
	}
	r := ranks[0][0]
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = c.Close() })
	name := fmt.Sprintf("%s-%d", id, rand.Uint64())
	mp, err := shm.Create(shmDir, name, uint64(len(r.Mem)))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = mp.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: r.Layout, CompatHash: "m", Layerwise: true,
		Memory: []stream.Memory{{Path: filepath.Join(shmDir, name), Base: r.Base, Size: uint64(len(r.Mem))}}})
	if err != nil {
		t.Fatal(err)
	}
	return rs
}

func runDroppedStepEndsHeldPrefilling(t *testing.T) {
	shmDir := t.TempDir()
	d := startDaemonWith(t, shmDir, func(c *server.Config) {
		c.DrainTimeout = 100 * time.Millisecond
		c.PublishWait = 100 * time.Millisecond
	})
	rs := connectLayerwise(t, d, shmDir, "P")
	_, c, ctx := schedulerClientOn(t, d)
	if _, err := c.OpenScheduler(ctx, &pb.OpenSchedulerRequest{Config: &pb.SchedulerConfig{EngineId: "P", Mode: pb.Mode_MODE_PUSH, TpSize: 1,
		LogicalBlockSize: 16, Layerwise: true}}); err != nil {
		t.Fatal(err)
	}
	ws := d.srv.Workers()["P"]
	if len(ws) != 1 {
		t.Fatalf("workers of engine P: %d", len(ws))
	}
	w := ws[0]
	sends := func() int {
		t.Helper()
		st, err := w.State()
		if err != nil {
			t.Fatal(err)
		}
		return st.Sends
	}
	prefill := func(id string, block topology.BlockID) kvxfer.SendReq {
		return kvxfer.SendReq{ReqID: id, TransferID: "t-" + id, Blocks: []topology.Span{{IDs: []topology.BlockID{block}}}, Tokens: 16}
	}
	// Step 1, sent whole: p-1 and p-2 prefill (held prefilling); step 2:
	// p-3 prefills.
	if err := rs.Step(&kvxfer.StepMeta{Step: 1, Prefill: []kvxfer.SendReq{prefill("p-1", 1), prefill("p-2", 2)}}); err != nil {
		t.Fatal(err)
	}
	if err := rs.Step(&kvxfer.StepMeta{Step: 2, Prefill: []kvxfer.SendReq{prefill("p-3", 3)}}); err != nil {
		t.Fatal(err)
	}
	// Up to 10 s (200 tries 5 ms apart, about a second, could run out on
	// a loaded machine).
	for deadline := time.Now().Add(10 * time.Second); sends() != 3; {
		if time.Now().After(deadline) {
			t.Fatalf("worker holds %d sends, want 3 prefilling", sends())
		}
		time.Sleep(5 * time.Millisecond)
	}
	outcomes := map[string][]kvxfer.Outcome{}
	named := map[string]int{} // id -> times a dropped StepError named it
	var dropped []*stream.StepError
	take := func(until func() bool) {
		t.Helper()
		deadline := time.After(5 * time.Second)
		for !until() {
			select {
			case f := <-rs.Finished():
				for _, o := range f.Sending {
					outcomes[o.ReqID] = append(outcomes[o.ReqID], o)
				}
			case se := <-rs.StepErrors():
				if se.Dropped {
					dropped = append(dropped, se)
					for _, id := range se.Send {
						named[id]++
					}
				}
			case <-deadline:
				return
			}
		}
	}
	// Step 3, by reference, finishes p-1 and q-new (not held): never
	// published, dropped after PublishWait.
	if err := rs.StepRef(3, nil, []string{"p-1", "q-new"}); err != nil {
		t.Fatal(err)
	}
	take(func() bool { return len(outcomes["p-1"])+named["p-1"] > 0 && len(dropped) == 1 && sends() == 2 })
	// Step 4 is published, so that step 3 named again is dropped again
	// at once; its step_ref finishes p-2.
	if _, err := c.Step(ctx, &pb.StepRequest{EngineId: "P", PublishStep: 4}); err != nil {
		t.Fatal(err)
	}
	if err := rs.StepRef(3, nil, []string{"p-2"}); err != nil {
		t.Fatal(err)
	}
	take(func() bool { return len(outcomes["p-2"])+named["p-2"] > 0 && len(dropped) == 2 && sends() == 1 })
	if n := sends(); n != 1 {
		t.Errorf("worker holds %d sends after the drops, want 1 (p-3, whose finish was not dropped): p-1 and p-2 held for ever", n)
	}
	for _, id := range []string{"p-1", "p-2"} {
		if n := len(outcomes[id]) + named[id]; n != 1 {
			t.Errorf("%s: %d worker outcomes %v and named in %d dropped StepErrors, want exactly one terminal outcome", id, len(outcomes[id]), outcomes[id], named[id])
			continue
		}
		if named[id] > 0 {
			t.Errorf("%s: named in a dropped StepError (its blocks freed by the engine while the rank held it), want the worker's outcome", id)
			continue
		}
		if o := outcomes[id][0]; o.Result != kvxfer.ResultFailed || !strings.Contains(o.Reason, "step 3") {
			t.Errorf("%s's outcome = %+v, want failed, naming step 3", id, o)
		}
	}
	if named["q-new"] != 1 || len(outcomes["q-new"]) != 0 {
		t.Errorf("q-new (not held): named %d times, outcomes %v; want named once by the dropped StepError, no worker outcome", named["q-new"], outcomes["q-new"])
	}
	if len(dropped) != 2 {
		t.Errorf("dropped StepErrors %d, want 2 (step 3, twice)", len(dropped))
	}
	if len(outcomes["p-3"]) != 0 {
		t.Errorf("p-3 (its finish not dropped): outcomes %v, want none yet", outcomes["p-3"])
	}
}

// A step dropped because the rank's worker is closed (it stopped after a
// contained panic, or the rank is leaving) names none of the requests the
// closed worker held: its close ended each with its own outcome (failed,
// worker closed), and the engine, told twice, frees the blocks at the
// first. Requests it did not hold are named, as for any dropped step.
// Before, Worker.StepDropped returned ErrClosed and nothing else, so the
// dropped StepError named them all: a held layer-wise producer got two
// outcomes.
func TestDroppedStepOfClosedWorkerSparesHeld(t *testing.T) {
	before := runtime.NumGoroutine()
	t.Run("run", func(t *testing.T) {
		shmDir := t.TempDir()
		d := startDaemonWith(t, shmDir, func(c *server.Config) { c.DrainTimeout = 100 * time.Millisecond })
		rs := connectLayerwise(t, d, shmDir, "P")
		w := d.srv.Workers()["P"][0]
		prefill := func(id string, block topology.BlockID) kvxfer.SendReq {
			return kvxfer.SendReq{ReqID: id, TransferID: "t-" + id, Blocks: []topology.Span{{IDs: []topology.BlockID{block}}}, Tokens: 16}
		}
		if err := rs.Step(&kvxfer.StepMeta{Step: 1, Prefill: []kvxfer.SendReq{prefill("p-1", 1), prefill("p-2", 2)}}); err != nil {
			t.Fatal(err)
		}
		for deadline := time.Now().Add(10 * time.Second); ; {
			st, err := w.State()
			if err != nil {
				t.Fatal(err)
			}
			if st.Sends == 2 {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("worker holds %d sends, want 2 prefilling", st.Sends)
			}
			time.Sleep(5 * time.Millisecond)
		}
		if err := w.Close(); err != nil {
			t.Fatal(err)
		}
		failed := map[string]int{}
		deadline := time.After(10 * time.Second)
		for failed["p-1"] == 0 || failed["p-2"] == 0 {
			select {
			case f := <-rs.Finished():
				for _, o := range f.Sending {
					failed[o.ReqID]++
				}
			case <-deadline:
				t.Fatalf("closed worker's outcomes %v, want p-1 and p-2", failed)
			}
		}
		held, err := w.StepDropped([]string{"p-1", "q-new", "p-1"}, "step 2 dropped")
		if !errors.Is(err, kvxfer.ErrClosed) || !slices.Equal(held, []string{"p-1"}) {
			t.Errorf("StepDropped on the closed worker = %q, %v; want [p-1] (its close ended it), ErrClosed", held, err)
		}
		var named []string
		for _, e := range server.DroppedErrsForTest(w, 2, "worker closed", []string{"p-1", "q-new", "p-2"}) {
			named = append(named, e.SendRequestIds...)
		}
		if !slices.Equal(named, []string{"q-new"}) {
			t.Errorf("the dropped step's error names %q, want q-new alone (p-1 and p-2 had the closed worker's outcome)", named)
		}
	})
	leakcheck.Check(t, before, 2, 10*time.Second)
}
