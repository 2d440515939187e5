"""Run `orbitkv-bench pipeline` with wall-clock timers around the save and restore paths' per-batch functions
(not cProfile: its per-call cost inflates the per-segment Python it sees several times over). Each function
named in TARGETS is replaced, wherever the package holds it (module attribute, class attribute, a name
imported elsewhere), by a wrapper that adds its inclusive perf_counter time and call count. Run from a
directory that is not the checkout. Usage: python stage_timers.py OUT_TXT BENCH_ARGS...
Prints per function: calls, total ms, us per call, inclusive (nested functions count in their callers)."""

from __future__ import annotations

import functools
import importlib
import runpy
import sys
import time

TARGETS = {
    "orbitkv_fs.manager.save": ["SavePipeline._save_submit", "SavePipeline._save_finish", "SavePipeline._save_columns",
                                "SavePipeline._workspace_delta", "_segment_fields", "_gaps"],
    "orbitkv_fs.manager.restore": ["RestorePipeline._decode_gpu_rows", "RestorePipeline._verified_rows",
                                   "RestorePipeline._rows_end", "RestorePipeline._collect_batch",
                                   "RestorePipeline._acquire", "RestorePipeline._check_device_batch",
                                   "RestorePipeline.restore", "RestorePipeline._row_items",
                                   "RestorePipeline._decode_gpu", "RestorePipeline._decode_start",
                                   "RestorePipeline._decode_end"],
    "orbitkv_fs.manager.device": ["_GpuCodecs.gather_rows", "_GpuCodecs.decode_rows_submit",
                                  "_GpuCodecs.decode_rows_finish", "_Targets.__init__", "_Targets.places",
                                  "_Targets.table", "_table_of", "_GpuCodecs.decode_submit",
                                  "_GpuCodecs.decode_finish", "_gather_batch", "_block_table"],
    "orbitkv_fs.manager.verify": ["_verify_headers"],
    "orbitkv_fs.tiers.dram": ["DramTier.publish_many", "DramTier.reserve", "DramTier.cancel", "DramTier.lease",
                              "DramTier.release"],
    "orbitkv_fs.index": ["ObjectIndex.add_many"],
    "orbitkv_fs.gpu.engine": ["GpuCodecEngine.encode_columns_submit", "GpuCodecEngine._run_encode_columns",
                              "GpuCodecEngine._finish_encode_columns", "GpuCodecEngine.encode_collect",
                              "GpuCodecEngine._launch_encode", "GpuCodecEngine._template_ids", "_write_headers",
                              "_encode_rows", "_enc_groups", "_enc_offsets", "GpuCodecEngine._enc_cuts",
                              "GpuCodecEngine.decode_columns_submit", "GpuCodecEngine._run_decode_columns",
                              "GpuCodecEngine._launch_decode", "_decode_rows", "_plan_cols", "_header_cols",
                              "GpuCodecEngine.gather_blocks", "GpuCodecEngine.scatter_blocks",
                              "GpuCodecEngine.block_buffer", "GpuCodecEngine.decode_collect",
                              "GpuCodecEngine.decode_rows_finish", "_mirror", "_dec_layout_fixed",
                              "GpuCodecEngine.encode_submit", "GpuCodecEngine._run_encode",
                              "GpuCodecEngine._finish_encode", "GpuCodecEngine.decode_submit",
                              "GpuCodecEngine._run_decode", "GpuCodecEngine._enc_layout", "GpuCodecEngine._dec_layout",
                              "GpuCodecEngine._ans_temp", "GpuCodecEngine._classify", "_temp_batches",
                              "GpuCodecEngine._packed_slots", "GpuCodecEngine._ans_temp_of", "_enc_offsets",
                              "GpuCodecEngine._class_set"],
    "orbitkv_fs.gpu.nvcomp": ["Nvcomp.compress", "Nvcomp.decompress"],
    "orbitkv_fs.gpu.ans_format": ["parse_table", "parse_tables"],
    "orbitkv_fs.gpu.tables": ["finish_crc"],
    "orbitkv_fs.segment": ["header_crcs"],
}
# the engine's workspace (its class name differs between trees: matched by attribute)
WORKER_METHODS = ["place", "finish", "h2d", "d2h", "launch", "launched", "handoff", "wait_for_current", "copy_blocks",
                  "fetch"]

stats: dict[str, list] = {}


def _wrap(name: str, f):
    rec = stats.setdefault(name, [0, 0.0])

    @functools.wraps(f)
    def timed(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            rec[0] += 1
            rec[1] += time.perf_counter() - t
    timed.__timed__ = True
    return timed


def _replace_everywhere(orig, wrapped) -> None:
    for mname, mod in list(sys.modules.items()):
        if not mname.startswith("orbitkv_fs") or mod is None:
            continue
        for attr, val in list(vars(mod).items()):
            if val is orig:
                setattr(mod, attr, wrapped)
            elif isinstance(val, type):
                for cattr, cval in list(vars(val).items()):
                    if cval is orig:
                        setattr(val, cattr, wrapped)


def install() -> None:
    for mname, names in TARGETS.items():
        try:
            mod = importlib.import_module(mname)
        except Exception as e:  # a tree without it
            print(f"skip {mname}: {e}")
            continue
        for qual in names:
            obj, parts = mod, qual.split(".")
            try:
                for p in parts[:-1]:
                    obj = getattr(obj, p)
                orig = getattr(obj, parts[-1])
            except AttributeError:
                continue
            if getattr(orig, "__timed__", False):
                continue
            _replace_everywhere(orig, _wrap(qual, orig))
    eng = importlib.import_module("orbitkv_fs.gpu.engine")
    for cname, cls in list(vars(eng).items()):
        if isinstance(cls, type) and all(hasattr(cls, m) for m in ("place", "finish", "h2d")):
            for m in WORKER_METHODS:
                if m in vars(cls):
                    setattr(cls, m, _wrap(f"{cname}.{m}", vars(cls)[m]))


def main() -> None:
    out, args = sys.argv[1], sys.argv[2:]
    install()  # imports the modules the targets live in
    sys.argv = ["orbitkv-bench", "pipeline", *args]
    try:
        runpy.run_module("orbitkv_fs.tools.bench", run_name="__main__")
    except SystemExit:
        pass
    rows = sorted(stats.items(), key=lambda kv: -kv[1][1])
    with open(out, "w") as f:
        f.write(f"{'function':<48} {'calls':>7} {'total ms':>10} {'us/call':>9}\n")
        for name, (n, s) in rows:
            if n:
                f.write(f"{name:<48} {n:>7} {s * 1e3:>10.1f} {s / n * 1e6:>9.1f}\n")
    print(open(out).read())


if __name__ == "__main__":
    main()
