package kvxfer_test

import (
	"testing"
	"testing/synctest"
	"time"

	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A pull producer's request id used again, by a router that names no
// transfer id, once the earlier request's lease lapsed while its consumer
// had not read yet (its heartbeats late, say). The earlier consumer,
// reading only now, names the producer request by its id alone: before,
// its READ was admitted out of the new request's hold of the same blocks
// (it read another request's KV as its own, and reported it done), and
// its completion notice counted as the new request's: the producer
// reported the new request done and let its blocks go before the new
// consumer read them, whose READ then failed. The producer's params now
// name a transfer id of the hold's own when the router gave none, which
// every consumer build echoes: the late READ is refused, and the new
// request waits for its own consumer (and its heartbeats, naming the
// earlier transfer, extend nothing of the new request's).
func TestPullIDReusedWithoutTransferID(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		fab, dir := newFabricDir()
		model := kvsim.Model{Kinds: []topology.Kind{fa}, TotalKVHeads: 4, HeadSize: 4, ElemBytes: 2}
		P := newStack(t, startEngine(t, fab, dir, &model, e2eEngine(1, 1, 1, 16, 16), "P", kvxfer.ModePull, nil), kvxfer.ModePull)
		D := newStack(t, startEngine(t, fab, dir, &model, e2eEngine(2, 1, 1, 16, 16), "D", kvxfer.ModePull, nil), kvxfer.ModePull)
		defer D.se.close(t)
		defer P.se.close(t)
		pBlocks := [][]topology.BlockID{{1, 2}}
		prefill := func() *kvxfer.TransferParams {
			t.Helper()
			r := &kvxfer.Request{ID: "p-1", PromptTokens: 32, Params: &kvxfer.TransferParams{DoRemoteDecode: true}}
			if err := P.sched.AfterAlloc(r, kvxfer.Alloc{Blocks: pBlocks}); err != nil {
				t.Fatal(err)
			}
			delay, params, err := P.sched.RequestFinished(r, kvxfer.FinishStopped, pBlocks, 32)
			if err != nil || !delay {
				t.Fatalf("P RequestFinished = %v, %v", delay, err)
			}
			P.step(t)
			return params
		}
		read := func(id string, params *kvxfer.TransferParams, blocks []topology.BlockID) {
			t.Helper()
			r := &kvxfer.Request{ID: id, PromptTokens: 32, Params: params}
			n, _ := D.sched.MatchedTokens(r, 0)
			if err := D.sched.AfterAlloc(r, kvxfer.Alloc{Blocks: [][]topology.BlockID{blocks}, External: n}); err != nil {
				t.Fatal(err)
			}
			for range 20 {
				D.step(t)
				P.step(t)
				if _, ok := D.recvd[id]; ok {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			P.step(t)
		}
		old := prefill()
		time.Sleep(31 * time.Second)
		P.step(t)
		if o := P.sent["p-1"]; o.Result != kvxfer.ResultExpired {
			t.Fatalf("P's first p-1 = %+v, want expired", o)
		}
		P.sent = map[string]kvxfer.Outcome{} // the id is reported again, for its new request
		fresh := prefill()
		if old.TransferID == fresh.TransferID {
			t.Errorf("both holds of p-1 are named by transfer id %q: a consumer of one cannot be told from one of the other", old.TransferID)
		}

		// The fake backend fences nothing: the earlier consumer's READ
		// moves here whatever it names (the access table refuses it where
		// a backend fences: TestAccessTablePullReadNamesItsHold's
		// p-new/t-old case, which needs the two transfer ids above).
		read("d-old", old, []topology.BlockID{3, 4})
		if o, ok := P.sent["p-1"]; ok {
			t.Errorf("P's new p-1 reported %+v on the earlier consumer's read, before its own consumer read", o)
		}

		read("d-new", fresh, []topology.BlockID{5, 6})
		if o := D.recvd["d-new"]; o.Result != kvxfer.ResultDone {
			t.Errorf("the new consumer = %+v, want done", o)
		}
		if o := P.sent["p-1"]; o.Result != kvxfer.ResultDone {
			t.Errorf("P's new p-1 = %+v, want done", o)
		}
	})
}
