package test

import (
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/daemon/registry"
	"github.com/kvxfer/kvxfer/internal/daemon/registry/etcdtest"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

// A fleet of producer instances churning on etcd while KV moves: 100
// producer engine ids join (attach to one of two producer daemons, so the
// registry lists them), leave (detach) and die (their daemon SIGKILLed and
// restarted: a lease ends, a rejoin under a new generation), while a
// consumer names them by id alone (resolved through the registry) in
// batches of requests. Every D request ends exactly once; a done one has
// every byte of its producer's blocks; every request of a producer that
// lives on ends exactly once on P too, done with D. The outcomes are
// counted and logged. KVXFER_CHURN sets how long (default 6 s; the
// goal's 5 minutes: KVXFER_CHURN=5m, bench/RESULTS.md).
func TestFleetChurnTransfers(t *testing.T) {
	churn := 6 * time.Second
	if s := os.Getenv("KVXFER_CHURN"); s != "" {
		d, err := time.ParseDuration(s)
		if err != nil {
			t.Fatalf("KVXFER_CHURN=%q: %v", s, err)
		}
		churn = d
	}
	etcd := etcdtest.Start(t)
	dir := world(t)
	const ttl = "2s"
	startP := func(i, gen int) *daemontest.Proc {
		return startDaemon(t, dir, fmt.Sprintf("P%d-%d", i, gen), "-etcd", etcd.Endpoint(), "-etcd-role", "producer", "-etcd-ttl", ttl)
	}
	pds := []*daemontest.Proc{startP(0, 0), startP(1, 0)}
	pgen := []int{0, 0}
	d := startDaemon(t, dir, "D", "-etcd", etcd.Endpoint(), "-etcd-role", "consumer", "-etcd-ttl", ttl)
	D := attachByID(t, dir, d.Sock, d.Peer, "D", 2, kvxfer.ModePush)
	defer D.Close()
	reg, err := registry.Dial(registry.ClientConfig{Endpoints: etcd.Endpoint()})
	if err != nil {
		t.Fatal(err)
	}
	defer reg.Close()

	type instance struct {
		e      *simengine.Engine
		on     int       // its daemon
		joined time.Time // when it attached
	}
	const slots = 100
	live := map[int]*instance{}
	rng := rand.New(rand.NewPCG(26, uint64(time.Now().UnixNano())))
	join := func(i int) bool {
		on := rng.IntN(len(pds))
		m := simModel
		e, err := simengine.Attach(simengine.Config{Dir: dir, Sock: pds[on].Sock, Peer: pds[on].Peer, ID: fmt.Sprintf("p%d", i),
			Model: &m, Engine: simEngine(100+i, 1), Mode: kvxfer.ModePush, Version: "test"})
		if err != nil {
			t.Logf("p%d could not join on daemon %d: %v", i, on, err)
			return false
		}
		live[i] = &instance{e: e, on: on, joined: time.Now()}
		return true
	}
	var joins, leaves, deaths int
	for i := range 12 {
		if join(i) {
			joins++
		}
	}
	time.Sleep(500 * time.Millisecond) // D's view lists them
	counts := map[string]int{}
	var reqs, batches int
	seq := 0
	for end := time.Now().Add(churn); time.Now().Before(end); {
		// Churn: a few joins and leaves, now and then a daemon's death.
		for range 1 + rng.IntN(3) {
			i := rng.IntN(slots)
			if in, ok := live[i]; ok {
				_ = in.e.Close()
				delete(live, i)
				leaves++
			} else if join(i) {
				joins++
			}
		}
		dying := -1
		if rng.IntN(8) == 0 {
			dying = rng.IntN(len(pds))
		}
		// A batch: up to four producers, one request each (2 blocks of
		// D's 16, distinct within the batch).
		// As a router would, only instances the registry lists: at their
		// daemon and nowhere else (their daemon published them, an earlier
		// daemon of the id unpublished it), and joined some time ago (D's
		// view watches). The time alone only hoped for the rest: a daemon
		// slowed by load could publish later, and D's request for a
		// producer that lived on failed as not in the registry.
		var picked []int
		for i, in := range live {
			if len(picked) == 4 {
				break
			}
			if time.Since(in.joined) > 300*time.Millisecond && listedAt(t, reg, fmt.Sprintf("p%d", i), pds[in.on].Peer) {
				picked = append(picked, i)
			}
		}
		if len(picked) == 0 {
			time.Sleep(50 * time.Millisecond)
			continue
		}
		batches++
		type req struct {
			slot     int
			id, tid  string
			ids      []topology.BlockID
			producer *simengine.Engine
			diedWith bool
		}
		var batch []req
		for k, i := range picked {
			seq++
			r := req{slot: i, id: fmt.Sprint(seq), tid: fmt.Sprintf("t-%d", seq), producer: live[i].e,
				ids: []topology.BlockID{topology.BlockID(4 * k), topology.BlockID(4*k + 1 + rng.IntN(3))}}
			r.diedWith = live[i].on == dying
			dr := &kvxfer.Request{ID: "d-" + r.id, PromptTokens: 32, Params: &kvxfer.TransferParams{TransferID: r.tid,
				DoRemotePrefill: true, RemoteEngineID: fmt.Sprintf("p%d", i), RemoteTPSize: 1}}
			ext, _ := D.Sched.MatchedTokens(dr, 0)
			if err := D.Sched.AfterAlloc(dr, kvxfer.Alloc{Blocks: [][]topology.BlockID{r.ids}, External: ext}); err != nil {
				t.Fatal(err)
			}
			finishP(t, r.producer, "p-"+r.id, r.tid, r.ids)
			batch = append(batch, r)
		}
		if err := D.Step(D.Sched.BuildMeta()); err != nil {
			t.Fatal(err)
		}
		if dying >= 0 {
			// The daemon dies with requests in flight; it comes back
			// (a new process: its engines attach anew, new generations).
			_ = pds[dying].Kill()
			deaths++
			for i, in := range live {
				if in.on == dying {
					_ = in.e.Close()
					delete(live, i)
				}
			}
			pgen[dying]++
			pds[dying] = startP(dying, pgen[dying])
		}
		// Every P of the batch that lives on reports its request.
		pOut := make(chan map[string]kvxfer.Outcome, len(batch))
		nP := 0
		for _, r := range batch {
			if !r.diedWith {
				nP++
				go func() {
					pOut <- map[string]kvxfer.Outcome{r.id: outcomesOf(t, r.producer, 20*time.Second, "p-"+r.id)["p-"+r.id]}
				}()
			}
		}
		var dIDs []string
		for _, r := range batch {
			dIDs = append(dIDs, "d-"+r.id)
		}
		got := outcomesOf(t, D, 20*time.Second, dIDs...)
		pGot := map[string]kvxfer.Outcome{}
		for range nP {
			for k, v := range <-pOut {
				pGot[k] = v
			}
		}
		for _, r := range batch {
			reqs++
			o, ok := got["d-"+r.id]
			if !ok {
				t.Fatalf("d-%s (producer p%d, its daemon killed: %v): no outcome within 20 s", r.id, r.slot, r.diedWith)
			}
			key := o.Result.String()
			if o.Result == kvxfer.ResultFailed {
				key += "/" + o.Kind.String()
			}
			counts[key]++
			if o.Result == kvxfer.ResultDone {
				wantBytes(t, D, r.tid, r.ids)
			} else if !r.diedWith {
				t.Errorf("d-%s from p%d, which lived on: %+v, want done", r.id, r.slot, o)
			}
			if r.diedWith {
				continue
			}
			if po, ok := pGot[r.id]; !ok || po.Result == 0 {
				t.Errorf("p-%s on p%d: no outcome", r.id, r.slot)
			} else if (po.Result == kvxfer.ResultDone) != (o.Result == kvxfer.ResultDone) {
				t.Errorf("p-%s: P %+v, D %+v: the sides disagree", r.id, po, o)
			}
		}
	}
	for _, in := range live {
		_ = in.e.Close()
	}
	t.Logf("churn %v over 100 producer ids on 2 daemons: %d joins, %d leaves, %d daemon deaths (with their engines); "+
		"%d requests in %d batches, one outcome each side: %v", churn, joins, leaves, deaths, reqs, batches, counts)
	if counts[kvxfer.ResultDone.String()] == 0 {
		t.Error("no request was done: the churn moved no KV")
	}
}

// listedAt reports whether the registry lists engine, and only at the
// daemon whose peer address is peer.
func listedAt(t *testing.T, cl *clientv3.Client, engine, peer string) bool {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cl.Get(ctx, registry.EnginesPrefix("/kvxfer")+engine+"/", clientv3.WithPrefix())
	if err != nil || len(resp.Kvs) == 0 {
		return false
	}
	for _, kv := range resp.Kvs {
		e, err := registry.Decode("/kvxfer", string(kv.Key), kv.Value)
		if err != nil || e.Peer() != peer {
			return false
		}
	}
	return true
}
