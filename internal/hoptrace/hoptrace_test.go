package hoptrace

import (
	"bufio"
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/kvxfer/kvxfer/kvxfer"
)

func lines(t *testing.T, b []byte) []map[string]any {
	t.Helper()
	var out []map[string]any
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		var m map[string]any
		if err := json.Unmarshal(sc.Bytes(), &m); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		out = append(out, m)
	}
	return out
}

// A line carries every field of its event, empty ones left out; an event
// of a backend call is stamped when the call began; t is CLOCK_MONOTONIC.
func TestLine(t *testing.T) {
	var buf bytes.Buffer
	tr := New(&buf, 0)
	before := Now()
	tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopRegSent, Side: kvxfer.RoleConsumer, Engine: "D", TPRank: 1, PPRank: 2, DReq: "d-1", PReq: "p-1",
		TransferID: "t-1", Call: 50 * time.Millisecond})
	tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopWriteDone, Side: kvxfer.RoleProducer, Engine: "P", PReq: "p-1", Result: "done", Xfer: 2 * time.Millisecond})
	after := Now()
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	var ts unix.Timespec
	if err := unix.ClockGettime(unix.CLOCK_MONOTONIC, &ts); err != nil || ts.Nano() < after {
		t.Fatalf("CLOCK_MONOTONIC = %d (%v), want >= Now() %d", ts.Nano(), err, after)
	}
	ls := lines(t, buf.Bytes())
	if len(ls) != 4 || ls[0]["ev"] != "trace.start" || ls[3]["ev"] != "trace.end" || ls[3]["dropped"] != 0.0 {
		t.Fatalf("lines = %v, want trace.start, two events, trace.end with dropped 0", ls)
	}
	pid := float64(os.Getpid())
	reg, out := ls[1], ls[2]
	want := map[string]any{"ev": "reg.sent", "side": "D", "engine": "D", "tp": 1.0, "pp": 2.0, "d_req": "d-1", "p_req": "p-1", "tid": "t-1",
		"call_ns": 5e7, "pid": pid}
	for k, v := range want {
		if reg[k] != v {
			t.Errorf("reg.sent line %v: %s = %v, want %v", reg, k, reg[k], v)
		}
	}
	if at := int64(reg["t"].(float64)); at > after-int64(50*time.Millisecond) || at < before-int64(50*time.Millisecond)-int64(time.Millisecond) {
		t.Errorf("reg.sent t = %d, want its call's start: in [%d, %d] less 50 ms", at, before, after)
	}
	if _, ok := reg["xfer_ns"]; ok {
		t.Errorf("reg.sent line %v has xfer_ns, want it left out (0)", reg)
	}
	for _, k := range []string{"d_req", "tid", "call_ns"} {
		if _, ok := out[k]; ok {
			t.Errorf("write.done line %v has %s, want it left out (empty)", out, k)
		}
	}
	if out["side"] != "P" || out["result"] != "done" || out["tp"] != 0.0 || out["xfer_ns"] != 2e6 {
		t.Errorf("write.done line %v: want side P, result done, tp 0, xfer_ns 2e6", out)
	}
}

// blockingWriter blocks every Write until release is closed, saying on
// entered when the first began.
type blockingWriter struct {
	entered, release chan struct{}
	once             sync.Once
	mu               sync.Mutex
	buf              bytes.Buffer
}

func (w *blockingWriter) Write(b []byte) (int, error) {
	w.once.Do(func() { close(w.entered) })
	<-w.release
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.buf.Write(b)
}

// Hop never waits for the writer: past the queue's capacity events are
// dropped and counted (Dropped, and trace.end's count); once the writer
// catches up, Close writes what was queued.
func TestDropsWhenFull(t *testing.T) {
	w := &blockingWriter{entered: make(chan struct{}), release: make(chan struct{})}
	tr := New(w, 4)
	tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopRecvStep, DReq: "first"})
	<-w.entered // the writer holds the first event, stuck writing it
	const n = 100
	done := make(chan struct{})
	go func() {
		for range n {
			tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopRecvStep, DReq: "d"})
		}
		close(done)
	}()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("Hop blocked on a writer that does not write")
	}
	if got := tr.Dropped(); got != n-4 {
		t.Errorf("Dropped() = %d of %d events past a queue of 4, want %d", got, n, n-4)
	}
	close(w.release)
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	ls := lines(t, w.buf.Bytes())
	if end := ls[len(ls)-1]; end["ev"] != "trace.end" || end["dropped"] != float64(n-4) {
		t.Errorf("last line %v, want trace.end with dropped %d", end, n-4)
	}
	if got := len(ls) - 2; got != 1+4 {
		t.Errorf("%d events written, want 5 (the first and the 4 queued)", got)
	}
}

// Close is idempotent and safe to call concurrently; an event after it is
// dropped, not written and not a panic.
func TestClose(t *testing.T) {
	var buf bytes.Buffer
	tr := New(&buf, 0)
	tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopRecvStep})
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			if err := tr.Close(); err != nil {
				t.Error(err)
			}
		})
	}
	wg.Wait()
	n := buf.Len()
	tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopRecvStep})
	if buf.Len() != n || tr.Dropped() != 1 {
		t.Errorf("after Close: %d bytes more, Dropped() = %d; want none written, 1 dropped", buf.Len()-n, tr.Dropped())
	}
}

// Two traces appending to one file (two processes' servers given the same
// -hop-trace) leave whole lines: each write is of whole lines.
func TestOpenAppends(t *testing.T) {
	path := filepath.Join(t.TempDir(), "hops.jsonl")
	var trs []*Trace
	for range 2 {
		tr, err := Open(path)
		if err != nil {
			t.Fatal(err)
		}
		trs = append(trs, tr)
	}
	const n = 2000
	var wg sync.WaitGroup
	for _, tr := range trs {
		wg.Go(func() {
			for range n {
				tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopOutcome, Engine: "an-engine-with-a-long-name", DReq: "a-request-with-a-long-id"})
				if tr.Dropped() > 0 {
					time.Sleep(time.Microsecond)
				}
			}
		})
	}
	wg.Wait()
	var dropped uint64
	for _, tr := range trs {
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
		dropped += tr.Dropped()
	}
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if st, err := os.Stat(path); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("mode %v (%v), want 0600", st.Mode(), err)
	}
	ls := lines(t, b) // fails on a torn line
	if got := uint64(len(ls)); got != 2*(n+2)-dropped {
		t.Errorf("%d lines, want %d (%d dropped)", got, 2*(n+2)-dropped, dropped)
	}
	if _, err := Open(filepath.Join(t.TempDir(), "no", "such", "dir")); err == nil {
		t.Error("Open in a missing directory: no error")
	}
}

// An event that says when its call began is stamped then, however long
// after the call the reporting goroutine ran: before, the stamp was the
// report's time less the call's length, so a goroutine kept 40 ms from
// running between the call's end and its report put a message's sending
// 40 ms late, after its receipt on the other side (TestHopTrace failed so
// on a loaded host).
func TestStampedWhenTheCallBegan(t *testing.T) {
	var buf bytes.Buffer
	tr := New(&buf, 0)
	lo := Now()
	began := time.Now()
	hi := Now()
	time.Sleep(time.Millisecond) // the call
	call := time.Since(began)
	time.Sleep(100 * time.Millisecond) // the goroutine kept from running
	tr.Hop(kvxfer.HopEvent{Hop: kvxfer.HopRegSent, Side: kvxfer.RoleConsumer, Engine: "D", DReq: "d-1", Call: call, Began: began})
	if err := tr.Close(); err != nil {
		t.Fatal(err)
	}
	ls := lines(t, buf.Bytes())
	if len(ls) != 3 {
		t.Fatalf("lines = %v, want one event", ls)
	}
	// (Go's clock mapped onto CLOCK_MONOTONIC once, by the closest of 64
	// pairs of reads: microseconds; 5 ms allowed for a first mapping on a
	// loaded host, against 100 ms before.)
	if got := int64(ls[1]["t"].(float64)); got < lo-int64(5*time.Millisecond) || got > hi+int64(5*time.Millisecond) {
		t.Errorf("reg.sent stamped %v after its call began; want when it began", time.Duration(got-hi))
	}
	if ls[1]["call_ns"] != float64(call) {
		t.Errorf("call_ns = %v, want %d", ls[1]["call_ns"], call)
	}
}

// Go's clock maps onto CLOCK_MONOTONIC: a time.Now read between two
// CLOCK_MONOTONIC reads maps between them, whenever it is mapped (Hop
// maps an event's Began when it reports it, however long after).
func TestMonoAt(t *testing.T) {
	for range 100 {
		lo := Now()
		at := time.Now()
		hi := Now()
		time.Sleep(100 * time.Microsecond)
		if got := monoAt(at); got < lo-int64(time.Millisecond) || got > hi+int64(time.Millisecond) {
			t.Fatalf("monoAt = %d, want within [%d, %d] (1 ms either side)", got, lo, hi)
		}
	}
}
