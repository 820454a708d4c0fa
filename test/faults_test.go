package test

import (
	"net"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// freeAddr returns a loopback address nothing listens on now (for a
// daemon that must come back on the same address).
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	return addr
}

// registerD schedules a D request for the push producer P at pAddr: D's
// scheduler matches it, allocates its blocks, and the step registers them
// with P.
func registerD(t *testing.T, D *simengine.Engine, id, tid, pAddr string, ids []topology.BlockID) {
	t.Helper()
	req := &kvxfer.Request{ID: id, PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: tid, DoRemotePrefill: true,
		RemoteEngineID: "P", RemoteAddr: pAddr, RemoteTPSize: 1}}
	ext, _ := D.Sched.MatchedTokens(req, 0)
	if err := D.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}, External: ext}); err != nil {
		t.Fatal(err)
	}
	if err := D.Step(D.Sched.BuildMeta()); err != nil {
		t.Fatal(err)
	}
}

// finishP hands P's scheduler a finished request to keep for D.
func finishP(t *testing.T, P *simengine.Engine, id, tid string, ids []topology.BlockID) {
	t.Helper()
	req := &kvxfer.Request{ID: id, PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: tid, DoRemoteDecode: true}}
	if err := P.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}}); err != nil {
		t.Fatal(err)
	}
	if _, _, err := P.Sched.RequestFinished(req, kvxfer.FinishLengthCapped, [][]topology.BlockID{ids}, 32); err != nil {
		t.Fatal(err)
	}
}

// outcomesOf steps e until its ranks reported every request of ids, or
// within passed, and returns the outcomes reported (each exactly once:
// a second report of one is an error outcome).
func outcomesOf(e *simengine.Engine, within time.Duration, ids ...string) map[string]kvxfer.Outcome {
	got := map[string]kvxfer.Outcome{}
	for deadline := time.Now().Add(within); len(got) < len(ids) && time.Now().Before(deadline); {
		if err := e.Step(e.Sched.BuildMeta()); err != nil {
			return got
		}
		for i, rs := range e.Streams {
			select {
			case f := <-rs.Finished():
				out, err := e.Fold(i, &f)
				if err != nil || out == nil {
					continue
				}
				for _, o := range append(out.Sending, out.Recving...) {
					if _, twice := got[o.ReqID]; twice {
						o = kvxfer.Outcome{ReqID: o.ReqID, Result: kvxfer.ResultFailed, Reason: "reported twice"}
					}
					got[o.ReqID] = o
				}
			case <-time.After(5 * time.Millisecond):
			}
		}
	}
	return got
}

func attachSim(t *testing.T, dir, sock, peer, id string, eng int, mode kvxfer.Mode) *simengine.Engine {
	t.Helper()
	m := simModel
	e, err := simengine.Attach(simengine.Config{Dir: dir, Sock: sock, Peer: peer, ID: id, Model: &m, Engine: simEngine(eng, 1),
		Mode: mode, Version: "test"})
	if err != nil {
		t.Fatal(err)
	}
	return e
}

// The P daemon is SIGKILLed while D requests wait on it (registered,
// their WRITEs never coming): each ends failed within 10 s, with a reason
// naming P. P's daemon comes back on the same address with its engine
// re-attached under the same id: a new request is done within 10 s.
func TestProducerDaemonKilledAndRestarted(t *testing.T) {
	dir := world(t)
	pAddr := freeAddr(t)
	p := startDaemon(t, dir, "P", "-peer-listen", pAddr)
	d := startDaemon(t, dir, "D")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	for i := range 3 {
		id := string(rune('a' + i))
		registerD(t, D, "d-"+id, "t-"+id, p.Peer, []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)})
	}
	time.Sleep(300 * time.Millisecond) // the registrations reach P
	_ = p.Kill()
	killed := time.Now()
	P.Close()
	got := outcomesOf(D, 10*time.Second-time.Since(killed), "d-a", "d-b", "d-c")
	for _, id := range []string{"d-a", "d-b", "d-c"} {
		o, ok := got[id]
		if !ok {
			t.Fatalf("%s: no outcome 10 s after P's daemon was killed", id)
		}
		if o.Result != kvxfer.ResultFailed || !strings.Contains(o.Reason, "producer engine P") {
			t.Errorf("%s: %+v, want failed naming producer engine P", id, o)
		}
	}
	t.Logf("D's requests ended %v after the kill", time.Since(killed).Round(time.Millisecond))

	// P comes back on the same address; its engine re-attaches.
	p2 := startDaemon(t, dir, "P2", "-peer-listen", pAddr)
	P2 := attachSim(t, dir, p2.Sock, p2.Peer, "P", 1, kvxfer.ModePush)
	defer P2.Close()
	back := time.Now()
	ids := []topology.BlockID{8, 9}
	registerD(t, D, "d-new", "t-new", p2.Peer, ids)
	finishP(t, P2, "p-new", "t-new", ids)
	pDone := make(chan kvxfer.Outcome, 1)
	go func() { o, _ := outcome(P2, "p-new", 10*time.Second); pDone <- o }()
	o, err := outcome(D, "d-new", 10*time.Second)
	if err != nil || o.Result != kvxfer.ResultDone {
		t.Fatalf("new request after P's restart: %+v, %v; want done within 10 s", o, err)
	}
	if po := <-pDone; po.Result != kvxfer.ResultDone {
		t.Errorf("P's new request: %+v, want done", po)
	}
	t.Logf("a new request was done %v after P came back", time.Since(back).Round(time.Millisecond))
}
