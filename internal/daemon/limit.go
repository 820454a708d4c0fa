package daemon

import (
	"net"
	"sync"
)

// metricsConnsPerAddr and metricsConns bound the connections the metrics
// endpoint holds at once, from one address and from all.
const metricsConnsPerAddr, metricsConns = 4, 16

// limitListener bounds the connections open at once from one remote IP,
// and from all (a hostile peer cannot hold every descriptor, even from
// many addresses): a connection past a bound is closed as soon as it is
// accepted, and counted by reason (what+"_conns_per_addr",
// what+"_conns": peer_conns_per_addr, metrics_conns, ...).
type limitListener struct {
	net.Listener
	what           string
	perAddr, total int
	refused        func(reason string)
	mu             sync.Mutex
	open           map[string]int
	all            int
}

func newLimitListener(ln net.Listener, what string, perAddr, total int, refused func(reason string)) *limitListener {
	return &limitListener{Listener: ln, what: what, perAddr: perAddr, total: total, refused: refused, open: map[string]int{}}
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
		reason := ""
		switch {
		case l.open[host] >= l.perAddr:
			reason = l.what + "_conns_per_addr"
		case l.all >= l.total:
			reason = l.what + "_conns"
		}
		if reason != "" {
			l.mu.Unlock()
			l.refused(reason) // counted before the peer can see the close
			_ = c.Close()
			continue
		}
		l.open[host]++
		l.all++
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
		c.l.all--
		c.l.mu.Unlock()
	})
	return c.Conn.Close()
}
