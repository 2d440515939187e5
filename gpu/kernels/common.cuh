// Shared device code of the OrbitKV-FS codec kernels: types, the segment descriptor, the batch
// work mapping and the CRC32C primitives. Compiled with -fmad=false: every float operation of the
// codecs is rounded on its own, in the order the host reference (orbitkv_fs/codecs) specifies.
typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;

#define OKV_THREADS 256
#define OKV_PIECE 64                       // bytes of CRC work per thread
#define OKV_CHUNK (OKV_THREADS * OKV_PIECE) // bytes of CRC work per block work unit (16 KiB)
#define OKV_CRC_POLY 0x82F63B78u           // CRC32C, reflected
#define OKV_FULL 0xffffffffu

// Status bits in Meta.status (orbitkv_fs.gpu.engine mirrors them).
#define OKV_ST_RANGE 1u     // FP8: finite |x| > 448; TurboQuant: norm/min/scale outside FP16
#define OKV_ST_NONFINITE 2u // NaN or infinity in the source

// One segment of a launch. Python builds these as a numpy structured array (engine.SEG_DTYPE);
// the field offsets are part of the contract and checked there.
struct Seg {
  u64 src;        // encode: source bytes; decode: payload in the staging area
  u64 dst;        // encode: payload slot (64-byte aligned); decode: destination; 0: no copy (CRC only)
  u64 n;          // bytes the kernel walks: source bytes (encode, CRC) or output bytes (decode)
  u64 n_dev;      // when nonzero: device address of a u64 holding the real length (<= n)
  u32 block0;     // first work unit of this segment in the launch
  u32 nblocks;    // work units of this segment
  u32 meta;       // index into the Meta array
  u32 dtype;      // 0: bfloat16, 1: float16
  u32 head_dim;
  u32 bits;
  u32 role;       // 1: key, 2: value
  u32 expect_crc; // decode: the raw CRC the payload must have (header CRC32C ^ crc32c(zeros))
  u32 signs[8];   // TurboQuant: bit j set means element j is negated
  u64 st_dev;     // when nonzero: device address of an nvCOMP status (int) that must be 0 to copy
  u32 pad[6];
};

struct Meta {
  u32 acc;    // raw (zero-init) CRC of the bytes the CRC kernels walked, XOR-accumulated
  u32 status; // OKV_ST_* bits
  u32 pad[2];
};

// CRC tables, one device array: slicing-by-8 (8 x 256), XP[d] = x^(8d) mod P for d in 0..CHUNK,
// XC[j] = x^(8*CHUNK*j) mod P for j in 0..2048.
#define OKV_TAB_SLICE 0
#define OKV_TAB_XP (8 * 256)
#define OKV_TAB_XC (OKV_TAB_XP + OKV_CHUNK + 1)
// then nibble tables of "times x^(8s)" for s = 64, 128, 256, 512, 1024, 2048 (8 x 16 words each)
#define OKV_TAB_SHIFT (OKV_TAB_XC + 2049)
#define OKV_SHIFT_WORDS (6 * 8 * 32)  // in shared memory: each 16-word row stored twice (lane parity)

__device__ __forceinline__ u32 okv_find_seg(const Seg* segs, int nsegs, u32 g) {
  int lo = 0, hi = nsegs - 1;
  while (lo < hi) {  // last segment with block0 <= g
    int mid = (lo + hi + 1) >> 1;
    if (segs[mid].block0 <= g) lo = mid; else hi = mid - 1;
  }
  return (u32)lo;
}

// a * b mod P in the reflected domain (x^0 is the top bit), as zlib's multmodp.
__device__ __forceinline__ u32 okv_gf_mul(u32 a, u32 b) {
  u32 p = 0;
#pragma unroll
  for (int i = 0; i < 32; ++i) {
    p ^= b & (0u - (a >> 31));
    a <<= 1;
    b = (b >> 1) ^ (OKV_CRC_POLY & (0u - (b & 1u)));
  }
  return p;
}

// Raw (zero-init, no final xor) CRC register after 8 more bytes, slicing-by-8 (8 x 256 words in
// shared memory). Measured on the H200 (ncu): the kernels are bound by the integer pipe, not by the
// bank conflicts of these random lookups, so byte tables (one lookup per byte) beat conflict-free
// nibble tables (two lookups and twice the index arithmetic per byte). The tables sit 1024-byte
// aligned and are addressed by their shared-window address T: a lookup is then one shift, one LOP3
// ((x & 0x3fc) | T) and a load with an immediate table offset, where C++ indexing costs an extra add.
#define OKV_SLICE_WORDS (8 * 256)
__device__ __forceinline__ u32 okv_lds(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
  return v;
}
template <int OFF>
__device__ __forceinline__ u32 okv_lds_off(u32 addr) {
  u32 v;
  asm volatile("ld.shared.u32 %0, [%1+%2];" : "=r"(v) : "r"(addr), "n"(OFF));
  return v;
}
__device__ __forceinline__ u32 okv_crc8(u32 crc, u32 lo, u32 hi, u32 T) {
  lo ^= crc;
  return okv_lds_off<7168>(((lo << 2) & 0x3fcu) | T) ^ okv_lds_off<6144>(((lo >> 6) & 0x3fcu) | T) ^
         okv_lds_off<5120>(((lo >> 14) & 0x3fcu) | T) ^ okv_lds_off<4096>(((lo >> 22) & 0x3fcu) | T) ^
         okv_lds_off<3072>(((hi << 2) & 0x3fcu) | T) ^ okv_lds_off<2048>(((hi >> 6) & 0x3fcu) | T) ^
         okv_lds_off<1024>(((hi >> 14) & 0x3fcu) | T) ^ okv_lds(((hi >> 22) & 0x3fcu) | T);
}

__device__ __forceinline__ u32 okv_crc1(u32 crc, u32 b, u32 T) {
  return okv_lds((((crc ^ b) & 255u) << 2) | T) ^ (crc >> 8);
}

// Shared-window address of a __shared__ array (for the lookups above).
__device__ __forceinline__ u32 okv_saddr(const void* p) { return (u32)__cvta_generic_to_shared(p); }

// Raw CRC of `len` (1..64) bytes held in shared memory at an 8-byte aligned address.
__device__ __forceinline__ u32 okv_crc_piece_smem(const u8* p, int len, u32 T) {
  u32 crc = 0;
  int i = 0;
  const uint2* w = reinterpret_cast<const uint2*>(p);
  for (; i + 8 <= len; i += 8) {
    uint2 v = w[i >> 3];
    crc = okv_crc8(crc, v.x, v.y, T);
  }
  for (; i < len; ++i) crc = okv_crc1(crc, p[i], T);
  return crc;
}

// Fills the shared slicing tables sT and the shift tables sS (table l at sS + l * 256, row i at
// + i * 32; each 16-word row stored twice so that lane parity picks a copy and lookups never share a bank).
__device__ __forceinline__ const u32* okv_load_tables(u32* sT, u32* sS, const u32* tables) {
  for (int i = threadIdx.x; i < OKV_SLICE_WORDS; i += blockDim.x) sT[i] = tables[OKV_TAB_SLICE + i];
  for (int i = threadIdx.x; i < OKV_SHIFT_WORDS; i += blockDim.x) {
    int l = i >> 8, row = (i >> 5) & 7, v = i & 15;
    sS[i] = tables[OKV_TAB_SHIFT + l * 128 + row * 16 + v];
  }
  return sT;
}

// v * x^(8s) for the fixed shift of table l: eight nibble lookups. S is the shared-window address of
// the lane's copy of the table (sS + l * 256 words + (lane & 1) * 16 words; 64-byte aligned, so the
// nibble offset is OR-ed in); row i lies i * 128 bytes further.
__device__ __forceinline__ u32 okv_mul_fixed(u32 v, u32 S) {
  return okv_lds(((v << 2) & 0x3cu) | S) ^ okv_lds_off<128>(((v >> 2) & 0x3cu) | S) ^
         okv_lds_off<256>(((v >> 6) & 0x3cu) | S) ^ okv_lds_off<384>(((v >> 10) & 0x3cu) | S) ^
         okv_lds_off<512>(((v >> 14) & 0x3cu) | S) ^ okv_lds_off<640>(((v >> 18) & 0x3cu) | S) ^
         okv_lds_off<768>(((v >> 22) & 0x3cu) | S) ^ okv_lds_off<896>(((v >> 26) & 0x3cu) | S);
}

// Padded shared-memory layout of a 16 KiB work unit: 64-byte rows with 16 bytes of padding so that
// the per-thread row reads (and most of the cooperative writes) are free of bank conflicts.
#define OKV_ROW 80
__device__ __forceinline__ int okv_pad(int off) { return off + (off >> 6) * 16; }

// Adds one work unit's CRC to its segment's. Thread t owns bytes [64t, 64t+64) of the unit (which
// starts `unit_start` bytes into a segment of n bytes) and holds its piece's raw CRC. A full unit is
// combined by a tree of fixed shifts (lanes: 64..1024 bytes, then warps: 2048, Horner in thread 0),
// each a table product; a partial unit (a segment's last) multiplies each piece by x^(8 * bytes after
// it in the unit). Thread 0 then shifts the unit's raw CRC to the segment's end, x^(8d) with
// d = n - unit end = XC[d / CHUNK] * XP[d % CHUNK], and XORs it into Meta.acc: the raw (zero-init) CRC
// of the whole segment. The host turns it into the standard CRC32C: acc ^ crc32c(n zero bytes)
// (orbitkv_fs.gpu.tables.finish_crc). `red` holds 8 words; callers sync before reusing it.
__device__ __forceinline__ void okv_crc_unit(u32 raw, u32 m, u64 unit_start, u64 n, Meta* meta, const u32* tables,
                                             u32 sS, u32* red) {
  const int t = threadIdx.x, lane = t & 31;
  const bool full = m == OKV_CHUNK;
  u32 v = 0;
  if (full) {
    v = raw;
    const u32 S = sS + (lane & 1) * 64;
#pragma unroll
    for (int k = 0; k < 5; ++k) {
      const u32 right = __shfl_down_sync(OKV_FULL, v, 1 << k);
      const u32 shifted = okv_mul_fixed(v, S + k * 1024);
      if ((lane & ((2 << k) - 1)) == 0) v = shifted ^ right;
    }
  } else {
    int len = (int)m - t * OKV_PIECE;
    if (len > 0) {
      if (len > OKV_PIECE) len = OKV_PIECE;
      const u32 d = m - (u32)t * OKV_PIECE - (u32)len;
      v = d ? okv_gf_mul(raw, tables[OKV_TAB_XP + d]) : raw;
    }
    for (int o = 16; o; o >>= 1) v ^= __shfl_xor_sync(OKV_FULL, v, o);
  }
  if (lane == 0) red[t >> 5] = v;
  __syncthreads();
  if (t == 0) {
    u32 acc = red[0];
    for (int w = 1; w < OKV_THREADS / 32; ++w) acc = (full ? okv_mul_fixed(acc, sS + 5 * 1024) : acc) ^ red[w];
    // units past a device-side length (m == 0) contribute nothing and must not index the tables
    const u64 d = m ? n - (unit_start + m) : 0;
    if (acc && d) {
      const u32 q = (u32)(d / OKV_CHUNK), r = (u32)(d % OKV_CHUNK);
      const u32 mult = q ? okv_gf_mul(tables[OKV_TAB_XC + q], tables[OKV_TAB_XP + r]) : tables[OKV_TAB_XP + r];
      acc = okv_gf_mul(acc, mult);
    }
    if (acc) atomicXor(&meta->acc, acc);
  }
}

// ---- Braided CRC32C (okv_crc32c, okv_fp8_encode, okv_ans_pack) ------------------------------------
// A work unit is CHUNK bytes = 2048 8-byte words (a shorter unit is zero-padded at its tail). Thread t
// folds the words t, t + 256, ..., t + 7 * 256 -- one coalesced 8-byte access per warp lane and step, and
// exactly the words an FP8 encode thread produces, so no shared-memory staging -- with "braid" tables:
// the slicing-by-8 tables times x^(64 * 255), which also carry its register across the 255 words of the
// other threads. Its register d_t then satisfies: raw CRC of the unit = XOR_t d_t * x^(-64 t). That
// factor is x^(-64 lane) (per-lane nibble tables, one conflict-free bank per lane) times x^(-64 * 32 warp)
// (per-warp nibble tables); then thread 0 shifts the unit to the end of its n-byte range: by x^(8e),
// e = n - (unit start + CHUNK), or by x^(-8|e|) (table XN) when the zero padding reaches past the end.
// Per thread and unit: 8 table steps + one 8-lookup multiply + 5 shuffles, where the staged version had
// a 16-byte store and 8 loads of staging, 8 steps and a 5-level shift tree (5 multiplies of 8 lookups).
// tables.crc32c_braid_model is the host model of exactly this decomposition.
#define OKV_TAB_BRAID (OKV_TAB_SHIFT + 6 * 128)
#define OKV_TAB_XN (OKV_TAB_BRAID + 8 * 256)
#define OKV_TAB_LANE (OKV_TAB_XN + OKV_CHUNK + 1)
#define OKV_TAB_WARP (OKV_TAB_LANE + 32 * 128)
#define OKV_LANE_WORDS (32 * 128)
#define OKV_WARP_WORDS (8 * 128)
#define OKV_X0 0x80000000u  // x^0 (reflected): the identity multiplier

// The kernel's shared tables live in one array `sm` of OKV_BRAID_SMEM_WORDS words, declared
// __shared__ __align__(1024): lane tables (32 x 128 words, which need a 2048-byte aligned window address:
// their index bits 2..10 are OR-ed in), then braid (8 x 256, 1024-byte aligned) and warp tables (8 x 128,
// 512-byte aligned). The lane tables' place is chosen at run time: __align__ on a __shared__ array
// aligns its offset in the block's static allocation, not its window address, and on sm_90 that
// allocation starts at window address 0x400 (the first 1 KiB is reserved), so __align__(2048) yields an
// address that is only 1024-aligned. (Three separate __align__(1024/2048/512) arrays put the lane tables
// at 0x2400 there and broke every lookup with nibble >= 8.) The 512-word slack covers any 4-byte aligned
// start. Returns the window addresses; tables.braid_smem_layout models this. Callers sync before use.
#define OKV_BRAID_SMEM_WORDS (OKV_LANE_WORDS + OKV_SLICE_WORDS + OKV_WARP_WORDS + 512)
struct OkvBraid {
  u32 aB, aL, aW;  // shared-window addresses of the braid, lane and warp tables
};
__device__ __forceinline__ OkvBraid okv_load_braid(u32* sm, const u32* tables) {
  u32* sL = sm + (((0u - okv_saddr(sm)) & 2047u) >> 2);
  u32* sB = sL + OKV_LANE_WORDS;
  u32* sW = sB + OKV_SLICE_WORDS;
  for (int i = threadIdx.x; i < OKV_SLICE_WORDS; i += blockDim.x) sB[i] = tables[OKV_TAB_BRAID + i];
  for (int i = threadIdx.x; i < OKV_LANE_WORDS; i += blockDim.x) sL[i] = tables[OKV_TAB_LANE + i];
  for (int i = threadIdx.x; i < OKV_WARP_WORDS; i += blockDim.x) sW[i] = tables[OKV_TAB_WARP + i];
  OkvBraid r;
  r.aL = okv_saddr(sL);
  r.aB = r.aL + 4u * OKV_LANE_WORDS;
  r.aW = r.aB + 4u * OKV_SLICE_WORDS;
  return r;
}

// v * x^(-64 lane): L = shared-window address of the lane tables + 4 * lane (word (i*16 + nibble)*32 + lane).
__device__ __forceinline__ u32 okv_mul_lane(u32 v, u32 L) {
  return okv_lds(((v << 7) & 0x780u) | L) ^ okv_lds_off<2048>(((v << 3) & 0x780u) | L) ^
         okv_lds_off<4096>(((v >> 1) & 0x780u) | L) ^ okv_lds_off<6144>(((v >> 5) & 0x780u) | L) ^
         okv_lds_off<8192>(((v >> 9) & 0x780u) | L) ^ okv_lds_off<10240>(((v >> 13) & 0x780u) | L) ^
         okv_lds_off<12288>(((v >> 17) & 0x780u) | L) ^ okv_lds_off<14336>(((v >> 21) & 0x780u) | L);
}

// v times a constant held as 8 rows of 16 nibble words at S (64-byte aligned; row i at S + 64 i).
__device__ __forceinline__ u32 okv_mul_nib16(u32 v, u32 S) {
  return okv_lds(((v << 2) & 0x3cu) | S) ^ okv_lds_off<64>(((v >> 2) & 0x3cu) | S) ^
         okv_lds_off<128>(((v >> 6) & 0x3cu) | S) ^ okv_lds_off<192>(((v >> 10) & 0x3cu) | S) ^
         okv_lds_off<256>(((v >> 14) & 0x3cu) | S) ^ okv_lds_off<320>(((v >> 18) & 0x3cu) | S) ^
         okv_lds_off<384>(((v >> 22) & 0x3cu) | S) ^ okv_lds_off<448>(((v >> 26) & 0x3cu) | S);
}

// The multiplier that moves a (zero-padded) unit starting `unit_start` bytes into an n-byte range to the
// range's end (n > unit_start). Thread 0 computes it at the start of the unit, off the critical path.
__device__ __forceinline__ u32 okv_unit_mult(u64 unit_start, u64 n, const u32* tables) {
  const long long e = (long long)(n - unit_start) - (long long)OKV_CHUNK;
  if (e < 0) return tables[OKV_TAB_XN + (u32)(-e)];
  if (e == 0) return OKV_X0;
  const u32 q = (u32)((u64)e / OKV_CHUNK), r = (u32)((u64)e % OKV_CHUNK);
  return q ? okv_gf_mul(tables[OKV_TAB_XC + q], tables[OKV_TAB_XP + r]) : tables[OKV_TAB_XP + r];
}

// 8 bytes p[o .. o+8) of a range of m > o bytes, little-endian, zero past m (any alignment).
__device__ __forceinline__ uint2 okv_load_tail(const u8* p, u32 o, u32 m) {
  u32 lo = 0, hi = 0;
  const u32 c = min(8u, m - o);
#pragma unroll 1
  for (u32 i = 0; i < c; ++i) {
    const u32 b = (u32)p[o + i] << (8 * (i & 3));
    if (i < 4) lo |= b; else hi |= b;
  }
  return make_uint2(lo, hi);
}

// Stores the bytes of w that lie below m at p + o (any alignment; 8 at once when aligned and whole).
__device__ __forceinline__ void okv_store_tail(u8* p, u32 o, u32 m, uint2 w) {
  if (o >= m) return;
  if (o + 8 <= m && (reinterpret_cast<u64>(p + o) & 7) == 0) {
    *reinterpret_cast<uint2*>(p + o) = w;
    return;
  }
  const u32 c = min(8u, m - o);
#pragma unroll 1
  for (u32 i = 0; i < c; ++i) p[o + i] = (u8)((i < 4 ? w.x : w.y) >> (8 * (i & 3)));
}

// Adds one unit to Meta.acc: d is this thread's braid register, mult (thread 0's) okv_unit_mult. `red`
// holds 8 words; callers alternate between two such sets from one unit to the next (so that warp 0 has
// read a set before any warp writes it again: one __syncthreads per unit).
__device__ __forceinline__ void okv_crc_braid_unit(u32 d, u32 mult, Meta* meta, u32 sL, u32 sW, u32* red) {
  const int t = threadIdx.x, lane = t & 31;
  u32 v = okv_mul_lane(d, sL + 4u * (u32)lane);
#pragma unroll
  for (int o = 16; o; o >>= 1) v ^= __shfl_xor_sync(OKV_FULL, v, o);
  if (lane == 0) red[t >> 5] = v;
  __syncthreads();
  if (t < 32) {
    u32 u = lane < OKV_THREADS / 32 ? okv_mul_nib16(red[lane], sW + 512u * (u32)lane) : 0u;
    u ^= __shfl_xor_sync(OKV_FULL, u, 4);
    u ^= __shfl_xor_sync(OKV_FULL, u, 2);
    u ^= __shfl_xor_sync(OKV_FULL, u, 1);
    if (t == 0 && u) {
      if (mult != OKV_X0) u = okv_gf_mul(u, mult);
      atomicXor(&meta->acc, u);
    }
  }
}

// Float <-> half/bfloat16 without the CUDA headers (NVRTC builds these sources alone).
__device__ __forceinline__ float okv_bf16_to_f32(u32 h) { return __uint_as_float(h << 16); }
__device__ __forceinline__ float okv_f16_to_f32(u32 h) {
  float f;
  unsigned short s = (unsigned short)h;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
  return f;
}
__device__ __forceinline__ u32 okv_f32_to_f16(float f) {
  unsigned short s;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s) : "f"(f));
  return s;
}
// Round-to-nearest-even float32 -> bfloat16 bits, for finite inputs (the codecs never decode NaN here).
__device__ __forceinline__ u32 okv_f32_to_bf16(float f) {
  u32 u = __float_as_uint(f);
  return (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
}
__device__ __forceinline__ float okv_src_to_f32(u32 h, u32 dtype) {
  return dtype ? okv_f16_to_f32(h) : okv_bf16_to_f32(h);
}
__device__ __forceinline__ u32 okv_f32_to_src(float f, u32 dtype) {
  return dtype ? okv_f32_to_f16(f) : okv_f32_to_bf16(f);
}
