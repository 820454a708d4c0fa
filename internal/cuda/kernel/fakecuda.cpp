// A CUDA driver without a GPU, for CI: the part of libcuda.so.1's API
// internal/cuda loads (cuda.go's cu_load), over host memory, so that the
// package's GPU tests run on a machine without one (TestGPUOnFakeDriver
// builds this as libcuda.so.1 and runs them against it). It checks what
// kvxfer's Go side does with the driver, not the GPU: device memory is
// shared memory (a memfd per allocation, so that another process imports
// it through its "IPC handle" as a GPU's peer would), streams are threads
// running their work in order, events complete behind it, and the copy
// kernels (copy.cu's kvxfer_copy and kvxfer_copy_gated, found by name in
// the PTX image) run as a model of their contract: every piece of every
// region and entry copied, and the gate's protocol (count in, read the
// generation, copy only if it is the launch's, count out, mark the launch
// shut otherwise) kept CTA by CTA, in memory the consumer's process sees.
// The kernels' own code is copy.cu's, checked on the CPU by emu.cpp.
//
// Several GPUs: KVXFER_FAKE_CUDA_DEVICES=n (default 1) devices, each with
// its own UUID, renumbered per process by CUDA_VISIBLE_DEVICES (indices).
// Memory belongs to the device whose context allocated it; a kernel runs
// on its stream's device and may touch that device's memory, pinned host
// memory, and other memory only through an import opened on its device
// (the peer mapping an IPC import gives); anything else faults.
//
// For tests of what kvxfer does when things go wrong:
// KVXFER_FAKE_CUDA_FAIL_LAUNCH=n makes the n-th cuLaunchKernel of the
// process refuse (CUDA_ERROR_INVALID_VALUE, nothing queued), and
// KVXFER_FAKE_CUDA_KERNEL_US=t makes every launch take t microseconds
// more on its stream (a kernel still running when its caller looks).
//
// Like a GPU it faults on memory it does not know: a copy or a kernel
// that touches bytes outside every allocation, import and pinned host
// buffer of the process fails, a kernel's fault with
// CUDA_ERROR_ILLEGAL_ADDRESS that sticks to the context (every later call
// fails as a real context does), so a bounds mistake of kvxfer's shows as
// it would on a GPU.
//
//   g++ -std=c++20 -shared -fPIC -pthread -o libcuda.so.1 fakecuda.cpp
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <fcntl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
struct CUipcMemHandle {
  char reserved[64];
};
struct CUuuid {
  char bytes[16];
};

enum : CUresult {
  OK = 0,
  ERR_INVALID_VALUE = 1,
  ERR_OUT_OF_MEMORY = 2,
  ERR_INVALID_DEVICE = 101,
  ERR_INVALID_CONTEXT = 201,
  ERR_INVALID_IMAGE = 200,
  ERR_INVALID_HANDLE = 400,
  ERR_NOT_FOUND = 500,
  ERR_NOT_READY = 600,
  ERR_ILLEGAL_ADDRESS = 700,
};

namespace {

// ---- memory the "device" knows ----

enum Kind { DEVICE, IMPORT, PINNED };

struct Region {
  uint64_t base, size;
  Kind kind;
  int dev;         // DEVICE, IMPORT: the physical device it is mapped for (IMPORT: the importing context's)
  int home;        // DEVICE, IMPORT: the physical device its memory is on
  int fd;          // DEVICE: its memfd (exported through /proc/<pid>/fd/<fd>)
  std::string id;  // IMPORT: the exporter's pid and memfd inode
  int refs;        // IMPORT: opens not closed yet
};

std::mutex mem_mu;
std::map<uint64_t, Region> regions;  // by base
std::atomic<CUresult> sticky{OK};    // a kernel's fault: the context is dead

// find returns the region holding [p, p+n) (n may be 0), or null.
const Region *find(uint64_t p, uint64_t n) {
  auto it = regions.upper_bound(p);
  if (it == regions.begin()) return nullptr;
  --it;
  const Region &r = it->second;
  if (p - r.base > r.size || n > r.size - (p - r.base)) return nullptr;
  return &r;
}

bool known(uint64_t p, uint64_t n) {
  std::lock_guard<std::mutex> g(mem_mu);
  return find(p, n) != nullptr;
}

// reach reports whether a kernel on physical device dev may touch
// [p, p+n): memory mapped for dev (its own, or imported in its context),
// or pinned host memory.
bool reach(int dev, uint64_t p, uint64_t n) {
  std::lock_guard<std::mutex> g(mem_mu);
  const Region *r = find(p, n);
  return r != nullptr && (r->kind == PINNED || r->dev == dev);
}

// ---- devices ----

const int kMaxDevices = 8;

// physical is the physical devices (KVXFER_FAKE_CUDA_DEVICES); visible,
// this process's ordinals' physical devices (CUDA_VISIBLE_DEVICES).
struct Devices {
  int physical = 1;
  int visible[kMaxDevices];
  int n = 0;
  Devices() {
    if (const char *e = getenv("KVXFER_FAKE_CUDA_DEVICES")) physical = std::max(1, std::min(kMaxDevices, atoi(e)));
    const char *v = getenv("CUDA_VISIBLE_DEVICES");
    if (v == nullptr) {
      for (int i = 0; i < physical; i++) visible[n++] = i;
      return;
    }
    for (const char *c = v; *c && n < kMaxDevices;) {
      char *end;
      long i = strtol(c, &end, 10);
      if (end == c || i < 0 || i >= physical) break;  // CUDA stops at the first it cannot use
      visible[n++] = int(i);
      c = *end == ',' ? end + 1 : end;
      if (*end != ',') break;
    }
  }
  int ordinal(int phys) const {
    for (int i = 0; i < n; i++)
      if (visible[i] == phys) return i;
    return -1;
  }
};
const Devices &devices() {
  static Devices d;
  return d;
}

// A context is its physical device; the thread's current one is its
// device (every call kvxfer makes sets it first).
int contexts[kMaxDevices];
thread_local int current = 0;

// ---- streams: a thread each, running its work in order ----

struct Stream {
  int dev = current;  // the device of the context it was made in
  std::mutex mu;
  std::condition_variable cv;
  std::deque<std::function<void()>> q;
  bool busy = false;
  std::thread t;
  Stream() {
    t = std::thread([this] {
      for (;;) {
        std::function<void()> f;
        {
          std::unique_lock<std::mutex> l(mu);
          cv.wait(l, [this] { return !q.empty(); });
          f = std::move(q.front());
          q.pop_front();
          busy = true;
        }
        f();
        {
          std::lock_guard<std::mutex> l(mu);
          busy = false;
        }
        cv.notify_all();
      }
    });
    t.detach();  // streams live as long as the process (as kvxfer's do)
  }
  void push(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(mu);
      q.push_back(std::move(f));
    }
    cv.notify_all();
  }
  void sync() {
    std::unique_lock<std::mutex> l(mu);
    cv.wait(l, [this] { return q.empty() && !busy; });
  }
};

// run runs f on stream s, or now on the legacy default stream (null:
// kvxfer's own streams are non-blocking, so nothing orders them with it).
void run(void *s, std::function<void()> f) {
  if (s == nullptr)
    f();
  else
    static_cast<Stream *>(s)->push(std::move(f));
}

struct Event {
  std::atomic<uint64_t> recorded{0}, completed{0};
};

// ---- the kernels ----

struct KRegion {
  uint64_t dst, src;
};
struct KEntry {
  uint64_t dst, src, len;
};

const char kPlain[] = "kvxfer_copy", kGated[] = "kvxfer_copy_gated";

struct Function {
  bool gated;
};
Function plain_fn{false}, gated_fn{true};

// launch_model runs one launch of a copy kernel: grid CTAs, CTA b taking
// pieces b, b+grid, ...; with a gate, each CTA counts itself in, reads
// the generation, copies only if it is want (else marks *shut), counts
// itself out. A piece, the gate or the shut word outside known memory is
// the launch's fault.
CUresult launch_model(int dev, bool gated, unsigned grid, uint64_t regs, unsigned nreg, uint64_t ents, unsigned nent, uint64_t gate,
                      unsigned want, uint64_t shut) {
  if (!reach(dev, regs, uint64_t(nreg) * sizeof(KRegion)) || !reach(dev, ents, uint64_t(nent) * sizeof(KEntry))) return ERR_ILLEGAL_ADDRESS;
  if (gated && (!reach(dev, gate, 128) || !reach(dev, shut, 4))) return ERR_ILLEGAL_ADDRESS;
  const KRegion *rg = reinterpret_cast<const KRegion *>(regs);
  const KEntry *en = reinterpret_cast<const KEntry *>(ents);
  uint64_t pieces = uint64_t(nreg) * nent;
  // Every piece checked before any is copied (a GPU faults mid-launch;
  // a fault here leaves the launch's memory as it was: either way the
  // context is dead).
  for (uint64_t p = 0; p < pieces; p++) {
    const KRegion &r = rg[p / nent];
    const KEntry &e = en[p % nent];
    if (e.len > (64u << 10)) return ERR_ILLEGAL_ADDRESS;  // the kernel's contract: the host cuts longer pieces
    if (e.len && (!reach(dev, r.dst + e.dst, e.len) || !reach(dev, r.src + e.src, e.len))) return ERR_ILLEGAL_ADDRESS;
  }
  unsigned *g = reinterpret_cast<unsigned *>(gate);
  for (unsigned b = 0; b < grid; b++) {
    bool open = true;
    unsigned *act = gated ? &g[16 + (b & 15)] : nullptr;
    if (gated) {
      __atomic_fetch_add(act, 1u, __ATOMIC_SEQ_CST);
      open = __atomic_load_n(&g[0], __ATOMIC_SEQ_CST) == want;
      if (!open) __atomic_store_n(reinterpret_cast<unsigned *>(shut), 1u, __ATOMIC_SEQ_CST);
    }
    if (open)
      for (uint64_t p = b; p < pieces; p += grid) {
        const KRegion &r = rg[p / nent];
        const KEntry &e = en[p % nent];
        memmove(reinterpret_cast<void *>(r.dst + e.dst), reinterpret_cast<const void *>(r.src + e.src), e.len);
      }
    if (gated) __atomic_fetch_sub(act, 1u, __ATOMIC_SEQ_CST);
  }
  return OK;
}

CUresult copy_checked(uint64_t dst, uint64_t src, size_t n, bool dst_dev, bool src_dev) {
  if ((dst_dev && !known(dst, n)) || (src_dev && !known(src, n))) return ERR_INVALID_VALUE;
  memmove(reinterpret_cast<void *>(dst), reinterpret_cast<const void *>(src), n);
  return OK;
}

// async runs a copy on stream s; its failure, found when it runs, is the
// context's (as a failed asynchronous copy's error shows at the next
// synchronisation).
CUresult async_copy(void *s, uint64_t dst, uint64_t src, size_t n, bool dst_dev, bool src_dev) {
  if (sticky) return sticky;
  if ((dst_dev && !known(dst, n)) || (src_dev && !known(src, n))) return ERR_INVALID_VALUE;
  run(s, [=] {
    if (copy_checked(dst, src, n, dst_dev, src_dev) != OK) sticky = ERR_ILLEGAL_ADDRESS;
  });
  return OK;
}

struct Handle {
  char magic[16];
  int32_t pid, fd;
  uint64_t size;
  int32_t home;  // the physical device of the memory
};
const char kMagic[16] = "kvxfer-fakecuda";

}  // namespace

extern "C" {

CUresult cuInit(unsigned) { return OK; }
CUresult cuDeviceGetCount(int *n) {
  *n = devices().n;
  return OK;
}
// A CUdevice here is the physical device.
CUresult cuDeviceGet(CUdevice *d, int ordinal) {
  if (ordinal < 0 || ordinal >= devices().n) return ERR_INVALID_DEVICE;
  *d = devices().visible[ordinal];
  return OK;
}
CUresult cuDeviceGetUuid(CUuuid *u, CUdevice d) {
  static const char id[16] = {'k', 'v', 'x', 'f', 'e', 'r', '-', 'f', 'a', 'k', 'e', '-', 'g', 'p', 'u', '0'};
  if (d < 0 || d >= devices().physical) return ERR_INVALID_DEVICE;
  memcpy(u->bytes, id, 16);
  u->bytes[15] = char('0' + d);
  return OK;
}
CUresult cuDeviceGetUuid_v2(CUuuid *u, CUdevice d) { return cuDeviceGetUuid(u, d); }
// Two multiprocessors: a gated launch is capped at 16 CTAs (internal/cuda
// gatedGrid), fewer than most tests' pieces, so its CTAs loop.
CUresult cuDeviceGetAttribute(int *v, int attr, CUdevice d) {
  if (d < 0 || d >= devices().physical) return ERR_INVALID_DEVICE;
  if (attr != 16) return ERR_INVALID_VALUE;  // CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT
  *v = 2;
  return OK;
}
CUresult cuDevicePrimaryCtxRetain(void **ctx, CUdevice d) {
  if (d < 0 || d >= devices().physical || devices().ordinal(d) < 0) return ERR_INVALID_DEVICE;
  contexts[d] = d;
  *ctx = &contexts[d];
  return OK;
}
CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return OK; }
CUresult cuCtxSetCurrent(void *ctx) {
  if (ctx != nullptr) current = *static_cast<int *>(ctx);
  return OK;
}

CUresult cuGetErrorString(CUresult r, const char **s) {
  switch (r) {
    case OK: *s = "no error (fake driver)"; break;
    case ERR_INVALID_VALUE: *s = "invalid argument (fake driver)"; break;
    case ERR_OUT_OF_MEMORY: *s = "out of memory (fake driver)"; break;
    case ERR_INVALID_CONTEXT: *s = "invalid device context (fake driver)"; break;
    case ERR_INVALID_IMAGE: *s = "device kernel image is invalid (fake driver)"; break;
    case ERR_INVALID_HANDLE: *s = "invalid resource handle (fake driver)"; break;
    case ERR_NOT_FOUND: *s = "named symbol not found (fake driver)"; break;
    case ERR_NOT_READY: *s = "device not ready (fake driver)"; break;
    case ERR_ILLEGAL_ADDRESS: *s = "an illegal memory access was encountered (fake driver)"; break;
    default: *s = "unknown error (fake driver)";
  }
  return OK;
}

CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n) {
  if (sticky) return sticky;
  if (n == 0) return ERR_INVALID_VALUE;
  int fd = memfd_create("kvxfer-fakecuda", MFD_CLOEXEC);
  if (fd < 0) return ERR_OUT_OF_MEMORY;
  if (ftruncate(fd, off_t(n)) != 0) {
    close(fd);
    return ERR_OUT_OF_MEMORY;
  }
  void *m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (m == MAP_FAILED) {
    close(fd);
    return ERR_OUT_OF_MEMORY;
  }
  std::lock_guard<std::mutex> g(mem_mu);
  regions[uint64_t(m)] = Region{uint64_t(m), n, DEVICE, current, current, fd, "", 0};
  *p = uint64_t(m);
  return OK;
}

CUresult cuMemFree_v2(CUdeviceptr p) {
  std::lock_guard<std::mutex> g(mem_mu);
  auto it = regions.find(p);
  if (it == regions.end() || it->second.kind != DEVICE) return ERR_INVALID_VALUE;
  munmap(reinterpret_cast<void *>(p), it->second.size);
  close(it->second.fd);
  regions.erase(it);
  return OK;
}

CUresult cuMemAllocHost_v2(void **p, size_t n) {
  void *m = mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (m == MAP_FAILED) return ERR_OUT_OF_MEMORY;
  std::lock_guard<std::mutex> g(mem_mu);
  regions[uint64_t(m)] = Region{uint64_t(m), n, PINNED, -1, -1, -1, "", 0};
  *p = m;
  return OK;
}

CUresult cuMemFreeHost(void *p) {
  std::lock_guard<std::mutex> g(mem_mu);
  auto it = regions.find(uint64_t(p));
  if (it == regions.end() || it->second.kind != PINNED) return ERR_INVALID_VALUE;
  munmap(p, it->second.size);
  regions.erase(it);
  return OK;
}

// Pinned host memory is mapped at the same address on the device
// (unified addressing).
CUresult cuMemHostGetDevicePointer_v2(CUdeviceptr *d, void *p, unsigned) {
  if (!known(uint64_t(p), 1)) return ERR_INVALID_VALUE;
  *d = uint64_t(p);
  return OK;
}

CUresult cuMemGetAddressRange_v2(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
  std::lock_guard<std::mutex> g(mem_mu);
  const Region *r = find(p, 1);
  if (r == nullptr || r->kind == PINNED) return ERR_NOT_FOUND;
  *base = r->base;
  *size = r->size;
  return OK;
}

// CU_POINTER_ATTRIBUTE_MEMORY_TYPE (2: CU_MEMORYTYPE_HOST 1, DEVICE 2)
// and CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL (9); memory the driver does not
// know is an invalid value.
CUresult cuPointerGetAttribute(void *data, int attr, CUdeviceptr p) {
  std::lock_guard<std::mutex> g(mem_mu);
  const Region *r = find(p, 1);
  if (r == nullptr) return ERR_INVALID_VALUE;
  switch (attr) {
    case 2: *static_cast<unsigned *>(data) = r->kind == PINNED ? 1u : 2u; return OK;
    case 9: *static_cast<int *>(data) = r->kind == PINNED ? -1 : devices().ordinal(r->home); return OK;
  }
  return ERR_INVALID_VALUE;
}

CUresult cuIpcGetMemHandle(CUipcMemHandle *h, CUdeviceptr p) {
  std::lock_guard<std::mutex> g(mem_mu);
  const Region *r = find(p, 1);
  if (r == nullptr || r->kind != DEVICE || r->base != p) return ERR_INVALID_VALUE;
  Handle x{};
  memcpy(x.magic, kMagic, sizeof x.magic);
  x.pid = getpid();
  x.fd = r->fd;
  x.size = r->size;
  x.home = r->home;
  memset(h->reserved, 0, sizeof h->reserved);
  memcpy(h->reserved, &x, sizeof x);
  return OK;
}

// An import maps the exporter's memfd through /proc (the exporter must be
// alive, as a GPU's IPC import needs its allocation). As CUDA's: a handle
// opens only in another process (in its own, CUDA_ERROR_INVALID_CONTEXT),
// and opened again in the same context it is the same pointer, counted (each
// open closed once); in another device's context, a mapping of its own.
CUresult cuIpcOpenMemHandle_v2(CUdeviceptr *p, CUipcMemHandle h, unsigned) {
  if (sticky) return sticky;
  Handle x;
  memcpy(&x, h.reserved, sizeof x);
  if (memcmp(x.magic, kMagic, sizeof x.magic) != 0) return ERR_INVALID_VALUE;
  if (x.pid == getpid()) return ERR_INVALID_CONTEXT;
  std::string path = "/proc/" + std::to_string(x.pid) + "/fd/" + std::to_string(x.fd);
  int fd = open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return ERR_INVALID_VALUE;
  struct stat st;
  if (fstat(fd, &st) != 0 || uint64_t(st.st_size) != x.size) {
    close(fd);
    return ERR_INVALID_VALUE;
  }
  // One mapping per handle and importing context (device).
  std::string id = std::to_string(x.pid) + ":" + std::to_string(st.st_ino) + "@" + std::to_string(current);
  std::lock_guard<std::mutex> g(mem_mu);
  for (auto &[base, r] : regions)
    if (r.kind == IMPORT && r.id == id) {
      close(fd);
      r.refs++;
      *p = base;
      return OK;
    }
  void *m = mmap(nullptr, x.size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (m == MAP_FAILED) return ERR_OUT_OF_MEMORY;
  regions[uint64_t(m)] = Region{uint64_t(m), x.size, IMPORT, current, x.home, -1, id, 1};
  *p = uint64_t(m);
  return OK;
}

CUresult cuIpcCloseMemHandle(CUdeviceptr p) {
  std::lock_guard<std::mutex> g(mem_mu);
  auto it = regions.find(p);
  if (it == regions.end() || it->second.kind != IMPORT) return ERR_INVALID_VALUE;
  if (--it->second.refs > 0) return OK;
  munmap(reinterpret_cast<void *>(p), it->second.size);
  regions.erase(it);
  return OK;
}

CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *h, size_t n) {
  if (sticky) return sticky;
  return copy_checked(d, uint64_t(h), n, true, false);
}
CUresult cuMemcpyDtoH_v2(void *h, CUdeviceptr d, size_t n) {
  if (sticky) return sticky;
  return copy_checked(uint64_t(h), d, n, false, true);
}
CUresult cuMemcpyDtoD_v2(CUdeviceptr d, CUdeviceptr s, size_t n) {
  if (sticky) return sticky;
  return copy_checked(d, s, n, true, true);
}
CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr d, const void *h, size_t n, void *s) { return async_copy(s, d, uint64_t(h), n, true, false); }
CUresult cuMemcpyDtoHAsync_v2(void *h, CUdeviceptr d, size_t n, void *s) { return async_copy(s, uint64_t(h), d, n, false, true); }
CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr src, size_t n, void *s) { return async_copy(s, d, src, n, true, true); }

CUresult cuStreamCreate(void **s, unsigned) {
  *s = new Stream();
  return OK;
}
CUresult cuStreamSynchronize(void *s) {
  if (s != nullptr) static_cast<Stream *>(s)->sync();
  return sticky;
}

CUresult cuEventCreate(void **e, unsigned) {
  *e = new Event();
  return OK;
}
CUresult cuEventDestroy_v2(void *e) {
  delete static_cast<Event *>(e);
  return OK;
}
CUresult cuEventRecord(void *e, void *s) {
  if (sticky) return sticky;
  Event *ev = static_cast<Event *>(e);
  uint64_t n = ev->recorded.fetch_add(1) + 1;
  run(s, [ev, n] { ev->completed.store(n); });
  return OK;
}
CUresult cuEventQuery(void *e) {
  if (sticky) return sticky;
  Event *ev = static_cast<Event *>(e);
  return ev->completed.load() >= ev->recorded.load() ? OK : ERR_NOT_READY;
}
CUresult cuEventSynchronize(void *e) {
  Event *ev = static_cast<Event *>(e);
  while (ev->completed.load() < ev->recorded.load() && !sticky) std::this_thread::yield();
  return sticky;
}

// A module is the image's text: a function is found by its .entry.
CUresult cuModuleLoadData(void **m, const void *image) {
  if (sticky) return sticky;
  const char *s = static_cast<const char *>(image);
  if (strstr(s, ".entry") == nullptr) return ERR_INVALID_IMAGE;
  *m = new std::string(s);
  return OK;
}
CUresult cuModuleGetFunction(void **f, void *m, const char *name) {
  const std::string &img = *static_cast<std::string *>(m);
  // ".entry name(" : the whole name, not a prefix of another.
  if (img.find(std::string(".entry ") + name + "(") == std::string::npos) return ERR_NOT_FOUND;
  if (strcmp(name, kPlain) == 0)
    *f = &plain_fn;
  else if (strcmp(name, kGated) == 0)
    *f = &gated_fn;
  else
    return ERR_NOT_FOUND;
  return OK;
}

long env_long(const char *name) {
  const char *e = getenv(name);
  return e ? atol(e) : 0;
}

std::atomic<long> launches{0};

CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz, unsigned shmem,
                        void *s, void **args, void **extra) {
  if (sticky) return sticky;
  static const long fail_at = env_long("KVXFER_FAKE_CUDA_FAIL_LAUNCH"), delay_us = env_long("KVXFER_FAKE_CUDA_KERNEL_US");
  if (launches.fetch_add(1) + 1 == fail_at) return ERR_INVALID_VALUE;
  const Function *fn = static_cast<const Function *>(f);
  if ((fn != &plain_fn && fn != &gated_fn) || gx == 0 || gy != 1 || gz != 1 || bx != 256 || by != 1 || bz != 1 || shmem != 0 ||
      args == nullptr || extra != nullptr)
    return ERR_INVALID_VALUE;
  // The kernels' parameters, in copy.cu's order.
  uint64_t regs = *static_cast<uint64_t *>(args[0]), ents = *static_cast<uint64_t *>(args[2]);
  unsigned nreg = *static_cast<unsigned *>(args[1]), nent = *static_cast<unsigned *>(args[3]);
  uint64_t gate = 0, shut = 0;
  unsigned want = 0;
  if (fn->gated) {
    gate = *static_cast<uint64_t *>(args[4]);
    want = *static_cast<unsigned *>(args[5]);
    shut = *static_cast<uint64_t *>(args[6]);
  }
  bool gated = fn->gated;
  int dev = s != nullptr ? static_cast<Stream *>(s)->dev : current;
  run(s, [=] {
    if (sticky) return;
    if (delay_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    CUresult r = launch_model(dev, gated, gx, regs, nreg, ents, nent, gate, want, shut);
    if (r != OK) {
      fprintf(stderr, "fakecuda: %s launch on device %d faulted: a piece, its descriptors, the gate or the shut word outside memory it can reach\n",
              gated ? "a gated" : "a", dev);
      sticky = r;
    }
  });
  return OK;
}

}  // extern "C"
