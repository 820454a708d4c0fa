package cuda

// Tests of internal/cuda's own logic that need no driver.

import (
	"errors"
	"testing"
)

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

// gatesWork's verdicts (no driver needed: the check is replaced): a check
// that could not run says no and runs again next time; a launch that
// misbehaved turns the device's gates off for good, counted once; a
// check that passed is not run again.
func TestGatesWorkVerdicts(t *testing.T) {
	saved := checkGates
	t.Cleanup(func() { checkGates = saved })
	var runs int
	var next error
	checkGates = func(*Device) error { runs++; return next }

	d := &Device{}
	next = errors.New("cuda: alloc: out of memory")
	first, second := d.gatesWork(), d.gatesWork()
	if first || second || runs != 2 {
		t.Fatalf("a check that could not run: gates on, or not run again (%d runs)", runs)
	}
	before := GateCheckFailures()
	next = faultf("a gated launch through a gate open true reported shut true")
	first, second = d.gatesWork(), d.gatesWork()
	if first || second || runs != 3 || GateCheckFailures() != before+1 {
		t.Fatalf("a misbehaving launch: gates on, checked again, or not counted once (%d runs, %d failures)", runs, GateCheckFailures()-before)
	}

	d, runs, next = &Device{}, 0, nil
	first, second = d.gatesWork(), d.gatesWork()
	if !first || !second || runs != 1 {
		t.Fatalf("a check that passed: gates off, or checked again (%d runs)", runs)
	}
}

// A gated launch has as many CTAs as the device holds at once, never
// more than a launch takes, and a bounded number where the driver did
// not say.
func TestGatedGrid(t *testing.T) {
	for _, c := range []struct {
		sms  int
		want uint64
	}{{132, 1056}, {2, 16}, {0, gatedGridUnknown}, {-1, gatedGridUnknown}, {1 << 20, maxGrid}} {
		if got := gatedGrid(c.sms); got != c.want {
			t.Errorf("gatedGrid(%d) = %d, want %d", c.sms, got, c.want)
		}
	}
}
