"""TurboQuant encode builds side by side on one GPU, in one process: GB/s and bytes.

Variants are the package's gpu/kernels/turboquant.cu built with their own -D options (VARIANTS), and "base":
an older turboquant.cu given with --base (e.g. `git show 0a80477:gpu/kernels/turboquant.cu > tq_base.cu`:
K and V in one kernel `okv_tq_encode`, 128 float4 cells; the table it reads is built here). Builds run in
parallel processes (they fill the on-disk cache of module.build_module). Per variant it prints registers,
resident blocks, and GB/s of source (encode) / output (decode) for BF16 K and V, head dims 64 and 128, 3
and 4 bits (real K/V from ORBITKV_REAL_KV if set, else Gaussian), like orbitkv_fs.gpu.bench; and it checks
bytes:
  host  -- the first vectors of every benchmark buffer against the host codec (encode_key/encode_value),
  ref   -- the whole encoded buffer and the decode against the first variant's,
  sweep -- head dims 32..256, 3/4 bits, K/V, BF16/FP16, on 1 MiB of mixed-scale data per case (Gaussian
           rows scaled 2^-70..2^10 for BF16: subnormal squares and the slow division path included, zero
           rows, real rows), against the host codec (the host declining must show as a nonzero status).
Run from the repo root:  python scripts/tq_encode_variants.py [--variants base,e64b2] [--base tq_base.cu]
"""

from __future__ import annotations

import argparse
import importlib.resources
import multiprocessing as mp
import os
import sys
import time

import numpy as np

VARIANTS = {
    "base": None,  # the committed kernel (0a80477): K and V 8 elements per lane, 4 blocks, 128 float4 cells
    "e64b2": (),  # K: 64 elements per lane, byte cells, 2 blocks per SM (the default); V its own kernel
}
NAMES = ("okv_tq_encode_k", "okv_tq_encode_v", "okv_tq_decode")
LAYER, SEED = 3, 0
HOST_VECTORS = 8192  # per benchmark case, compared with the host codec


def tq_source(variant: str, base_path: str) -> str:
    root = importlib.resources.files("orbitkv_fs.gpu") / "kernels"
    tq = open(base_path).read() if variant == "base" else (root / "turboquant.cu").read_text()
    return (root / "common.cuh").read_text() + "\n" + tq


def old_tables() -> np.ndarray:
    """The base kernel's table: centroids(4) at 0, centroids(3) at 16, then 128 float4 cells per bit width
    (boundary, base index bits, centroid[base], centroid[base + 1]) at 24 and 24 + 512."""
    from orbitkv_fs.codecs.turboquant import lloyd_max_boundaries, lloyd_max_centroids

    t = np.zeros(24 + 2 * 512, dtype=np.float32)
    t[0:16] = lloyd_max_centroids(4)
    t[16:24] = lloyd_max_centroids(3)
    for bits, off in ((4, 24), (3, 24 + 512)):
        bnd = lloyd_max_boundaries(bits).astype(np.float32)
        cen = lloyd_max_centroids(bits).astype(np.float32)
        out = np.zeros((128, 4), dtype=np.float32)
        for c in range(128):
            lo = -np.inf if c == 0 else -4.0 + c / 16 - 1 / 64
            hi = np.inf if c == 127 else -4.0 + (c + 1) / 16 + 1 / 64
            inside = np.flatnonzero((bnd >= lo) & (bnd <= hi))
            base = int(np.count_nonzero(bnd < lo))
            out[c, 0] = bnd[inside[0]] if len(inside) else np.inf
            out[c, 1] = np.array([base], dtype=np.uint32).view(np.float32)[0]
            out[c, 2] = cen[base]
            out[c, 3] = cen[min(base + 1, len(cen) - 1)]
        t[off:off + 512] = out.reshape(-1)
    return t


def enc_name(variant: str, key: bool) -> str:
    if variant == "base":
        return "okv_tq_encode"
    return "okv_tq_encode_k" if key else "okv_tq_encode_v"


def names(variant: str) -> tuple:
    return ("okv_tq_encode", "okv_tq_decode") if variant == "base" else NAMES


def build_options(variant: str) -> tuple:
    from orbitkv_fs.gpu import module as km

    return tuple(km.OPTIONS) + tuple(VARIANTS[variant] or ())


def _compile_child(args: tuple) -> tuple:
    variant, base_path = args
    t = time.time()
    try:
        from orbitkv_fs.gpu import module as km

        km.build_module(tq_source(variant, base_path), build_options(variant))  # fills the on-disk cache
        return variant, round(time.time() - t, 1), None
    except Exception as e:  # reported by the parent, which builds again itself
        return variant, round(time.time() - t, 1), repr(e)


# ------------------------------------------------------------------------------------------------ host

def host_records(x_u16: np.ndarray, d: int, bits: int, key: bool, f16: bool):
    """Records of the host codec (uint8[n, rec]) for 16-bit source bits x, or a RawReason."""
    import ml_dtypes

    from orbitkv_fs.codecs import turboquant as tqh

    w = x_u16.view(np.float16 if f16 else ml_dtypes.bfloat16).reshape(-1, d).astype(np.float32)
    if not np.all(np.isfinite(w)):
        return "nonfinite"
    return tqh.encode_key(w, bits, LAYER, SEED) if key else tqh.encode_value(w, bits)


def sweep_data(d: int, f16: bool, nbytes: int, real: np.ndarray, seed: int) -> np.ndarray:
    """uint16 bits of mixed-scale vectors: Gaussian rows at random power-of-two scales, zero rows, and
    rows of the real K/V (converted to FP16 when f16)."""
    import ml_dtypes

    rng = np.random.default_rng(seed)
    n = nbytes // (2 * d)
    w = rng.standard_normal((n, d)).astype(np.float32)
    lo, hi = (-20, 8) if f16 else (-70, 10)
    w *= np.exp2(rng.integers(lo, hi, n)).astype(np.float32)[:, None]
    w[rng.random(n) < 0.02] = 0
    r = np.resize(real, n * d).view(ml_dtypes.bfloat16).astype(np.float32).reshape(n, d)
    take = rng.random(n) < 0.3
    w[take] = r[take]
    return w.astype(np.float16 if f16 else ml_dtypes.bfloat16).view(np.uint16).reshape(-1)


# ------------------------------------------------------------------------------------------------ GPU

def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--base", default="tq_base.cu", help="the base variant's turboquant.cu")
    ap.add_argument("--mib", type=int, default=256, help="MiB of K and of V source")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--no-pool", action="store_true", help="build the variants one by one")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    if "base" in variants and not os.path.isfile(args.base):
        print(f"no {args.base}: variant base skipped")
        variants.remove("base")
    t0 = time.time()
    pool = None
    if not args.no_pool and len(variants) > 1:
        pool = mp.get_context("spawn").Pool(len(variants))
        pending = pool.map_async(_compile_child, [(v, args.base) for v in variants])

    import cupy as cp

    from orbitkv_fs.gpu import bench as b
    from orbitkv_fs.gpu import module as km
    from orbitkv_fs.gpu.tables import sign_words, turboquant_tables
    from orbitkv_fs.segment import Role, turboquant_record_bytes

    kh, vh, what = b._load_kv(os.environ.get("ORBITKV_REAL_KV"))
    print(f"data: {what}")
    n = args.mib << 20
    seg = b.SEG
    nseg = n // seg
    cases = [(d, bits, key) for d in (64, 128) for bits in (4, 3) for key in (True, False)]
    # host references (computed while the builds run)
    host = {}
    for d, bits, key in cases:
        src = np.resize(kh if key else vh, HOST_VECTORS * d)
        host[(d, bits, key)] = host_records(src.astype(np.uint16), d, bits, key, False)
    sweep_cases = [(d, bits, key, f16) for d in (32, 64, 128, 256) for bits in (4, 3) for key in (True, False)
                   for f16 in (False, True)]
    sweep = {}
    if not args.no_sweep:
        for i, (d, bits, key, f16) in enumerate(sweep_cases):
            x = sweep_data(d, f16, 1 << 20, kh if key else vh, i)
            sweep[(d, bits, key, f16)] = (x, host_records(x, d, bits, key, f16))
    print(f"host references: {time.time() - t0:.1f} s")
    if pool is not None:
        for v, secs, err in pending.get():
            print(f"build {v}: {secs} s" + (f" FAILED in the child: {err}" if err else ""))
        pool.close()

    dev = cp.cuda.Device()
    props = cp.cuda.runtime.getDeviceProperties(dev.id)
    sms = int(props["multiProcessorCount"])
    tables = cp.asarray(turboquant_tables())
    base_tables = cp.asarray(old_tables())
    kernels = {}
    for v in variants:
        t = time.time()
        mod = km.build_module(tq_source(v, args.base), build_options(v))
        fns = km.load_functions(mod, names(v))
        grids = {name: sms * km._resident_blocks(fn, props, km.DYNAMIC_SMEM.get(name, 0)) for name, fn in fns.items()}
        kernels[v] = km.Kernels(module=mod, functions=fns, crc_tables=None,
                                tq_tables=base_tables if v == "base" else tables, grids=grids,
                                hardware_fp8=False)
        regs = {name: int(fn.attributes["num_regs"]) for name, fn in fns.items()}
        spill = int(fns["okv_tq_encode_k"].attributes.get("local_size_bytes", 0)) if "okv_tq_encode_k" in fns else -1
        print(f"variant {v}: load {time.time() - t:.1f} s, regs {regs}, encode local bytes {spill}, "
              f"blocks/SM { {n: g // sms for n, g in grids.items()} }")
    src = {True: b._tile(kh, n // 2), False: b._tile(vh, n // 2)}
    results: dict = {}
    problems: list = []
    for d, bits, key in cases:
        role = Role.KEY if key else Role.VALUE
        rec = turboquant_record_bytes(d, bits, role)
        per = seg // (2 * d) * rec
        per_al = -(-per // 256) * 256
        data = src[key]
        ref_enc = ref_dec = None
        for v in variants:
            k = kernels[v]
            enc_buf = cp.zeros(per_al * nseg, dtype=np.uint8)
            rows = [{"src": data.data.ptr + i * seg, "dst": enc_buf.data.ptr + i * per_al, "n": seg, "dtype": 0,
                     "head_dim": d, "bits": bits, "role": int(role), "signs": sign_words(d, LAYER, SEED),
                     "nblocks": km.units_tq(seg, d)} for i in range(nseg)]
            e = b._Segs(rows)
            te = b._median_time(lambda: e.launch(k, enc_name(v, key), k.tq_tables), args.repeat)
            status = int(e.meta.get().view(km.META_DTYPE)["status"].max())
            outb = cp.zeros_like(data)
            dd = b._Segs([dict(r, src=enc_buf.data.ptr + i * per_al, dst=outb.data.ptr + i * seg)
                          for i, r in enumerate(rows)])
            td = b._median_time(lambda: dd.launch(k, "okv_tq_decode", k.tq_tables), args.repeat)
            h = host[(d, bits, key)]
            host_ok = isinstance(h, np.ndarray) and np.array_equal(
                enc_buf[: HOST_VECTORS * rec].get(), h.reshape(-1))
            if ref_enc is None:
                ref_enc, ref_dec, ref_ok = enc_buf, outb, "ref"
            else:
                ref_ok = bool(cp.array_equal(enc_buf, ref_enc)) and bool(cp.array_equal(outb, ref_dec))
            results[(v, d, bits, key)] = (b._gbps(n, te), b._gbps(n, td))
            tag = f"{v} d{d} {bits}-bit {'K' if key else 'V'}"
            if not host_ok or ref_ok is False or status:
                problems.append(f"{tag}: host {host_ok} ref {ref_ok} status {status}")
            print(f"{tag}: enc {b._gbps(n, te):7.1f} GB/s  dec {b._gbps(n, td):7.1f} GB/s  host {host_ok}  "
                  f"ref {ref_ok}  status {status}", flush=True)
            if ref_enc is not enc_buf:
                del enc_buf, outb
        del ref_enc, ref_dec
    if not args.no_sweep:
        for v in variants:
            k = kernels[v]
            bad = []
            for (d, bits, key, f16), (x, h) in sweep.items():
                role = Role.KEY if key else Role.VALUE
                rec = turboquant_record_bytes(d, bits, role)
                xs = cp.asarray(x)
                out = cp.zeros(len(x) // d * rec, dtype=np.uint8)
                e = b._Segs([{"src": xs.data.ptr, "dst": out.data.ptr, "n": xs.nbytes, "dtype": int(f16),
                              "head_dim": d, "bits": bits, "role": int(role), "signs": sign_words(d, LAYER, SEED),
                              "nblocks": km.units_tq(xs.nbytes, d)}])
                e.launch(k, enc_name(v, key), k.tq_tables)
                status = int(e.meta.get().view(km.META_DTYPE)["status"][0])
                if isinstance(h, np.ndarray):
                    ok = status == 0 and np.array_equal(out.get(), h.reshape(-1))
                else:
                    ok = status != 0
                if not ok:
                    bad.append(f"d{d}/{bits}/{'K' if key else 'V'}/{'fp16' if f16 else 'bf16'}"
                               f"(host {'declines ' + str(h) if not isinstance(h, np.ndarray) else 'encodes'}, "
                               f"status {status})")
            print(f"sweep {v}: {len(sweep) - len(bad)}/{len(sweep)} cases equal the host" + (f"; FAIL {bad}" if bad else ""))
            problems += [f"sweep {v} {x}" for x in bad]
    print("\nGB/s encode (decode)    " + "  ".join(f"{v:>16}" for v in variants))
    for d, bits, key in cases:
        row = "  ".join(f"{results[(v, d, bits, key)][0]:7.1f} ({results[(v, d, bits, key)][1]:6.1f})" for v in variants)
        print(f"d{d:<3} {bits}-bit {'K' if key else 'V'}          {row}")
    print(f"\n{'ALL BYTES EQUAL' if not problems else 'PROBLEMS: ' + '; '.join(problems)}  ({time.time() - t0:.0f} s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
