package nixl_test

import (
	"testing"

	"github.com/kvxfer/kvxfer/hotpath"
	"github.com/kvxfer/kvxfer/kvxfer"
	"github.com/kvxfer/kvxfer/kvxfer/kvxfertest"
)

func TestConformanceNixl(t *testing.T) { kvxfertest.Conformance(t, &kvxfertest.NixlHarness{}) }

// Both agents in this process over UCX's shared memory (which needs
// ucx_error_handling_mode=none): UCX cannot see a closed peer here (CMA
// to our own pid succeeds, the memory is still mapped); the backend knows
// its process's agents (nixlpeer.go), so PeerLoss passes too.
func TestConformanceNixlShm(t *testing.T) {
	t.Setenv("UCX_TLS", "sm")
	kvxfertest.Conformance(t, &kvxfertest.NixlHarness{Params: map[string]string{"ucx_error_handling_mode": "none"}})
}

// NIXL's telemetry of a finished transfer reaches the caller.
func TestNixlTelemetry(t *testing.T) {
	for _, tc := range []struct {
		name   string
		params map[string]string
		descs  int
	}{{"one", nil, 1}, {"split", map[string]string{"num_threads": "4", "split_batch_size": "4"}, 16}} {
		t.Run(tc.name, func(t *testing.T) {
			h := &kvxfertest.NixlHarness{Params: tc.params}
			a, ar, _ := h.New(t, 1<<20)
			b, br, _ := h.New(t, 1<<20)
			defer a.Close()
			defer b.Close()
			peer := kvxfertest.Link(t, a, b, ar, br)
			var ds []hotpath.Desc
			n := uint64(1<<20) / uint64(tc.descs)
			for i := range uint64(tc.descs) {
				ds = append(ds, hotpath.Desc{Local: ar.Addr + i*n, Remote: br.Addr + i*n, Len: n})
			}
			id, err := a.Post(hotpath.OpWrite, peer, ds, nil)
			if err != nil {
				t.Fatal(err)
			}
			for s, _ := a.State(id); s == kvxfer.XferInProgress; s, _ = a.State(id) {
			}
			tm, ok := a.(kvxfer.Telemeter).Telemetry(id)
			if !ok {
				t.Skip("this NIXL library keeps no telemetry")
			}
			if tm.Bytes != 1<<20 || tm.Descs != uint64(tc.descs) {
				t.Errorf("telemetry = %+v, want 1 MiB in %d descriptors", tm, tc.descs)
			}
			t.Logf("NIXL telemetry: %+v", tm)
		})
	}
}

// The UCX plugin's thread pool splitting each transfer over its workers
// (num_threads dedicated workers; a transfer of at least split_batch_size
// descriptors is posted as one chunk per worker, its notification after
// them): what a VRAM agent's defaults ask for (GPUSplitBatch). Here every
// transfer of four or more descriptors is split.
func TestConformanceNixlSplit(t *testing.T) {
	kvxfertest.Conformance(t, &kvxfertest.NixlHarness{Params: map[string]string{"num_threads": "4", "split_batch_size": "4"}})
}
