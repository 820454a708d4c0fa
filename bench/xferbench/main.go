// Command xferbench runs kvxfer's built-in transfer backend side by side
// with its baselines between two processes on one host: a WRITE of 8 MiB
// or 64 MiB in scattered pieces of 1 MiB, 4 KiB or 512 B, from a
// /dev/shm mapping of this process into one of a child process (this
// command re-executed with -child, driven over its stdin and stdout).
//
// The contenders (contenders.go) are the built-in backend over loopback
// TCP, raw Go TCP over the same number of connections, a memory copy in
// one process (the same-host upper bound), and NIXL over UCX when its
// library is available. They run interleaved: every round runs every
// case once per contender, the contenders in a rotating order; each
// transfer's destination bytes are checked against a pattern unique to
// it. The table gives each contender's GB/s (10^9 bytes per second; the
// median over the rounds, and the range), and the built-in backend's
// ratio to each other contender, taken per round and then summarised.
//
// Usage:
//
//	go run ./bench/xferbench                      # -mode quick: 8 and 64 MiB, 21 rounds
//	go run ./bench/xferbench -mode full           # 81 rounds
//	go run ./bench/xferbench -contenders builtin,rawtcp -pieces 512,4KiB -rounds 20 -cpuprofile /tmp/xb
//
// -cpuprofile P writes the sender's CPU profile (this process) to
// P.sender.pprof and the receiver's (the child) to P.receiver.pprof. The
// sender's includes filling and checking the pattern between transfers
// (fill, verify, markGaps): leave them out with pprof -ignore. NIXL needs
// its library: see internal/nixl.FindLibrary (NIXL_CAPI_LIB).
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"maps"
	"os"
	"os/exec"
	"runtime"
	"runtime/pprof"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/kvxfer/kvxfer/shm"
)

func main() {
	if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
		fmt.Fprintln(os.Stderr, "xferbench:", err)
		os.Exit(1)
	}
}

// childEnv marks a process started as the child, for a test binary that
// must serve as the child before its own flags are parsed (TestMain).
const childEnv = "XFERBENCH_CHILD"

// config is what the flags select.
type config struct {
	sizes, pieces []int
	rounds        int
	contenders    []contender
	o             opts
	cpuprofile    string
}

var modes = map[string]struct {
	sizes  string
	rounds int
}{
	"quick": {"8MiB,64MiB", 21},
	"full":  {"8MiB,64MiB", 81},
}

func run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("xferbench", flag.ContinueOnError)
	fs.SetOutput(stderr)
	mode := fs.String("mode", "quick", "quick (21 rounds, about half a minute on 2 vCPUs) or full (81 rounds, about 2 minutes)")
	sizes := fs.String("sizes", "", "total bytes of one WRITE, comma-separated (default: the mode's)")
	pieces := fs.String("pieces", "1MiB,4KiB,512", "piece sizes, comma-separated")
	rounds := fs.Int("rounds", 0, "rounds (default: the mode's)")
	names := fs.String("contenders", "", "contenders to run, comma-separated (default: all)")
	conns := fs.Int("conns", 4, "TCP connections of builtin and rawtcp")
	cpuprofile := fs.String("cpuprofile", "", "write CPU profiles to `P`.sender.pprof and P.receiver.pprof")
	child := fs.Bool("child", false, "serve as the receiving process (internal)")
	dstPath := fs.String("dst", "", "child: the destination file")
	size := fs.Int("size", 0, "child: the destination file's size")
	if err := fs.Parse(args); err != nil {
		return err
	}
	if *child {
		return childMain(*dstPath, *size, *cpuprofile, os.Stdin, os.Stdout)
	}
	m, ok := modes[*mode]
	if !ok {
		return fmt.Errorf("-mode %q: want quick or full", *mode)
	}
	cfg := config{rounds: m.rounds, o: opts{Conns: *conns}, cpuprofile: *cpuprofile}
	if *rounds != 0 {
		cfg.rounds = *rounds
	}
	if cfg.rounds < 1 || cfg.o.Conns < 1 {
		return fmt.Errorf("-rounds %d, -conns %d: want at least 1", cfg.rounds, cfg.o.Conns)
	}
	if *sizes == "" {
		*sizes = m.sizes
	}
	var err error
	if cfg.sizes, err = parseSizes("sizes", *sizes); err != nil {
		return err
	}
	if cfg.pieces, err = parseSizes("pieces", *pieces); err != nil {
		return err
	}
	for _, t := range cfg.sizes {
		for _, p := range cfg.pieces {
			if p%8 != 0 || t%p != 0 {
				return fmt.Errorf("-pieces %d with -sizes %d: want pieces that are multiples of 8 bytes and divide the size", p, t)
			}
		}
	}
	if *names == "" {
		cfg.contenders = contenders
	} else {
		for _, n := range strings.Split(*names, ",") {
			c, ok := findContender(strings.TrimSpace(n))
			if !ok {
				return fmt.Errorf("-contenders: unknown %q (have %s)", n, strings.Join(contenderNames(contenders), ", "))
			}
			cfg.contenders = append(cfg.contenders, c)
		}
	}
	return bench(ctx, cfg, stdout, stderr)
}

func contenderNames(cs []contender) []string {
	var out []string
	for _, c := range cs {
		out = append(out, c.name)
	}
	return out
}

// bench runs the parent's side: mappings, the child, the rounds, the table.
func bench(ctx context.Context, cfg config, stdout, stderr io.Writer) (err error) {
	fmt.Fprintf(stdout, "xferbench: %s\n", machine())
	fmt.Fprintf(stdout, "xferbench: %d rounds, %d connections (builtin, rawtcp), GB/s = 10^9 B/s from the start of a WRITE to the sender knowing it landed\n",
		cfg.rounds, cfg.o.Conns)
	var run []contender
	for _, c := range cfg.contenders {
		if c.avail != nil {
			if aerr := c.avail(); aerr != nil {
				fmt.Fprintf(stdout, "xferbench: skip %s: %v\n", c.name, aerr)
				continue
			}
		}
		fmt.Fprintf(stdout, "xferbench: %-8s %s\n", c.name, c.what)
		run = append(run, c)
	}
	if len(run) == 0 {
		return errors.New("no contender can run")
	}
	var cases []xcase
	span := 0
	for _, t := range cfg.sizes {
		for _, p := range cfg.pieces {
			c := xcase{total: t, piece: p}
			cases = append(cases, c)
			span = max(span, c.span())
		}
	}
	span = int(shm.PageAlign(uint64(span)))

	dir, err := os.MkdirTemp(shmDir(), "xferbench-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	srcMap, err := shm.Create(dir, "src", uint64(span))
	if err != nil {
		return err
	}
	defer srcMap.Close()
	dstMap, err := shm.Create(dir, "dst", uint64(span))
	if err != nil {
		return err
	}
	defer dstMap.Close()

	if cfg.cpuprofile != "" {
		f, err := os.Create(cfg.cpuprofile + ".sender.pprof")
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}

	ch, err := startChild(ctx, dstMap.Path, span, cfg.cpuprofile, stderr)
	if err != nil {
		return err
	}
	defer func() {
		if cerr := ch.stop(); err == nil {
			err = cerr
		}
	}()
	e := &sides{src: srcMap.Bytes, srcFile: srcMap.File(), dst: dstMap.Bytes, dstBase: ch.base}

	movers := make([]mover, len(run))
	defer func() {
		for i, m := range movers {
			if m == nil {
				continue
			}
			if cerr := m.close(); cerr != nil && err == nil {
				err = fmt.Errorf("%s: close: %w", run[i].name, cerr)
			}
			if run[i].peer != nil {
				if _, cerr := ch.call(ctlReq{Op: "close", Contender: run[i].name}); cerr != nil && err == nil {
					err = fmt.Errorf("%s: close the child's side: %w", run[i].name, cerr)
				}
			}
		}
	}()
	for i, c := range run {
		var info peerInfo
		if c.peer != nil {
			resp, err := ch.call(ctlReq{Op: "open", Contender: c.name, Opts: cfg.o})
			if err != nil {
				return fmt.Errorf("%s: open the child's side: %w", c.name, err)
			}
			info = resp.Info
		}
		m, err := c.open(cfg.o, e, info)
		if err != nil {
			if c.peer != nil {
				_, _ = ch.call(ctlReq{Op: "close", Contender: c.name})
			}
			return fmt.Errorf("%s: open: %w", c.name, err)
		}
		movers[i] = m
	}

	seed := uint64(0)
	once := func(ci, k int) (time.Duration, error) {
		c := cases[ci]
		seed++
		fill(e.src, c, seed)
		markGaps(e.dst, c)
		d, err := movers[k].write(c)
		if err != nil {
			return 0, fmt.Errorf("%s, %s: %w", run[k].name, c, err)
		}
		if err := verify(e.dst, c, seed); err != nil {
			return 0, fmt.Errorf("%s, %s: WRONG BYTES after a transfer reported done: %w", run[k].name, c, err)
		}
		return d, nil
	}
	// One transfer of every case per contender first (connections, first
	// touch of the pages, NIXL's first registration lookups), not counted.
	for ci := range cases {
		for k := range run {
			if _, err := once(ci, k); err != nil {
				return err
			}
		}
	}
	// gbps[case][contender][round]
	gbps := make([][][]float64, len(cases))
	for ci := range cases {
		gbps[ci] = make([][]float64, len(run))
		for k := range run {
			gbps[ci][k] = make([]float64, cfg.rounds)
		}
	}
	started, load0 := time.Now(), loadavg()
	for r := range cfg.rounds {
		if err := ctx.Err(); err != nil {
			return err
		}
		for ci, c := range cases {
			for j := range run {
				k := (j + r) % len(run) // each contender takes each place in turn
				d, err := once(ci, k)
				if err != nil {
					return err
				}
				gbps[ci][k][r] = float64(c.total) / d.Seconds() / 1e9
			}
		}
	}
	fmt.Fprintf(stdout, "xferbench: %d rounds in %v, every destination byte checked after every transfer; load average %s -> %s\n\n",
		cfg.rounds, time.Since(started).Round(time.Millisecond), load0, loadavg())
	report(stdout, cases, run, gbps)
	return nil
}

// shmDir is where the mappings' files go: /dev/shm where there is one.
func shmDir() string {
	if st, err := os.Stat("/dev/shm"); err == nil && st.IsDir() {
		return "/dev/shm"
	}
	return os.TempDir()
}

// loadavg is the host's 1-minute load average: other work on the host
// shows in the spread.
func loadavg() string {
	b, _ := os.ReadFile("/proc/loadavg")
	if f := strings.Fields(string(b)); len(f) > 0 {
		return f[0]
	}
	return "?"
}

// machine describes this host in one line.
func machine() string {
	model := "unknown CPU"
	if b, err := os.ReadFile("/proc/cpuinfo"); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			if k, v, ok := strings.Cut(l, ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
	}
	kernel, _ := os.ReadFile("/proc/sys/kernel/osrelease")
	return fmt.Sprintf("%d CPUs (%s), GOMAXPROCS %d, %s %s/%s, Linux %s", runtime.NumCPU(), model, runtime.GOMAXPROCS(0),
		runtime.Version(), runtime.GOOS, runtime.GOARCH, strings.TrimSpace(string(kernel)))
}

// ctlReq is one request to the child.
type ctlReq struct {
	Op        string // open, close, exit
	Contender string `json:",omitempty"`
	Opts      opts
}

// ctlResp answers a request; the child's first message (hello) carries
// Base.
type ctlResp struct {
	Err  string `json:",omitempty"`
	Base uint64 `json:",omitempty"` // hello: the child's address of the destination mapping
	Info peerInfo
}

// child is the receiving process.
type child struct {
	cmd  *exec.Cmd
	in   io.WriteCloser
	enc  *json.Encoder
	dec  *json.Decoder
	base uint64
	done chan error
}

// startChild re-executes this program as the child over the destination
// file; the child dies with this process (Pdeathsig, and it exits when
// its stdin closes).
func startChild(ctx context.Context, dst string, size int, cpuprofile string, stderr io.Writer) (*child, error) {
	exe, err := os.Executable()
	if err != nil {
		return nil, err
	}
	args := []string{"-child", "-dst", dst, "-size", fmt.Sprint(size)}
	if cpuprofile != "" {
		args = append(args, "-cpuprofile", cpuprofile+".receiver.pprof")
	}
	cmd := exec.CommandContext(ctx, exe, args...)
	cmd.Env = append(os.Environ(), childEnv+"=1")
	cmd.Stderr = stderr
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	cmd.WaitDelay = 10 * time.Second
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start the child: %w", err)
	}
	ch := &child{cmd: cmd, in: in, enc: json.NewEncoder(in), dec: json.NewDecoder(bufio.NewReader(out)), done: make(chan error, 1)}
	var hello ctlResp
	if err := ch.dec.Decode(&hello); err != nil || hello.Err != "" {
		in.Close()
		werr := cmd.Wait()
		return nil, fmt.Errorf("child: hello: %v %s (exit: %v)", err, hello.Err, werr)
	}
	ch.base = hello.Base
	return ch, nil
}

func (ch *child) call(req ctlReq) (ctlResp, error) {
	if err := ch.enc.Encode(req); err != nil {
		return ctlResp{}, fmt.Errorf("child %s: %w", req.Op, err)
	}
	var resp ctlResp
	if err := ch.dec.Decode(&resp); err != nil {
		return ctlResp{}, fmt.Errorf("child %s: %w", req.Op, err)
	}
	if resp.Err != "" {
		return resp, fmt.Errorf("child %s: %s", req.Op, resp.Err)
	}
	return resp, nil
}

// stop asks the child to exit and waits for it (bounded by WaitDelay
// once its pipes close).
func (ch *child) stop() error {
	_, err := ch.call(ctlReq{Op: "exit"})
	ch.in.Close()
	if werr := ch.cmd.Wait(); err == nil && werr != nil {
		err = fmt.Errorf("child: %w", werr)
	}
	return err
}

// childMain serves the parent's requests over in and out.
func childMain(dstPath string, size int, cpuprofile string, in io.Reader, out io.Writer) error {
	m, err := shm.Map("", dstPath, uint64(size))
	enc := json.NewEncoder(out)
	if err != nil {
		_ = enc.Encode(ctlResp{Err: err.Error()})
		return err
	}
	defer m.Close()
	if cpuprofile != "" {
		f, err := os.Create(cpuprofile)
		if err != nil {
			return err
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			return err
		}
		defer pprof.StopCPUProfile()
	}
	open := map[string]io.Closer{}
	defer func() {
		for _, c := range open {
			c.Close()
		}
	}()
	if err := enc.Encode(ctlResp{Base: addr(m.Bytes)}); err != nil {
		return err
	}
	dec := json.NewDecoder(bufio.NewReader(in))
	for {
		var req ctlReq
		if err := dec.Decode(&req); err != nil {
			if errors.Is(err, io.EOF) {
				return nil // the parent is gone
			}
			return err
		}
		var resp ctlResp
		switch c, ok := findContender(req.Contender); {
		case req.Op == "exit":
			for name, c := range open {
				if err := c.Close(); err != nil {
					resp.Err = fmt.Sprintf("close %s: %v", name, err)
				}
				delete(open, name)
			}
			return enc.Encode(resp)
		case !ok || c.peer == nil:
			resp.Err = fmt.Sprintf("no receiving side for contender %q", req.Contender)
		case req.Op == "open" && open[c.name] == nil:
			info, closer, err := c.peer(req.Opts, m.Bytes)
			if err != nil {
				resp.Err = err.Error()
				break
			}
			open[c.name], resp.Info = closer, info
		case req.Op == "close" && open[c.name] != nil:
			if err := open[c.name].Close(); err != nil {
				resp.Err = err.Error()
			}
			delete(open, c.name)
		default:
			resp.Err = fmt.Sprintf("%s %q: not possible now (open: %v)", req.Op, req.Contender, slices.Sorted(maps.Keys(open)))
		}
		if err := enc.Encode(resp); err != nil {
			return err
		}
	}
}
