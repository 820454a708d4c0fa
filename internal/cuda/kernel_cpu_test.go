package cuda

import (
	"context"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestKernelOnCPU runs kernel/copy.cu's kernels on the CPU
// (kernel/emu.cpp: the CUDA source compiled as C++ against a stand-in for
// what it uses of CUDA, a CTA's threads real threads): every alignment
// and length, regions and entries, grid-stride loops, guards around every
// piece and AddressSanitizer's bounds; the gated kernel through open and
// shut gates, and a receiver shutting its gate at random moments of a
// launch (nothing stored once it saw the counts at 0). It needs no GPU:
// CI checks the kernel's logic on every run, the GPU run its memory
// model.
func TestKernelOnCPU(t *testing.T) {
	cxx, err := exec.LookPath("g++")
	if err != nil {
		t.Skip("no g++ here: the kernel's CPU run needs a C++ compiler")
	}
	bin := filepath.Join(t.TempDir(), "emu")
	base := []string{"-std=c++20", "-O1", "-g", "-pthread", "-fno-strict-aliasing", "-Wall", "-Werror", "-Wno-unknown-pragmas",
		"-o", bin, filepath.Join("kernel", "emu.cpp")}
	san := []string{"-fsanitize=address,undefined", "-fno-sanitize-recover=all"}
	// The build and the run each get their own bound (both inside go
	// test's 10-minute default): one 240 s bound shared by the sanitized
	// build and the run ran out in a CI run on a machine loaded with
	// other work.
	ctx, cancel := context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	out, err := exec.CommandContext(ctx, cxx, append(san, base...)...).CombinedOutput()
	if err != nil {
		// A compiler without the sanitizers' run-time libraries: the
		// guards still catch stray writes.
		t.Logf("building with sanitizers failed (%v): building without them\n%s", err, out)
		if out, err = exec.CommandContext(ctx, cxx, base...).CombinedOutput(); err != nil {
			t.Fatalf("building kernel/emu.cpp: %v\n%s", err, out)
		}
	}
	ctx, cancel = context.WithTimeout(context.Background(), 4*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin)
	cmd.Env = append(cmd.Environ(), "ASAN_OPTIONS=detect_leaks=1:abort_on_error=0", "UBSAN_OPTIONS=print_stacktrace=1")
	out, err = cmd.CombinedOutput()
	t.Logf("%s", out)
	if err != nil {
		t.Fatalf("the copy kernels on the CPU: %v", err)
	}
	if !strings.HasSuffix(strings.TrimSpace(string(out)), "ok") {
		t.Fatal("the kernels' CPU run did not finish")
	}
}
