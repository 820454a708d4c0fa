//go:build !cgo

package cuda

// Allocation reports ErrUnavailable (addr.go without cgo).
func (d *Device) Allocation(uint64) (base, size uint64, err error) { return 0, 0, ErrUnavailable }
