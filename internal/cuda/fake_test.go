package cuda

import (
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
