// Package proctime reads this process's CPU time, for benchmarks that
// report what idling costs.
package proctime

import (
	"syscall"
	"time"
)

// CPU is this process's user and system CPU time so far (0 where the
// system cannot tell).
func CPU() time.Duration {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
