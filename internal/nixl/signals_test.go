package nixl

import (
	"os"
	"os/signal"
	"syscall"
	"testing"
	"time"
)

// Making an agent leaves the process's signal handlers as they were: UCX
// installs its debug handler on SIGHUP when it loads, which took an
// engine's own SIGHUP (python/tests/test_inprocess_signals.py found it);
// the shim puts such handlers back, and counts it.
func TestAgentKeepsTheProcessSignalHandlers(t *testing.T) {
	ch := make(chan os.Signal, 4)
	signal.Notify(ch, syscall.SIGHUP, syscall.SIGUSR1)
	defer signal.Stop(ch)
	a, err := Open("signals", "UCX", nil)
	if err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
	defer a.Close()
	for _, sig := range []syscall.Signal{syscall.SIGHUP, syscall.SIGUSR1} {
		if err := syscall.Kill(os.Getpid(), sig); err != nil {
			t.Fatal(err)
		}
		select {
		case got := <-ch:
			if got != sig {
				t.Errorf("got %v, want %v", got, sig)
			}
		case <-time.After(5 * time.Second):
			t.Fatalf("%v did not reach the process's own handler after an agent was made (restored: %v)", sig, RestoredSignals())
		}
	}
	t.Logf("handlers put back after the agent was made: %v", RestoredSignals())
}
