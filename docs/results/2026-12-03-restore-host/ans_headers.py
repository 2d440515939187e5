"""The batch header check (``_verify_headers``) of a 230-segment `ans` restore batch (a 512 KiB batch of the
bench's Manager): BF16 ANS headers of 72 layer/role classes, each its own payload length, another batch's lengths
each repeat (as a restore's batches differ in them). Usage: PYTHONPATH=TREE python ans_headers.py
(TREE laid out as the build maps it; the installed tree without it). Prints the median per batch."""

import statistics
import time

import ml_dtypes
import numpy as np

from orbitkv_fs.manager.verify import _verify_headers
from orbitkv_fs.segment import AnsType, Format, Role, SegmentHeader, pack_header


def main() -> None:
    rng = np.random.default_rng(1)
    n = 230
    hs = [SegmentHeader(Format.ANS, np.dtype(ml_dtypes.bfloat16), 512 << 10, int(rng.integers(300000, 380000)),
                        int(rng.integers(0, 1 << 32)), role=Role(i % 2), layer=i // 2 % 36, ans_type=AnsType.FLOAT16)
          for i in range(n)]
    heads = np.frombuffer(b"".join(pack_header(h) for h in hs), np.uint8).reshape(n, 64).copy()
    layers = np.array([h.layer for h in hs])
    roles = np.array([int(h.role) for h in hs])
    lengths = np.array([h.stored_length + 64 for h in hs])
    times = []
    for _ in range(300):
        heads.view("<u4").reshape(n, 16)[:, 5] = rng.integers(300000, 380000, n)  # the stored lengths (not re-signed)
        t = time.perf_counter()
        _verify_headers(heads, layers, roles, lengths)
        times.append(time.perf_counter() - t)
    print(f"{statistics.median(times) * 1e6:.1f} us per {n}-header ANS batch")


if __name__ == "__main__":
    main()
