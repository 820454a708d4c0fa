package netxfer

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"
)

// A gate's end waits for the producer's CTAs inside it unless the
// producer's process is gone; it tells by the process id the same-host
// connection's peer credentials give. A producer in a PID namespace the
// consumer cannot see (containers of one pod: one network namespace,
// a PID namespace each) has id 0 there, which reads as gone: the grant's
// end would return, and clear the counts, while the producer's launch
// still writes the blocks. Such a peer gets no gate: its WRITEs go the
// two-sided way, where the consumer copies them itself.
//
// The consumer runs in a child process in a PID namespace of its own
// (the test process, the producer, is outside it: unseen from there).
func TestGateProducerPIDUnseen(t *testing.T) {
	if os.Getenv("NETXFER_GATE_PEER") != "" {
		return
	}
	p, err := New(Config{Name: fmt.Sprintf("%s-p-%d", t.Name(), rand.Uint64()), DisableLocal: true})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = p.Close() })
	cmd := exec.Command(os.Args[0], "-test.run=^TestGateProducerPIDUnseenChild$", "-test.count=1")
	cmd.Env = append(os.Environ(), "NETXFER_GATE_PEER="+string(p.Metadata()))
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWPID}
	done := make(chan struct{})
	var out []byte
	go func() {
		defer close(done)
		out, err = cmd.CombinedOutput()
	}()
	select {
	case <-done:
	case <-time.After(60 * time.Second):
		_ = cmd.Process.Kill()
		<-done
		t.Fatalf("the consumer's process ran 60 s: %s", out)
	}
	if cmd.Process == nil { // not started: no PID namespace for it (not root)
		t.Skipf("no PID namespace for the consumer: %v", err)
	}
	got := string(out)
	if !strings.Contains(got, "gate: refused\n") {
		t.Fatalf("consumer in another PID namespace (err %v):\n%s", err, got)
	}
}

// TestGateProducerPIDUnseenChild is TestGateProducerPIDUnseen's consumer.
func TestGateProducerPIDUnseenChild(t *testing.T) {
	meta, ok := os.LookupEnv("NETXFER_GATE_PEER")
	if !ok {
		return // only as TestGateProducerPIDUnseen's child
	}
	g := newFakeGPU()
	d := newGateGPU(g)
	uuid := [16]byte{0xdb}
	dd, err := New(Config{DisableLocal: true, Devices: func(u [16]byte) (Device, error) {
		if u == uuid {
			return d, nil
		}
		return nil, fmt.Errorf("no GPU %x here", u)
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer dd.Close()
	ptr, h, _ := d.alloc(1 << 20)
	if err := dd.MapDevice(ptr, 1<<20, d, uuid, h); err != nil {
		t.Fatal(err)
	}
	if err := dd.Register([]Region{{ptr, 1 << 20}}); err != nil {
		t.Fatal(err)
	}
	f := newGateFence()
	if err := dd.SetGuard(f); err != nil {
		t.Fatal(err)
	}
	name, err := dd.LoadPeer([]byte(meta))
	if err != nil {
		t.Fatal(err)
	}
	err = dd.OpenGate(name, []LayoutSpan{{Bases: []uint64{ptr}, Entries: []Region{{0, 4096}}}}, []byte("req-1"))
	if errors.Is(err, ErrNoGate) {
		fmt.Println("gate: refused")
		return
	}
	if err != nil {
		fmt.Println("gate:", err)
		return
	}
	// A gate: a CTA of the producer's launch is inside it (the producer
	// runs); the grant's end must wait for it.
	st := &dd.gates
	st.mu.Lock()
	var gt *gate
	for x := range st.open {
		gt = x
	}
	at := gt.area.ptr + uint64(gt.slot)*GateSize
	pid := gt.pid
	st.mu.Unlock()
	one := make([]byte, 4)
	binary.LittleEndian.PutUint32(one, 1)
	if err := d.CopyIn(at+gateActiveOff+8, one); err != nil {
		t.Fatal(err)
	}
	ended := make(chan struct{})
	go func() {
		f.revoke()
		close(ended)
	}()
	select {
	case <-ended:
		fmt.Printf("gate: opened (producer pid %d seen here); the grant's end returned with the live producer's CTA inside the gate\n", pid)
	case <-time.After(time.Second):
		fmt.Printf("gate: opened (producer pid %d seen here); the grant's end waited for the CTA\n", pid)
		_ = d.CopyIn(at+gateActiveOff+8, make([]byte, 4)) // the CTA leaves
		<-ended
	}
}
