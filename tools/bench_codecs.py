"""``orbitkv-bench codecs``: GB/s of each codec direction, next to baselines measured in the same run.

``--device cpu`` (default) times, single-threaded (``NUMBA_NUM_THREADS=1``; numpy casts are single
threaded), on one 16 MiB buffer of BF16 values:

* baselines: ``np.copyto`` (memory bandwidth), numpy's BF16->FP32 ``astype`` and ml_dtypes' BF16->E4M3FN
  ``astype`` (the independent FP8 reference);
* FP8 kernels alone (:func:`~orbitkv_fs.codecs.fp8.encode_fp8` / ``decode_fp8``) and every codec through
  the segment API (:func:`~orbitkv_fs.codecs.encode_segment` / ``decode_segment``: policy, header and
  CRC32C included): none, fp8, turboquant-4/-3 for keys and for values; CRC32C alone.

GB/s counts source (BF16) bytes in both directions; each figure is the median of ``--repeat`` runs after
one warm-up. Data: the real per-layer K and V of SmolLM2-135M (:func:`orbitkv_fs.tools.models.prefill_kv`,
K layers then V layers), tiled to 16 MiB; where the model is not installed (or with ``--synthetic``), a
synthetic stand-in: Gaussian K with per-channel standard deviations log-uniform in [0.25, 4] (keys have
outlier channels) and Gaussian V with standard deviation 0.5, head_dim 64, fixed seed. Targets (issue 2):
FP8 encode >= 10x ml_dtypes' astype and >= 0.5x numpy's BF16->FP32 astype, judged like for like on the
FP8 kernel (array in, array out, as the two casts); the segment-level ratios (range check, CRC32C, header
and the copies of ``build_segment`` included) are reported next to them.

``--device gpu`` hands the same arguments to :func:`orbitkv_fs.gpu.bench.run_codecs` and prints/saves its
dict. ``--out DIR`` writes ``codecs-<device>.json`` and ``codecs-<device>.md`` there.
"""

from __future__ import annotations

import os

os.environ["NUMBA_NUM_THREADS"] = "1"  # before numba loads: the figures are single-threaded by contract

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

BUFFER_BYTES = 16 << 20
HEAD_DIM_SYNTHETIC = 64
TARGET_VS_ML_DTYPES = 10.0
TARGET_VS_NUMPY_F32 = 0.5
BF16 = np.dtype(ml_dtypes.bfloat16)


def _tile(parts: list[np.ndarray], n: int) -> np.ndarray:
    flat = np.concatenate([p.reshape(-1).view(np.uint16) for p in parts])
    return np.resize(flat, n).view(BF16)


def load_data(synthetic: bool = False) -> tuple[np.ndarray, np.ndarray, int, str]:
    """(K buffer, V buffer, head_dim, description): each buffer BF16 of BUFFER_BYTES."""
    n = BUFFER_BYTES // 2
    if not synthetic:
        from .models import ModelUnavailable, prefill_kv

        try:
            kv = prefill_kv()
        except ModelUnavailable as e:
            print(f"orbitkv-bench codecs: {e}; using synthetic data", file=sys.stderr)
        else:
            k = _tile([pair[0] for pair in kv], n)
            v = _tile([pair[1] for pair in kv], n)
            t, h, d = kv[0][0].shape
            return k, v, d, f"SmolLM2-135M K and V ({len(kv)} layers x {t} tokens x {h} heads x {d}), tiled"
    rng = np.random.default_rng(1234)
    d = HEAD_DIM_SYNTHETIC
    sd = np.exp(rng.uniform(np.log(0.25), np.log(4.0), d)).astype(np.float32)
    k = (rng.standard_normal((n // d, d), dtype=np.float32) * sd).astype(BF16).reshape(-1)
    v = (rng.standard_normal(n, dtype=np.float32) * np.float32(0.5)).astype(BF16)
    return k, v, d, "synthetic: Gaussian K, per-channel sd log-uniform in [0.25, 4]; Gaussian V, sd 0.5"


def _median_s(fn: Callable[[], Any], repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run_cpu(repeat: int = 5, synthetic: bool = False) -> dict[str, Any]:
    """All CPU figures as one dict (GB/s of source bytes, medians)."""
    import crc32c
    import numba

    from orbitkv_fs.codecs import decode_segment, encode_segment
    from orbitkv_fs.codecs.fp8 import decode_fp8, encode_fp8
    from orbitkv_fs.segment import parse_header

    k, v, d, desc = load_data(synthetic)
    both = np.concatenate([k[: k.size // 2], v[: v.size // 2]])  # FP8 sees K and V alike
    nbytes = both.nbytes
    gbps = lambda seconds: nbytes / seconds / 1e9  # noqa: E731
    figures: dict[str, float] = {}
    dst = np.empty_like(both)
    figures["baseline_memcpy"] = gbps(_median_s(lambda: np.copyto(dst, both), repeat))
    figures["baseline_numpy_bf16_to_fp32_astype"] = gbps(_median_s(lambda: both.astype(np.float32), repeat))
    figures["baseline_ml_dtypes_bf16_to_fp8_astype"] = gbps(
        _median_s(lambda: both.astype(ml_dtypes.float8_e4m3fn), max(1, repeat // 2)))
    figures["crc32c"] = gbps(_median_s(lambda: crc32c.crc32c(both), repeat))

    codes = encode_fp8(both)
    if not isinstance(codes, np.ndarray):
        raise RuntimeError(f"benchmark data not FP8-encodable ({codes.name})")
    figures["fp8_kernel_encode"] = gbps(_median_s(lambda: encode_fp8(both), repeat))
    figures["fp8_kernel_decode"] = gbps(_median_s(lambda: decode_fp8(codes, BF16), repeat))

    formats: dict[str, str] = {}
    cases = [("none", "opaque", both), ("fp8", "opaque", both)]
    cases += [(f"turboquant-{b}", role, buf.reshape(-1, d)) for b in (4, 3) for role, buf in (("key", k), ("value", v))]
    for codec, role, buf in cases:
        label = codec if role == "opaque" else f"{codec}_{role}"
        blob = encode_segment(buf, codec, role=role, layer=1)
        formats[label] = parse_header(blob).format.name.lower()
        figures[f"{label}_segment_encode"] = gbps(_median_s(lambda: encode_segment(buf, codec, role=role, layer=1), repeat))
        figures[f"{label}_segment_decode"] = gbps(_median_s(lambda: decode_segment(blob), repeat))

    enc = figures["fp8_segment_encode"]
    ratios = {
        "fp8_segment_encode_vs_ml_dtypes": enc / figures["baseline_ml_dtypes_bf16_to_fp8_astype"],
        "fp8_segment_encode_vs_numpy_fp32": enc / figures["baseline_numpy_bf16_to_fp32_astype"],
        "fp8_kernel_encode_vs_ml_dtypes": figures["fp8_kernel_encode"] / figures["baseline_ml_dtypes_bf16_to_fp8_astype"],
        "fp8_kernel_encode_vs_numpy_fp32": figures["fp8_kernel_encode"] / figures["baseline_numpy_bf16_to_fp32_astype"],
    }
    return {
        "device": "cpu",
        "data": desc,
        "buffer_bytes": nbytes,
        "repeat": repeat,
        "threads": {"numba": numba.get_num_threads(), "NUMBA_NUM_THREADS": os.environ.get("NUMBA_NUM_THREADS")},
        "host": {"machine": platform.machine(), "processor": platform.processor() or platform.machine(),
                 "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                 "numba": numba.__version__, "ml_dtypes": ml_dtypes.__version__,
                 "load_average_1min_at_end": round(os.getloadavg()[0], 2)},
        "segment_formats": formats,
        "GBps": figures,
        "ratios": ratios,
        "targets": {"fp8_encode_vs_ml_dtypes": TARGET_VS_ML_DTYPES, "fp8_encode_vs_numpy_fp32": TARGET_VS_NUMPY_F32},
        "meets": {
            "fp8_encode_vs_ml_dtypes": ratios["fp8_kernel_encode_vs_ml_dtypes"] >= TARGET_VS_ML_DTYPES,
            "fp8_encode_vs_numpy_fp32": ratios["fp8_kernel_encode_vs_numpy_fp32"] >= TARGET_VS_NUMPY_F32,
        },
    }


def markdown(res: dict[str, Any]) -> str:
    """A short markdown report of a CPU result: the command, the data, one table."""
    lines = [f"# orbitkv-bench codecs --device {res['device']}", "", f"Command: `{res['command']}`", "",
             f"Data: {res['data']}; {res['buffer_bytes'] / 2**20:.0f} MiB BF16 per figure; median of "
             f"{res['repeat']} runs; single thread (numba threads: {res['threads']['numba']}).", "",
             f"Host: {res['host']['processor']}, {res['host']['cpus']} CPUs, Python {res['host']['python']}, "
             f"numpy {res['host']['numpy']}, numba {res['host']['numba']}, ml_dtypes {res['host']['ml_dtypes']}; "
             f"1-minute load average at the end {res['host']['load_average_1min_at_end']} (a shared machine "
             "makes absolute figures noisy; baselines and codecs ran back to back in one process).",
             "", "| operation | GB/s (source bytes) |", "| --- | ---: |"]
    lines += [f"| {name} | {val:.3f} |" for name, val in res["GBps"].items()]
    lines += ["", "| ratio | value | target | met |", "| --- | ---: | ---: | --- |"]
    for name, target_key in (("fp8_kernel_encode_vs_ml_dtypes", "fp8_encode_vs_ml_dtypes"),
                             ("fp8_kernel_encode_vs_numpy_fp32", "fp8_encode_vs_numpy_fp32")):
        lines.append(f"| {name} | {res['ratios'][name]:.2f}x | {res['targets'][target_key]}x | "
                     f"{'yes' if res['meets'][target_key] else 'NO'} |")
    for name in ("fp8_segment_encode_vs_ml_dtypes", "fp8_segment_encode_vs_numpy_fp32"):
        lines.append(f"| {name} (header, CRC32C, copies) | {res['ratios'][name]:.2f}x | | |")
    lines += ["", "Segment formats produced (raw would mean the policy declined): "
              + ", ".join(f"{k}={v}" for k, v in res["segment_formats"].items()) + "."]
    return "\n".join(lines) + "\n"


def _table(res: dict[str, Any]) -> str:
    rows = [f"{name:<44} {val:>9.3f} GB/s" for name, val in res["GBps"].items()]
    rows += [f"{name:<44} {val:>9.2f}x" for name, val in res["ratios"].items()]
    rows += [f"target {name:<37} {'met' if ok else 'NOT MET'}" for name, ok in res["meets"].items()]
    return f"data: {res['data']}\n" + "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-bench codecs", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", type=Path, help="also write codecs-<device>.json and .md into this folder")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per figure (cpu 5, gpu 20)")
    p.add_argument("--synthetic", action="store_true", help="cpu: use the synthetic data even if SmolLM2 is there")
    p.add_argument("--size-mb", type=int, default=None, help="gpu: buffer size (default 1024)")
    p.add_argument("--kv", default=None, help="gpu: .npz of real K/V (uint16 BF16 bits 'k', 'v'); see --save-kv")
    p.add_argument("--storage-codec-budget", type=int, default=None, help="gpu: engine workspace bytes")
    p.add_argument("--save-kv", type=Path, default=None,
                   help="write SmolLM2's K/V as the .npz --kv reads, then exit (run where the model is installed)")
    return p


def save_kv(path: Path) -> None:
    """SmolLM2's per-layer K and V as ``k``, ``v`` uint16 arrays of BF16 bits ``[layers, tokens, heads, D]``."""
    from .models import prefill_kv

    kv = prefill_kv()
    np.savez(path, k=np.stack([p[0] for p in kv]).view(np.uint16), v=np.stack([p[1] for p in kv]).view(np.uint16))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.command_line = "orbitkv-bench codecs " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.save_kv:
        save_kv(args.save_kv)
        print(f"wrote {args.save_kv}")
        return 0
    if args.device == "gpu":
        try:
            from orbitkv_fs.gpu.bench import run_codecs
        except ImportError as e:
            print(f"orbitkv-bench codecs --device gpu: the GPU stack is not usable here ({e}); "
                  "pip install 'orbitkv-fs[gpu]' on a machine with a CUDA GPU", file=sys.stderr)
            return 2
        res = run_codecs(args)
        res.setdefault("command", args.command_line)
        text = None
    else:
        res = run_cpu(repeat=args.repeat or 5, synthetic=args.synthetic)
        res["command"] = args.command_line
        text = markdown(res)
    print(json.dumps(res, indent=2) if args.json or text is None else _table(res))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"codecs-{args.device}.json").write_text(json.dumps(res, indent=2) + "\n")
        if text is not None:
            (args.out / f"codecs-{args.device}.md").write_text(text)
    return 0
