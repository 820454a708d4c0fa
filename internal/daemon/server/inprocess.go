package server

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"strconv"
	"unsafe"

	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/stream"
	pb "github.com/kvxfer/kvxfer/stream/kvxferv1"
)

// Memory named by its address (SharedMemory.in_process): the in-process
// placement, where the server runs inside the engine's process and takes
// the engine's own allocations as they are.

// errForeignAddress is the error of memory named by address from a
// process other than the server's (Status: PermissionDenied; counted as
// the refusal memory_address).
var errForeignAddress = fmt.Errorf("%w: memory named by address", ErrPermission)

// byAddress reports whether m names memory by its address here.
func byAddress(m *pb.SharedMemory) bool {
	return m.InProcess != pb.InProcessMemory_IN_PROCESS_MEMORY_UNSPECIFIED
}

// isGPU reports whether m is GPU memory: a CUDA IPC handle, or device
// memory named by address.
func isGPU(m *pb.SharedMemory) bool {
	return len(m.CudaIpcHandle) > 0 || m.InProcess == pb.InProcessMemory_IN_PROCESS_MEMORY_DEVICE
}

// checkInProcess vets memory entry i's in_process field, from engine
// process pid: a known value, neither path nor handle beside it, and only
// from this very process (the unix socket's SO_PEERCRED pid), since an
// address means nothing in another process's address space, and a server
// that took one would read and write its own memory on another's behalf.
func checkInProcess(i int, m *pb.SharedMemory, pid int32) error {
	switch m.InProcess {
	case pb.InProcessMemory_IN_PROCESS_MEMORY_UNSPECIFIED:
		return nil
	case pb.InProcessMemory_IN_PROCESS_MEMORY_HOST, pb.InProcessMemory_IN_PROCESS_MEMORY_DEVICE:
	default:
		return stream.Invalid("hello.memory[%d].in_process = %d, want IN_PROCESS_MEMORY_HOST or IN_PROCESS_MEMORY_DEVICE", i, m.InProcess)
	}
	if int(pid) != os.Getpid() {
		return fmt.Errorf("%w: hello.memory[%d].in_process = %v from process %d: kvxfer takes memory by address only from its own process (%d), "+
			"when it runs inside the engine's process (libkvxfer); share memory with kvxferd as a shared-memory file (path) or a CUDA IPC handle",
			errForeignAddress, i, m.InProcess, pid, os.Getpid())
	}
	if m.Path != "" || len(m.CudaIpcHandle) > 0 {
		return stream.Invalid("hello.memory[%d].in_process = %v with path %q or a cuda_ipc_handle: memory named by address has neither", i, m.InProcess, m.Path)
	}
	return nil
}

// ownHostMemory returns host memory entry i, m, named by address, as
// bytes, once /proc/self/maps shows all of it mapped readable and
// writable: an address that is not (a mistake, or memory freed already)
// is refused here instead of faulting in a transfer.
func ownHostMemory(i int, m *pb.SharedMemory) ([]byte, error) {
	if m.Size == 0 || m.Base == 0 || m.Base+m.Size < m.Base {
		return nil, stream.Invalid("hello.memory[%d] (in_process host): base %#x, size %d", i, m.Base, m.Size)
	}
	maps, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		return nil, fmt.Errorf("hello.memory[%d] (in_process host): %w", i, err)
	}
	if err := coveredRW(maps, m.Base, m.Base+m.Size); err != nil {
		return nil, stream.Invalid("hello.memory[%d] (in_process host): [%#x, +%d): %v", i, m.Base, m.Size, err)
	}
	return addrBytes(m.Base, m.Size), nil
}

// coveredRW checks that /proc/self/maps text maps covers [lo, hi) with
// readable and writable mappings, without a gap.
func coveredRW(maps []byte, lo, hi uint64) error {
	at := lo
	sc := bufio.NewScanner(bytes.NewReader(maps))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() && at < hi {
		line := sc.Bytes()
		rng, rest, ok := bytes.Cut(line, []byte(" "))
		if !ok {
			continue
		}
		a, b, ok := bytes.Cut(rng, []byte("-"))
		if !ok {
			continue
		}
		start, err1 := strconv.ParseUint(string(a), 16, 64)
		end, err2 := strconv.ParseUint(string(b), 16, 64)
		if err1 != nil || err2 != nil || end <= at {
			continue
		}
		if start > at {
			return fmt.Errorf("%#x is not mapped in this process", at)
		}
		if len(rest) < 2 || rest[0] != 'r' || rest[1] != 'w' {
			return fmt.Errorf("%#x is mapped %s, want readable and writable", at, bytes.Fields(rest)[0])
		}
		at = end
	}
	if at < hi {
		return fmt.Errorf("%#x is not mapped in this process", at)
	}
	return nil
}

// addrBytes is the memory at address base of this process as bytes.
//
// Safety: base comes from the engine in this very process (checkInProcess)
// and [base, base+size) is mapped readable and writable (coveredRW); it is
// not Go heap memory, which an engine cannot name over gRPC. The engine
// keeps it allocated until its rank's stream ends, and the rank's backend
// is closed, touching it no more, before that stream ends.
func addrBytes(base, size uint64) []byte {
	p := *(*unsafe.Pointer)(unsafe.Pointer(&base))
	return unsafe.Slice((*byte)(p), size)
}

// ownDeviceMemory checks that GPU memory entry i, m, named by address,
// lies in one allocation of dev's GPU in this process.
func ownDeviceMemory(i int, m *pb.SharedMemory, dev *cuda.Device) error {
	if m.Size == 0 || m.Base+m.Size < m.Base {
		return stream.Invalid("hello.memory[%d] (in_process device): base %#x, size %d", i, m.Base, m.Size)
	}
	ab, as, err := dev.Allocation(m.Base)
	switch {
	case errors.Is(err, cuda.ErrUnavailable):
		return fmt.Errorf("hello.memory[%d] (in_process device): %w", i, err)
	case err != nil:
		return stream.Invalid("hello.memory[%d] (in_process device) base %#x: %v", i, m.Base, err)
	case m.Base+m.Size > ab+as:
		return stream.Invalid("hello.memory[%d] (in_process device): [%#x, +%d) runs past its allocation [%#x, +%d)", i, m.Base, m.Size, ab, as)
	}
	return nil
}

// mapOwnDevice maps the allocation of dev holding base (GPU memory of
// this process) into the built-in backend by its CUDA IPC export, which
// same-host peers import: the engine's own allocation's handle, never a
// copy. An allocation mapped already (done) is not mapped again.
func mapOwnDevice(im IPCMapper, dev *cuda.Device, base uint64, done map[uint64]bool) error {
	ab, as, err := dev.Allocation(base)
	if err != nil {
		return err
	}
	if done[ab] {
		return nil
	}
	h, err := dev.Export(ab)
	if err != nil {
		return fmt.Errorf("export allocation %#x: %w", ab, err)
	}
	u, err := dev.UUID()
	if err != nil {
		return err
	}
	if err := im.MapIPC(ab, as, cudaDevice{dev}, u, h); err != nil {
		return err
	}
	done[ab] = true
	return nil
}
