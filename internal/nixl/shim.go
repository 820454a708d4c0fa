//go:build cgo

package nixl

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <signal.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// Our own declarations of the subset of NIXL's C API we call, resolved
// with dlsym: NIXL's headers are not needed to build.
typedef int st_t;
typedef void* h_t;

typedef struct {
	bool enable_prog_thread;
	bool enable_listen_thread;
	int listen_port;
	int thread_sync;
	unsigned int num_workers;
	uint64_t pthr_delay_us;
	uint64_t lthr_delay_us;
	bool capture_telemetry;
} kx_agent_cfg;

enum { KX_IN_PROG = 1, KX_MEM_DRAM = 0, KX_MEM_VRAM = 1 };

static struct {
	void *lib;
	st_t (*create_configured_agent)(const char*, const kx_agent_cfg*, h_t*);
	st_t (*destroy_agent)(h_t);
	st_t (*create_params)(h_t*);
	st_t (*params_add)(h_t, const char*, const char*);
	st_t (*destroy_params)(h_t);
	st_t (*get_plugin_params)(h_t, const char*, h_t*, h_t*);
	st_t (*destroy_mem_list)(h_t);
	st_t (*create_backend)(h_t, const char*, h_t, h_t*);
	st_t (*destroy_backend)(h_t);
	st_t (*create_opt_args)(h_t*);
	st_t (*destroy_opt_args)(h_t);
	st_t (*opt_args_add_backend)(h_t, h_t);
	st_t (*opt_args_set_notif_msg)(h_t, const void*, size_t);
	st_t (*opt_args_set_has_notif)(h_t, bool);
	st_t (*create_reg_dlist)(int, h_t*);
	st_t (*destroy_reg_dlist)(h_t);
	st_t (*reg_dlist_add_desc)(h_t, uintptr_t, size_t, uint64_t, const void*, size_t);
	st_t (*register_mem)(h_t, h_t, h_t);
	st_t (*deregister_mem)(h_t, h_t, h_t);
	st_t (*get_local_md)(h_t, void**, size_t*);
	st_t (*load_remote_md)(h_t, const void*, size_t, char**);
	st_t (*invalidate_remote_md)(h_t, const char*);
	st_t (*create_xfer_dlist)(int, h_t*);
	st_t (*destroy_xfer_dlist)(h_t);
	st_t (*xfer_dlist_add_desc)(h_t, uintptr_t, size_t, uint64_t);
	st_t (*create_xfer_req)(h_t, int, h_t, h_t, const char*, h_t*, h_t);
	st_t (*post_xfer_req)(h_t, h_t, h_t);
	st_t (*get_xfer_status)(h_t, h_t);
	st_t (*release_xfer_req)(h_t, h_t);
	st_t (*destroy_xfer_req)(h_t);
	st_t (*gen_notif)(h_t, const char*, const void*, size_t, h_t);
	st_t (*create_notif_map)(h_t*);
	st_t (*destroy_notif_map)(h_t);
	st_t (*get_notifs)(h_t, h_t, h_t);
	st_t (*notif_map_size)(h_t, size_t*);
	st_t (*notif_map_get_agent_at)(h_t, size_t, const char**);
	st_t (*notif_map_get_notifs_size)(h_t, const char*, size_t*);
	st_t (*notif_map_get_notif)(h_t, const char*, size_t, const void**, size_t*);
	st_t (*notif_map_clear)(h_t);
	st_t (*get_xfer_telemetry)(h_t, h_t, void*);
	st_t (*prep_xfer_dlist)(h_t, const char*, h_t, h_t*, h_t);
	st_t (*release_xfer_dlist_handle)(h_t, h_t);
	st_t (*make_xfer_req)(h_t, int, h_t, const int*, size_t, h_t, const int*, size_t, h_t*, h_t);
} kx;

typedef struct {
	uint64_t start_time_us;
	uint64_t post_duration_us;
	uint64_t xfer_duration_us;
	uint64_t total_bytes;
	uint64_t desc_count;
} kx_telemetry;

#define KX_SYM(name) do { *(void**)(&kx.name) = dlsym(kx.lib, "nixl_capi_" #name); if (!kx.name) return "nixl_capi_" #name; } while (0)

// kx_load opens the library and resolves every symbol; it returns NULL or
// what failed (dlerror's text or the missing symbol).
static const char* kx_load(const char *path) {
	if (kx.lib) return NULL;
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib) return dlerror();
	kx.lib = lib;
	KX_SYM(create_configured_agent); KX_SYM(destroy_agent); KX_SYM(create_params); KX_SYM(params_add);
	KX_SYM(destroy_params); KX_SYM(get_plugin_params); KX_SYM(destroy_mem_list); KX_SYM(create_backend);
	KX_SYM(destroy_backend); KX_SYM(create_opt_args); KX_SYM(destroy_opt_args); KX_SYM(opt_args_add_backend);
	KX_SYM(opt_args_set_notif_msg); KX_SYM(opt_args_set_has_notif); KX_SYM(create_reg_dlist); KX_SYM(destroy_reg_dlist);
	KX_SYM(reg_dlist_add_desc); KX_SYM(register_mem); KX_SYM(deregister_mem); KX_SYM(get_local_md);
	KX_SYM(load_remote_md); KX_SYM(invalidate_remote_md); KX_SYM(create_xfer_dlist); KX_SYM(destroy_xfer_dlist);
	KX_SYM(xfer_dlist_add_desc); KX_SYM(create_xfer_req); KX_SYM(post_xfer_req); KX_SYM(get_xfer_status);
	KX_SYM(release_xfer_req); KX_SYM(destroy_xfer_req); KX_SYM(gen_notif); KX_SYM(create_notif_map);
	KX_SYM(destroy_notif_map); KX_SYM(get_notifs); KX_SYM(notif_map_size); KX_SYM(notif_map_get_agent_at);
	KX_SYM(notif_map_get_notifs_size); KX_SYM(notif_map_get_notif); KX_SYM(notif_map_clear);
	KX_SYM(prep_xfer_dlist); KX_SYM(release_xfer_dlist_handle); KX_SYM(make_xfer_req);
	// Telemetry is optional: older libraries lack it.
	*(void**)(&kx.get_xfer_telemetry) = dlsym(kx.lib, "nixl_capi_get_xfer_telemetry");
	return NULL;
}

// The signals a process's own handlers answer (an engine's shutdown,
// reload and debug hooks) that a transport's library may take when it
// loads: UCX installs its debug handler on SIGHUP (UCX_DEBUG_SIGNO).
static const int kx_keep[] = {SIGHUP, SIGINT, SIGTERM, SIGQUIT, SIGUSR1, SIGUSR2, SIGPIPE, SIGALRM, SIGCHLD};
#define KX_NKEEP (sizeof(kx_keep) / sizeof(kx_keep[0]))

// kx_keep_save records the dispositions of kx_keep.
static void kx_keep_save(struct sigaction *saved) {
	for (size_t i = 0; i < KX_NKEEP; i++) sigaction(kx_keep[i], NULL, &saved[i]);
}

// kx_keep_restore puts back those of kx_keep that changed since
// kx_keep_save and returns them as a bit set (bit i: kx_keep[i]).
static unsigned kx_keep_restore(const struct sigaction *saved) {
	unsigned changed = 0;
	for (size_t i = 0; i < KX_NKEEP; i++) {
		struct sigaction now;
		if (sigaction(kx_keep[i], NULL, &now) != 0) continue;
		if (now.sa_handler != saved[i].sa_handler || now.sa_flags != saved[i].sa_flags) {
			sigaction(kx_keep[i], &saved[i], NULL);
			changed |= 1u << i;
		}
	}
	return changed;
}

static st_t kx_new_agent_raw(const char *name, const char *plugin, const char **kv, int n, uint64_t pthr_delay_us, h_t *agent, h_t *backend);

// kx_keep_signo is kx_keep[i], or 0.
static int kx_keep_signo(int i) { return i >= 0 && (size_t)i < KX_NKEEP ? kx_keep[i] : 0; }

// kx_new_agent makes an agent with a progress thread (pausing
// pthr_delay_us between rounds) and one backend of plugin, configured by
// n key/value pairs (kv[2i], kv[2i+1]). The dispositions of kx_keep are
// as they were before (restored: bits set in *restored).
static st_t kx_new_agent(const char *name, const char *plugin, const char **kv, int n, uint64_t pthr_delay_us, h_t *agent, h_t *backend,
                         unsigned *restored) {
	struct sigaction saved[KX_NKEEP];
	kx_keep_save(saved);
	st_t s = kx_new_agent_raw(name, plugin, kv, n, pthr_delay_us, agent, backend);
	*restored = kx_keep_restore(saved);
	return s;
}

static st_t kx_new_agent_raw(const char *name, const char *plugin, const char **kv, int n, uint64_t pthr_delay_us, h_t *agent, h_t *backend) {
	kx_agent_cfg cfg = {true, false, 0, 0, 1, pthr_delay_us, 100000, kx.get_xfer_telemetry != NULL};
	st_t s = kx.create_configured_agent(name, &cfg, agent);
	if (s != 0) return s;
	h_t mems = NULL, params = NULL;
	s = kx.get_plugin_params(*agent, plugin, &mems, &params);
	if (s != 0) { kx.destroy_agent(*agent); return s; }
	for (int i = 0; i < n && s == 0; i++) s = kx.params_add(params, kv[2*i], kv[2*i+1]);
	if (s == 0) s = kx.create_backend(*agent, plugin, params, backend);
	kx.destroy_mem_list(mems);
	kx.destroy_params(params);
	if (s != 0) kx.destroy_agent(*agent);
	return s;
}

// kx_reg registers (or deregisters) n (addr, len, dev) triples.
static st_t kx_reg(h_t agent, h_t backend, int mem, const uint64_t *d, size_t n, bool reg) {
	h_t list = NULL, opt = NULL;
	st_t s = kx.create_reg_dlist(mem, &list);
	if (s != 0) return s;
	for (size_t i = 0; i < n && s == 0; i++) s = kx.reg_dlist_add_desc(list, (uintptr_t)d[3*i], (size_t)d[3*i+1], d[3*i+2], NULL, 0);
	if (s == 0) s = kx.create_opt_args(&opt);
	if (s == 0) s = kx.opt_args_add_backend(opt, backend);
	if (s == 0) s = reg ? kx.register_mem(agent, list, opt) : kx.deregister_mem(agent, list, opt);
	if (opt) kx.destroy_opt_args(opt);
	kx.destroy_reg_dlist(list);
	return s;
}

// kx_make creates (does not post) one transfer of n (local, remote, len)
// triples: create_xfer_req over two fresh descriptor lists. dev holds
// each triple's (local, remote) device ids, or is NULL for device 0.
static st_t kx_make(h_t agent, h_t backend, int op, int mem, const uint64_t *dev, const uint64_t *d, size_t n,
		const char *remote, const void *notif, size_t nlen, bool has_notif, h_t *req) {
	h_t l = NULL, r = NULL, opt = NULL;
	st_t s = kx.create_xfer_dlist(mem, &l);
	if (s == 0) s = kx.create_xfer_dlist(mem, &r);
	for (size_t i = 0; i < n && s == 0; i++) {
		s = kx.xfer_dlist_add_desc(l, (uintptr_t)d[3*i], (size_t)d[3*i+2], dev ? dev[2*i] : 0);
		if (s == 0) s = kx.xfer_dlist_add_desc(r, (uintptr_t)d[3*i+1], (size_t)d[3*i+2], dev ? dev[2*i+1] : 0);
	}
	if (s == 0) s = kx.create_opt_args(&opt);
	if (s == 0) s = kx.opt_args_add_backend(opt, backend);
	if (s == 0 && has_notif) {
		s = kx.opt_args_set_has_notif(opt, true);
		if (s == 0) s = kx.opt_args_set_notif_msg(opt, notif, nlen);
	}
	if (s == 0) s = kx.create_xfer_req(agent, op, l, r, remote, req, opt);
	if (opt) kx.destroy_opt_args(opt);
	if (l) kx.destroy_xfer_dlist(l);
	if (r) kx.destroy_xfer_dlist(r);
	return s;
}

// kx_start posts a created transfer; on failure it frees it.
static st_t kx_start(h_t agent, h_t *req) {
	st_t s = kx.post_xfer_req(agent, *req, NULL);
	if (s == KX_IN_PROG) s = 0;
	if (s != 0) { kx.release_xfer_req(agent, *req); kx.destroy_xfer_req(*req); *req = NULL; }
	return s;
}

// kx_post creates and posts one transfer of n (local, remote, len) triples:
// one C call per transfer.
// *posting is set where the transfer was made and posting it failed (the
// transport's failure, not the request's).
static st_t kx_post(h_t agent, h_t backend, int op, int mem, const uint64_t *dev, const uint64_t *d, size_t n,
		const char *remote, const void *notif, size_t nlen, bool has_notif, h_t *req, int *posting) {
	st_t s = kx_make(agent, backend, op, mem, dev, d, n, remote, notif, nlen, has_notif, req);
	if (s == 0) { s = kx_start(agent, req); *posting = s != 0; }
	return s;
}

static st_t kx_status(h_t agent, h_t req) { return kx.get_xfer_status(agent, req); }

// kx_prep prepares a descriptor list of n (addr, len, dev) triples, local
// (peer "") or of a remote agent, once; transfers then name entries by
// index.
static st_t kx_prep(h_t agent, h_t backend, int mem, const char *peer, const uint64_t *d, size_t n, h_t *out) {
	h_t l = NULL, opt = NULL;
	st_t s = kx.create_xfer_dlist(mem, &l);
	for (size_t i = 0; i < n && s == 0; i++) s = kx.xfer_dlist_add_desc(l, (uintptr_t)d[3*i], (size_t)d[3*i+1], d[3*i+2]);
	if (s == 0) s = kx.create_opt_args(&opt);
	if (s == 0) s = kx.opt_args_add_backend(opt, backend);
	if (s == 0) s = kx.prep_xfer_dlist(agent, peer, l, out, opt);
	if (opt) kx.destroy_opt_args(opt);
	if (l) kx.destroy_xfer_dlist(l);
	return s;
}

static st_t kx_unprep(h_t agent, h_t h) { return kx.release_xfer_dlist_handle(agent, h); }

// kx_make_prepped makes (does not post) a transfer of n index pairs
// between two prepared lists: make_xfer_req.
static st_t kx_make_prepped(h_t agent, h_t backend, int op, h_t lh, const int *li, h_t rh, const int *ri, size_t n,
		const void *notif, size_t nlen, bool has_notif, h_t *req) {
	h_t opt = NULL;
	st_t s = kx.create_opt_args(&opt);
	if (s == 0) s = kx.opt_args_add_backend(opt, backend);
	if (s == 0 && has_notif) {
		s = kx.opt_args_set_has_notif(opt, true);
		if (s == 0) s = kx.opt_args_set_notif_msg(opt, notif, nlen);
	}
	if (s == 0) s = kx.make_xfer_req(agent, op, lh, li, n, rh, ri, n, req, opt);
	if (opt) kx.destroy_opt_args(opt);
	return s;
}

// kx_post_prepped makes and posts a transfer of n index pairs between two
// prepared lists: one C call per transfer (*posting: as kx_post's).
static st_t kx_post_prepped(h_t agent, h_t backend, int op, h_t lh, const int *li, h_t rh, const int *ri, size_t n,
		const void *notif, size_t nlen, bool has_notif, h_t *req, int *posting) {
	st_t s = kx_make_prepped(agent, backend, op, lh, li, rh, ri, n, notif, nlen, has_notif, req);
	if (s == 0) { s = kx_start(agent, req); *posting = s != 0; }
	return s;
}

static st_t kx_telemetry_get(h_t agent, h_t req, kx_telemetry *t) {
	if (!kx.get_xfer_telemetry) return -5;
	return kx.get_xfer_telemetry(agent, req, t);
}
static st_t kx_release(h_t agent, h_t req) { st_t s = kx.release_xfer_req(agent, req); kx.destroy_xfer_req(req); return s; }
static st_t kx_notify(h_t agent, const char *remote, const void *msg, size_t len) { return kx.gen_notif(agent, remote, msg, len, NULL); }
static st_t kx_local_md(h_t agent, void **data, size_t *len) { return kx.get_local_md(agent, data, len); }
static st_t kx_load_md(h_t agent, const void *data, size_t len, char **name) { return kx.load_remote_md(agent, data, len, name); }
static st_t kx_invalidate(h_t agent, const char *name) { return kx.invalidate_remote_md(agent, name); }
static st_t kx_destroy(h_t agent, h_t backend) { (void)backend; return kx.destroy_agent(agent); }

// kx_drain moves every pending notification into one malloc'd buffer of
// records [u32 agent len][agent][u32 msg len][msg]; *out is NULL when none.
static st_t kx_drain(h_t agent, h_t map, void **out, size_t *outlen) {
	*out = NULL; *outlen = 0;
	st_t s = kx.get_notifs(agent, map, NULL);
	if (s != 0) return s;
	size_t na = 0, total = 0;
	kx.notif_map_size(map, &na);
	for (int pass = 0; pass < 2; pass++) {
		char *p = (char*)*out;
		for (size_t a = 0; a < na; a++) {
			const char *name = NULL; size_t nn = 0;
			kx.notif_map_get_agent_at(map, a, &name);
			kx.notif_map_get_notifs_size(map, name, &nn);
			uint32_t al = (uint32_t)strlen(name);
			for (size_t i = 0; i < nn; i++) {
				const void *m = NULL; size_t ml = 0;
				kx.notif_map_get_notif(map, name, i, &m, &ml);
				if (pass == 0) { total += 8 + al + ml; continue; }
				uint32_t l32 = (uint32_t)ml;
				memcpy(p, &al, 4); p += 4; memcpy(p, name, al); p += al;
				memcpy(p, &l32, 4); p += 4; memcpy(p, m, ml); p += ml;
			}
		}
		if (pass == 0) {
			if (total == 0) break;
			*out = malloc(total); *outlen = total;
			if (!*out) { kx.notif_map_clear(map); return -4; }
		}
	}
	kx.notif_map_clear(map);
	return 0;
}
static st_t kx_new_map(h_t *map) { return kx.create_notif_map(map); }
static void kx_free_map(h_t map) { kx.destroy_notif_map(map); }
*/
import "C"

import (
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

var loadOnce struct {
	sync.Once
	err           error
	path, version string
}

// load finds and opens libnixl_capi.so once per process. It changes no
// environment: what NIXL and UCX read when they load (ProcessEnv) must be
// set by then, and a plugin directory left unset is refused here rather
// than found missing by NIXL later.
func load() error {
	loadOnce.Do(func() {
		path, err := FindLibrary()
		if err != nil {
			loadOnce.err = err
			return
		}
		for _, kv := range ProcessEnv(path) {
			if k, v, _ := strings.Cut(kv, "="); k == "NIXL_PLUGIN_DIR" {
				loadOnce.err = fmt.Errorf("%w: %s: NIXL_PLUGIN_DIR is not set, and NIXL would not find its UCX plugin; "+
					"set NIXL_PLUGIN_DIR=%s before the process starts (kvxferd sets it itself)", ErrUnavailable, path, v)
				return
			}
		}
		cpath := C.CString(path)
		defer C.free(unsafe.Pointer(cpath))
		if msg := C.kx_load(cpath); msg != nil {
			loadOnce.err = fmt.Errorf("%w: load %s: %s", ErrUnavailable, path, C.GoString(msg))
			return
		}
		loadOnce.path, loadOnce.version = path, LibraryVersion(path)
	})
	return loadOnce.err
}

// Library returns the path of the loaded NIXL C library, loading it.
func Library() (string, error) {
	if err := load(); err != nil {
		return "", err
	}
	return loadOnce.path, nil
}

// cString copies s into C memory (free it with C.free), refusing one
// with a NUL byte: C would read it cut short there (a peer "P\x00x"
// would be P). what names s in the error.
func cString(what, s string) (*C.char, error) {
	if i := strings.IndexByte(s, 0); i >= 0 {
		return nil, fmt.Errorf("%w: %s %q holds a NUL byte at %d (a C string would end there)", ErrBadString, what, s, i)
	}
	return C.CString(s), nil
}

func status(op string, s C.st_t) error {
	if s == 0 {
		return nil
	}
	return &Error{Op: op, Code: int(s)}
}

// posted marks err (status's) as the transport's (Error.Transport) where
// transport is set.
func posted(err error, transport bool) error {
	if e, ok := err.(*Error); ok && transport {
		e.Transport = true
	}
	return err
}

// Agent is one NIXL agent with one backend. It is safe for concurrent
// use.
type Agent struct {
	name    string
	mu      sync.Mutex
	agent   C.h_t
	backend C.h_t
	notifs  C.h_t
	closed  bool
	mem     C.int
}

// Open makes an agent named name with a backend of plugin (UCX), set up
// with params (for Debian's UCX 1.13 and shared memory:
// ucx_error_handling_mode=none), for host memory.
func Open(name, plugin string, params map[string]string) (*Agent, error) {
	return OpenConfig(Config{Name: name, Plugin: plugin, Params: params, ProgressDelay: DefaultProgressDelay})
}

// OpenVRAM is Open for GPU memory (device pointers, with their device id
// in each registered range).
func OpenVRAM(name, plugin string, params map[string]string) (*Agent, error) {
	return OpenConfig(Config{Name: name, Plugin: plugin, Params: params, VRAM: true, ProgressDelay: DefaultProgressDelay})
}

// OpenConfig makes an agent as c says.
func OpenConfig(c Config) (*Agent, error) {
	if err := load(); err != nil {
		return nil, err
	}
	if err := checkVersion(loadOnce.path, loadOnce.version, c.AnyVersion); err != nil {
		return nil, err
	}
	if c.VRAM && os.Getenv("UCX_MEMTYPE_CACHE") != "n" {
		return nil, fmt.Errorf("nixl: a GPU memory agent needs UCX_MEMTYPE_CACHE=n in the environment before the process " +
			"loads NIXL (UCX takes memory imported from CUDA IPC handles for host memory otherwise); kvxferd sets it itself")
	}
	mem := C.int(C.KX_MEM_DRAM)
	if c.VRAM {
		mem = C.KX_MEM_VRAM
	}
	for k, v := range c.Params {
		if strings.IndexByte(k, 0) >= 0 || strings.IndexByte(v, 0) >= 0 {
			return nil, fmt.Errorf("%w: plugin parameter %q=%q holds a NUL byte (a C string would end there)", ErrBadString, k, v)
		}
	}
	cname, err := cString("agent name", c.Name)
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(cname))
	cplug, err := cString("plugin", c.Plugin)
	if err != nil {
		return nil, err
	}
	defer C.free(unsafe.Pointer(cplug))
	kv := C.malloc(C.size_t(2*len(c.Params)+1) * C.size_t(unsafe.Sizeof(uintptr(0))))
	defer C.free(kv)
	slots := unsafe.Slice((**C.char)(kv), 2*len(c.Params)+1)
	i := 0
	for k, v := range c.Params {
		slots[2*i], slots[2*i+1] = C.CString(k), C.CString(v)
		defer C.free(unsafe.Pointer(slots[2*i]))
		defer C.free(unsafe.Pointer(slots[2*i+1]))
		i++
	}
	a := &Agent{name: c.Name, mem: mem}
	var restored C.unsigned
	err = status("create agent", C.kx_new_agent(cname, cplug, (**C.char)(kv), C.int(len(c.Params)), C.uint64_t(c.delayMicros()), &a.agent, &a.backend, &restored))
	noteRestored(uint(restored))
	if err != nil {
		return nil, err
	}
	if err := status("create notification map", C.kx_new_map(&a.notifs)); err != nil {
		C.kx_destroy(a.agent, a.backend)
		return nil, err
	}
	return a, nil
}

// Name returns the agent's name.
func (a *Agent) Name() string { return a.name }

// Register registers (addr, len, dev) ranges of host memory.
func (a *Agent) Register(ranges [][3]uint64) error { return a.reg(ranges, true) }

// Deregister deregisters ranges registered earlier.
func (a *Agent) Deregister(ranges [][3]uint64) error { return a.reg(ranges, false) }

func (a *Agent) reg(ranges [][3]uint64, reg bool) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	if len(ranges) == 0 {
		return nil
	}
	buf := cTriples(ranges)
	defer C.free(unsafe.Pointer(buf))
	op := "register memory"
	if !reg {
		op = "deregister memory"
	}
	return status(op, C.kx_reg(a.agent, a.backend, a.mem, buf, C.size_t(len(ranges)), C.bool(reg)))
}

// cTriples copies triples into C memory (the cgo pointer rules: C keeps
// no Go pointer).
func cTriples(t [][3]uint64) *C.uint64_t {
	p := (*C.uint64_t)(C.malloc(C.size_t(len(t)*24 + 8)))
	s := unsafe.Slice((*uint64)(unsafe.Pointer(p)), len(t)*3)
	for i, x := range t {
		s[3*i], s[3*i+1], s[3*i+2] = x[0], x[1], x[2]
	}
	return p
}

// Metadata returns the agent's metadata blob.
func (a *Agent) Metadata() ([]byte, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil, ErrClosed
	}
	var data unsafe.Pointer
	var n C.size_t
	if err := status("get local metadata", C.kx_local_md(a.agent, &data, &n)); err != nil {
		return nil, err
	}
	defer C.free(data)
	return C.GoBytes(data, C.int(n)), nil
}

// LoadPeer loads a peer's metadata and returns its name.
func (a *Agent) LoadPeer(meta []byte) (string, error) {
	if len(meta) == 0 {
		return "", &Error{Op: "load remote metadata", Code: -1}
	}
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return "", ErrClosed
	}
	cmeta := C.CBytes(meta)
	defer C.free(cmeta)
	var name *C.char
	if err := status("load remote metadata", C.kx_load_md(a.agent, cmeta, C.size_t(len(meta)), &name)); err != nil {
		return "", err
	}
	defer C.free(unsafe.Pointer(name))
	return C.GoString(name), nil
}

// InvalidatePeer forgets a peer.
func (a *Agent) InvalidatePeer(name string) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	cname, err := cString("peer", name)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(cname))
	return status("invalidate remote metadata", C.kx_invalidate(a.agent, cname))
}

// Xfer is a posted transfer.
type Xfer struct{ h C.h_t }

// Post creates and posts one transfer of (local, remote, len) triples in
// one C call, all on device 0; notif (when not nil) reaches the peer after
// the bytes.
func (a *Agent) Post(write bool, peer string, descs [][3]uint64, notif []byte) (Xfer, error) {
	return a.post(write, peer, descs, nil, notif, true)
}

// PostDevs is Post with each triple's (local, remote) device ids in devs
// (as long as descs; nil: device 0 for all). NIXL finds a descriptor's
// registered memory by device and address.
func (a *Agent) PostDevs(write bool, peer string, descs [][3]uint64, devs [][2]uint64, notif []byte) (Xfer, error) {
	if devs != nil && len(devs) != len(descs) {
		return Xfer{}, fmt.Errorf("nixl: post: %d device pairs for %d descriptors", len(devs), len(descs))
	}
	return a.post(write, peer, descs, devs, notif, true)
}

// Make creates the transfer Post would (NIXL's create_xfer_req) without
// posting it: Start posts it, Release frees it. Post's two halves apart,
// for measuring them (BenchmarkMake).
func (a *Agent) Make(write bool, peer string, descs [][3]uint64, notif []byte) (Xfer, error) {
	return a.post(write, peer, descs, nil, notif, false)
}

func (a *Agent) post(write bool, peer string, descs [][3]uint64, devs [][2]uint64, notif []byte, start bool) (Xfer, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return Xfer{}, ErrClosed
	}
	buf := cTriples(descs)
	defer C.free(unsafe.Pointer(buf))
	var cdevs *C.uint64_t
	if devs != nil {
		cdevs = (*C.uint64_t)(C.malloc(C.size_t(len(devs)*16 + 8)))
		defer C.free(unsafe.Pointer(cdevs))
		copy(unsafe.Slice((*[2]uint64)(unsafe.Pointer(cdevs)), len(devs)), devs)
	}
	cpeer, err := cString("peer", peer)
	if err != nil {
		return Xfer{}, err
	}
	defer C.free(unsafe.Pointer(cpeer))
	var cnotif unsafe.Pointer
	if len(notif) > 0 {
		cnotif = C.CBytes(notif)
		defer C.free(cnotif)
	}
	op := C.int(0)
	if write {
		op = 1
	}
	var req C.h_t
	if !start {
		err = status("make transfer", C.kx_make(a.agent, a.backend, op, a.mem, cdevs, buf, C.size_t(len(descs)), cpeer,
			cnotif, C.size_t(len(notif)), C.bool(notif != nil), &req))
		return Xfer{req}, err
	}
	var posting C.int
	err = posted(status("post transfer", C.kx_post(a.agent, a.backend, op, a.mem, cdevs, buf, C.size_t(len(descs)), cpeer,
		cnotif, C.size_t(len(notif)), C.bool(notif != nil), &req, &posting)), posting != 0)
	return Xfer{req}, err
}

// Start posts a transfer made by Make or MakePrepared. On failure the
// transfer is freed: do not Release it.
func (a *Agent) Start(x Xfer) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	return posted(status("post transfer", C.kx_start(a.agent, &x.h)), true)
}

// State polls a transfer: done, in progress, or an error with NIXL's
// status.
func (a *Agent) State(x Xfer) (done bool, err error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.stateLocked(x)
}

// TryState is State where no other call on the agent is under way; ok is
// false, and nothing asked, where one is.
func (a *Agent) TryState(x Xfer) (done, ok bool, err error) {
	if !a.mu.TryLock() {
		return false, false, nil
	}
	defer a.mu.Unlock()
	done, err = a.stateLocked(x)
	return done, true, err
}

func (a *Agent) stateLocked(x Xfer) (done bool, err error) {
	if a.closed {
		return false, ErrClosed
	}
	s := C.kx_status(a.agent, x.h)
	switch {
	case s == 0:
		return true, nil
	case s == C.KX_IN_PROG:
		return false, nil
	}
	return false, &Error{Op: "transfer", Code: int(s)}
}

// Telemetry is NIXL's own measurement of a finished transfer.
type Telemetry struct {
	Post, Transfer time.Duration
	Bytes, Descs   uint64
}

// Telemetry returns NIXL's telemetry of a finished transfer (false when
// the library has none).
func (a *Agent) Telemetry(x Xfer) (Telemetry, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return Telemetry{}, false
	}
	var t C.kx_telemetry
	if C.kx_telemetry_get(a.agent, x.h, &t) != 0 {
		return Telemetry{}, false
	}
	return Telemetry{Post: time.Duration(t.post_duration_us) * time.Microsecond, Transfer: time.Duration(t.xfer_duration_us) * time.Microsecond,
		Bytes: uint64(t.total_bytes), Descs: uint64(t.desc_count)}, true
}

// Prepped is a prepared descriptor list.
type Prepped struct{ h C.h_t }

// Prepare prepares a list of (addr, len, dev) entries: this agent's own
// when peer is "", else the loaded peer's.
func (a *Agent) Prepare(peer string, entries [][3]uint64) (Prepped, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return Prepped{}, ErrClosed
	}
	buf := cTriples(entries)
	defer C.free(unsafe.Pointer(buf))
	cpeer, err := cString("peer", peer)
	if err != nil {
		return Prepped{}, err
	}
	defer C.free(unsafe.Pointer(cpeer))
	var h C.h_t
	err = status("prepare descriptor list", C.kx_prep(a.agent, a.backend, a.mem, cpeer, buf, C.size_t(len(entries)), &h))
	return Prepped{h}, err
}

// Unprepare releases a prepared list.
func (a *Agent) Unprepare(p Prepped) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	return status("release descriptor list", C.kx_unprep(a.agent, p.h))
}

// PostPrepared posts a transfer of index pairs between a local and a
// remote prepared list, in one C call.
func (a *Agent) PostPrepared(write bool, local, remote Prepped, pairs [][2]int32, notif []byte) (Xfer, error) {
	return a.postPrepared(write, local, remote, pairs, notif, true)
}

// MakePrepared makes the transfer PostPrepared would (NIXL's
// make_xfer_req) without posting it: Start posts it, Release frees it.
func (a *Agent) MakePrepared(write bool, local, remote Prepped, pairs [][2]int32, notif []byte) (Xfer, error) {
	return a.postPrepared(write, local, remote, pairs, notif, false)
}

func (a *Agent) postPrepared(write bool, local, remote Prepped, pairs [][2]int32, notif []byte, start bool) (Xfer, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return Xfer{}, ErrClosed
	}
	n := len(pairs)
	li := (*C.int)(C.malloc(C.size_t(4*n + 4)))
	ri := (*C.int)(C.malloc(C.size_t(4*n + 4)))
	defer C.free(unsafe.Pointer(li))
	defer C.free(unsafe.Pointer(ri))
	ls, rs := unsafe.Slice((*int32)(unsafe.Pointer(li)), n), unsafe.Slice((*int32)(unsafe.Pointer(ri)), n)
	for i, p := range pairs {
		ls[i], rs[i] = p[0], p[1]
	}
	var cnotif unsafe.Pointer
	if len(notif) > 0 {
		cnotif = C.CBytes(notif)
		defer C.free(cnotif)
	}
	op := C.int(0)
	if write {
		op = 1
	}
	var req C.h_t
	if !start {
		err := status("make prepared transfer", C.kx_make_prepped(a.agent, a.backend, op, local.h, li, remote.h, ri, C.size_t(n),
			cnotif, C.size_t(len(notif)), C.bool(notif != nil), &req))
		return Xfer{req}, err
	}
	var posting C.int
	err := posted(status("post prepared transfer", C.kx_post_prepped(a.agent, a.backend, op, local.h, li, remote.h, ri, C.size_t(n),
		cnotif, C.size_t(len(notif)), C.bool(notif != nil), &req, &posting)), posting != 0)
	return Xfer{req}, err
}

// Release frees a transfer.
func (a *Agent) Release(x Xfer) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	return status("release transfer", C.kx_release(a.agent, x.h))
}

// Notify sends a bare notification.
func (a *Agent) Notify(peer string, msg []byte) error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return ErrClosed
	}
	cpeer, err := cString("peer", peer)
	if err != nil {
		return err
	}
	defer C.free(unsafe.Pointer(cpeer))
	cmsg := C.CBytes(msg)
	defer C.free(cmsg)
	s := C.kx_notify(a.agent, cpeer, cmsg, C.size_t(len(msg)))
	return posted(status("notify", s), s == -2) // a backend error: the connection's (an unknown peer is -6)
}

// Notif is a received notification.
type Notif struct {
	From string
	Msg  []byte
}

// Drain appends the notifications received since the last call.
func (a *Agent) Drain(dst []Notif) ([]Notif, error) {
	a.mu.Lock()
	defer a.mu.Unlock()
	return a.drainLocked(dst)
}

// TryDrain is Drain where no other call on the agent is under way (a
// post of many descriptors, a registration); ok is false, and nothing
// drained, where one is: the process's poller of many agents goes on to
// the next one instead of waiting.
func (a *Agent) TryDrain(dst []Notif) (out []Notif, ok bool, err error) {
	if !a.mu.TryLock() {
		return dst, false, nil
	}
	defer a.mu.Unlock()
	out, err = a.drainLocked(dst)
	return out, true, err
}

func (a *Agent) drainLocked(dst []Notif) ([]Notif, error) {
	if a.closed {
		return dst, ErrClosed
	}
	var out unsafe.Pointer
	var n C.size_t
	if err := status("get notifications", C.kx_drain(a.agent, a.notifs, &out, &n)); err != nil {
		return dst, err
	}
	if out == nil {
		return dst, nil
	}
	b := C.GoBytes(out, C.int(n))
	C.free(out)
	for len(b) >= 8 {
		al := binary.LittleEndian.Uint32(b)
		from := string(b[4 : 4+al])
		b = b[4+al:]
		ml := binary.LittleEndian.Uint32(b)
		dst = append(dst, Notif{From: from, Msg: append([]byte(nil), b[4:4+ml]...)})
		b = b[4+ml:]
	}
	return dst, nil
}

// Close destroys the agent and its backend. It is idempotent.
func (a *Agent) Close() error {
	a.mu.Lock()
	defer a.mu.Unlock()
	if a.closed {
		return nil
	}
	a.closed = true
	C.kx_free_map(a.notifs)
	err := status("destroy agent", C.kx_destroy(a.agent, a.backend))
	runtime.KeepAlive(a)
	return err
}

var _ = errors.New

// restoredSignals counts, by signal, the handlers a transport library
// installed when an agent was made and that were put back (kx_keep): the
// process's own handlers stay in charge (an engine's SIGHUP, SIGTERM...).
var restoredSignals sync.Map // syscall.Signal -> *atomic.Int64

func noteRestored(bits uint) {
	for i := 0; bits != 0; i++ {
		if bits&1 != 0 {
			sig := syscall.Signal(C.kx_keep_signo(C.int(i)))
			v, _ := restoredSignals.LoadOrStore(sig, new(atomic.Int64))
			if v.(*atomic.Int64).Add(1) == 1 {
				slog.Debug("nixl: a transport library installed a handler for a signal the process answers itself; put back", "signal", sig)
			}
		}
		bits >>= 1
	}
}

// RestoredSignals returns how many times each signal's handler was put
// back after a transport library replaced it while an agent was made.
func RestoredSignals() map[syscall.Signal]int64 {
	out := map[syscall.Signal]int64{}
	restoredSignals.Range(func(k, v any) bool {
		out[k.(syscall.Signal)] = v.(*atomic.Int64).Load()
		return true
	})
	return out
}
