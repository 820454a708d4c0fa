package nixl

import (
	"errors"
	"maps"
	"strconv"
	"strings"
	"testing"
	"time"

	capi "github.com/kvxfer/kvxfer/internal/nixl"
)

// Config.ProgressDelay: zero is the default pause, negative a spin,
// anything else as given.
func TestNixlProgressDelay(t *testing.T) {
	for d, want := range map[time.Duration]time.Duration{0: capi.DefaultProgressDelay, -1: 0, -time.Second: 0,
		250 * time.Microsecond: 250 * time.Microsecond} {
		c := Config{ProgressDelay: d}
		if got := c.progressDelay(); got != want {
			t.Errorf("ProgressDelay %v: %v, want %v", d, got, want)
		}
	}
}

// A VRAM agent of the UCX plugin gets num_threads=GPUThreads unless its
// parameters set one, and GPUEngineConfig in engine_config; host-memory agents and other plugins get exactly
// what they asked for; the caller's map is never changed.
func TestGPUDefaults(t *testing.T) {
	mine := map[string]string{"ucx_error_handling_mode": "none"}
	got := withDefaults("UCX", mine, true)
	if got["num_threads"] != GPUThreads || got["ucx_error_handling_mode"] != "none" || len(mine) != 1 {
		t.Fatalf("VRAM agent: %v (caller's map now %v), want num_threads=%s added to a copy", got, mine, GPUThreads)
	}
	if got["split_batch_size"] != GPUSplitBatch {
		t.Fatalf("VRAM agent: %v, want split_batch_size=%s", got, GPUSplitBatch)
	}
	if got := withDefaults("UCX", map[string]string{"num_threads": "8"}, true); got["num_threads"] != "8" || got["split_batch_size"] != GPUSplitBatch {
		t.Fatalf("num_threads set by the caller: %v", got)
	}
	if got := withDefaults("UCX", map[string]string{"split_batch_size": "1024"}, true); got["split_batch_size"] != "1024" || got["num_threads"] != GPUThreads {
		t.Fatalf("split_batch_size set by the caller: %v", got)
	}
	if got := withDefaults("UCX", mine, false); len(got) != 1 {
		t.Fatalf("a host-memory agent's parameters became %v", got)
	}
	// UCX settings through engine_config: the GPU defaults added unless
	// named (with or without UCX_, any case), ';' accepted as a separator.
	for _, tc := range []struct {
		vram     bool
		ec, want string
	}{
		{true, "", "CUDA_IPC_ENABLE_GET_ZCOPY=y"},
		{true, "RNDV_THRESH=8k", "RNDV_THRESH=8k,CUDA_IPC_ENABLE_GET_ZCOPY=y"},
		{true, "RNDV_THRESH=8k;MAX_RMA_RAILS=1", "RNDV_THRESH=8k,MAX_RMA_RAILS=1,CUDA_IPC_ENABLE_GET_ZCOPY=y"},
		{true, "cuda_ipc_enable_get_zcopy=n", "cuda_ipc_enable_get_zcopy=n"},
		{true, "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto", "CUDA_IPC_ENABLE_GET_ZCOPY=auto"},
		{false, "A=1;B=2", "A=1,B=2"},
	} {
		p := map[string]string{}
		if tc.ec != "" {
			p["engine_config"] = tc.ec
		}
		got := withDefaults("UCX", p, tc.vram)
		if got["engine_config"] != tc.want {
			t.Errorf("VRAM %v, engine_config %q: %q, want %q", tc.vram, tc.ec, got["engine_config"], tc.want)
		}
		if tc.ec != "" && p["engine_config"] != tc.ec {
			t.Errorf("the caller's engine_config became %q", p["engine_config"])
		}
	}
	// The environment's setting decides: ours is left out.
	t.Setenv("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "n")
	if got := withDefaults("UCX", nil, true); got["engine_config"] != "" {
		t.Errorf("with UCX_CUDA_IPC_ENABLE_GET_ZCOPY set, engine_config became %q", got["engine_config"])
	}
	if got := withDefaults("UCX", nil, false); got != nil {
		t.Fatalf("a host-memory agent with no parameters got %v", got)
	}
	if got := withDefaults("POSIX", nil, true); got != nil {
		t.Fatalf("another plugin's parameters became %v", got)
	}
}

// The user's -nixl-params win over the GPU defaults however they are
// spaced: before, "num_threads = 8" became the key "num_threads " (which
// the plugin ignores), so a VRAM agent ran num_threads=4 and the user's 8
// was lost, as was an engine_config written "engine_config = ...".
func TestUserParamsWinOverGPUDefaults(t *testing.T) {
	p, err := ParseParams("num_threads = 8, split_batch_size = 128, engine_config = CUDA_IPC_ENABLE_GET_ZCOPY=n")
	if err != nil {
		t.Fatal(err)
	}
	got := withDefaults("UCX", p, true)
	want := map[string]string{"num_threads": "8", "split_batch_size": "128", "engine_config": "CUDA_IPC_ENABLE_GET_ZCOPY=n"}
	if !maps.Equal(got, want) {
		t.Errorf("a VRAM agent's parameters = %q, want the user's %q", got, want)
	}
}

// The UCX plugin's numeric parameters are checked before NIXL gets them,
// and a bad one is refused naming its key and value. Before,
// split_batch_size=0 with num_threads set opened an agent whose first
// transfer of fewer descriptors than num_threads divided by zero inside
// the plugin (SIGFPE: the whole process died), and a malformed number was
// refused only as "create agent: status -2 (backend error)", the key and
// value in NIXL's log alone.
func TestPluginParamsChecked(t *testing.T) {
	for _, tc := range []struct{ key, value string }{
		{"split_batch_size", "0"},
		{"num_threads", "abc"},
		{"num_threads", "-1"},
		{"num_workers", "4x"},
		{"split_batch_size", "99999999999"},
		{"ucx_error_handling_mode", "sometimes"},
		// Each of these is a UCX worker (and a thread) the plugin
		// would make.
		{"num_threads", "100000"},
	} {
		params := map[string]string{"num_threads": "4", tc.key: tc.value}
		b, err := New(Config{Name: "params-" + tc.key, Params: params})
		if errors.Is(err, ErrUnavailable) {
			t.Skipf("NIXL is not available here: %v", err)
		}
		if err == nil {
			_ = b.Close()
			t.Fatalf("%s=%s: the agent opened", tc.key, tc.value)
		}
		if !strings.Contains(err.Error(), tc.key) || !strings.Contains(err.Error(), strconv.Quote(tc.value)) {
			t.Errorf("%s=%s refused with %q, which names neither the key nor the value", tc.key, tc.value, err)
		}
	}
	// What the plugin takes still opens.
	for _, params := range []map[string]string{
		{"num_threads": "4", "split_batch_size": "1", "num_workers": "2"},
		{"num_threads": "0", "ucx_error_handling_mode": "none"},
		{"ucx_error_handling_mode": "peer", "some_future_key": "x"},
	} {
		b, err := New(Config{Name: "params-ok", Params: params})
		if errors.Is(err, ErrUnavailable) {
			t.Skipf("NIXL is not available here: %v", err)
		}
		if err != nil {
			t.Errorf("%v: %v", params, err)
			continue
		}
		_ = b.Close()
	}
}
