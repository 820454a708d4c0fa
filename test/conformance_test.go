package test

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// The backend conformance suite between two processes: every agent runs
// as this test binary re-executed (TestMain serves it).

// agentHarness runs every agent as this test binary re-executed
// (kvxfertest.AgentCommand) with the backend flags, in a child process
// whose environment is the test's plus env (which wins). UCX may use the
// loopback device only (UCX_NET_DEVICES=lo): with UCX_TLS=tcp it would
// otherwise also send over the host's own address on eth0.
//
// UCX's memory hooks are off in the agents (UCX_MEM_MMAP_HOOK_MODE=none,
// unless the test's environment sets it): installing them costs about
// 0.4 s per process, which is most of an agent's start, and they only
// tell UCX's registration cache about memory being unmapped, which these
// agents never do while they live. The in-process NIXL tests
// (kvxfer.TestConformanceNixl*) keep UCX's defaults.
func agentHarness(env []string, args ...string) kvxfertest.ProcessHarness {
	return kvxfertest.ProcessHarness{Command: func() *exec.Cmd {
		cmd := kvxfertest.AgentCommand(args...)
		cmd.Env = append(append([]string{"UCX_MEM_MMAP_HOOK_MODE=none"}, os.Environ()...), "UCX_NET_DEVICES=lo")
		cmd.Env = append(cmd.Env, env...)
		return cmd
	}}
}

// skipWithoutNixl skips where NIXL's library cannot be loaded. The probe
// agent runs without UCX's peer-failure handling, so that whatever
// UCX_TLS the test's environment sets (the agents get their own) it
// starts.
func skipWithoutNixl(t *testing.T) {
	t.Helper()
	b, err := nixl.New(nixl.Config{Name: fmt.Sprintf("kvxfertest-probe-%d", time.Now().UnixNano()),
		Params: map[string]string{"ucx_error_handling_mode": "none"}})
	if errors.Is(err, nixl.ErrUnavailable) {
		t.Skipf("NIXL is not available here: %v", err)
	}
	if err != nil {
		t.Fatalf("NIXL is here but an agent does not start: %v", err)
	}
	_ = b.Close()
}

// The conformance suite between two agent processes, neither the test's:
// the built-in backend over loopback TCP.
func TestConformanceProcessBuiltinTCP(t *testing.T) {
	kvxfertest.Conformance(t, agentHarness(nil, "-backend", "builtin"))
}

// The same suite over the built-in backend's same-host path: each agent
// adopts its shared-memory file (MapFile), so a WRITE is copied by the
// receiving process straight out of the sender's file.
func TestConformanceProcessBuiltinSameHost(t *testing.T) {
	kvxfertest.Conformance(t, agentHarness(nil, "-backend", "builtin", "-same-host"))
}

// The same-host path is what moved the bytes between the two processes,
// and the bytes are right.
func TestSameHostProcess(t *testing.T) {
	h := agentHarness(nil, "-backend", "builtin", "-same-host")
	const size = 1 << 20
	a, b := h.Start(t, size), h.Start(t, size)
	for _, x := range []*kvxfertest.ProcAgent{a, b} {
		if err := x.Register([]kvxfer.MemRegion{x.Info().Region}); err != nil {
			t.Fatal(err)
		}
	}
	meta, err := b.LocalMetadata()
	if err != nil {
		t.Fatal(err)
	}
	peer, err := a.LoadPeer(meta)
	if err != nil {
		t.Fatal(err)
	}
	for i := range a.Mem {
		a.Mem[i] = byte(i*7 + i>>9)
	}
	ar, br := a.Info().Region, b.Info().Region
	var descs []hotpath.Desc
	for off := uint64(0); off+1024 <= size; off += 2048 {
		descs = append(descs, hotpath.Desc{Local: ar.Addr + off, Remote: br.Addr + off + 1024, Len: 1024})
	}
	id, err := a.Post(hotpath.OpWrite, peer, descs, []byte("done"))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		s, err := a.State(id)
		if s == kvxfer.XferDone {
			break
		}
		if s != kvxfer.XferInProgress || time.Now().After(deadline) {
			t.Fatalf("WRITE: %v, %v", s, err)
		}
		select {
		case <-a.Events():
		case <-time.After(10 * time.Millisecond):
		}
	}
	for off := 0; off+1024 <= size; off += 2048 {
		if !bytes.Equal(a.Mem[off:off+1024], b.Mem[off+1024:off+2048]) {
			t.Fatalf("piece at %d differs", off)
		}
	}
	if n, err := b.SameHostParts(); err != nil || n == 0 {
		t.Fatalf("same-host parts at the receiver: %d, %v; want the WRITE's parts", n, err)
	}
}

// NIXL between two agent processes, UCX over TCP (UCX's default error
// handling: peer failures are reported).
func TestConformanceProcessNixlTCP(t *testing.T) {
	skipWithoutNixl(t)
	kvxfertest.Conformance(t, agentHarness([]string{"UCX_TLS=tcp"}, "-backend", "nixl"))
}

// NIXL between two agent processes, UCX over shared memory: UCX's
// shared-memory transports need ucx_error_handling_mode=none.
func TestConformanceProcessNixlShm(t *testing.T) {
	skipWithoutNixl(t)
	kvxfertest.Conformance(t, agentHarness([]string{"UCX_TLS=sm"}, "-backend", "nixl", "-nixl-params", "ucx_error_handling_mode=none"))
}

// A peer process killed (SIGKILL, no goodbye): transfers and
// notifications to it fail instead of hanging or vanishing. Over UCX's
// shared-memory FIFOs alone (posix) nothing in UCX notices the death; the
// NIXL backend's own peer watch does (kvxfer/backend/nixl/peer.go).
func TestPeerKilledProcess(t *testing.T) {
	for _, v := range []struct {
		name string
		nixl bool
		env  []string
		args []string
		hang string // why the survivor's Close is known to hang
	}{
		{name: "builtin-tcp", args: []string{"-backend", "builtin"}},
		{name: "builtin-same-host", args: []string{"-backend", "builtin", "-same-host"}},
		{name: "nixl-ucx-tcp", nixl: true, env: []string{"UCX_TLS=tcp"}, args: []string{"-backend", "nixl"}},
		{name: "nixl-ucx-sm", nixl: true, env: []string{"UCX_TLS=sm"}, args: []string{"-backend", "nixl", "-nixl-params", "ucx_error_handling_mode=none"}},
		{name: "nixl-ucx-posix", nixl: true, env: []string{"UCX_TLS=posix"}, args: []string{"-backend", "nixl", "-nixl-params", "ucx_error_handling_mode=none"},
			hang: "NIXL 1.5.1/UCX 1.23: with a request to the dead peer stuck in UCX's shared-memory FIFO, destroying the agent joins NIXL's UCX progress thread, which spins in ucp_worker_arm forever (bench/RESULTS.md)"},
	} {
		t.Run(v.name, func(t *testing.T) {
			if v.nixl {
				skipWithoutNixl(t)
			}
			h := agentHarness(v.env, v.args...)
			h.CloseHangsAfterCrash = v.hang
			kvxfertest.PeerKilled(t, h)
		})
	}
}
