package daemon

import (
	"net"
	"sync"
)

// limitListener bounds the connections open at once from one remote IP
// (a hostile peer cannot hold every descriptor): a connection past the
// bound is closed as soon as it is accepted, and counted.
type limitListener struct {
	net.Listener
	perAddr int
	refused func()
	mu      sync.Mutex
	open    map[string]int
}

func newLimitListener(ln net.Listener, perAddr int, refused func()) *limitListener {
	return &limitListener{Listener: ln, perAddr: perAddr, refused: refused, open: map[string]int{}}
}

// Accept returns the next connection within the bound.
func (l *limitListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		host, _, err := net.SplitHostPort(c.RemoteAddr().String())
		if err != nil {
			host = c.RemoteAddr().String()
		}
		l.mu.Lock()
		if l.open[host] >= l.perAddr {
			l.mu.Unlock()
			l.refused() // counted before the peer can see the close
			_ = c.Close()
			continue
		}
		l.open[host]++
		l.mu.Unlock()
		return &limitConn{Conn: c, l: l, host: host}, nil
	}
}

type limitConn struct {
	net.Conn
	l    *limitListener
	host string
	once sync.Once
}

func (c *limitConn) Close() error {
	c.once.Do(func() {
		c.l.mu.Lock()
		if c.l.open[c.host]--; c.l.open[c.host] <= 0 {
			delete(c.l.open, c.host)
		}
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}
