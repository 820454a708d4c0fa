package main

import (
	"runtime"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/protobuf/proto"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// A server that stops by itself (a listener gone: the daemon's watcher
// calls Stop) drains its ranks, which may still move bytes into the
// memory their engine named, for up to its drain-timeout. A kvxfer_start
// meanwhile must not leave that server running unseen: kvxfer_stop's
// promise (OK: no memory named by address is touched after it returns)
// covers it too, and an engine's stop after that start would otherwise
// return at once, with the first server's rank still attached.
func TestStartWaitsForServerStoppingByItself(t *testing.T) {
	before := runtime.NumGoroutine()
	// (The drain-timeout, 10 s, is well past the 5 s the checks below
	// allow for the test's own goroutines to see what already happened:
	// with 5 s and 1 s, a loaded machine could take that second with
	// nothing wrong. A start that does not wait ends the rank only at the
	// drain-timeout, past the 5 s.)
	cfg := `{"insecure_peers": true, "log_level": "error", "drain_timeout": "10s"}`
	p, d := startHoldingProducer(t, cfg)
	rankEnded := make(chan struct{})
	go func() {
		for {
			if _, _, ended, _, _ := d.Take(-1); ended {
				close(rankEnded)
				return
			}
		}
	}()
	stopped := make(chan struct{})
	go func() { _ = p.Stop(); close(stopped) }() // the watcher, as when a listener stops by itself
	for !p.Stopped() {
		time.Sleep(time.Millisecond)
	}
	if _, code, err := start(cfg); err != nil {
		t.Fatalf("start after the server stopped by itself: %d %v", code, err)
	}
	if err := stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-rankEnded:
	case <-time.After(5 * time.Second):
		t.Error("kvxfer_stop returned OK with a rank of the server that stopped by itself still attached (its memory may still be touched)")
	}
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Error("kvxfer_stop returned OK while the server that stopped by itself was still stopping")
	}
	<-stopped
	<-rankEnded
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// startHoldingProducer starts the library's server from cfg (stopped at
// the test's end) with a producer rank attached on a direct stream, its
// memory named by address, holding a request for a consumer that never
// comes: the server's drain takes its whole drain-timeout.
func startHoldingProducer(t *testing.T, cfg string) (*daemon.InProcess, *server.DirectStream) {
	t.Helper()
	mem, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	if _, code, err := start(cfg); err != nil {
		t.Fatalf("start: %d %v", code, err)
	}
	t.Cleanup(func() {
		_ = stop()
		_ = unix.Munmap(mem) // (cleanups run last first: after the stop, which lets go of it)
	})
	running.Lock()
	p := running.p
	running.Unlock()
	d := p.OpenDirect()
	put := func(m *pb.ConnectRequest) {
		t.Helper()
		b, err := proto.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		if err := d.Put(b); err != nil {
			t.Fatal(err)
		}
	}
	put(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Hello{Hello: &pb.WorkerHello{EngineId: "P", Mode: pb.Mode_MODE_PUSH, CompatHash: "h",
		Layout: &pb.KvLayout{TpSize: 1, PpSize: 1, TotalKvHeads: 1, HeadSize: 4, ElemBytes: 2, Order: pb.KvLayoutOrder_KV_LAYOUT_ORDER_HND,
			Packing: pb.KvPacking_KV_PACKING_PACKED, LogicalBlockSize: 16, KernelBlockSize: 16,
			Regions: []*pb.Region{{Kind: pb.CacheKind_CACHE_KIND_FULL_ATTENTION, Base: base, BlockLen: 256, NumBlocks: 16}}},
		Memory: []*pb.SharedMemory{{Base: base, Size: 4096, InProcess: pb.InProcessMemory_IN_PROCESS_MEMORY_HOST}}}}})
	if _, ok, ended, code, msg := d.Take(10 * time.Second); !ok {
		t.Fatalf("no Ready: ended %v, %v %s", ended, code, msg)
	}
	now := time.Now()
	put(&pb.ConnectRequest{Msg: &pb.ConnectRequest_Step{Step: &pb.StepMeta{Step: 1, SchedulerClockUnixNanos: now.UnixNano(),
		Send: []*pb.SendRequest{{RequestId: "p-1", TransferId: "t-1", DeadlineUnixNanos: now.Add(time.Minute).UnixNano(),
			Blocks: []*pb.Span{{BlockIds: []int32{1, 2}}}, Tokens: 20}}}}})
	time.Sleep(100 * time.Millisecond) // the step is taken
	return p, d
}

// While kvxfer_stop waits for the server's drain, the engine's other
// threads' calls (kvxfer_call, kvxfer_stream_open) fail at once: no server
// runs for them any more. They waited for the whole stop instead (its
// drain-timeout, and up to 45 s more), past the deadline the engine gave
// kvxfer_call: a scheduler's step hung while a worker's shutdown stopped
// the server.
func TestCallsDuringStopFailAtOnce(t *testing.T) {
	// (The drain-timeout, 20 s, is far past the 5 s the call is allowed.)
	p, d := startHoldingProducer(t, `{"insecure_peers": true, "log_level": "error", "drain_timeout": "20s"}`)
	go func() {
		for {
			if _, _, ended, _, _ := d.Take(-1); ended {
				return
			}
		}
	}()
	stopped := make(chan error, 1)
	go func() { stopped <- stop() }()
	for !p.Stopped() { // the stop began: its drain waits for the rank
		time.Sleep(time.Millisecond)
	}
	got := make(chan error, 1)
	go func() {
		_, err := runningServer()
		got <- err
	}()
	select {
	case err := <-got:
		if err == nil {
			t.Error("a call while the server stops found it running")
		}
	case <-time.After(5 * time.Second):
		t.Error("a call while the server stops waited for the stop (its drain-timeout) instead of failing at once")
		<-got
	}
	if err := <-stopped; err != nil {
		t.Fatal(err)
	}
}
