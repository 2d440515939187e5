"""``orbitkv-bench codecs``: GB/s of each codec direction, next to baselines measured in the same run.

``--device cpu`` (default) times, single-threaded (``NUMBA_NUM_THREADS=1``; numpy casts are single
threaded), on one 16 MiB buffer of BF16 values:

* baselines: ``np.copyto`` (memory bandwidth), numpy's BF16->FP32 ``astype`` and ml_dtypes' BF16->E4M3FN
  ``astype`` (the independent FP8 reference);
* FP8 kernels alone (:func:`~orbitkv_fs.codecs.fp8.encode_fp8` / ``decode_fp8``) and every codec through
  the segment API (:func:`~orbitkv_fs.codecs.encode_segment` / ``decode_segment``: policy, header and
  CRC32C included): none, fp8, turboquant-4/-3 for keys and for values; CRC32C alone.

GB/s counts source (BF16) bytes in both directions; each figure is the median of ``--repeat`` runs after
one warm-up, the operations taking turns (round robin) so that load from other processes hits baselines
and codecs alike; figures come from wall time and, next to them, from the thread's CPU time. Data: the real per-layer K and V of SmolLM2-135M (:func:`orbitkv_fs.tools.models.prefill_kv`,
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

import argparse
import os
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import ml_dtypes
import numpy as np

from orbitkv_fs.console import HelpFormatter
from orbitkv_fs.progress import progress
from orbitkv_fs.provenance import code_identity

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


def _measure(ops: dict[str, Callable[[], Any]], repeat: int) -> tuple[dict[str, float], dict[str, float]]:
    """Median wall and thread-CPU seconds of each op. The ops run round robin (one warm-up each, then
    ``repeat`` rounds of every op), so a change in the machine's load hits baselines and codecs alike."""
    wall: dict[str, list[float]] = {name: [] for name in ops}
    cpu: dict[str, list[float]] = {name: [] for name in ops}
    with progress(len(ops) * (repeat + 1), "codecs", "op") as bar:
        for fn in ops.values():
            fn()
            bar.update()
        for _ in range(repeat):
            for name, fn in ops.items():
                c0, t0 = time.thread_time(), time.perf_counter()
                fn()
                wall[name].append(time.perf_counter() - t0)
                cpu[name].append(time.thread_time() - c0)
                bar.update()
    return ({k: statistics.median(v) for k, v in wall.items()}, {k: statistics.median(v) for k, v in cpu.items()})


def _ratios(f: dict[str, float]) -> dict[str, float]:
    ml, f32 = f["baseline_ml_dtypes_bf16_to_fp8_astype"], f["baseline_numpy_bf16_to_fp32_astype"]
    return {
        "fp8_kernel_encode_vs_ml_dtypes": f["fp8_kernel_encode"] / ml,
        "fp8_kernel_encode_vs_numpy_fp32": f["fp8_kernel_encode"] / f32,
        "fp8_segment_encode_vs_ml_dtypes": f["fp8_segment_encode"] / ml,
        "fp8_segment_encode_vs_numpy_fp32": f["fp8_segment_encode"] / f32,
    }


def run_cpu(repeat: int = 5, synthetic: bool = False) -> dict[str, Any]:
    """All CPU figures as one dict: GB/s of source bytes from median wall time (``GBps``) and from
    median thread CPU time (``GBps_cpu_time``, what one unshared core would do)."""
    import crc32c
    import numba

    numba.set_num_threads(1)  # the figures are single-threaded by contract (main() also sets the env)
    from orbitkv_fs.codecs import decode_segment, encode_segment
    from orbitkv_fs.codecs.fp8 import decode_fp8, encode_fp8
    from orbitkv_fs.segment import parse_header

    k, v, d, desc = load_data(synthetic)
    both = np.concatenate([k[: k.size // 2], v[: v.size // 2]])  # FP8 sees K and V alike
    nbytes = both.nbytes
    codes = encode_fp8(both)
    if not isinstance(codes, np.ndarray):
        raise RuntimeError(f"benchmark data not FP8-encodable ({codes.name})")
    dst = np.empty_like(both)
    ops: dict[str, Callable[[], Any]] = {
        "baseline_memcpy": lambda: np.copyto(dst, both),
        "baseline_numpy_bf16_to_fp32_astype": lambda: both.astype(np.float32),
        "baseline_ml_dtypes_bf16_to_fp8_astype": lambda: both.astype(ml_dtypes.float8_e4m3fn),
        "crc32c": lambda: crc32c.crc32c(both),
        "fp8_kernel_encode": lambda: encode_fp8(both),
        "fp8_kernel_decode": lambda: decode_fp8(codes, BF16),
    }
    formats: dict[str, str] = {}
    cases = [("none", "opaque", both), ("fp8", "opaque", both)]
    cases += [(f"turboquant-{b}", role, buf.reshape(-1, d)) for b in (4, 3) for role, buf in (("key", k), ("value", v))]
    for codec, role, buf in cases:
        label = codec if role == "opaque" else f"{codec}_{role}"
        blob = encode_segment(buf, codec, role=role, layer=1)
        formats[label] = parse_header(blob).format.name.lower()
        ops[f"{label}_segment_encode"] = lambda buf=buf, codec=codec, role=role: encode_segment(buf, codec, role=role, layer=1)
        ops[f"{label}_segment_decode"] = lambda blob=blob: decode_segment(blob)
    wall, cpu = _measure(ops, repeat)
    figures = {name: nbytes / t / 1e9 for name, t in wall.items()}
    figures_cpu = {name: nbytes / t / 1e9 for name, t in cpu.items()}
    ratios, ratios_cpu = _ratios(figures), _ratios(figures_cpu)
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
        "code": code_identity(),
        "segment_formats": formats,
        "GBps": figures,
        "GBps_cpu_time": figures_cpu,
        "ratios": ratios,
        "ratios_cpu_time": ratios_cpu,
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
             "makes absolute figures noisy; baselines and codecs took turns, round robin, in one process).",
             "", "| operation | GB/s, wall time | GB/s, thread CPU time |", "| --- | ---: | ---: |"]
    lines += [f"| {name} | {val:.3f} | {res['GBps_cpu_time'][name]:.3f} |" for name, val in res["GBps"].items()]
    lines += ["", "| ratio (wall time; CPU time in brackets) | value | target | met |", "| --- | ---: | ---: | --- |"]
    for name, target_key in (("fp8_kernel_encode_vs_ml_dtypes", "fp8_encode_vs_ml_dtypes"),
                             ("fp8_kernel_encode_vs_numpy_fp32", "fp8_encode_vs_numpy_fp32")):
        lines.append(f"| {name} | {res['ratios'][name]:.2f}x ({res['ratios_cpu_time'][name]:.2f}x) | "
                     f"{res['targets'][target_key]}x | "
                     f"{'yes' if res['meets'][target_key] else 'NO'} |")
    for name in ("fp8_segment_encode_vs_ml_dtypes", "fp8_segment_encode_vs_numpy_fp32"):
        lines.append(f"| {name} (header, CRC32C, copies) | {res['ratios'][name]:.2f}x "
                     f"({res['ratios_cpu_time'][name]:.2f}x) | | |")
    lines += ["", "Segment formats produced (raw would mean the policy declined): "
              + ", ".join(f"{k}={v}" for k, v in res["segment_formats"].items()) + "."]
    return "\n".join(lines) + "\n"


def _table(res: dict[str, Any]) -> str:
    rows = [f"{name:<44} {val:>9.3f} GB/s  (CPU time: {res['GBps_cpu_time'][name]:.3f})"
            for name, val in res["GBps"].items()]
    rows += [f"{name:<44} {val:>9.2f}x  (CPU time: {res['ratios_cpu_time'][name]:.2f}x)"
             for name, val in res["ratios"].items()]
    rows += [f"target {name:<37} {'met' if ok else 'NOT MET'}" for name, ok in res["meets"].items()]
    return f"data: {res['data']}\n" + "\n".join(rows)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-bench codecs", description=__doc__.split("\n\n")[0],
                                formatter_class=HelpFormatter)
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="where the codecs run")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.add_argument("--out", type=Path, help="also write codecs-<device>.json and .md into this folder "
                   "(default: print only)")
    p.add_argument("--repeat", type=int, default=None, help="timed runs per figure (default: cpu 5, gpu 20)")
    p.add_argument("--synthetic", action="store_true", help="cpu: use the synthetic data even if SmolLM2 is there")
    p.add_argument("--size-mb", type=int, default=None, help="gpu: buffer size (default 1024)")
    p.add_argument("--kv", default=None, help="gpu: .npz of real K/V (uint16 BF16 bits 'k', 'v'); see --save-kv "
                   "(default: $ORBITKV_REAL_KV, else synthetic data)")
    p.add_argument("--storage-codec-budget", type=int, default=None,
                   help="gpu: engine workspace bytes (default 64 MiB)")
    p.add_argument("--save-kv", type=Path, default=None,
                   help="write SmolLM2's K/V as the .npz --kv reads, then exit (run where the model is installed; "
                        "default: benchmark)")
    return p


def save_kv(path: Path) -> None:
    """SmolLM2's per-layer K and V as ``k``, ``v`` uint16 arrays of BF16 bits ``[layers, tokens, heads, D]``."""
    from .models import prefill_kv

    kv = prefill_kv()
    np.savez(path, k=np.stack([p[0] for p in kv]).view(np.uint16), v=np.stack([p[1] for p in kv]).view(np.uint16))


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ["NUMBA_NUM_THREADS"] = "1"  # before numba loads, here and in anything this run starts
    args.command_line = "orbitkv-bench codecs " + " ".join(sys.argv[1:] if argv is None else argv)
    if args.save_kv:
        from .models import ModelUnavailable

        try:
            save_kv(args.save_kv)
        except ModelUnavailable as e:
            print(f"orbitkv-bench codecs --save-kv: {e}", file=sys.stderr)
            return 2
        print(f"wrote {args.save_kv}")
        return 0
    if args.device == "gpu":
        from orbitkv_fs.gpu import unusable_reason

        why = unusable_reason()
        if why is None:
            try:
                from orbitkv_fs.gpu.bench import run_codecs
            except ImportError as e:  # the rest of the GPU stack (nvCOMP's binding, kvikio) missing
                why = str(e)
        if why is not None:
            print(f"orbitkv-bench codecs --device gpu: the GPU stack is not usable here ({why}); "
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
