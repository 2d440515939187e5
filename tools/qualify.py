"""``orbitkv-qualify``: measure what a codec does to your own KV before you turn it on.

Lossy codecs (``fp8``, ``turboquant-*``) are opt-in and experimental; this tool runs the exact code path
the cache uses (:func:`orbitkv_fs.codecs.encode_segment` / :func:`~orbitkv_fs.codecs.decode_segment`,
keep-or-raw policy included) over ``.npy`` dumps and reports, per file and in total:

* relative MSE ``sum((x - x^)^2) / sum(x^2)`` over all elements,
* mean and minimum cosine similarity between each vector (last axis) and its reconstruction,
* maximum absolute error,
* logical bytes (source) and stored bytes (segment headers + payloads), and the raw fallbacks by reason.

Inputs: float16 or bfloat16 arrays, any shape whose last axis is head_dim (e.g. ``[tokens, kv_heads,
head_dim]``). ``np.save`` writes bfloat16 as the opaque ``|V2`` dtype; it is read back as bfloat16.
float32 dumps (what ``tensor.float().numpy()`` and ``orbitkv-inspect dump`` give) are read as the
16-bit type they hold exactly with ``--dtype auto`` (the default): bfloat16 when every value is a
bfloat16 value, else float16 when every value is a float16 value, else rounded to bfloat16;
``--dtype bf16|fp16`` rounds to that type. Rows are cut into segments of at most ``--segment-bytes``
(default 16 MiB, the encodable maximum). Files whose work takes more than a moment show a progress bar
on a terminal (:mod:`orbitkv_fs.progress`).

Primitives: :func:`load_kv` (file -> array), :func:`qualify_array` (array -> :class:`Quality`),
:func:`main` (the CLI). Core imports only; no torch, no GPU (except for ``--codec ans``).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import ml_dtypes
import numpy as np

from orbitkv_fs.codecs import CODEC_NAMES, decode_segment, encode_segment
from orbitkv_fs.console import HelpFormatter, entry_point
from orbitkv_fs.errors import OrbitKVError
from orbitkv_fs.progress import progress
from orbitkv_fs.segment import MAX_SOURCE_BYTES, Format, RawReason, parse_header

BF16 = np.dtype(ml_dtypes.bfloat16)
FP16 = np.dtype(np.float16)
DTYPES = {"bf16": BF16, "fp16": FP16}


class QualifyInputError(OrbitKVError):
    """A file that cannot be qualified (unreadable, not numeric, empty)."""


@dataclass
class Quality:
    """What a codec did to one array (or, summed with :meth:`merge`, to several)."""

    elements: int = 0
    vectors: int = 0
    sq_error: float = 0.0
    sq_ref: float = 0.0
    cos_sum: float = 0.0
    cos_count: int = 0
    min_cosine: float = 1.0
    max_abs_error: float = 0.0
    logical_bytes: int = 0
    stored_bytes: int = 0
    segments: int = 0
    raw_segments: dict[str, int] = field(default_factory=dict)

    @property
    def relative_mse(self) -> float:
        return self.sq_error / self.sq_ref if self.sq_ref else 0.0

    @property
    def mean_cosine(self) -> float:
        return self.cos_sum / self.cos_count if self.cos_count else 1.0

    @property
    def ratio(self) -> float:
        """Logical over stored bytes (headers included): above 1 means the codec saves space."""
        return self.logical_bytes / self.stored_bytes if self.stored_bytes else 0.0

    def merge(self, other: "Quality") -> None:
        for name in ("elements", "vectors", "sq_error", "sq_ref", "cos_sum", "cos_count", "logical_bytes",
                     "stored_bytes", "segments"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self.min_cosine = min(self.min_cosine, other.min_cosine)
        self.max_abs_error = max(self.max_abs_error, other.max_abs_error)
        self.raw_segments = dict(Counter(self.raw_segments) + Counter(other.raw_segments))

    def summary(self) -> dict:
        out = asdict(self)
        for name in ("sq_error", "sq_ref", "cos_sum", "cos_count"):
            out.pop(name)
        out.update(relative_mse=self.relative_mse, mean_cosine=self.mean_cosine, ratio=self.ratio)
        return out


def _exact_16bit(x: np.ndarray) -> np.ndarray:
    """``x`` (float32/64) as the 16-bit type that holds every value exactly; else rounded to bfloat16."""
    for dt in (BF16, FP16):
        with np.errstate(over="ignore", invalid="ignore"):
            y = x.astype(dt)
        if np.array_equal(y.astype(x.dtype), x, equal_nan=True):
            return y
    return x.astype(BF16)


def load_kv(path: "str | Path", dtype: str = "auto") -> np.ndarray:
    """The array in ``path`` as float16/bfloat16 (``|V2`` read as bfloat16; float32/64 as the 16-bit type
    that holds it exactly with ``dtype="auto"``, else rounded to ``dtype``)."""
    try:
        x = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise QualifyInputError(f"{path}: cannot read as .npy: {e}") from None
    if x.dtype == np.dtype("V2"):
        x = x.view(BF16)
    elif x.dtype in (np.float32, np.float64):
        x = _exact_16bit(x) if dtype == "auto" else x.astype(DTYPES[dtype])
    elif x.dtype not in (BF16, FP16):
        raise QualifyInputError(f"{path}: dtype {x.dtype} is not float16, bfloat16 or float32")
    if x.ndim == 0 or x.size == 0:
        raise QualifyInputError(f"{path}: empty array")
    return x


def qualify_array(x: np.ndarray, codec: str, role: str, *, layer: int = 0,
                  segment_bytes: int = MAX_SOURCE_BYTES, on_segment: Callable[[int], None] | None = None) -> Quality:
    """Encode and decode ``x`` segment by segment exactly as the cache would, and measure the damage.
    ``on_segment`` gets each segment's source bytes once it is measured (a progress bar's ``update``)."""
    d = x.shape[-1] if x.ndim > 1 else x.size
    rows = np.ascontiguousarray(x).reshape(-1, d)
    per_segment = max(1, segment_bytes // (d * x.dtype.itemsize))
    q = Quality()
    for start in range(0, rows.shape[0], per_segment):
        part = rows[start:start + per_segment]
        blob = encode_segment(part, codec, role=role, layer=layer)
        h = parse_header(blob)
        y = decode_segment(blob).reshape(part.shape).astype(np.float64)
        ref = part.astype(np.float64)
        diff = ref - y
        q.segments += 1
        q.logical_bytes += part.nbytes
        q.stored_bytes += len(blob)
        if h.format == Format.RAW and codec != "none":
            reason = RawReason(h.raw_reason).name.lower()
            q.raw_segments[reason] = q.raw_segments.get(reason, 0) + 1
        q.elements += part.size
        q.vectors += part.shape[0]
        q.sq_error += float((diff * diff).sum())
        q.sq_ref += float((ref * ref).sum())
        q.max_abs_error = max(q.max_abs_error, float(np.abs(diff).max()))
        nx = np.sqrt((ref * ref).sum(axis=1))
        ny = np.sqrt((y * y).sum(axis=1))
        ok = (nx > 0) & (ny > 0)  # cosine is undefined for zero vectors; both zero is counted as exact
        cos = (ref[ok] * y[ok]).sum(axis=1) / (nx[ok] * ny[ok])
        exact_zero = int(((nx == 0) & (ny == 0)).sum())
        q.cos_sum += float(cos.sum()) + exact_zero
        q.cos_count += int(ok.sum()) + exact_zero
        if ok.any():
            q.min_cosine = min(q.min_cosine, float(cos.min()))
        if ((nx == 0) != (ny == 0)).any():
            q.min_cosine = min(q.min_cosine, 0.0)
        if on_segment is not None:
            on_segment(part.nbytes)
    return q


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="orbitkv-qualify",
        description="Measure a codec's error on your own KV dumps (.npy, last axis = head_dim).",
        formatter_class=HelpFormatter,
    )
    p.add_argument("files", nargs="+", type=Path, metavar="FILE.npy",
                   help="K or V dumps: bfloat16, float16, or float32 (see --dtype)")
    p.add_argument("--codec", required=True, choices=CODEC_NAMES, help="the codec to measure")
    p.add_argument("--role", required=True, choices=("key", "value"), help="what the files hold")
    p.add_argument("--layer", type=int, default=0, help="layer index (seeds TurboQuant's signs)")
    p.add_argument("--dtype", choices=["auto", *sorted(DTYPES)], default="auto",
                   help="what float32 dumps hold: auto: the 16-bit type that holds every value exactly "
                        "(bf16, else fp16, else rounded to bf16); bf16/fp16: round to it (default auto)")
    p.add_argument("--segment-bytes", type=int, default=MAX_SOURCE_BYTES,
                   help="source bytes per segment (default and maximum 16 MiB)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    return p


def _fmt_row(name: str, q: Quality) -> str:
    raw = ",".join(f"{k}:{v}" for k, v in sorted(q.raw_segments.items())) or "-"
    return (f"{name:<32} {q.relative_mse:>10.3e} {q.mean_cosine:>9.6f} {q.min_cosine:>9.6f} "
            f"{q.max_abs_error:>10.4g} {q.logical_bytes:>12} {q.stored_bytes:>12} {q.ratio:>6.2f}x  {raw}")


@entry_point("orbitkv-qualify")
def main(argv: "list[str] | None" = None) -> int:
    args = build_parser().parse_args(argv)
    if not 0 < args.segment_bytes <= MAX_SOURCE_BYTES:
        print(f"orbitkv-qualify: --segment-bytes must be in 1..{MAX_SOURCE_BYTES}", file=sys.stderr)
        return 2
    results: dict[str, Quality] = {}
    total = Quality()
    try:
        for path in args.files:
            x = load_kv(path, args.dtype)
            with progress(x.nbytes, f"{path.name} ({args.codec})", "B") as bar:
                q = qualify_array(x, args.codec, args.role, layer=args.layer, segment_bytes=args.segment_bytes,
                                  on_segment=bar.update)
            results[str(path)] = q
            total.merge(q)
    except OrbitKVError as e:  # bad file, unsupported codec on this machine (ans without GPU), bad layer
        print(f"orbitkv-qualify: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"codec": args.codec, "role": args.role, "layer": args.layer,
                          "files": {k: v.summary() for k, v in results.items()}, "total": total.summary()},
                         indent=2))
        return 0
    print(f"codec {args.codec}, role {args.role}, layer {args.layer}")
    print(f"{'file':<32} {'rel MSE':>10} {'mean cos':>9} {'min cos':>9} {'max |err|':>10} "
          f"{'logical B':>12} {'stored B':>12} {'ratio':>7}  raw segments")
    for name, q in results.items():
        print(_fmt_row(name if len(name) <= 32 else "..." + name[-29:], q))
    if len(results) > 1:
        print(_fmt_row("total", total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
