//go:build cgo

package cuda

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdint.h>
#include <string.h>
#include <stdlib.h>

typedef int CUresult;
typedef int CUdevice;
typedef void* CUcontext;
typedef unsigned long long CUdeviceptr;
typedef struct { char reserved[64]; } CUipcMemHandle;
typedef struct { char bytes[16]; } CUuuid;
typedef void* CUmodule;
typedef void* CUfunction;
typedef void* CUstream;
typedef void* CUevent;

static struct {
	void *lib;
	CUresult (*cuInit)(unsigned int);
	CUresult (*cuDeviceGetCount)(int*);
	CUresult (*cuDeviceGet)(CUdevice*, int);
	CUresult (*cuDeviceGetUuid)(CUuuid*, CUdevice);
	CUresult (*cuDevicePrimaryCtxRetain)(CUcontext*, CUdevice);
	CUresult (*cuDevicePrimaryCtxRelease)(CUdevice);
	CUresult (*cuCtxSetCurrent)(CUcontext);
	CUresult (*cuMemAlloc)(CUdeviceptr*, size_t);
	CUresult (*cuMemFree)(CUdeviceptr);
	CUresult (*cuMemcpyHtoD)(CUdeviceptr, const void*, size_t);
	CUresult (*cuMemcpyDtoH)(void*, CUdeviceptr, size_t);
	CUresult (*cuMemcpyDtoD)(CUdeviceptr, CUdeviceptr, size_t);
	CUresult (*cuIpcGetMemHandle)(CUipcMemHandle*, CUdeviceptr);
	CUresult (*cuIpcOpenMemHandle)(CUdeviceptr*, CUipcMemHandle, unsigned int);
	CUresult (*cuIpcCloseMemHandle)(CUdeviceptr);
	CUresult (*cuGetErrorString)(CUresult, const char**);
	// The batched copy (batch.go).
	CUresult (*cuModuleLoadData)(CUmodule*, const void*);
	CUresult (*cuModuleGetFunction)(CUfunction*, CUmodule, const char*);
	CUresult (*cuLaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream, void**, void**);
	CUresult (*cuStreamCreate)(CUstream*, unsigned);
	CUresult (*cuEventCreate)(CUevent*, unsigned);
	CUresult (*cuEventRecord)(CUevent, CUstream);
	CUresult (*cuEventQuery)(CUevent);
	CUresult (*cuEventSynchronize)(CUevent);
	CUresult (*cuEventDestroy)(CUevent);
	CUresult (*cuMemAllocHost)(void**, size_t);
	CUresult (*cuMemFreeHost)(void*);
	CUresult (*cuMemcpyHtoDAsync)(CUdeviceptr, const void*, size_t, CUstream);
	CUresult (*cuMemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
	CUresult (*cuStreamSynchronize)(CUstream);
	CUresult (*cuMemHostGetDevicePointer)(CUdeviceptr*, void*, unsigned int);
	CUresult (*cuMemGetAddressRange)(CUdeviceptr*, size_t*, CUdeviceptr);
	CUresult (*cuMemcpyDtoHAsync)(void*, CUdeviceptr, size_t, CUstream);
	CUresult (*cuDeviceGetAttribute)(int*, int, CUdevice); // optional: NULL where the driver lacks it
} cu;

#define CU_SYM(n, v) do { *(void**)(&cu.n) = dlsym(cu.lib, v); if (!cu.n) return v; } while (0)

static const char* cu_load(void) {
	if (cu.lib) return NULL;
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) return dlerror();
	cu.lib = lib;
	CU_SYM(cuInit, "cuInit"); CU_SYM(cuDeviceGetCount, "cuDeviceGetCount"); CU_SYM(cuDeviceGet, "cuDeviceGet");
	CU_SYM(cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"); CU_SYM(cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2");
	CU_SYM(cuCtxSetCurrent, "cuCtxSetCurrent"); CU_SYM(cuMemAlloc, "cuMemAlloc_v2"); CU_SYM(cuMemFree, "cuMemFree_v2");
	CU_SYM(cuMemcpyHtoD, "cuMemcpyHtoD_v2"); CU_SYM(cuMemcpyDtoH, "cuMemcpyDtoH_v2"); CU_SYM(cuMemcpyDtoD, "cuMemcpyDtoD_v2");
	CU_SYM(cuIpcGetMemHandle, "cuIpcGetMemHandle"); CU_SYM(cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2");
	CU_SYM(cuIpcCloseMemHandle, "cuIpcCloseMemHandle"); CU_SYM(cuGetErrorString, "cuGetErrorString");
	CU_SYM(cuModuleLoadData, "cuModuleLoadData"); CU_SYM(cuModuleGetFunction, "cuModuleGetFunction");
	CU_SYM(cuLaunchKernel, "cuLaunchKernel"); CU_SYM(cuStreamCreate, "cuStreamCreate");
	CU_SYM(cuEventCreate, "cuEventCreate"); CU_SYM(cuEventRecord, "cuEventRecord"); CU_SYM(cuEventQuery, "cuEventQuery");
	CU_SYM(cuEventSynchronize, "cuEventSynchronize"); CU_SYM(cuEventDestroy, "cuEventDestroy_v2");
	CU_SYM(cuMemAllocHost, "cuMemAllocHost_v2"); CU_SYM(cuMemFreeHost, "cuMemFreeHost");
	CU_SYM(cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"); CU_SYM(cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2");
	CU_SYM(cuStreamSynchronize, "cuStreamSynchronize");
	CU_SYM(cuMemHostGetDevicePointer, "cuMemHostGetDevicePointer_v2");
	CU_SYM(cuMemGetAddressRange, "cuMemGetAddressRange_v2");
	CU_SYM(cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2");
	// _v2 (CUDA 11.4+) reports a MIG instance's own UUID, as cuda-python
	// and CUDA 12+ headers do; on whole GPUs both versions agree.
	*(void**)(&cu.cuDeviceGetAttribute) = dlsym(cu.lib, "cuDeviceGetAttribute");
	*(void**)(&cu.cuDeviceGetUuid) = dlsym(cu.lib, "cuDeviceGetUuid_v2");
	if (!cu.cuDeviceGetUuid) CU_SYM(cuDeviceGetUuid, "cuDeviceGetUuid");
	return NULL;
}

static CUresult cu_init(void) { return cu.cuInit(0); }
static CUresult cu_count(int *n) { return cu.cuDeviceGetCount(n); }
static CUresult cu_ctx(int ordinal, CUcontext *ctx) {
	CUdevice d; CUresult r = cu.cuDeviceGet(&d, ordinal);
	if (r) return r;
	r = cu.cuDevicePrimaryCtxRetain(ctx, d);
	if (r) return r;
	return cu.cuCtxSetCurrent(*ctx);
}
// cu_sms is the device's number of multiprocessors (0: unknown).
static int cu_sms(int ordinal) {
	CUdevice d; int n = 0;
	if (!cu.cuDeviceGetAttribute || cu.cuDeviceGet(&d, ordinal)) return 0;
	if (cu.cuDeviceGetAttribute(&n, 16, d)) return 0; // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
	return n;
}
static CUresult cu_release(int ordinal) { CUdevice d; CUresult r = cu.cuDeviceGet(&d, ordinal); if (r) return r; return cu.cuDevicePrimaryCtxRelease(d); }
static CUresult cu_uuid(int ordinal, void *out16) {
	CUdevice d; CUuuid u; CUresult r = cu.cuDeviceGet(&d, ordinal);
	if (r) return r;
	r = cu.cuDeviceGetUuid(&u, d);
	if (!r) memcpy(out16, &u, 16);
	return r;
}
// cu_find_uuid sets *ordinal to the device with UUID want16, or -1; *n to
// the number of devices. One C call for the whole search.
static CUresult cu_find_uuid(const void *want16, int *ordinal, int *n) {
	*ordinal = -1;
	CUresult r = cu.cuDeviceGetCount(n);
	if (r) return r;
	for (int i = 0; i < *n; i++) {
		char u[16];
		r = cu_uuid(i, u);
		if (r) return r;
		if (memcmp(u, want16, 16) == 0) { *ordinal = i; return 0; }
	}
	return 0;
}
static CUresult cu_set(CUcontext ctx) { return cu.cuCtxSetCurrent(ctx); }
static CUresult cu_alloc(CUdeviceptr *p, size_t n) { return cu.cuMemAlloc(p, n); }
static CUresult cu_free(CUdeviceptr p) { return cu.cuMemFree(p); }
static CUresult cu_htod(CUdeviceptr d, const void *h, size_t n) { return cu.cuMemcpyHtoD(d, h, n); }
static CUresult cu_dtoh(void *h, CUdeviceptr d, size_t n) { return cu.cuMemcpyDtoH(h, d, n); }
// cu_dtod returns once the bytes landed: a device-to-device cuMemcpy
// returns to the host before it ran (the legacy stream it went on is
// synchronised).
static CUresult cu_dtod(CUdeviceptr d, CUdeviceptr s, size_t n) {
	CUresult r = cu.cuMemcpyDtoD(d, s, n);
	if (r) return r;
	return cu.cuStreamSynchronize(NULL);
}
static CUresult cu_ipc_get(void *out64, CUdeviceptr p) { CUipcMemHandle h; CUresult r = cu.cuIpcGetMemHandle(&h, p); if (!r) memcpy(out64, &h, 64); return r; }
static CUresult cu_ipc_open(CUdeviceptr *p, const void *in64) { CUipcMemHandle h; memcpy(&h, in64, 64); return cu.cuIpcOpenMemHandle(p, h, 1); }
static CUresult cu_ipc_close(CUdeviceptr p) { return cu.cuIpcCloseMemHandle(p); }
static CUresult cu_range(CUdeviceptr p, CUdeviceptr *base, size_t *size) { return cu.cuMemGetAddressRange(base, size, p); }
// The batched copy: the kernel loaded from its PTX image, a stream, and
// slots (pinned descriptors, their device copy, an event) posted whole.
static CUresult cu_module(CUcontext ctx, const void *image, CUfunction *f, CUfunction *gated) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	CUmodule m;
	r = cu.cuModuleLoadData(&m, image);
	if (r) return r;
	if ((r = cu.cuModuleGetFunction(f, m, "kvxfer_copy"))) return r;
	// Without the gated kernel the plain one still serves (no gates).
	if (cu.cuModuleGetFunction(gated, m, "kvxfer_copy_gated")) *gated = NULL;
	return 0;
}
static CUresult cu_stream(CUcontext ctx, CUstream *s) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	return cu.cuStreamCreate(s, 1); // CU_STREAM_NON_BLOCKING
}
// A slot's pinned memory is its words and then one more: the word a gated
// launch sets when its gate was shut (*shut: its address on the device).
static CUresult cu_slot_new(CUcontext ctx, size_t bytes, void **host, CUdeviceptr *dev, CUevent *ev, CUdeviceptr *shut) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	*host = NULL; *dev = 0; *ev = NULL; *shut = 0;
	if ((r = cu.cuMemAllocHost(host, bytes + 8))) return r;
	// No device address for it (not expected with unified addressing):
	// the slot takes no gated launch (Batch.Gate reports false).
	if (cu.cuMemHostGetDevicePointer(shut, *host, 0)) *shut = 0;
	else *shut += bytes;
	if ((r = cu.cuMemAlloc(dev, bytes))) { cu.cuMemFreeHost(*host); *host = NULL; return r; }
	if ((r = cu.cuEventCreate(ev, 2))) { // CU_EVENT_DISABLE_TIMING
		cu.cuMemFree(*dev); cu.cuMemFreeHost(*host); *dev = 0; *host = NULL; return r;
	}
	return 0;
}
static void cu_slot_free(CUcontext ctx, void *host, CUdeviceptr dev, CUevent ev) {
	if (cu.cuCtxSetCurrent(ctx)) return;
	cu.cuEventSynchronize(ev);
	cu.cuEventDestroy(ev); cu.cuMemFree(dev); cu.cuMemFreeHost(host);
}
// cu_post copies the words staged in host to dev, launches the kernel
// once per section (4 unsigned each: region word, regions, entry word,
// entries) and records ev behind the last, on stream s. With a gate (not
// 0) it launches the gated kernel (f is kvxfer_copy_gated) with gate,
// want and shut as its last arguments.
static CUresult cu_post(CUcontext ctx, CUstream s, CUfunction f, void *host, CUdeviceptr dev, size_t words,
		const unsigned *secs, unsigned nsec, unsigned long long maxgrid, CUevent ev,
		CUdeviceptr gate, unsigned want, CUdeviceptr shut) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	if ((r = cu.cuMemcpyHtoDAsync(dev, host, words * 8, s))) return r;
	for (unsigned i = 0; i < nsec; i++, secs += 4) {
		CUdeviceptr regions = dev + (CUdeviceptr)secs[0] * 8, entries = dev + (CUdeviceptr)secs[2] * 8;
		unsigned nreg = secs[1], nent = secs[3];
		unsigned long long pieces = (unsigned long long)nreg * nent;
		unsigned grid = (unsigned)(pieces < maxgrid ? pieces : maxgrid);
		if (grid == 0) continue;
		void *args[] = { &regions, &nreg, &entries, &nent, &gate, &want, &shut };
		if ((r = cu.cuLaunchKernel(f, grid, 1, 1, 256, 1, 1, 0, s, args, NULL))) return r;
	}
	return cu.cuEventRecord(ev, s);
}
// cu_post_each is the fallback: one asynchronous copy per piece.
static CUresult cu_post_each(CUcontext ctx, CUstream s, const unsigned long long *w, const unsigned *secs,
		unsigned nsec, CUevent ev) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	for (unsigned i = 0; i < nsec; i++, secs += 4) {
		const unsigned long long *g = w + secs[0];
		for (unsigned j = 0; j < secs[1]; j++, g += 2) {
			const unsigned long long *e = w + secs[2];
			for (unsigned k = 0; k < secs[3]; k++, e += 3) {
				if ((r = cu.cuMemcpyDtoDAsync(g[0] + e[0], g[1] + e[1], e[2], s))) return r;
			}
		}
	}
	return cu.cuEventRecord(ev, s);
}
// cu_side_copy copies n bytes to the device (toDevice) or from it on
// stream s (non-blocking: it waits for no other stream's work, the
// legacy default stream's included) and returns once they landed.
static CUresult cu_side_copy(CUcontext ctx, CUstream s, int toDevice, CUdeviceptr d, void *h, size_t n) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	r = toDevice ? cu.cuMemcpyHtoDAsync(d, h, n, s) : cu.cuMemcpyDtoHAsync(h, d, n, s);
	if (r) return r;
	return cu.cuStreamSynchronize(s);
}
// cu_drain returns once everything queued on stream s ran.
static CUresult cu_drain(CUcontext ctx, CUstream s) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	return cu.cuStreamSynchronize(s);
}
static CUresult cu_query(CUcontext ctx, CUevent ev) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	return cu.cuEventQuery(ev);
}
static CUresult cu_wait(CUcontext ctx, CUevent ev) {
	CUresult r = cu.cuCtxSetCurrent(ctx);
	if (r) return r;
	return cu.cuEventSynchronize(ev);
}
static const char* cu_err(CUresult r) { const char *s = NULL; if (cu.cuGetErrorString) cu.cuGetErrorString(r, &s); return s ? s : "unknown"; }
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

var loadOnce struct {
	sync.Once
	err error
}

func load() error {
	loadOnce.Do(func() {
		if msg := C.cu_load(); msg != nil {
			loadOnce.err = fmt.Errorf("%w: %s", ErrUnavailable, C.GoString(msg))
			return
		}
		if r := C.cu_init(); r != 0 {
			loadOnce.err = fmt.Errorf("%w: cuInit: %s", ErrUnavailable, C.GoString(C.cu_err(r)))
			return
		}
		var n C.int
		if r := C.cu_count(&n); r != 0 || n == 0 {
			loadOnce.err = fmt.Errorf("%w: no CUDA device", ErrUnavailable)
		}
	})
	return loadOnce.err
}

func check(op string, r C.CUresult) error {
	if r == 0 {
		return nil
	}
	return &Error{Op: op, Code: int(r), Msg: C.GoString(C.cu_err(r))}
}

// Device is one GPU's primary context. CUDA contexts are per OS thread:
// every method locks the goroutine to its thread and makes the context
// current for the call.
type Device struct {
	ordinal int
	ctx     C.CUcontext
	copier  copier // the batched copy (batch.go)
	// side is the stream of SideCopyIn and SideCopyOut (made on first
	// use).
	side struct {
		once sync.Once
		s    unsafe.Pointer
		err  error
	}
}

// Open retains device ordinal's primary context.
func Open(ordinal int) (*Device, error) {
	if err := load(); err != nil {
		return nil, err
	}
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	d := &Device{ordinal: ordinal}
	if err := check("retain context", C.cu_ctx(C.int(ordinal), &d.ctx)); err != nil {
		return nil, err
	}
	return d, nil
}

// OpenUUID retains the primary context of the device with UUID u (see
// OrdinalOf).
func OpenUUID(u [16]byte) (*Device, error) {
	ordinal, err := OrdinalOf(u)
	if err != nil {
		return nil, err
	}
	return Open(ordinal)
}

// OrdinalOf returns the ordinal, in this process, of the device with UUID
// u: an engine names its GPU by UUID because ordinals depend on each
// process's CUDA_VISIBLE_DEVICES. It wraps ErrNoDevice when no visible
// device has u.
func OrdinalOf(u [16]byte) (int, error) {
	if err := load(); err != nil {
		return 0, err
	}
	var ordinal, n C.int
	if err := check("find device by uuid", C.cu_find_uuid(unsafe.Pointer(&u[0]), &ordinal, &n)); err != nil {
		return 0, err
	}
	if ordinal < 0 {
		return 0, fmt.Errorf("%w: %s (%d devices visible)", ErrNoDevice, FormatUUID(u), int(n))
	}
	return int(ordinal), nil
}

// DeviceUUID returns the UUID of device ordinal (cuDeviceGetUuid).
func DeviceUUID(ordinal int) (u [16]byte, err error) {
	if err := load(); err != nil {
		return u, err
	}
	err = check("device uuid", C.cu_uuid(C.int(ordinal), unsafe.Pointer(&u[0])))
	return u, err
}

// Ordinal is the device's ordinal in this process.
func (d *Device) Ordinal() int { return d.ordinal }

// UUID returns the device's UUID.
func (d *Device) UUID() ([16]byte, error) { return DeviceUUID(d.ordinal) }

func (d *Device) do(f func() error) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	if err := check("set context", C.cu_set(d.ctx)); err != nil {
		return err
	}
	return f()
}

// Alloc allocates n bytes of device memory.
func (d *Device) Alloc(n int) (ptr uint64, err error) {
	err = d.do(func() error {
		var p C.CUdeviceptr
		e := check("alloc", C.cu_alloc(&p, C.size_t(n)))
		ptr = uint64(p)
		return e
	})
	return ptr, err
}

// Free frees device memory from Alloc.
func (d *Device) Free(ptr uint64) error {
	own.forget(ptr)
	return d.do(func() error { return check("free", C.cu_free(C.CUdeviceptr(ptr))) })
}

// CopyIn copies host bytes to device memory.
func (d *Device) CopyIn(dst uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	return d.do(func() error {
		return check("copy to device", C.cu_htod(C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
	})
}

// CopyOut copies device memory to host bytes.
func (d *Device) CopyOut(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return nil
	}
	return d.do(func() error {
		return check("copy to host", C.cu_dtoh(unsafe.Pointer(&dst[0]), C.CUdeviceptr(src), C.size_t(len(dst))))
	})
}

// CopyDevice copies n bytes between device addresses (imported ones
// included) and returns once they landed.
func (d *Device) CopyDevice(dst, src uint64, n int) error {
	return d.do(func() error {
		return check("copy device to device", C.cu_dtod(C.CUdeviceptr(dst), C.CUdeviceptr(src), C.size_t(n)))
	})
}

// Handle is a CUDA IPC memory handle: 64 opaque bytes an engine sends.
type Handle [64]byte

// Export returns the IPC handle of memory from Alloc.
func (d *Device) Export(ptr uint64) (h Handle, err error) {
	err = d.do(func() error {
		var buf [64]byte
		e := check("ipc get handle", C.cu_ipc_get(unsafe.Pointer(&buf[0]), C.CUdeviceptr(ptr)))
		h = buf
		return e
	})
	if err == nil {
		own.exported(h, ptr, d.ordinal)
	}
	return h, err
}

// Import maps another process's device memory from its IPC handle.
// Close it with Unmap on detach. A handle this process exported itself
// from this device is its own memory, at its own address: CUDA opens a
// handle only in another process (in its own, CUDA_ERROR_INVALID_CONTEXT),
// and two agents of one process (two in-process servers, two daemons'
// agents in a test) exchange them as any two peers do.
func (d *Device) Import(h Handle) (ptr uint64, err error) {
	if p, ok := own.open(h, d.ordinal); ok {
		return p, nil
	}
	err = d.do(func() error {
		var p C.CUdeviceptr
		buf := h
		e := check("ipc open handle", C.cu_ipc_open(&p, unsafe.Pointer(&buf[0])))
		ptr = uint64(p)
		return e
	})
	return ptr, err
}

// AllocSize returns the bytes of the allocation ptr lies in from ptr on
// (cuMemGetAddressRange): what an import of another process's handle
// really maps, whatever that process claims.
func (d *Device) AllocSize(ptr uint64) (n uint64, err error) {
	err = d.do(func() error {
		var base C.CUdeviceptr
		var size C.size_t
		if e := check("address range", C.cu_range(C.CUdeviceptr(ptr), &base, &size)); e != nil {
			return e
		}
		n = uint64(base) + uint64(size) - ptr
		return nil
	})
	return n, err
}

// SideCopyIn and SideCopyOut copy a few bytes to or from device memory on
// a stream of their own that waits for no other work of the process (not
// the legacy default stream's, which CopyIn and CopyOut wait for: in an
// engine's process, its queued kernels), and return once they landed.
// For the words a consumer stores and reads in its gates.
func (d *Device) SideCopyIn(dst uint64, src []byte) error {
	if len(src) == 0 {
		return nil
	}
	s, err := d.sideStream()
	if err != nil {
		return err
	}
	return check("copy to device", C.cu_side_copy(d.ctx, s, 1, C.CUdeviceptr(dst), unsafe.Pointer(&src[0]), C.size_t(len(src))))
}

// SideCopyOut: see SideCopyIn.
func (d *Device) SideCopyOut(dst []byte, src uint64) error {
	if len(dst) == 0 {
		return nil
	}
	s, err := d.sideStream()
	if err != nil {
		return err
	}
	return check("copy to host", C.cu_side_copy(d.ctx, s, 0, C.CUdeviceptr(src), unsafe.Pointer(&dst[0]), C.size_t(len(dst))))
}

func (d *Device) sideStream() (C.CUstream, error) {
	d.side.once.Do(func() {
		var s C.CUstream
		d.side.err = check("create stream", C.cu_stream(d.ctx, &s))
		d.side.s = unsafe.Pointer(s)
	})
	return C.CUstream(d.side.s), d.side.err
}

// Unmap closes imported memory.
func (d *Device) Unmap(ptr uint64) error {
	if own.close(ptr) {
		return nil
	}
	return d.do(func() error { return check("ipc close handle", C.cu_ipc_close(C.CUdeviceptr(ptr))) })
}

// Close releases the primary context.
func (d *Device) Close() error {
	return check("release context", C.cu_release(C.int(d.ordinal)))
}

// The batched copy's driver calls (batch.go holds the logic). Each is one
// C call that makes the context current itself: no thread is locked.

// errNotReady is cuEventQuery's "still running" (CUDA_ERROR_NOT_READY).
const errNotReady = 600

func (d *Device) loadKernel(image []byte) (fn, gated, stream unsafe.Pointer, err error) {
	cimg := C.CBytes(append(image[:len(image):len(image)], 0)) // NUL-terminated PTX
	defer C.free(cimg)
	var s C.CUstream
	if err := check("create stream", C.cu_stream(d.ctx, &s)); err != nil {
		return nil, nil, nil, err
	}
	var f, g C.CUfunction
	if err := check("load copy kernel", C.cu_module(d.ctx, cimg, &f, &g)); err != nil {
		return nil, nil, unsafe.Pointer(s), err
	}
	return unsafe.Pointer(f), unsafe.Pointer(g), unsafe.Pointer(s), nil
}

func (d *Device) newSlot(words int) (*slot, error) {
	var host unsafe.Pointer
	var dev C.CUdeviceptr
	var ev C.CUevent
	var shut C.CUdeviceptr
	if err := check("allocate copy descriptors", C.cu_slot_new(d.ctx, C.size_t(words*8), &host, &dev, &ev, &shut)); err != nil {
		return nil, err
	}
	all := unsafe.Slice((*uint64)(host), words+1)
	return &slot{words: all[:words:words], shut: (*uint32)(unsafe.Pointer(&all[words])), shutDev: uint64(shut),
		dev: uint64(dev), ev: unsafe.Pointer(ev)}, nil
}

func (d *Device) freeSlot(s *slot) {
	C.cu_slot_free(d.ctx, unsafe.Pointer(&s.words[0]), C.CUdeviceptr(s.dev), C.CUevent(s.ev))
}

// sms is the device's number of multiprocessors (0: the driver did not
// say).
func (d *Device) sms() int { return int(C.cu_sms(C.int(d.ordinal))) }

func (d *Device) launch(fn, stream unsafe.Pointer, s *slot, words int, grid uint64, g gateArgs) error {
	return check("launch copy kernel", C.cu_post(d.ctx, C.CUstream(stream), C.CUfunction(fn),
		unsafe.Pointer(&s.words[0]), C.CUdeviceptr(s.dev), C.size_t(words),
		(*C.uint)(unsafe.Pointer(&s.secs[0])), C.uint(len(s.secs)), C.ulonglong(grid), C.CUevent(s.ev),
		C.CUdeviceptr(g.gate), C.uint(g.want), C.CUdeviceptr(g.shut)))
}

// drain returns once everything queued on stream ran (its error, if
// the context failed).
func (d *Device) drain(stream unsafe.Pointer) error {
	return check("synchronize stream", C.cu_drain(d.ctx, C.CUstream(stream)))
}

func (d *Device) launchEach(stream unsafe.Pointer, s *slot) error {
	return check("post copies", C.cu_post_each(d.ctx, C.CUstream(stream), (*C.ulonglong)(unsafe.Pointer(&s.words[0])),
		(*C.uint)(unsafe.Pointer(&s.secs[0])), C.uint(len(s.secs)), C.CUevent(s.ev)))
}

// query reports whether s's work ended (and how).
func (d *Device) query(s *slot) (bool, error) {
	r := C.cu_query(d.ctx, C.CUevent(s.ev))
	if r == errNotReady {
		return false, nil
	}
	return true, check("copy", r)
}

func (d *Device) wait(s *slot) error {
	return check("copy", C.cu_wait(d.ctx, C.CUevent(s.ev)))
}
