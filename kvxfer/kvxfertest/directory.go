package kvxfertest

import (
	"context"
	"fmt"
	"slices"
	"sync"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// Directory is an in-process Resolver: the workers of engines in one
// process publish their ranks in it. It is safe for concurrent use.
type Directory struct {
	mu struct {
		sync.Mutex
		engines map[string]*kvxfer.HandshakeResult
		gen     uint64
		// fail makes the next n handshakes to an engine fail (tests).
		fail  map[string]int
		delay map[string]chan struct{}
	}
}

// NewDirectory returns an empty directory.
func NewDirectory() *Directory {
	d := &Directory{}
	d.mu.engines = map[string]*kvxfer.HandshakeResult{}
	d.mu.fail = map[string]int{}
	d.mu.delay = map[string]chan struct{}{}
	return d
}

// Publish adds or replaces one rank of an engine. Replacing a rank starts
// a new generation of the engine.
func (d *Directory) Publish(r kvxfer.RankInfo) error {
	if r.EngineID == "" {
		return fmt.Errorf("kvxfertest: publish: kvxfer.RankInfo.EngineID is empty")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.mu.engines[r.EngineID]
	if e == nil {
		d.mu.gen++
		e = &kvxfer.HandshakeResult{Generation: d.mu.gen}
		d.mu.engines[r.EngineID] = e
	}
	r.Agent = slices.Clone(r.Agent)
	for i, have := range e.Ranks {
		if have.Layout.TPRank == r.Layout.TPRank && have.Layout.PPRank == r.Layout.PPRank {
			d.mu.gen++
			e.Generation = d.mu.gen
			e.Ranks[i] = r
			return nil
		}
	}
	e.Ranks = append(e.Ranks, r)
	return nil
}

// Remove forgets an engine.
func (d *Directory) Remove(engineID string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.mu.engines, engineID)
}

// FailHandshakes makes the next n handshakes to engineID fail.
func (d *Directory) FailHandshakes(engineID string, n int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.mu.fail[engineID] += n
}

// Hold makes handshakes to engineID block until the returned function is
// called (tests of pending handshakes).
func (d *Directory) Hold(engineID string) (release func()) {
	ch := make(chan struct{})
	d.mu.Lock()
	d.mu.delay[engineID] = ch
	d.mu.Unlock()
	var once sync.Once
	return func() {
		once.Do(func() {
			d.mu.Lock()
			if d.mu.delay[engineID] == ch {
				delete(d.mu.delay, engineID)
			}
			d.mu.Unlock()
			close(ch)
		})
	}
}

// Handshake implements kvxfer.Resolver. addr is ignored.
func (d *Directory) Handshake(ctx context.Context, engineID, _ string) (kvxfer.HandshakeResult, error) {
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
	defer d.mu.Unlock()
	if d.mu.fail[engineID] > 0 {
		d.mu.fail[engineID]--
		return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s: injected failure", engineID)
	}
	e := d.mu.engines[engineID]
	if e == nil {
		return kvxfer.HandshakeResult{}, fmt.Errorf("handshake %s: %w", engineID, kvxfer.ErrUnknownEngine)
	}
	out := kvxfer.HandshakeResult{Generation: e.Generation, Ranks: slices.Clone(e.Ranks)}
	return out, nil
}
