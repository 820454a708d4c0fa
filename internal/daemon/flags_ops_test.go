package daemon

import (
	"strings"
	"testing"
)

// A word on the command line that is no flag is refused, naming it: the
// flag package stops at the first one, so "-insecure-peers true -socket
// /x" (a bool flag takes no separate value) dropped -socket and every
// flag after it without a word, and kvxferd served on the defaults.
func TestStrayArgumentRefused(t *testing.T) {
	for _, args := range [][]string{
		{"-no-same-host", "true", "-socket", "/tmp/kvxferd-ops.sock"},
		{"-socket", "/tmp/kvxferd-ops.sock", "extra"},
	} {
		c, err := parseFlags(args)
		if err == nil {
			t.Errorf("%q accepted (socket %q): want an error naming the stray argument", args, c.socket)
			continue
		}
		if !strings.Contains(err.Error(), "unexpected argument") {
			t.Errorf("%q: %v, want an error naming the stray argument", args, err)
		}
	}
}
