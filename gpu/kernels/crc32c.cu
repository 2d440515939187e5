// CRC32C of many byte ranges in one launch, optionally copying each range to a destination on the way
// (raw segments: the copy lands in the batch's output slot). Work unit: 16 KiB of one range; thread t
// reads the 8-byte words t + 256 k (k = 0..7) straight from global memory -- coalesced, no shared-memory
// staging -- copies them and folds them with the braided CRC (okv_crc_braid_unit). Ranges whose start is
// not 8-byte aligned, and the tail word of a range, are read bytewise.
extern "C" __global__ void __launch_bounds__(OKV_THREADS, 6)
okv_crc32c(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
           const u32* __restrict__ tables) {
  __shared__ __align__(1024) u32 sm[OKV_BRAID_SMEM_WORDS];  // tables placed by okv_load_braid
  __shared__ u32 red[2 * OKV_THREADS / 32];
  const OkvBraid tb = okv_load_braid(sm, tables);
  const u32 aB = tb.aB, aL = tb.aL, aW = tb.aW;
  __syncthreads();
  u32 par = 0;
  for (u32 g = blockIdx.x; g < total; g += gridDim.x, par ^= OKV_THREADS / 32) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    const u32 b = g - s.block0;
    const u64 n = s.n_dev ? *reinterpret_cast<const u64*>(s.n_dev) : s.n;
    const u64 start = (u64)b * OKV_CHUNK;
    // units past a device-side length (m == 0) read nothing and contribute nothing
    const u32 m = start < n ? (u32)min((u64)OKV_CHUNK, n - start) : 0u;
    const u8* src = reinterpret_cast<const u8*>(s.src) + start;
    u8* dst = s.dst ? reinterpret_cast<u8*>(s.dst) + start : nullptr;
    const bool al = (reinterpret_cast<u64>(src) & 7) == 0;
    const u32 mult = (threadIdx.x == 0 && m) ? okv_unit_mult(start, n, tables) : OKV_X0;
    const bool full = m == OKV_CHUNK;
    uint2 w[8];
    if (al && full) {  // the hot path: eight coalesced 8-byte loads in flight
#pragma unroll
      for (int k = 0; k < 8; ++k) w[k] = __ldg(reinterpret_cast<const uint2*>(src + 8u * (threadIdx.x + OKV_THREADS * k)));
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const u32 o = 8u * (threadIdx.x + OKV_THREADS * k);
        if (al && o + 8 <= m) w[k] = __ldg(reinterpret_cast<const uint2*>(src + o));
        else w[k] = o < m ? okv_load_tail(src, o, m) : make_uint2(0u, 0u);
      }
    }
    if (dst) {
      if ((reinterpret_cast<u64>(dst) & 7) == 0 && full) {
#pragma unroll
        for (int k = 0; k < 8; ++k) *reinterpret_cast<uint2*>(dst + 8u * (threadIdx.x + OKV_THREADS * k)) = w[k];
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) okv_store_tail(dst, 8u * (threadIdx.x + OKV_THREADS * k), m, w[k]);
      }
    }
    u32 d = 0;
#pragma unroll
    for (int k = 0; k < 8; ++k) d = okv_crc8(d, w[k].x, w[k].y, aB);
    okv_crc_braid_unit(d, mult, &meta[s.meta], aL, aW, red + par);
  }
}

// Copies verified payloads to their destinations: raw segments from the staging area, ANS segments
// from nvCOMP's output. A segment is copied only when its payload CRC32C matched the header
// (meta.acc, computed earlier in the stream) and, for ANS, nvCOMP reported success with exactly
// the expected length of every chunk (head_dim = chunk bytes; n_dev / st_dev: the chunks' lengths
// and statuses). Otherwise the destination is left untouched.
extern "C" __global__ void __launch_bounds__(OKV_THREADS)
okv_copy_checked(const Seg* __restrict__ segs, int nsegs, u32 total, const Meta* __restrict__ meta) {
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    if (meta[s.meta].acc != s.expect_crc) continue;
    // ANS (head_dim = chunk bytes): every chunk's nvCOMP status is 0 and its length exact
    int bad = 0;
    if (s.head_dim) {
      const u64 chunk = s.head_dim;
      const u64 nch = (s.n + chunk - 1) / chunk;
      const int* st = reinterpret_cast<const int*>(s.st_dev);
      const u64* got = reinterpret_cast<const u64*>(s.n_dev);
      for (u64 i = threadIdx.x; i < nch; i += OKV_THREADS)
        if (st[i] != 0 || got[i] != min(chunk, s.n - i * chunk)) bad = 1;
    }
    if (__syncthreads_or(bad)) continue;
    u64 start = (u64)(g - s.block0) * OKV_CHUNK;
    u32 m = (u32)min((u64)OKV_CHUNK, s.n - start);
    const u8* src = reinterpret_cast<const u8*>(s.src) + start;
    u8* dst = reinterpret_cast<u8*>(s.dst) + start;
    if (((reinterpret_cast<u64>(src) | reinterpret_cast<u64>(dst)) & 15) == 0) {
      for (u32 off = threadIdx.x * 16; off < m; off += OKV_THREADS * 16) {
        if (off + 16 <= m) *reinterpret_cast<uint4*>(dst + off) = __ldg(reinterpret_cast<const uint4*>(src + off));
        else for (u32 i = off; i < m; ++i) dst[i] = src[i];
      }
    } else {
      for (u32 i = threadIdx.x; i < m; i += OKV_THREADS) dst[i] = src[i];
    }
  }
}
