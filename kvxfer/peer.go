package kvxfer

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// RankInfo is what a handshake tells about one rank of an engine: its KV
// layout (which carries its TP and PP rank and size), its backend agent's
// metadata, and the engine's compatibility hash (SPEC §2).
type RankInfo struct {
	EngineID   string
	CompatHash string
	Layout     topology.Layout
	Agent      []byte
}

// HandshakeResult is every rank of a peer engine.
type HandshakeResult struct {
	Ranks []RankInfo
	// Generation changes whenever the engine re-publishes its ranks
	// (a restart): cached plans of an older generation are dropped.
	Generation uint64
	// ClockOffset estimates the peer's clock minus ours.
	ClockOffset time.Duration
}

// Resolver performs handshakes: it fetches the rank metadata of a peer
// engine. kvxferd implements it over the Peer gRPC service; Directory
// implements it in process.
type Resolver interface {
	// Handshake returns the ranks of engine engineID reached at addr. It
	// blocks until it has them, fails, or ctx ends.
	Handshake(ctx context.Context, engineID, addr string) (HandshakeResult, error)
}

// ErrUnknownEngine is returned by a Resolver that does not know an engine.
var ErrUnknownEngine = errors.New("kvxfer: unknown engine")

// Directory is an in-process Resolver: the workers of engines in one
// process publish their ranks in it. It is safe for concurrent use.
type Directory struct {
	mu struct {
		sync.Mutex
		engines map[string]*HandshakeResult
		gen     uint64
		// fail makes the next n handshakes to an engine fail (tests).
		fail  map[string]int
		delay map[string]chan struct{}
	}
}

// NewDirectory returns an empty directory.
func NewDirectory() *Directory {
	d := &Directory{}
	d.mu.engines = map[string]*HandshakeResult{}
	d.mu.fail = map[string]int{}
	d.mu.delay = map[string]chan struct{}{}
	return d
}

// Publish adds or replaces one rank of an engine. Replacing a rank starts
// a new generation of the engine.
func (d *Directory) Publish(r RankInfo) error {
	if r.EngineID == "" {
		return fmt.Errorf("kvxfer: publish: RankInfo.EngineID is empty")
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	e := d.mu.engines[r.EngineID]
	if e == nil {
		d.mu.gen++
		e = &HandshakeResult{Generation: d.mu.gen}
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

// Handshake implements Resolver. addr is ignored.
func (d *Directory) Handshake(ctx context.Context, engineID, _ string) (HandshakeResult, error) {
	d.mu.Lock()
	hold := d.mu.delay[engineID]
	d.mu.Unlock()
	if hold != nil {
		select {
		case <-hold:
		case <-ctx.Done():
			return HandshakeResult{}, fmt.Errorf("handshake %s: %w", engineID, ctx.Err())
		}
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.mu.fail[engineID] > 0 {
		d.mu.fail[engineID]--
		return HandshakeResult{}, fmt.Errorf("handshake %s: injected failure", engineID)
	}
	e := d.mu.engines[engineID]
	if e == nil {
		return HandshakeResult{}, fmt.Errorf("handshake %s: %w", engineID, ErrUnknownEngine)
	}
	out := HandshakeResult{Generation: e.Generation, Ranks: slices.Clone(e.Ranks)}
	return out, nil
}
