package kvxfer

import (
	"fmt"
	"math"
	"sync"
	"testing"
	"time"
)

func TestHistogramBuckets(t *testing.T) {
	h := NewHistogram(1, 2, 4) // bounds 1 2 4 8, +Inf
	for _, v := range []float64{0.5, 1, 1.5, 2, 3, 8, 9, math.Inf(1)} {
		h.Observe(v)
	}
	s := h.Snapshot()
	want := []uint64{2, 2, 1, 1, 2} // <=1: 0.5 1; <=2: 1.5 2; <=4: 3; <=8: 8; +Inf: 9 inf
	for i := range want {
		if s.Counts[i] != want[i] {
			t.Fatalf("Counts = %v, want %v", s.Counts, want)
		}
	}
	if got := s.Cumulative(); got[4] != 8 || got[1] != 4 {
		t.Errorf("Cumulative = %v, want ... 4 ... 8", got)
	}
	if s.Count != 8 {
		t.Errorf("Count = %d, want 8", s.Count)
	}
}

func TestHistogramQuantileAndMean(t *testing.T) {
	h := NewHistogram(1, 2, 10)
	for range 10 {
		h.Observe(3) // bucket (2, 4]
	}
	s := h.Snapshot()
	if got := s.Mean(); got != 3 {
		t.Errorf("Mean = %v, want 3", got)
	}
	if got := s.Quantile(0.5); got != 3 { // halfway through (2, 4]
		t.Errorf("Quantile(0.5) = %v, want 3", got)
	}
	if got := s.Quantile(1); got != 4 {
		t.Errorf("Quantile(1) = %v, want 4", got)
	}
	if got := (HistogramSnapshot{}).Quantile(0.9); got != 0 {
		t.Errorf("empty Quantile = %v, want 0", got)
	}
}

func TestMetricsConcurrent(t *testing.T) {
	m := NewMetrics()
	var wg sync.WaitGroup
	const g, n = 8, 1000
	for range g {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range n {
				m.Transfer(time.Millisecond, time.Microsecond, 100, 2, 1)
				m.FailedNotification()
				m.BadInput("x")
			}
		}()
	}
	wg.Wait()
	s := m.Snapshot()
	if s.Transfers != g*n || s.TotalBytes != 100*g*n || s.TransferSeconds.Count != g*n || s.FailedNotifications != g*n || s.BadInput["x"] != g*n {
		t.Errorf("after %d records: %+v", g*n, s)
	}
	if math.Abs(s.TransferSeconds.Sum-float64(g*n)*1e-3) > 1e-6 {
		t.Errorf("TransferSeconds.Sum = %v, want %v", s.TransferSeconds.Sum, float64(g*n)*1e-3)
	}
}

// SPEC §12 connector test 18: three workers with two transfers each add
// up to six transfers averaging 1500 ms and 1.5 descriptors.
func TestStatsAggregateAndReduce(t *testing.T) {
	var total Stats
	for range 3 {
		m := NewMetrics()
		m.Transfer(time.Second, time.Millisecond, 1<<20, 1, 1)
		m.Transfer(2*time.Second, time.Millisecond, 1<<20, 2, 1)
		total = total.Add(m.Snapshot())
	}
	r := total.Reduce()
	if r.Transfers != 6 || math.Abs(r.AvgTransferMs-1500) > 1e-9 || r.AvgDescs != 1.5 || r.AvgMB != 1 || r.Amplification != 1.5 {
		t.Errorf("Reduce = %+v, want 6 transfers, 1500 ms, 1.5 descriptors, 1 MB, amplification 1.5", r)
	}
	if math.Abs(r.MBps-6.0/9.0) > 1e-9 {
		t.Errorf("MBps = %v, want %v", r.MBps, 6.0/9.0)
	}
}

func TestStatsSubAndIsEmpty(t *testing.T) {
	m := NewMetrics()
	before := m.Snapshot()
	if !before.IsEmpty() {
		t.Fatal("a new recorder is not empty")
	}
	m.ExpiredRequest()
	m.Dropped("malformed")
	d := m.Snapshot().Sub(before)
	if d.IsEmpty() || d.ExpiredRequests != 1 || d.Dropped["malformed"] != 1 {
		t.Errorf("delta = %+v, want one expiry and one drop", d)
	}
	if again := m.Snapshot().Sub(m.Snapshot()); !again.IsEmpty() {
		t.Errorf("delta of equal snapshots = %+v, want empty", again)
	}
}

func TestLabelsCapped(t *testing.T) {
	m := NewMetrics()
	for i := range 100 {
		m.BadInput(fmt.Sprint("field", i))
	}
	s := m.Snapshot()
	if len(s.BadInput) != maxLabels+1 || s.BadInput["other"] != 100-maxLabels {
		t.Errorf("%d labels, other = %d; want %d labels and %d under other", len(s.BadInput), s.BadInput["other"], maxLabels+1, 100-maxLabels)
	}
}

func TestMetricsTransferAllocatesNothing(t *testing.T) {
	m := NewMetrics()
	if n := testing.AllocsPerRun(100, func() {
		m.Transfer(time.Millisecond, time.Microsecond, 4096, 3, 2)
		m.Outcome(RoleProducer, ResultDone, FailureNone)
		m.Outcome(RoleConsumer, ResultFailed, FailureTransfer)
		m.FailedTransfer()
	}); n != 0 {
		t.Errorf("recording allocates %v times, want 0", n)
	}
}
