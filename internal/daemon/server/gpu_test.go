package server_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/internal/cuda/cudatest"
	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
	"github.com/kvxfer/kvxfer/stream"
	"github.com/kvxfer/kvxfer/topology"
)

const (
	gpuBlockLen = 4096 // 16 tokens x 1 head x 64 elements x 2 bytes x K and V
	gpuBlocks   = 64
	gpuBytes    = gpuBlockLen * gpuBlocks
)

func TestMain(m *testing.M) {
	if sock := os.Getenv("KVXFER_ADDR_ENGINE"); sock != "" {
		os.Exit(addressEngine(sock))
	}
	if arg := os.Getenv("KVXFER_OWNERS_ENGINE"); arg != "" {
		sock, ops, _ := strings.Cut(arg, "|")
		os.Exit(ownersEngine(sock, ops))
	}
	if arg := os.Getenv("KVXFER_SCHED_ENGINE"); arg != "" {
		os.Exit(schedEngine(arg))
	}
	if role := os.Getenv("KVXFER_GPU_ENGINE"); role != "" {
		os.Exit(gpuEngine(role, os.Getenv("KVXFER_GPU_DUMP")))
	}
	os.Exit(m.Run())
}

func gpuPattern() []byte {
	b := make([]byte, gpuBytes)
	for i := range b {
		b[i] = byte(i*7 + i>>12)
	}
	return b
}

// gpuEngine plays an engine whose KV cache is GPU memory on its device 0:
// it prints the memory's CUDA IPC handle and the device's UUID, keeps the
// memory until stdin closes, and then (consumer) dumps it to a file.
func gpuEngine(role, dump string) int {
	d, err := cuda.Open(0)
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	defer d.Close()
	p, err := d.Alloc(gpuBytes)
	if err == nil {
		init := make([]byte, gpuBytes)
		if role == "P" {
			init = gpuPattern()
		}
		err = d.CopyIn(p, init)
	}
	var h cuda.Handle
	if err == nil {
		h, err = d.Export(p)
	}
	var u [16]byte
	if err == nil {
		u, err = d.UUID()
	}
	if err != nil {
		fmt.Println("error", err)
		return 1
	}
	fmt.Println(hex.EncodeToString(h[:]), cuda.FormatUUID(u))
	_, _ = io.Copy(io.Discard, os.Stdin)
	if dump != "" {
		out := make([]byte, gpuBytes)
		if err := d.CopyOut(out, p); err != nil {
			return 1
		}
		if err := os.WriteFile(dump, out, 0o600); err != nil {
			return 1
		}
	}
	_ = d.Free(p)
	return 0
}

type gpuProc struct {
	cmd    *exec.Cmd
	stdin  io.WriteCloser
	handle []byte
	uuid   string // of the engine's device 0
}

// startGPUEngine starts gpuEngine in a child process; env adds to its
// environment (CUDA_VISIBLE_DEVICES).
func startGPUEngine(t *testing.T, role, dump string, env ...string) *gpuProc {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(append(os.Environ(), "KVXFER_GPU_ENGINE="+role, "KVXFER_GPU_DUMP="+dump), env...)
	stdin, _ := cmd.StdinPipe()
	stdout, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, err := bufio.NewReader(stdout).ReadString('\n')
	f := strings.Fields(line)
	var h []byte
	var herr, uerr error = errors.New("want a handle and a UUID"), nil
	if len(f) == 2 {
		h, herr = hex.DecodeString(f[0])
		_, uerr = cuda.ParseUUID(f[1])
	}
	if err != nil || herr != nil || uerr != nil || len(h) != 64 {
		t.Fatalf("engine %s said %q: %v %v %v", role, line, err, herr, uerr)
	}
	return &gpuProc{cmd: cmd, stdin: stdin, handle: h, uuid: f[1]}
}

// TestDaemonsGPU: two daemons with the NIXL backend serve engines whose KV
// caches are GPU memory in other processes, shared as CUDA IPC handles;
// P's blocks are pushed into D's blocks VRAM to VRAM and every byte of D's
// cache is checked. Needs a GPU and NIXL; skips otherwise.
func TestDaemonsGPU(t *testing.T) {
	if _, err := cuda.Open(0); errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	probe, err := nixl.New(nixl.Config{Name: fmt.Sprint("probe-", time.Now().UnixNano())})
	if err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
	probe.Close()
	nixlBackend := func(c *server.Config) {
		c.NewBackend = func(engine string, l *topology.Layout, vram bool) (server.Backend, error) {
			return backendOf(nixl.New(nixl.Config{Name: fmt.Sprintf("%s-%d", engine, time.Now().UnixNano()), VRAM: vram}))
		}
	}
	daemonsGPU(t, startDaemonWith(t, t.TempDir(), nixlBackend), startDaemonWith(t, t.TempDir(), nixlBackend), "NIXL agents")
}

// TestDaemonsGPUSameHost: the same with the built-in backend's same-host
// path, both ways it moves GPU memory: one-sided (the default: D's
// daemon offers its grant to P's as a gate, and P's daemon imports D's
// engine's allocation and launches the copy into it itself) and
// two-sided (gates off: D's daemon imports P's engine's allocation, its
// CUDA IPC handle passed by P's daemon, and copies device to device).
// Needs a GPU; skips otherwise.
func TestDaemonsGPUSameHost(t *testing.T) {
	if _, err := cuda.Open(0); errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	for _, gates := range []bool{true, false} {
		t.Run(fmt.Sprint("gates=", gates), func(t *testing.T) {
			dp, dd := builtinGPUPair(t, gates)
			daemonsGPU(t, dp, dd, fmt.Sprintf("built-in agents' same-host path (gates %v)", gates))
			checkSides(t, gates, dp, dd)
		})
	}
}

// daemonsGPU pushes 8 blocks from a P engine's GPU KV cache into a D
// engine's, through daemons dp and dd, and checks every byte of D's cache.
func daemonsGPU(t *testing.T, dp, dd *daemon, how string) { daemonsGPUEnv(t, dp, dd, how, nil, nil) }

// daemonsGPUEnv is daemonsGPU with environments of their own for P's and
// D's engine processes (penv, denv: CUDA_VISIBLE_DEVICES).
func daemonsGPUEnv(t *testing.T, dp, dd *daemon, how string, penv, denv []string) {
	dump := filepath.Join(t.TempDir(), "d.bin")
	pe, de := startGPUEngine(t, "P", "", penv...), startGPUEngine(t, "D", dump, denv...)
	defer pe.cmd.Wait()
	defer pe.stdin.Close()
	layout := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 64, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 40, BlockLen: gpuBlockLen, NumBlocks: gpuBlocks}}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	connect := func(d *daemon, id string, e *gpuProc, uuid string) *stream.RankStream {
		c, err := stream.Dial("unix://" + d.sock)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { c.Close() })
		rs, err := c.Connect(ctx, stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: layout, CompatHash: "m",
			Memory: []stream.Memory{{Base: 1 << 40, Size: gpuBytes, CUDAIPCHandle: e.handle, DeviceUUID: uuid}}})
		if err != nil {
			t.Fatalf("%s: %v", id, err)
		}
		return rs
	}
	// P names its GPU by ordinal, D by UUID: both ways move the bytes.
	P, D := connect(dp, "P", pe, ""), connect(dd, "D", de, de.uuid)
	pIDs, dIDs := push8(ctx, t, P, D, dp.peerAddr)
	de.stdin.Close()
	if err := de.cmd.Wait(); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(dump)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, pushed8(pIDs, dIDs)) {
		t.Fatal("D's GPU KV cache differs from what P's blocks should have put there")
	}
	t.Logf("8 blocks pushed VRAM -> VRAM between two daemons' %s, from and into engine processes' GPU memory imported through CUDA IPC", how)
}

// TestDaemonsGPUCrossDevice: the same-host path between two GPUs of one
// host: P's engine on device 0, D's on device 1 (each process sees only
// its own, CUDA_VISIBLE_DEVICES), the daemons see both. D's daemon copies
// on D's device, reading P's memory through its import there (the peer
// mapping); no gate is used, with gates on (they are for one GPU). Needs
// two devices (or the fake driver: TestGPUSameHostOnFakeDriver); skips
// otherwise.
func TestDaemonsGPUCrossDevice(t *testing.T) {
	n := 0
	for ; ; n++ {
		if _, err := cuda.DeviceUUID(n); err != nil {
			if n == 0 && errors.Is(err, cuda.ErrUnavailable) {
				t.Skipf("no GPU here: %v", err)
			}
			break
		}
	}
	if n < 2 {
		t.Skipf("this machine has %d CUDA device: the cross-device path needs 2", n)
	}
	dp, dd := builtinGPUPair(t, true)
	daemonsGPUEnv(t, dp, dd, "built-in agents' same-host path, device 0 to device 1", []string{"CUDA_VISIBLE_DEVICES=0"},
		[]string{"CUDA_VISIBLE_DEVICES=1"})
	checkSides(t, false, dp, dd)
}

// builtinGPUPair starts two daemons with the built-in backend, each
// importing same-host peers' GPU memory on its own devices, gates on or
// off.
func builtinGPUPair(t *testing.T, gates bool) (dp, dd *daemon) {
	t.Helper()
	builtin := func(srv **server.Server) func(*server.Config) {
		return func(c *server.Config) {
			c.NewBackend = func(engine string, l *topology.Layout, vram bool) (server.Backend, error) {
				return backendOf(tcp.New(tcp.Config{Logger: quiet, Conns: 2, DisableLocal: true, DisableGates: !gates,
					Devices: func(u [16]byte) (tcp.Device, error) { return (*srv).IPCDevice(u) }}))
			}
		}
	}
	var ps, ds *server.Server
	dp, dd = startDaemonWith(t, t.TempDir(), builtin(&ps)), startDaemonWith(t, t.TempDir(), builtin(&ds))
	ps, ds = dp.srv, dd.srv
	return dp, dd
}

// push8 pushes 8 of P's blocks into 8 of D's (P's engine served by the
// daemon at pAddr), waits until both ranks report them done, and closes
// both streams; it returns the blocks' ids, P's and D's.
func push8(ctx context.Context, t *testing.T, P, D *stream.RankStream, pAddr string) (pIDs, dIDs []topology.BlockID) {
	t.Helper()
	for i := range 8 {
		pIDs = append(pIDs, topology.BlockID(3*i+1))
		dIDs = append(dIDs, topology.BlockID(60-i))
	}
	now := time.Now()
	if err := D.Step(&kvxfer.StepMeta{SchedulerClock: now, Recv: []kvxfer.RecvReq{{ReqID: "d", TransferID: "t", Local: []topology.Span{{IDs: dIDs}},
		Deadline: now.Add(time.Minute), Remote: kvxfer.RemoteRef{EngineID: "P", Addr: pAddr, TPSize: 1, Tokens: 128}}}}); err != nil {
		t.Fatal(err)
	}
	if err := P.Step(&kvxfer.StepMeta{SchedulerClock: now, Send: []kvxfer.SendReq{{ReqID: "p", TransferID: "t", Deadline: now.Add(time.Minute),
		Blocks: []topology.Span{{IDs: pIDs}}, Tokens: 128}}}); err != nil {
		t.Fatal(err)
	}
	for _, w := range []struct {
		name string
		rs   *stream.RankStream
		send bool
	}{{"P", P, true}, {"D", D, false}} {
		select {
		case f := <-w.rs.Finished():
			os := f.Recving
			if w.send {
				os = f.Sending
			}
			if len(os) != 1 || os[0].Result != kvxfer.ResultDone {
				t.Fatalf("%s outcomes %+v", w.name, os)
			}
		case <-ctx.Done():
			t.Fatalf("%s: no outcome", w.name)
		}
	}
	for _, rs := range []*stream.RankStream{P, D} {
		go func() {
			for range rs.Finished() {
			}
		}()
		_ = rs.Close(ctx)
	}
	return pIDs, dIDs
}

// pushed8 is what D's cache holds after push8: P's pattern's blocks pIDs
// at dIDs, zeros elsewhere.
func pushed8(pIDs, dIDs []topology.BlockID) []byte {
	want := make([]byte, gpuBytes)
	pat := gpuPattern()
	for i := range pIDs {
		copy(want[int(dIDs[i])*gpuBlockLen:], pat[int(pIDs[i])*gpuBlockLen:(int(pIDs[i])+1)*gpuBlockLen])
	}
	return want
}

// checkSides checks which way the WRITE went: with gates, one-sided (P's
// daemon launched it, D's copied no part); without, D's daemon copied it.
func checkSides(t *testing.T, gates bool, dp, dd *daemon) {
	t.Helper()
	parts, oneSided := dd.srv.SameHostParts(), dp.srv.OneSidedWrites()
	switch {
	case gates && (oneSided == 0 || parts != 0):
		t.Errorf("with gates: P's daemon posted %d WRITEs one-sided, D's copied %d parts; want the WRITE one-sided", oneSided, parts)
	case !gates && (oneSided != 0 || parts == 0):
		t.Errorf("without gates: P's daemon posted %d WRITEs one-sided, D's copied %d parts; want D to copy", oneSided, parts)
	}
}

// TestAttachGPUByUUID: an engine whose process sees only the last GPU (as
// its device 0, through CUDA_VISIBLE_DEVICES) names it by UUID; kvxferd,
// which sees every GPU, imports the memory on the right device and
// publishes its own ordinal for it. The engine's ordinal (0) is wrong for
// the daemon whenever there are two GPUs or more, so this is the case the
// UUID exists for. A UUID no GPU has is FailedPrecondition. Needs a GPU
// and NIXL; skips otherwise.
func TestAttachGPUByUUID(t *testing.T) {
	var uuids []string
	for i := 0; ; i++ {
		u, err := cuda.DeviceUUID(i)
		if errors.Is(err, cuda.ErrUnavailable) {
			t.Skipf("no GPU here: %v", err)
		}
		if err != nil {
			break // past the last device (CUDA_ERROR_INVALID_DEVICE)
		}
		uuids = append(uuids, cuda.FormatUUID(u))
	}
	if len(uuids) == 0 {
		t.Skip("no GPU here")
	}
	probe, err := nixl.New(nixl.Config{Name: fmt.Sprint("probe-", time.Now().UnixNano())})
	if err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
	probe.Close()
	last := len(uuids) - 1
	d := startDaemonWith(t, t.TempDir(), func(c *server.Config) {
		c.NewBackend = func(engine string, l *topology.Layout, vram bool) (server.Backend, error) {
			return backendOf(nixl.New(nixl.Config{Name: fmt.Sprintf("%s-%d", engine, time.Now().UnixNano()), VRAM: vram}))
		}
	})
	e := startGPUEngine(t, "D", "", "CUDA_VISIBLE_DEVICES="+uuids[last])
	defer e.cmd.Wait()
	defer e.stdin.Close()
	if e.uuid != uuids[last] {
		t.Fatalf("the engine's device 0 is %s, want the last GPU %s", e.uuid, uuids[last])
	}
	layout := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 64, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 40, BlockLen: gpuBlockLen, NumBlocks: gpuBlocks}}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	hello := func(uuid string) stream.Hello {
		return stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: layout, CompatHash: "m",
			Memory: []stream.Memory{{Base: 1 << 40, Size: gpuBytes, CUDAIPCHandle: e.handle, Device: 0, DeviceUUID: uuid}}}
	}
	const nilUUID = "GPU-00000000-0000-0000-0000-000000000000"
	if _, err := c.Connect(ctx, hello(nilUUID)); status.Code(err) != codes.FailedPrecondition || !strings.Contains(err.Error(), nilUUID) {
		t.Errorf("Connect with GPU memory on %s: %v, want FailedPrecondition naming it", nilUUID, err)
	}
	rs, err := c.Connect(ctx, hello(e.uuid))
	if err != nil {
		t.Fatalf("Connect by UUID %s: %v", e.uuid, err)
	}
	defer func() {
		go func() {
			for range rs.Finished() {
			}
		}()
		_ = rs.Close(ctx)
	}()
	res, err := server.NewPeerResolver(server.ResolverConfig{}).Handshake(ctx, "E", d.peerAddr)
	if err != nil || len(res.Ranks) != 1 {
		t.Fatalf("handshake = %+v, %v; want the one rank", res, err)
	}
	if got := res.Ranks[0].Layout.Regions[0].DeviceID; got != int32(last) {
		t.Errorf("published region device = %d, want %d (the daemon's ordinal of %s)", got, last, e.uuid)
	}
	t.Logf("engine memory on %s (its device 0, the daemon's device %d of %d) attached by UUID", e.uuid, last, len(uuids))
}

// TestGPUSameHostOnFakeDriver runs TestDaemonsGPUSameHost on every
// machine, against a fake CUDA driver (internal/cuda/cudatest): two
// daemons' built-in agents, engines' GPU memory in other processes, the
// WRITE one-sided through a gate and two-sided, every byte of D's cache
// checked. The fake found what a GPU run would have: both daemons of the
// test share a process, and CUDA will not open a handle in the process
// that exported it, so P could not import D's gates (internal/cuda now
// gives a process's own handles back as its memory).
func TestGPUSameHostOnFakeDriver(t *testing.T) {
	cudatest.RunOnFakeDriver(t, "TestDaemonsGPUSameHost", "TestInProcessGPU", "TestDaemonsGPUCrossDevice")
}

// TestInProcessGPU: the in-process placement over GPU memory: two
// servers in the engines' own process (here the test's), each engine's KV
// cache its own device allocation named by address (no IPC handle from
// the engine), 8 blocks pushed over the built-in backend's same-host path,
// one-sided through a gate and two-sided, every byte of D's cache
// checked. Each server exports its engine's allocation itself, and the
// other imports it: in one process, as the memory itself (CUDA opens a
// handle only in another process). Needs a GPU (or the fake driver:
// TestGPUSameHostOnFakeDriver); skips otherwise.
func TestInProcessGPU(t *testing.T) {
	dev, err := cuda.Open(0)
	if errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	defer dev.Close()
	for _, gates := range []bool{true, false} {
		t.Run(fmt.Sprint("gates=", gates), func(t *testing.T) {
			dp, dd := builtinGPUPair(t, gates)
			var mem [2]uint64
			for i := range mem {
				p, err := dev.Alloc(gpuBytes)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = dev.Free(p) })
				init := make([]byte, gpuBytes)
				if i == 0 {
					init = gpuPattern()
				}
				if err := dev.CopyIn(p, init); err != nil {
					t.Fatal(err)
				}
				mem[i] = p
			}
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			connect := func(d *daemon, id string, base uint64) *stream.RankStream {
				c, err := stream.Dial("unix://" + d.sock)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { c.Close() })
				l := addrLayout(base, gpuBytes)
				l.HeadSize, l.Regions[0].BlockLen, l.Regions[0].NumBlocks = 64, gpuBlockLen, gpuBlocks
				rs, err := c.Connect(ctx, stream.Hello{EngineID: id, Mode: kvxfer.ModePush, Layout: l, CompatHash: "m",
					Memory: []stream.Memory{{Base: base, Size: gpuBytes, InProcess: stream.InProcessDevice}}})
				if err != nil {
					t.Fatalf("%s: %v", id, err)
				}
				return rs
			}
			P, D := connect(dp, "P", mem[0]), connect(dd, "D", mem[1])
			pIDs, dIDs := push8(ctx, t, P, D, dp.peerAddr)
			got := make([]byte, gpuBytes)
			if err := dev.CopyOut(got, mem[1]); err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, pushed8(pIDs, dIDs)) {
				t.Fatal("D's GPU KV cache differs from what P's blocks should have put there")
			}
			checkSides(t, gates, dp, dd)
		})
	}
}

// TestAttachGPUSizePastAllocation: an engine whose hello claims more GPU
// memory than the allocation its CUDA IPC handle exports is refused at
// attach, naming the size: the daemon's copies into or out of the import
// past its end would fault the daemon's GPU context, which every engine of
// the daemon on that GPU shares. Needs a GPU (or the fake driver:
// TestGPUAttachSizeOnFakeDriver); skips otherwise.
func TestAttachGPUSizePastAllocation(t *testing.T) {
	if _, err := cuda.Open(0); errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	var srv *server.Server
	d := startDaemonWith(t, t.TempDir(), func(c *server.Config) {
		c.NewBackend = func(engine string, l *topology.Layout, vram bool) (server.Backend, error) {
			return backendOf(tcp.New(tcp.Config{Logger: quiet, Conns: 2, DisableLocal: true,
				Devices: func(u [16]byte) (tcp.Device, error) { return srv.IPCDevice(u) }}))
		}
	})
	srv = d.srv
	e := startGPUEngine(t, "D", "")
	defer e.cmd.Wait()
	defer e.stdin.Close()
	const claimed = 2 * gpuBytes // the allocation is gpuBytes
	layout := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 64, ElemBytes: 2, KVLayout: topology.LayoutHND, Packing: topology.PackedKV,
		LogicalBlockSize: 16, KernelBlockSize: 16, Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: 1 << 40, BlockLen: gpuBlockLen, NumBlocks: 2 * gpuBlocks}}}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	c, err := stream.Dial("unix://" + d.sock)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: "E", Mode: kvxfer.ModePush, Layout: layout, CompatHash: "m",
		Memory: []stream.Memory{{Base: 1 << 40, Size: claimed, CUDAIPCHandle: e.handle, DeviceUUID: e.uuid}}})
	if err == nil {
		go func() {
			for range rs.Finished() {
			}
		}()
		_ = rs.Close(ctx)
		t.Fatalf("an engine claiming %d bytes of a %d-byte GPU allocation was attached", claimed, gpuBytes)
	}
	if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "hello.memory[0]") || !strings.Contains(err.Error(), fmt.Sprint(claimed)) {
		t.Fatalf("Connect claiming %d bytes of a %d-byte allocation: %v, want InvalidArgument naming hello.memory[0] and the size", claimed, gpuBytes, err)
	}
}

// TestGPUAttachSizeOnFakeDriver runs TestAttachGPUSizePastAllocation on
// every machine, against the fake CUDA driver.
func TestGPUAttachSizeOnFakeDriver(t *testing.T) {
	cudatest.RunOnFakeDriver(t, "TestAttachGPUSizePastAllocation")
}
