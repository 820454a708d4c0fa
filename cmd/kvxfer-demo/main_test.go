package main

import (
	"os"
	"testing"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
)

// TestMain lets the demo start this test binary as its daemons.
func TestMain(m *testing.M) {
	daemontest.ServeIfChild()
	os.Exit(m.Run())
}

// The README's run command: a P and a D daemon as processes, simulated
// engines, bytes verified.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	if err := run([]string{"-requests", "30"}); err != nil {
		t.Fatal(err)
	}
}

// The demo with the NIXL backend between the two daemons (skips where
// NIXL is not installed).
func TestDemoNixl(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	if _, err := daemon.NixlLibrary(); err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
	if err := run([]string{"-requests", "20", "-backend", "nixl"}); err != nil {
		t.Fatal(err)
	}
}
