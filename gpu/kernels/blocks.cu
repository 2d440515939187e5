// Gathers and scatters of engine KV pages: one table row per page block. A block is `rows` rows of
// `row_bytes` bytes, `src_stride` / `dst_stride` bytes apart (a vLLM packed block's K half is
// heads x tokens rows of head_dim elements, every other one; a separate or SGLang block is one row).
// One launch moves every block of a batch, where a cupy fancy-index copy per tensor cost ~35 us each
// to launch plus a synchronous index upload.
struct BlockCopy {
  u64 src;
  u64 dst;
  u64 src_stride;
  u64 dst_stride;
  u32 rows;
  u32 row_bytes;
};

extern "C" __global__ void __launch_bounds__(OKV_THREADS)
okv_copy_blocks(const BlockCopy* __restrict__ table, u32 n) {
  for (u32 g = blockIdx.x; g < n; g += gridDim.x) {
    const BlockCopy c = table[g];
    const u8* src = reinterpret_cast<const u8*>(c.src);
    u8* dst = reinterpret_cast<u8*>(c.dst);
    if (((c.src | c.dst | c.src_stride | c.dst_stride | (u64)c.row_bytes) & 15) == 0) {
      const u32 per_row = c.row_bytes >> 4;
      const u32 total = c.rows * per_row;
      for (u32 i = threadIdx.x; i < total; i += OKV_THREADS) {
        const u32 r = i / per_row, q = (i - r * per_row) << 4;
        *reinterpret_cast<uint4*>(dst + r * c.dst_stride + q) =
            __ldg(reinterpret_cast<const uint4*>(src + r * c.src_stride + q));
      }
    } else {
      const u32 total = c.rows * c.row_bytes;
      for (u32 i = threadIdx.x; i < total; i += OKV_THREADS) {
        const u32 r = i / c.row_bytes, q = i - r * c.row_bytes;
        dst[r * c.dst_stride + q] = src[r * c.src_stride + q];
      }
    }
  }
}
