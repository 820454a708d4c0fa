// Package cuda imports GPU memory that an engine shares as CUDA IPC memory
// handles, so a backend (NIXL) can register it as VRAM, and unmaps it on
// detach. The CUDA driver (libcuda.so.1) is loaded at run time, so the
// package builds everywhere; without a driver or a GPU every entry point
// reports ErrUnavailable and tests skip.
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
