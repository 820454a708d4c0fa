package kvxfer

import (
	"time"

	"github.com/kvxfer/kvxfer/topology"
)

// SchedulerConfig configures a Scheduler. Zero fields mean the documented
// defaults (SPEC §0).
type SchedulerConfig struct {
	// EngineID names this engine to its peers (required).
	EngineID string
	// Addr is how peers reach this engine's kvxferd (host:port), returned
	// in transfer params (required).
	Addr string
	// Mode is push or pull (required).
	Mode Mode
	// TPSize and PPSize are this engine's parallelism (0 means 1).
	TPSize, PPSize int
	// LogicalBlockSize is the scheduler's block size in tokens (required).
	LogicalBlockSize int
	// Groups are the cache groups (kind and window), in the order block
	// lists are given. Empty means one full-attention group.
	Groups []topology.Group
	// SpecBlocks is the number of speculative-decoding blocks a Mamba
	// group keeps beyond its state block (0: none).
	SpecBlocks int
	// Lease is how long a producer holds finished blocks without a
	// heartbeat (default 30 s).
	Lease time.Duration
	// DecoderBlocksTTL is how long a consumer holds blocks for a second
	// turn in bidirectional pull (default 480 s).
	DecoderBlocksTTL time.Duration
	// RegistrationTimeout bounds how long a push consumer waits for the
	// producer's WRITE after registering (default DecoderBlocksTTL).
	RegistrationTimeout time.Duration
	// RecomputeThreshold: a second-turn read of fewer tokens than this is
	// recomputed instead (default 64; negative disables).
	RecomputeThreshold int
	// Bidirectional enables multi-turn pull (SPEC §8); refused in push.
	Bidirectional bool
	// HostBuffer stages producer saves to a host buffer (SPEC §11).
	HostBuffer bool
	// Now is the scheduler clock (default time.Now).
	Now func() time.Time
}

// Alloc is what an engine allocated for a request in a step.
type Alloc struct {
	// Blocks are the logical block ids per cache group that a transfer
	// fills: the blocks past the local prefix-cache hit.
	Blocks [][]topology.BlockID
	// Computed is the number of tokens already computed locally (the
	// prefix-cache hit); Blocks start at this token.
	Computed int
	// External is the number of tokens the transfer provides
	// (num_external_tokens).
	External int
}
