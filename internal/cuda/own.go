package cuda

import "sync"

// own is what this process exported (Device.Export): its handles, by
// handle, with the memory and the device each is of, and how many Imports
// of them are not yet Unmapped. Import on the same device gives such a
// handle back as the memory itself (CUDA will not open it here). On
// another device it goes to the driver, which refuses it: the memory
// itself would need peer access enabled there, which an IPC import
// enables and this does not.
var own ownHandles

type ownHandles struct {
	mu   sync.Mutex
	ptrs map[Handle]ownMemory
	refs map[uint64]int
}

type ownMemory struct {
	ptr     uint64
	ordinal int
}

// exported records that h is the handle of ptr, memory of device ordinal.
func (o *ownHandles) exported(h Handle, ptr uint64, ordinal int) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ptrs == nil {
		o.ptrs, o.refs = map[Handle]ownMemory{}, map[uint64]int{}
	}
	o.ptrs[h] = ownMemory{ptr, ordinal}
}

// open returns the memory h is the handle of, counted, if this process
// exported it from device ordinal.
func (o *ownHandles) open(h Handle, ordinal int) (uint64, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	m, ok := o.ptrs[h]
	if !ok || m.ordinal != ordinal {
		return 0, false
	}
	o.refs[m.ptr]++
	return m.ptr, true
}

// close reports whether ptr is this process's own memory opened by
// Import (and counts that open closed): Unmap then has nothing to close.
func (o *ownHandles) close(ptr uint64) bool {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.refs[ptr] == 0 {
		return false
	}
	if o.refs[ptr]--; o.refs[ptr] == 0 {
		delete(o.refs, ptr)
	}
	return true
}

// forget drops ptr's handles (ptr is being freed): a later Import of
// one of them goes to the driver, which refuses it as it refuses any
// handle of freed memory.
func (o *ownHandles) forget(ptr uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	for h, m := range o.ptrs {
		if m.ptr == ptr {
			delete(o.ptrs, h)
		}
	}
	delete(o.refs, ptr)
}
