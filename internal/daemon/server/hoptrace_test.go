package server_test

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/server"
	"github.com/kvxfer/kvxfer/internal/hoptrace"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// hopLine is a line of a hop trace (internal/hoptrace).
type hopLine struct {
	T       int64   `json:"t"`
	Ev      string  `json:"ev"`
	Side    string  `json:"side"`
	Engine  string  `json:"engine"`
	TP      *int    `json:"tp"`
	PP      *int    `json:"pp"`
	DReq    string  `json:"d_req"`
	PReq    string  `json:"p_req"`
	TID     string  `json:"tid"`
	Result  string  `json:"result"`
	CallNS  int64   `json:"call_ns"`
	PID     int     `json:"pid"`
	Dropped *uint64 `json:"dropped"`
}

// The hops each side of a transfer passes, in the order it passes them,
// by mode: every one once per request, stamped in this order.
var wantHops = map[kvxfer.Mode]map[string][]string{
	kvxfer.ModePush: {
		"D": {kvxfer.HopRecvStep, kvxfer.HopRecvLoop, kvxfer.HopRegSent, kvxfer.HopDoneRecv, kvxfer.HopOutcome, kvxfer.HopOutcomeSent},
		// P's step came first (the test steps P, then D); its WRITE goes
		// once the registration came.
		"P": {kvxfer.HopSendStep, kvxfer.HopSendLoop, kvxfer.HopRegRecv, kvxfer.HopWritePost, kvxfer.HopWriteDone, kvxfer.HopOutcome, kvxfer.HopOutcomeSent},
	},
	kvxfer.ModePull: {
		"D": {kvxfer.HopRecvStep, kvxfer.HopRecvLoop, kvxfer.HopReadPost, kvxfer.HopReadDone, kvxfer.HopOutcome, kvxfer.HopOutcomeSent},
		"P": {kvxfer.HopSendStep, kvxfer.HopSendLoop, kvxfer.HopDoneRecv, kvxfer.HopOutcome, kvxfer.HopOutcomeSent},
	},
}

// Across the sides: the first happens before the second (one host, one
// CLOCK_MONOTONIC).
var wantCross = map[kvxfer.Mode][][2][2]string{
	kvxfer.ModePush: {
		{{"D", kvxfer.HopRegSent}, {"P", kvxfer.HopRegRecv}},
		{{"P", kvxfer.HopWritePost}, {"D", kvxfer.HopDoneRecv}},
	},
	kvxfer.ModePull: {
		{{"P", kvxfer.HopSendLoop}, {"D", kvxfer.HopRecvStep}},
		{{"D", kvxfer.HopReadPost}, {"P", kvxfer.HopDoneRecv}},
	},
}

// TestHopTrace: two daemons with a hop trace each (kvxferd -hop-trace)
// move requests in push and pull; every request passes every hop of its
// side once, in order, each event naming its engine, rank and the
// request's ids (D's, P's and the transfer's, where the point knows
// them), its timestamps on CLOCK_MONOTONIC non-decreasing along the path
// and across the sides; nothing is dropped.
func TestHopTrace(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			before := runtime.NumGoroutine()
			t.Run("run", func(t *testing.T) { runHopTrace(t, mode) }) // its cleanups end with it
			leakcheck.Check(t, before, 2, 10*time.Second)
		})
	}
}

func runHopTrace(t *testing.T, mode kvxfer.Mode) {
	shmDir := t.TempDir()
	var pBuf, dBuf bytes.Buffer
	pTrace, dTrace := hoptrace.New(&pBuf, 0), hoptrace.New(&dBuf, 0)
	t.Cleanup(func() { _, _ = pTrace.Close(), dTrace.Close() })
	traced := func(tr *hoptrace.Trace) func(*server.Config) {
		return func(c *server.Config) { c.WorkerConfig = func(wc *kvxfer.WorkerConfig) { wc.HopTrace = tr } }
	}
	t0 := hoptrace.Now()
	dp, dd := startDaemonWith(t, shmDir, traced(pTrace)), startDaemonWith(t, shmDir, traced(dTrace))
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention, topology.KindFullAttention}, TotalKVHeads: 2, HeadSize: 8, ElemBytes: 2}
	eng := func(id int) kvsim.Engine {
		return kvsim.Engine{ID: id, TP: 1, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 32}
	}
	P := attach(t, dp, shmDir, "P", &model, eng(1), mode)
	D := attach(t, dd, shmDir, "D", &model, eng(2), mode)
	const n = 5
	now := time.Now()
	var pm, dm kvxfer.StepMeta
	pm.SchedulerClock, dm.SchedulerClock = now, now
	for i := range n {
		ps := []topology.Span{{IDs: []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}}}
		ds := []topology.Span{{IDs: []topology.BlockID{topology.BlockID(31 - 2*i), topology.BlockID(30 - 2*i)}}}
		id := fmt.Sprint(i)
		pm.Send = append(pm.Send, kvxfer.SendReq{ReqID: "p-" + id, TransferID: "t-" + id, Deadline: now.Add(30 * time.Second), Blocks: ps, Tokens: 32})
		rr := kvxfer.RecvReq{ReqID: "d-" + id, TransferID: "t-" + id, Local: ds, Deadline: now.Add(time.Minute),
			Remote: kvxfer.RemoteRef{EngineID: "P", Addr: dp.peerAddr, ReqID: "p-" + id, TPSize: 1, Tokens: 32}}
		if mode == kvxfer.ModePull {
			rr.Remote.Blocks = ps
		}
		dm.Recv = append(dm.Recv, rr)
	}
	P.step(t, &pm)
	waitSends(t, dp, "P", n) // P's loop holds the sends before D steps (pull: its READs find them)
	D.step(t, &dm)
	for id, os := range P.collect(t, n, true) {
		if len(os) != 1 || os[0].Result != kvxfer.ResultDone {
			t.Errorf("P %s: outcomes %+v", id, os)
		}
	}
	for id, os := range D.collect(t, n, false) {
		if len(os) != 1 || os[0].Result != kvxfer.ResultDone {
			t.Errorf("D %s: outcomes %+v", id, os)
		}
	}
	P.close(t)
	D.close(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, d := range []*daemon{dp, dd} {
		if err := d.srv.Drain(ctx); err != nil { // every worker closed: nothing more to trace
			t.Fatal(err)
		}
	}
	for _, tr := range []*hoptrace.Trace{pTrace, dTrace} {
		if err := tr.Close(); err != nil {
			t.Fatal(err)
		}
	}
	t1 := hoptrace.Now()

	// at[side][req][hop]: the times of each event of a request.
	at := map[string]map[string]map[string][]int64{"P": {}, "D": {}}
	for _, s := range []struct {
		side string
		buf  *bytes.Buffer
	}{{"P", &pBuf}, {"D", &dBuf}} {
		lines := parseHops(t, s.buf)
		if first, last := lines[0], lines[len(lines)-1]; first.Ev != "trace.start" || last.Ev != "trace.end" || last.Dropped == nil || *last.Dropped != 0 {
			t.Errorf("%s's trace: first line %+v, last %+v; want trace.start, then trace.end with dropped 0", s.side, first, last)
		}
		for _, l := range lines[1 : len(lines)-1] {
			if l.T < t0 || l.T > t1 {
				t.Errorf("%s: %+v: t outside the test's [%d, %d] on CLOCK_MONOTONIC", s.side, l, t0, t1)
			}
			if l.Side != s.side || l.Engine != s.side || l.TP == nil || *l.TP != 0 || l.PP == nil || *l.PP != 0 {
				t.Errorf("%s: %+v: want side and engine %s, tp 0, pp 0", s.side, l, s.side)
			}
			req := l.DReq
			if s.side == "P" {
				req = l.PReq
			}
			i, ok := strings.CutPrefix(req, strings.ToLower(s.side)+"-")
			if !ok {
				t.Errorf("%s: %+v names no request of its side", s.side, l)
				continue
			}
			// What each event knows of the request's ids: a step names them
			// all, a message or a transfer (its notification) too, an
			// outcome its own side's id only.
			want := hopLine{DReq: "d-" + i, PReq: "p-" + i, TID: "t-" + i}
			switch {
			case l.Ev == kvxfer.HopOutcome || l.Ev == kvxfer.HopOutcomeSent:
				want.TID = ""
				if s.side == "P" {
					want.DReq = ""
				} else {
					want.PReq = ""
				}
				if l.Result != "done" {
					t.Errorf("%s: %+v: result %q, want done", s.side, l, l.Result)
				}
			case l.Ev == kvxfer.HopSendStep || l.Ev == kvxfer.HopSendLoop:
				want.DReq = ""
			}
			if l.DReq != want.DReq || l.PReq != want.PReq || l.TID != want.TID {
				t.Errorf("%s: %+v: ids d_req %q p_req %q tid %q, want %q %q %q", s.side, l, l.DReq, l.PReq, l.TID, want.DReq, want.PReq, want.TID)
			}
			if at[s.side][req] == nil {
				at[s.side][req] = map[string][]int64{}
			}
			at[s.side][req][l.Ev] = append(at[s.side][req][l.Ev], l.T)
		}
	}
	for i := range n {
		ids := map[string]string{"P": fmt.Sprint("p-", i), "D": fmt.Sprint("d-", i)}
		for side, hops := range wantHops[mode] {
			got := at[side][ids[side]]
			var prev int64
			for _, h := range hops {
				ts := got[h]
				if len(ts) != 1 {
					t.Errorf("%s %s: %d %s events, want 1", side, ids[side], len(ts), h)
					continue
				}
				if ts[0] < prev {
					t.Errorf("%s %s: %s at %d, before the hop before it (%d); want the order %v", side, ids[side], h, ts[0], prev, hops)
				}
				prev = ts[0]
			}
			for h := range got {
				if !slices.Contains(hops, h) {
					t.Errorf("%s %s: an unexpected %s event (%d)", side, ids[side], h, len(got[h]))
				}
			}
		}
		for _, c := range wantCross[mode] {
			a, b := at[c[0][0]][ids[c[0][0]]][c[0][1]], at[c[1][0]][ids[c[1][0]]][c[1][1]]
			if len(a) == 1 && len(b) == 1 && a[0] > b[0] {
				t.Errorf("request %d: %s %s at %d after %s %s at %d", i, c[0][0], c[0][1], a[0], c[1][0], c[1][1], b[0])
			}
		}
	}
}

// waitSends waits until engine's worker on d holds n producer requests.
func waitSends(t *testing.T, d *daemon, engine string, n int) {
	t.Helper()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if ws := d.srv.Workers()[engine]; len(ws) == 1 {
			if st, err := ws[0].State(); err == nil && st.Sends == n {
				return
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s's worker did not take its %d sends in 10 s", engine, n)
		}
		time.Sleep(time.Millisecond)
	}
}

func parseHops(t *testing.T, b *bytes.Buffer) []hopLine {
	t.Helper()
	var out []hopLine
	sc := bufio.NewScanner(b)
	for sc.Scan() {
		var l hopLine
		if err := json.Unmarshal(sc.Bytes(), &l); err != nil {
			t.Fatalf("line %q: %v", sc.Text(), err)
		}
		out = append(out, l)
	}
	if len(out) < 2 {
		t.Fatalf("a trace of %d lines", len(out))
	}
	return out
}
