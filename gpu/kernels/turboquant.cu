// TurboQuant-3/-4 encode and decode, K and V, head dims 32..256 (powers of two), in the host's exact order
// of float32 operations (no contraction: the module is built with -fmad=false and -ftz=false; every
// explicit fma below rounds once an operation the host also rounds once, e.g. p + (-1 * v) == p - v).
// V encode and both decodes: a vector of D elements is held by a group of G = D/8 lanes of one warp,
// lane l holding elements j = l + G*k (k = 0..7). With that layout the halving tree sums of the host
// reference start inside the lane (h = 4G, 2G, G) and end across lanes (h = G/2 .. 1), and the
// Walsh-Hadamard stages h = 1 .. G/2 run across lanes, h = G, 2G, 4G inside. Work unit: 16384/D vectors
// (32 KiB of source), 8 per group.
// K encode (okv_tq_encode_k): the same layout with 64 elements a lane (G = D/64 lanes, one up to D = 64),
// see okv_tq_k_pass.
// Each (head dim, bits, role, dtype) has its own instantiation: with G, the record layout and the
// conversions known at compile time the passes are straight-line code (measured on the H200 with ncu:
// the generic kernel spent most of its issue slots on loop control, runtime branches and spills).
#define TQ_C4 0       // orbitkv_fs.gpu.tables.turboquant_tables(): centroids(4)
#define TQ_C3 16      // centroids(3)
#define TQ_B4 24      // turboquant_boundary_slots(4): 16 floats
#define TQ_B3 40      // turboquant_boundary_slots(3): 8 floats
#define TQ_CELLB4 48  // turboquant_cells(4): 129 bytes
#define TQ_CELLB3 84  // turboquant_cells(3)
#define TQ_TAB 120

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

// The host's bucketize of q (the count of boundaries below it) by the tables of tables.turboquant_cells:
// the cell round(128 * sat(y)), y = q/8 + 63.5/128, i.e. round(16 q + 63.5) clamped to 0..128 (the
// saturating fma sends a NaN, a rejected segment's, to cell 0; the magic 2^23 leaves the cell in the low
// bits of the float), its byte w4 = 4 * base, then idx = base + (q > slots[base]) and the centroid of idx:
// three 32-bit loads with few bank conflicts. y may come from an approximation of q (a cell answers for
// q up to TQ_CELL_SLACK outside it): the K encode passes w * (r/8) + 63.5/128 from the undivided element
// and the reciprocal, which does not wait for the division. `cells` is okv_cell_base's address.
__device__ __forceinline__ u32 okv_cell_base(const float* cellb) {
  return (u32)__cvta_generic_to_shared(cellb) - 0x4B000000u;
}
template <int BITS>
__device__ __forceinline__ u32 okv_bucket4(float q, float y, u32 cells, const float* sq, float& c) {
  u32 w4;
  asm("ld.shared.u8 %0, [%1];" : "=r"(w4) : "r"(cells + __float_as_uint(__fmaf_rn(y, 128.0f, 8388608.0f))));
  const char* const slots = reinterpret_cast<const char*>(sq + (BITS == 4 ? TQ_B4 : TQ_B3));
  const u32 i4 = w4 + (q > *reinterpret_cast<const float*>(slots + w4) ? 4u : 0u);
  c = *reinterpret_cast<const float*>(reinterpret_cast<const char*>(sq + (BITS == 4 ? TQ_C4 : TQ_C3)) + i4);
  return i4;  // 4 * idx
}
__device__ __forceinline__ float okv_cell_y(float x, float r8) {  // sat(x * r8 + 63.5/128)
  float y;
  asm("fma.rn.sat.f32 %0, %1, %2, 0f3EFE0000;" : "=f"(y) : "f"(x), "f"(r8));
  return y;
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
template <int D, int BITS, bool F16>
__device__ __forceinline__ u32 okv_tq_encode_value_unit(const Seg& s, u32 unit, u8* codes) {
  constexpr int G = D / 8, NGRP = OKV_THREADS / G;
  constexpr u32 REC = 4 + D * BITS / 8;
  constexpr float LEVELS = (float)((1 << BITS) - 1);
  const int gl = threadIdx.x & (G - 1), grp = threadIdx.x / G;
  const u64 v0 = (u64)unit * (u64)(8 * NGRP) + (u64)grp;
  const int npass = okv_tq_passes<NGRP>(s.n / (u64)(2 * D), v0);  // passes whose vector exists
  const u16* xp = reinterpret_cast<const u16*>(s.src) + v0 * D + gl;
  u8* rp = reinterpret_cast<u8*>(s.dst) + v0 * REC;
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
#pragma unroll
    for (int k = 0; k < 8; k += 2) {
      const u32 two = nxt[k >> 1];
      mag = __vmaxu2(mag, two & 0x7FFF7FFFu);
      w[k] = okv_half_to_f32<F16>(two & 0xFFFFu);
      w[k + 1] = okv_half_to_f32<F16>(two >> 16);
    }
    if (p + 1 < 8) load(p + 1 < npass);
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
    // Regroup the codes so that each lane packs 8 consecutive ones (LSB first, BITS bytes).
    u8* const cg = codes + grp * D;
    __syncwarp();
#pragma unroll
    for (int k = 0; k < 8; ++k) cg[gl + G * k] = (u8)idx[k];
    __syncwarp();
    const uint2 cv = *reinterpret_cast<const uint2*>(cg + 8 * gl);
    const u32 word = okv_pack_codes<BITS>(cv.x, cv.y);
    if (live) {
      u8* const cp = rp + 4 + gl * BITS;  // records are 4-byte aligned in a 64-byte aligned payload
      if (gl == 0) *reinterpret_cast<u32*>(rp) = lo16 | (sc16 << 16);
      if (BITS == 4) {
        *reinterpret_cast<u32*>(cp) = word;
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

// Elements of a vector one lane of the K encode holds (one lane per vector up to head dim 64).
#define OKV_TQ_KE 64
// Bytes of one K encode buffer of a warp -- a pass's rows (32/G rows of 2D + 16 bytes: the 16 keep
// LDS.128 free of bank conflicts), its records, or 128 bytes a lane for the slow division -- given by
// module.py (TQ_K_BUFFER), which also sizes the launch's dynamic shared memory from it.
#ifndef OKV_TQ_KBUF
#error "OKV_TQ_KBUF: build through orbitkv_fs.gpu.module, which defines it"
#endif
static_assert(OKV_TQ_KBUF >= 64 * OKV_TQ_KE + 512 && OKV_TQ_KBUF >= 4096, "OKV_TQ_KBUF too small");

// Leaves of the host's halving tree over E in-lane elements (first level k + E/2, ...) are visited in
// bit-reversed order k = okv_brev<E>(t), each merged as soon as its sibling subtree is complete (stack
// level b holds a finished subtree of 2^b leaves): few partial sums are live at once.
template <int E>
__host__ __device__ constexpr int okv_brev(int t) {
  int r = 0;
  for (int b = 1; b < E; b <<= 1, t >>= 1) r = (r << 1) | (t & 1);
  return r;
}
#define OKV_TREE_PUSH(ST, T, LOG2E, V, ADD)         \
  {                                                 \
    auto acc_ = (V);                                \
    _Pragma("unroll") for (int b_ = 0; b_ < LOG2E; ++b_) { \
      if ((T) & (1 << b_)) {                        \
        acc_ = ADD(ST[b_], acc_);                   \
      } else {                                      \
        ST[b_] = acc_;                              \
        break;                                      \
      }                                             \
    }                                               \
    if ((T) == (1 << LOG2E) - 1) ST[LOG2E] = acc_;  \
  }
__device__ __forceinline__ float2 okv_add2(float2 a, float2 b) {
  return make_float2(__fadd_rn(a.x, b.x), __fadd_rn(a.y, b.y));
}
__host__ __device__ constexpr int okv_log2(int n) { return n > 1 ? 1 + okv_log2(n >> 1) : 0; }
template <int E>
__device__ __forceinline__ float okv_tree_squares(const float (&w)[E]) {
  constexpr int L = okv_log2(E);
  float st[L + 1];
#pragma unroll
  for (int t = 0; t < E; ++t) {
    const int k = okv_brev<E>(t);
    OKV_TREE_PUSH(st, t, L, __fmul_rn(w[k], w[k]), __fadd_rn)
  }
  return st[L];
}

// The cross-lane end of a halving tree of G lanes per vector (lanes l and l^h add the same two values).
template <int G>
__device__ __forceinline__ float okv_group_sum(float v) {
#pragma unroll
  for (int off = G >> 1; off; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(OKV_FULL, v, off, G));
  return v;
}

// The K encode, one warp pass at a time: a pass is VPW = 32/G vectors (64*E source bytes), lane g of a
// group of G = D/E lanes holding elements g + G*k (k < E) of one vector, so the rotation's stages h < G
// and the trees' last levels run across lanes, the rest in the lane; with E = 64 (D <= 64) a vector is
// one lane's, with no shuffles at all. A warp's passes are software-pipelined through two shared-memory
// buffers: okv_tq_k_issue starts the copy of the next pass (cp.async, 16-byte pieces, rows of 2D + 16
// bytes) before okv_tq_k_pass computes this one, so the loads' latency hides behind the arithmetic
// (ncu: half the stall cycles were loads waited for). The records leave through the same buffer
// (coalesced 16-byte stores). Only warp barriers.
// cp.async needs compute capability 8.0, which module.check_device requires.
#define okv_cp_async(INSN) asm volatile(INSN ::: "memory")
__device__ __forceinline__ int okv_tq_k_e(int d) { return d < OKV_TQ_KE ? d : OKV_TQ_KE; }
__device__ __forceinline__ int okv_tq_k_passes(int d) { return 64 / okv_tq_k_e(d); }  // per warp per unit

// The first vector of pass p of unit `unit` for this warp, and the pass's vectors.
__device__ __forceinline__ u64 okv_tq_k_first(u32 unit, int p, int d) {
  const int e = okv_tq_k_e(d), vpw = 32 * e / d;
  return (u64)unit * (u64)(16384 / d) + (u64)((threadIdx.x >> 5) * 64 / e + p) * (u64)vpw;
}

// Start copying pass p of unit `unit` into the buffer at shared address `buf`: row vl (a vector) at
// vl * (2D + 16); rows past the segment's end are zero-filled. Sources not 16-byte aligned are copied
// with plain loads (done when this returns).
__device__ __forceinline__ void okv_tq_k_issue(const Seg& s, u32 unit, int p, u32 buf) {
  const int d = (int)s.head_dim, e = okv_tq_k_e(d), lg = 31 - __clz(2 * d);
  const u64 vp = okv_tq_k_first(unit, p, d), nv = s.n / (u64)(2 * d);
  const u32 nbytes = vp >= nv ? 0u : (u32)min((u64)(64 * e), (nv - vp) * (u64)(2 * d));
  const u8* const src = reinterpret_cast<const u8*>(s.src) + vp * (u64)(2 * d);
  const bool aligned = (s.src & 15u) == 0;
  for (u32 b = 16u * (threadIdx.x & 31u); b < (u32)(64 * e); b += 512u) {
    const u32 at = buf + (b >> lg) * (u32)(2 * d + 16) + (b & (2u * d - 1u));
    if (aligned) {
      const u32 take = b < nbytes ? 16u : 0u;  // 0: zero-fill
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(at), "l"(src + (take ? b : 0u)), "r"(take));
    } else {
      u32 x[4] = {0u, 0u, 0u, 0u};
      if (b < nbytes) {
        const u16* h = reinterpret_cast<const u16*>(src + b);
#pragma unroll
        for (int i = 0; i < 4; ++i) x[i] = h[2 * i] | ((u32)h[2 * i + 1] << 16);
      }
      asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(at), "r"(x[0]), "r"(x[1]), "r"(x[2]), "r"(x[3]));
    }
  }
  okv_cp_async("cp.async.commit_group;");
}

// Compute pass p of unit `unit` from `stage` (filled by okv_tq_k_issue and waited for); `negs` is rebuilt
// on a unit's first pass. Answers the status bits it found.
template <int D, int BITS, bool F16>
__device__ __forceinline__ u32 okv_tq_k_pass(const Seg& s, u32 unit, int p, const float* sq, u32 cells, u8* stage,
                                             u32* negs) {
  constexpr int E = D < OKV_TQ_KE ? D : OKV_TQ_KE, G = D / E, VPW = 32 / G;
  constexpr int ROW = 2 * D + 16, NW = D / 8, WORDS = E / 8;  // groups of 8 codes: all, a lane's to write
  constexpr u32 REC = 2 + D * BITS / 8;
  static_assert(G <= 4, "K encode: at most 4 lanes per vector");
  const int lane = threadIdx.x & 31, g = lane & (G - 1);
  const u64 nv = s.n / (u64)(2 * D), vp = okv_tq_k_first(unit, p, D);
  if (vp >= nv) return 0u;
  const u32 nlive = (u32)min((u64)VPW, nv - vp);
  if (p == 0) {  // the rotation's sign bits of lane row g, elements g + G*k and g + G*(k+1): bits 15, 31 of word k/2
    for (int i = lane; i < D / 2; i += 32) {
      const int r = i / (E / 2), k = 2 * (i % (E / 2)), j = r + G * k, j1 = j + G;
      negs[i] = (((s.signs[j >> 5] >> (j & 31)) & 1u) << 15) | (((s.signs[j1 >> 5] >> (j1 & 31)) & 1u) << 31);
    }
    __syncwarp();
  }
  u32 flags = 0, mag = 0;
  {
    // the lane's halves g + G*k from its vector's row (16-byte pieces; G > 1 keeps every G-th half)
    u32 two[E / 2];
    const u8* const row = stage + (lane / G) * ROW;
#pragma unroll
    for (int i = 0; i < E / 8; ++i) {
      u32 h[4];
      if (G == 1) {
        const uint4 x = *reinterpret_cast<const uint4*>(row + 16 * i);
        h[0] = x.x, h[1] = x.y, h[2] = x.z, h[3] = x.w;
      } else if (G == 2) {
        const u32 sel = g ? 0x7632u : 0x5410u;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const uint4 x = *reinterpret_cast<const uint4*>(row + 32 * i + 16 * c);
          h[2 * c] = __byte_perm(x.x, x.y, sel);
          h[2 * c + 1] = __byte_perm(x.z, x.w, sel);
        }
      } else {
        const u32 sel = (g & 1) ? 0x7632u : 0x5410u;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          const uint4 x = *reinterpret_cast<const uint4*>(row + 64 * i + 16 * c);
          h[c] = __byte_perm((g & 2) ? x.y : x.x, (g & 2) ? x.w : x.z, sel);
        }
      }
      const uint4 m = *reinterpret_cast<const uint4*>(negs + g * (E / 2) + 4 * i);
      two[4 * i] = h[0] ^ m.x;
      two[4 * i + 1] = h[1] ^ m.y;
      two[4 * i + 2] = h[2] ^ m.z;
      two[4 * i + 3] = h[3] ^ m.w;
    }
    __syncwarp();  // every row read: the slow division may use the buffer
    // div.rn's fast path is exact for the lane's raw halves? (okv_tq_fast_ok, over E halves)
    bool fast = true;
    if (!F16) {
      u32 mx = 0, mn = 0xFFFFFFFFu;
#pragma unroll
      for (int i = 0; i < E / 2; ++i) {
        const u32 m = two[i] & 0x7FFF7FFFu;
        mx = __vmaxu2(mx, m);
        mn = __vminu2(mn, __vsub2(m, 0x00010001u));  // a zero half wraps to 0xFFFF and drops out
      }
      mag = __vmaxu2(mag, mx);
      const u32 top = __vmaxu2(mx, mx >> 16) & 0xFFFFu, bottom = __vminu2(mn, mn >> 16) & 0xFFFFu;
      fast = top < (157u << 7) && bottom >= (67u << 7) - 1u;
    } else {
#pragma unroll
      for (int i = 0; i < E / 2; ++i) mag = __vmaxu2(mag, two[i] & 0x7FFF7FFFu);
    }
    if (G > 1) fast = !__any_sync(OKV_FULL, !fast);  // a group divides one way
    float w[E];
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {
      w[2 * i] = okv_half_to_f32<F16>(two[i] & 0xFFFFu);
      w[2 * i + 1] = okv_half_to_f32<F16>(two[i] >> 16);
    }
    const float norm = __fsqrt_rn(okv_group_sum<G>(okv_tree_squares<E>(w)));
    // the rotation: stages h < G across lanes (lower lane own + partner's, upper partner's - own), then in-lane
#pragma unroll
    for (int h = 1; h < G; h <<= 1) {
      const float sgn = (g & h) ? -1.0f : 1.0f;
#pragma unroll
      for (int k = 0; k < E; ++k) w[k] = __fmaf_rn(w[k], sgn, __shfl_xor_sync(OKV_FULL, w[k], h, G));
    }
#pragma unroll
    for (int step = 1; step < E; step <<= 1) {
#pragma unroll
      for (int k = 0; k < E; ++k) {
        if (k & step) continue;
        const float a = w[k], b = w[k + step];
        w[k] = __fadd_rn(a, b);
        w[k + step] = __fsub_rn(a, b);
      }
    }
    // q = w / norm: div.rn's fast path inline below where okv_tq_fast_ok allows (with the cell taken from
    // w * r/8, see okv_bucket4), else __fdiv_rn first, 32 elements at a time through the lane's 128
    // bytes of the buffer in a loop (inlined 64 times, its slow-path calls made the compiler spill on
    // the fast path too), and then q / 1 below, which is q.
    float dv = norm, r = 0.0f;
    if (norm > 0.0f && fast) {
      r = okv_rcp_refined(norm);
    } else {
      float* const t = reinterpret_cast<float*>(stage + 128 * lane);
#pragma unroll
      for (int h = 0; h < E; h += 32) {
#pragma unroll
        for (int k = 0; k < 32; ++k) t[k] = w[h + k];
#pragma unroll 1
        for (int k = 0; k < 32; ++k) t[k] = norm > 0.0f ? __fdiv_rn(t[k], norm) : 0.0f;
#pragma unroll
        for (int k = 0; k < 32; ++k) w[h + k] = t[k];
      }
      dv = r = 1.0f;
    }
    const float r8 = __fmul_rn(r, 0.125f);
    // bucketize; the codes of group m (8 consecutive elements) land in word[m] at bit BITS*(G*t) (t < 8/G)
    u32 word[NW];
#pragma unroll
    for (int m = 0; m < NW; ++m) word[m] = 0u;
    constexpr int L = okv_log2(E);
    float2 st[L + 1];  // the trees of q*c and c*c
#pragma unroll
    for (int t = 0; t < E; ++t) {
      const int k = okv_brev<E>(t);
      const float q = okv_div_by(w[k], dv, r);
      float c;
      const u32 i4 = okv_bucket4<BITS>(q, okv_cell_y(w[k], r8), cells, sq, c);
      const int sh = BITS * G * (k % (8 / G));  // codes of a word at disjoint bits: + is |
      word[k / (8 / G)] += sh >= 2 ? i4 << (sh - 2) : i4 >> (2 - sh);
      OKV_TREE_PUSH(st, t, L, make_float2(__fmul_rn(q, c), __fmul_rn(c, c)), okv_add2)
    }
    const float sqc = okv_group_sum<G>(st[L].x), scc = okv_group_sum<G>(st[L].y);
    const float den = __fsqrt_rn(__fmul_rn(scc, (float)D));
    const u32 g16 = okv_f32_to_f16(__fdiv_rn(__fmul_rn(norm, sqc), den));
    if (!okv_f16_finite(g16)) flags |= OKV_ST_RANGE;
    // the group's words: lane g's codes shifted to their positions, OR-ed across the group
#pragma unroll
    for (int m = 0; m < NW; ++m) {
      u32 x = word[m] << (BITS * g);
#pragma unroll
      for (int off = 1; off < G; off <<= 1) x |= __shfl_xor_sync(OKV_FULL, x, off, G);
      word[m] = x;
    }
    // stage the records (2-byte aligned: the side, then BITS bytes per 8 codes; lane g writes groups
    // g*WORDS/G ..), then copy the live ones out in 16-byte pieces (a pass starts 16-byte aligned)
    __syncwarp();
    u8* const rec = stage + (lane / G) * REC;
    if (g == 0) *reinterpret_cast<u16*>(rec) = (u16)g16;
    u16* const out = reinterpret_cast<u16*>(rec + 2 + g * WORDS * BITS);
#pragma unroll
    for (int m = 0; m < WORDS; ++m) {
      u32 x = word[m];  // lane g writes words g*WORDS + m: picked with a run-time g
#pragma unroll
      for (int q = 1; q < G; ++q) x = g == q ? word[q * WORDS + m] : x;
      if (BITS == 4) {
        out[2 * m] = (u16)x;
        out[2 * m + 1] = (u16)(x >> 16);
      } else if (m & 1) {  // 3 bytes per word: two words are three u16
        out[3 * (m >> 1) + 1] |= (u16)((x & 0xFFu) << 8);
        out[3 * (m >> 1) + 2] = (u16)(x >> 8);
      } else {
        out[3 * (m >> 1)] = (u16)x;
        out[3 * (m >> 1) + 1] = (u16)((x >> 16) & 0xFFu);
      }
    }
    __syncwarp();
    u8* const dst = reinterpret_cast<u8*>(s.dst) + vp * (u64)REC;
    const u32 nbytes = nlive * REC;
    const bool out16 = (reinterpret_cast<u64>(dst) & 15u) == 0;
    for (u32 b = 16u * (u32)lane; b < nbytes; b += 512u) {
      if (out16 && b + 16u <= nbytes) {
        *reinterpret_cast<uint4*>(dst + b) = *reinterpret_cast<const uint4*>(stage + b);
      } else {
        for (u32 t = b; t < min(b + 16u, nbytes); ++t) dst[t] = stage[t];
      }
    }
    __syncwarp();  // the buffer is free for the next copy
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

// The encodes of K and of V are separate kernels: the K encode holds 64 elements a lane (128 registers,
// 2 blocks per multiprocessor), the V encode 8 (4 blocks). A descriptor's role picks
// the kernel on the host; these read only head_dim, bits and dtype.
#define OKV_TQ_DISPATCH3(CALL)                                                     \
  {                                                                                \
    const bool f16 = s.dtype != 0, four = s.bits == 4;                             \
    switch (s.head_dim) {                                                          \
      case 32: OKV_TQ_DISPATCH3_D(CALL, 32) break;                                 \
      case 64: OKV_TQ_DISPATCH3_D(CALL, 64) break;                                 \
      case 128: OKV_TQ_DISPATCH3_D(CALL, 128) break;                               \
      default: OKV_TQ_DISPATCH3_D(CALL, 256) break;                                \
    }                                                                              \
  }
#define OKV_TQ_DISPATCH3_D(CALL, D)                                                \
  if (four) {                                                                      \
    if (f16) CALL(D, 4, true) else CALL(D, 4, false)                               \
  } else {                                                                         \
    if (f16) CALL(D, 3, true) else CALL(D, 3, false)                               \
  }

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 2)
okv_tq_encode_k(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
                const float* __restrict__ tq) {
  extern __shared__ __align__(16) u8 okv_dyn[];  // two buffers of OKV_TQ_KBUF bytes a warp
  __shared__ __align__(16) float sq[TQ_TAB];
  __shared__ __align__(16) u32 negs[OKV_THREADS / 32][128];
  __shared__ u32 cbase[2];
  okv_tq_setup(sq, tq);
  if (threadIdx.x < 2) cbase[threadIdx.x] = okv_cell_base(sq + (threadIdx.x ? TQ_CELLB3 : TQ_CELLB4));
  __syncthreads();
  u8* const bufs = okv_dyn + (threadIdx.x >> 5) * 2 * OKV_TQ_KBUF;
  const u32 sbufs = (u32)__cvta_generic_to_shared(bufs);
  u32* const wnegs = negs[threadIdx.x >> 5];
  // the warp's work items (unit g, pass p), each copied in while the one before computes
  u32 g = blockIdx.x;
  if (g >= total) return;
  u32 si = okv_find_seg(segs, nsegs, g);
  int p = 0, cur = 0;
  okv_tq_k_issue(segs[si], g - segs[si].block0, p, sbufs);
  for (;;) {
    u32 gn = g, sn = si;
    int pn = p + 1;
    if (pn == okv_tq_k_passes((int)segs[si].head_dim)) {
      pn = 0;
      gn = g + gridDim.x;
      if (gn < total) sn = okv_find_seg(segs, nsegs, gn);
    }
    const bool more = gn < total;
    if (more) {
      okv_tq_k_issue(segs[sn], gn - segs[sn].block0, pn, sbufs + (1 - cur) * OKV_TQ_KBUF);
      okv_cp_async("cp.async.wait_group 1;");
    } else {
      okv_cp_async("cp.async.wait_group 0;");
    }
    __syncwarp();
    const Seg& s = segs[si];
    const u32 unit = g - s.block0;
    u8* const stage = bufs + cur * OKV_TQ_KBUF;
    u32 flags = 0;
#define OKV_TQ_ENC(D, B, F) flags = okv_tq_k_pass<D, B, F>(s, unit, p, sq, cbase[B == 4 ? 0 : 1], stage, wnegs);
    OKV_TQ_DISPATCH3(OKV_TQ_ENC)
#undef OKV_TQ_ENC
    if (flags) atomicOr(&meta[s.meta].status, flags);
    if (!more) break;
    g = gn, si = sn, p = pn, cur ^= 1;
  }
}

extern "C" __global__ void __launch_bounds__(OKV_THREADS, 4)
okv_tq_encode_v(const Seg* __restrict__ segs, int nsegs, u32 total, Meta* __restrict__ meta,
                const float* __restrict__ tq) {
  __shared__ __align__(8) u8 codes[OKV_THREADS * 8];
  for (u32 g = blockIdx.x; g < total; g += gridDim.x) {
    const Seg& s = segs[okv_find_seg(segs, nsegs, g)];
    const u32 unit = g - s.block0;
    u32 flags = 0;
#define OKV_TQ_ENC(D, B, F) flags = okv_tq_encode_value_unit<D, B, F>(s, unit, codes);
    OKV_TQ_DISPATCH3(OKV_TQ_ENC)
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
