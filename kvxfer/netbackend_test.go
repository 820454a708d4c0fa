package kvxfer_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

// netHarness makes built-in backends over loopback TCP (the in-process
// direct copy off, so the TCP path is what is checked) or with it on.
type netHarness struct{ direct bool }

func (h netHarness) New(t *testing.T, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	b, err := kvxfer.NewNetBackend(kvxfer.NetConfig{DisableLocal: !h.direct, Conns: 3, Logger: quiet})
	if err != nil {
		t.Fatal(err)
	}
	mem := make([]byte, n)
	const base = 1 << 40
	if err := b.Map(base, mem); err != nil {
		t.Fatal(err)
	}
	return b, kvxfer.MemRegion{Addr: base, Len: uint64(n), Kind: kvxfer.MemDRAM}, mem
}

func TestConformanceNetTCP(t *testing.T)    { kvxfertest.Conformance(t, netHarness{}) }
func TestConformanceNetDirect(t *testing.T) { kvxfertest.Conformance(t, netHarness{direct: true}) }

// nixlHarness makes NIXL backends (UCX) over Go memory, or skips.
type nixlHarness struct {
	n      int
	params map[string]string // default: nixlParams()
}

func (h *nixlHarness) New(t *testing.T, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	h.n++
	params := h.params
	if params == nil {
		params = nixlParams()
	}
	b, err := kvxfer.NewNixlBackend(kvxfer.NixlConfig{Name: fmt.Sprintf("%s-%d-%d", t.Name(), h.n, rand.Uint64()), Params: params})
	if errors.Is(err, kvxfer.ErrNixlUnavailable) {
		t.Skipf("NIXL is not available here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	mem := make([]byte, n)
	base := uint64(uintptr(unsafe.Pointer(&mem[0])))
	if err := b.Map(base, mem); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { runtime.KeepAlive(mem) })
	return b, kvxfer.MemRegion{Addr: base, Len: uint64(n), Kind: kvxfer.MemDRAM}, mem
}

func TestConformanceNixl(t *testing.T) { kvxfertest.Conformance(t, &nixlHarness{}) }

// Both agents in this process over UCX's shared memory (which needs
// ucx_error_handling_mode=none): UCX cannot see a closed peer here (CMA
// to our own pid succeeds, the memory is still mapped); the backend knows
// its process's agents (nixlpeer.go), so PeerLoss passes too.
func TestConformanceNixlShm(t *testing.T) {
	t.Setenv("UCX_TLS", "sm")
	kvxfertest.Conformance(t, &nixlHarness{params: map[string]string{"ucx_error_handling_mode": "none"}})
}

// nixlParams reads UCX backend parameters for the NIXL tests from
// KVXFER_NIXL_PARAMS (key=value,...): UCX over shared memory needs
// ucx_error_handling_mode=none.
func nixlParams() map[string]string {
	out := map[string]string{}
	for _, kv := range strings.Split(os.Getenv("KVXFER_NIXL_PARAMS"), ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			out[k] = v
		}
	}
	return out
}

// NIXL's telemetry of a finished transfer reaches the caller.
func TestNixlTelemetry(t *testing.T) {
	h := &nixlHarness{}
	a, ar, _ := h.New(t, 1<<20)
	b, br, _ := h.New(t, 1<<20)
	defer a.Close()
	defer b.Close()
	peer := link(t, a, b, ar, br)
	id, err := a.Post(hotpath.OpWrite, peer, []hotpath.Desc{{Local: ar.Addr, Remote: br.Addr, Len: 1 << 20}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	for s, _ := a.State(id); s == kvxfer.XferInProgress; s, _ = a.State(id) {
	}
	tm, ok := a.(kvxfer.Telemeter).Telemetry(id)
	if !ok {
		t.Skip("this NIXL library keeps no telemetry")
	}
	if tm.Bytes != 1<<20 || tm.Descs != 1 {
		t.Errorf("telemetry = %+v, want 1 MiB in 1 descriptor", tm)
	}
	t.Logf("NIXL telemetry: %+v", tm)
}
