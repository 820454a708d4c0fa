package kvxfertest

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/puzpuzpuz/xsync/v4"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// Directory is an in-process Resolver: the workers of engines in one
// process publish their ranks in it, and every worker's handshakes read
// it. It is safe for concurrent use: handshakes read it without a lock
// (an engine's entry is never changed once stored; Publish stores a new
// one), and its fault hooks cost nothing while none is set.
type Directory struct {
	engines *xsync.Map[string, *kvxfer.HandshakeResult]
	hooks   atomic.Int32 // fault hooks set (FailHandshakes, Hold)
	mu      struct {
		sync.Mutex // writers take turns; the hooks' maps
		gen        uint64
		fail       map[string]int
		delay      map[string]chan struct{}
	}
}

// NewDirectory returns an empty directory.
func NewDirectory() *Directory {
	d := &Directory{engines: xsync.NewMap[string, *kvxfer.HandshakeResult]()}
	d.mu.fail = map[string]int{}
	d.mu.delay = map[string]chan struct{}{}
	return d
}

// Publish adds or replaces one rank of an engine. Replacing a rank starts
// a new generation of the engine.
func (d *Directory) Publish(r kvxfer.RankInfo) error {
	if r.EngineID == "" {
		return fmt.Errorf("kvxfertest: publish: RankInfo.EngineID is empty")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	r.Agent = slices.Clone(r.Agent)
	next := &kvxfer.HandshakeResult{}
	if old, ok := d.engines.Load(r.EngineID); ok {
		next.Generation, next.Ranks = old.Generation, slices.Clone(old.Ranks)
	} else {
		d.mu.gen++
		next.Generation = d.mu.gen
	}
	replaced := false
	for i, have := range next.Ranks {
		if have.Layout.TPRank == r.Layout.TPRank && have.Layout.PPRank == r.Layout.PPRank {
			d.mu.gen++
			next.Generation = d.mu.gen
			next.Ranks[i] = r
			replaced = true
		}
	}
	if !replaced {
		next.Ranks = append(next.Ranks, r)
	}
	d.engines.Store(r.EngineID, next)
	return nil
}

// Remove forgets an engine.
func (d *Directory) Remove(engineID string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.engines.Delete(engineID)
}

// Unpublish removes one rank of an engine, as a daemon does when the
// rank's stream ends (before its Worker's close has fenced what it
// moves): a new generation without it; the engine goes with its last
// rank.
func (d *Directory) Unpublish(engineID string, tpRank, ppRank int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	old, ok := d.engines.Load(engineID)
	if !ok {
		return
	}
	ranks := slices.DeleteFunc(slices.Clone(old.Ranks), func(r kvxfer.RankInfo) bool {
		return r.Layout.TPRank == tpRank && r.Layout.PPRank == ppRank
	})
	if len(ranks) == len(old.Ranks) {
		return
	}
	if len(ranks) == 0 {
		d.engines.Delete(engineID)
		return
	}
	d.mu.gen++
	d.engines.Store(engineID, &kvxfer.HandshakeResult{Generation: d.mu.gen, Ranks: ranks})
}

// FailHandshakes makes the next n handshakes to engineID fail.
func (d *Directory) FailHandshakes(engineID string, n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mu.fail[engineID] += n
	d.hooks.Add(int32(n))
}

// Hold makes handshakes to engineID block until the returned function is
// called (tests of pending handshakes).
func (d *Directory) Hold(engineID string) (release func()) {
	ch := make(chan struct{})
	d.mu.Lock()
	d.mu.delay[engineID] = ch
	d.mu.Unlock()
	d.hooks.Add(1)
	var once sync.Once
	return func() {
		once.Do(func() {
			d.mu.Lock()
			if d.mu.delay[engineID] == ch {
				delete(d.mu.delay, engineID)
			}
			d.mu.Unlock()
			d.hooks.Add(-1)
			close(ch)
		})
	}
}

// Handshake implements kvxfer.Resolver. addr is ignored.
func (d *Directory) Handshake(ctx context.Context, engineID, _ string) (kvxfer.HandshakeResult, error) {
	if d.hooks.Load() > 0 {
		d.mu.Lock()
		hold := d.mu.delay[engineID]
		d.mu.Unlock()
		if hold != nil {
			select {
			case <-hold:
			case <-ctx.Done():
				return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s: %w", engineID, ctx.Err())
			}
		}
		d.mu.Lock()
		failing := d.mu.fail[engineID] > 0
		if failing {
			d.mu.fail[engineID]--
			d.hooks.Add(-1)
		}
		d.mu.Unlock()
		if failing {
			return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s: injected failure", engineID)
		}
	}
	e, ok := d.engines.Load(engineID)
	if !ok {
		return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s: %w", engineID, kvxfer.ErrUnknownEngine)
	}
	return kvxfer.HandshakeResult{Generation: e.Generation, Ranks: slices.Clone(e.Ranks)}, nil
}
