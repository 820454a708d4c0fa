package kvxfer

import (
	"context"
	"errors"
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
// engine. kvxferd implements it over the Peer gRPC service;
// kvxfertest.Directory implements it in process.
type Resolver interface {
	// Handshake returns the ranks of engine engineID reached at addr. It
	// blocks until it has them, fails, or ctx ends.
	Handshake(ctx context.Context, engineID, addr string) (HandshakeResult, error)
}

// ErrUnknownEngine is returned by a Resolver that does not know an engine.
var ErrUnknownEngine = errors.New("kvxfer: unknown engine")
