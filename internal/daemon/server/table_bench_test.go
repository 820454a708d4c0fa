package server

import (
	"fmt"
	"sync"
	"testing"

	"github.com/puzpuzpuz/xsync/v4"
)

// BenchmarkEngineTable: what the daemon's engine and scheduler tables cost
// to read from many goroutines at once (a handshake or liveness probe per
// lookup, a scheduler call or rank step per lookup), as an xsync.Map (what
// they are) against a map under a mutex (what they were), 64 engines.
// "+writes" adds one goroutine replacing an entry every 1,000 reads, as
// ranks attach and detach.
func BenchmarkEngineTable(b *testing.B) {
	const engines = 64
	keys := make([]string, engines)
	for i := range keys {
		keys[i] = fmt.Sprintf("engine-%d", i)
	}
	for _, writes := range []bool{false, true} {
		suffix := ""
		if writes {
			suffix = "+writes"
		}
		b.Run("xsync"+suffix, func(b *testing.B) {
			m := xsync.NewMap[string, *engineEntry]()
			for _, k := range keys {
				m.Store(k, &engineEntry{})
			}
			var mu sync.Mutex // writers take turns, as in the server
			b.RunParallel(func(p *testing.PB) {
				for i := 0; p.Next(); i++ {
					if writes && i%1000 == 0 {
						mu.Lock()
						m.Store(keys[i%engines], &engineEntry{gen: uint64(i)})
						mu.Unlock()
						continue
					}
					if e, _ := m.Load(keys[i%engines]); e == nil {
						b.Fatal("missing")
					}
				}
			})
		})
		b.Run("mutex"+suffix, func(b *testing.B) {
			var mu sync.Mutex
			m := map[string]*engineEntry{}
			for _, k := range keys {
				m[k] = &engineEntry{}
			}
			b.RunParallel(func(p *testing.PB) {
				for i := 0; p.Next(); i++ {
					mu.Lock()
					if writes && i%1000 == 0 {
						m[keys[i%engines]] = &engineEntry{gen: uint64(i)}
						mu.Unlock()
						continue
					}
					e := m[keys[i%engines]]
					mu.Unlock()
					if e == nil {
						b.Fatal("missing")
					}
				}
			})
		})
	}
}
