package main

import (
	"bufio"
	"context"
	_ "embed"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
)

// lockedWriter serializes writes to w.
type lockedWriter struct {
	mu sync.Mutex
	w  io.Writer
}

func (l *lockedWriter) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.w.Write(p)
}

// nixlPy is the python contender: NIXL's own Python API between two
// processes, each on a torch CUDA tensor it allocated (see its doc).
//
//go:embed nixl_py.py
var nixlPy []byte

// pyLine prefixes nixl_py.py's result lines on its standard output.
const pyLine = "gpubench-py "

// pyResult is one line of nixl_py.py: a case's GB/s in a mode, or why it
// could not run (Skip: the whole contender; Error: this case).
type pyResult struct {
	Mode                  string
	Piece, Blocks, Layers int
	GBps                  []float64
	Error, Skip           string
}

// pyModes are nixl_py.py's modes by contender: post to completion, and
// the push round trip.
var pyModes = map[string]string{pythonName: "write", pushName: "push", readName: "read", splitName: "write"}

// pySplit are the python contenders whose agents split a transfer over
// their workers as kvxfer's VRAM agents do (split_batch_size): run by a
// second nixl_py.py.
var pySplit = map[string]bool{splitName: true}

// runPython runs the python contenders cfg names, those of each
// split_batch_size by one nixl_py.py, and returns their results and, for
// those whose run failed, why.
func runPython(ctx context.Context, cfg config, stderr io.Writer) (map[string]map[xcase]result, map[string]error) {
	res, errs := map[string]map[xcase]result{}, map[string]error{}
	for _, split := range []bool{false, true} {
		var names []string
		for _, n := range cfg.names {
			if _, ok := pyModes[n]; ok && pySplit[n] == split {
				names = append(names, n)
			}
		}
		if len(names) == 0 {
			continue
		}
		n := 0
		if split {
			n = gpuTune.split
		}
		r, err := runNixlPy(ctx, cfg, stderr, names, n)
		for _, name := range names {
			if err != nil {
				errs[name] = err
			} else {
				res[name] = r[name]
			}
		}
	}
	return res, errs
}

// runNixlPy runs nixl_py.py with cfg's cases in the modes of the python
// contenders names (split: its agents' split_batch_size, 0 for NIXL's
// default), and returns their results by contender.
func runNixlPy(ctx context.Context, cfg config, stderr io.Writer, names []string, split int) (map[string]map[xcase]result, error) {
	if cfg.python == "" {
		return nil, fmt.Errorf("no -python")
	}
	dir, err := os.MkdirTemp("", "gpubench-py-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	script := filepath.Join(dir, "nixl_py.py")
	if err := os.WriteFile(script, nixlPy, 0o600); err != nil {
		return nil, err
	}
	var pieces, blocks []string
	seen := map[string]bool{}
	for _, c := range cfg.cases {
		if c.Piece < 64<<10 && !cfg.pySmall {
			continue
		}
		if p := fmt.Sprint(c.Piece); !seen["p"+p] {
			seen["p"+p] = true
			pieces = append(pieces, p)
		}
		if b := fmt.Sprint(c.Blocks); !seen["b"+b] {
			seen["b"+b] = true
			blocks = append(blocks, b)
		}
	}
	if len(pieces) == 0 {
		return nil, fmt.Errorf("no case left (-python-small=false)")
	}
	var modes []string
	byMode := map[string]string{}
	for _, n := range names {
		m := pyModes[n]
		modes = append(modes, m)
		byMode[m] = n
	}
	device := "cuda"
	if cfg.o.fake {
		device = "cpu"
	}
	cmd := exec.CommandContext(ctx, cfg.python, script, "--pieces", strings.Join(pieces, ","), "--blocks", strings.Join(blocks, ","),
		"--layers", fmt.Sprint(cfg.cases[0].Layers), "--reps", fmt.Sprint(cfg.reps), "--warmup", fmt.Sprint(cfg.warmup),
		"--threads", "4", "--device", device, "--modes", strings.Join(modes, ","), "--engine-config", engineConfig(&cfg.o),
		"--split", fmt.Sprint(split))
	// The child's standard error is copied by a goroutine of exec's while
	// lines of its standard output that are no result go there too.
	if _, ok := stderr.(*lockedWriter); !ok {
		stderr = &lockedWriter{w: stderr}
	}
	cmd.Stderr = stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("%s: %w", cfg.python, err)
	}
	res := map[string]map[xcase]result{}
	var skip string
	sc := bufio.NewScanner(out)
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), pyLine)
		if !ok {
			fmt.Fprintln(stderr, "nixl_py:", sc.Text())
			continue
		}
		var r pyResult
		if err := json.Unmarshal([]byte(line), &r); err != nil {
			return nil, fmt.Errorf("nixl_py.py said %q: %w", line, err)
		}
		if r.Skip != "" {
			skip = r.Skip
			continue
		}
		n, ok := byMode[r.Mode]
		if !ok {
			return nil, fmt.Errorf("nixl_py.py said %q: unknown mode %q", line, r.Mode)
		}
		if res[n] == nil {
			res[n] = map[xcase]result{}
		}
		res[n][xcase{Piece: r.Piece, Blocks: r.Blocks, Layers: r.Layers}] = result{gbps: r.GBps, err: r.Error}
	}
	werr := cmd.Wait()
	switch {
	case skip != "":
		return nil, fmt.Errorf("%s", skip)
	case werr != nil && len(res) == 0:
		return nil, fmt.Errorf("nixl_py.py: %w", werr)
	case werr != nil:
		for _, m := range modes {
			n := byMode[m]
			if res[n] == nil {
				res[n] = map[xcase]result{}
			}
			for _, c := range cfg.cases {
				if _, ok := res[n][c]; !ok && (c.Piece >= 64<<10 || cfg.pySmall) {
					res[n][c] = result{err: fmt.Sprintf("nixl_py.py ended (%v) before this case", werr)}
				}
			}
		}
	}
	return res, nil
}
