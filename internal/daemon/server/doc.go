// Package server is kvxferd's side of the kvxfer.v1 protocol (package
// stream): the gRPC Server behind the daemon (one WorkerService.Connect
// stream per engine rank, its memory mapped from shared-memory files or
// imported from CUDA IPC handles and its layout relocated; the engines'
// SchedulerService; PeerService handshakes between daemons), the
// PeerResolver that handshakes with peer daemons, the credentials of the
// engine socket (EngineCredentials: each engine's uid) and of the peer
// listener (PeerCredentials), the -peer-allow list, and Status, the one
// function that maps errors to gRPC status codes. package daemon (kvxferd
// serve) wires it to its listeners and backends.
package server

import (
	"fmt"
	"math"

	"github.com/kvxfer/kvxfer/stream"
)

// invalid is an error about a malformed message: it wraps
// stream.ErrInvalid, which Status maps to InvalidArgument.
func invalid(format string, args ...any) error {
	return fmt.Errorf("%w: %s", stream.ErrInvalid, fmt.Sprintf(format, args...))
}

// fitInt converts a message's field to an int, refusing values outside
// int32's range.
func fitInt(field string, v int64) (int, error) {
	if v < math.MinInt32 || v > math.MaxInt32 {
		return 0, invalid("%s = %d out of range", field, v)
	}
	return int(v), nil
}
