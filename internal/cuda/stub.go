//go:build !cgo

package cuda

import "unsafe"

// Without cgo there is no driver: every entry point reports
// ErrUnavailable.

// Device is unavailable without cgo.
type Device struct {
	ordinal int
	copier  copier
}

// Handle is a CUDA IPC memory handle.
type Handle [64]byte

// Open reports ErrUnavailable.
func Open(int) (*Device, error) { return nil, ErrUnavailable }

// OpenUUID reports ErrUnavailable.
func OpenUUID([16]byte) (*Device, error) { return nil, ErrUnavailable }

// OrdinalOf reports ErrUnavailable.
func OrdinalOf([16]byte) (int, error) { return 0, ErrUnavailable }

// DeviceUUID reports ErrUnavailable.
func DeviceUUID(int) ([16]byte, error) { return [16]byte{}, ErrUnavailable }

func (d *Device) Ordinal() int                         { return 0 }
func (d *Device) UUID() ([16]byte, error)              { return [16]byte{}, ErrUnavailable }
func (d *Device) Alloc(int) (uint64, error)            { return 0, ErrUnavailable }
func (d *Device) Free(uint64) error                    { return ErrUnavailable }
func (d *Device) CopyIn(uint64, []byte) error          { return ErrUnavailable }
func (d *Device) CopyOut([]byte, uint64) error         { return ErrUnavailable }
func (d *Device) CopyDevice(uint64, uint64, int) error { return ErrUnavailable }
func (d *Device) Export(uint64) (Handle, error)        { return Handle{}, ErrUnavailable }
func (d *Device) Import(Handle) (uint64, error)        { return 0, ErrUnavailable }
func (d *Device) Unmap(uint64) error                   { return ErrUnavailable }
func (d *Device) AllocSize(uint64) (uint64, error)     { return 0, ErrUnavailable }
func (d *Device) SideCopyIn(uint64, []byte) error      { return ErrUnavailable }
func (d *Device) SideCopyOut([]byte, uint64) error     { return ErrUnavailable }
func (d *Device) Close() error                         { return nil }

func (d *Device) loadKernel([]byte) (fn, gated, stream unsafe.Pointer, err error) {
	return nil, nil, nil, ErrUnavailable
}
func (d *Device) newSlot(int) (*slot, error) { return nil, ErrUnavailable }
func (d *Device) freeSlot(*slot)             {}
func (d *Device) sms() int                   { return 0 }
func (d *Device) launch(_, _ unsafe.Pointer, _ *slot, _ int, _ uint64, _ gateArgs) error {
	return ErrUnavailable
}
func (d *Device) launchEach(unsafe.Pointer, *slot) error { return ErrUnavailable }
func (d *Device) drain(unsafe.Pointer) error             { return ErrUnavailable }
func (d *Device) query(*slot) (bool, error)              { return true, ErrUnavailable }
func (d *Device) wait(*slot) error                       { return ErrUnavailable }
