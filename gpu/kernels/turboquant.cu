// TurboQuant-3/-4 encode and decode, K and V, head dims 32..256 (powers of two).
// A vector of D elements is held by a group of G = D/8 lanes of one warp, lane l holding elements
// j = l + G*k (k = 0..7). With that layout the halving tree sums of the host reference start inside
// the lane (h = 4G, 2G, G) and end across lanes (h = G/2 .. 1), and the Walsh-Hadamard stages
// h = 1 .. G/2 run across lanes, h = G, 2G, 4G inside: exactly the host's order of float32 operations
// (no contraction: the module is built with -fmad=false; every explicit fma below rounds once an
// operation the host also rounds once, e.g. p + (-1 * v) == p - v).
// Work unit: 16384/D vectors (32 KiB of source), 8 per group.
// Each (head dim, bits, role, dtype) has its own instantiation: with G, the record layout and the
// conversions known at compile time the passes are straight-line code (measured on the H200 with ncu:
// the generic kernel spent most of its issue slots on loop control, runtime branches and spills).
#define TQ_C4 0                      // orbitkv_fs.gpu.tables.turboquant_tables(): centroids(4)
#define TQ_C3 16                     // centroids(3)
#define TQ_CELLS4 24                 // turboquant_cells(4): 128 x float4
#define TQ_CELLS3 (TQ_CELLS4 + 512)  // turboquant_cells(3)
#define TQ_TAB (TQ_CELLS3 + 512)

// The host's halving tree over the group's 8*G elements; the butterfly leaves the sum in every lane
// (IEEE addition is commutative, so lane l and lane l^h add the same two values).
template <int G>
__device__ __forceinline__ float okv_tree_sum8(const float* s) {
  const float a0 = __fadd_rn(s[0], s[4]), a1 = __fadd_rn(s[1], s[5]), a2 = __fadd_rn(s[2], s[6]),
              a3 = __fadd_rn(s[3], s[7]);
  float v = __fadd_rn(__fadd_rn(a0, a2), __fadd_rn(a1, a3));
#pragma unroll
  for (int off = G >> 1; off; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(OKV_FULL, v, off, G));
  return v;
}

template <int G>
__device__ __forceinline__ void okv_fwht8(float* v, int gl) {
#pragma unroll
  for (int h = 1; h < G; h <<= 1) {
    // lower lane: own + partner's; upper lane: partner's - own, one rounding each as the host's
    const float sgn = (gl & h) ? -1.0f : 1.0f;
#pragma unroll
    for (int k = 0; k < 8; ++k) v[k] = __fmaf_rn(v[k], sgn, __shfl_xor_sync(OKV_FULL, v[k], h, G));
  }
#pragma unroll
  for (int step = 1; step < 8; step <<= 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (k & step) continue;
      const float a = v[k], b = v[k + step];
      v[k] = __fadd_rn(a, b);
      v[k + step] = __fsub_rn(a, b);
    }
  }
}

// Division by one divisor per vector: div.rn's own fast path (reciprocal refined once, quotient corrected
// once) with the reciprocal computed once instead of per element. It is exact while divisor, dividends,
// quotients and remainders stay far from overflow and underflow; okv_tq_fast_ok checks that on the raw
// inputs of a pass, and a pass that fails it divides with __fdiv_rn.
__device__ __forceinline__ float okv_rcp_refined(float b) {
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(b));
  return __fmaf_rn(r, __fmaf_rn(-b, r, 1.0f), r);
}
__device__ __forceinline__ float okv_div_by(float a, float b, float r) {
  const float q = __fmaf_rn(a, r, 0.0f);
  return __fmaf_rn(r, __fmaf_rn(-b, q, a), q);
}
// FP16 inputs always qualify (nonzero magnitudes 2^-24..65504). BF16 inputs qualify when every nonzero
// magnitude lies in [2^-60, 2^30): then K's norm is in [2^-60, 2^35), a rotated element is 0 or at least
// 2^-67 (a sum of multiples of the smallest input's ulp), so quotients and remainders stay normal; V's
// divisor is an FP16 scale (2^-24..65504) and its dividends are 0 or differences of at least 2^-67.
// (A zero dividend gives +0 where div.rn gives -0 for -0: both uses only compare the quotient with
// boundaries or round it to an integer, where the two zeros are the same.)
template <bool F16>
__device__ __forceinline__ bool okv_tq_fast_ok(const u32* two) {
  if (F16) return true;
  u32 m[4], z[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    m[i] = two[i] & 0x7FFF7FFFu;
    z[i] = __vsub2(m[i], 0x00010001u);  // a zero half wraps to 0xFFFF and drops out of the minimum
  }
  const u32 mx = __vmaxu2(__vmaxu2(m[0], m[1]), __vmaxu2(m[2], m[3]));
  const u32 mn = __vminu2(__vminu2(z[0], z[1]), __vminu2(z[2], z[3]));
  const u32 top = __vmaxu2(mx, mx >> 16) & 0xFFFFu, bottom = __vminu2(mn, mn >> 16) & 0xFFFFu;
  return top < (157u << 7) && bottom >= (67u << 7) - 1u;
}

template <bool F16>
__device__ __forceinline__ float okv_half_to_f32(u32 h) {
  return F16 ? okv_f16_to_f32(h) : __uint_as_float(h << 16);
}
template <bool F16>
__device__ __forceinline__ u32 okv_f32_to_half(float f) {
#if __CUDA_ARCH__ >= 800
  if (!F16) {  // the conversion instruction rounds to nearest even, as okv_f32_to_bf16
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
  }
#endif
  return F16 ? okv_f32_to_f16(f) : okv_f32_to_bf16(f);
}

__device__ __forceinline__ bool okv_f16_finite(u32 h) { return (h & 0x7C00u) != 0x7C00u; }

__device__ __forceinline__ void okv_tq_setup(float* sq, const float* tq) {
  for (int i = threadIdx.x; i < TQ_TAB; i += blockDim.x) sq[i] = tq[i];
}

// The host's bucketize (the count of boundaries below q) and that bucket's centroid, by the cell table
// (tables.turboquant_cells): one shared-memory load. A NaN q (a rejected segment) lands in cell 0 or 127.
__device__ __forceinline__ u32 okv_bucket(float q, const float4* cells, float& c) {
  const float x = fminf(fmaxf(__fmaf_rn(q, 16.0f, 63.5f), 0.0f), 127.0f);
  const float4 e = cells[__float_as_uint(__fadd_rn(x, 8388608.0f)) - 0x4B000000u];  // + 2^23: round(x)
  const bool up = q > e.x;
  c = up ? e.w : e.z;
  return __float_as_uint(e.y) + (up ? 1u : 0u);
}

// Passes (of NGRP vectors, at most 8) of a unit whose first vector is v0, in a segment of nv vectors.
template <int NGRP>
__device__ __forceinline__ int okv_tq_passes(u64 nv, u64 v0) {
  return v0 >= nv ? 0 : (int)min((nv - v0 + NGRP - 1) / NGRP, (u64)8);
}

// Pack 8 codes (one per byte of lo, hi, LSB first) into BITS * 8 bits, LSB first.
template <int BITS>
__device__ __forceinline__ u32 okv_pack_codes(u32 lo, u32 hi) {
  if (BITS == 4) {  // byte i of x | x >> 4 holds codes i and i+1; keep bytes 0 and 2
    return __byte_perm(lo | (lo >> 4), hi | (hi >> 4), 0x6420);
  }
  u32 word = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) word |= (((i < 4 ? lo : hi) >> (8 * (i & 3))) & 0xFFu) << (BITS * i);
  return word;
}

// One work unit of the encode: 8 passes of NGRP vectors. Answers the status bits it found.
template <int D, int BITS, bool KEY, bool F16>
__device__ __forceinline__ u32 okv_tq_encode_unit(const Seg& s, u32 unit, const float* sq, u8* codes) {
  constexpr int G = D / 8, NGRP = OKV_THREADS / G, SIDE = KEY ? 2 : 4;
  constexpr u32 REC = SIDE + D * BITS / 8;
  constexpr float LEVELS = (float)((1 << BITS) - 1);
  const int gl = threadIdx.x & (G - 1), grp = threadIdx.x / G;
  const u64 v0 = (u64)unit * (u64)(8 * NGRP) + (u64)grp;
  const int npass = okv_tq_passes<NGRP>(s.n / (u64)(2 * D), v0);  // passes whose vector exists
  const u16* xp = reinterpret_cast<const u16*>(s.src) + v0 * D + gl;
  u8* rp = reinterpret_cast<u8*>(s.dst) + v0 * REC;
  const float4* const cells = reinterpret_cast<const float4*>(sq + (BITS == 4 ? TQ_CELLS4 : TQ_CELLS3));
  u32 negs[4];  // K: the rotation's sign bits of elements gl + G*k, k+1, at bits 15 and 31 of pair k/2
#pragma unroll
  for (int k = 0; k < 8; k += 2) {
    const int j = gl + G * k, j1 = j + G;
    negs[k >> 1] = KEY ? ((((s.signs[j >> 5] >> (j & 31)) & 1u) << 15) | (((s.signs[j1 >> 5] >> (j1 & 31)) & 1u) << 31)) : 0u;
  }
  u32 flags = 0, mag = 0;  // mag: the largest |x| bit patterns, two halves at a time
  // the next pass's elements are loaded while this pass computes (two halves per register)
  u32 nxt[4];
  auto load = [&](bool live) {
#pragma unroll
    for (int k = 0; k < 8; k += 2)
      nxt[k >> 1] = live ? (u32)__ldg(xp + G * k) | ((u32)__ldg(xp + G * (k + 1)) << 16) : 0u;
    xp += NGRP * D;
  };
  load(0 < npass);
#pragma unroll 1
  for (int p = 0; p < 8; ++p, rp += NGRP * REC) {
    const bool live = p < npass;
    const bool fast = !__any_sync(OKV_FULL, !okv_tq_fast_ok<F16>(nxt));
    float w[8];
    u32 idx[8];
    u32 side;
#pragma unroll
    for (int k = 0; k < 8; k += 2) {  // K: the rotation's signs flipped in the source halves
      const u32 two = nxt[k >> 1] ^ negs[k >> 1];
      mag = __vmaxu2(mag, two & 0x7FFF7FFFu);
      w[k] = okv_half_to_f32<F16>(two & 0xFFFFu);
      w[k + 1] = okv_half_to_f32<F16>(two >> 16);
    }
    if (p + 1 < 8) load(p + 1 < npass);
    if (KEY) {
      float t[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) t[k] = __fmul_rn(w[k], w[k]);  // (-x)^2 == x^2: the signs cannot change the norm
      const float norm = __fsqrt_rn(okv_tree_sum8<G>(t));
      okv_fwht8<G>(w, gl);
      float q[8];
      if (norm > 0.0f && fast) {
        const float r = okv_rcp_refined(norm);
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = okv_div_by(w[k], norm, r);
      } else if (norm > 0.0f) {
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = __fdiv_rn(w[k], norm);
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = 0.0f;
      }
      float qc[8], cc[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        float c;
        idx[k] = okv_bucket(q[k], cells, c);
        qc[k] = __fmul_rn(q[k], c);
        cc[k] = __fmul_rn(c, c);
      }
      const float sqc = okv_tree_sum8<G>(qc), scc = okv_tree_sum8<G>(cc);
      const float den = __fsqrt_rn(__fmul_rn(scc, (float)D));
      const u32 g16 = okv_f32_to_f16(__fdiv_rn(__fmul_rn(norm, sqc), den));
      if (!okv_f16_finite(g16)) flags |= OKV_ST_RANGE;
      side = g16;
    } else {
      float lo = w[0], hi = w[0];
#pragma unroll
      for (int k = 1; k < 8; ++k) { lo = fminf(lo, w[k]); hi = fmaxf(hi, w[k]); }
#pragma unroll
      for (int off = G >> 1; off; off >>= 1) {
        lo = fminf(lo, __shfl_xor_sync(OKV_FULL, lo, off, G));
        hi = fmaxf(hi, __shfl_xor_sync(OKV_FULL, hi, off, G));
      }
      const u32 lo16 = okv_f32_to_f16(lo), sc16 = okv_f32_to_f16(__fdiv_rn(__fsub_rn(hi, lo), LEVELS));
      if (!okv_f16_finite(lo16) || !okv_f16_finite(sc16)) flags |= OKV_ST_RANGE;
      const float lo32 = okv_f16_to_f32(lo16), sc32 = okv_f16_to_f32(sc16);
      float q[8];
      if (sc32 > 0.0f && fast) {
        const float r = okv_rcp_refined(sc32);
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = rintf(okv_div_by(__fsub_rn(w[k], lo32), sc32, r));
      } else if (sc32 > 0.0f) {
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = rintf(__fdiv_rn(__fsub_rn(w[k], lo32), sc32));
      } else {
#pragma unroll
        for (int k = 0; k < 8; ++k) q[k] = 0.0f;
      }
#pragma unroll
      for (int k = 0; k < 8; ++k) idx[k] = (u32)fminf(fmaxf(q[k], 0.0f), LEVELS);
      side = lo16 | (sc16 << 16);
    }
    // Regroup the codes so that each lane packs 8 consecutive ones (LSB first, BITS bytes).
    u8* const cg = codes + grp * D;
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 8; ++k) cg[gl + G * k] = (u8)idx[k];
    __syncwarp();
    const uint2 cv = *reinterpret_cast<const uint2*>(cg + 8 * gl);
    const u32 word = okv_pack_codes<BITS>(cv.x, cv.y);
    if (live) {
      u8* const cp = rp + SIDE + gl * BITS;
      // records are 2-byte (K) or 4-byte (V) aligned in a 64-byte aligned payload
      if (KEY) {
        if (gl == 0) *reinterpret_cast<u16*>(rp) = (u16)side;
      } else {
        if (gl == 0) *reinterpret_cast<u32*>(rp) = side;
      }
      if (BITS == 4 && !KEY) {
        *reinterpret_cast<u32*>(cp) = word;
      } else if (BITS == 4) {
        reinterpret_cast<u16*>(cp)[0] = (u16)word;
        reinterpret_cast<u16*>(cp)[1] = (u16)(word >> 16);
      } else {
#pragma unroll
        for (int i = 0; i < 3; ++i) cp[i] = (u8)(word >> (8 * i));
      }
    }
  }
  const u32 top = __vmaxu2(mag, mag >> 16) & 0xFFFFu;
  if (top >= (F16 ? 0x7C00u : 0x7F80u)) flags |= OKV_ST_NONFINITE;
  return flags;
}

// One work unit of the decode (8 passes of NGRP vectors).
template <int D, int BITS, bool KEY, bool F16>
__device__ __forceinline__ void okv_tq_decode_unit(const Seg& s, u32 unit, const float* sq, u8* codes) {
  constexpr int G = D / 8, NGRP = OKV_THREADS / G, SIDE = KEY ? 2 : 4;
  constexpr u32 REC = SIDE + D * BITS / 8;
  constexpr u32 MASK = (1u << BITS) - 1u;
  const int gl = threadIdx.x & (G - 1), grp = threadIdx.x / G;
  const u64 v0 = (u64)unit * (u64)(8 * NGRP) + (u64)grp;
  const int npass = okv_tq_passes<NGRP>(s.n / (u64)(2 * D), v0);
  const u8* rp = reinterpret_cast<const u8*>(s.src) + v0 * REC;
  u16* yp = reinterpret_cast<u16*>(s.dst) + v0 * D + gl;
  const float* const C = sq + (BITS == 4 ? TQ_C4 : TQ_C3);
  u32 negs = 0;
#pragma unroll
  for (int k = 0; k < 8; ++k) {
    const int j = gl + G * k;
    negs |= ((s.signs[j >> 5] >> (j & 31)) & 1u) << k;
  }
#pragma unroll 1
  for (int p = 0; p < 8; ++p, rp += NGRP * REC, yp += NGRP * D) {
    const bool live = p < npass;
    u32 word = 0, side = 0;
    if (live) {
      const u8* const cp = rp + SIDE + gl * BITS;
      if (KEY) {
        side = *reinterpret_cast<const u16*>(rp);
      } else {
        side = *reinterpret_cast<const u32*>(rp);
      }
      if (BITS == 4 && !KEY) {
        word = *reinterpret_cast<const u32*>(cp);
      } else if (BITS == 4) {
        word = (u32)reinterpret_cast<const u16*>(cp)[0] | ((u32)reinterpret_cast<const u16*>(cp)[1] << 16);
      } else {
        word = (u32)cp[0] | ((u32)cp[1] << 8) | ((u32)cp[2] << 16);
      }
    }
    u8* const cg = codes + grp * D;
    __syncwarp();
    uint2 cv;
    cv.x = cv.y = 0;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const u32 c = (word >> (BITS * i)) & MASK;
      if (i < 4) cv.x |= c << (8 * i); else cv.y |= c << (8 * (i - 4));
    }
    *reinterpret_cast<uint2*>(cg + 8 * gl) = cv;
    __syncwarp();
    float out[8];
    if (KEY) {
      float c[8], cc[8];
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        c[k] = C[cg[gl + G * k]];
        cc[k] = __fmul_rn(c[k], c[k]);
      }
      const float scc = okv_tree_sum8<G>(cc);
      const float scale = __fdiv_rn(okv_f16_to_f32(side & 0xFFFFu), __fsqrt_rn(__fmul_rn(scc, (float)D)));
      okv_fwht8<G>(c, gl);
#pragma unroll
      for (int k = 0; k < 8; ++k)
        out[k] = __uint_as_float(__float_as_uint(__fmul_rn(c[k], scale)) ^ (((negs >> k) & 1u) << 31));
    } else {
      const float lo32 = okv_f16_to_f32(side & 0xFFFFu), sc32 = okv_f16_to_f32(side >> 16);
#pragma unroll
      for (int k = 0; k < 8; ++k) out[k] = __fadd_rn(lo32, __fmul_rn((float)cg[gl + G * k], sc32));
    }
    if (live) {
#pragma unroll
      for (int k = 0; k < 8; ++k) yp[G * k] = (u16)okv_f32_to_half<F16>(out[k]);
    }
  }
}

// The segment's instantiation: head_dim 32..256, bits 3|4, role 1 (K) | 2 (V), dtype 0 (BF16) | 1 (FP16).
#define OKV_TQ_DISPATCH(CALL)                                                      \
  {                                                                                \
    const bool key = s.role == 1, f16 = s.dtype != 0, four = s.bits == 4;          \
    switch (s.head_dim) {                                                          \
      case 32: OKV_TQ_DISPATCH_D(CALL, 32) break;                                  \
      case 64: OKV_TQ_DISPATCH_D(CALL, 64) break;                                  \
      case 128: OKV_TQ_DISPATCH_D(CALL, 128) break;                                \
      default: OKV_TQ_DISPATCH_D(CALL, 256) break;                                 \
    }                                                                              \
  }
#define OKV_TQ_DISPATCH_D(CALL, D)                                                 \
  if (four) { OKV_TQ_DISPATCH_B(CALL, D, 4) } else { OKV_TQ_DISPATCH_B(CALL, D, 3) }
#define OKV_TQ_DISPATCH_B(CALL, D, B)                                              \
  if (key) {                                                                       \
    if (f16) CALL(D, B, true, true) else CALL(D, B, true, false)                   \
  } else {                                                                         \
    if (f16) CALL(D, B, false, true) else CALL(D, B, false, false)                 \
  }

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 4)
okv_tq_encode(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
              const float* __restrict__ tq) {
  __shared__ __align__(16) float sq[TQ_TAB];
  __shared__ __align__(8) u8 codes[OKV_THREADS * 8];
  okv_tq_setup(sq, tq);
  __syncthreads();
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    const u32 unit = g - s.block0;
    u32 flags = 0;
#define OKV_TQ_ENC(D, B, K, F) flags = okv_tq_encode_unit<D, B, K, F>(s, unit, sq, codes);
    OKV_TQ_DISPATCH(OKV_TQ_ENC)
#undef OKV_TQ_ENC
    if (flags) atomicOr(&meta[s.meta].status, flags);
  }
}

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 4)
okv_tq_decode(const Seg* __restrict__ segs, int nsegs, u32 total, const Meta* __restrict__ meta,
              const float* __restrict__ tq) {
  __shared__ __align__(16) float sq[TQ_TAB];
  __shared__ __align__(8) u8 codes[OKV_THREADS * 8];
  okv_tq_setup(sq, tq);
  __syncthreads();
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    if (meta[s.meta].acc != s.expect_crc) continue;
    const u32 unit = g - s.block0;
#define OKV_TQ_DEC(D, B, K, F) okv_tq_decode_unit<D, B, K, F>(s, unit, sq, codes);
    OKV_TQ_DISPATCH(OKV_TQ_DEC)
#undef OKV_TQ_DEC
  }
}
