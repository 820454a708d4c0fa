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
	l := newLimitListener(ln, 2, func() { refused.Add(1) })
	defer l.Close()
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
