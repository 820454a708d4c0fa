package kvxfer

import (
	"math"
	"sort"
	"sync"
	"sync/atomic"
	"time"

	"github.com/kvxfer/kvxfer/hotpath"
)

// Histogram counts observations in fixed exponential buckets. Observe is
// lock-free and allocation-free; a Histogram is safe for concurrent use.
type Histogram struct {
	bounds []float64       // upper bounds, ascending; +Inf is implicit
	counts []atomic.Uint64 // len(bounds)+1
	count  atomic.Uint64
	sum    atomic.Uint64 // float64 bits
}

// NewHistogram returns a histogram with count buckets whose upper bounds
// are start·factor^i, plus a +Inf bucket.
func NewHistogram(start, factor float64, count int) *Histogram {
	h := &Histogram{bounds: make([]float64, count), counts: make([]atomic.Uint64, count+1)}
	b := start
	for i := range h.bounds {
		h.bounds[i] = b
		b *= factor
	}
	return h
}

// Observe records v.
func (h *Histogram) Observe(v float64) {
	i := sort.SearchFloat64s(h.bounds, v) // first bound >= v
	h.counts[i].Add(1)
	h.count.Add(1)
	for {
		old := h.sum.Load()
		if h.sum.CompareAndSwap(old, math.Float64bits(math.Float64frombits(old)+v)) {
			return
		}
	}
}

// Snapshot returns the histogram's current values.
func (h *Histogram) Snapshot() HistogramSnapshot {
	s := HistogramSnapshot{Bounds: h.bounds, Counts: make([]uint64, len(h.counts))}
	for i := range h.counts {
		s.Counts[i] = h.counts[i].Load()
	}
	s.Count = h.count.Load()
	s.Sum = math.Float64frombits(h.sum.Load())
	return s
}

// HistogramSnapshot is a histogram's values at one time. Counts are per
// bucket (not cumulative); the last bucket is +Inf.
type HistogramSnapshot struct {
	Bounds []float64
	Counts []uint64
	Count  uint64
	Sum    float64
}

// Cumulative returns the cumulative bucket counts (what Prometheus wants).
func (s HistogramSnapshot) Cumulative() []uint64 {
	out := make([]uint64, len(s.Counts))
	var c uint64
	for i, n := range s.Counts {
		c += n
		out[i] = c
	}
	return out
}

// Mean is Sum/Count (0 when empty).
func (s HistogramSnapshot) Mean() float64 {
	if s.Count == 0 {
		return 0
	}
	return s.Sum / float64(s.Count)
}

// Quantile estimates the q-quantile by linear interpolation inside its
// bucket, as Prometheus's histogram_quantile does; a quantile in the +Inf
// bucket returns the highest finite bound.
func (s HistogramSnapshot) Quantile(q float64) float64 {
	if s.Count == 0 || len(s.Bounds) == 0 {
		return 0
	}
	rank := q * float64(s.Count)
	var c float64
	for i, n := range s.Counts {
		if c+float64(n) >= rank && n > 0 {
			if i == len(s.Bounds) {
				return s.Bounds[len(s.Bounds)-1]
			}
			lo := 0.0
			if i > 0 {
				lo = s.Bounds[i-1]
			}
			return lo + (s.Bounds[i]-lo)*(rank-c)/float64(n)
		}
		c += float64(n)
	}
	return s.Bounds[len(s.Bounds)-1]
}

// Sub returns s minus an earlier snapshot of the same histogram.
func (s HistogramSnapshot) Sub(prev HistogramSnapshot) HistogramSnapshot {
	out := HistogramSnapshot{Bounds: s.Bounds, Counts: make([]uint64, len(s.Counts)), Count: s.Count - prev.Count, Sum: s.Sum - prev.Sum}
	for i := range s.Counts {
		out.Counts[i] = s.Counts[i]
		if i < len(prev.Counts) {
			out.Counts[i] -= prev.Counts[i]
		}
	}
	return out
}

// Add returns the sum of two snapshots of histograms with equal bounds.
func (s HistogramSnapshot) Add(o HistogramSnapshot) HistogramSnapshot {
	if s.Bounds == nil {
		return o
	}
	out := HistogramSnapshot{Bounds: s.Bounds, Counts: make([]uint64, len(s.Counts)), Count: s.Count + o.Count, Sum: s.Sum + o.Sum}
	for i := range s.Counts {
		out.Counts[i] = s.Counts[i]
		if i < len(o.Counts) {
			out.Counts[i] += o.Counts[i]
		}
	}
	return out
}

// maxLabels caps the distinct labels of a labelled counter; further
// labels count under "other".
const maxLabels = 64

// labelled is a small set of counters by label.
type labelled struct {
	mu sync.Mutex
	m  map[string]uint64
}

func (l *labelled) inc(label string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.m == nil {
		l.m = map[string]uint64{}
	}
	if _, ok := l.m[label]; !ok && len(l.m) >= maxLabels {
		label = "other"
	}
	l.m[label]++
}

func (l *labelled) snapshot() map[string]uint64 {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]uint64, len(l.m))
	for k, v := range l.m {
		out[k] = v
	}
	return out
}

// Metrics records a Worker's statistics (SPEC §10 and ours): transfer and
// post time, bytes, descriptors and descriptor amplification per
// transfer; failed transfers and notifications; expired requests;
// handshakes; outcomes; bad input and dropped messages by reason. It is
// safe for concurrent use; the transfer path records without allocating.
type Metrics struct {
	transferSec, postSec, bytes, descs, amplification *Histogram
	handshakeSec                                      *Histogram

	transfers, failedTransfers, failedNotifs, expired atomic.Uint64
	handshakeFailures, panics                         atomic.Uint64
	totalBytes, totalDescs, totalBlocks               atomic.Uint64
	outcomes                                          [3][5]atomic.Uint64               // [role][result]
	failures                                          [3][numFailureKinds]atomic.Uint64 // [role][kind]

	badInput, dropped, refused labelled
	gates                      labelled
}

// NewMetrics returns an empty recorder. Bucket layouts: seconds from 10 µs
// doubling over 24 buckets (to ~84 s); bytes from 4 KiB ×4 over 16 (to
// 4 TiB); descriptors from 1 doubling over 24; amplification
// (descriptors per block) from 1/64 doubling over 16.
func NewMetrics() *Metrics {
	return &Metrics{
		transferSec:   NewHistogram(10e-6, 2, 24),
		postSec:       NewHistogram(10e-6, 2, 24),
		handshakeSec:  NewHistogram(10e-6, 2, 24),
		bytes:         NewHistogram(4096, 4, 16),
		descs:         NewHistogram(1, 2, 24),
		amplification: NewHistogram(1.0/64, 2, 16),
	}
}

// Transfer records one successful transfer.
func (m *Metrics) Transfer(transfer, post time.Duration, bytes int64, descs, blocks int) {
	m.transfers.Add(1)
	m.transferSec.Observe(transfer.Seconds())
	m.postSec.Observe(post.Seconds())
	m.bytes.Observe(float64(bytes))
	m.descs.Observe(float64(descs))
	if blocks > 0 {
		m.amplification.Observe(float64(descs) / float64(blocks))
	}
	m.totalBytes.Add(uint64(max(bytes, 0)))
	m.totalDescs.Add(uint64(max(descs, 0)))
	m.totalBlocks.Add(uint64(max(blocks, 0)))
}

// FailedTransfer counts a transfer that failed to post or complete.
func (m *Metrics) FailedTransfer() { m.failedTransfers.Add(1) }

// FailedNotification counts a notification that could not be sent.
func (m *Metrics) FailedNotification() { m.failedNotifs.Add(1) }

// ExpiredRequest counts a request whose lease or deadline passed.
func (m *Metrics) ExpiredRequest() { m.expired.Add(1) }

// Handshake records a handshake's latency, or its failure.
func (m *Metrics) Handshake(d time.Duration, ok bool) {
	if ok {
		m.handshakeSec.Observe(d.Seconds())
	} else {
		m.handshakeFailures.Add(1)
	}
}

// Outcome counts a terminal outcome of one side, and a failed or
// expired one by its kind too.
func (m *Metrics) Outcome(side Role, r Result, kind FailureKind) {
	if int(side) < len(m.outcomes) && int(r) < len(m.outcomes[0]) {
		m.outcomes[side][r].Add(1)
	}
	if kind != FailureNone && int(side) < len(m.failures) && kind < numFailureKinds {
		m.failures[side][kind].Add(1)
	}
}

// Panic counts a panic a Worker contained (WorkerConfig.ContainPanics):
// it stopped, failing its requests.
func (m *Metrics) Panic() { m.panics.Add(1) }

// Panics returns how many panics Workers recording here contained.
func (m *Metrics) Panics() uint64 { return m.panics.Load() }

// BadInput counts an input rejected for the named field.
func (m *Metrics) BadInput(field string) { m.badInput.inc(field) }

// Dropped counts a peer message dropped for the named reason.
func (m *Metrics) Dropped(reason string) { m.dropped.inc(reason) }

// RefusedAccess counts a peer's transfer refused by the Worker's grants
// (see Guarded): labels "write_late", "write_deny", "read_late",
// "read_deny".
func (m *Metrics) RefusedAccess(op hotpath.Op, a Access) {
	dir := "read_"
	if op == hotpath.OpWrite {
		dir = "write_"
	}
	m.refused.inc(dir + a.String())
}

// GateOpened counts a push grant offered to a producer one-sided
// (WriteGater); GateFailed one whose offer failed (it is served
// two-sided). Labels "opened", "failed" of Stats.Gates.
func (m *Metrics) GateOpened() { m.gates.inc("opened") }

// GateFailed: see GateOpened.
func (m *Metrics) GateFailed() { m.gates.inc("failed") }

// RetriedRead counts a pull consumer's READ refused because the producer
// did not hold the blocks yet, and tried again (label "read_retried" of
// RefusedAccess).
func (m *Metrics) RetriedRead() { m.refused.inc("read_retried") }

// AbortedLanding counts a peer's part cut short while its bytes moved,
// because the grant (or pull hold) that admitted it ended (labels
// "write_aborted", "read_aborted" of RefusedAccess).
func (m *Metrics) AbortedLanding(op hotpath.Op) {
	if op == hotpath.OpWrite {
		m.refused.inc("write_aborted")
	} else {
		m.refused.inc("read_aborted")
	}
}

// Stats is a snapshot of Metrics: cumulative values since the recorder
// was made (Prometheus counters). Sub gives the delta between two.
type Stats struct {
	TransferSeconds, PostSeconds, Bytes, Descriptors, Amplification HistogramSnapshot
	HandshakeSeconds                                                HistogramSnapshot

	Transfers, FailedTransfers, FailedNotifications, ExpiredRequests uint64
	HandshakeFailures                                                uint64
	TotalBytes, TotalDescriptors, TotalBlocks                        uint64
	// Panics counts panics contained (WorkerConfig.ContainPanics): each
	// stopped its Worker, failing its requests.
	Panics uint64
	// Outcomes counts terminal outcomes by role and result:
	// Outcomes[RoleProducer][ResultDone], ...
	Outcomes [3][5]uint64
	// Failures counts failed and expired outcomes by role and kind:
	// Failures[RoleConsumer][FailureTransfer], ...
	Failures [3][numFailureKinds]uint64
	// BadInput and Dropped count by field or reason.
	BadInput, Dropped map[string]uint64
	// RefusedAccess counts peers' transfers refused by the data-plane
	// grants, by direction and verdict (see Metrics.RefusedAccess).
	RefusedAccess map[string]uint64
	// Gates counts push grants offered one-sided, by outcome (see
	// Metrics.GateOpened).
	Gates map[string]uint64
}

// Snapshot returns the current values.
func (m *Metrics) Snapshot() Stats {
	s := Stats{
		TransferSeconds: m.transferSec.Snapshot(), PostSeconds: m.postSec.Snapshot(), Bytes: m.bytes.Snapshot(),
		Descriptors: m.descs.Snapshot(), Amplification: m.amplification.Snapshot(), HandshakeSeconds: m.handshakeSec.Snapshot(),
		Transfers: m.transfers.Load(), FailedTransfers: m.failedTransfers.Load(), FailedNotifications: m.failedNotifs.Load(),
		ExpiredRequests: m.expired.Load(), HandshakeFailures: m.handshakeFailures.Load(),
		TotalBytes: m.totalBytes.Load(), TotalDescriptors: m.totalDescs.Load(), TotalBlocks: m.totalBlocks.Load(), Panics: m.panics.Load(),
		BadInput: m.badInput.snapshot(), Dropped: m.dropped.snapshot(), RefusedAccess: m.refused.snapshot(),
		Gates: m.gates.snapshot(),
	}
	for i := range m.outcomes {
		for j := range m.outcomes[i] {
			s.Outcomes[i][j] = m.outcomes[i][j].Load()
		}
		for j := range m.failures[i] {
			s.Failures[i][j] = m.failures[i][j].Load()
		}
	}
	return s
}

func subMap(a, b map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range a {
		if d := v - b[k]; d > 0 {
			out[k] = d
		}
	}
	return out
}

func addMap(a, b map[string]uint64) map[string]uint64 {
	out := map[string]uint64{}
	for k, v := range a {
		out[k] += v
	}
	for k, v := range b {
		out[k] += v
	}
	return out
}

// Sub returns what happened between prev and s (the reference's
// clone_and_reset, without resetting shared state).
func (s Stats) Sub(prev Stats) Stats {
	out := Stats{
		TransferSeconds: s.TransferSeconds.Sub(prev.TransferSeconds), PostSeconds: s.PostSeconds.Sub(prev.PostSeconds),
		Bytes: s.Bytes.Sub(prev.Bytes), Descriptors: s.Descriptors.Sub(prev.Descriptors),
		Amplification: s.Amplification.Sub(prev.Amplification), HandshakeSeconds: s.HandshakeSeconds.Sub(prev.HandshakeSeconds),
		Transfers: s.Transfers - prev.Transfers, FailedTransfers: s.FailedTransfers - prev.FailedTransfers,
		FailedNotifications: s.FailedNotifications - prev.FailedNotifications, ExpiredRequests: s.ExpiredRequests - prev.ExpiredRequests,
		HandshakeFailures: s.HandshakeFailures - prev.HandshakeFailures, TotalBytes: s.TotalBytes - prev.TotalBytes,
		TotalDescriptors: s.TotalDescriptors - prev.TotalDescriptors, TotalBlocks: s.TotalBlocks - prev.TotalBlocks,
		Panics:   s.Panics - prev.Panics,
		BadInput: subMap(s.BadInput, prev.BadInput), Dropped: subMap(s.Dropped, prev.Dropped),
		RefusedAccess: subMap(s.RefusedAccess, prev.RefusedAccess), Gates: subMap(s.Gates, prev.Gates),
	}
	for i := range s.Outcomes {
		for j := range s.Outcomes[i] {
			out.Outcomes[i][j] = s.Outcomes[i][j] - prev.Outcomes[i][j]
		}
		for j := range s.Failures[i] {
			out.Failures[i][j] = s.Failures[i][j] - prev.Failures[i][j]
		}
	}
	return out
}

// Add returns the sum of two snapshots (several ranks of an engine).
func (s Stats) Add(o Stats) Stats {
	out := Stats{
		TransferSeconds: s.TransferSeconds.Add(o.TransferSeconds), PostSeconds: s.PostSeconds.Add(o.PostSeconds),
		Bytes: s.Bytes.Add(o.Bytes), Descriptors: s.Descriptors.Add(o.Descriptors),
		Amplification: s.Amplification.Add(o.Amplification), HandshakeSeconds: s.HandshakeSeconds.Add(o.HandshakeSeconds),
		Transfers: s.Transfers + o.Transfers, FailedTransfers: s.FailedTransfers + o.FailedTransfers,
		FailedNotifications: s.FailedNotifications + o.FailedNotifications, ExpiredRequests: s.ExpiredRequests + o.ExpiredRequests,
		HandshakeFailures: s.HandshakeFailures + o.HandshakeFailures, TotalBytes: s.TotalBytes + o.TotalBytes,
		TotalDescriptors: s.TotalDescriptors + o.TotalDescriptors, TotalBlocks: s.TotalBlocks + o.TotalBlocks,
		Panics:   s.Panics + o.Panics,
		BadInput: addMap(s.BadInput, o.BadInput), Dropped: addMap(s.Dropped, o.Dropped),
		RefusedAccess: addMap(s.RefusedAccess, o.RefusedAccess), Gates: addMap(s.Gates, o.Gates),
	}
	for i := range s.Outcomes {
		for j := range s.Outcomes[i] {
			out.Outcomes[i][j] = s.Outcomes[i][j] + o.Outcomes[i][j]
		}
		for j := range s.Failures[i] {
			out.Failures[i][j] = s.Failures[i][j] + o.Failures[i][j]
		}
	}
	return out
}

// IsEmpty reports whether nothing succeeded, failed or expired (SPEC §10).
func (s Stats) IsEmpty() bool {
	return s.Transfers == 0 && s.FailedTransfers == 0 && s.FailedNotifications == 0 && s.ExpiredRequests == 0
}

// Summary is the reference's reduce() for a CLI line (SPEC §10).
type Summary struct {
	Transfers                          uint64
	AvgTransferMs, P90TransferMs       float64
	AvgPostMs, P90PostMs               float64
	AvgMB, MBps, AvgDescs              float64
	Amplification                      float64
	FailedTransfers, FailedNotifs      uint64
	ExpiredRequests, HandshakeFailures uint64
}

// Reduce summarises s. P90s are estimated from the histograms; MB/s is
// total MB over total transfer seconds; Amplification is total
// descriptors over total blocks.
func (s Stats) Reduce() Summary {
	out := Summary{Transfers: s.Transfers, FailedTransfers: s.FailedTransfers, FailedNotifs: s.FailedNotifications,
		ExpiredRequests: s.ExpiredRequests, HandshakeFailures: s.HandshakeFailures}
	if s.Transfers == 0 {
		return out
	}
	out.AvgTransferMs = s.TransferSeconds.Mean() * 1e3
	out.P90TransferMs = s.TransferSeconds.Quantile(0.9) * 1e3
	out.AvgPostMs = s.PostSeconds.Mean() * 1e3
	out.P90PostMs = s.PostSeconds.Quantile(0.9) * 1e3
	mb := float64(s.TotalBytes) / (1 << 20)
	out.AvgMB = mb / float64(s.Transfers)
	if s.TransferSeconds.Sum > 0 {
		out.MBps = mb / s.TransferSeconds.Sum
	}
	out.AvgDescs = float64(s.TotalDescriptors) / float64(s.Transfers)
	if s.TotalBlocks > 0 {
		out.Amplification = float64(s.TotalDescriptors) / float64(s.TotalBlocks)
	}
	return out
}
