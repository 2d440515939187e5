"""Host work of an `ans` GPU save, on a machine without a GPU: ../2026-12-03-save-host/save_host.py's Manager
(the bench's geometry: 36 layers, 512 KiB segments, shuffled blocks, 2,304 segments a save) with its null GPU
engines given a null nvCOMP (its size queries answer the H200's figures; compress does nothing) and a download
that writes what the GPU would leave in a flight's region for the host to read: every status 0 and each `ans`
payload's length at 0.72 of its segment (the bench's BF16 data packs to about that). What is timed is the
Python and numpy a save runs per batch and flight, kernels, copies and nvCOMP aside.

Usage: python ans_save_host.py [--codec ans] [--repeat 40] [--profile OUT.txt]
Prints the median wall and thread CPU per save and per segment, and the engine flights a save makes."""

from __future__ import annotations

import argparse
import importlib.util
import os
import time
import types

from orbitkv_fs.gpu import engine as E

_spec = importlib.util.spec_from_file_location(
    "save_host", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "2026-12-03-save-host", "save_host.py"))
save_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(save_host)

CHUNK_CAP = 89_288  # nvCOMP 5.3's worst case for a 64 KiB chunk (gpu/engine.py, ANS_ROUND_SHARE's comment)
PACKED = 0.72


def _null_nvcomp() -> types.SimpleNamespace:
    return types.SimpleNamespace(max_compressed_bytes=lambda chunk, t: CHUNK_CAP,
                                 compress_temp_bytes=lambda chunks, chunk, total, t: 8 * chunks + (1 << 20),
                                 compress=lambda *args: None)


def _with_lengths(eng: E.GpuCodecEngine) -> None:
    """``eng`` 's ``_launch_encode`` followed by what the flight's download brings: its meta (statuses 0) and the
    `ans` payload lengths, in the region the host finishes from (the fill is the GPU's work: not counted)."""
    launch = eng._launch_encode
    filled = save_host._DownloadWorker.filled

    def launch_and_fill(base, off, rows, groups, k, *args, **kw):
        host, own = launch(base, off, rows, groups, k, *args, **kw)
        c0 = time.thread_time()
        host[:16 * k] = 0
        na = len(dict(groups).get("okv_ans_pack", ()))
        if na:
            a_off = off["pay_len"] - off["meta"]
            n = int(eng._ans_orig * PACKED) // 8 * 8
            host[a_off:a_off + 8 * na].view("<u8")[:] = n
        filled[0] += time.thread_time() - c0
        return host, own

    eng._launch_encode = launch_and_fill


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--codec", default="ans")
    p.add_argument("--repeat", type=int, default=40)
    p.add_argument("--segment-kib", type=int, default=512)
    p.add_argument("--profile", default=None, help="line_profiler of the engine's encode steps, to this file")
    args = p.parse_args()
    E.km.launch_ans_place = lambda *a, **k: 1
    with save_host.harness(args.codec, args.segment_kib) as h:
        m, eng, nseg = h.m, h.eng, h.nseg
        engine_of = m._gpu_codecs.engine

        def engine(seed: int) -> E.GpuCodecEngine:
            x = engine_of(seed)
            if x._nvcomp is None:
                x._nvcomp = _null_nvcomp()
                x.save.stream = types.SimpleNamespace(ptr=0)  # nvCOMP's calls name the stream
                x._ans_orig = args.segment_kib << 10
                _with_lengths(x)
            return x

        m._gpu_codecs.engine = engine
        lp = None
        if args.profile:
            from line_profiler import LineProfiler

            lp = LineProfiler()
            for f in (E.GpuCodecEngine.encode_columns_submit, E.GpuCodecEngine._run_encode_columns,
                      E.GpuCodecEngine._finish_encode_columns, E.GpuCodecEngine._launch_encode,
                      E.GpuCodecEngine._packed_slots, E._encode_rows, E._ans_rounds, E._enc_offsets):
                lp.add_function(f)
        w, c = save_host.time_saves(h, args.repeat, lp, args.profile)
        st = m._gpu_codecs.engine(eng.reg.rotation_seed).save.stats
        assert st["raw_fallbacks"] == 0, st
        print(f"{args.codec} {args.segment_kib} KiB: {nseg} segments, {st['batches'] // args.repeat} engine flights"
              f" a save, {st['ans_rounds'] // args.repeat} ans rounds; median wall {w:.0f} us ({w / nseg:.2f} us/seg),"
              f" thread CPU {c:.0f} us ({c / nseg:.2f} us/seg)")


if __name__ == "__main__":
    main()
