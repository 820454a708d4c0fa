package main

import (
	"errors"
	"flag"
	"strings"
	"testing"
)

// kvxferd links no simulator and no test agent: `kvxferd demo` names the
// demo's own command, and the test agent is no command of kvxferd's.
func TestDemoAndAgentAreNotHere(t *testing.T) {
	if err := run([]string{"demo", "-requests", "30"}); err == nil || !strings.Contains(err.Error(), "go run ./cmd/kvxfer-demo") {
		t.Errorf("run(demo) = %v, want an error naming go run ./cmd/kvxfer-demo", err)
	}
	if err := run([]string{"agent"}); err == nil || !strings.Contains(err.Error(), `unknown command "agent"`) {
		t.Errorf("run(agent) = %v, want unknown command", err)
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
