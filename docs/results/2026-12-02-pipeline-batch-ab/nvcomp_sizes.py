"""nvCOMP 5.3 ANS temp sizes against batch shape, and the host cost of asking: does the per-segment fit check
of an ANS batch (one GetTempSize per segment added) cost what the 4 MiB ANS save's host time suggests?
Usage on a GPU machine: python nvcomp_sizes.py -> JSON on stdout."""

from __future__ import annotations

import json
import time

from orbitkv_fs.gpu import nvcomp
from orbitkv_fs.segment import AnsType

CHUNK = 65536


def main() -> None:
    nv = nvcomp.load()
    out: dict = {"compress": [], "decompress": []}
    for chunks in (1, 8, 64, 512, 2048):
        for t in (AnsType.FLOAT16, AnsType.BYTES):
            total = chunks * CHUNK
            t0 = time.perf_counter()
            c = nv._compress_temp_bytes(chunks, CHUNK, total, t)
            t1 = time.perf_counter()
            d = nv._decompress_temp_bytes(chunks, CHUNK, total, t)
            t2 = time.perf_counter()
            out["compress"].append({"chunks": chunks, "type": t.name, "temp_bytes": c, "call_us": (t1 - t0) * 1e6})
            out["decompress"].append({"chunks": chunks, "type": t.name, "temp_bytes": d, "call_us": (t2 - t1) * 1e6})
    out["max_compressed_chunk_bytes"] = nv._max_compressed_bytes(CHUNK, AnsType.FLOAT16)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
