package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// The library built as a C shared library, driven through kvxfer.h by a C
// program: version, idempotent start, a too-small endpoint buffer, a
// second configuration refused, a forked child refused (KVXFER_EFORK, not
// a hang), idempotent stop, a bad key named, and a restart.
func TestCABI(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the shared library")
	}
	cc, err := exec.LookPath("cc")
	if err != nil {
		t.Skipf("no C compiler: %v", err)
	}
	dir := t.TempDir()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	lib := filepath.Join(dir, "libkvxfer.so")
	if out, err := exec.CommandContext(ctx, "go", "build", "-buildmode=c-shared", "-o", lib, ".").CombinedOutput(); err != nil {
		t.Fatalf("go build -buildmode=c-shared: %v\n%s", err, out)
	}
	drive := filepath.Join(dir, "drive")
	if out, err := exec.CommandContext(ctx, cc, "-Wall", "-Werror", "-I", ".", "-o", drive, "testdata/drive.c", "-ldl", "-pthread").CombinedOutput(); err != nil {
		t.Fatalf("cc: %v\n%s", err, out)
	}
	rctx, rcancel := context.WithTimeout(ctx, 60*time.Second)
	defer rcancel()
	out, err := exec.CommandContext(rctx, drive, lib).CombinedOutput()
	if err != nil || !strings.Contains(string(out), "\nok\n") {
		t.Fatalf("drive: %v\n%s", err, out)
	}
	if !strings.Contains(string(out), "version "+version) {
		t.Errorf("drive's output lacks version %q:\n%s", version, out)
	}

	// A process whose stderr is a pipe nobody reads any more: one that
	// ignores SIGPIPE (Python) lives on as the server logs (the Go
	// runtime killed it, exit status 141), one that does not dies by it,
	// as by its own writes.
	sigpipe := filepath.Join(dir, "sigpipe")
	if out, err := exec.CommandContext(ctx, cc, "-Wall", "-Werror", "-I", ".", "-o", sigpipe, "testdata/sigpipe.c", "-ldl").CombinedOutput(); err != nil {
		t.Fatalf("cc: %v\n%s", err, out)
	}
	for _, mode := range []string{"ignore", "default"} {
		out, err := exec.CommandContext(rctx, sigpipe, lib, mode).Output()
		var st syscall.WaitStatus
		if ee, ok := err.(*exec.ExitError); ok {
			st, _ = ee.Sys().(syscall.WaitStatus)
		}
		switch {
		case mode == "ignore" && (err != nil || string(out) != "alive\n"):
			t.Errorf("SIGPIPE ignored, stderr broken: %v (%v), output %q; want it alive", err, st, out)
		case mode == "default" && !st.Signaled():
			t.Errorf("SIGPIPE at its default, stderr broken: %v, output %q; want it killed by SIGPIPE, as by its own writes", err, out)
		case mode == "default" && st.Signal() != syscall.SIGPIPE:
			t.Errorf("SIGPIPE at its default, stderr broken: killed by %v, want SIGPIPE", st.Signal())
		}
	}
}

// abi.c's KVXFER_VERSION is the Go side's version.
func TestVersion(t *testing.T) {
	b, err := os.ReadFile("abi.c")
	if err != nil {
		t.Fatal(err)
	}
	if want := `#define KVXFER_VERSION "` + version + `"`; !strings.Contains(string(b), want) {
		t.Errorf("abi.c lacks %s", want)
	}
}
