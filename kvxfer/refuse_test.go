package kvxfer_test

import (
	"log/slog"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// hndToNHD is a P engine with HND blocks and a D engine with NHD blocks:
// exact placement needs one descriptor per (head, token) cell, 4 heads ·
// 16 tokens = 64 per unit.
func hndToNHD() (p, d kvsim.Engine) {
	p, d = e2eEngine(1, 1, 1, 16, 16), e2eEngine(2, 1, 1, 16, 16)
	d.Layout = topology.LayoutNHD
	return p, d
}

const (
	hndDesc = "producer engine P rank tp 0 pp 0 [HND/packed, block 16, head size 4, 4 KV heads, TP 1]"
	nhdDesc = "consumer engine D rank tp 0 pp 0 [NHD/packed, block 16, head size 4, 4 KV heads, TP 1]"
)

func (l *logRecorder) count(msg string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	n := 0
	for _, r := range l.recs {
		if r["msg"] == msg {
			n++
		}
	}
	return n
}

const refusedMsg = "kvxfer: peer engine refused: incompatible KV layouts; every request with it in this role fails"

// A P/D pair whose layouts cannot be transferred within the descriptor
// bound is refused when the consumer handshakes: every request fails at
// once on both sides, with one error naming both layouts and what to do,
// logged and counted once; nothing is posted and nothing is left held.
func TestIncompatibleLayoutsRefusedAtHandshake(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				logs := &logRecorder{}
				pe, de := hndToNHD()
				x := newPairOf(t, mode, pe, de, func(side string, c *kvxfer.WorkerConfig) {
					c.MaxSegments = 32
					if side == "D" {
						c.Logger = slog.New(logs)
					}
				})
				qs := []*xreq{x.req("r1", 40, 0), x.req("r2", 20, 0), x.req("r3", 33, 0)}
				x.sendP(qs...)
				x.recvD(qs[0], qs[1]) // these wait for the handshake
				x.settle()
				x.recvD(qs[2]) // this one finds the refusal cached
				x.settle()
				if d := x.recvResult(qs[0]); len(d) == 1 {
					t.Logf("refusal: %s", d[0].Reason)
				}
				for _, q := range qs {
					d := x.recvResult(q)
					wantResult(t, "D "+q.id, d, kvxfer.ResultFailed, "kvxfer: incompatible KV layouts: "+hndDesc+" -> "+nhdDesc)
					for _, want := range []string{"more than 32 descriptors per 16-token unit", "same KV cache layout (HND on both",
						"WorkerConfig.MaxSegments", "-max-segments", "KVXFERD_MAX_SEGMENTS", "now 32"} {
						if len(d) == 1 && !strings.Contains(d[0].Reason, want) {
							t.Errorf("D %s reason = %q, want it to contain %q", q.id, d[0].Reason, want)
						}
					}
					// P fails at once too, with D's reason.
					wantResult(t, "P "+q.id, x.sendResult(q), kvxfer.ResultFailed, hndDesc+" -> "+nhdDesc)
				}
				if n := x.posted(); n != 0 {
					t.Errorf("posted %d transfers between refused layouts, want 0", n)
				}
				if s := x.state(x.d); s.Recvs != 0 {
					t.Errorf("D still receives %d requests, want 0", s.Recvs)
				}
				if s := x.state(x.p); s.Sends != 0 || s.Matches != 0 {
					t.Errorf("P still holds %d requests (%d matched), want 0", s.Sends, s.Matches)
				}
				if got := x.d.workers[0][0].Metrics().Snapshot().BadInput["handshake.layout"]; got != 1 {
					t.Errorf(`D BadInput["handshake.layout"] = %d, want 1 (once per peer generation)`, got)
				}
				if got := logs.count(refusedMsg); got != 1 {
					t.Errorf("D logged the refusal %d times, want once", got)
				}
				if got := logs.count("kvxfer: transfer failure"); got != 0 {
					t.Errorf("D logged %d per-request failures, want none (the refusal is logged once)", got)
				}
			})
		})
	}
}

// When only the producer refuses (its bound is lower than the consumer's),
// it refuses on the first registration: each request fails at once on
// both sides with its error, logged once on P.
func TestIncompatibleLayoutsRefusedByProducer(t *testing.T) {
	inSynctest(t, func(t *testing.T) {
		logs := &logRecorder{}
		pe, de := hndToNHD()
		x := newPairOf(t, kvxfer.ModePush, pe, de, func(side string, c *kvxfer.WorkerConfig) {
			c.MaxSegments = 64
			if side == "P" {
				c.MaxSegments, c.Logger = 32, slog.New(logs)
			}
		})
		qs := []*xreq{x.req("r1", 40, 0), x.req("r2", 20, 0)}
		x.sendP(qs...)
		x.recvD(qs...)
		x.settle()
		for _, q := range qs {
			wantResult(t, "P "+q.id, x.sendResult(q), kvxfer.ResultFailed, "consumer rank 0: kvxfer: incompatible KV layouts: "+hndDesc+" -> "+nhdDesc)
			wantResult(t, "D "+q.id, x.recvResult(q), kvxfer.ResultFailed, "more than 32 descriptors per 16-token unit")
		}
		if n := x.posted(); n != 0 {
			t.Errorf("posted %d transfers between refused layouts, want 0", n)
		}
		if s := x.state(x.p); s.Sends != 0 || s.Matches != 0 {
			t.Errorf("P still holds %d requests (%d matched), want 0", s.Sends, s.Matches)
		}
		if s := x.state(x.d); s.Recvs != 0 {
			t.Errorf("D still receives %d requests, want 0", s.Recvs)
		}
		if got := x.p.workers[0][0].Metrics().Snapshot().BadInput["handshake.layout"]; got != 1 {
			t.Errorf(`P BadInput["handshake.layout"] = %d, want 1`, got)
		}
		if got, per := logs.count(refusedMsg), logs.count("kvxfer: transfer failure"); got != 1 || per != 0 {
			t.Errorf("P logged the refusal %d times and %d per-request failures, want 1 and 0", got, per)
		}
	})
}

// Raising WorkerConfig.MaxSegments on both engines admits the same pair:
// every byte lands in D's NHD blocks.
func TestRaisedMaxSegmentsAdmitsLayouts(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			inSynctest(t, func(t *testing.T) {
				pe, de := hndToNHD()
				x := newPairOf(t, mode, pe, de, func(side string, c *kvxfer.WorkerConfig) {
					c.MaxSegments = 64
				})
				qs := []*xreq{x.req("r1", 40, 0), x.req("r2", 20, 0)}
				dr := x.d.ranks[0][0]
				dr.Scramble(9)
				before := dr.Snapshot()
				x.sendP(qs...)
				x.recvD(qs...)
				x.settle()
				var sims []*kvsim.Request
				for _, q := range qs {
					wantResult(t, "P "+q.id, x.sendResult(q), kvxfer.ResultDone, "")
					wantResult(t, "D "+q.id, x.recvResult(q), kvxfer.ResultDone, "")
					sims = append(sims, &q.sim)
				}
				if err := dr.CheckValues(before, sims, pe.KernelBlock, pe.LogicalBlock); err != nil {
					t.Error(err)
				}
			})
		})
	}
}

func TestWorkerConfigMaxSegments(t *testing.T) {
	fab, dir := newFabricDir()
	a, err := fab.NewAgent("x")
	if err != nil {
		t.Fatal(err)
	}
	mem := a.Alloc(256, 0)
	l := topology.Layout{TPSize: 1, PPSize: 1, TotalKVHeads: 1, HeadSize: 4, ElemBytes: 2,
		KVLayout: topology.LayoutHND, Packing: topology.PackedKV, LogicalBlockSize: 16, KernelBlockSize: 16,
		Regions: []topology.Region{{Kind: topology.KindFullAttention, Base: mem.Addr, BlockLen: 256, NumBlocks: 1}}}
	_, err = kvxfer.NewWorker(kvxfer.WorkerConfig{EngineID: "E", Mode: kvxfer.ModePush, Layout: l, Backend: a, Resolver: dir, MaxSegments: -1})
	if err == nil || !strings.Contains(err.Error(), "WorkerConfig.MaxSegments = -1") {
		t.Errorf("NewWorker(MaxSegments -1) error = %v, want one naming WorkerConfig.MaxSegments", err)
	}
}
