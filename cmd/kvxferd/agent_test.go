package main

import (
	"os"
	"os/exec"
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// agentHarness runs every agent as `kvxferd agent` (this test binary,
// through TestMain) with the backend flags, in a child process whose
// environment is the test's plus env (which wins).
func agentHarness(env []string, args ...string) kvxfertest.ProcessHarness {
	return kvxfertest.ProcessHarness{Command: func() *exec.Cmd {
		cmd := exec.Command(os.Args[0], append([]string{"agent"}, args...)...)
		cmd.Env = append(os.Environ(), env...)
		return cmd
	}}
}

func skipWithoutNixl(t *testing.T) {
	t.Helper()
	if _, err := nixlLibrary(); err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
}

// The conformance suite between two kvxferd processes, neither the
// test's: the built-in backend over loopback TCP.
func TestConformanceProcessBuiltinTCP(t *testing.T) {
	kvxfertest.Conformance(t, agentHarness(nil, "-backend", "builtin"))
}

// NIXL between two kvxferd processes, UCX over TCP (UCX's default error
// handling: peer failures are reported).
func TestConformanceProcessNixlTCP(t *testing.T) {
	skipWithoutNixl(t)
	kvxfertest.Conformance(t, agentHarness([]string{"UCX_TLS=tcp"}, "-backend", "nixl"))
}

// NIXL between two kvxferd processes, UCX over shared memory: UCX's
// shared-memory transports need ucx_error_handling_mode=none.
func TestConformanceProcessNixlShm(t *testing.T) {
	skipWithoutNixl(t)
	kvxfertest.Conformance(t, agentHarness([]string{"UCX_TLS=sm"}, "-backend", "nixl", "-nixl-params", "ucx_error_handling_mode=none"))
}
