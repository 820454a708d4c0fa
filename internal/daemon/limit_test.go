package daemon

import (
	"net"
	"sync/atomic"
	"testing"
	"time"
)

// Past perAddr open connections from one address, new ones are closed at
// once and counted; closing one makes room again.
func TestLimitListener(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var refused atomic.Int64
	l := newLimitListener(ln, "peer", 2, 100, func(string) { refused.Add(1) })
	defer l.Close()
	accepted := acceptAll(l)
	dial := func() net.Conn {
		c, err := net.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	a, b := dial(), dial()
	defer a.Close()
	defer b.Close()
	s1, s2 := <-accepted, <-accepted
	c := dial() // the third: closed by the server
	defer c.Close()
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("the third connection from one address stayed open")
	}
	if refused.Load() != 1 {
		t.Errorf("refused = %d, want 1", refused.Load())
	}
	_ = s1.Close()
	d := dial()
	defer d.Close()
	select {
	case s3 := <-accepted:
		_ = s3.Close()
	case <-time.After(5 * time.Second):
		t.Error("no room made by closing a connection")
	}
	_ = s2.Close()
}

// Past total open connections, from any mix of addresses, new ones are
// closed at once and counted apart: a client with many source addresses
// (an IPv6 prefix) cannot hold every descriptor 64 at a time per address.
func TestLimitListenerTotal(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var perAddr, total atomic.Int64
	l := newLimitListener(ln, "peer", 2, 3, func(reason string) {
		switch reason {
		case "peer_conns_per_addr":
			perAddr.Add(1)
		case "peer_conns":
			total.Add(1)
		}
	})
	defer l.Close()
	accepted := acceptAll(l)
	dialFrom := func(ip string) net.Conn {
		d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(ip)}, Timeout: 5 * time.Second}
		c, err := d.Dial("tcp", ln.Addr().String())
		if err != nil {
			t.Skipf("cannot dial from %s: %v", ip, err)
		}
		t.Cleanup(func() { c.Close() })
		return c
	}
	for _, ip := range []string{"127.0.0.1", "127.0.0.2", "127.0.0.3"} {
		dialFrom(ip)
		select {
		case s := <-accepted:
			t.Cleanup(func() { s.Close() })
		case <-time.After(5 * time.Second):
			t.Fatalf("connection from %s not accepted", ip)
		}
	}
	c := dialFrom("127.0.0.4") // the fourth in all: closed by the server
	_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err == nil {
		t.Error("a connection past the total bound stayed open")
	}
	if total.Load() != 1 || perAddr.Load() != 0 {
		t.Errorf("refused: %d past the total, %d past the per-address bound; want 1 and 0", total.Load(), perAddr.Load())
	}
}

// acceptAll hands on what l accepts, and closes the channel once Accept
// fails (l closed).
func acceptAll(l net.Listener) <-chan net.Conn {
	accepted := make(chan net.Conn, 8)
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				close(accepted)
				return
			}
			accepted <- c
		}
	}()
	return accepted
}
