package main

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/internal/simengine"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/topology"
)

type scenario struct {
	name     string
	mode     kvxfer.Mode
	ptp, dtp int
}

type result struct {
	scenario
	requests, done, bad, missing int
	bytes                        int64
	elapsed                      time.Duration
	lat                          []time.Duration
	failures                     []string
}

// run runs the demo with command-line flags.
func run(args []string) error {
	fs := flag.NewFlagSet("kvxfer-demo", flag.ContinueOnError)
	n := fs.Int("requests", 200, "requests per scenario")
	seed := fs.Uint64("seed", 1, "seed of the request mix")
	backend := fs.String("backend", "builtin", "transfer backend of both daemons: builtin or nixl")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *n <= 0 {
		return fmt.Errorf("-requests = %d, want > 0", *n)
	}
	base := "/dev/shm"
	if st, err := os.Stat(base); err != nil || !st.IsDir() {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "kvxfer-demo-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	fmt.Printf("kvxfer-demo: starting a P and a D kvxferd (separate processes, %s backend; work dir %s)\n", *backend, dir)
	p, err := daemontest.Start(dir, "P", *backend)
	if err != nil {
		return err
	}
	d, err := daemontest.Start(dir, "D", *backend)
	if err != nil {
		p.Stop()
		return err
	}
	scenarios := []scenario{
		{"push  P TP1 -> D TP1", kvxfer.ModePush, 1, 1},
		{"pull  P TP1 -> D TP1", kvxfer.ModePull, 1, 1},
		{"push  P TP2 -> D TP1", kvxfer.ModePush, 2, 1},
		{"pull  P TP2 -> D TP1", kvxfer.ModePull, 2, 1},
	}
	var results []*result
	var runErr error
	for i, sc := range scenarios {
		r, err := runScenario(dir, p, d, sc, *n, *seed+uint64(i), i)
		if err != nil {
			runErr = fmt.Errorf("%s: %w", sc.name, err)
			break
		}
		results = append(results, r)
	}
	perr, derr := p.Stop(), d.Stop()
	fmt.Println()
	fmt.Printf("%-22s %8s %6s %6s %8s %10s %9s %9s %9s %9s\n", "scenario", "requests", "done", "bad", "missing", "MiB", "MiB/s", "p50 ms", "p90 ms", "p99 ms")
	ok := runErr == nil && perr == nil && derr == nil
	for _, r := range results {
		slices.Sort(r.lat)
		pct := func(q float64) float64 {
			if len(r.lat) == 0 {
				return 0
			}
			return float64(r.lat[min(len(r.lat)-1, int(q*float64(len(r.lat))))].Microseconds()) / 1000
		}
		mib := float64(r.bytes) / (1 << 20)
		fmt.Printf("%-22s %8d %6d %6d %8d %10.1f %9.1f %9.2f %9.2f %9.2f\n", r.name, r.requests, r.done, r.bad, r.missing, mib,
			mib/r.elapsed.Seconds(), pct(0.5), pct(0.9), pct(0.99))
		for _, f := range r.failures[:min(len(r.failures), 5)] {
			fmt.Println("   ", f)
		}
		ok = ok && r.bad == 0 && r.missing == 0 && r.done == r.requests
	}
	if runErr != nil {
		fmt.Println("error:", runErr)
	}
	if perr != nil || derr != nil {
		fmt.Println("daemon exit:", perr, derr)
	}
	if !ok {
		return errors.New("demo failed: a byte was wrong, a request lacked its outcome, or a daemon failed")
	}
	fmt.Println("\ndemo OK: every request ended done on both sides and every transferred byte matched")
	return nil
}

// simEngine is an engine of the demo: an attached simengine (ranks in
// shared memory, a stream per rank, a scheduler and an aggregator) and a
// shuffled free block list.
type simEngine struct {
	*simengine.Engine
	free []topology.BlockID
}

func newSimEngine(dir string, dm *daemontest.Proc, id string, m *kvsim.Model, e kvsim.Engine, mode kvxfer.Mode, rng *rand.Rand) (*simEngine, error) {
	en, err := simengine.Attach(simengine.Config{Dir: dir, Sock: dm.Sock, Peer: dm.Peer, ID: id, Model: m, Engine: e, Mode: mode,
		Version: "kvxfer-demo"})
	if err != nil {
		return nil, err
	}
	se := &simEngine{Engine: en}
	for i := range e.Blocks {
		se.free = append(se.free, topology.BlockID(i))
	}
	rng.Shuffle(len(se.free), func(i, j int) { se.free[i], se.free[j] = se.free[j], se.free[i] })
	return se, nil
}

func (se *simEngine) alloc(n int) []topology.BlockID {
	if n > len(se.free) {
		return nil
	}
	ids := slices.Clone(se.free[:n])
	se.free = se.free[n:]
	return ids
}

// step builds the scheduler's metadata, hands it to every rank, and folds
// the ranks' outcomes.
func (se *simEngine) step() (*kvxfer.Finished, error) {
	if err := se.Step(se.Sched.BuildMeta()); err != nil {
		return nil, err
	}
	if err := se.StepError(); err != nil {
		return nil, err
	}
	all := &kvxfer.Finished{}
	for i, rs := range se.Streams {
		for drained := false; !drained; {
			select {
			case f, ok := <-rs.Finished():
				if !ok {
					return nil, fmt.Errorf("%s rank %d: stream ended", se.ID, i)
				}
				out, err := se.Fold(i, &f)
				if err != nil {
					return nil, err
				}
				if out != nil {
					all.Sending = append(all.Sending, out.Sending...)
					all.Recving = append(all.Recving, out.Recving...)
				}
			default:
				drained = true
			}
		}
	}
	return all, nil
}

type demoReq struct {
	id          string
	tokens      int
	pIDs, dIDs  []topology.BlockID
	pDone, dGot bool
	ready       time.Time
	pReq, dReq  *kvxfer.Request
}

func runScenario(dir string, pd, dd *daemontest.Proc, sc scenario, n int, seed uint64, idx int) (*result, error) {
	rng := rand.New(rand.NewPCG(seed, 77))
	model := kvsim.Model{Kinds: []topology.Kind{topology.KindFullAttention, topology.KindFullAttention, topology.KindFullAttention, topology.KindFullAttention},
		TotalKVHeads: 8, HeadSize: 64, ElemBytes: 2}
	const blocks, block = 192, 16
	pe := kvsim.Engine{ID: 1, TP: sc.ptp, PP: 1, LogicalBlock: block, KernelBlock: block, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: blocks}
	de := kvsim.Engine{ID: 2, TP: sc.dtp, PP: 1, LogicalBlock: block, KernelBlock: block, Layout: topology.LayoutHND, Packing: topology.PackedKV, Blocks: blocks}
	pid, did := fmt.Sprintf("P%d", idx), fmt.Sprintf("D%d", idx)
	P, err := newSimEngine(dir, pd, pid, &model, pe, sc.mode, rng)
	if P != nil {
		defer P.Close()
	}
	if err != nil {
		return nil, err
	}
	D, err := newSimEngine(dir, dd, did, &model, de, sc.mode, rng)
	if D != nil {
		defer D.Close()
	}
	if err != nil {
		return nil, err
	}
	fmt.Printf("  %-22s %d requests ...", sc.name, n)
	res := &result{scenario: sc, requests: n}
	bytesPerToken := int64(len(model.Kinds) * model.TotalKVHeads * model.HeadSize * model.ElemBytes * 2)
	reqs := map[string]*demoReq{}
	var order []*demoReq
	next, inflight := 0, 0
	start := time.Now()
	deadline := start.Add(90 * time.Second)
	for (next < n || inflight > 0) && time.Now().Before(deadline) {
		// Admit requests while blocks last.
		for next < n && inflight < 10 {
			tokens := 16 + rng.IntN(240)
			nb := (tokens + block - 1) / block
			pIDs := P.alloc(nb)
			if pIDs == nil {
				break
			}
			dIDs := D.alloc(nb)
			if dIDs == nil {
				P.free = append(P.free, pIDs...)
				break
			}
			q := &demoReq{id: fmt.Sprint(next), tokens: tokens, pIDs: pIDs, dIDs: dIDs}
			reqs[q.id] = q
			order = append(order, q)
			next++
			inflight++
			tid := fmt.Sprintf("%s-t%d", sc.name[:4], next)
			q.pReq = &kvxfer.Request{ID: "p-" + q.id, PromptTokens: tokens, Params: &kvxfer.TransferParams{TransferID: tid, DoRemoteDecode: true}}
			q.dReq = &kvxfer.Request{ID: "d-" + q.id, PromptTokens: tokens}
			if sc.mode == kvxfer.ModePush { // concurrent dispatch: D registers while P prefills
				q.dReq.Params = &kvxfer.TransferParams{TransferID: tid, DoRemotePrefill: true, RemoteEngineID: pid, RemoteAddr: pd.Peer, RemoteTPSize: sc.ptp}
				ext, _ := D.Sched.MatchedTokens(q.dReq, 0)
				if err := D.Sched.AfterAlloc(q.dReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{dIDs}, External: ext}); err != nil {
					return nil, err
				}
			}
			// P "prefills": its KV gets the pattern, then it finishes.
			for _, r := range P.Ranks {
				r.Fill([]topology.Span{{IDs: pIDs}})
			}
			_ = P.Sched.AfterAlloc(q.pReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{pIDs}})
			delay, params, err := P.Sched.RequestFinished(q.pReq, kvxfer.FinishStopped, [][]topology.BlockID{pIDs}, tokens)
			if err != nil || !delay {
				return nil, fmt.Errorf("producer RequestFinished = %v, %v; want delay", delay, err)
			}
			q.ready = time.Now()
			if sc.mode == kvxfer.ModePull { // sequential dispatch: D gets P's params
				q.dReq.Params = params
				ext, _ := D.Sched.MatchedTokens(q.dReq, 0)
				if err := D.Sched.AfterAlloc(q.dReq, kvxfer.Alloc{Blocks: [][]topology.BlockID{dIDs}, External: ext}); err != nil {
					return nil, err
				}
			}
		}
		pf, err := P.step()
		if err != nil {
			return nil, err
		}
		df, err := D.step()
		if err != nil {
			return nil, err
		}
		for _, o := range pf.Sending {
			q := reqs[strings.TrimPrefix(o.ReqID, "p-")]
			if q == nil || q.pDone {
				return nil, fmt.Errorf("unexpected producer outcome %+v", o)
			}
			q.pDone = true
			if o.Result != kvxfer.ResultDone {
				res.failures = append(res.failures, fmt.Sprintf("P %s: %v %s", o.ReqID, o.Result, o.Reason))
			}
			P.free = append(P.free, q.pIDs...)
			if q.dGot {
				inflight--
			}
		}
		for _, o := range df.Recving {
			q := reqs[strings.TrimPrefix(o.ReqID, "d-")]
			if q == nil || q.dGot {
				return nil, fmt.Errorf("unexpected consumer outcome %+v", o)
			}
			q.dGot = true
			res.lat = append(res.lat, time.Since(q.ready))
			if o.Result != kvxfer.ResultDone {
				res.failures = append(res.failures, fmt.Sprintf("D %s: %v %s", o.ReqID, o.Result, o.Reason))
			} else {
				sim := &kvsim.Request{Tokens: q.tokens, P: []topology.Span{{IDs: q.pIDs}}, D: []topology.Span{{IDs: q.dIDs}}}
				good := true
				for i, r := range D.Ranks {
					if err := r.CheckRequest(sim, block, block); err != nil {
						good = false
						res.failures = append(res.failures, fmt.Sprintf("D rank %d %s: wrong bytes: %v", i, o.ReqID, err))
					}
				}
				if good {
					res.done++
					res.bytes += int64(q.tokens) * bytesPerToken
				} else {
					res.bad++
				}
			}
			D.free = append(D.free, q.dIDs...)
			if q.pDone {
				inflight--
			}
		}
		time.Sleep(500 * time.Microsecond)
	}
	res.elapsed = time.Since(start)
	for _, q := range order {
		if !q.pDone || !q.dGot {
			res.missing++
			res.failures = append(res.failures, fmt.Sprintf("request %s: producer outcome %v, consumer outcome %v", q.id, q.pDone, q.dGot))
		}
	}
	res.missing += n - len(order)
	fmt.Printf(" %d done in %v\n", res.done, res.elapsed.Round(time.Millisecond))
	return res, nil
}
