package netxfer

import (
	"net"
	"testing"
	"time"
)

// A peer that keeps its connection open but stops reading it (a process
// frozen, its kernel still acknowledging) cannot hold a sender for ever:
// a frame not taken within FrameTimeout fails its connection, as the
// peer's own server cuts a frame that takes longer to arrive. Before,
// Notify blocked for good once the socket's buffers were full (and a
// Worker's loop with it: every request of the rank, and its Close).
func TestNotifyToStalledPeerIsBounded(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	stop := make(chan struct{})
	defer close(stop)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		<-stop // reads nothing, ever
	}()
	a, _ := newHeapAgent(t, "a", 1<<16, Config{DisableLocal: true, DisableSameHost: true, Conns: 1, FrameTimeout: 300 * time.Millisecond})
	name, err := a.LoadPeer([]byte(metaPrefix + "fake\n" + ln.Addr().String()))
	if err != nil {
		t.Fatal(err)
	}
	msg := make([]byte, 256<<10)
	ended := make(chan error, 1)
	go func() {
		for range 1024 { // 256 MiB: far past any socket buffer
			if err := a.Notify(name, msg); err != nil {
				ended <- err
				return
			}
		}
		ended <- nil
	}()
	select {
	case err := <-ended:
		if err == nil {
			t.Fatal("256 MiB of notifications went to a peer that reads nothing")
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Notify to a peer that stopped reading still blocked after 10 s (FrameTimeout 300 ms)")
	}
}
