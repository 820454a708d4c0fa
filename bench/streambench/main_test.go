package main

import (
	"bytes"
	"strings"
	"testing"
)

// A short run prints a row per size with both sides' quantiles and the
// goal's verdict at 256 requests; bad flags are refused.
func TestRun(t *testing.T) {
	var out bytes.Buffer
	if err := run([]string{"-sizes", "16,256", "-rounds", "2", "-iters", "5"}, &out); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"p50 ratio", "p99 ratio", "\n        16 ", "\n       256 ", "p50 <= 1.5x"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	for _, args := range [][]string{{"-quick", "-full"}, {"-sizes", "x"}, {"-sizes", "0"}, {"-only", "x"}} {
		if err := run(args, &out); err == nil {
			t.Errorf("run(%q) = nil, want an error", args)
		}
	}
}
