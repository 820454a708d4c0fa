package kvxfer_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// The core's per-request bookkeeping that needs no allocation makes none:
// timers armed and fired (no entry boxed through container/heap), and
// outcomes drained into lists the caller reuses (Finished.Clear).
func TestCoreZeroAllocs(t *testing.T) {
	if raceEnabled {
		t.Skip("allocation counts are not meaningful under -race")
	}
	timers := kvxfer.ArmAndFireForTest()
	timers(256)
	if n := testing.AllocsPerRun(10, func() { timers(256) }); n != 0 {
		t.Errorf("256 timers armed and fired: %v allocations, want 0", n)
	}
	var f kvxfer.Finished
	outcomes := make([]kvxfer.Outcome, 256)
	drain := func() {
		f.Sending = append(f.Sending, outcomes...)
		f.Recving = append(f.Recving, outcomes...)
		f.Clear()
	}
	drain()
	if n := testing.AllocsPerRun(10, drain); n != 0 {
		t.Errorf("256 outcomes a side appended and cleared: %v allocations, want 0", n)
	}
	big := kvxfer.Finished{Sending: make([]kvxfer.Outcome, 5000)}
	if big.Clear(); big.Sending != nil {
		t.Errorf("Clear kept a list of %d outcomes, want it dropped past 4096", cap(big.Sending))
	}
}
