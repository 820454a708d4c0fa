package server

import (
	"fmt"
	"sync"
	"testing"
)

// The resolver's connection cache under concurrent handshakes: calls take
// and give back connections while others are dialed, evicted (MaxConns 4
// over 8 addresses) and retired; the cache never holds more than
// MaxConns, and a connection a call holds is never closed under it.
func TestResolverCacheConcurrent(t *testing.T) {
	r := NewPeerResolver(ResolverConfig{MaxConns: 4})
	defer r.Close()
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range 300 {
				addr := fmt.Sprintf("127.0.0.1:%d", 1+(g+i)%8)
				pc, done, _, err := r.conn(addr)
				if err != nil {
					continue // all four in use: refused, as it should be
				}
				if pc.refs.Load() <= 0 {
					t.Errorf("%s: a held connection counts %d calls", addr, pc.refs.Load())
				}
				if i%7 == 0 {
					r.retire(addr, pc)
				}
				if pc.refs.Load() <= 0 {
					t.Errorf("%s: a held connection was closed under its call", addr)
				}
				done()
				if n := r.Conns(); n > 4+8 {
					t.Errorf("%d connections cached", n)
				}
			}
		}()
	}
	wg.Wait()
	if n := r.Conns(); n > 4 {
		t.Errorf("%d connections cached once calls ended, want at most MaxConns 4", n)
	}
	r.conns.Range(func(addr string, pc *peerConn) bool {
		if pc.refs.Load() != 0 || pc.retired.Load() {
			t.Errorf("%s: cached with %d calls, retired %v", addr, pc.refs.Load(), pc.retired.Load())
		}
		return true
	})
}

// BenchmarkResolverConn: taking and giving back a cached connection, what
// every handshake and liveness probe does first, from many goroutines at
// once (8 peer addresses).
func BenchmarkResolverConn(b *testing.B) {
	r := NewPeerResolver(ResolverConfig{})
	defer r.Close()
	addrs := make([]string, 8)
	for i := range addrs {
		addrs[i] = fmt.Sprintf("127.0.0.1:%d", 1+i)
		_, done, _, err := r.conn(addrs[i])
		if err != nil {
			b.Fatal(err)
		}
		done()
	}
	b.RunParallel(func(p *testing.PB) {
		for i := 0; p.Next(); i++ {
			_, done, _, err := r.conn(addrs[i%len(addrs)])
			if err != nil {
				b.Fatal(err)
			}
			done()
		}
	})
}
