"""The CPU host path's floor at 32 KiB, next to the Manager's save of the same pages in the same process: the
bench's geometry (8 layers, 512 blocks of 32 KiB per layer and role, host pages in /dev/shm), `none`, chunks of
one block (a 32 KiB segment each); the floor is the copy and the payload CRC32C the save cannot skip, done the
way the save does them at best (a (layer, role) group of 32 pieces copied into the Manager's own arena with
one numpy copy, each piece's CRC32C right after), with no Python around them but the loop.

Usage: PYTHONPATH=<tree> python floor.py [--repeat 20]
Prints the save's best and median microseconds per segment (wall, invalidate-all between saves, as the bench's
repeats), the floor's best, and the share of the save's time outside the floor."""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import crc32c
import numpy as np

from orbitkv_fs.keys import chunk_key
from orbitkv_fs.manager import ChunkBlocks, Manager, ManagerConfig
from orbitkv_fs.segment import HEADER_SIZE
from orbitkv_fs.tiers.dram import UNIT
from orbitkv_fs.tools import bench_pipeline as B


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=20)
    a = ap.parse_args()
    blocks = 512
    pages, reg = B._engine(blocks, B.LAYERS)
    try:
        with Manager(ManagerConfig(pool_size=2 * blocks * B.BLOCK_BYTES * B.LAYERS * 2 + (64 << 20), storage_codec="none",
                                   device="cpu")) as m:
            e = m.register_engine(reg)
            chunks = [ChunkBlocks(chunk_key(f"floor-{i}"), [i]) for i in range(blocks)]
            nseg = blocks * B.LAYERS * 2
            gc.collect()
            gc.freeze()
            saves = []
            for _ in range(a.repeat):
                m.invalidate(all=True)
                t = time.perf_counter()
                m.save(e.engine_id, chunks)
                saves.append((time.perf_counter() - t) / nseg * 1e6)
            m.invalidate(all=True)
            buf = m.dram.arena.buf
            n, group = B.BLOCK_BYTES, 32
            piece = -(-(n + HEADER_SIZE) // UNIT) * UNIT
            srcs = [pages.array(t).reshape(blocks, -1).view(np.uint8) for t in pages.tensors]
            floors = []
            with memoryview(buf) as mv:
                for _ in range(a.repeat):
                    t = time.perf_counter()
                    off = 0
                    for src in srcs:
                        for g in range(0, blocks, group):
                            np.copyto(buf[off:off + group * piece].reshape(group, piece)[:, HEADER_SIZE:HEADER_SIZE + n],
                                      src[g:g + group])
                            [crc32c.crc32c(mv[o + HEADER_SIZE:o + HEADER_SIZE + n])
                             for o in range(off, off + group * piece, piece)]
                            off += group * piece
                    floors.append((time.perf_counter() - t) / nseg * 1e6)
    finally:
        pages.close()
    best, floor = min(saves), min(floors)
    print(f"none 32 KiB: {nseg} segments a save; save best {best:.2f} us/segment, median {statistics.median(saves):.2f}; "
          f"floor (copy + CRC32C in groups of {group}) best {floor:.2f}; outside the floor {1 - floor / best:.0%} of the "
          f"best save")


if __name__ == "__main__":
    main()
