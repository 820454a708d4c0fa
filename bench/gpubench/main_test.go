package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"slices"
	"strings"
	"testing"

	"github.com/kvxfer/kvxfer/internal/cuda"
	"github.com/kvxfer/kvxfer/internal/cuda/cudatest"
	capi "github.com/kvxfer/kvxfer/internal/nixl"
)

// TestMain serves as the destination process when the bench re-executes
// the test binary.
func TestMain(m *testing.M) {
	if os.Getenv(childEnv) != "" {
		if err := run(context.Background(), os.Args[1:], os.Stdout, os.Stderr); err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// TestGPU runs the bench's GPU mode (internal/cuda memory, the copy
// kernels, the same-host path both ways and through a gate): on a GPU,
// or on the fake CUDA driver (TestGPUOnFakeDriver); it skips without one.
// NIXL and the Python contenders, which need a GPU's transports and
// torch, are left to test/gpu/run.
func TestGPU(t *testing.T) {
	if _, err := cuda.Open(0); errors.Is(err, cuda.ErrUnavailable) {
		t.Skipf("no GPU here: %v", err)
	}
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"-blocks", "2,5", "-pieces", "4KiB,520", "-layers", "3", "-reps", "2",
		"-contenders", "samehost,samehost-pieces,samehost-x4,samehost-gate,samehost-read,kernel,kernel-layout,kernel-gated,contig,perpiece"}, &out, &errb)
	if err != nil {
		t.Fatalf("run: %v\n%s\n%s", err, out.String(), errb.String())
	}
	for _, want := range []string{"| kvxfer same-host, one-sided through a gate (P launches into D's memory) | 520 B |", "| kvxfer same-host, READ (pull) as a layout | 4 KiB |",
		"| samehost-gate | 4 KiB x 5 blocks x 3 layers | P saw it done -> D drained the notification (one hop: D's wake-up) | 2 |",
		"| kvxfer copy kernel, one launch of a layout (one process) | 4 KiB |", "| per-piece async cuMemcpyDtoD, one event | 520 B |",
		"| kvxfer gated copy kernel, one launch of a layout through an open gate (one process) | 520 B |",
		"| samehost-gate | 4 KiB x 5 blocks x 3 layers | launched -> P's poller saw it done (the GPU, the poll) | 2 |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "FAILED") {
		t.Errorf("a case failed:\n%s\n%s", out.String(), errb.String())
	}
}

// TestGPUOnFakeDriver runs TestGPU against the fake CUDA driver
// (internal/cuda/cudatest): the bench test/gpu/run measures with, in its
// GPU mode, on every machine.
func TestGPUOnFakeDriver(t *testing.T) {
	cudatest.RunOnFakeDriver(t, "TestGPU")
}

// TestFakeGPU runs the bench end to end on host memory standing in for
// the GPU: the child, the same-host agents and the copies, each case
// checked byte by byte, and the table.
func TestFakeGPU(t *testing.T) {
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"-fake-gpu", "-blocks", "2,5", "-pieces", "4KiB,520", "-layers", "3", "-reps", "2",
		"-contenders", "samehost,samehost-pieces,samehost-x4,samehost-gate,samehost-read,kernel,kernel-layout,kernel-gated,contig,perpiece", "-fake-gpu-busy", "30us"}, &out, &errb)
	if err != nil {
		t.Fatalf("run: %v\n%s\n%s", err, out.String(), errb.String())
	}
	for _, want := range []string{"| kvxfer same-host (netxfer, MapDevice), as a layout | 4 KiB |", "| kvxfer same-host (netxfer, MapDevice), as pieces | 520 B |", "| per-piece async cuMemcpyDtoD, one event | 520 B |",
		"| kvxfer copy kernel, one launch of a layout (one process) | 520 B |",
		"| kvxfer same-host (netxfer, MapDevice), as a layout, 4 in flight | 4 KiB |",
		"| kvxfer same-host, one-sided through a gate (P launches into D's memory) | 520 B |",
		"| kvxfer same-host, READ (pull) as a layout | 520 B |",
		"| samehost-gate | 4 KiB x 5 blocks x 3 layers | P saw it done -> D drained the notification (one hop: D's wake-up) | 2 |",
		"| samehost-gate | 520 B x 2 blocks x 3 layers | P post -> launched (P's checks, staging, the launch queued) | 2 |",
		"| kvxfer gated copy kernel, one launch of a layout through an open gate (one process) | 4 KiB |",
		// The machine's wake-up cost, from the probe.
		"one hop between two processes (a byte over a unix socket",
		// The same-host hops, from both processes' stamps.
		"| samehost | 4 KiB x 5 blocks x 3 layers | D posted -> D saw it done (the GPU, D's poller) | 2 |",
		"| samehost-pieces | 520 B x 2 blocks x 3 layers | total: P post -> P saw it done | 2 |",
		"| samehost | 4 KiB x 2 blocks x 3 layers | part sent -> D read it (the wake-up of D's connection) | 2 |",
		"| samehost | 4 KiB x 2 blocks x 3 layers | D's answer sent -> P read it (the wake-up of P's connection) | 2 |",
		"5 blocks (15 pieces)"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "FAILED") {
		t.Errorf("a case failed:\n%s\n%s", out.String(), errb.String())
	}
	if strings.Contains(out.String(), "| samehost-x4 |") {
		t.Errorf("the hop table has rows of transfers that overlapped (samehost-x4):\n%s", out.String())
	}
}

// Out of time, the bench still prints its table, the cases it did not
// reach reading "not run", and fails saying why.
func TestOutOfTimeStillReports(t *testing.T) {
	var out, errb bytes.Buffer
	err := run(context.Background(), []string{"-fake-gpu", "-blocks", "2", "-pieces", "4KiB", "-layers", "2", "-reps", "1",
		"-contenders", "kernel,contig,python", "-timeout", "1ns"}, &out, &errb)
	if err == nil || !strings.Contains(err.Error(), "out of time") {
		t.Fatalf("run with -timeout 1ns = %v, want an out-of-time error\n%s", err, out.String())
	}
	for _, want := range []string{"| kvxfer copy kernel, one launch (one process) | 4 KiB | not run |",
		"| device copy, contiguous (the limit) | 4 KiB | not run |",
		"| NIXL Python API (num_threads=4) | all | did not run: out of time before it started |"} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
}

// A piece that lands in the wrong place, or not at all, is caught.
func TestVerify(t *testing.T) {
	c := xcase{Piece: 64, Blocks: 4, Layers: 2}
	src, dst := make([]byte, c.span()), bytes.Repeat([]byte{marker}, c.span())
	pattern(src, c.seed(), 0)
	for _, p := range c.pairs() {
		copy(dst[p.dst:p.dst+64], src[p.src:p.src+64])
	}
	if err := verify(c, dst); err != nil {
		t.Fatalf("verify of a correct transfer: %v", err)
	}
	p := c.pairs()[5]
	dst[p.dst+63] ^= 1
	if err := verify(c, dst); err == nil || !strings.Contains(err.Error(), "piece 5") {
		t.Errorf("verify with piece 5's last byte flipped = %v, want an error naming piece 5", err)
	}
	src2, dst2 := c.ids()
	if s, d := (xcase{Piece: 64, Blocks: 4, Layers: 2}).ids(); !slices.Equal(s, src2) || !slices.Equal(d, dst2) {
		t.Error("a case's block ids are not fixed")
	}
}

// The python contenders (NIXL's own Python API: WRITE, the push round
// trip, READ) and kvxfer's NIXL READ on host memory, where the
// Python here has torch and nixl_cu12: every mode runs every case and
// check every byte (a case that failed, or wrong bytes, is FAILED).
func TestPythonContendersOnHost(t *testing.T) {
	py := os.Getenv("KVXFER_TEST_PYTHON")
	if py == "" {
		py = "python3"
	}
	if out, err := exec.Command(py, "-c", "import torch, numpy, nixl_cu12._api").CombinedOutput(); err != nil {
		t.Skipf("%s lacks torch, numpy or nixl_cu12 (the NIXL wheel .ci/run installs): %v: %s", py, err, lastLine(out))
	}
	names, wants := "python,python-push,python-read,python-split", []string{"| NIXL Python API (num_threads=4) | 4 KiB |",
		"| NIXL Python API, push round trip (D notifies, P WRITEs + notifies, D sees it) | 4 KiB |",
		"| NIXL Python API (num_threads=4), READ (pull) | 4 KiB |",
		"| NIXL Python API (num_threads=4, split_batch_size=64) | 4 KiB |"}
	// kvxfer's own READ where this process finds NIXL's library (CI sets
	// NIXL_CAPI_LIB), for the same table.
	if _, err := capi.FindLibrary(); err == nil {
		names, wants = names+",nixl4-read,nixl-gpu", append(wants, "| kvxfer NIXL (UCX num_threads=4), READ (pull) | 4 KiB |",
			"| kvxfer NIXL, kvxfer's GPU defaults (num_threads=4, split_batch_size=64) | 4 KiB |")
	} else {
		t.Logf("without kvxfer's NIXL READ: %v", err)
	}
	var out, errb bytes.Buffer
	// 3 layers x 32 blocks: 96 descriptors, split over the workers where
	// split_batch_size (64) says so.
	err := run(context.Background(), []string{"-fake-gpu", "-python", py, "-blocks", "2,32", "-pieces", "4KiB", "-layers", "3", "-reps", "3",
		"-contenders", names}, &out, &errb)
	if err != nil {
		t.Fatalf("run: %v\n%s\n%s", err, out.String(), errb.String())
	}
	for _, want := range wants {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the report lacks %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "FAILED") || strings.Contains(out.String(), "did not run") || strings.Contains(out.String(), "not run") {
		t.Errorf("a case failed or did not run:\n%s\n%s", out.String(), errb.String())
	}
}

func lastLine(b []byte) string {
	lines := strings.Split(strings.TrimSpace(string(b)), "\n")
	return lines[len(lines)-1]
}

// The goals table: the cases, met or not by their medians, only
// those measured; the NIXL ratios where NIXL's Python API ran.
func TestReportGoals(t *testing.T) {
	big, small8 := xcase{Piece: 64 << 10, Blocks: 256, Layers: 32}, xcase{Piece: 64 << 10, Blocks: 8, Layers: 32}
	res := map[string]map[xcase]result{
		"samehost":      {big: {gbps: []float64{500, 700, 650}}, small8: {gbps: []float64{90, 95, 99}}},
		"samehost-gate": {big: {gbps: []float64{1200, 1100, 1300}}, small8: {err: "boom"}},
		pythonName:      {small8: {gbps: []float64{4, 4, 4}}},
		"nixl-gpu":      {small8: {gbps: []float64{6, 6, 6}}},
	}
	var out bytes.Buffer
	reportGoals(&out, config{cases: []xcase{big, small8}}, res)
	for _, want := range []string{
		"| 64 KiB x 256 blocks x 32 layers | >= 600 | 650 (met) | 1200 (met) |",
		"| 64 KiB x 8 blocks x 32 layers | >= 100 | 95.0 (not met) | not run |",
		"| 64 KiB x 8 blocks x 32 layers | 4.00 | - | 1.50x | - |",
	} {
		if !strings.Contains(out.String(), want) {
			t.Errorf("the goals lack %q:\n%s", want, out.String())
		}
	}
	if strings.Contains(out.String(), "| 4 KiB x 256") {
		t.Errorf("a goal case not measured is in the table:\n%s", out.String())
	}
}
