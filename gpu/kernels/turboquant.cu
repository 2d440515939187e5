// TurboQuant-3/-4 encode and decode, K and V, head dims 32..256 (powers of two).
// A vector of D elements is held by a group of G = D/8 lanes of one warp, lane l holding elements
// j = l + G*k (k = 0..7). With that layout the halving tree sums of the host reference start inside
// the lane (h = 4G, 2G, G) and end across lanes (h = G/2 .. 1), and the Walsh-Hadamard stages
// h = 1 .. G/2 run across lanes, h = G, 2G, 4G inside: exactly the host's order of float32 operations
// (no FMA: the module is built with -fmad=false and uses the _rn intrinsics).
// Work unit: 16384/D vectors (32 KiB of source), 8 per group.
#define TQ_C4 0
#define TQ_B4 16
#define TQ_C3 32
#define TQ_B3 40
#define TQ_TAB 48

__device__ __forceinline__ float okv_tree_sum8(const float* s, int G) {
  float a0 = __fadd_rn(s[0], s[4]), a1 = __fadd_rn(s[1], s[5]), a2 = __fadd_rn(s[2], s[6]), a3 = __fadd_rn(s[3], s[7]);
  float b0 = __fadd_rn(a0, a2), b1 = __fadd_rn(a1, a3);
  float v = __fadd_rn(b0, b1);
  for (int off = G >> 1; off; off >>= 1) v = __fadd_rn(v, __shfl_down_sync(OKV_FULL, v, off, G));
  return __shfl_sync(OKV_FULL, v, 0, G);
}

__device__ __forceinline__ void okv_fwht8(float* v, int G, int gl) {
  for (int h = 1; h < G; h <<= 1) {
    // lower lane: a + b = p + v; upper lane: a - b = p + (-v) (IEEE defines x - y as x + (-y))
    const u32 neg = (gl & h) ? 0x80000000u : 0u;
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      float p = __shfl_xor_sync(OKV_FULL, v[k], h, G);
      v[k] = __fadd_rn(p, __uint_as_float(__float_as_uint(v[k]) ^ neg));
    }
  }
#pragma unroll
  for (int step = 1; step < 8; step <<= 1) {
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      if (k & step) continue;
      float a = v[k], b = v[k + step];
      v[k] = __fadd_rn(a, b);
      v[k + step] = __fsub_rn(a, b);
    }
  }
}

__device__ __forceinline__ bool okv_finite(float x) { return (__float_as_uint(x) & 0x7F800000u) != 0x7F800000u; }
__device__ __forceinline__ bool okv_f16_finite(u32 h) { return (h & 0x7C00u) != 0x7C00u; }

__device__ __forceinline__ void okv_tq_setup(float* sq, const float* tq) {
  for (int i = threadIdx.x; i < TQ_TAB; i += blockDim.x) sq[i] = tq[i];
}

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 4)
okv_tq_encode(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
              const float* __restrict__ tq) {
  __shared__ float sq[TQ_TAB];
  __shared__ __align__(8) u8 codes[OKV_THREADS * 8];
  okv_tq_setup(sq, tq);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    // descriptor fields in registers: the byte stores below could otherwise force reloads
    const int D = (int)s.head_dim, G = D >> 3, bits = (int)s.bits;
    const u32 dtype = s.dtype;
    const u16* const src = reinterpret_cast<const u16*>(s.src);
    u8* const dst = reinterpret_cast<u8*>(s.dst);
    Meta* const mt = &meta[s.meta];
    const int gl = lane & (G - 1), grp = threadIdx.x / G, ngrp = OKV_THREADS / G;
    const bool key = s.role == 1;
    const int sidebytes = key ? 2 : 4;
    const u32 rec = (u32)sidebytes + (u32)(D * bits / 8);
    const u64 nv = s.n / (u64)(2 * D);
    const u64 v0 = (u64)(g - s.block0) * (u64)(8 * ngrp);
    const float* C = sq + (bits == 4 ? TQ_C4 : TQ_C3);
    const float* B = sq + (bits == 4 ? TQ_B4 : TQ_B3);
    const float levels = (float)((1 << bits) - 1);
    float sg[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      int j = gl + G * k;
      sg[k] = ((s.signs[j >> 5] >> (j & 31)) & 1u) ? -1.0f : 1.0f;
    }
    u32 flags = 0;
    // the next pass's elements are loaded while this pass computes (two u16 per register)
    u32 nxt[4];
    auto load = [&](int p) {
      const u64 v = v0 + (u64)p * ngrp + grp;
      const u16* x = src + v * D;
#pragma unroll
      for (int k = 0; k < 8; k += 2) {
        u32 a = 0, b = 0;
        if (v < nv) { a = x[gl + G * k]; b = x[gl + G * (k + 1)]; }
        nxt[k >> 1] = a | (b << 16);
      }
    };
    load(0);
    for (int p = 0; p < 8; ++p) {
      const u64 v = v0 + (u64)p * ngrp + grp;
      const bool live = v < nv;
      float w[8];
      u32 idx[8];
      u32 side;
#pragma unroll
      for (int k = 0; k < 8; ++k) {
        w[k] = okv_src_to_f32((nxt[k >> 1] >> (16 * (k & 1))) & 0xFFFFu, dtype);
        if (!okv_finite(w[k])) flags |= OKV_ST_NONFINITE;
      }
      if (p + 1 < 8) load(p + 1);
      if (key) {
        float t[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) t[k] = __fmul_rn(w[k], w[k]);
        const float norm = __fsqrt_rn(okv_tree_sum8(t, G));
#pragma unroll
        for (int k = 0; k < 8; ++k) w[k] = __fmul_rn(w[k], sg[k]);
        okv_fwht8(w, G, gl);
        float qc[8], cc[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float q = norm > 0.0f ? __fdiv_rn(w[k], norm) : 0.0f;
          u32 i = 0;
          if (bits == 4 && q > B[7]) i = 8;
          if (q > B[i + 3]) i += 4;
          if (q > B[i + 1]) i += 2;
          if (q > B[i]) i += 1;
          idx[k] = i;
          float c = C[i];
          qc[k] = __fmul_rn(q, c);
          cc[k] = __fmul_rn(c, c);
        }
        const float sqc = okv_tree_sum8(qc, G), scc = okv_tree_sum8(cc, G);
        const float den = __fsqrt_rn(__fmul_rn(scc, (float)D));
        const u32 g16 = okv_f32_to_f16(__fdiv_rn(__fmul_rn(norm, sqc), den));
        if (!okv_f16_finite(g16)) flags |= OKV_ST_RANGE;
        side = g16;
      } else {
        float lo = w[0], hi = w[0];
#pragma unroll
        for (int k = 1; k < 8; ++k) { lo = fminf(lo, w[k]); hi = fmaxf(hi, w[k]); }
        for (int off = G >> 1; off; off >>= 1) {
          lo = fminf(lo, __shfl_xor_sync(OKV_FULL, lo, off, G));
          hi = fmaxf(hi, __shfl_xor_sync(OKV_FULL, hi, off, G));
        }
        const u32 lo16 = okv_f32_to_f16(lo), sc16 = okv_f32_to_f16(__fdiv_rn(__fsub_rn(hi, lo), levels));
        if (!okv_f16_finite(lo16) || !okv_f16_finite(sc16)) flags |= OKV_ST_RANGE;
        const float lo32 = okv_f16_to_f32(lo16), sc32 = okv_f16_to_f32(sc16);
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          float t = sc32 > 0.0f ? rintf(__fdiv_rn(__fsub_rn(w[k], lo32), sc32)) : 0.0f;
          t = fminf(fmaxf(t, 0.0f), levels);
          idx[k] = (u32)t;
        }
        side = lo16 | (sc16 << 16);
      }
      // Regroup the codes so that each lane packs 8 consecutive ones (LSB first, `bits` bytes).
      u8* cg = codes + grp * D;
      __syncwarp();
#pragma unroll
      for (int k = 0; k < 8; ++k) cg[gl + G * k] = (u8)idx[k];
      __syncwarp();
      const uint2 cv = *reinterpret_cast<const uint2*>(cg + 8 * gl);
      u32 word = 0;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        u32 c = ((i < 4 ? cv.x : cv.y) >> (8 * (i & 3))) & 0xFFu;
        word |= c << (bits * i);
      }
      if (live) {
        u8* r = dst + v * rec;
        if (gl == 0)
          for (int i = 0; i < sidebytes; ++i) r[i] = (u8)(side >> (8 * i));
        u8* cp = r + sidebytes + gl * bits;
        for (int i = 0; i < bits; ++i) cp[i] = (u8)(word >> (8 * i));
      }
    }
    if (flags) atomicOr(&mt->status, flags);
  }
}

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 4)
okv_tq_decode(const Seg* __restrict__ segs, int nsegs, u32 total, const Meta* __restrict__ meta,
              const float* __restrict__ tq) {
  __shared__ float sq[TQ_TAB];
  __shared__ __align__(8) u8 codes[OKV_THREADS * 8];
  okv_tq_setup(sq, tq);
  __syncthreads();
  const int lane = threadIdx.x & 31;
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    if (meta[s.meta].acc != s.expect_crc) continue;
    const int D = (int)s.head_dim, G = D >> 3, bits = (int)s.bits;
    const int gl = lane & (G - 1), grp = threadIdx.x / G, ngrp = OKV_THREADS / G;
    const bool key = s.role == 1;
    const int sidebytes = key ? 2 : 4;
    const u32 rec = (u32)sidebytes + (u32)(D * bits / 8);
    const u64 nv = s.n / (u64)(2 * D);
    const u64 v0 = (u64)(g - s.block0) * (u64)(8 * ngrp);
    const float* C = sq + (bits == 4 ? TQ_C4 : TQ_C3);
    const u32 mask = (1u << bits) - 1u;
    float sg[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) {
      int j = gl + G * k;
      sg[k] = ((s.signs[j >> 5] >> (j & 31)) & 1u) ? -1.0f : 1.0f;
    }
    for (int p = 0; p < 8; ++p) {
      const u64 v = v0 + (u64)p * ngrp + grp;
      const bool live = v < nv;
      const u8* r = reinterpret_cast<const u8*>(s.src) + v * rec;
      u32 word = 0, side = 0;
      if (live) {
        const u8* cp = r + sidebytes + gl * bits;
        for (int i = 0; i < bits; ++i) word |= (u32)cp[i] << (8 * i);
        for (int i = 0; i < sidebytes; ++i) side |= (u32)r[i] << (8 * i);
      }
      u8* cg = codes + grp * D;
      __syncwarp();
#pragma unroll
      for (int i = 0; i < 8; ++i) cg[8 * gl + i] = (u8)((word >> (bits * i)) & mask);
      __syncwarp();
      float out[8];
      if (key) {
        float c[8], cc[8];
#pragma unroll
        for (int k = 0; k < 8; ++k) {
          c[k] = C[cg[gl + G * k]];
          cc[k] = __fmul_rn(c[k], c[k]);
        }
        const float scc = okv_tree_sum8(cc, G);
        const float scale = __fdiv_rn(okv_f16_to_f32(side & 0xFFFFu), __fsqrt_rn(__fmul_rn(scc, (float)D)));
        okv_fwht8(c, G, gl);
#pragma unroll
        for (int k = 0; k < 8; ++k) out[k] = __fmul_rn(__fmul_rn(c[k], scale), sg[k]);
      } else {
        const float lo32 = okv_f16_to_f32(side & 0xFFFFu), sc32 = okv_f16_to_f32(side >> 16);
#pragma unroll
        for (int k = 0; k < 8; ++k) out[k] = __fadd_rn(lo32, __fmul_rn((float)cg[gl + G * k], sc32));
      }
      if (live) {
        u16* y = reinterpret_cast<u16*>(s.dst) + v * D;
#pragma unroll
        for (int k = 0; k < 8; ++k) y[gl + G * k] = (u16)okv_f32_to_src(out[k], s.dtype);
      }
    }
  }
}
