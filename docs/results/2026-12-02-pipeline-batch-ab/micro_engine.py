"""Host cost of the GPU engine's per-batch planning, old (385478c) against this tree, in one process, rounds
alternating: descriptor rows of an encode and a decode batch (256 segments: fp8, TurboQuant K/V, raw), and
the headers of an encode batch written into its host region. Needs cupy importable (no GPU: only host code
runs). Usage, from the repository root: python docs/results/2026-12-02-pipeline-batch-ab/micro_engine.py
[OLD_ENGINE_PY] (default: ab-base/gpu/engine.py) -> prints JSON."""

from __future__ import annotations

import importlib.util
import json
import random
import sys
import time
import types

import ml_dtypes
import numpy as np

import orbitkv_fs.gpu.engine as new
from orbitkv_fs.segment import HEADER_SIZE, HeaderTemplates, Role, SegmentHeader

BF16 = np.dtype(ml_dtypes.bfloat16)


def load_old(path: str):
    spec = importlib.util.spec_from_file_location("orbitkv_fs.gpu._old_engine", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "orbitkv_fs.gpu"
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def plans(k: int, seed: int = 0) -> list:
    rng = random.Random(seed)
    out = []
    for j in range(k):
        kind = ["fp8", "tq", "raw"][j % 3]
        n = 512 << 10
        out.append(types.SimpleNamespace(kind=kind, meta=j, i=j, ptr=rng.getrandbits(40), n=n, dtype=BF16,
                                         role=Role.KEY if j % 2 else Role.VALUE, layer=j % 36, head_dim=128, bits=4,
                                         cap=n // 2 if kind == "fp8" else n // 3, slot=j * (n + 256),
                                         nch=0, chunk0=0, tmp=0))
    return out


def groups(ps: list) -> tuple:
    tq = [p for p in ps if p.kind == "tq"]
    return (("okv_fp8_encode", [p for p in ps if p.kind == "fp8"]),
            ("okv_tq_encode_k", [p for p in tq if p.role == Role.KEY]),
            ("okv_tq_encode_v", [p for p in tq if p.role != Role.KEY]), ("okv_ans_pack", []),
            ("okv_crc32c", [p for p in ps if p.kind in ("raw", "tq")]))


def dec_plans(ps: list) -> list:
    out = []
    for p in ps:
        h = SegmentHeader(1 if p.kind == "raw" else 2, BF16, p.n, p.cap, 7, role=p.role, layer=p.layer)
        out.append(types.SimpleNamespace(kind=p.kind if p.kind != "tq" else "fp8", h=h, meta=p.meta, staged=p.slot,
                                         dst=types.SimpleNamespace(ptr=p.ptr), scratch=0, chunk0=0))
    return out


def best(fn, reps: int = 30) -> float:
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        t.append(time.perf_counter() - t0)
    return min(t)


def main() -> None:
    old = load_old(sys.argv[1] if len(sys.argv) > 1 else "ab-base/gpu/engine.py")
    k = 256
    ps = plans(k)
    dps = dec_plans(ps)
    buf = np.zeros(128 * (2 * k + 8), np.uint8)
    off = {"pay_len": 0, "chunk_sizes": 0, "chunk_status": 0}
    host = np.zeros(k * ((512 << 10) + 256), np.uint8)
    # Old header step: a template pack per segment (as _finish_encode did); new: rows, CRCs, one scatter.
    # One tuple per (layer, role) class, shared by its segments, as the engine's plans share their class's.
    classes = {(p.layer, int(p.role)): (int(new.Format.FP8), 4, p.n, p.n // 2, int(p.role), p.layer, 8, 0, 0, 0, 0, 0)
               for p in ps}
    heads = [classes[(p.layer, int(p.role))] for p in ps]
    enum_heads = [(new.Format.FP8, BF16, p.n, p.n // 2, p.role, p.layer, 8, 0, 0, 0, new.AnsType.NONE,
                   new.RawReason.NONE) for p in ps]
    crcs = np.arange(k, dtype=np.uint32)
    eng = object.__new__(new.GpuCodecEngine)
    eng._rows = {}

    templates = HeaderTemplates()  # kept across batches, as the old engine kept it

    def old_headers() -> None:
        t, mv = templates, memoryview(host)
        for p, h, c in zip(ps, enum_heads, crcs.tolist()):
            t.pack_into(h, c, mv, p.slot)

    def new_headers() -> None:
        tids, rows, bases = eng._template_ids(heads)
        raw = rows[tids]
        hdr = raw.view(new.HEADER_DTYPE)[:, 0]
        hdr["payload_crc"] = crcs
        hdr["header_crc"] = new.header_crcs(bases[tids], crcs)
        slots = np.fromiter([p.slot for p in ps], np.int64, count=k)
        host[slots[:, None] + np.arange(HEADER_SIZE)] = raw

    cases = {
        "encode_rows": (lambda: old._encode_rows(buf, 0, groups(ps), 1 << 40, 7, 0, 0, off),
                        lambda: new._encode_rows(buf, 0, groups(ps), 1 << 40, 7, 0, 0, off)),
        "decode_rows": (lambda: old._decode_rows(buf, 0, dps, [p for p in dps if p.kind == "fp8"], [],
                                                 [p for p in dps if p.kind == "raw"], lambda p: 1 << 40,
                                                 list(range(k)), 0, 0, 0),
                        lambda: new._decode_rows(buf, 0, dps, [p for p in dps if p.kind == "fp8"], [],
                                                 [p for p in dps if p.kind == "raw"], lambda p: 1 << 40,
                                                 list(range(k)), 0, 0, 0)),
        "encode_headers": (old_headers, new_headers),
    }
    res: dict = {"segments_per_batch": k, "rounds": 5}
    for name, (a, b) in cases.items():
        olds, news = [], []
        for r in range(5):  # alternating
            pair = (a, b) if r % 2 == 0 else (b, a)
            for fn in pair:
                (olds if fn is a else news).append(best(fn))
        res[name] = {"old_us_per_segment": min(olds) / k * 1e6, "new_us_per_segment": min(news) / k * 1e6}
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
