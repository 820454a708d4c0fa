// kvxfer's gather/scatter copy: one launch moves every piece of a
// transfer between device memories (the same-host path's GPU pieces).
//
// A launch is given regions and entries: piece (r, e) copies entry e's
// len bytes from region r's source base + e's source offset to region
// r's destination base + e's destination offset. A KV cache transfer is
// naturally this shape: the regions are its layers (one base pair each),
// the entries its blocks (one offset pair each, the same in every
// layer), so what the host stages is layers + blocks, not their product.
// A plain list of pieces is one region of bases 0 with absolute entries.
//
// Every entry is at most 64 KiB (the host cuts longer pieces), and each
// CTA copies whole pieces: CTA b takes pieces b, b + gridDim.x, ... and
// finds a piece's region and entry by one division (no search, no
// per-piece state on the host).
//
// Within a piece the widest access both sides allow is used: 16-byte
// vectors when destination and source agree modulo 16 (after a head of
// single bytes up to the first 16-byte boundary), then 8, 4, 2 and 1.
// Loads go through the read-only cache (the source does not change while
// it is copied), stores are streaming (the copy is not read back here).
//
// Regenerate internal/cuda/copy.ptx with internal/cuda/kernel/gen (NVRTC
// from the nvidia-cuda-nvrtc-cu12 wheel); .ci/run checks it is current
// and assembles it with ptxas for every architecture we support.

struct kvxfer_region {
  unsigned long long dst;
  unsigned long long src;
};

struct kvxfer_entry {
  unsigned long long dst;  // offset from the region's destination base
  unsigned long long src;  // offset from its source base
  unsigned long long len;  // bytes, at most 64 KiB
};

template <typename T, int U>
__device__ __forceinline__ void copy_words(T *__restrict__ d, const T *__restrict__ s, unsigned long long n) {
  const unsigned long long step = blockDim.x;
  unsigned long long i = threadIdx.x;
  for (; i + (U - 1) * step < n; i += U * step) {
    T v[U];
#pragma unroll
    for (int u = 0; u < U; u++) v[u] = __ldg(s + i + u * step);
#pragma unroll
    for (int u = 0; u < U; u++) __stcs(d + i + u * step, v[u]);
  }
  for (; i < n; i += step) __stcs(d + i, __ldg(s + i));
}

// copy_span copies n bytes at the widest width W such that d and s agree
// modulo W: single bytes up to d's first W boundary, words, then the tail.
template <typename T>
__device__ __forceinline__ void copy_span(unsigned char *d, const unsigned char *s, unsigned long long n) {
  const unsigned long long w = sizeof(T);
  unsigned long long head = (w - ((unsigned long long)d & (w - 1))) & (w - 1);
  if (head > n) head = n;
  if (threadIdx.x < head) d[threadIdx.x] = s[threadIdx.x];
  d += head;
  s += head;
  n -= head;
  unsigned long long words = n / w;
  copy_words<T, 4>((T *)d, (const T *)s, words);
  unsigned long long done = words * w;
  unsigned long long tail = n - done;
  if (threadIdx.x < tail) d[done + threadIdx.x] = s[done + threadIdx.x];
}

// copy_piece copies piece p of a launch.
__device__ __forceinline__ void copy_piece(const kvxfer_region *__restrict__ regions, const kvxfer_entry *__restrict__ entries,
                                           unsigned int nent, unsigned long long p) {
  const unsigned long long r = p / nent;
  const kvxfer_region g = regions[r];
  const kvxfer_entry e = entries[p - r * nent];
  unsigned char *d = (unsigned char *)(g.dst + e.dst);
  const unsigned char *s = (const unsigned char *)(g.src + e.src);
  const unsigned long long x = (unsigned long long)d ^ (unsigned long long)s;
  if ((x & 15) == 0)
    copy_span<uint4>(d, s, e.len);
  else if ((x & 7) == 0)
    copy_span<unsigned long long>(d, s, e.len);
  else if ((x & 3) == 0)
    copy_span<unsigned int>(d, s, e.len);
  else if ((x & 1) == 0)
    copy_span<unsigned short>(d, s, e.len);
  else
    copy_span<unsigned char>(d, s, e.len);
}

extern "C" __global__ void __launch_bounds__(256)
kvxfer_copy(const kvxfer_region *__restrict__ regions, unsigned int nreg, const kvxfer_entry *__restrict__ entries,
            unsigned int nent) {
  const unsigned long long pieces = (unsigned long long)nreg * nent;
  for (unsigned long long p = blockIdx.x; p < pieces; p += gridDim.x) copy_piece(regions, entries, nent, p);
}

// A gate guards a one-sided write: memory of the receiving process (its
// GPU memory, mapped here through its CUDA IPC handle) that says which
// generation of the grant it stands for may still write (gen; 0: none)
// and counts the CTAs inside it (active, sharded by CTA to spread the
// atomics). A CTA counts itself in, then reads gen, copies only if gen is
// the generation its launch was given, makes its stores visible, and
// counts itself out. The receiver ends a grant by storing a new gen and
// waiting until every active count reads 0: a CTA that read the old gen
// counted itself in before that store and out only after its stores
// landed, and any later CTA reads the new gen and copies nothing. A CTA
// that found its gen gone sets *shut (host memory of the launching
// process) so the sender fails the transfer instead of reporting it done.
struct kvxfer_gate {
  unsigned int gen;
  unsigned int pad[15];
  unsigned int active[16];
};

extern "C" __global__ void __launch_bounds__(256)
kvxfer_copy_gated(const kvxfer_region *__restrict__ regions, unsigned int nreg, const kvxfer_entry *__restrict__ entries,
                  unsigned int nent, kvxfer_gate *gate, unsigned int want, unsigned int *shut) {
  __shared__ int open;
  unsigned int *act = &gate->active[blockIdx.x & 15];
  if (threadIdx.x == 0) {
    atomicAdd(act, 1);
    __threadfence();
    open = *(volatile unsigned int *)&gate->gen == want;
    if (!open) *(volatile unsigned int *)shut = 1;
  }
  __syncthreads();
  if (open) {
    const unsigned long long pieces = (unsigned long long)nreg * nent;
    for (unsigned long long p = blockIdx.x; p < pieces; p += gridDim.x) copy_piece(regions, entries, nent, p);
  }
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) atomicSub(act, 1);
}
