package kvxfertest

import (
	"errors"
	"fmt"
	"io"
	"log/slog"
	"math/rand/v2"
	"os"
	"runtime"
	"strings"
	"testing"
	"unsafe"

	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/backend/nixl"
	"github.com/kvxfer/kvxfer/kvxfer/backend/tcp"
)

// TCPHarness makes built-in backends (kvxfer/backend/tcp) over loopback
// TCP, or with the in-process direct copy on when Direct is set. Each
// backend adopts n bytes of Go memory at a fixed base.
type TCPHarness struct{ Direct bool }

var quiet = slog.New(slog.NewTextHandler(io.Discard, nil))

// New implements Harness.
func (h TCPHarness) New(t *testing.T, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	b, err := tcp.New(tcp.Config{DisableLocal: !h.Direct, Conns: 3, Logger: quiet})
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

// NixlHarness makes NIXL backends (kvxfer/backend/nixl, UCX) over Go
// memory, or skips the test when NIXL's library is not available.
type NixlHarness struct {
	// Params are UCX's backend parameters (default: NixlParams()).
	Params map[string]string
	n      int
}

// New implements Harness.
func (h *NixlHarness) New(t *testing.T, n int) (kvxfer.Backend, kvxfer.MemRegion, []byte) {
	h.n++
	params := h.Params
	if params == nil {
		params = NixlParams()
	}
	b, err := nixl.New(nixl.Config{Name: fmt.Sprintf("%s-%d-%d", t.Name(), h.n, rand.Uint64()), Params: params})
	if errors.Is(err, nixl.ErrUnavailable) {
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

// NixlParams reads UCX backend parameters for the NIXL tests from
// KVXFER_NIXL_PARAMS (key=value,...): UCX over shared memory needs
// ucx_error_handling_mode=none.
func NixlParams() map[string]string {
	out := map[string]string{}
	for _, kv := range strings.Split(os.Getenv("KVXFER_NIXL_PARAMS"), ",") {
		if k, v, ok := strings.Cut(kv, "="); ok {
			out[k] = v
		}
	}
	return out
}

// Link registers one region on each backend and loads dst as src's peer.
func Link(tb testing.TB, src, dst kvxfer.Backend, sr, dr kvxfer.MemRegion) kvxfer.PeerName {
	tb.Helper()
	if err := src.Register([]kvxfer.MemRegion{sr}); err != nil {
		tb.Fatal(err)
	}
	if err := dst.Register([]kvxfer.MemRegion{dr}); err != nil {
		tb.Fatal(err)
	}
	meta, err := dst.LocalMetadata()
	if err != nil {
		tb.Fatal(err)
	}
	peer, err := src.LoadPeer(meta)
	if err != nil {
		tb.Fatal(err)
	}
	return peer
}
