// Packing of nvCOMP ANS outputs into the chunked ANS payload (docs/format-ans.md):
//   u32 chunk_bytes | u32 nchunks | u32 sizes[nchunks] | zeros to 8 | chunk 0 | zeros to 8 | chunk 1 ...
// nvCOMP compressed chunk j of segment s into src + j * OKV_ANS_CAP (one buffer per chunk, sized for
// the worst case); one block per chunk moves it to its packed offset (the sum of the earlier chunks'
// 8-byte aligned sizes) in the payload slot, zero padding included, and block 0 writes the table and
// the payload length (and the CRC32C, below). Nothing is written past the slot's capacity (Seg.bits: capacity in bytes): a
// payload that would not fit -- one that would not save enough to be kept anyway -- is flagged.
#define OKV_ANS_CHUNK 65536u
#define OKV_ST_ANS_FAILED 4u // nvCOMP reported an error for a chunk
#define OKV_ST_ANS_LARGE 8u  // the packed payload exceeds the slot's capacity

__device__ __forceinline__ u64 okv_al8(u64 v) { return (v + 7) & ~7ull; }

// Seg fields: src = first chunk buffer, dst = payload slot, n = source bytes, n_dev = u64 sizes of the
// segment's chunks (from nvCOMP), st_dev = int statuses of its chunks, expect_crc = chunk buffer stride,
// bits = slot capacity, signs[0..1] = address of the u64 that receives the payload length.
// The payload's CRC32C is fused: each block folds the words it writes with the braided CRC
// (common.cuh) in units of up to CHUNK bytes at their payload offsets, shifted to the payload's end,
// into Meta.acc -- the raw CRC of the whole payload, as okv_crc32c over it would give, without
// reading the payload again.
__device__ __forceinline__ u32 okv_ans_table_word(u32 wi, u32 nch, const u64* sizes, bool hi) {
  if (wi == 0) return hi ? nch : OKV_ANS_CHUNK;
  const u32 i = 2 * wi - 2 + (hi ? 1u : 0u);
  return i < nch ? (u32)sizes[i] : 0u;
}

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 6)
okv_ans_pack(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
             const u32* __restrict__ tables) {
  __shared__ __align__(1024) u32 sm[OKV_BRAID_SMEM_WORDS];  // tables placed by okv_load_braid
  __shared__ u32 red[2 * OKV_THREADS / 32];
  __shared__ u64 pre[OKV_THREADS / 32], pre2[OKV_THREADS / 32];
  __shared__ int bad_sh;
  const OkvBraid tb = okv_load_braid(sm, tables);
  const u32 aB = tb.aB, aL = tb.aL, aW = tb.aW;
  __syncthreads();
  u32 par = 0;
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    const u32 j = g - s.block0;
    const u32 nch = (u32)((s.n + OKV_ANS_CHUNK - 1) / OKV_ANS_CHUNK);
    const u64* sizes = reinterpret_cast<const u64*>(s.n_dev);
    const int* st = reinterpret_cast<const int*>(s.st_dev);
    const u64 start = okv_al8(8 + 4ull * nch);
    const u64 cap = s.bits;
    // offset of chunk j (sum over i < j) and, for block 0, the total; any failed chunk
    u64 part = 0, all = 0;
    int bad = 0;
    for (u32 i = threadIdx.x; i < nch; i += OKV_THREADS) {
      u64 a = okv_al8(sizes[i]);
      if (i < j) part += a;
      all += a;
      if (st[i] != 0 || sizes[i] == 0 || sizes[i] > s.expect_crc) bad = 1;
    }
    __syncthreads();  // the previous chunk's pre/pre2/bad_sh have been read
    if (threadIdx.x == 0) bad_sh = 0;
    __syncthreads();
    if (bad) bad_sh = 1;
    for (int o = 16; o; o >>= 1) {
      part += __shfl_xor_sync(OKV_FULL, part, o);
      all += __shfl_xor_sync(OKV_FULL, all, o);
    }
    if ((threadIdx.x & 31) == 0) { pre[threadIdx.x >> 5] = part; pre2[threadIdx.x >> 5] = all; }
    __syncthreads();
    u64 off = start, len = start;
    for (int i = 0; i < OKV_THREADS / 32; ++i) { off += pre[i]; len += pre2[i]; }
    const bool failed = bad_sh != 0;
    u64* plen = reinterpret_cast<u64*>((static_cast<u64>(s.signs[1]) << 32) | s.signs[0]);
    if (failed || len > cap) {
      if (threadIdx.x == 0 && j == 0) {
        atomicOr(&meta[s.meta].status, failed ? OKV_ST_ANS_FAILED : OKV_ST_ANS_LARGE);
        *plen = 0;
      }
      continue;
    }
    u8* out = reinterpret_cast<u8*>(s.dst);
    Meta* mt = &meta[s.meta];
    if (j == 0) {  // the chunk table: u32 chunk_bytes, u32 nchunks, u32 sizes[nch], zeros to 8
      if (threadIdx.x == 0) {
        *plen = len;
        mt->pad[0] = (u32)(s.dst - 64 - reinterpret_cast<u64>(meta));  // its header's slot, for okv_write_headers
      }
      for (u64 us = 0; us < start; us += OKV_CHUNK) {
        const u32 m = (u32)min((u64)OKV_CHUNK, start - us);
        const u32 mult = threadIdx.x == 0 ? okv_unit_mult(us, len, tables) : OKV_X0;
        u32 d = 0;
#pragma unroll 2
        for (int k = 0; k < 8; ++k) {
          const u32 o = 8u * (threadIdx.x + OKV_THREADS * k);
          uint2 v = make_uint2(0u, 0u);
          if (o < m) {
            const u32 wi = (u32)((us + o) >> 3);
            v = make_uint2(okv_ans_table_word(wi, nch, sizes, false), okv_ans_table_word(wi, nch, sizes, true));
            *reinterpret_cast<uint2*>(out + us + o) = v;
          }
          d = okv_crc8(d, v.x, v.y, aB);
        }
        okv_crc_braid_unit(d, mult, mt, aL, aW, red + par);
        par ^= OKV_THREADS / 32;
      }
    }
    // chunk j: 8-byte words, the last one zero-padded, at payload offset off
    const u64 size = sizes[j];
    const u64 L = okv_al8(size);
    const u64* src = reinterpret_cast<const u64*>(s.src + (u64)j * s.expect_crc);
    u64* dst = reinterpret_cast<u64*>(out + off);
    for (u64 us = 0; us < L; us += OKV_CHUNK) {
      const u32 m = (u32)min((u64)OKV_CHUNK, L - us);
      const u32 mult = threadIdx.x == 0 ? okv_unit_mult(off + us, len, tables) : OKV_X0;
      u64 w[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const u32 o = 8u * (threadIdx.x + OKV_THREADS * k);
        w[k] = o < m ? src[(us + o) >> 3] : 0ull;
      }
      u32 d = 0;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        const u32 o = 8u * (threadIdx.x + OKV_THREADS * k);
        if (o < m) {
          const u64 valid = size - (us + o);
          if (valid < 8) w[k] &= (1ull << (8 * valid)) - 1;
          dst[(us + o) >> 3] = w[k];
        }
        d = okv_crc8(d, (u32)w[k], (u32)(w[k] >> 32), aB);
      }
      okv_crc_braid_unit(d, mult, mt, aL, aW, red + par);
      par ^= OKV_THREADS / 32;
    }
  }
}

// Packed ANS slots: one block, launched before okv_ans_pack over the same rows (segs, nsegs, in order).
// Each segment's payload length as okv_ans_pack computes it -- zero when a chunk failed or the payload
// exceeds the slot capacity (it is stored raw and takes no room here) -- and its slot: the earlier slots,
// each header and payload rounded up to align, one after another from ans0 (the device address of the
// batch's first ANS slot) plus *carry, the bytes the batch's earlier rounds placed (zero before the first;
// updated here for the next). Writes Seg.dst (the payload, after the 64-byte header) for okv_ans_pack. The
// host computes the same slots from the payload lengths it downloads, so only the packed bytes cross
// PCIe instead of every slot's worst case.
extern "C" __global__ void __launch_bounds__(OKV_THREADS)
okv_ans_place(Seg* __restrict__ segs, int nsegs, u64 ans0, u64 align, u64* __restrict__ carry) {
  __shared__ u64 warp_sums[OKV_THREADS / 32];
  __shared__ u64 carry_sh;
  if (threadIdx.x == 0) carry_sh = *carry;
  __syncthreads();
  const u32 lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  for (int t0 = 0; t0 < nsegs; t0 += OKV_THREADS) {
    const int i = t0 + (int)threadIdx.x;
    u64 step = 0;
    if (i < nsegs) {
      const Seg& s = segs[i];
      const u32 nch = (u32)((s.n + OKV_ANS_CHUNK - 1) / OKV_ANS_CHUNK);
      const u64* sizes = reinterpret_cast<const u64*>(s.n_dev);
      const int* st = reinterpret_cast<const int*>(s.st_dev);
      u64 len = okv_al8(8 + 4ull * nch);
      bool bad = false;
      for (u32 c = 0; c < nch; ++c) {
        const u64 z = sizes[c];
        if (st[c] != 0 || z == 0 || z > s.expect_crc) bad = true;
        len += okv_al8(z);
      }
      if (!bad && len <= s.bits) step = (64 + len + align - 1) / align * align;
    }
    u64 x = step;  // inclusive scan within the warp, then over the warps' sums
    for (u32 o = 1; o < 32; o <<= 1) {
      const u64 y = __shfl_up_sync(OKV_FULL, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    u64 before = carry_sh;
    for (u32 w = 0; w < warp; ++w) before += warp_sums[w];
    const u64 excl = before + x - step;
    if (i < nsegs) segs[i].dst = ans0 + excl + 64;
    __syncthreads();  // every thread has read carry_sh and warp_sums
    if (threadIdx.x == OKV_THREADS - 1) carry_sh = excl + step;
    __syncthreads();
  }
  if (threadIdx.x == 0) *carry = carry_sh;
}
