package test

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// Recovery over real daemons, in the cases faults_test.go leaves out:
// pull mode, kills while transfers are in flight, a peer back on the same
// address before the requests of its old self ended, and requests after
// a restart that reuse the very blocks (and so the very addresses) of the
// requests the fault ended. Every request ends once per side within its
// bound, and a done request holds its own bytes, never an older
// request's.

// finishPull has P's engine finish a pull request: its blocks hold the
// transfer's pattern and its scheduler holds them for D; it returns the
// params D reads them by.
func finishPull(t *testing.T, P *simengine.Engine, id, tid string, ids []topology.BlockID) *kvxfer.TransferParams {
	t.Helper()
	P.Ranks[0].FillSalt([]topology.Span{{IDs: ids}}, salt(tid))
	req := &kvxfer.Request{ID: id, PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: tid, DoRemoteDecode: true}}
	if err := P.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}}); err != nil {
		t.Fatal(err)
	}
	delay, params, err := P.Sched.RequestFinished(req, kvxfer.FinishLengthCapped, [][]topology.BlockID{ids}, 32)
	if err != nil || !delay || params == nil {
		t.Fatalf("P RequestFinished(%s) = %v, %+v, %v; want its blocks held", id, delay, params, err)
	}
	if err := P.Step(P.Sched.BuildMeta()); err != nil {
		t.Fatal(err)
	}
	return params
}

// readPull has D's engine take a pull request with P's params into its
// blocks ids: the step READs them.
func readPull(t *testing.T, D *simengine.Engine, id string, params *kvxfer.TransferParams, ids []topology.BlockID) {
	t.Helper()
	p := *params
	req := &kvxfer.Request{ID: id, PromptTokens: 32, Params: &p}
	ext, _ := D.Sched.MatchedTokens(req, 0)
	if err := D.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}, External: ext}); err != nil {
		t.Fatal(err)
	}
	if err := D.Step(D.Sched.BuildMeta()); err != nil {
		t.Fatal(err)
	}
}

// pullOnce runs one pull request, p-<id> on P and d-<id> on D (transfer
// t-<id>), between blocks ids on both sides, and checks both end done
// within within and D holds the request's own bytes.
func pullOnce(t *testing.T, P, D *simengine.Engine, id string, ids []topology.BlockID, within time.Duration, when string) {
	t.Helper()
	params := finishPull(t, P, "p-"+id, "t-"+id, ids)
	pOut := make(chan kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P, within, "p-"+id)["p-"+id] }()
	readPull(t, D, "d-"+id, params, ids)
	if o := outcomesOf(t, D, within, "d-"+id)["d-"+id]; o.Result != kvxfer.ResultDone {
		t.Fatalf("%s: D's request %+v, want done within %v", when, o, within)
	}
	wantBytes(t, D, "t-"+id, ids)
	if o := <-pOut; o.Result != kvxfer.ResultDone {
		t.Errorf("%s: P's request %+v, want done", when, o)
	}
}

// endedOnce checks that each of ids has an outcome in got (outcomesOf
// already failed the test on one reported twice) that is not done.
func endedOnce(t *testing.T, side string, got map[string]kvxfer.Outcome, ids []string, within time.Duration) {
	t.Helper()
	for _, id := range ids {
		o, ok := got[id]
		switch {
		case !ok:
			t.Errorf("%s %s: no outcome within %v", side, id, within)
		case o.Result == kvxfer.ResultDone:
			t.Errorf("%s %s: done, want failed or expired (its peer died under it)", side, id)
		case o.Kind == kvxfer.FailureNone:
			t.Errorf("%s %s: %+v names no failure kind", side, id, o)
		}
	}
}

// Pull: P's daemon is frozen while D's READs of three requests are posted
// to it (they cannot be answered), then SIGKILLed. Each of D's requests
// ends failed once within 10 s. P's daemon comes back on the same address
// at once, its engine re-attached under the same id, and requests that
// reuse the blocks of the failed ones (on both sides) are done with their
// own bytes. D's daemon holds nothing of the dead peer afterwards.
//
// All of it within a second of D's handshake with P (the warm-up's):
// before, D took that handshake as fresh although P had been unreachable
// since (its READs cut off, its probe unanswered), so the first request
// after the restart READ from P's gone agent and failed ("dial ...
// connection refused") instead of handshaking again.
func TestPullProducerDaemonKilledMidRead(t *testing.T) {
	dir := world(t)
	pAddr, dMetrics := freeAddr(t), freeAddr(t)
	p := startDaemon(t, dir, "P", "-peer-listen", pAddr)
	d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics)
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePull)
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePull)
	defer D.Close()
	warm := time.Now()
	pullOnce(t, P, D, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the fault")
	baseline := metricsOf(t, dMetrics)["go_goroutines"]

	var dIDs []string
	var params []*kvxfer.TransferParams
	for i := range 3 {
		id := string(rune('a' + i))
		params = append(params, finishPull(t, P, "p-"+id, "t-"+id, []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}))
	}
	time.Sleep(100 * time.Millisecond) // P's ranks hold them
	if err := p.Freeze(); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		id := string(rune('a' + i))
		readPull(t, D, "d-"+id, params[i], []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)})
		dIDs = append(dIDs, "d-"+id)
	}
	time.Sleep(200 * time.Millisecond) // the READs are out, unanswered
	_ = p.Kill()
	killed := time.Now()
	P.Close()
	got := outcomesOf(t, D, 10*time.Second, dIDs...)
	endedOnce(t, "D", got, dIDs, 10*time.Second)
	t.Logf("D's requests ended %v after P's daemon was killed", time.Since(killed).Round(time.Millisecond))

	p2 := startDaemon(t, dir, "P2", "-peer-listen", pAddr)
	_ = os.Remove(filepath.Join(dir, "P-tp0"))
	P2 := attachSim(t, dir, p2.Sock, p2.Peer, "P", 1, kvxfer.ModePull)
	defer P2.Close()
	t.Logf("P is back %v after D's handshake with it", time.Since(warm).Round(time.Millisecond))
	for i := range 3 {
		pullOnce(t, P2, D, fmt.Sprintf("new%d", i), []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}, 10*time.Second,
			"after P's restart, in the failed requests' blocks")
	}
	settled(t, "D's daemon", dMetrics, baseline, 10)
}

// Pull: D's daemon is SIGKILLed while P holds three requests for it (D's
// READs of them posted, its daemon frozen so none completes). P's
// requests end once each within their lease (the engine's, 3 s here, and
// a bound), its blocks given back. D's daemon comes back on the same
// address with its engine re-attached under the same id; P reuses the
// released blocks for new requests, D reads them into the blocks the dead
// requests had: each is done with its own bytes.
func TestPullConsumerDaemonKilledMidRead(t *testing.T) {
	dir := world(t)
	dAddr, pMetrics := freeAddr(t), freeAddr(t)
	p := startDaemon(t, dir, "P", "-metrics-listen", pMetrics)
	d := startDaemon(t, dir, "D", "-peer-listen", dAddr)
	m := simModel
	P, err := simengine.Attach(simengine.Config{Dir: dir, Sock: p.Sock, Peer: p.Peer, ID: "P", Model: &m, Engine: simEngine(1, 1),
		Mode: kvxfer.ModePull, Version: "test", Lease: 3 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePull)
	pullOnce(t, P, D, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the fault")
	baseline := metricsOf(t, pMetrics)["go_goroutines"]

	var pIDs []string
	for i := range 3 {
		id := string(rune('a' + i))
		ids := []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}
		params := finishPull(t, P, "p-"+id, "t-"+id, ids)
		pIDs = append(pIDs, "p-"+id)
		if i == 0 {
			if err := d.Freeze(); err != nil {
				t.Fatal(err)
			}
		}
		readPull(t, D, "d-"+id, params, ids) // taken in by the stream's buffer; D's daemon is frozen
	}
	time.Sleep(300 * time.Millisecond)
	_ = d.Kill()
	killed := time.Now()
	D.Close()
	within := 3*time.Second + 5*time.Second
	got := outcomesOf(t, P, within, pIDs...)
	endedOnce(t, "P", got, pIDs, within)
	t.Logf("P's requests ended %v after D's daemon was killed", time.Since(killed).Round(time.Millisecond))

	d2 := startDaemon(t, dir, "D2", "-peer-listen", dAddr)
	_ = os.Remove(filepath.Join(dir, "D-tp0"))
	D2 := attachSim(t, dir, d2.Sock, d2.Peer, "D", 2, kvxfer.ModePull)
	defer D2.Close()
	for i := range 3 {
		pullOnce(t, P, D2, fmt.Sprintf("new%d", i), []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}, 10*time.Second,
			"after D's restart, in the ended requests' blocks")
	}
	settled(t, "P's daemon", pMetrics, baseline, 15)
}

// Push: D's daemon is SIGKILLed while P holds three requests it
// registered, and comes back on the same address, its engine re-attached
// under the same id, before P's engine finishes them. The new D engine
// registers new requests in the same blocks (the same addresses in a new
// memory file) with P; only then does P finish the old requests and the
// new ones together. The old ones end once each, not done (their
// consumer's agents are gone: their WRITEs must not land in the new
// engine's blocks, granted to other requests); the new ones are done with
// their own bytes.
func TestPushConsumerBackBeforeOldWrites(t *testing.T) {
	dir := world(t)
	dAddr, pMetrics := freeAddr(t), freeAddr(t)
	p := startDaemon(t, dir, "P", "-metrics-listen", pMetrics)
	d := startDaemon(t, dir, "D", "-peer-listen", dAddr)
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	defer P.Close()
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	transferOnce(t, P, D, p.Peer, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the fault")
	baseline := metricsOf(t, pMetrics)["go_goroutines"]
	dBlocks := func(i int) []topology.BlockID {
		return []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}
	}
	for i := range 3 {
		id := string(rune('a' + i))
		registerD(t, D, "d-"+id, "t-"+id, p.Peer, dBlocks(i))
	}
	regsReachP(t, 3, 10*time.Second, scrapeOf(t, pMetrics))
	_ = d.Kill()
	D.Close()
	d2 := startDaemon(t, dir, "D2", "-peer-listen", dAddr)
	_ = os.Remove(filepath.Join(dir, "D-tp0"))
	D2 := attachSim(t, dir, d2.Sock, d2.Peer, "D", 2, kvxfer.ModePush)
	defer D2.Close()
	for i := range 3 {
		id := fmt.Sprintf("new%d", i)
		registerD(t, D2, "d-"+id, "t-"+id, p.Peer, dBlocks(i))
	}
	time.Sleep(300 * time.Millisecond) // the new registrations reach P
	var pIDs, dIDs []string
	for i := range 3 {
		// P's old requests first, in P blocks of their own; then the new
		// ones in blocks 6..11 (the old ones' are still held).
		id := string(rune('a' + i))
		finishP(t, P, "p-"+id, "t-"+id, dBlocks(i))
		pIDs = append(pIDs, "p-"+id)
	}
	for i := range 3 {
		id := fmt.Sprintf("new%d", i)
		ids := []topology.BlockID{topology.BlockID(6 + 2*i), topology.BlockID(7 + 2*i)}
		P.Ranks[0].FillSalt([]topology.Span{{IDs: ids}}, salt("t-"+id))
		req := &kvxfer.Request{ID: "p-" + id, PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: "t-" + id, DoRemoteDecode: true}}
		if err := P.Sched.AfterAlloc(req, kvxfer.Alloc{Blocks: [][]topology.BlockID{ids}}); err != nil {
			t.Fatal(err)
		}
		if _, _, err := P.Sched.RequestFinished(req, kvxfer.FinishLengthCapped, [][]topology.BlockID{ids}, 32); err != nil {
			t.Fatal(err)
		}
		pIDs, dIDs = append(pIDs, "p-"+id), append(dIDs, "d-"+id)
	}
	pOut := make(chan map[string]kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P, 15*time.Second, pIDs...) }()
	dGot := outcomesOf(t, D2, 15*time.Second, dIDs...)
	pGot := <-pOut
	endedOnce(t, "P", pGot, pIDs[:3], 15*time.Second)
	for i, id := range dIDs {
		o, ok := dGot[id]
		if !ok || o.Result != kvxfer.ResultDone {
			t.Errorf("D %s: %+v (reported %v), want done", id, o, ok)
			continue
		}
		// D's blocks hold the new request's pattern, read from P's
		// blocks 6+2i..: check token by token against the salt.
		req := kvsimReq("t-"+fmt.Sprintf("new%d", i), []topology.BlockID{topology.BlockID(6 + 2*i), topology.BlockID(7 + 2*i)}, dBlocks(i))
		if err := D2.Ranks[0].CheckRequest(req, 16, 16); err != nil {
			t.Errorf("D %s done with wrong bytes: %v", id, err)
		}
		if o := pGot["p-"+fmt.Sprintf("new%d", i)]; o.Result != kvxfer.ResultDone {
			t.Errorf("P p-new%d: %+v, want done", i, o)
		}
	}
	settled(t, "P's daemon", pMetrics, baseline, 15)
}

// kvsimReq is transfer tid's request for a check: P's blocks pIDs, D's
// dIDs, the transfer's salt.
func kvsimReq(tid string, pIDs, dIDs []topology.BlockID) *kvsim.Request {
	return &kvsim.Request{Tokens: 32, P: []topology.Span{{IDs: pIDs}}, D: []topology.Span{{IDs: dIDs}}, Salt: salt(tid)}
}

// Push: P's daemon is frozen, D registers three requests with it (the
// registrations go out, unanswered), and P's daemon is SIGKILLed and back
// on the same address at once, its engine re-attached under the same id.
// A request D takes then is done with its own bytes: its registration to
// P's gone agent is refused and D handshakes again. The requests
// registered with the old P end once each within 10 s, and requests that
// reuse their blocks afterwards are done with their own bytes. Both with
// D's handshake less than a second old when P comes back, and more.
//
// Before: within the second, the new request failed (the handshake was
// taken as fresh, so its refused registration failed it); past it, the
// new request's handshake loaded P's new generation without failing
// what was registered with the old one, and probes, answered by the new
// generation, found nothing changed: the three old requests had no
// outcome until their registration timeout (minutes).
func TestPushProducerDaemonBackAtOnce(t *testing.T) {
	for _, wait := range []time.Duration{0, 1200 * time.Millisecond} {
		t.Run(fmt.Sprintf("handshake-%v-old", wait), func(t *testing.T) { pushProducerBackAtOnce(t, wait) })
	}
}

func pushProducerBackAtOnce(t *testing.T, wait time.Duration) {
	dir := world(t)
	pAddr, dMetrics := freeAddr(t), freeAddr(t)
	p := startDaemon(t, dir, "P", "-peer-listen", pAddr)
	d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics)
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePush)
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	warm := time.Now()
	transferOnce(t, P, D, p.Peer, "warm", []topology.BlockID{14, 15}, 10*time.Second, "before the fault")
	baseline := metricsOf(t, dMetrics)["go_goroutines"]
	time.Sleep(wait)
	blocks := func(i int) []topology.BlockID {
		return []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}
	}
	var dIDs []string
	if err := p.Freeze(); err != nil {
		t.Fatal(err)
	}
	for i := range 3 {
		id := string(rune('a' + i))
		registerD(t, D, "d-"+id, "t-"+id, p.Peer, blocks(i))
		dIDs = append(dIDs, "d-"+id)
	}
	time.Sleep(100 * time.Millisecond) // the registrations are out, unanswered
	_ = p.Kill()
	P.Close()
	p2 := startDaemon(t, dir, "P2", "-peer-listen", pAddr)
	_ = os.Remove(filepath.Join(dir, "P-tp0"))
	P2 := attachSim(t, dir, p2.Sock, p2.Peer, "P", 1, kvxfer.ModePush)
	defer P2.Close()
	back := time.Now()
	t.Logf("P is back %v after D's handshake with it", back.Sub(warm).Round(time.Millisecond))
	registerD(t, D, "d-now", "t-now", p2.Peer, blocks(3))
	finishP(t, P2, "p-now", "t-now", blocks(3))
	pOut := make(chan kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P2, 10*time.Second, "p-now")["p-now"] }()
	got := outcomesOf(t, D, 10*time.Second, append(dIDs, "d-now")...)
	if o := got["d-now"]; o.Result != kvxfer.ResultDone {
		t.Errorf("D's request taken as P came back: %+v, want done", o)
	} else {
		wantBytes(t, D, "t-now", blocks(3))
	}
	if o := <-pOut; o.Result != kvxfer.ResultDone {
		t.Errorf("P's request taken as it came back: %+v, want done", o)
	}
	endedOnce(t, "D", got, dIDs, 10*time.Second)
	t.Logf("D's requests ended within %v of P's return", time.Since(back).Round(time.Millisecond))
	for i := range 3 {
		transferOnce(t, P2, D, p2.Peer, fmt.Sprintf("new%d", i), blocks(i), 10*time.Second, "after P's restart, in the ended requests' blocks")
	}
	settled(t, "D's daemon", dMetrics, baseline, 10)
}

// attachAgain attaches engine id again to daemon d once the daemon has let
// its crashed ranks go (a hello for a rank still being let go is refused),
// its stale memory file removed first, as an engine restarting does.
func attachAgain(t *testing.T, dir string, d *daemontest.Proc, id string, eng int, mode kvxfer.Mode) *simengine.Engine {
	t.Helper()
	m := simModel
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(100 * time.Millisecond) {
		_ = os.Remove(filepath.Join(dir, id+"-tp0"))
		e, err := simengine.Attach(simengine.Config{Dir: dir, Sock: d.Sock, Peer: d.Peer, ID: id, Model: &m, Engine: simEngine(eng, 1),
			Mode: mode, Version: "test"})
		if err == nil {
			return e
		}
		if time.Now().After(deadline) {
			t.Fatalf("engine %s not attached again within 20 s: %v", id, err)
		}
	}
}

// P's engine crashes (its rank stream drops without a bye; its daemon
// stays) while D's requests are in flight: in push, registered with P and
// finished by P's engine just before (their WRITEs may be under way); in
// pull, held by P and being read by D. It attaches again under the same
// id. Each of D's requests ends once within 15 s, and one done holds its
// own bytes; P's crashed requests are not reported to anyone (their
// engine is gone). New requests that reuse the very blocks on both sides
// are done with their own bytes, never an old request's, and D's daemon
// holds nothing of the old requests afterwards. (The transfers here are
// small: most are done before the crash lands.) Before, in push, the
// first new request failed ("dial ...: connection refused"): P's rank,
// attached again within a second of D's handshake, was at a new agent, and
// D took its handshake as fresh.
func TestProducerEngineCrashesMidTransfer(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			dir := world(t)
			dMetrics := freeAddr(t)
			p := startDaemon(t, dir, "P")
			d := startDaemon(t, dir, "D", "-metrics-listen", dMetrics)
			P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, mode)
			D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, mode)
			defer D.Close()
			once := func(P *simengine.Engine, id string, ids []topology.BlockID, when string) {
				if mode == kvxfer.ModePush {
					transferOnce(t, P, D, p.Peer, id, ids, 15*time.Second, when)
				} else {
					pullOnce(t, P, D, id, ids, 15*time.Second, when)
				}
			}
			once(P, "warm", []topology.BlockID{14, 15}, "before the crash")
			baseline := metricsOf(t, dMetrics)["go_goroutines"]
			blocks := fourBlocks
			dIDs := fourInFlight(t, mode, P, D, p.Peer, "d-")
			if err := P.Crash(); err != nil {
				t.Fatal(err)
			}
			crashed := time.Now()
			P = attachAgain(t, dir, p, "P", 1, mode)
			defer P.Close()
			t.Logf("P's engine attached again %v after its crash", time.Since(crashed).Round(time.Millisecond))
			got := outcomesOf(t, D, 15*time.Second, dIDs...)
			for i, id := range dIDs {
				o, ok := got[id]
				switch {
				case !ok:
					t.Errorf("D %s: no outcome within 15 s of P's engine crash", id)
				case o.Result == kvxfer.ResultDone:
					wantBytes(t, D, "t-"+id[2:], blocks(i))
				case o.Kind == kvxfer.FailureNone:
					t.Errorf("D %s: %+v names no failure kind", id, o)
				}
			}
			t.Logf("D's requests ended %v after the crash: %v", time.Since(crashed).Round(time.Millisecond), got)
			for i := range 4 {
				once(P, fmt.Sprintf("new%d", i), blocks(i), "after P's engine came back, in the old requests' blocks")
			}
			settled(t, "D's daemon", dMetrics, baseline, 10)
		})
	}
}

// Pull: P's engine crashes while it holds a request D has not read yet,
// and attaches again under the same id; the new engine holds a new
// request in the very same blocks (other bytes) when D's READ of the old
// request comes, naming the old request and those blocks. D must not get
// the new request's bytes for the old one: the old request ends not done
// (or, were it done, with its own bytes, which no longer exist), and the
// new one is done with its own bytes.
func TestPullReadOfCrashedHoldMeetsNewHold(t *testing.T) {
	for _, named := range []bool{true, false} {
		t.Run(fmt.Sprintf("producer-id-named-%v", named), func(t *testing.T) { pullReadOfCrashedHold(t, named) })
	}
}

func pullReadOfCrashedHold(t *testing.T, named bool) {
	dir := world(t)
	p := startDaemon(t, dir, "P")
	d := startDaemon(t, dir, "D")
	P := attachSim(t, dir, p.Sock, p.Peer, "P", 1, kvxfer.ModePull)
	D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePull)
	defer D.Close()
	pullOnce(t, P, D, "warm", []topology.BlockID{14, 15}, 15*time.Second, "before the crash")
	ids := []topology.BlockID{0, 1}
	old := finishPull(t, P, "p-a", "t-a", ids)
	if !named {
		old.RemoteRequestID = ""
	}
	time.Sleep(100 * time.Millisecond)
	if err := P.Crash(); err != nil {
		t.Fatal(err)
	}
	P = attachAgain(t, dir, p, "P", 1, kvxfer.ModePull)
	defer P.Close()
	// The new engine's request in the same blocks; its id and transfer
	// id are its own, as a restarted engine's are.
	fresh := finishPull(t, P, "p-b", "t-b", ids)
	time.Sleep(100 * time.Millisecond) // P's rank holds it
	readPull(t, D, "d-a", old, []topology.BlockID{2, 3})
	o, ok := outcomesOf(t, D, 15*time.Second, "d-a")["d-a"]
	switch {
	case !ok:
		t.Fatal("D's read of the crashed hold: no outcome within 15 s")
	case o.Result == kvxfer.ResultDone:
		req := kvsimReq("t-a", ids, []topology.BlockID{2, 3})
		if err := D.Ranks[0].CheckRequest(req, 16, 16); err != nil {
			t.Errorf("D's read of the crashed hold is done with bytes not its own (the new hold's?): %v", err)
		}
		if D.Ranks[0].CheckRequest(kvsimReq("t-b", ids, []topology.BlockID{2, 3}), 16, 16) == nil {
			t.Error("D's read of the crashed hold got the new hold's bytes: KV cross-wired between requests")
		}
	}
	t.Logf("D's read of the crashed hold: %+v", o)
	pOut := make(chan kvxfer.Outcome, 1)
	go func() { pOut <- outcomesOf(t, P, 15*time.Second, "p-b")["p-b"] }()
	readPull(t, D, "d-b", fresh, []topology.BlockID{4, 5})
	if o := outcomesOf(t, D, 15*time.Second, "d-b")["d-b"]; o.Result != kvxfer.ResultDone {
		t.Fatalf("D's read of the new hold: %+v, want done", o)
	}
	if err := D.Ranks[0].CheckRequest(kvsimReq("t-b", ids, []topology.BlockID{4, 5}), 16, 16); err != nil {
		t.Errorf("D's read of the new hold done with wrong bytes: %v", err)
	}
	if o := <-pOut; o.Result != kvxfer.ResultDone {
		t.Errorf("P's new hold: %+v, want done", o)
	}
}

// D's engine crashes (its rank stream drops without a bye; its daemon
// stays) with requests in flight: in push, registered with P and
// finished by P's engine just before; in pull, held by P (a 3 s lease)
// and read by D just before. It attaches again under the same id. Each of
// P's requests ends once within its bound, P's blocks given back; new
// requests that reuse the very blocks on both sides are done with their
// own bytes.
func TestConsumerEngineCrashesMidTransfer(t *testing.T) {
	for _, mode := range []kvxfer.Mode{kvxfer.ModePush, kvxfer.ModePull} {
		t.Run(mode.String(), func(t *testing.T) {
			dir := world(t)
			pMetrics := freeAddr(t)
			p := startDaemon(t, dir, "P", "-metrics-listen", pMetrics)
			d := startDaemon(t, dir, "D")
			m := simModel
			P, err := simengine.Attach(simengine.Config{Dir: dir, Sock: p.Sock, Peer: p.Peer, ID: "P", Model: &m, Engine: simEngine(1, 1),
				Mode: mode, Version: "test", Lease: 3 * time.Second})
			if err != nil {
				t.Fatal(err)
			}
			defer P.Close()
			D := attachSim(t, dir, d.Sock, d.Peer, "D", 2, mode)
			once := func(D *simengine.Engine, id string, ids []topology.BlockID, when string) {
				if mode == kvxfer.ModePush {
					transferOnce(t, P, D, p.Peer, id, ids, 15*time.Second, when)
				} else {
					pullOnce(t, P, D, id, ids, 15*time.Second, when)
				}
			}
			once(D, "warm", []topology.BlockID{14, 15}, "before the crash")
			baseline := metricsOf(t, pMetrics)["go_goroutines"]
			blocks := fourBlocks
			pIDs := fourInFlight(t, mode, P, D, p.Peer, "p-")
			if err := D.Crash(); err != nil {
				t.Fatal(err)
			}
			crashed := time.Now()
			within := 3*time.Second + 12*time.Second // the lease, and the D Worker's close (10 s) with slack
			got := outcomesOf(t, P, within, pIDs...)
			for _, id := range pIDs {
				if o, ok := got[id]; !ok {
					t.Errorf("P %s: no outcome within %v of D's engine crash", id, within)
				} else if o.Result != kvxfer.ResultDone && o.Kind == kvxfer.FailureNone {
					t.Errorf("P %s: %+v names no failure kind", id, o)
				}
			}
			t.Logf("P's requests ended %v after the crash: %v", time.Since(crashed).Round(time.Millisecond), got)
			D = attachAgain(t, dir, d, "D", 2, mode)
			defer D.Close()
			for i := range 4 {
				once(D, fmt.Sprintf("new%d", i), blocks(i), "after D's engine came back, in the old requests' blocks")
			}
			settled(t, "P's daemon", pMetrics, baseline, 10)
		})
	}
}

// fourBlocks are the blocks of fourInFlight's request i, on both sides.
func fourBlocks(i int) []topology.BlockID {
	return []topology.BlockID{topology.BlockID(2 * i), topology.BlockID(2*i + 1)}
}

// fourInFlight starts four requests "a".."d" from P (peer address pPeer)
// to D, in blocks fourBlocks(i) on both sides: in push D registers each
// and P finishes them in one step; in pull P finishes each and D reads
// it. It returns the requests' ids on one side: prefix "d-" or "p-".
func fourInFlight(t *testing.T, mode kvxfer.Mode, P, D *simengine.Engine, pPeer, prefix string) []string {
	t.Helper()
	var ids []string
	for i := range 4 {
		id := string(rune('a' + i))
		ids = append(ids, prefix+id)
		if mode == kvxfer.ModePush {
			registerD(t, D, "d-"+id, "t-"+id, pPeer, fourBlocks(i))
			continue
		}
		params := finishPull(t, P, "p-"+id, "t-"+id, fourBlocks(i))
		readPull(t, D, "d-"+id, params, fourBlocks(i))
	}
	if mode == kvxfer.ModePush {
		time.Sleep(200 * time.Millisecond) // the registrations reach P
		for i := range 4 {
			id := string(rune('a' + i))
			finishP(t, P, "p-"+id, "t-"+id, fourBlocks(i))
		}
		if err := P.Step(P.Sched.BuildMeta()); err != nil {
			t.Fatal(err)
		}
	}
	return ids
}

// A daemon that cannot start (its metrics address is taken) is reported
// as soon as it exits, with what its log says: before, Start polled its
// ready file for the full 20 s and said only that it was not ready, the
// log (the reason) left in a removed directory.
func TestDaemonThatCannotStartSaysWhy(t *testing.T) {
	dir := world(t)
	ln, err := net.Listen("tcp", freeAddr(t))
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	start := time.Now()
	d, err := daemontest.Start(dir, "X", daemonBackend, "-metrics-listen", ln.Addr().String())
	if err == nil {
		_ = d.Stop()
		t.Fatalf("a daemon started on a taken metrics address %s", ln.Addr())
	}
	if took := time.Since(start); took > 15*time.Second {
		t.Errorf("Start took %v to see the daemon exit", took)
	}
	if !strings.Contains(err.Error(), "exited while starting") || !strings.Contains(err.Error(), "address already in use") {
		t.Errorf("Start's error %q does not say the daemon exited, nor why (its log)", err)
	}
}
