package nixl

import "time"

// Config is an agent to open.
type Config struct {
	// Name is the agent's name, unique among the agents that meet.
	Name string
	// Plugin is NIXL's transfer plugin ("UCX").
	Plugin string
	// Params configure the plugin (for Debian's UCX 1.13 and shared
	// memory: ucx_error_handling_mode=none).
	Params map[string]string
	// VRAM makes the agent move GPU memory (device pointers, with their
	// device id in each registered range) instead of host memory.
	VRAM bool
	// ProgressDelay is how long NIXL's progress thread waits between its
	// rounds, in whole microseconds; 0 makes it spin, which costs a core
	// per agent even when idle. Open uses DefaultProgressDelay.
	ProgressDelay time.Duration
	// AnyVersion opens a library whose version is not in
	// SupportedVersions, or cannot be told (undefined behaviour where
	// its C API differs from the one this package declares).
	AnyVersion bool
}

// DefaultProgressDelay is the progress thread's pause between rounds:
// an idle agent then costs about 2% of a core instead of a whole one, and
// on a 2-vCPU host transfers got faster too, the spinning thread no longer
// taking the CPU from the thread that posts (bench/RESULTS.md).
const DefaultProgressDelay = 100 * time.Microsecond

// delayMicros is the progress thread delay handed to NIXL.
func (c *Config) delayMicros() uint64 {
	if c.ProgressDelay <= 0 {
		return 0
	}
	return uint64(c.ProgressDelay / time.Microsecond)
}
