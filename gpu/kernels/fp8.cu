// FP8 E4M3FN encode (with range check and the payload's CRC32C fused) and decode.
// Encode work unit: 16 KiB of output = 16384 source elements. Thread t converts 8 elements per step
// (16-byte loads, coalesced across the block), stores the 8 codes to the payload and folds them, still
// in registers, into the braided CRC (common.cuh): the source is read once, the codes never re-read. Range rejection is per segment
// (OKV_ST_RANGE / OKV_ST_NONFINITE); the codes of a rejected segment are never used.
// Conversion: Hopper (sm_89+) has cvt.rn.satfinite.e4m3x2.{f32,f16x2}; elsewhere, or with
// OKV_FP8_ARITH, the same round-to-nearest-even result comes from integer/float arithmetic.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890 && !defined(OKV_FP8_ARITH)
#define OKV_FP8_HW 1
#endif

__device__ __forceinline__ u32 okv_e4m3_arith(float x) {
  u32 sign = (__float_as_uint(x) >> 24) & 0x80u;
  float a = fabsf(x);
  int e = (int)((__float_as_uint(a) >> 23) & 0xFF) - 127;
  e = max(e, -6);
  float scaled = __fmul_rn(a, __uint_as_float((u32)(127 + 3 - e) << 23));
  u32 r = (u32)__float2int_rn(scaled);
  return sign | (u32)(((e + 6) << 3) + (int)r);
}

// Two source elements (packed u16 pair, element 0 in the low half) -> two codes (low byte element 0).
__device__ __forceinline__ u32 okv_e4m3x2(u32 pair, u32 dtype) {
#ifdef OKV_FP8_HW
  unsigned short r;
  if (dtype) {
    asm("cvt.rn.satfinite.e4m3x2.f16x2 %0, %1;" : "=h"(r) : "r"(pair));
  } else {
    float lo = __uint_as_float(pair << 16), hi = __uint_as_float(pair & 0xFFFF0000u);
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  }
  return r;
#else
  float lo = okv_src_to_f32(pair & 0xFFFFu, dtype), hi = okv_src_to_f32(pair >> 16, dtype);
  return okv_e4m3_arith(lo) | (okv_e4m3_arith(hi) << 8);
#endif
}

// The status of a unit from the largest magnitude bit pattern of its elements (a NaN or infinity has the
// largest patterns, so "non-finite" wins over "out of range", as the host's check).
__device__ __forceinline__ u32 okv_fp8_flags(u32 mag2, u32 dtype) {
  const u32 mag = __vmaxu2(mag2, mag2 >> 16) & 0xFFFFu;
  const u32 inf = dtype ? 0x7C00u : 0x7F80u, max = dtype ? 0x5F00u : 0x43E0u;  // 448
  return (mag >= inf) ? OKV_ST_NONFINITE : (mag > max ? OKV_ST_RANGE : 0u);
}

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 6)
okv_fp8_encode(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
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
    const u64 n_out = s.n >> 1;  // one code per 2-byte element
    const u64 e0 = (u64)b * OKV_CHUNK;
    const u32 m = (u32)min((u64)OKV_CHUNK, n_out - e0);  // elements (= output bytes) of this unit
    const u32 dtype = s.dtype;
    const u16* src = reinterpret_cast<const u16*>(s.src) + e0;
    u8* dst = reinterpret_cast<u8*>(s.dst) + e0;
    const u32 mult = threadIdx.x == 0 ? okv_unit_mult(e0, n_out, tables) : OKV_X0;
    const bool vec = (reinterpret_cast<u64>(src) & 15) == 0;
    u32 mag2 = 0, d = 0;  // mag2: the largest |element| bit patterns, two halves at a time
    // Step k: this thread's 8 codes are output word t + 256 k of the unit -- the braided CRC folds them
    // from registers as they are made (words past the unit's end are zeros).
#pragma unroll 2
    for (int k = 0; k < OKV_CHUNK / (8 * OKV_THREADS); ++k) {
      const u32 off = 8u * (threadIdx.x + OKV_THREADS * k);  // element (= output byte) offset in the unit
      u32 lo = 0, hi = 0;
      if (off < m) {
        const u32 cnt = min(8u, m - off);
        u32 w[4];
        if (vec && cnt == 8) {
          const uint4 v = __ldg(reinterpret_cast<const uint4*>(src + off));
          w[0] = v.x; w[1] = v.y; w[2] = v.z; w[3] = v.w;
        } else {
#pragma unroll
          for (u32 i = 0; i < 4; ++i) {
            const u32 a = (2 * i < cnt) ? (u32)src[off + 2 * i] : 0u;
            const u32 c = (2 * i + 1 < cnt) ? (u32)src[off + 2 * i + 1] : 0u;
            w[i] = a | (c << 16);  // missing elements are +0: code 0, as the zero padding of the CRC word
          }
        }
        mag2 = __vmaxu2(mag2, __vmaxu2(w[0] & 0x7FFF7FFFu, w[1] & 0x7FFF7FFFu));
        mag2 = __vmaxu2(mag2, __vmaxu2(w[2] & 0x7FFF7FFFu, w[3] & 0x7FFF7FFFu));
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const u32 c = okv_e4m3x2(w[i], dtype);
          if (i < 2) lo |= c << (16 * i); else hi |= c << (16 * (i - 2));
        }
        okv_store_tail(dst, off, m, make_uint2(lo, hi));
      }
      d = okv_crc8(d, lo, hi, aB);
    }
    const u32 flags = okv_fp8_flags(mag2, dtype);
    if (flags) atomicOr(&meta[s.meta].status, flags);
    okv_crc_braid_unit(d, mult, &meta[s.meta], aL, aW, red + par);
  }
}

// Decode: unit = 16 KiB of codes -> 16384 elements. Segments whose payload CRC (computed by
// okv_crc32c earlier in the stream) differs from the header's are skipped: nothing is written.
__device__ __forceinline__ u32 okv_fp8_to_src(u32 c, u32 dtype) {
  u32 sign = c & 0x80u, E = (c >> 3) & 15u, M = c & 7u;
  if ((c & 0x7Fu) == 0x7Fu) return dtype ? (0x7E00u | (sign << 8)) : (0x7FC0u | (sign << 8));
  float v = E ? __uint_as_float(((E + 120u) << 23) | (M << 20)) : __fmul_rn((float)M, 0.001953125f);
  u32 out = dtype ? okv_f32_to_f16(v) : (__float_as_uint(v) >> 16);  // exact: at most 4 significant bits
  return out | (sign << 8);
}

__device__ __forceinline__ u32 okv_fp8x2_to_src(u32 c2, u32 dtype) {
#ifdef OKV_FP8_HW
  u32 h2;
  unsigned short in = (unsigned short)c2;
  asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h2) : "h"(in));
  u32 r[2];
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    u32 c = (c2 >> (8 * i)) & 0xFFu, h = (h2 >> (16 * i)) & 0xFFFFu;
    if ((c & 0x7Fu) == 0x7Fu) r[i] = okv_fp8_to_src(c, dtype);
    else r[i] = dtype ? h : (__float_as_uint(okv_f16_to_f32(h)) >> 16);
  }
  return r[0] | (r[1] << 16);
#else
  return okv_fp8_to_src(c2 & 0xFFu, dtype) | (okv_fp8_to_src((c2 >> 8) & 0xFFu, dtype) << 16);
#endif
}

extern "C" __global__ void __launch_bounds__(OKV_THREADS)
okv_fp8_decode(const Seg* __restrict__ segs, int nsegs, u32 total, const Meta* __restrict__ meta) {
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    if (meta[s.meta].acc != s.expect_crc) continue;
    u32 b = g - s.block0;
    u64 n_el = s.n >> 1;
    u64 e0 = (u64)b * OKV_CHUNK;
    u32 m = (u32)min((u64)OKV_CHUNK, n_el - e0);
    const u8* src = reinterpret_cast<const u8*>(s.src) + e0;
    u16* dst = reinterpret_cast<u16*>(s.dst) + e0;
    bool vec = ((reinterpret_cast<u64>(src) & 7) == 0) && ((reinterpret_cast<u64>(dst) & 15) == 0);
    for (int k = 0; k < OKV_CHUNK / (8 * OKV_THREADS); ++k) {
      int off = k * 8 * OKV_THREADS + threadIdx.x * 8;
      if (off >= (int)m) continue;
      int cnt = min(8, (int)m - off);
      if (vec && cnt == 8) {
        uint2 c = __ldg(reinterpret_cast<const uint2*>(src + off));
        uint4 o;
        o.x = okv_fp8x2_to_src(c.x & 0xFFFFu, s.dtype);
        o.y = okv_fp8x2_to_src(c.x >> 16, s.dtype);
        o.z = okv_fp8x2_to_src(c.y & 0xFFFFu, s.dtype);
        o.w = okv_fp8x2_to_src(c.y >> 16, s.dtype);
        *reinterpret_cast<uint4*>(dst + off) = o;
      } else {
        for (int i = 0; i < cnt; ++i) dst[off + i] = (u16)okv_fp8_to_src(src[off + i], s.dtype);
      }
    }
  }
}
