"""``orbitkv-bench pipeline`` on the CPU: the throughput part runs the real Manager over host pages and
reports each codec next to its baseline and to ``none``; SmolLM2 ratios from a saved K/V sample."""

from __future__ import annotations

import json

import ml_dtypes
import numpy as np
import pytest

from orbitkv_fs.tools import bench_cohort, bench_pipeline


def test_throughput_report(tmp_path):
    out = tmp_path / "res"
    assert bench_pipeline.main(["--only", "throughput", "--blocks", "128", "--repeat", "1", "--codecs", "none,fp8",
                                "--out", str(out)]) == 0
    res = json.loads((out / "pipeline-cpu.json").read_text())
    runs = res["throughput"]["runs"]
    assert [(r["codec"], r["segment_bytes"]) for r in runs] == [
        (c, s) for c in ("none", "fp8") for s in bench_pipeline.SEGMENT_SIZES]
    for r in runs:
        assert r["save_gbs"] > 0 and r["restore_gbs"] > 0 and r["save_baseline_gbs"] > 0
        lo, hi = r["host_probe_us_range"]
        assert 0 < lo <= r["host_probe_us"] <= hi
        (call,) = r["calls"]  # one repeat: its call is the reported figure, timed next to its own probes
        assert call["save_probe_us"] > 0 and call["restore_probe_us"] > 0 and call["save_host_us"] > 0
        assert abs(r["logical_bytes"] / call["save_s"] / 1e9 - r["save_gbs"]) < 1e-6 * r["save_gbs"]
        assert abs(call["restore_host_us"] / r["segments"] - r["restore_cpu_us_per_segment"]) < 1e-6
        assert abs(r["save_vs_baseline"] - r["save_gbs"] / r["save_baseline_gbs"]) < 1e-9
        none = next(x for x in runs if x["codec"] == "none" and x["segment_bytes"] == r["segment_bytes"])
        assert abs(r["restore_vs_none"] - r["restore_gbs"] / none["restore_gbs"]) < 1e-9
        ratio = r["stored_bytes"] / r["logical_bytes"]
        assert (0.49 < ratio < 0.52) if r["codec"] == "fp8" else (1.0 <= ratio < 1.01)
    md = (out / "pipeline-cpu.md").read_text()
    assert "| fp8 | 64 KiB |" in md
    for r in runs:  # the host probe of each row, beside its host CPU figures
        assert f"| {r['codec']} | {r['segment_bytes'] >> 10} KiB | {r['host_probe_us']:.0f} | {r['save_cpu_us_per_segment']:.2f} |" in md


def test_smollm2_ratios_from_saved_kv(tmp_path):
    rng = np.random.default_rng(0)
    k, v = (rng.standard_normal((6, 128, 2, 64), dtype=np.float32).astype(ml_dtypes.bfloat16) for _ in range(2))
    path = tmp_path / "kv.npz"
    np.savez(path, k=k.view(np.uint16), v=v.view(np.uint16))
    r = bench_cohort.smollm2_ratios(["none", "fp8", "turboquant-4"], chunk_tokens=64, kv_path=str(path))
    assert (r["layers"], r["tokens"], r["kv_heads"], r["head_dim"]) == (6, 128, 2, 64)
    assert r["codecs"]["none"]["relative_rmse"] == 0.0
    assert 1.9 < r["codecs"]["fp8"]["ratio"] < 2.0
    tq = r["codecs"]["turboquant-4"]
    assert tq["segments"]["raw"] == 4 * 2 * 2  # first and last two layers exact: 2 roles x 2 segments each
    assert tq["ratio"] > r["codecs"]["fp8"]["ratio"] * 0.5 and tq["relative_rmse"] < 0.2
    assert "skipped" in bench_cohort.smollm2_ratios(["none"], 64, kv_path=str(tmp_path / "missing.npz"))


def test_shuffled_blocks_and_profile(tmp_path):
    """Chunks of random block ids (an engine's fragmented free list) still restore exactly (the bench asserts
    every chunk restored); ``--profile`` profiles the saves and restores after the first repeat, and only them."""
    out = tmp_path / "res"
    assert bench_pipeline.main(["--only", "throughput", "--blocks", "128", "--repeat", "2", "--codecs", "none",
                                "--block-order", "shuffled", "--profile", "--out", str(out)]) == 0
    res = json.loads((out / "pipeline-cpu.json").read_text())
    assert res["throughput"]["geometry"]["block_order"] == "shuffled"
    assert "shuffled block ids" in (out / "pipeline-cpu.md").read_text()
    for op, other in (("save", "restore"), ("restore", "save")):
        text = (out / f"profile-cpu-{op}.txt").read_text()
        assert f"manager/{op}.py" in text and f"manager/{other}.py" not in text and "_throughput" not in text
        assert (out / f"profile-cpu-{op}.prof").stat().st_size > 0


def test_round_robin_keeps_every_codec_and_the_row_order():
    """The GPU path's round robin (a Manager per codec, each repeat running every codec once) on host
    pages: the same rows, in codec-major order, each with its own stored bytes and ratio to none."""
    pages, reg = bench_pipeline._engine(64, 4)
    try:
        out = bench_pipeline._throughput(["none", "fp8"], reg, 64, 2, "cpu",
                                         lambda: bench_pipeline._host_baseline(pages, 1), "shuffled", pages="host",
                                         baseline_name="copy", segment_sizes=(256 << 10, 1 << 20), round_robin=True)
    finally:
        pages.close()
    assert out["round_robin"] is True
    runs = out["runs"]
    assert [(r["codec"], r["segment_bytes"]) for r in runs] == [(c, s) for c in ("none", "fp8")
                                                                 for s in (256 << 10, 1 << 20)]
    for r in runs:
        ratio = r["stored_bytes"] / r["logical_bytes"]
        assert (0.49 < ratio < 0.52) if r["codec"] == "fp8" else (1.0 <= ratio < 1.01)
        none = next(x for x in runs if x["codec"] == "none" and x["segment_bytes"] == r["segment_bytes"])
        assert abs(r["save_vs_none"] - r["save_gbs"] / none["save_gbs"]) < 1e-9
        # the bound: the stored bytes at the baseline's rate, against none
        assert r["restore_bound_gbs"] == pytest.approx(r["restore_baseline_gbs"] / ratio)
        assert r["save_bound_vs_none"] == pytest.approx(r["save_baseline_gbs"] / ratio / none["save_gbs"])
    md = bench_pipeline._markdown({"device": "cpu", "host": "h", "throughput": out}, "cmd")
    assert "round robin" in md and "bound vs none save / restore" in md
