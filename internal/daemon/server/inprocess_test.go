package server_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/stream"
	"github.com/kvxfer/kvxfer/topology"
)

// addrLayout is a one-region layout over n bytes at base.
func addrLayout(base uint64, n int) topology.Layout {
	return topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2, KVLayout: topology.LayoutHND,
		Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: base, BlockLen: 256, NumBlocks: n / 256}}}
}

// helloByAddress connects a rank whose memory is mem, named by address
// (host memory).
func helloByAddress(sock, engine string, base uint64, size int) error {
	return helloByAddressKind(sock, engine, base, size, stream.InProcessHost)
}

// helloByAddressKind is helloByAddress for memory of kind (host or device).
func helloByAddressKind(sock, engine string, base uint64, size int, kind stream.InProcessMemory) error {
	c, err := stream.Dial("unix://" + sock)
	if err != nil {
		return err
	}
	defer c.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	rs, err := c.Connect(ctx, stream.Hello{EngineID: engine, Mode: kvxfer.ModePush, Layout: addrLayout(base, size), CompatHash: "m",
		Memory: []stream.Memory{{Base: base, Size: uint64(size), InProcess: kind}}})
	if err != nil {
		return err
	}
	go func() {
		for range rs.Finished() {
		}
	}()
	return rs.Close(ctx)
}

// addressEngine is the child process of TestAddressMemoryFromAnotherProcess:
// an engine that names its own memory by address to a server of another
// process, and prints the answer.
func addressEngine(sock string) int {
	mem, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		fmt.Println("mmap:", err)
		return 1
	}
	err = helloByAddress(sock, "other", addrOf(mem), len(mem))
	fmt.Printf("code=%v\n%v\n", status.Code(err), err)
	return 0
}

// Memory named by address is accepted only from the server's own
// process: an engine in another process gets PermissionDenied naming the
// field, counted as memory_address.
func TestAddressMemoryFromAnotherProcess(t *testing.T) {
	if testing.Short() {
		t.Skip("starts a process")
	}
	d := startDaemon(t, t.TempDir())
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, self, "-test.run=^$")
	cmd.Env = append(os.Environ(), "KVXFER_ADDR_ENGINE="+d.sock)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("child: %v\n%s", err, out)
	}
	for _, want := range []string{"code=PermissionDenied", "hello.memory[0].in_process = IN_PROCESS_MEMORY_HOST", "its own process"} {
		if !strings.Contains(string(out), want) {
			t.Errorf("another process's memory by address: %s\nwant it to contain %q", out, want)
		}
	}
	if n := d.srv.Refusals()["memory_address"]; n != 1 {
		t.Errorf("Refusals()[memory_address] = %d, want 1 (%v)", n, d.srv.Refusals())
	}
}

// From the server's own process, memory named by address attaches (the
// in-process placement); memory that is not mapped read-write here, and
// the field beside a path, are refused naming the field.
func TestAddressMemoryOwnProcess(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	mem, err := unix.Mmap(-1, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	if err := helloByAddress(d.sock, "own", addrOf(mem), len(mem)); err != nil {
		t.Fatalf("own memory by address: %v", err)
	}
	// Read-only memory, and memory unmapped already.
	if err := unix.Mprotect(mem[4096:], unix.PROT_READ); err != nil {
		t.Fatal(err)
	}
	gone, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	goneAt := addrOf(gone)
	if err := unix.Munmap(gone); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name       string
		base       uint64
		size       int
		wantSubstr string
	}{
		{"read-only", addrOf(mem), len(mem), "want readable and writable"},
		{"unmapped", goneAt, 4096, "not mapped in this process"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := helloByAddress(d.sock, "own-"+tc.name, tc.base, tc.size)
			if status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "hello.memory[0] (in_process host)") ||
				!strings.Contains(err.Error(), tc.wantSubstr) {
				t.Errorf("hello = %v, want InvalidArgument naming hello.memory[0] and %q", err, tc.wantSubstr)
			}
		})
	}
	if n := d.srv.Refusals()["memory_address"]; n != 0 {
		t.Errorf("Refusals()[memory_address] = %d, want 0", n)
	}
}

// addrOf is the address of b's first byte.
func addrOf(b []byte) uint64 { return uint64(uintptr(unsafe.Pointer(&b[0]))) }

// GPU memory named by address has no CUDA IPC handle: the hello is not
// refused for want of one. Here the address is host memory, so it is
// refused further on: for want of a GPU (no CUDA here), or, on a GPU
// machine, because it is not device memory.
func TestAddressDeviceMemoryNeedsNoHandle(t *testing.T) {
	d := startDaemon(t, t.TempDir())
	mem, err := unix.Mmap(-1, 0, 8192, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(mem)
	err = helloByAddressKind(d.sock, "own-device", addrOf(mem), len(mem), stream.InProcessDevice)
	if err == nil {
		t.Fatal("host memory named as in_process device attached")
	}
	if strings.Contains(err.Error(), "cuda_ipc_handle") {
		t.Errorf("hello = %v, want no complaint about a cuda_ipc_handle (memory named by address has none)", err)
	}
	if !strings.Contains(err.Error(), "hello.memory[0]") {
		t.Errorf("hello = %v, want it to name hello.memory[0]", err)
	}
	t.Logf("refused as it should be: %v", err)
}
