package netxfer

import (
	"os"
	"os/exec"
	"testing"
)

// A producer that died with CTAs counted in a gate, whose process id
// another process then took (ids are reused), is still gone: the grant's
// end stops waiting and clears the counts. Before, the gate knew its
// producer only by the id, found a live process under it, and waited for
// ever (the consumer's request never ended, its blocks never went back).
func TestGateProducerPIDReused(t *testing.T) {
	s := newGateSetup(t, Config{}, Config{})
	s.open(t, "req-1")
	st := &s.dd.gates
	st.mu.Lock()
	var g *gate
	for x := range st.open {
		g = x
	}
	st.mu.Unlock()
	// The producer: a process of its own, gone (and reaped) once the
	// gate knows it.
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Skipf("no process to outlive: %v", err)
	}
	proc, err := os.FindProcess(cmd.Process.Pid)
	if err != nil {
		t.Fatal(err)
	}
	st.mu.Lock()
	_ = g.proc.Release()
	g.pid, g.proc = cmd.Process.Pid, proc
	st.mu.Unlock()
	_ = cmd.Process.Kill()
	_ = cmd.Wait()
	// Its id now names another, live process.
	st.mu.Lock()
	g.pid = os.Getpid()
	at := g.area.ptr + uint64(g.slot)*GateSize
	st.mu.Unlock()
	revokeDeadCTA(t, s, at, " (its process id reused)")
}
