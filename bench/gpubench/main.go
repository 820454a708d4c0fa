// Command gpubench measures moving a KV cache's blocks between two
// processes on one GPU: 32 layers x n blocks, one piece per layer-block
// (64 KiB and 4 KiB), from scattered source blocks into scattered
// destination blocks (random permutations, fixed seed), n = 8, 64 and
// 256. The source process is this one (P); the destination is this
// command re-executed as a child (D), driven over two pipes. Each side
// transfers from and into GPU memory its own process allocated.
//
// The contenders, side by side in one run (contenders.go, python.go):
// kvxfer's built-in backend on its same-host path (internal/netxfer:
// MapDevice, CUDA IPC), kvxfer's NIXL binding (internal/nixl, UCX) with
// the backend's default threads and with num_threads=4, NIXL's own
// Python API (nixl_py.py, torch CUDA tensors, num_threads=4 as vLLM:
// "python" posts the WRITE and polls it to completion, "python-push" times
// the push round trip through the same API, from the destination's
// registration notification to its seeing the WRITE's notification, the
// work kvxfer's whole path does), and two copies in one process: one contiguous cuMemcpyDtoD of the same
// bytes (the limit) and one cuMemcpyDtoD per piece. Every byte of the
// destination pieces is checked once per case and contender, after its
// timed transfers (the destination is marked before them, and every case
// has its own source pattern). The table gives GB/s (10^9 B/s, from the
// post to the sender knowing the transfer completed): the median over
// the timed repetitions and their range.
//
// Usage (on a machine with an NVIDIA GPU; test/gpu/run runs it):
//
//	go run ./bench/gpubench
//	go run ./bench/gpubench -contenders samehost,contig -reps 10
//
// Without a GPU it says so and exits 1. -fake-gpu runs every contender on
// host memory standing in for the GPU (its test; the numbers mean
// nothing).
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/internal/cuda"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "gpubench:", err)
		os.Exit(1)
	}
}

// childEnv marks the child process (for a test binary, whose TestMain
// must serve as the child before the testing flags are parsed).
const childEnv = "GPUBENCH_CHILD"

type config struct {
	cases        []xcase
	reps, warmup int
	names        []string
	python       string
	pySmall      bool
	o            opts
	timeout      time.Duration
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	// One lock for every writer of stderr: the bench, the child's copier
	// and the python contender's (exec's goroutines).
	if _, ok := stderr.(*lockedWriter); !ok {
		stderr = &lockedWriter{w: stderr}
	}
	fs := flag.NewFlagSet("gpubench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	pieces := fs.String("pieces", "64KiB,4KiB", "piece (layer-block) sizes, comma-separated")
	blocks := fs.String("blocks", "8,64,256", "blocks per layer, comma-separated")
	layers := fs.Int("layers", 32, "layers")
	reps := fs.Int("reps", 5, "timed transfers per case and contender")
	warmup := fs.Int("warmup", 1, "untimed transfers before them")
	names := fs.String("contenders", "samehost,samehost-pieces,samehost-x4,samehost-gate,samehost-read,nixl,nixl4,nixl4-read,nixl-gpu,nixl8,python,python-push,python-read,python-split,kernel,kernel-layout,kernel-gated,contig,perpiece", "contenders, comma-separated")
	python := fs.String("python", "python3", "the Python of the python contender (torch and nixl_cu12)")
	pySmall := fs.Bool("python-small", true, "run the python contender's pieces under 64 KiB too")
	fake := fs.Bool("fake-gpu", false, "host memory stands in for the GPU (tests; the numbers mean nothing)")
	fakeBusy := fs.Duration("fake-gpu-busy", 0, "with -fake-gpu: a batch is done this long after it was posted (a kernel's time)")
	timeout := fs.Duration("timeout", 4*time.Minute, "give up after this long")
	child := fs.Bool("child", false, "serve as the destination process (internal)")
	span := fs.Int("span", 0, "child: bytes of its region")
	wakeChild := fs.Bool("wakeup-child", false, "echo bytes on descriptor 3 (internal: the wake-up probe)")
	if err := fs.Parse(args); err != nil {
		return err
	}
	o := opts{fake: *fake, fakeBusy: *fakeBusy}
	if o.fakeBusy < 0 || o.fakeBusy > 0 && !o.fake {
		return fmt.Errorf("-fake-gpu-busy %v: want a duration of at least 0, with -fake-gpu", o.fakeBusy)
	}
	if *child {
		return childMain(o, *span)
	}
	if *wakeChild {
		return wakeupChild()
	}
	cfg := config{reps: *reps, warmup: *warmup, python: *python, pySmall: *pySmall, o: o, timeout: *timeout}
	ps, err := parseList("pieces", *pieces)
	if err != nil {
		return err
	}
	bs, err := parseList("blocks", *blocks)
	if err != nil {
		return err
	}
	for _, p := range ps {
		if p%8 != 0 {
			return fmt.Errorf("-pieces %d: want multiples of 8 bytes", p)
		}
		for _, b := range bs {
			cfg.cases = append(cfg.cases, xcase{Piece: p, Blocks: b, Layers: *layers})
		}
	}
	if *layers < 1 || cfg.reps < 1 || cfg.warmup < 0 {
		return fmt.Errorf("-layers %d, -reps %d, -warmup %d: want at least 1, 1, 0", *layers, cfg.reps, cfg.warmup)
	}
	for _, n := range strings.Split(*names, ",") {
		n = strings.TrimSpace(n)
		if _, ok := findContender(n); !ok && pyModes[n] == "" {
			return fmt.Errorf("-contenders: unknown %q (have samehost, samehost-pieces, samehost-x4, samehost-gate, samehost-read, nixl, nixl4, nixl4-read, nixl-gpu, python, python-push, python-read, python-split, kernel, kernel-layout, contig, perpiece)", n)
		}
		cfg.names = append(cfg.names, n)
	}
	ctx, cancel := context.WithTimeout(ctx, cfg.timeout)
	defer cancel()
	return bench(ctx, cfg, stdout, stderr)
}

func parseList(name, s string) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		f = strings.TrimSpace(f)
		mul := 1
		for suf, m := range map[string]int{"KiB": 1 << 10, "MiB": 1 << 20} {
			if v, ok := strings.CutSuffix(f, suf); ok {
				f, mul = v, m
			}
		}
		n, err := strconv.Atoi(f)
		if err != nil || n < 1 {
			return nil, fmt.Errorf("-%s: %q is not a positive size", name, f)
		}
		out = append(out, n*mul)
	}
	return out, nil
}

// openGPU opens device 0, or the fake.
func openGPU(o opts) (gpu, error) {
	if o.fake {
		g := newFakeGPU()
		g.busy = o.fakeBusy
		return g, nil
	}
	g, err := openCUDA(0)
	if errors.Is(err, cuda.ErrUnavailable) {
		return nil, fmt.Errorf("no GPU here (%w): run it on a machine with an NVIDIA GPU and its driver (test/gpu/run), "+
			"or with -fake-gpu to test the bench itself", err)
	}
	if err != nil {
		return nil, err
	}
	return g, nil
}

// allocSide allocates and exports a region of n bytes.
func allocSide(g gpu, n int) (*side, error) {
	s := &side{g: g, size: n}
	var err error
	if s.base, err = g.Alloc(n); err != nil {
		return nil, fmt.Errorf("allocate %d MiB: %w", n>>20, err)
	}
	if s.handle, err = g.Export(s.base); err == nil {
		s.uuid, err = g.UUID()
	}
	if err != nil {
		_ = g.Free(s.base)
		return nil, err
	}
	return s, nil
}

// result is one contender's outcome on one case.
type result struct {
	gbps []float64
	err  string
}

func bench(ctx context.Context, cfg config, stdout, stderr io.Writer) (err error) {
	g, err := openGPU(cfg.o)
	if err != nil {
		return err
	}
	defer g.Close()
	span := 0
	for _, c := range cfg.cases {
		span = max(span, c.span())
	}
	fmt.Fprintf(stdout, "gpubench: %s; %d timed transfers after %d warm-up per case; regions of %d MiB per process\n",
		machine(cfg.o), cfg.reps, cfg.warmup, span>>20)
	if idle, busy, werr := wakeup(ctx); werr != nil {
		fmt.Fprintf(stdout, "gpubench: the wake-up probe failed: %v\n", werr)
	} else {
		fmt.Fprintf(stdout, "gpubench: one hop between two processes (a byte over a unix socket, half a round trip; medians of %d): "+
			"%.1f µs with both asleep (%v apart), %.1f µs back to back\n", wakeupTrips, us(idle), wakeupIdle, us(busy))
	}
	src, err := allocSide(g, span)
	if err != nil {
		return err
	}
	defer g.Free(src.base)
	scratch, err := allocSide(g, span)
	if err != nil {
		return err
	}
	defer g.Free(scratch.base)

	res := map[string]map[xcase]result{}
	why := map[string]string{} // a contender that did not run, and why
	var run []contender
	for _, n := range cfg.names {
		c, ok := findContender(n)
		if !ok {
			continue
		}
		if c.avail != nil {
			if aerr := c.avail(&cfg.o); aerr != nil {
				why[n] = aerr.Error()
				fmt.Fprintf(stdout, "gpubench: skip %s: %v\n", n, aerr)
				continue
			}
		}
		run = append(run, c)
	}
	var r *remote
	if slices.ContainsFunc(run, func(c contender) bool { return c.peer != nil }) {
		if r, err = startChild(ctx, cfg.o, span, stderr); err != nil {
			return err
		}
		defer func() {
			if cerr := r.stop(); err == nil && cerr != nil {
				err = cerr
			}
		}()
	}
	movers := map[string]mover{}
	defer func() {
		for n, m := range movers {
			if cerr := m.close(); cerr != nil {
				fmt.Fprintf(stderr, "gpubench: close %s: %v\n", n, cerr)
			}
		}
	}()
	for _, c := range run {
		var meta []byte
		if c.peer != nil {
			resp, err := r.call(ctlReq{Op: "open", Contender: c.name})
			if err != nil {
				why[c.name] = "the destination's side: " + err.Error()
				continue
			}
			meta = resp.Meta
		}
		m, back, err := c.open(&cfg.o, src, scratch, r, meta)
		if err == nil && back != nil {
			_, err = r.call(ctlReq{Op: "link", Contender: c.name, Meta: back})
		}
		if err != nil {
			why[c.name] = err.Error()
			if m != nil {
				_ = m.close()
			}
			continue
		}
		movers[c.name] = m
		res[c.name] = map[xcase]result{}
	}
	host := new([]byte)
	started := time.Now()
	// Out of time, the cases measured so far are still reported (the rest
	// read "not run"), and the run fails.
	var late error
	var hops []hopReport
cases:
	for _, c := range cfg.cases {
		b := grow(host, c.span())
		pattern(b, c.seed(), 0)
		if err := src.g.CopyIn(src.base, b); err != nil {
			return err
		}
		for _, ct := range run {
			m := movers[ct.name]
			if m == nil {
				continue
			}
			if err := ctx.Err(); err != nil {
				late = fmt.Errorf("out of time (-timeout %v) before %s on %s: the cases left read \"not run\"", cfg.timeout, ct.name, c)
				break cases
			}
			out := measure(m, c, cfg)
			res[ct.name][c] = out
			if h, ok := m.(hopper); ok && out.err == "" {
				if names, hs, err := h.hops(cfg.warmup); err != nil {
					fmt.Fprintf(stderr, "gpubench: %s, %s: hops: %v\n", ct.name, c, err)
				} else if hs != nil {
					hops = append(hops, hopReport{name: ct.name, c: c, names: names, hops: hs})
				}
			}
			if out.err != "" {
				fmt.Fprintf(stderr, "gpubench: %s, %s: %s\n", ct.name, c, out.err)
			}
		}
	}
	fmt.Fprintf(stdout, "gpubench: the Go contenders took %v\n", time.Since(started).Round(time.Millisecond))
	if late != nil {
		fmt.Fprintf(stdout, "gpubench: %v\n", late)
		for n := range pyModes {
			if slices.Contains(cfg.names, n) {
				why[n] = "out of time before it started"
			}
		}
	}
	if late == nil && slices.ContainsFunc(cfg.names, func(n string) bool { return pyModes[n] != "" }) {
		pr, perrs := runPython(ctx, cfg, stderr)
		for n := range pyModes {
			switch {
			case !slices.Contains(cfg.names, n):
			case perrs[n] != nil:
				why[n] = perrs[n].Error()
			default:
				res[n] = pr[n]
			}
		}
	}
	fmt.Fprintln(stdout)
	failed := report(stdout, cfg, res, why)
	reportGoals(stdout, cfg, res)
	reportHops(stdout, hops)
	if late != nil {
		return late
	}
	if failed > 0 {
		return fmt.Errorf("%d case(s) failed (see the table)", failed)
	}
	return nil
}

// measure runs one case on one mover: marks, warm-up, timed transfers,
// the check.
func measure(m mover, c xcase, cfg config) result {
	if err := m.prepare(c); err != nil {
		return result{err: "prepare: " + err.Error()}
	}
	var out result
	for i := range cfg.warmup + cfg.reps {
		d, err := m.write(c)
		if err != nil {
			return result{err: err.Error()}
		}
		if i >= cfg.warmup {
			out.gbps = append(out.gbps, float64(c.total())/d.Seconds()/1e9)
		}
	}
	if err := m.check(c); err != nil {
		return result{err: "WRONG BYTES: " + err.Error()}
	}
	return out
}

// machine describes the host and the GPU in one line.
func machine(o opts) string {
	what := "GPU 0"
	if o.fake {
		what = "a fake GPU (host memory)"
	} else if out, err := exec.Command("nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader", "-i", "0").Output(); err == nil {
		what = strings.TrimSpace(string(out))
	}
	return fmt.Sprintf("%s, %d CPUs, %s", what, runtime.NumCPU(), runtime.Version())
}

// ctlReq is one request to the child; ctlResp its answer.
type ctlReq struct {
	Op        string // open, link, gate, mark, verify, fill, stamps, close, exit
	Contender string `json:",omitempty"`
	Case      xcase
	Meta      []byte `json:",omitempty"`
}

type ctlResp struct {
	Err  string `json:",omitempty"`
	Base uint64 `json:",omitempty"` // hello: the child's region's address
	Meta []byte `json:",omitempty"`
}

// remote is the child process, the destination.
type remote struct {
	cmd  *exec.Cmd
	w    io.WriteCloser
	enc  *json.Encoder
	dec  *json.Decoder
	base uint64
}

// startChild re-executes this program as the child. The requests go
// over its descriptor 3 and the answers come back on 4, so whatever NIXL
// or UCX print on its standard output does not mix with them.
func startChild(ctx context.Context, o opts, span int, stderr io.Writer) (*remote, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := []string{"-child", "-span", fmt.Sprint(span)}
	if o.fake {
		args = append(args, "-fake-gpu", "-fake-gpu-busy", o.fakeBusy.String())
	}
	reqR, reqW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	respR, respW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.Stdout, cmd.Stderr = stderr, stderr
	cmd.ExtraFiles = []*os.File{reqR, respW}
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 10 * time.Second
	err = cmd.Start()
	reqR.Close()
	respW.Close()
	if err != nil {
		reqW.Close()
		respR.Close()
		return nil, fmt.Errorf("start the destination process: %w", err)
	}
	r := &remote{cmd: cmd, w: reqW, enc: json.NewEncoder(reqW), dec: json.NewDecoder(respR)}
	var hello ctlResp
	if err := r.dec.Decode(&hello); err != nil || hello.Err != "" {
		reqW.Close()
		werr := cmd.Wait()
		return nil, fmt.Errorf("the destination process: %v %s (exit: %v)", err, hello.Err, werr)
	}
	r.base = hello.Base
	return r, nil
}

func (r *remote) call(req ctlReq) (ctlResp, error) {
	if err := r.enc.Encode(req); err != nil {
		return ctlResp{}, fmt.Errorf("destination %s: %w", req.Op, err)
	}
	var resp ctlResp
	if err := r.dec.Decode(&resp); err != nil {
		return ctlResp{}, fmt.Errorf("destination %s: %w", req.Op, err)
	}
	if resp.Err != "" {
		return resp, fmt.Errorf("destination %s: %s", req.Op, resp.Err)
	}
	return resp, nil
}

// stamps fetches (and empties) the child's stamps.
func (r *remote) stamps() (childStamps, error) {
	var st childStamps
	resp, err := r.call(ctlReq{Op: "stamps"})
	if err == nil {
		err = json.Unmarshal(resp.Meta, &st)
	}
	return st, err
}

func (r *remote) stop() error {
	_, err := r.call(ctlReq{Op: "exit"})
	r.w.Close()
	if werr := r.cmd.Wait(); err == nil && werr != nil {
		err = fmt.Errorf("destination process: %w", werr)
	}
	return err
}

// childMain is the destination process: its own region of span bytes on
// its own GPU, and the contenders' sides on it.
func childMain(o opts, span int) error {
	in, out := os.NewFile(3, "requests"), os.NewFile(4, "answers")
	if in == nil || out == nil {
		return errors.New("-child: started without its pipes")
	}
	enc, dec := json.NewEncoder(out), json.NewDecoder(in)
	fail := func(err error) error {
		_ = enc.Encode(ctlResp{Err: err.Error()})
		return err
	}
	g, err := openGPU(o)
	if err != nil {
		return fail(err)
	}
	defer g.Close()
	s, err := allocSide(g, span)
	if err != nil {
		return fail(err)
	}
	defer g.Free(s.base)
	open := map[string]peerSide{}
	defer func() {
		for _, p := range open {
			_ = p.close()
		}
	}()
	if err := enc.Encode(ctlResp{Base: s.base}); err != nil {
		return err
	}
	host := new([]byte)
	for {
		var req ctlReq
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil // the parent is gone
			}
			return err
		}
		var resp ctlResp
		var err error
		c, _ := findContender(req.Contender)
		switch req.Op {
		case "exit":
			for n, p := range open {
				if cerr := p.close(); cerr != nil {
					resp.Err = fmt.Sprintf("close %s: %v", n, cerr)
				}
				delete(open, n)
			}
			return enc.Encode(resp)
		case "open":
			switch {
			case c.peer == nil:
				err = fmt.Errorf("no destination side for contender %q", req.Contender)
			case open[c.name] != nil:
				err = fmt.Errorf("%s is open already", c.name)
			default:
				var p peerSide
				if resp.Meta, p, err = c.peer(&o, s); err == nil {
					open[c.name] = p
				}
			}
		case "link":
			if p := open[req.Contender]; p != nil {
				err = p.link(req.Meta)
			} else {
				err = fmt.Errorf("%q is not open", req.Contender)
			}
		case "close":
			if p := open[req.Contender]; p != nil {
				err = p.close()
				delete(open, req.Contender)
			}
		case "gate":
			if g, ok := open[req.Contender].(*gateSide); ok {
				err = g.open(req.Case)
			} else {
				err = fmt.Errorf("%q opens no gates", req.Contender)
			}
		case "mark":
			err = mark(s, req.Case)
		case "verify":
			err = checkSide(s, req.Case, host)
		case "stamps":
			resp.Meta = encodeStamps(childStamps{Batches: childBatches.take(), Wire: childWire.take(), Notes: childNotes.take()})
		case "fill":
			// The source pattern in this region (a READ's remote side).
			b := grow(host, req.Case.span())
			pattern(b, req.Case.seed(), 0)
			err = s.g.CopyIn(s.base, b)
		default:
			err = fmt.Errorf("unknown request %q", req.Op)
		}
		if err != nil {
			resp.Err = err.Error()
		}
		if err := enc.Encode(resp); err != nil {
			return err
		}
	}
}
