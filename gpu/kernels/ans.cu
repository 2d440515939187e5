// Packing of nvCOMP ANS outputs into the chunked ANS payload (docs/format-ans.md):
//   u32 chunk_bytes | u32 nchunks | u32 sizes[nchunks] | zeros to 8 | chunk 0 | zeros to 8 | chunk 1 ...
// nvCOMP compressed chunk j of segment s into src + j * OKV_ANS_CAP (one buffer per chunk, sized for
// the worst case); one block per chunk moves it to its packed offset (the sum of the earlier chunks'
// 8-byte aligned sizes) in the payload slot, zero padding included, and block 0 writes the table and
// the payload length. Nothing is written past the slot's capacity (Seg.bits: capacity in bytes): a
// payload that would not fit -- one that would not save enough to be kept anyway -- is flagged.
#define OKV_ANS_CHUNK 65536u
#define OKV_ST_ANS_FAILED 4u // nvCOMP reported an error for a chunk
#define OKV_ST_ANS_LARGE 8u  // the packed payload exceeds the slot's capacity

__device__ __forceinline__ u64 okv_al8(u64 v) { return (v + 7) & ~7ull; }

// Seg fields: src = first chunk buffer, dst = payload slot, n = source bytes, n_dev = u64 sizes of the
// segment's chunks (from nvCOMP), st_dev = int statuses of its chunks, expect_crc = chunk buffer stride,
// bits = slot capacity, signs[0..1] = address of the u64 that receives the payload length.
extern "C" __global__ void __launch_bounds__(OKV_THREADS)
okv_ans_pack(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta) {
  __shared__ u64 red[OKV_THREADS / 32];
  __shared__ int bad_sh;
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
    if (threadIdx.x == 0) bad_sh = 0;
    __syncthreads();
    if (bad) bad_sh = 1;
    for (int o = 16; o; o >>= 1) {
      part += __shfl_xor_sync(OKV_FULL, part, o);
      all += __shfl_xor_sync(OKV_FULL, all, o);
    }
    __shared__ u64 red2[OKV_THREADS / 32];
    if ((threadIdx.x & 31) == 0) { red[threadIdx.x >> 5] = part; red2[threadIdx.x >> 5] = all; }
    __syncthreads();
    u64 off = start, len = start;
    for (int i = 0; i < OKV_THREADS / 32; ++i) { off += red[i]; len += red2[i]; }
    const bool failed = bad_sh != 0;
    __syncthreads();
    if (failed || len > cap) {
      if (threadIdx.x == 0 && j == 0) {
        atomicOr(&meta[s.meta].status, failed ? OKV_ST_ANS_FAILED : OKV_ST_ANS_LARGE);
        *reinterpret_cast<u64*>((static_cast<u64>(s.signs[1]) << 32) | s.signs[0]) = 0;
      }
      continue;
    }
    u8* out = reinterpret_cast<u8*>(s.dst);
    if (j == 0) {
      u32* tab = reinterpret_cast<u32*>(out);
      if (threadIdx.x == 0) {
        tab[0] = OKV_ANS_CHUNK;
        tab[1] = nch;
        *reinterpret_cast<u64*>((static_cast<u64>(s.signs[1]) << 32) | s.signs[0]) = len;
      }
      for (u32 i = threadIdx.x; i < nch; i += OKV_THREADS) tab[2 + i] = (u32)sizes[i];
      for (u64 b = 8 + 4ull * nch + threadIdx.x; b < start; b += OKV_THREADS) out[b] = 0;
    }
    // chunk j: 8-byte words, the last one zero-padded
    const u64 size = sizes[j];
    const u64 words = okv_al8(size) >> 3;
    const u64* src = reinterpret_cast<const u64*>(s.src + (u64)j * s.expect_crc);
    u64* dst = reinterpret_cast<u64*>(out + off);
    for (u64 w = threadIdx.x; w < words; w += OKV_THREADS) {
      u64 v = src[w];
      u64 valid = size - 8 * w;
      if (valid < 8) v &= (1ull << (8 * valid)) - 1;
      dst[w] = v;
    }
  }
}
