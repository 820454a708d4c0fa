package main

import (
	"bytes"
	"context"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/kvxfer/kvxfer/internal/daemon"
	"github.com/kvxfer/kvxfer/internal/daemon/daemontest"
	"github.com/kvxfer/kvxfer/internal/leakcheck"
)

// TestMain lets the simulator start this test binary as its daemons.
func TestMain(m *testing.M) {
	daemontest.ServeIfChild()
	os.Exit(m.Run())
}

// A short run with small shapes in every mode: it must end OK with every
// request done and its bytes verified, print the table and write the chart;
// nothing of it may outlive it.
func TestQuickRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	before := runtime.NumGoroutine()
	dir := t.TempDir()
	svg, md := filepath.Join(dir, "ttft.svg"), filepath.Join(dir, "table.md")
	var out bytes.Buffer
	if err := pdsimMain(context.Background(), []string{"-quick", "-svg", svg, "-md", md}, &out, io.Discard); err != nil {
		t.Fatalf("pdsim -quick: %v\n%s", err, out.String())
	}
	for _, want := range []string{"OK: every request ended done", "tp1/in256/out8/20qps/hit0/fresh", "p2d1/in512/out8/20qps/hit50/frag",
		"baseline", "pull", "push", "layerwise", "pull/push mean"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("output lacks %q:\n%s", want, out.String())
		}
	}
	b, err := os.ReadFile(svg)
	if err != nil || !bytes.HasPrefix(b, []byte("<svg")) || bytes.Count(b, []byte("<polyline")) != 8 {
		t.Errorf("chart: %v, %d curves (want 8: 2 shapes x 4 modes)", err, bytes.Count(b, []byte("<polyline")))
	}
	b, err = os.ReadFile(md)
	if err != nil || !bytes.Contains(b, []byte("| p2d1/in512/out8/20qps/hit50/frag | layerwise | 1 | 12/12 |")) {
		t.Errorf("markdown table: %v\n%s", err, b)
	}
	checkBreakdown(t, string(b))
	leakcheck.Check(t, before, 2, 10*time.Second)
}

// Repeats run every mode once per seed and pool them; the summary gives
// the range over the runs.
func TestRepeats(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	var out bytes.Buffer
	err := pdsimMain(context.Background(), []string{"-tp", "1", "-input", "64", "-output", "2", "-rate", "50", "-requests", "4",
		"-modes", "baseline,push,layerwise", "-repeats", "2", "-svg", ""}, &out, io.Discard)
	if err != nil {
		t.Fatalf("%v\n%s", err, out.String())
	}
	o := out.String()
	n := 0
	for _, l := range strings.Split(o, "\n") {
		if f := strings.Fields(l); len(f) > 2 && f[0] == "tp1/in64/out2/50qps/hit0/fresh" && f[1] == "push" {
			n++
		}
	}
	if n != 3 {
		t.Errorf("%d push rows, want 3 (2 runs, 1 pooled):\n%s", n, o)
	}
	if !strings.Contains(o, "seeds 1-2") || !strings.Contains(o, "pooled over the runs") || !strings.Contains(o, "% to ") {
		t.Errorf("no pooled table or range:\n%s", o)
	}
}

// The simulator over NIXL (skips where NIXL is not installed): every mode
// on a small shape, every byte verified.
func TestNixlRun(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	if _, err := daemon.NixlLibrary(); err != nil {
		t.Skipf("NIXL is not available here: %v", err)
	}
	var out bytes.Buffer
	err := pdsimMain(context.Background(), []string{"-backend", "nixl", "-ptp", "2", "-dtp", "1", "-input", "256", "-output", "4",
		"-rate", "40", "-requests", "8", "-svg", ""}, &out, io.Discard)
	if err != nil || !strings.Contains(out.String(), "nixl backend") || !strings.Contains(out.String(), "OK: every request ended done") {
		t.Fatalf("pdsim -backend nixl: %v\n%s", err, out.String())
	}
}

// A corrupted byte fails the run loudly, naming the request and the byte.
func TestCorruptedByteFails(t *testing.T) {
	if testing.Short() {
		t.Skip("starts processes")
	}
	var out bytes.Buffer
	err := pdsimMain(context.Background(), []string{"-tp", "2", "-input", "128", "-output", "4", "-rate", "50", "-requests", "6",
		"-modes", "push,layerwise,pull", "-corrupt", "-svg", ""}, &out, io.Discard)
	if err == nil {
		t.Fatalf("a run with a corrupted source byte passed:\n%s", out.String())
	}
	if got := strings.Count(out.String(), "WRONG BYTES"); got != 3 {
		t.Errorf("%d WRONG BYTES reports, want one per mode (3):\n%s", got, out.String())
	}
	if !strings.Contains(out.String(), "FAILED") || strings.Contains(out.String(), "OK: every") {
		t.Errorf("the run did not fail loudly:\n%s", out.String())
	}
}

func TestOptionsValidation(t *testing.T) {
	for _, args := range [][]string{
		{"-modes", "push,teleport"},
		{"-tp", "4", "-rate", "0"},
		{"-tp", "4", "-hit", "1.5"},
		{"-layers", "0"},
		{"-compute-scale", "-1"},
		{"-dispatch-latency", "-1ms"},
		{"-repeats", "0"},
		{"-backend", "rdma"},
		{"-nixl-params", "a=b"},
		{"-backend", "nixl", "-nixl-params", "novalue"},
	} {
		if _, err := parseOptions(args, io.Discard); err == nil {
			t.Errorf("parseOptions(%q) accepted", args)
		}
	}
	o, err := parseOptions([]string{"-ptp", "8", "-dtp", "4", "-rate", "4"}, io.Discard)
	if err != nil || len(o.shapes) != 1 || o.shapes[0].String() != "p8d4/in1024/out128/4qps/hit0/fresh" || o.shapes[0].Requests != 40 {
		t.Errorf("one shape: %+v, %v", o, err)
	}
	if o, _ := parseOptions(nil, io.Discard); len(o.shapes) != len(defaultShapes(1)) || len(o.modes) != 4 {
		t.Errorf("defaults: %d shapes, %d modes", len(o.shapes), len(o.modes))
	}
}

// Repeats pool per shape and mode; the summary compares the pooled means
// and gives the range of the per-run comparisons, paired by seed.
func TestMergeAndSpread(t *testing.T) {
	s := shape{PTP: 4, DTP: 4, Input: 1024, Output: 128, Rate: 8, Requests: 2}
	ms := func(v ...int) []time.Duration {
		var out []time.Duration
		for _, x := range v {
			out = append(out, time.Duration(x)*time.Millisecond)
		}
		return out
	}
	run := func(m mode, ttft ...int) *result {
		r := &result{shape: s, mode: m, runs: 1, requests: len(ttft), done: len(ttft), ttft: ms(ttft...), elapsed: time.Second,
			kvIn: ms(ttft...), modelledD: 100 * time.Millisecond, overrunD: 10 * time.Millisecond}
		r.runTTFT = []time.Duration{mean(r.ttft)}
		return r
	}
	pull := merge([]*result{run(modePull, 110, 130), run(modePull, 300, 300)})
	push := merge([]*result{run(modePush, 100, 100), run(modePush, 200, 200)})
	base := merge([]*result{run(modeBaseline, 100, 100), run(modeBaseline, 150, 150)})
	if pull.runs != 2 || pull.done != 4 || len(pull.ttft) != 4 || pull.elapsed != 2*time.Second || len(pull.kvIn) != 4 ||
		pull.lagD() < 0.0999 || pull.lagD() > 0.1001 || pull.ttft[0] != 110*time.Millisecond || pull.ttft[3] != 300*time.Millisecond {
		t.Fatalf("merged %+v", pull)
	}
	cs := compare([]*result{base, pull, push})
	if len(cs) != 1 {
		t.Fatalf("%d comparisons", len(cs))
	}
	// Pooled: pull 210 ms / push 150 ms = 1.40x; per run 1.20x and 1.50x.
	if c := cs[0]; c.pullPushMean != "1.40x (1.20x to 1.50x)" || c.pushVsBase != "+20.0% (+0.0% to +33.3%)" || c.layerwiseVsBase != "-" {
		t.Errorf("comparison %+v", c)
	}
	if md := markdown([]*result{base, pull, push}); !strings.Contains(md, "| tp4/in1024/out128/8qps/hit0/fresh | pull | 2 | 4/4 | 210.0 |") {
		t.Errorf("markdown:\n%s", md)
	}
}

// checkBreakdown checks every row of a Markdown table: the five parts of
// the TTFT breakdown (P queue, prefill, KV in, D step, to token 1) add up
// to the mean TTFT, none is negative, and the baseline moves no KV.
func checkBreakdown(t *testing.T, md string) {
	t.Helper()
	rows := 0
	for _, l := range strings.Split(md, "\n") {
		f := strings.Split(l, "|")
		if len(f) != 19 || !strings.Contains(f[4], "/") { // data rows of the first table
			continue
		}
		num := func(i int) float64 {
			v, err := strconv.ParseFloat(strings.TrimSpace(f[i]), 64)
			if err != nil {
				t.Fatalf("column %d of %q: %v", i, l, err)
			}
			return v
		}
		rows++
		ttft, sum := num(5), 0.0
		for i := 11; i <= 15; i++ {
			if num(i) < 0 {
				t.Errorf("negative part (column %d) in %q", i, l)
			}
			sum += num(i)
		}
		if math.Abs(sum-ttft) > 0.35 { // six values rounded to 0.1
			t.Errorf("breakdown adds up to %.1f ms, TTFT mean is %.1f ms: %q", sum, ttft, l)
		}
		if strings.TrimSpace(f[2]) == "baseline" && num(13) != 0 {
			t.Errorf("the baseline's KV in is %v ms, want 0: %q", num(13), l)
		}
	}
	if rows == 0 {
		t.Errorf("no rows in:\n%s", md)
	}
}
