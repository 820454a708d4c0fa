// Package cudatest runs GPU tests without a GPU: against a fake CUDA
// driver (internal/cuda/kernel/fakecuda.cpp) built as libcuda.so.1, in a
// child process of the test binary that loads it instead of a real one.
package cudatest

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"strings"
	"testing"
	"time"
)

// childEnv marks the test process that runs against the fake driver.
const childEnv = "KVXFER_FAKE_CUDA"

// onFakeDriver reports whether this process runs against the fake driver.
func onFakeDriver() bool { return os.Getenv(childEnv) != "" }

// FailLaunchEnv is the fake driver's knob that makes its n-th kernel
// launch refuse; KernelDelayEnv, the one that makes every launch take
// that many microseconds more.
const (
	FailLaunchEnv  = "KVXFER_FAKE_CUDA_FAIL_LAUNCH"
	KernelDelayEnv = "KVXFER_FAKE_CUDA_KERNEL_US"
)

// RunOnFakeDriver builds the fake driver and runs the tests named by
// tests (top-level test names) of this test binary against it, in a
// child process; each must pass (a skip, "no GPU here", is a failure:
// the fake is a GPU to them). It skips where there is no C++ compiler,
// and inside the child itself.
func RunOnFakeDriver(t *testing.T, tests ...string) {
	t.Helper()
	RunOnFakeDriverEnv(t, nil, tests...)
}

// RunOnFakeDriverEnv is RunOnFakeDriver with env added to the child's
// environment (the fake driver's KVXFER_FAKE_CUDA_* knobs).
func RunOnFakeDriverEnv(t *testing.T, env []string, tests ...string) {
	t.Helper()
	if onFakeDriver() {
		t.Skip("the fake driver's own run")
	}
	dir := build(t)
	pattern := "^(" + strings.Join(tests, "|") + ")$"
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, os.Args[0], "-test.run", pattern, "-test.v", "-test.count=1")
	// Two devices: the tests of one use device 0; those of two get them.
	cmd.Env = append(os.Environ(), childEnv+"=1", "LD_LIBRARY_PATH="+dir+prepend(os.Getenv("LD_LIBRARY_PATH")),
		"KVXFER_FAKE_CUDA_DEVICES=2")
	cmd.Env = append(cmd.Env, env...)
	out, err := cmd.CombinedOutput()
	// The child's lines, marked: its "--- PASS" lines must not read as
	// results of this test's (go test -json would take them for its).
	t.Logf("the tests on the fake driver said:\n%s", strings.ReplaceAll("\n"+string(out), "\n", "\nfake| ")[1:])
	if err != nil {
		t.Fatalf("GPU tests on the fake driver: %v", err)
	}
	for _, name := range tests {
		if !regexp.MustCompile(`(?m)^--- PASS: ` + regexp.QuoteMeta(name) + ` `).Match(out) {
			t.Errorf("%s did not pass on the fake driver", name)
		}
	}
}

func prepend(s string) string {
	if s == "" {
		return ""
	}
	return ":" + s
}

// build compiles the fake driver into a directory of the test's, as
// libcuda.so.1 (the name internal/cuda loads).
func build(t *testing.T) string {
	t.Helper()
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("no g++ here: the fake CUDA driver needs a C++ compiler")
	}
	_, self, _, _ := runtime.Caller(0)
	src := filepath.Join(filepath.Dir(self), "..", "kernel", "fakecuda.cpp")
	dir := t.TempDir()
	out, err := exec.Command(cxx, "-std=c++20", "-O1", "-g", "-shared", "-fPIC", "-pthread", "-Wall", "-Werror",
		"-o", filepath.Join(dir, "libcuda.so.1"), src).CombinedOutput()
	if err != nil {
		t.Fatalf("building the fake CUDA driver: %v\n%s", err, out)
	}
	return dir
}
