package cuda

import "testing"

// The registry of this process's own handles (no driver needed): an
// Import on the exporting device is the memory, counted; on another
// device, or once the memory is freed, it is the driver's.
func TestOwnHandles(t *testing.T) {
	var o ownHandles
	h := Handle{1, 2, 3}
	if _, ok := o.open(h, 0); ok {
		t.Fatal("a handle never exported opened as our own")
	}
	o.exported(h, 0x1000, 0)
	if _, ok := o.open(h, 1); ok {
		t.Fatal("our own handle opened on another device (it needs the driver's peer mapping)")
	}
	for range 2 {
		if p, ok := o.open(h, 0); !ok || p != 0x1000 {
			t.Fatalf("open = %#x, %v; want 0x1000", p, ok)
		}
	}
	for i := range 2 {
		if !o.close(0x1000) {
			t.Fatalf("close %d of two opens: not ours", i)
		}
	}
	if o.close(0x1000) {
		t.Fatal("a third close of two opens was taken as ours (it must go to the driver)")
	}
	o.open(h, 0)
	o.forget(0x1000)
	if _, ok := o.open(h, 0); ok || o.close(0x1000) {
		t.Fatal("freed memory's handle still opens (or closes) as our own")
	}
}
