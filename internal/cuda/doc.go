// Package cuda imports GPU memory that an engine shares as CUDA IPC memory
// handles, so a backend (NIXL) can register it as VRAM, and unmaps it on
// detach; and it copies a transfer's GPU pieces with one kernel launch
// (Device.Post, batch.go: the built-in backend's same-host path). The
// CUDA driver (libcuda.so.1) is loaded at run time, so the package builds
// everywhere; without a driver or a GPU every entry point reports
// ErrUnavailable and tests skip.
//
// # The copy kernel
//
// kernel/copy.cu is compiled to PTX (copy.ptx, committed, embedded) by
// kernel/gen with NVRTC from NVIDIA's wheel; the driver JIT-compiles it
// for the GPU when it is first used on a device, so no CUDA toolkit is
// needed to build or run. NVRTC 12.0 writes PTX ISA 8.0: any CUDA 12 or
// later driver loads it, on Volta (sm_70) and later (CI assembles it with
// ptxas for each). Where it does not load, a batch is one asynchronous
// copy per piece instead, logged once and counted (CopyFallbacks:
// kvxferd's kvxfer_gpu_copy_fallback_total).
//
// The kernels' logic is also run on the CPU, on every CI run, by
// TestKernelOnCPU: kernel/emu.cpp compiles copy.cu itself as C++ against
// a stand-in for what it uses of CUDA (a CTA's threads real threads) and
// checks every alignment and length, regions and entries, and the gated
// kernel against a receiver shutting its gate at random moments. The
// GPU's weaker memory model is left to the GPU tests.
//
// # Without a GPU
//
// The package's GPU tests also run against a fake driver on every test
// run (TestGPUOnFakeDriver; kernel/fakecuda.cpp, package cudatest):
// shared memory for device memory, IPC between processes through /proc,
// streams as threads, the kernels as a model of their contract, faults on
// memory it does not know. Like CUDA it opens a handle only in another
// process; Import gives a handle this process exported back as its own
// memory (own.go), so two agents of one process exchange GPU memory as
// two processes do.
//
// # Devices by UUID
//
// Device ordinals are per process (CUDA_VISIBLE_DEVICES renumbers them),
// so an engine names its GPU by UUID, "GPU-" and 8-4-4-4-12 hex digits
// (FormatUUID, ParseUUID: pure Go, no driver needed), and kvxferd finds
// its own ordinal for it with OrdinalOf or OpenUUID.
//
// # cgo
//
// Only integers and C memory cross: device pointers are integers, IPC
// handles are 64-byte values copied in and out, host buffers for copies
// are passed as Go pointers only for the duration of one call (cgo's
// rules allow it: C keeps none).
package cuda
