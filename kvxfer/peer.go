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

// PartialHandshakeError is a Resolver's error for an engine whose ranks
// each answer at a server of their own (the in-process placement: every
// rank a process) when some of them did not answer (a rank's process
// died: its port refuses). The handshake failed, as before; Answered lists
// the ranks that did answer, whose agents still say who speaks for those
// ranks: a message of a surviving rank (a pull consumer's completion
// notice, heard before any handshake) is admitted by them, and a notice
// of ours reaches them (a request failed for the dead rank, told to the
// ranks that live). Before, a rank's death made its engine's every
// handshake fail, and its surviving ranks' messages were refused: a pull
// producer held the blocks they had read until its request's deadline.
type PartialHandshakeError struct {
	Answered []RankInfo
	Err      error // why the others did not answer
}

func (e *PartialHandshakeError) Error() string { return e.Err.Error() }
func (e *PartialHandshakeError) Unwrap() error { return e.Err }

// ErrUnknownEngine is returned by a Resolver that does not know an engine.
var ErrUnknownEngine = errors.New("kvxfer: unknown engine")
