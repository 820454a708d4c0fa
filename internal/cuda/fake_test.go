package cuda

import (
	"bytes"
	"os"
	"testing"

	"github.com/kvxfer/kvxfer/internal/cuda/cudatest"
)

// TestGPUOnFakeDriver runs this package's GPU tests on every machine,
// against a fake CUDA driver (kernel/fakecuda.cpp: device memory in
// shared memory, streams as threads, the copy kernels as a model of their
// contract, IPC between processes through /proc, faults on memory it does
// not know): the Go side of the batched copy, the gated launches, the
// side stream and IPC between processes, as a GPU machine runs them. What
// the GPU does itself (its memory model, copy.cu's code) is left to a GPU
// and to TestKernelOnCPU.
func TestGPUOnFakeDriver(t *testing.T) {
	cudatest.RunOnFakeDriver(t, "TestCopyKernel", "TestCopyKernelLayout", "TestGatedCopy", "TestIPCImportBetweenProcesses",
		"TestGateBetweenProcesses", "TestImportOwnHandle", "TestOrdinalOfOwnUUID")
}

// TestPostFailsAfterQueuing runs TestFailedPostDrains on the fake driver
// with its second launch refused and every launch slow.
func TestPostFailsAfterQueuing(t *testing.T) {
	cudatest.RunOnFakeDriverEnv(t, []string{cudatest.FailLaunchEnv + "=2", cudatest.KernelDelayEnv + "=100000"}, "TestFailedPostDrains")
}

// TestFailedPostDrains: a batch of two sections whose second launch the
// driver refuses returns the error only once the first section's launch,
// queued before it, ran: the caller, told the post failed, may let go of
// the memory the batch named. Runs where the driver can be made to refuse
// a launch (the fake's knob: TestPostFailsAfterQueuing).
func TestFailedPostDrains(t *testing.T) {
	d := openGPU(t)
	if os.Getenv(cudatest.FailLaunchEnv) != "2" {
		t.Skip("needs a driver that refuses the second launch (the fake driver's " + cudatest.FailLaunchEnv + "=2)")
	}
	src, dst := allocPair(t, d, 1<<20)
	if err := d.CopyIn(src, pattern(1<<20)); err != nil {
		t.Fatal(err)
	}
	if err := d.CopyIn(dst, make([]byte, 1<<20)); err != nil {
		t.Fatal(err)
	}
	b, err := d.NewBatch(2)
	if err != nil {
		t.Fatal(err)
	}
	// A layout (its own section, launched first), then a piece by Add
	// (a second section).
	if !b.AddLayout([]Region{{Dst: dst, Src: src}}, []Entry{{Dst: 0, Src: 0, Len: 4096}}) || !b.Add(dst+8192, src+8192, 4096) {
		t.Fatal("no room")
	}
	if _, err := b.Post(); err == nil {
		t.Fatal("the post whose second launch the driver refused succeeded")
	}
	got := make([]byte, 4096)
	if err := d.CopyOut(got, dst); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, pattern(1 << 20)[:4096]) {
		t.Fatal("the failed post returned while its first launch had not run")
	}
}
