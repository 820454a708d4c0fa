package kvxfer_test

import (
	"fmt"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// What an engine hands a rank (steps, layer signals) waited in the
// worker's inbox without bound: Step and LayerSaved appended and returned
// at once however far behind the loop was, so an engine sending steps
// faster than its rank takes them in (or while its loop is held up) grew
// the daemon's memory without end, with no backpressure on its stream.
// Past kvxfer.MaxQueuedSteps waiting, Step and LayerSaved wait for the
// loop to take them in (the daemon's stream receiver with them, and so the
// engine, through gRPC's flow control), or for the Worker to close; and
// nothing handed is lost: every step is taken in once the loop goes on.
func TestEngineInputQueueBounded(t *testing.T) {
	fab, dir := newFabricDir()
	a, err := fab.NewAgent("x")
	if err != nil {
		t.Fatal(err)
	}
	mem := a.Alloc(256, 0)
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2,
		KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: mem.Addr, BlockLen: 256, NumBlocks: 1}}}
	w, err := kvxfer.NewWorker(kvxfer.WorkerConfig{EngineID: "E", Addr: "E:1", Mode: kvxfer.ModePush, Layout: l, Backend: a, Resolver: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	const n = 20000
	release := kvxfer.StallLoop(w)
	defer release()
	// Each step refuses one request of its own: its failed outcome says
	// the step was taken in.
	sent := make(chan error, 1)
	go func() {
		for i := range n {
			id := fmt.Sprintf("r%d", i)
			if err := w.StepRefusing(&kvxfer.StepMeta{}, []kvxfer.Refusal{{Role: kvxfer.RoleConsumer, ReqID: id, Field: "test", Reason: "test"}}); err == nil {
				sent <- fmt.Errorf("step %d: no error for its refused entry", i)
				return
			}
			if i%2 == 0 {
				_ = w.LayerSaved(uint64(i), 0)
			}
		}
		sent <- nil
	}()
	// The loop is held: the engine's input waits, within the bound.
	deadline := time.Now().Add(10 * time.Second)
	for kvxfer.Queued(w) < kvxfer.MaxQueuedSteps && time.Now().Before(deadline) {
		select {
		case err := <-sent:
			t.Fatalf("all %d steps and layer signals were queued while the worker's loop was held (%d waiting, bound %d): %v",
				n+n/2, kvxfer.Queued(w), kvxfer.MaxQueuedSteps, err)
		default:
		}
		time.Sleep(time.Millisecond)
	}
	if q := kvxfer.Queued(w); q != kvxfer.MaxQueuedSteps {
		t.Fatalf("%d events queued while the loop was held, want the bound %d", q, kvxfer.MaxQueuedSteps)
	}
	select {
	case err := <-sent:
		t.Fatalf("the engine's sends returned while the loop was held: %v", err)
	default:
	}
	// The loop goes on: every step is taken in, each refused request
	// reported once.
	release()
	if err := <-sent; err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for deadline := time.Now().Add(20 * time.Second); len(seen) < n && time.Now().Before(deadline); {
		f := w.Finished()
		for _, o := range f.Recving {
			if seen[o.ReqID] {
				t.Fatalf("request %s reported twice", o.ReqID)
			}
			seen[o.ReqID] = true
		}
		if len(f.Recving) == 0 {
			time.Sleep(time.Millisecond)
		}
	}
	if len(seen) != n {
		t.Fatalf("%d of %d refused requests reported", len(seen), n)
	}
}
