package simengine_test

import (
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// TestMain lets daemontest.Start run this test binary as a kvxferd.
func TestMain(m *testing.M) {
	daemontest.ServeIfChild()
	os.Exit(m.Run())
}

var model = kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention, topology.KindFullAttention}, TotalKVHeads: 4, HeadSize: 8, ElemBytes: 2}

func engine(id, tp int) kvsim.Engine {
	return kvsim.Engine{ID: id, TP: tp, PP: 1, LogicalBlock: 16, KernelBlock: 16, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: 32}
}

// waitOutcome steps the engine until its ranks report an outcome for req
// (bounded: 10 s).
func waitOutcome(e *simengine.Engine, req string) (kvxfer.Outcome, error) {
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); {
		if err := e.Step(e.Sched.BuildMeta()); err != nil {
			return kvxfer.Outcome{}, err
		}
		for i, rs := range e.Streams {
			select {
			case f := <-rs.Finished():
				out, err := e.Fold(i, &f)
				if err != nil {
					return kvxfer.Outcome{}, err
				}
				if out == nil {
					continue
				}
				for _, o := range append(out.Sending, out.Recving...) {
					if o.ReqID == req {
						return o, nil
					}
				}
			case <-time.After(5 * time.Millisecond):
			}
		}
		if err := e.StepError(); err != nil {
			return kvxfer.Outcome{}, err
		}
	}
	return kvxfer.Outcome{}, fmt.Errorf("no outcome for %s in 10 s", req)
}

// Two engines attached to two kvxferd processes move one request's KV in
// push mode (P TP 2 into D TP 1); the bytes arrive, and Close leaves no
// shared memory and no goroutine behind.
func TestAttachPushAndClose(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	before := runtime.NumGoroutine()
	dir := t.TempDir()
	p, err := daemontest.Start(dir, "P", "builtin")
	if err != nil {
		t.Fatal(err)
	}
	defer p.Stop()
	d, err := daemontest.Start(dir, "D", "builtin")
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	m := model
	P, err := simengine.Attach(simengine.Config{Dir: dir, Sock: p.Sock, Peer: p.Peer, ID: "P", Model: &m, Engine: engine(1, 2),
		Mode: kvxfer.ModePush, Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	D, err := simengine.Attach(simengine.Config{Dir: dir, Sock: d.Sock, Peer: d.Peer, ID: "D", Model: &m, Engine: engine(2, 1),
		Mode: kvxfer.ModePush, Version: "test"})
	if err != nil {
		P.Close()
		t.Fatal(err)
	}
	if len(P.Ranks) != 2 || len(P.Streams) != 2 || len(D.Ranks) != 1 {
		t.Fatalf("P has %d ranks and %d streams, D %d ranks", len(P.Ranks), len(P.Streams), len(D.Ranks))
	}
	for _, name := range []string{"P-tp0", "P-tp1", "D-tp0"} {
		if _, err := os.Stat(filepath.Join(dir, name)); err != nil {
			t.Errorf("shared memory %s: %v", name, err)
		}
	}
	const tokens = 40
	pIDs, dIDs := []topology.BlockID{3, 4, 9}, []topology.BlockID{7, 1, 2}
	dReq := &kvxfer.Request{ID: "d-1", PromptTokens: tokens, Params: &kvxfer.TransferParams{TransferID: "t1", DoRemotePrefill: true,
		RemoteEngineID: "P", RemoteAddr: p.Peer, RemoteTPSize: 2}}
	ext, _ := D.Sched.MatchedTokens(dReq, 0)
	if err := D.Sched.AfterAlloc(dReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{dIDs}, External: ext}); err != nil {
		t.Fatal(err)
	}
	if err := D.Step(D.Sched.BuildMeta()); err != nil { // D registers first
		t.Fatal(err)
	}
	for _, r := range P.Ranks {
		r.FillSalt([]topology.Span{{IDs: pIDs}}, 9)
	}
	pReq := &kvxfer.Request{ID: "p-1", PromptTokens: tokens, Params: &kvxfer.TransferParams{TransferID: "t1", DoRemoteDecode: true}}
	if err := P.Sched.AfterAlloc(pReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{pIDs}}); err != nil {
		t.Fatal(err)
	}
	if delay, _, err := P.Sched.RequestFinished(pReq, kvxfer.FinishLengthCapped, [][]topology.BlockID{pIDs}, tokens); err != nil || !delay {
		t.Fatalf("RequestFinished = %v, %v", delay, err)
	}
	type res struct {
		o   kvxfer.Outcome
		err error
	}
	pDone := make(chan res, 1)
	go func() { // P steps until it reports its side
		o, err := waitOutcome(P, "p-1")
		pDone <- res{o, err}
	}()
	o, err := waitOutcome(D, "d-1")
	if err != nil || o.Result != kvxfer.ResultDone {
		t.Errorf("D outcome %+v, %v", o, err)
	}
	if r := <-pDone; r.err != nil || r.o.Result != kvxfer.ResultDone {
		t.Errorf("P outcome %+v, %v", r.o, r.err)
	}
	want := &kvsim.Request{Tokens: tokens, Salt: 9, P: []topology.Span{{IDs: pIDs}}, D: []topology.Span{{IDs: dIDs}}}
	if err := D.Ranks[0].CheckRequest(want, 16, 16); err != nil {
		t.Errorf("D's bytes: %v", err)
	}
	// A wrong salt must not pass: the check really reads the bytes.
	want.Salt = 10
	if err := D.Ranks[0].CheckRequest(want, 16, 16); err == nil {
		t.Error("the bytes matched another request's pattern")
	}
	if err := D.Close(); err != nil {
		t.Errorf("D.Close: %v", err)
	}
	if err := P.Close(); err != nil {
		t.Errorf("P.Close: %v", err)
	}
	for _, rs := range append(P.Streams, D.Streams...) {
		if _, open := <-rs.Finished(); open {
			t.Error("a rank's Finished channel is open after Close")
		}
	}
	left, _ := filepath.Glob(filepath.Join(dir, "*-tp*"))
	if len(left) > 0 {
		t.Errorf("shared memory left after Close: %v", left)
	}
	leakcheck.Check(t, before, 2, 5*time.Second)
}

// A daemon that is not there: Attach fails, naming it, and leaves no
// shared memory behind.
func TestAttachFailsCleanly(t *testing.T) {
	dir := t.TempDir()
	m := model
	_, err := simengine.Attach(simengine.Config{Dir: dir, Sock: filepath.Join(dir, "nobody.sock"), ID: "X", Model: &m, Engine: engine(1, 2),
		Mode: kvxfer.ModePush, Version: "test"})
	if err == nil || !strings.Contains(err.Error(), "attach X rank 0") {
		t.Fatalf("Attach to no daemon: %v", err)
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "X-*")); len(left) > 0 {
		t.Errorf("shared memory left after a failed Attach: %v", left)
	}
	bad := engine(1, 3) // 4 KV heads do not split over TP 3
	if _, err := simengine.Attach(simengine.Config{Dir: dir, Sock: filepath.Join(dir, "nobody.sock"), ID: "Y", Model: &m, Engine: bad}); err == nil {
		t.Error("Attach accepted TP 3 for 4 KV heads")
	}
}
