// A save flight's segment headers, written on the GPU into the flight's output region before its download, so
// that the host never stores to the arena's header lines (each a line of its own page, cold in every cache:
// docs/results/2026-12-03-gpu-suite). One row per segment (headers.HEADER_ROW_DTYPE):
struct HeaderRow {
  u32 slot;    // byte offset of the segment's header from the region's start (the Meta array; 4-byte aligned)
  u32 tid;     // its template: a validated header with a zero payload CRC (segment.header_row)
  u32 meta;    // its Meta row: acc is the raw CRC of the payload bytes the kernels walked
  u32 walked;  // those bytes; OKV_HEADER_ANS for an ANS segment, whose length nvCOMP decided
};

// An ANS segment's row: ``slot`` is the region offset of its u64 payload length (okv_ans_pack's, zero when the
// segment failed: it is stored raw, the host's, and takes no slot), its header's slot the one okv_ans_pack left
// in Meta.pad[0], its stored length that payload length in place of the template's (the template's is its
// capacity: a longer one is refused as okv_ans_pack refuses it), and walked the same.
#define OKV_HEADER_ANS 0xffffffffu

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
    const u32* t = templates + 16 * r.tid;
    u32 slot = r.slot, walked = r.walked, stored = t[5];  // stored_length: header bytes 20..23
    u32 hcrc = bases[r.tid];
    if (walked == OKV_HEADER_ANS) {
      const u64 len = *reinterpret_cast<const u64*>(region + r.slot);
      if (len == 0 || len > stored) continue;
      slot = meta[r.meta].pad[0];
      walked = (u32)len;
      const u32 x = stored ^ walked;  // the stored-length field's change, through its own tables (field + 1024)
      hcrc ^= field[1024 + (x & 255u)] ^ field[1280 + ((x >> 8) & 255u)] ^ field[1536 + ((x >> 16) & 255u)]
              ^ field[1792 + (x >> 24)];
      stored = walked;
    }
    const u32 x = okv_gf_mul(tables[OKV_TAB_XC + walked / OKV_CHUNK], tables[OKV_TAB_XP + walked % OKV_CHUNK]);
    const u32 pcrc = meta[r.meta].acc ^ okv_gf_mul(OKV_FULL, x) ^ OKV_FULL;
    hcrc ^= field[pcrc & 255u] ^ field[256 + ((pcrc >> 8) & 255u)] ^ field[512 + ((pcrc >> 16) & 255u)]
            ^ field[768 + (pcrc >> 24)];
    u32* h = reinterpret_cast<u32*>(region + slot);
#pragma unroll
    for (int j = 0; j < 16; ++j) h[j] = j == 5 ? stored : (j == 6 ? pcrc : (j == 15 ? hcrc : t[j]));
  }
}
