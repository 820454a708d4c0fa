package hoptrace

import (
	"io"
	"testing"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// BenchmarkHop is what one event costs the goroutine that reports it (the
// Worker's loop, mostly) with the trace on: the clock, and a queue send.
// The writer drains into io.Discard meanwhile; what it could not keep up
// with is dropped (reported as drops/op).
func BenchmarkHop(b *testing.B) {
	tr := New(io.Discard, 0)
	e := kvxfer.HopEvent{Hop: kvxfer.HopRegSent, Side: kvxfer.RoleConsumer, Engine: "D", DReq: "d-1", PReq: "p-1", TransferID: "t-1"}
	b.ReportAllocs()
	for b.Loop() {
		tr.Hop(e)
	}
	b.StopTimer()
	_ = tr.Close()
	b.ReportMetric(float64(tr.Dropped())/float64(b.N), "drops/op")
}

// BenchmarkNow is the clock alone (CLOCK_MONOTONIC through a system call).
func BenchmarkNow(b *testing.B) {
	for b.Loop() {
		_ = Now()
	}
}
