// kvxfer's gather/scatter copy: one launch moves every piece of a
// transfer between device memories (the same-host path's GPU pieces).
//
// A piece is split into tiles of 1 << tile_shift bytes; CTA b takes tiles
// b, b + gridDim.x, ... and finds each tile's piece by binary search over
// the pieces' first tile numbers (host-computed prefix sums), so a large
// piece is spread over many CTAs and small ones cost one CTA each.
//
// Within a tile the widest access both sides allow is used: 16-byte
// vectors when destination and source agree modulo 16 (after a head of
// single bytes up to the first 16-byte boundary), then 8, 4, 2 and 1.
// Loads go through the read-only cache (the source does not change while
// it is copied), stores are streaming (the copy is not read back here).
//
// Regenerate internal/cuda/copy.ptx with internal/cuda/kernel/gen (NVRTC
// from the nvidia-cuda-nvrtc-cu12 wheel); .ci/run checks it is current
// and assembles it with ptxas for every architecture we support.

struct kvxfer_piece {
  unsigned long long dst;
  unsigned long long src;
  unsigned int len;    // bytes (a piece is under 4 GiB)
  unsigned int tile0;  // number of this piece's first tile
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

extern "C" __global__ void __launch_bounds__(256)
kvxfer_copy(const kvxfer_piece *__restrict__ pieces, unsigned int n, unsigned int tiles, unsigned int tile_shift) {
  __shared__ unsigned int found;
  for (unsigned int t = blockIdx.x; t < tiles; t += gridDim.x) {
    if (threadIdx.x == 0) {
      // The last piece whose first tile is at most t (pieces of no bytes
      // share their successor's first tile and are passed over).
      unsigned int lo = 0, hi = n;
      while (hi - lo > 1) {
        unsigned int mid = lo + (hi - lo) / 2;
        if (pieces[mid].tile0 <= t)
          lo = mid;
        else
          hi = mid;
      }
      found = lo;
    }
    __syncthreads();
    const kvxfer_piece p = pieces[found];
    __syncthreads();  // found is rewritten by the next tile's search
    unsigned long long off = (unsigned long long)(t - p.tile0) << tile_shift;
    unsigned long long len = p.len - off;
    if (len > (1ull << tile_shift)) len = 1ull << tile_shift;
    unsigned char *d = (unsigned char *)(p.dst + off);
    const unsigned char *s = (const unsigned char *)(p.src + off);
    unsigned long long x = p.dst ^ p.src;
    if ((x & 15) == 0)
      copy_span<uint4>(d, s, len);
    else if ((x & 7) == 0)
      copy_span<unsigned long long>(d, s, len);
    else if ((x & 3) == 0)
      copy_span<unsigned int>(d, s, len);
    else if ((x & 1) == 0)
      copy_span<unsigned short>(d, s, len);
    else
      copy_span<unsigned char>(d, s, len);
  }
}
