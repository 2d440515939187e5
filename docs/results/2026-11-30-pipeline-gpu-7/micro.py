"""Per-call host costs behind two of this change's per-segment steps, each next to what it replaced, in one
run (timeit, best of 5 rounds of 20,000 calls): a segment's address (``hostmem.host_address`` against
numpy's ``.ctypes.data``) and its header written into the arena (``pack_header_into`` against
``pack_header`` plus a numpy copy). ``python micro.py`` (no GPU needed)."""
import platform
import timeit

import ml_dtypes
import numpy as np

from orbitkv_fs.hostmem import host_address
from orbitkv_fs.segment import Format, Role, SegmentHeader, pack_header, pack_header_into

arena = np.zeros(1 << 20, np.uint8)
view = memoryview(arena[4096:4096 + 65536])
h = SegmentHeader(Format.FP8, np.dtype(ml_dtypes.bfloat16), 1 << 22, 1 << 21, 123, role=Role.KEY, layer=5, bits=8)


def best(f) -> float:
    return min(timeit.repeat(f, number=20000, repeat=5)) / 20000 * 1e6


def old_header() -> None:
    arena[128:192] = np.frombuffer(pack_header(h), np.uint8)


print(f"host: {platform.processor() or platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}")
print(f"segment address: numpy .ctypes.data {best(lambda: np.frombuffer(view, np.uint8).ctypes.data):.2f} us, "
      f"host_address {best(lambda: host_address(view)):.2f} us")
print(f"header into the arena: pack_header + copy {best(old_header):.2f} us, "
      f"pack_header_into {best(lambda: pack_header_into(h, arena, 128)):.2f} us")
