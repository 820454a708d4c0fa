// copy.cu's kernels, run on the CPU: the CUDA source itself, compiled as
// C++ against a small stand-in for what it uses of CUDA (thread and block
// indices, __syncthreads, atomics, fences, the cache-hinted loads and
// stores), every CTA's threads real threads. It checks on a machine
// without a GPU what a GPU run checks only where one is lent: every piece
// of a launch lands byte for byte at every alignment and length the
// kernel picks a width for, nothing outside a piece is written (guards,
// and AddressSanitizer's bounds for reads past a piece), pieces are found
// right across regions and entries and in grid-stride loops, and the
// gated kernel copies only through an open gate, counts its CTAs out,
// and lets nothing land once a receiver that shut its gate saw the counts
// at zero (the receiver a thread of its own, shutting at random moments
// of the launch).
//
// What it cannot check is the GPU's own memory model: x86 orders memory
// more strongly than a GPU does, and one CTA runs at a time here (each
// with all its threads at once), where a GPU runs many. Those are the
// GPU run's (internal/cuda's TestGatedCopy and TestGateBetweenProcesses).
//
// Built and run by internal/cuda's TestKernelOnCPU:
//   g++ -std=c++20 -pthread -fsanitize=address,undefined emu.cpp -o emu && ./emu
#include <algorithm>
#include <atomic>
#include <barrier>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <thread>
#include <vector>

// ---- what copy.cu uses of CUDA ----
struct kemu_dim {
  unsigned int x, y, z;
};
static thread_local kemu_dim threadIdx, blockIdx;
static kemu_dim blockDim, gridDim;
static std::barrier<> *kemu_bar;
static void __syncthreads() { kemu_bar->arrive_and_wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
// One CTA runs at a time (all its threads), so a block's shared
// variables can be one per launch site.
#define __shared__ static
struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};
template <typename T>
static inline T __ldg(const T *p) {
  return *p;
}
// kemu_drained is set once a receiver saw its gate's counts at 0 (the
// gate race): a store after it is one the gate let through too late.
static std::atomic<bool> kemu_drained;
static std::atomic<long> kemu_late;
template <typename T>
static inline void __stcs(T *p, T v) {
  if (kemu_drained.load(std::memory_order_relaxed)) kemu_late.fetch_add(1);
  *p = v;
}
// kemu_jitter, when set, holds a CTA for a while before each of its
// atomics now and then: what a GPU's scheduling may do between any two
// steps of a CTA, widened so that a receiver's store lands between them.
static std::atomic<bool> kemu_jitter;
static void kemu_pause() {
  static thread_local unsigned x = 0x9e3779b9u ^ (unsigned)(uintptr_t)&x;
  x ^= x << 13, x ^= x >> 17, x ^= x << 5;
  if (kemu_jitter.load(std::memory_order_relaxed) && x % 2) std::this_thread::sleep_for(std::chrono::microseconds(x % 200));
}
static inline unsigned int atomicAdd(unsigned int *p, unsigned int v) {
  kemu_pause();
  return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static inline unsigned int atomicSub(unsigned int *p, unsigned int v) {
  kemu_pause();
  return __atomic_fetch_sub(p, v, __ATOMIC_SEQ_CST);
}
static inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

#ifndef KVXFER_KERNEL
#define KVXFER_KERNEL "copy.cu"
#endif
#include KVXFER_KERNEL

// ---- launching ----

// maxGrid is internal/cuda's: a launch has min(pieces, maxGrid) CTAs.
static const unsigned long long maxGrid = 1 << 16;

static unsigned grid_for(unsigned long long pieces) { return (unsigned)(pieces < maxGrid ? pieces : maxGrid); }

// kemu_ctas counts the CTAs launches started.
static std::atomic<unsigned> kemu_ctas;

// launch runs k as grid CTAs of block threads, one CTA after another.
static void launch(unsigned grid, unsigned block, const std::function<void()> &k) {
  blockDim = {block, 1, 1};
  gridDim = {grid, 1, 1};
  std::barrier<> bar(block);
  kemu_bar = &bar;
  std::vector<std::thread> ts;
  for (unsigned t = 0; t < block; t++)
    ts.emplace_back([&, t] {
      threadIdx = {t, 0, 0};
      for (unsigned b = 0; b < grid; b++) {
        blockIdx = {b, 0, 0};
        if (t == 0) kemu_ctas.fetch_add(1);
        k();
        bar.arrive_and_wait();  // the CTA ended before the next starts
      }
    });
  for (auto &t : ts) t.join();
}

static int failures;
#define CHECK(cond, ...)                         \
  do {                                           \
    if (!(cond)) {                               \
      if (failures++ < 20) {                     \
        fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__); \
        fprintf(stderr, __VA_ARGS__);            \
        fprintf(stderr, "\n");                   \
      }                                          \
    }                                            \
  } while (0)

static std::mt19937_64 rng(42);

// ---- memory with guards ----

const unsigned char kFill = 0xEE;  // what a destination holds before a copy
const size_t kGuard = 64;

// alloc16 returns n bytes (at least 1) at a 16-byte boundary.
static unsigned char *alloc16(size_t n) {
  void *p = nullptr;
  if (posix_memalign(&p, 16, n ? n : 1)) abort();
  return (unsigned char *)p;
}

// Src is a piece's source: its own allocation, the piece starting at
// the wanted address modulo 16 and ending where the allocation does
// (AddressSanitizer stops a read past it).
struct Src {
  unsigned char *mem;
  unsigned char *at;
  Src(size_t len, unsigned mod) {
    mem = alloc16(mod + len);
    at = mem + mod;
    for (size_t i = 0; i < len; i++) at[i] = (unsigned char)rng();
  }
  ~Src() { free(mem); }
};

// Dst is a piece's destination between guards of kFill.
struct Dst {
  unsigned char *mem;
  unsigned char *at;
  size_t len, size;
  Dst(size_t n, unsigned mod) : len(n) {
    size = kGuard + 16 + n + kGuard;
    mem = alloc16(size);
    memset(mem, kFill, size);
    at = mem + kGuard + mod;  // kGuard is a multiple of 16
  }
  ~Dst() { free(mem); }
  bool guards_intact() const {
    for (unsigned char *p = mem; p < at; p++)
      if (*p != kFill) return false;
    for (unsigned char *p = at + len; p < mem + size; p++)
      if (*p != kFill) return false;
    return true;
  }
  bool untouched() const {
    for (size_t i = 0; i < len; i++)
      if (at[i] != kFill) return false;
    return guards_intact();
  }
};

// ---- the plain kernel ----

// Every alignment of destination and source modulo 16 against lengths
// around each width's edges, as one list of pieces (one region of bases
// 0, absolute entries), with the given CTA count and threads.
static void test_pieces(unsigned block, unsigned grid, const std::vector<unsigned> &dmods,
                        const std::vector<unsigned> &smods, const std::vector<size_t> &lens) {
  std::vector<Src *> srcs;
  std::vector<Dst *> dsts;
  std::vector<kvxfer_entry> ents;
  for (unsigned dm : dmods)
    for (unsigned sm : smods)
      for (size_t n : lens) {
        srcs.push_back(new Src(n, sm));
        dsts.push_back(new Dst(n, dm));
        ents.push_back({(unsigned long long)dsts.back()->at, (unsigned long long)srcs.back()->at, n});
      }
  kvxfer_region base{0, 0};
  unsigned nent = ents.size();
  if (grid == 0) grid = grid_for(nent);
  launch(grid, block, [&] { kvxfer_copy(&base, 1, ents.data(), nent); });
  for (size_t i = 0; i < ents.size(); i++) {
    CHECK(memcmp(dsts[i]->at, srcs[i]->at, ents[i].len) == 0, "piece %zu (dst %% 16 = %llu, src %% 16 = %llu, %llu bytes; %u threads, %u CTAs): bytes differ",
          i, ents[i].dst & 15, ents[i].src & 15, ents[i].len, block, grid);
    CHECK(dsts[i]->guards_intact(), "piece %zu (dst %% 16 = %llu, src %% 16 = %llu, %llu bytes; %u threads, %u CTAs): wrote outside it", i,
          ents[i].dst & 15, ents[i].src & 15, ents[i].len, block, grid);
  }
  for (auto *s : srcs) delete s;
  for (auto *d : dsts) delete d;
  printf("pieces: %zu (every alignment pair of %zu x %zu, %zu lengths), %u threads, %u CTAs\n", ents.size(), dmods.size(),
         smods.size(), lens.size(), block, grid);
}

// A layout: regions (one base pair per layer, each its own memory)
// and entries (offsets and lengths, the same in every layer).
struct Layout {
  std::vector<kvxfer_region> regs;
  std::vector<kvxfer_entry> ents;
  std::vector<unsigned char *> dmem, smem, want;
  size_t layer;
  Layout(unsigned nreg, unsigned nent, size_t maxlen) {
    // Entries at scattered, disjoint places of a layer, odd offsets
    // and lengths among them.
    size_t slot = maxlen + 64;
    std::vector<unsigned> perm(nent * 2);
    for (unsigned i = 0; i < perm.size(); i++) perm[i] = i;
    std::shuffle(perm.begin(), perm.end(), rng);
    for (unsigned e = 0; e < nent; e++) {
      size_t len = e == 0 ? maxlen : 1 + rng() % maxlen;
      unsigned long long d = perm[e] * slot + rng() % 17, s = perm[nent + e] * slot + rng() % 17;
      ents.push_back({d, s, len});
    }
    layer = slot * nent * 2;
    for (unsigned r = 0; r < nreg; r++) {
      unsigned char *d = alloc16(layer), *s = alloc16(layer);
      memset(d, kFill, layer);
      for (size_t i = 0; i < layer; i++) s[i] = (unsigned char)rng();
      dmem.push_back(d);
      smem.push_back(s);
      regs.push_back({(unsigned long long)d, (unsigned long long)s});
      // What the layer's destination holds once every piece landed.
      unsigned char *w = (unsigned char *)malloc(layer);
      memset(w, kFill, layer);
      for (auto &e : ents) memcpy(w + e.dst, s + e.src, e.len);
      want.push_back(w);
    }
  }
  ~Layout() {
    for (auto *p : dmem) free(p);
    for (auto *p : smem) free(p);
    for (auto *p : want) free(p);
  }
  unsigned long long pieces() const { return (unsigned long long)regs.size() * ents.size(); }
  bool landed(unsigned r, unsigned e) const {
    return memcmp(dmem[r] + ents[e].dst, smem[r] + ents[e].src, ents[e].len) == 0;
  }
  bool untouched(unsigned r, unsigned e) const {
    for (size_t i = 0; i < ents[e].len; i++)
      if (dmem[r][ents[e].dst + i] != kFill) return false;
    return true;
  }
  // Every byte of every layer outside the pieces still kFill.
  bool outside_intact() const {
    for (unsigned r = 0; r < regs.size(); r++) {
      std::vector<bool> in(layer);
      for (auto &e : ents)
        for (size_t i = 0; i < e.len; i++) in[e.dst + i] = true;
      for (size_t i = 0; i < layer; i++)
        if (!in[i] && dmem[r][i] != kFill) return false;
    }
    return true;
  }
};

static void test_layout(unsigned nreg, unsigned nent, size_t maxlen, unsigned block, unsigned grid) {
  Layout l(nreg, nent, maxlen);
  if (grid == 0) grid = grid_for(l.pieces());
  launch(grid, block, [&] { kvxfer_copy(l.regs.data(), nreg, l.ents.data(), nent); });
  for (unsigned r = 0; r < nreg; r++)
    CHECK(memcmp(l.dmem[r], l.want[r], l.layer) == 0, "layout %u x %u (%u threads, %u CTAs): layer %u is not what its pieces make it",
          nreg, nent, block, grid, r);
  printf("layout: %u regions x %u entries of up to %zu bytes, %u threads, %u CTAs\n", nreg, nent, maxlen, block, grid);
}

// ---- the gated kernel ----

static bool counts_zero(kvxfer_gate *g) {
  for (int i = 0; i < 16; i++)
    if (__atomic_load_n(&g->active[i], __ATOMIC_SEQ_CST) != 0) return false;
  return true;
}

// An open gate (its generation the launch's) copies everything and
// leaves no CTA counted; a gate of another generation copies nothing and
// says so (shut).
static void test_gated(unsigned nreg, unsigned nent, unsigned block, unsigned grid) {
  for (int open = 1; open >= 0; open--) {
    Layout l(nreg, nent, 4096 + 3);
    kvxfer_gate gate{};
    gate.gen = 7;
    unsigned shut = 0;
    unsigned want = open ? 7 : 6;
    unsigned g = grid ? grid : grid_for(l.pieces());
    launch(g, block, [&] { kvxfer_copy_gated(l.regs.data(), nreg, l.ents.data(), nent, &gate, want, &shut); });
    CHECK(counts_zero(&gate), "gated launch (open %d): CTAs still counted in its gate after it ended", open);
    CHECK(shut == (unsigned)!open, "gated launch (open %d): shut reads %u", open, shut);
    for (unsigned r = 0; r < nreg; r++)
      if (open)
        CHECK(memcmp(l.dmem[r], l.want[r], l.layer) == 0, "gated launch through an open gate: layer %u is not what its pieces make it", r);
      else
        for (unsigned e = 0; e < nent; e++) CHECK(l.untouched(r, e), "a launch behind a shut gate wrote layer %u entry %u", r, e);
    CHECK(l.outside_intact(), "gated launch (open %d) wrote outside its pieces", open);
  }
  printf("gated: %u regions x %u entries, open and shut, %u threads, %u CTAs\n", nreg, nent, block, grid ? grid : grid_for((unsigned long long)nreg * nent));
}

// A receiver shuts the gate at a random moment of a launch, as a grant's
// end does: it stores a new generation, waits until every count reads 0,
// then takes what its memory holds. Nothing may be stored after that
// (the stand-in's stores check), nor change; each CTA copies all its
// pieces or none; shut says whether any CTA copied none. The moments are
// spread over CTAs' lives: after a random CTA started, a random part of
// a CTA's time.
static void test_gate_race(int rounds) {
  int waited = 0, cut = 0;
  const unsigned nreg = 4, nent = 16, block = 32;
  long long cta_us;  // how long a CTA takes here
  kemu_jitter = true;
  {
    Layout l(nreg, nent, 16 << 10);
    auto t0 = std::chrono::steady_clock::now();
    launch(grid_for(l.pieces()), block, [&] { kvxfer_copy(l.regs.data(), nreg, l.ents.data(), nent); });
    cta_us = std::chrono::duration_cast<std::chrono::microseconds>(std::chrono::steady_clock::now() - t0).count() / l.pieces() + 1;
  }
  for (int round = 0; round < rounds && !failures; round++) {
    Layout l(nreg, nent, 16 << 10);
    unsigned grid = round % 3 == 0 ? 16 : grid_for(l.pieces());  // CTAs that loop over pieces, or one each
    kvxfer_gate gate{};
    gate.gen = 3;
    unsigned shut = 0;
    std::vector<std::vector<unsigned char>> seen(nreg);
    std::atomic<bool> ended{false};
    kemu_ctas = 0;
    kemu_drained = false;
    kemu_late = 0;
    unsigned at = rng() % (grid + grid / 8 + 1);  // now and then after the launch ended
    long long delay = rng() % (cta_us * (grid == 16 ? 4 : 1));
    std::thread recv([&] {
      while (kemu_ctas.load() < at && !ended.load()) std::this_thread::yield();
      std::this_thread::sleep_for(std::chrono::microseconds(delay));
      __atomic_store_n(&gate.gen, 4u, __ATOMIC_SEQ_CST);
      bool first = true;
      auto limit = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (!counts_zero(&gate)) {
        if (first) waited++;
        first = false;
        if (std::chrono::steady_clock::now() > limit) {
          CHECK(false, "round %d: the gate's counts never read 0 after it was shut", round);
          break;
        }
        std::this_thread::yield();
      }
      kemu_drained = true;
      for (unsigned r = 0; r < nreg; r++) seen[r].assign(l.dmem[r], l.dmem[r] + l.layer);
    });
    launch(grid, block, [&] { kvxfer_copy_gated(l.regs.data(), nreg, l.ents.data(), nent, &gate, 3, &shut); });
    ended = true;
    recv.join();
    CHECK(kemu_late == 0, "round %d: %ld stores after the receiver saw its gate's counts at 0", round, kemu_late.load());
    kemu_drained = false;
    CHECK(counts_zero(&gate), "round %d: CTAs still counted after the launch", round);
    bool any_missing = false;
    for (unsigned r = 0; r < nreg; r++) {
      CHECK(memcmp(seen[r].data(), l.dmem[r], l.layer) == 0, "round %d: layer %u changed after the receiver saw its gate's counts at 0", round, r);
      for (unsigned e = 0; e < nent; e++) {
        bool in = l.landed(r, e), none = l.untouched(r, e);
        CHECK(in || none, "round %d: layer %u entry %u partly written", round, r, e);
        any_missing |= !in;
      }
    }
    // A CTA's pieces: all or none.
    for (unsigned b = 0; b < grid; b++) {
      int got = -1;
      for (unsigned long long p = b; p < l.pieces(); p += grid) {
        int in = l.landed(p / nent, p % nent);
        CHECK(got < 0 || got == in, "round %d: CTA %u copied some of its pieces and not others", round, b);
        got = in;
      }
    }
    CHECK(l.outside_intact(), "round %d: wrote outside the pieces", round);
    CHECK(shut == (unsigned)any_missing, "round %d: shut %u with pieces %s", round, shut, any_missing ? "missing" : "all written");
    cut += any_missing;
  }
  kemu_jitter = false;
  printf("gate races: %d rounds, the gate shut before the launch ended in %d, a CTA inside it when shut in %d\n", rounds, cut, waited);
}

int main() {
  std::vector<unsigned> all(16);
  for (unsigned i = 0; i < 16; i++) all[i] = i;
  std::vector<size_t> lens = {0, 1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 255, 256, 257, 1000, 4095, 4096, 4097, 65535, 65536};
  // Every alignment pair, CTAs that loop over many pieces (grid-stride).
  test_pieces(32, 97, all, all, lens);
  // As launched (256 threads, a CTA per piece), the widths' edges.
  test_pieces(256, 0, {0, 1, 4, 8}, {0, 3, 8, 12}, {0, 1, 15, 17, 255, 256, 257, 4097, 65535, 65536});
  test_layout(1, 1, 65536, 256, 0);
  test_layout(5, 7, 65536, 256, 0);
  test_layout(9, 13, 4096 + 5, 32, 0);
  test_layout(9, 13, 4096 + 5, 32, 4);  // fewer CTAs than pieces: loop across regions
  test_gated(3, 5, 256, 0);
  test_gated(6, 11, 32, 7);
  test_gate_race(100);
  if (failures) {
    fprintf(stderr, "%d checks failed\n", failures);
    return 1;
  }
  printf("ok\n");
  return 0;
}
