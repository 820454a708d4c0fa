// Command pdsim is kvxfer's P/D simulator: simulated prefill (P) and
// decode (D) engines — block allocators with a prefix cache and a free
// queue that fragments over time, a prefill time model per token and TP
// size, a decode time per step, step-loop schedulers — drive two real
// kvxferd daemons (child processes; built-in or NIXL backend) that move real KV
// bytes between the engines' shared memory. A router dispatches each
// request sequentially (pull: P, then D with P's transfer params) or
// concurrently (push, layer-wise push, and the no-transfer baseline: P and
// D at once). Every transferred byte is verified on every D rank.
//
//	go run ./bench/pdsim                 the default matrix, every mode
//	go run ./bench/pdsim -quick          a short run (small shapes)
//	go run ./bench/pdsim -tp 8 -input 2048 -output 64 -rate 16 -modes push,pull
//	go run ./bench/pdsim -backend nixl -quick   the daemons move KV over NIXL
//
// It prints a table (mean, median and p99 TTFT, mean TPOT, requests per
// second) per shape and mode, and writes an SVG of the TTFT distributions.
// The workload (arrivals, lengths, block order) is reproducible from
// -seed; times are real (the compute is slept), so they vary with the
// machine's load.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/kvsim"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/topology"
)

func main() {
	daemontest.ServeIfChild() // the daemons are this binary
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := pdsimMain(ctx, os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "pdsim:", err)
		os.Exit(1)
	}
}

// options are pdsim's flags.
type options struct {
	modes      []mode
	shapes     []shape
	seed       uint64
	svg, md    string
	model      kvsim.Model
	block      int
	time       timeModel
	corrupt    bool
	timeLimit  time.Duration
	hop        time.Duration
	repeats    int
	backend    string
	daemonArgs []string // extra kvxferd flags (-nixl-params)
}

// defaultShapes is the matrix of the seeds' workloads: TP 4 and 8 and P8
// -> D4, inputs 512-2048, outputs 64-128, 4-16 requests per second, D
// prefix hits of 0, 50 and 100%, fresh and fragmented KV.
func defaultShapes(scale float64) []shape {
	mk := func(ptp, dtp, in, out int, rate, hit float64, frag bool) shape {
		return shape{PTP: ptp, DTP: dtp, Input: in, Output: out, Rate: rate, Hit: hit, Frag: frag,
			Requests: max(10, int(rate*10*scale))}
	}
	return []shape{
		mk(4, 4, 512, 64, 4, 0, false),
		mk(4, 4, 1024, 128, 8, 0, false),
		mk(4, 4, 2048, 128, 4, 0, false),
		mk(4, 4, 1024, 128, 16, 0, false),
		mk(8, 8, 1024, 128, 8, 0, false),
		mk(8, 8, 2048, 64, 16, 0, false),
		mk(8, 4, 1024, 128, 8, 0, false),
		mk(4, 4, 1024, 128, 8, 0.5, false),
		mk(4, 4, 1024, 128, 8, 1, false),
		mk(4, 4, 1024, 128, 8, 0, true),
	}
}

func parseOptions(args []string, stderr io.Writer) (*options, error) {
	fs := flag.NewFlagSet("pdsim", flag.ContinueOnError)
	fs.SetOutput(stderr)
	modes := fs.String("modes", "baseline,pull,push,layerwise", "modes to run: baseline, pull, push, layerwise")
	quick := fs.Bool("quick", false, "a short run: two small shapes, 12 requests each")
	scale := fs.Float64("scale", 1, "requests per shape of the default matrix: rate x 10 s x scale")
	seed := fs.Uint64("seed", 1, "seed of the workload (arrivals, block order)")
	svg := fs.String("svg", "pdsim-ttft.svg", `SVG chart of the TTFT distributions ("" for none)`)
	md := fs.String("md", "", "also write the table as Markdown to this file")
	ptp := fs.Int("ptp", 0, "one shape: P's TP size (with -dtp, -input...; 0: the default matrix)")
	dtp := fs.Int("dtp", 0, "one shape: D's TP size (default -ptp)")
	tp := fs.Int("tp", 0, "one shape: P's and D's TP size")
	input := fs.Int("input", 1024, "one shape: prompt tokens")
	output := fs.Int("output", 128, "one shape: output tokens")
	rate := fs.Float64("rate", 8, "one shape: requests per second (Poisson)")
	hit := fs.Float64("hit", 0, "one shape: fraction of the prompt in D's prefix cache (0..1)")
	frag := fs.Bool("frag", false, "one shape: engines start with shuffled (fragmented) free block queues")
	requests := fs.Int("requests", 0, "one shape: requests (default rate x 10 s)")
	layers := fs.Int("layers", 16, "simulated model: layers (KV regions; layer-wise push WRITEs each)")
	heads := fs.Int("kv-heads", 8, "simulated model: KV heads")
	headSize := fs.Int("head-size", 8, "simulated model: head size (elements of 2 bytes); KV bytes per token = layers x heads x head size x 4")
	block := fs.Int("block", 16, "tokens per KV block")
	speed := fs.Float64("compute-scale", 1, "multiplies every simulated compute time")
	corrupt := fs.Bool("corrupt", false, "corrupt one source byte of one request per run (the run must fail)")
	limit := fs.Duration("time-limit", 0, "per run (default: the arrivals' span + 2 minutes)")
	backend := fs.String("backend", "builtin", "the daemons' transfer backend: builtin (between the two processes: its same-host path, one copy out of the engine's memory file) or nixl (NVIDIA NIXL, UCX; needs libnixl_capi.so)")
	nixlParams := fs.String("nixl-params", "", "with -backend nixl: the UCX backend's parameters, key=value,...")
	repeats := fs.Int("repeats", 1, "runs per shape and mode, with seeds -seed, -seed+1...; the table pools them and the summary gives the range over runs")
	hop := fs.Duration("dispatch-latency", 0, "the router's latency per dispatch (HTTP, tokenization): pull pays it twice in a row, the concurrent modes once")
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	o := &options{seed: *seed, svg: *svg, md: *md, block: *block, time: model32B, corrupt: *corrupt, timeLimit: *limit, hop: *hop, repeats: *repeats}
	if *repeats < 1 {
		return nil, fmt.Errorf("-repeats = %d, want >= 1", *repeats)
	}
	switch o.backend = *backend; o.backend {
	case "builtin":
		if *nixlParams != "" {
			return nil, errors.New("-nixl-params needs -backend nixl")
		}
	case "nixl":
		if _, err := nixl.ParseParams(*nixlParams); err != nil {
			return nil, fmt.Errorf("-nixl-params: %w", err)
		}
		if *nixlParams != "" {
			o.daemonArgs = []string{"-nixl-params", *nixlParams}
		}
	default:
		return nil, fmt.Errorf("-backend = %q, want builtin or nixl", *backend)
	}
	if *hop < 0 {
		return nil, fmt.Errorf("-dispatch-latency = %v, want >= 0", *hop)
	}
	for _, m := range strings.Split(*modes, ",") {
		md, err := parseMode(strings.TrimSpace(m))
		if err != nil {
			return nil, fmt.Errorf("-modes: %w", err)
		}
		o.modes = append(o.modes, md)
	}
	if *layers < 1 || *heads < 1 || *headSize < 1 || *block < 1 {
		return nil, fmt.Errorf("-layers %d -kv-heads %d -head-size %d -block %d: each must be > 0", *layers, *heads, *headSize, *block)
	}
	if *speed <= 0 {
		return nil, fmt.Errorf("-compute-scale = %g, want > 0", *speed)
	}
	o.time.PrefillPerToken = time.Duration(float64(o.time.PrefillPerToken) * *speed)
	o.time.DecodeStep = time.Duration(float64(o.time.DecodeStep) * *speed)
	o.time.DecodePerSeq = time.Duration(float64(o.time.DecodePerSeq) * *speed)
	o.model = kvsim.Model{TotalKVHeads: *heads, HeadSize: *headSize, ElemBytes: 2}
	for range *layers {
		o.model.Kinds = append(o.model.Kinds, topology.KindFullAttention)
	}
	if *tp > 0 {
		*ptp, *dtp = *tp, *tp
	}
	switch {
	case *quick:
		o.shapes = []shape{
			{PTP: 1, DTP: 1, Input: 256, Output: 8, Rate: 20, Requests: 12},
			{PTP: 2, DTP: 1, Input: 512, Output: 8, Rate: 20, Hit: 0.5, Frag: true, Requests: 12},
		}
	case *ptp > 0:
		if *dtp == 0 {
			*dtp = *ptp
		}
		s := shape{PTP: *ptp, DTP: *dtp, Input: *input, Output: *output, Rate: *rate, Hit: *hit, Frag: *frag, Requests: *requests}
		if s.Requests == 0 {
			s.Requests = max(10, int(s.Rate*10))
		}
		if s.Input < 1 || s.Output < 1 || s.Rate <= 0 || s.Hit < 0 || s.Hit > 1 || s.Requests < 1 || *dtp < 1 {
			return nil, fmt.Errorf("shape %+v: -input, -output, -rate, -requests and -dtp must be > 0 and -hit in [0, 1]", s)
		}
		o.shapes = []shape{s}
	default:
		if *scale <= 0 {
			return nil, fmt.Errorf("-scale = %g, want > 0", *scale)
		}
		o.shapes = defaultShapes(*scale)
	}
	return o, nil
}

func pdsimMain(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	o, err := parseOptions(args, stderr)
	if err != nil {
		return err
	}
	base := "/dev/shm"
	if st, err := os.Stat(base); err != nil || !st.IsDir() {
		base = os.TempDir()
	}
	dir, err := os.MkdirTemp(base, "kvxfer-pdsim-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	bpt := len(o.model.Kinds) * o.model.TotalKVHeads * o.model.HeadSize * o.model.ElemBytes * 2
	fmt.Fprintf(stdout, "pdsim: P and D kvxferd (%s backend, separate processes), seed %d\n", o.backend, o.seed)
	fmt.Fprintf(stdout, "  time model: 32B-class dense on H100 (prefill %v/token, decode step %v + %v/seq at TP 1; / TP^%.1f)\n",
		o.time.PrefillPerToken, o.time.DecodeStep, o.time.DecodePerSeq, o.time.TPExp)
	if o.hop > 0 {
		fmt.Fprintf(stdout, "  router: %v per dispatch\n", o.hop)
	}
	fmt.Fprintf(stdout, "  KV: %d layers x %d heads x %d x bf16 x K,V = %d bytes/token, block %d; every byte D receives is verified\n\n",
		len(o.model.Kinds), o.model.TotalKVHeads, o.model.HeadSize, bpt, o.block)
	p, err := daemontest.Start(dir, "P", o.backend, o.daemonArgs...)
	if err != nil {
		return err
	}
	d, err := daemontest.Start(dir, "D", o.backend, o.daemonArgs...)
	if err != nil {
		_ = p.Stop()
		return err
	}
	var results []*result // pooled per shape and mode
	var runErr error
	if o.repeats > 1 {
		fmt.Fprintf(stdout, "each run (%d per shape and mode, seeds %d-%d, modes in rotating order):\n", o.repeats, o.seed, o.seed+uint64(o.repeats)-1)
	}
	printHeader(stdout)
	for _, s := range o.shapes {
		runs := make([][]*result, len(o.modes))
		for rep := range o.repeats {
			for k := range o.modes {
				// Each repeat starts with another mode, so that a slow patch
				// of the machine does not always fall on the same one.
				i := (k + rep) % len(o.modes)
				m := o.modes[i]
				seed := o.seed + uint64(rep)
				res, err := simulate(ctx, runConfig{shape: s, mode: m, seed: seed, time: o.time, model: o.model, block: o.block,
					dir: dir, p: p, d: d, corrupt: o.corrupt, progress: stderr, timeLimit: o.timeLimit, hop: o.hop})
				if res != nil {
					runs[i] = append(runs[i], res)
					printRow(stdout, res)
					for _, f := range res.failures[:min(len(res.failures), 5)] {
						fmt.Fprintln(stdout, "    ", f)
					}
				}
				if err == nil && (res.bad > 0 || res.failed > 0 || len(res.failures) > 0) {
					err = fmt.Errorf("%d requests with wrong bytes, %d without an outcome, %d failures", res.bad, res.failed, len(res.failures))
				}
				if err != nil {
					runErr = errors.Join(runErr, fmt.Errorf("%s %s seed %d: %w", s, m, seed, err))
				}
				if ctx.Err() != nil {
					break
				}
			}
			if ctx.Err() != nil {
				break
			}
		}
		for _, rs := range runs {
			if len(rs) > 0 {
				results = append(results, merge(rs))
			}
		}
		if ctx.Err() != nil {
			break
		}
	}
	if o.repeats > 1 {
		fmt.Fprintf(stdout, "\npooled over the runs:\n")
		printHeader(stdout)
		for _, r := range results {
			printRow(stdout, r)
		}
	}
	perr, derr := p.Stop(), d.Stop()
	if perr != nil || derr != nil {
		runErr = errors.Join(runErr, fmt.Errorf("daemon exit: P %v, D %v (logs in %s)", perr, derr, dir))
	}
	fmt.Fprintln(stdout)
	printSummary(stdout, results)
	if o.md != "" {
		if err := os.WriteFile(o.md, []byte(markdown(results)), 0o644); err != nil {
			runErr = errors.Join(runErr, err)
		}
	}
	if o.svg != "" && len(results) > 0 {
		if err := os.WriteFile(o.svg, []byte(chart(results)), 0o644); err != nil {
			runErr = errors.Join(runErr, err)
		} else {
			fmt.Fprintf(stdout, "TTFT distributions: %s\n", o.svg)
		}
	}
	if runErr != nil {
		fmt.Fprintln(stdout, "\nFAILED:", runErr)
		return errors.New("a byte was wrong, a request lacked its outcome, or a run failed (see above)")
	}
	fmt.Fprintln(stdout, "\nOK: every request ended done on both sides and every transferred byte matched")
	return nil
}
