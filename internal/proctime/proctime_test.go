package proctime

import "testing"

// Work on the CPU shows in CPU.
func TestCPUGrows(t *testing.T) {
	c0 := CPU()
	x := 0
	for i := range 50_000_000 {
		x += i ^ (x >> 3)
	}
	if CPU() <= c0 {
		t.Errorf("CPU did not grow over a busy loop (%d)", x)
	}
}
