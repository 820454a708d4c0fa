package cuda

import "sync"

// own is what this process exported (Device.Export): its handles, by
// handle, and how many Imports of them are not yet Unmapped. Import gives
// such a handle back as the memory itself (CUDA will not open it here).
var own ownHandles

type ownHandles struct {
	mu   sync.Mutex
	ptrs map[Handle]uint64
	refs map[uint64]int
}

// exported records that h is ptr's handle.
func (o *ownHandles) exported(h Handle, ptr uint64) {
	o.mu.Lock()
	defer o.mu.Unlock()
	if o.ptrs == nil {
		o.ptrs, o.refs = map[Handle]uint64{}, map[uint64]int{}
	}
	o.ptrs[h] = ptr
}

// open returns the memory h is the handle of, counted, if this process
// exported it.
func (o *ownHandles) open(h Handle) (uint64, bool) {
	o.mu.Lock()
	defer o.mu.Unlock()
	ptr, ok := o.ptrs[h]
	if ok {
		o.refs[ptr]++
	}
	return ptr, ok
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
	for h, p := range o.ptrs {
		if p == ptr {
			delete(o.ptrs, h)
		}
	}
	delete(o.refs, ptr)
}
