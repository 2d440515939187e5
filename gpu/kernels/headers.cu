// A save flight's segment headers, written on the GPU into the flight's output region before its download, so
// that the host never stores to the arena's header lines (each a line of its own page, cold in every cache:
// docs/results/2026-12-03-gpu-suite). One row per segment (headers.HEADER_ROW_DTYPE):
struct HeaderRow {
  u32 slot;    // byte offset of the segment's header from the region's start (the Meta array; 4-byte aligned)
  u32 tid;     // its template: a validated header with a zero payload CRC (segment.header_row)
  u32 meta;    // its Meta row: acc is the raw CRC of the payload bytes the kernels walked
  u32 walked;  // those bytes
};

// Each row's header: the template's 16 words, the payload CRC32C (Meta.acc made standard: XOR the CRC32C of as
// many zero bytes, x^(8 walked) from the CRC tables, as tables.zero_crc) in word 6 (bytes 24..27), and the
// header CRC32C in word 15 (bytes 60..63): the template's (bases) XOR the payload CRC's four bytes through the
// field tables (segment.header_crc_tables' payload tables, 4 x 256 words), as headers.write_headers on the host.
extern "C" __global__ void __launch_bounds__(OKV_THREADS)
okv_write_headers(const HeaderRow* __restrict__ rows, int n, u8* __restrict__ region,
                  const u32* __restrict__ templates, const u32* __restrict__ bases,
                  const u32* __restrict__ field, const u32* __restrict__ tables) {
  const Meta* meta = reinterpret_cast<const Meta*>(region);
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    const HeaderRow r = rows[i];
    const u32 x = okv_gf_mul(tables[OKV_TAB_XC + r.walked / OKV_CHUNK], tables[OKV_TAB_XP + r.walked % OKV_CHUNK]);
    const u32 pcrc = meta[r.meta].acc ^ okv_gf_mul(OKV_FULL, x) ^ OKV_FULL;
    const u32 hcrc = bases[r.tid] ^ field[pcrc & 255u] ^ field[256 + ((pcrc >> 8) & 255u)]
                     ^ field[512 + ((pcrc >> 16) & 255u)] ^ field[768 + (pcrc >> 24)];
    const u32* t = templates + 16 * r.tid;
    u32* h = reinterpret_cast<u32*>(region + r.slot);
#pragma unroll
    for (int j = 0; j < 16; ++j) h[j] = j == 6 ? pcrc : (j == 15 ? hcrc : t[j]);
  }
}
