// Package hoptrace writes kvxfer's hop events (kvxfer.HopTracer) as JSON
// lines, one per event, each stamped with CLOCK_MONOTONIC in nanoseconds:
// the clock every process of a host shares, Python's time.monotonic_ns(),
// so the lines of a P process, a D process and the engines' own can be
// merged and each hop of a transfer timed (python/tests/hoptrace.py).
// kvxferd -hop-trace FILE (libkvxfer: "hop_trace") opens one.
//
// A line:
//
//	{"t":1234567890123,"ev":"reg.sent","side":"D","engine":"D","tp":0,"pp":0,"d_req":"d-1","p_req":"p-1","tid":"t-1","call_ns":5200,"pid":4242}
//
// t is when the event happened (for a backend call, when it began; call_ns
// is how long it took); side is the rank's side of the request (P or D);
// d_req, p_req and tid name the request where known; result is an
// outcome's result or a transfer's end state; xfer_ns is the backend's
// own measure of a transfer that ended (NIXL's telemetry); empty fields
// are left out.
// A trace.start line opens each process's lines and a trace.end line,
// with the count of events dropped, closes them.
//
// Hop never blocks and never does I/O: it stamps the event and queues it
// (a bounded queue; an event that does not fit is dropped and counted); a
// goroutine of the Trace's own writes the lines, whole lines per write,
// so that processes may share one file opened for appending.
package hoptrace

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/kvxfer"
)

// DefaultQueue is the events a Trace holds for its writer by default: some
// 5 MiB. A transfer makes about ten per side.
const DefaultQueue = 1 << 15

// batchBytes is how much the writer gathers before a write.
const batchBytes = 64 << 10

// Now is CLOCK_MONOTONIC in nanoseconds (0 where it cannot be read).
func Now() int64 {
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil {
		return 0
	}
	return ts.Nano()
}

// clockPair is one instant on Go's monotonic clock (at) and on
// CLOCK_MONOTONIC (mono).
type clockPair struct {
	at   time.Time
	mono int64
}

// clockRef is the pair that maps Go's monotonic clock onto
// CLOCK_MONOTONIC (monoAt), read once per process: the closest of a few
// CLOCK_MONOTONIC reads to the Go reads either side of it. On Linux Go's
// monotonic clock is CLOCK_MONOTONIC itself from another origin, so the
// two only ever differ by that one offset.
var clockRef = sync.OnceValue(func() clockPair {
	best, gap := clockPair{}, time.Duration(1<<62)
	for range 64 {
		a := time.Now()
		m := Now()
		if d := time.Since(a); d < gap {
			best, gap = clockPair{at: a.Add(d / 2), mono: m}, d
		}
	}
	return best
})

// monoAt is t (a reading of time.Now) on CLOCK_MONOTONIC, in nanoseconds.
func monoAt(t time.Time) int64 {
	r := clockRef()
	return r.mono + int64(t.Sub(r.at))
}

// Trace is a kvxfer.HopTracer writing JSON lines. It is safe for
// concurrent use.
type Trace struct {
	w       io.Writer
	closeW  func() error // the file's Close (Open), or nil
	pid     int
	q       chan record
	dropped atomic.Uint64
	closed  atomic.Bool

	stop, done chan struct{}
	closeOnce  sync.Once
	// err is the first write error, read once done is closed.
	err error
}

var _ kvxfer.HopTracer = (*Trace)(nil)

type record struct {
	t int64
	e kvxfer.HopEvent
}

// Open appends a trace to the file at path (created, mode 0600, if it does
// not exist). Close it to write what is queued and close the file.
func Open(path string) (*Trace, error) {
	f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("hoptrace: %w", err)
	}
	t := New(f, DefaultQueue)
	t.closeW = f.Close
	return t, nil
}

// New starts a trace writing to w, queueing up to queue events (0:
// DefaultQueue). w is written from the Trace's goroutine only, and no
// more once Close returns; Close does not close it.
func New(w io.Writer, queue int) *Trace {
	if queue <= 0 {
		queue = DefaultQueue
	}
	t := &Trace{w: w, pid: os.Getpid(), q: make(chan record, queue), stop: make(chan struct{}), done: make(chan struct{})}
	start := line{T: Now(), Ev: "trace.start", PID: t.pid}
	go t.run(start)
	return t
}

// Hop implements kvxfer.HopTracer: it stamps e (an event of a backend
// call at the call's start: e.Began, else e.Call before now) and queues
// it, or drops it when the queue is full or the Trace closed.
func (t *Trace) Hop(e kvxfer.HopEvent) {
	// An event whose call began at e.Began is stamped by Go's clock alone,
	// mapped once onto CLOCK_MONOTONIC (monoAt). Before, it was stamped by
	// reading both clocks here, CLOCK_MONOTONIC through a system call: a
	// goroutine that waited to run again after it (a loaded host) stamped
	// the event that much too early, a WRITE's post before the
	// registration the loop drained to decide it (0.9 ms, in a CI run's
	// hop table: its hop was left out, and the test failed).
	var now int64
	if !e.Began.IsZero() {
		now = monoAt(e.Began)
	} else {
		now = Now() - int64(e.Call)
	}
	if t.closed.Load() {
		t.dropped.Add(1)
		return
	}
	select {
	case t.q <- record{t: now, e: e}:
	default:
		t.dropped.Add(1)
	}
}

// Dropped is the number of events dropped so far: the queue was full (the
// writer fell behind) or the Trace closed.
func (t *Trace) Dropped() uint64 { return t.dropped.Load() }

// Close writes the events queued and a trace.end line, closes the file
// (Open), and returns once the writer stopped, with the first write
// error. Events reported after it are dropped. It is idempotent.
func (t *Trace) Close() error {
	t.closeOnce.Do(func() {
		t.closed.Store(true)
		close(t.stop)
		<-t.done
		if t.closeW != nil {
			t.err = errors.Join(t.err, t.closeW())
		}
	})
	return t.err // Do returns once the first call's f returned
}

// line is one JSON line.
type line struct {
	T      int64  `json:"t"`
	Ev     string `json:"ev"`
	Side   string `json:"side,omitempty"`
	Engine string `json:"engine,omitempty"`
	TP     *int   `json:"tp,omitempty"`
	PP     *int   `json:"pp,omitempty"`
	DReq   string `json:"d_req,omitempty"`
	PReq   string `json:"p_req,omitempty"`
	TID    string `json:"tid,omitempty"`
	Result string `json:"result,omitempty"`
	CallNS int64  `json:"call_ns,omitempty"`
	XferNS int64  `json:"xfer_ns,omitempty"`
	PID    int    `json:"pid"`
	// Dropped: trace.end's count of the events dropped.
	Dropped *uint64 `json:"dropped,omitempty"`
}

func (t *Trace) lineOf(r *record) line {
	e := &r.e
	e.ResolveIDs()
	side := "D"
	if e.Side == kvxfer.RoleProducer {
		side = "P"
	}
	return line{T: r.t, Ev: e.Hop, Side: side, Engine: e.Engine, TP: &e.TPRank, PP: &e.PPRank,
		DReq: e.DReq, PReq: e.PReq, TID: e.TransferID, Result: e.Result, CallNS: int64(e.Call), XferNS: int64(e.Xfer), PID: t.pid}
}

// run is the writer: it gathers what is queued into whole lines and
// writes them, until Close, then writes what is left and trace.end.
func (t *Trace) run(start line) {
	defer close(t.done)
	var buf bytes.Buffer
	enc := json.NewEncoder(&buf)
	enc.SetEscapeHTML(false)
	_ = enc.Encode(start)
	for {
		select {
		case r := <-t.q:
			_ = enc.Encode(t.lineOf(&r))
			t.gather(enc, &buf)
			t.write(&buf)
		case <-t.stop:
			for t.gather(enc, &buf) {
				t.write(&buf)
			}
			n := t.dropped.Load()
			_ = enc.Encode(line{T: Now(), Ev: "trace.end", PID: t.pid, Dropped: &n})
			t.write(&buf)
			return
		}
	}
}

// gather encodes queued events into buf until the queue is empty
// (false) or buf holds a batch (true).
func (t *Trace) gather(enc *json.Encoder, buf *bytes.Buffer) bool {
	for buf.Len() < batchBytes {
		select {
		case r := <-t.q:
			_ = enc.Encode(t.lineOf(&r))
		default:
			return false
		}
	}
	return true
}

// write writes buf's whole lines in one call and empties it; after a
// write error nothing more is written.
func (t *Trace) write(buf *bytes.Buffer) {
	if buf.Len() > 0 && t.err == nil {
		if _, err := t.w.Write(buf.Bytes()); err != nil {
			t.err = fmt.Errorf("hoptrace: %w", err)
		}
	}
	buf.Reset()
}
