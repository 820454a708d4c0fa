package server_test

import (
	"errors"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
)

func TestAllowList(t *testing.T) {
	a, err := server.ParseAllowList(" 10.0.0.0/8, 192.168.1.7 ,::1, prefill-0.example")
	if err != nil {
		t.Fatal(err)
	}
	for addr, want := range map[string]bool{
		"10.1.2.3:7600": true, "[::ffff:10.9.9.9]:1": true, "192.168.1.7:7600": true, "192.168.1.8:7600": false,
		"[::1]:7600": true, "127.0.0.1:7600": false, "prefill-0.example:7600": true, "PREFILL-0.example:1": true,
		"prefill-1.example:7600": false, "10.1.2.3": false, "": false,
	} {
		err := a.Check(addr)
		if (err == nil) != want || (err != nil && !errors.Is(err, server.ErrPeerNotAllowed)) {
			t.Errorf("Check(%q) = %v, want allowed %v", addr, err, want)
		}
	}
	for _, bad := range []string{"", " , ", "10.0.0.0/33", "a b", "host:1", "???", "10.0.0.0./8", "prefill-0..example", "-p.example",
		"p*.example", "10.0.0.1,???", strings.Repeat("a", 64) + ".example"} {
		if _, err := server.ParseAllowList(bad); err == nil {
			t.Errorf("ParseAllowList(%q) = nil error", bad)
		}
	}
}
