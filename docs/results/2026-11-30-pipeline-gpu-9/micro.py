"""Per-segment host costs behind this change, each next to what it replaced, in one run (timeit, best of 5
rounds of 20,000 calls): a save's header built and written into the arena, a restore's header parsed, and an
encode item built. ``python micro.py`` (no GPU needed)."""
import platform
import timeit
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import msgspec
import numpy as np

from orbitkv_fs.segment import (AnsType, Format, HeaderTemplates, RawReason, Role, SegmentHeader, pack_header_into,
                                parse_header)

BF16 = np.dtype(ml_dtypes.bfloat16)
arena = np.zeros(1 << 21, np.uint8)
mv = memoryview(arena)
FIELDS = (Format.FP8, BF16, 1 << 19, 1 << 18, Role.KEY, 5, 8, 0, 0, 0, AnsType.NONE, RawReason.NONE)
templates = HeaderTemplates()


def best(f) -> float:
    return min(timeit.repeat(f, number=20000, repeat=5)) / 20000 * 1e6


def old_header() -> None:
    h = SegmentHeader(Format.FP8, BF16, 1 << 19, 1 << 18, 12345, role=Role.KEY, layer=5, bits=8, head_dim=0,
                      sign_version=0, rotation_seed=0, ans_type=AnsType.NONE, raw_reason=RawReason.NONE)
    pack_header_into(h, arena, 4096)


@dataclass(frozen=True)
class OldEncodeItem:  # the dataclass EncodeItem was
    array: Any
    codec: str
    role: Any = Role.OPAQUE
    layer: int = 0
    dtype: Any = None
    raw_reason: RawReason = RawReason.NONE


class NewEncodeItem(msgspec.Struct, frozen=True):  # as gpu.engine.EncodeItem is now (without cupy)
    array: Any
    codec: str
    role: Any = Role.OPAQUE
    layer: int = 0
    dtype: Any = None
    raw_reason: RawReason = RawReason.NONE


old_header()
segment = mv[4096:4096 + 64 + (1 << 18)]
templates.parse(segment)
print(f"host: {platform.processor() or platform.machine()}, Python {platform.python_version()}, numpy {np.__version__}")
print(f"save header into the arena: SegmentHeader + pack_header_into {best(old_header):.2f} us, "
      f"HeaderTemplates.pack_into {best(lambda: templates.pack_into(FIELDS, 12345, mv, 4096)):.2f} us")
print(f"restore header check: parse_header {best(lambda: parse_header(segment)):.2f} us, "
      f"HeaderTemplates.parse {best(lambda: templates.parse(segment)):.2f} us")
print(f"encode item: frozen dataclass {best(lambda: OldEncodeItem(1, 'fp8', Role.KEY, 3, BF16, RawReason.NONE)):.2f} us, "
      f"msgspec struct {best(lambda: NewEncodeItem(1, 'fp8', Role.KEY, 3, BF16, RawReason.NONE)):.2f} us")
