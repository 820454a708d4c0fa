package main

import (
	"errors"
	"flag"
	"os"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/daemon"
)

// TestMain lets the demo start this test binary as its daemons.
func TestMain(m *testing.M) {
	daemon.ServeIfChild()
	os.Exit(m.Run())
}

// The README's run command: a P and a D daemon as processes, simulated
// engines, bytes verified.
func TestDemo(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	if err := demoMain([]string{"-requests", "30"}); err != nil {
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
	if err := demoMain([]string{"-requests", "20", "-backend", "nixl"}); err != nil {
		t.Fatal(err)
	}
}

// `kvxferd proxy` refuses bad flags naming the flag; -h is not an error
// for main (it printed the usage).
func TestProxyFlags(t *testing.T) {
	for _, tc := range []struct {
		name string
		args []string
		want string // "" means flag.ErrHelp
	}{
		{"help", []string{"proxy", "-h"}, ""},
		{"bad mode", []string{"proxy", "-mode", "sideways"}, `proxy: invalid value "sideways" for flag -mode: want push or pull`},
		{"no servers", []string{"proxy"}, "proxy: -prefill: no P server given"},
		{"push without kv", []string{"proxy", "-prefill", "http://p:1,engine=e", "-decode", "http://d:2"}, `proxy: -prefill "http://p:1,engine=e": kv=HOST:PORT`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := run(tc.args)
			if tc.want == "" {
				if !errors.Is(err, flag.ErrHelp) {
					t.Errorf("run(%q) = %v, want flag.ErrHelp", tc.args, err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("run(%q) = %v, want an error containing %q", tc.args, err, tc.want)
			}
		})
	}
}
