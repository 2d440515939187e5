// CRC32C of many byte ranges in one launch, optionally copying each range to a 64-byte aligned
// destination on the way (raw segments: the copy lands in the batch's output slot).
// Work unit: 16 KiB of one range. The unit is staged through shared memory with coalesced loads
// (16-byte loads when the range's start is 16-byte aligned, byte loads otherwise), then thread t
// folds bytes [64t, 64t+64) with slicing-by-8 tables and okv_crc_unit combines the pieces.
extern "C" __global__ void __launch_bounds__(OKV_THREADS, 8)
okv_crc32c(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
           const u32* __restrict__ tables) {
  __shared__ __align__(1024) u32 sN[OKV_SLICE_WORDS];
  __shared__ __align__(1024) u32 sS[OKV_SHIFT_WORDS];
  __shared__ u32 red[OKV_THREADS / 32];
  __shared__ __align__(16) u8 buf[OKV_THREADS * OKV_ROW];
  okv_load_tables(sN, sS, tables);
  const u32 sT = okv_saddr(sN), sSa = okv_saddr(sS);
  __syncthreads();
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    __syncthreads();  // the previous unit's rows have been read
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    u32 b = g - s.block0;
    u64 n = s.n_dev ? *reinterpret_cast<const u64*>(s.n_dev) : s.n;
    u64 start = (u64)b * OKV_CHUNK;
    u32 m = start < n ? (u32)min((u64)OKV_CHUNK, n - start) : 0u;
    const u8* src = reinterpret_cast<const u8*>(s.src) + start;
    u8* dst = s.dst ? reinterpret_cast<u8*>(s.dst) + start : nullptr;
    if ((reinterpret_cast<u64>(src) & 15) == 0) {
      for (int k = 0; k < OKV_CHUNK / (16 * OKV_THREADS); ++k) {
        int off = k * 16 * OKV_THREADS + threadIdx.x * 16;
        if (off + 16 <= (int)m) {
          uint4 v = __ldg(reinterpret_cast<const uint4*>(src + off));
          *reinterpret_cast<uint4*>(buf + okv_pad(off)) = v;
          if (dst) *reinterpret_cast<uint4*>(dst + off) = v;
        } else if (off < (int)m) {
          for (int i = off; i < (int)m; ++i) {
            u8 c = src[i];
            buf[okv_pad(i)] = c;
            if (dst) dst[i] = c;
          }
        }
      }
    } else {
      for (int i = threadIdx.x; i < (int)m; i += OKV_THREADS) {
        u8 c = src[i];
        buf[okv_pad(i)] = c;
        if (dst) dst[i] = c;
      }
    }
    __syncthreads();
    int len = (int)m - (int)threadIdx.x * OKV_PIECE;
    u32 raw = 0;
    if (len > 0) raw = okv_crc_piece_smem(buf + threadIdx.x * OKV_ROW, min(len, OKV_PIECE), sT);
    okv_crc_unit(raw, m, start, n, &meta[s.meta], tables, sSa, red);
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
