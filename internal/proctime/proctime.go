// Package proctime reads this process's CPU time, for benchmarks that
// report what idling costs.
package proctime

import (
	"syscall"
	"testing"
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

// BenchIdle is the body of an idle-cost benchmark: each op sleeps 100 ms
// while whatever the benchmark set up idles, and the reported cpu-% is the
// process's CPU time over that wall time.
func BenchIdle(b *testing.B) {
	var cpu, wall time.Duration
	for b.Loop() {
		c0, t0 := CPU(), time.Now()
		time.Sleep(100 * time.Millisecond)
		cpu += CPU() - c0
		wall += time.Since(t0)
	}
	b.ReportMetric(100*float64(cpu)/float64(wall), "cpu-%")
}
