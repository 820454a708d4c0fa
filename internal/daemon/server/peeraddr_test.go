package server_test

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
)

// A peer address is host:port over TCP, whatever an engine names: an
// address that gRPC would read as another target ("unix:///path",
// "unix-abstract:name", "dns:///host:port"...) is refused before anything
// is dialed, naming it. Else an engine could make kvxferd (which may run
// as root) connect to unix sockets its own uid cannot reach.
func TestResolverRefusesNonTCPAddresses(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "victim.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan struct{}, 16)
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted <- struct{}{}
			c.Close()
		}
	}()
	res := server.NewPeerResolver(server.ResolverConfig{})
	defer res.Close()
	for _, addr := range []string{"unix://" + sock, "unix:" + sock, "passthrough:///unix://" + sock, "dns:///127.0.0.1:1", "127.0.0.1", "127.0.0.1:0", "127.0.0.1:65536", ":7600", "127.0.0.1:http"} {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
		_, err := res.Handshake(ctx, "e", addr)
		cancel()
		if err == nil || !strings.Contains(err.Error(), addr) || !strings.Contains(err.Error(), "host:port") {
			t.Errorf("Handshake at %q = %v, want an error naming the address and that it wants host:port", addr, err)
		}
	}
	select {
	case <-accepted:
		t.Errorf("the resolver connected to a unix socket an engine named")
	case <-time.After(200 * time.Millisecond):
	}
}
