//go:build cgo

package cuda

// Memory named by its address in this process (the in-process placement):
// which allocation holds a device pointer, and on which device. The entry
// points are looked up here, beside cuda.go's, so that this file changes
// nothing there. Nothing here allocates or frees memory.

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stddef.h>

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

static CUresult (*cua_range)(CUdeviceptr*, size_t*, CUdeviceptr);
static CUresult (*cua_attr)(void*, int, CUdeviceptr);

static const char* cua_load(void) {
	void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD);
	if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) return dlerror();
	*(void**)(&cua_range) = dlsym(lib, "cuMemGetAddressRange_v2");
	if (!cua_range) return "cuMemGetAddressRange_v2";
	*(void**)(&cua_attr) = dlsym(lib, "cuPointerGetAttribute");
	if (!cua_attr) return "cuPointerGetAttribute";
	return NULL;
}

// CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2), CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (9).
static CUresult cua_kind(CUdeviceptr p, unsigned int *memType, int *ordinal) {
	CUresult r = cua_attr(memType, 2, p);
	if (r) return r;
	return cua_attr(ordinal, 9, p);
}
static CUresult cua_alloc_range(CUdeviceptr p, CUdeviceptr *base, size_t *size) { return cua_range(base, size, p); }
*/
import "C"

import (
	"fmt"
	"sync"
)

var addrOnce struct {
	sync.Once
	err error
}

func loadAddr() error {
	if err := load(); err != nil {
		return err
	}
	addrOnce.Do(func() {
		if msg := C.cua_load(); msg != nil {
			addrOnce.err = fmt.Errorf("%w: %s", ErrUnavailable, C.GoString(msg))
		}
	})
	return addrOnce.err
}

// cuMemorytypeDevice is CU_MEMORYTYPE_DEVICE.
const cuMemorytypeDevice = 2

// Allocation returns the device allocation holding ptr, a device address
// of this process: its base and size (cuMemGetAddressRange). It is an
// error when ptr is not device memory of d's GPU (cuPointerGetAttribute):
// host memory, another GPU's, or no memory at all.
func (d *Device) Allocation(ptr uint64) (base, size uint64, err error) {
	if err := loadAddr(); err != nil {
		return 0, 0, err
	}
	err = d.do(func() error {
		var kind C.uint
		var ordinal C.int
		if err := check("pointer attributes", C.cua_kind(C.CUdeviceptr(ptr), &kind, &ordinal)); err != nil {
			return err
		}
		if kind != cuMemorytypeDevice {
			return fmt.Errorf("cuda: %#x is not device memory (memory type %d)", ptr, kind)
		}
		if int(ordinal) != d.ordinal {
			return fmt.Errorf("cuda: %#x is memory of device %d, not %d", ptr, ordinal, d.ordinal)
		}
		var b C.CUdeviceptr
		var n C.size_t
		if err := check("address range", C.cua_alloc_range(C.CUdeviceptr(ptr), &b, &n)); err != nil {
			return err
		}
		base, size = uint64(b), uint64(n)
		return nil
	})
	return base, size, err
}
