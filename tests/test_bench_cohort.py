"""``orbitkv-bench cohort``: a small real run (tiny random Qwen3 on the CPU, real Manager, real SSD log, real
shared-memory pages) checked for the report's structure and the benchmark's invariants.

The invariants: every prompt token is accounted to exactly one of HBM, DRAM, SSD or computed; only reuse
requests (not the first request of a prefix, not a cold one) hit; with DRAM large enough for everything,
every reuse request hits; the Manager restored exactly the bytes of the chunks the engine says it got;
reservations, leases, workspace and in-flight requests are back to zero; ``ans`` is skipped with a reason.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import threading
import time

import numpy as np
import pytest
from polling import wait_until

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("matplotlib")

from orbitkv_fs.tools import bench_cohort  # noqa: E402

SMALL = ["--quick", "--requests", "8", "--warm-requests", "6", "--prefixes", "2", "--output-tokens", "4",
         "--no-smollm2"]


def _load(out) -> dict:
    with open(os.path.join(out, "cohort.json")) as f:
        return json.load(f)


def _check_run(run: dict, recipe: dict, *, control: bool, device: str = "cpu") -> None:
    reuse = recipe["reuse_requests"]
    assert reuse == recipe["warm_requests"] - recipe["prefixes"]
    ct = recipe["chunk_tokens"]
    assert run["requests"] == recipe["requests"] == len(run["records"])
    assert run["reservations_zero"] is True
    assert run["hbm_pins_end"] == 0
    assert run["prompt_tokens"] == sum(r["input_tokens"] for r in run["records"])
    assert sum(run["tier_tokens"].values()) == run["prompt_tokens"]
    assert math.isclose(sum(run["hit_rate"].values()), 1.0)
    assert 0 < run["ttft_p50_ms"] <= run["ttft_p95_ms"]
    assert run["requests_per_s"] > 0
    for r in run["records"]:
        assert r["hbm_tokens"] + r["dram_tokens"] + r["lower_tokens"] + r["computed_tokens"] == r["input_tokens"]
        assert r["computed_tokens"] >= 1  # the last prompt token is always computed
        assert len(r["tokens"]) == recipe["output_tokens"] == len(r["token_logprobs"])
        assert r["ttft_s"] >= r["lookup_s"] + r["restore_s"] + r["gather_s"] + r["queue_s"] + r["prefill_s"]
        if control or r["prefix"] is None or r["first"]:
            assert r["hbm_tokens"] == r["dram_tokens"] == r["lower_tokens"] == 0, r
    hit = sum(1 for r in run["records"] if r["computed_tokens"] < r["input_tokens"])
    assert hit <= reuse
    assert run["requests_hit"]["none"] == recipe["requests"] - hit
    assert 0 <= run["reuse_short"] <= reuse
    recs = run["records"]
    assert run["forward_requests"] == {
        "one_token_prefill": sum(1 for r in recs if r["computed_tokens"] == 1),
        "full_prefill": sum(1 for r in recs if r["computed_tokens"] == r["input_tokens"])}
    assert run["forward_p50_ms"]["full_prefill"] > 0 and run["forward_p50_ms"]["decode_step"] > 0
    assert run["step_queue_p50_ms"]["prefill"] > 0 and run["step_queue_p50_ms"]["decode_step"] > 0
    assert set(run["phase_p50_ms"]) == {"lookup", "restore", "gather", "queue", "prefill"}
    if control:
        assert "manager" not in run
        return
    m = run["manager"]
    assert m["reserved_bytes_end"] == m["leases_active_end"] == m["workspace_bytes_end"] == 0
    assert m["inflight_requests_end"] == 0
    assert m["decode_failures"] == 0
    restored_chunks = sum(r["manager_chunks"] for r in run["records"])
    assert restored_chunks == sum(math.ceil((r["dram_tokens"] + r["lower_tokens"]) / ct) for r in run["records"])
    assert m["restore_logical_bytes"] == restored_chunks * ct * recipe["kv_bytes_per_token"]
    if run["variant"] == "dram":
        assert hit == reuse  # DRAM holds the whole cohort: every reuse request hits somewhere
        assert run["reuse_short"] == 0
        assert m["ssd_read_bytes"] == 0 and run["tier_tokens"]["lower"] == 0
    if run["tier_tokens"]["lower"]:
        # served from the disk, from the write queue (not yet on disk) or after the readahead lane read it
        assert m["segment_hits"]["lower"] > 0
        assert m["ssd_read_bytes"] + m["ssd_read_pending_hits"] + m["ssd_prefetch_read_bytes"] > 0
    if run["codec"] == "none":
        assert m["compression_ratio"] < 1.0  # headers only, nothing encoded
        assert {rep for rep, n in m["codec_segments"].items() if n} == {"raw"}
        if device == "cpu":  # host pages: exact segments are gathered straight into the arena, no batch
            assert m["encode_s"] == 0 and m["codec_batches"] == 0
        else:
            # GPU pages: exact segments go through the GPU engine's batches as well (one gather, CRC32C on
            # the GPU, one copy into the arena per batch); encode_s is the Manager's time in those batches
            assert m["codec_batches"] > 0 and m["encode_s"] > 0
    elif run["codec"] == "ans":  # exact: random-weight KV may not compress, but it goes through the codec
        assert m["codec_batches"] > 0
    else:
        assert m["compression_ratio"] > 1.3  # 4 of the 8 tiny layers stay exact under TurboQuant
        assert m["codec_batches"] > 0 and m["segments_per_batch"] > 0
    vs = run["vs_control"]
    assert 0.0 <= vs["token_agreement"] <= 1.0
    assert vs["manager_served_requests"] == sum(1 for r in run["records"] if r["dram_tokens"] + r["lower_tokens"])


def test_quick_cohort_report_and_invariants(tmp_path):
    out = tmp_path / "res"
    argv = SMALL + ["--codecs", "none,ans,turboquant-4", "--variants", "ssd,dram", "--out", str(out)]
    assert bench_cohort.main(argv) == 0
    res = _load(out)
    for name in ("cohort.md", "ttft_throughput.png", "ssd_bytes_read.png"):
        assert (out / name).stat().st_size > 0
    assert res["command"].startswith("orbitkv-bench cohort --quick")
    assert res["device"] == "cpu" and res["manager_mode"] == "embedded"
    assert "ans" in res["skipped"] and "GPU" in res["skipped"]["ans"]
    assert {"torch", "transformers", "python"} <= set(res["versions"])
    labels = [(r["variant"], r["codec"]) for r in res["runs"]]
    assert labels == [("control", "recompute"), ("ssd", "none"), ("ssd", "turboquant-4"), ("dram", "none"),
                      ("dram", "turboquant-4")]
    recipe = res["recipe"]
    for run in res["runs"]:
        _check_run(run, recipe, control=run["codec"] == "recompute")
    ssd_none = res["runs"][1]["manager"]
    # DRAM is smaller than the cohort's KV in the ssd variant: evicted objects are demoted to the SSD log
    # (whether a reuse request is then served from DRAM or the SSD depends on thread timing)
    assert ssd_none["demoted"] > 0 and ssd_none["ssd_write_bytes"] > 0
    verdicts = {(v["variant"], v["codec"]): v for v in res["verdicts"]}
    assert set(verdicts) == set(labels[1:])
    tq = verdicts[("ssd", "turboquant-4")]
    assert {"beats_recompute_ttft", "beats_recompute_throughput", "beats_none_ttft", "beats_none_throughput"} <= set(tq)
    assert any(n.startswith("lossy:") for n in tq["why"])
    md = (out / "cohort.md").read_text()
    assert "| ssd | turboquant-4 |" in md and "## Verdicts" in md and "| one-token prefill |" in md
    assert "| queue before prefill |" in md
    # separate invocations (one per codec on a time-limited device) merge into one report
    merged = tmp_path / "merged"
    js = str(out / "cohort.json")
    assert bench_cohort.main(["--merge", js, js, "--out", str(merged), "--no-plots"]) == 0
    m = _load(merged)
    assert len(m["runs"]) == 1 + 2 * (len(labels) - 1) and len(m["verdicts"]) == 2 * (len(labels) - 1)
    assert m["merged_commands"] == [res["command"]] * 2
    # the second invocation is the second round: each run is compared with its own round's none
    assert [r.get("round", 0) for r in m["runs"][1:]] == [0] * (len(labels) - 1) + [1] * (len(labels) - 1)
    assert {(a["variant"], a["codec"], a["rounds"]) for a in m["across_rounds"]} == {(v, c, 2) for v, c in labels[1:]}
    for a in m["across_rounds"]:
        if a["codec"] == "none":
            continue
        assert a["throughput_vs_none"][0] == a["throughput_vs_none"][1]  # the same runs twice
        assert a["beats_none_throughput"] in (0, 2)
    assert "## Across rounds" in (merged / "cohort.md").read_text()


def test_rounds_alternate_the_codec_order_and_compare_within_a_round(tmp_path):
    """--rounds 2 runs A B then B A; each verdict compares against none of its own round and says which
    of the two ran first there."""
    out = tmp_path / "res"
    argv = SMALL + ["--codecs", "none,fp8", "--variants", "dram", "--rounds", "2", "--no-plots", "--out", str(out)]
    assert bench_cohort.main(argv) == 0
    res = _load(out)
    seq = [(r["codec"], r.get("round"), r.get("order")) for r in res["runs"]]
    assert seq == [("recompute", None, None), ("none", 0, 0), ("fp8", 0, 1), ("fp8", 1, 0), ("none", 1, 1)]
    for run in res["runs"]:
        _check_run(run, res["recipe"], control=run["codec"] == "recompute")
    fp8 = [v for v in res["verdicts"] if v["codec"] == "fp8"]
    assert [(v["round"], v["ran_before_none"]) for v in fp8] == [(0, False), (1, True)]
    runs = {(r["codec"], r.get("round")): r for r in res["runs"]}
    for v in fp8:
        assert v["throughput_vs_none"] == pytest.approx(
            runs[("fp8", v["round"])]["requests_per_s"] / runs[("none", v["round"])]["requests_per_s"])
    (summary,) = [a for a in res["across_rounds"] if a["codec"] == "fp8"]
    assert summary["rounds"] == 2 and summary["ran_before_none"] == [False, True]
    assert summary["beats_none_throughput"] == sum(v["beats_none_throughput"] for v in fp8)
    md = (out / "cohort.md").read_text()
    assert "| dram | fp8 (round 2) |" in md and "**dram/fp8**, 2 rounds" in md
    with pytest.raises(SystemExit):
        bench_cohort.main(SMALL + ["--rounds", "0"])


def test_cohort_with_manager_process(tmp_path):
    """The remote path the GPU run takes: the Manager in its own process, over the data plane."""
    out = tmp_path / "res"
    argv = SMALL + ["--codecs", "fp8", "--variants", "ssd", "--manager", "process", "--no-plots", "--out", str(out),
                    "--ssd-dir", str(tmp_path / "not-yet" / "ssd")]  # made by the benchmark
    assert bench_cohort.main(argv) == 0
    res = _load(out)
    assert res["manager_mode"] == "process"
    for run in res["runs"]:
        _check_run(run, res["recipe"], control=run["codec"] == "recompute")
    assert res["runs"][1]["manager"]["codec_batches"] > 0  # fp8 encoded in the Manager's process


def test_bad_recipe_is_refused():
    with pytest.raises(SystemExit):
        bench_cohort.main(["--quick", "--warm-requests", "99"])
    with pytest.raises(ValueError):
        bench_cohort.Recipe(chunk_tokens=100, block_size=16)


@pytest.mark.gpu
@pytest.mark.parametrize("codec", ["ans", "turboquant-4"])
def test_quick_cohort_on_gpu(tmp_path, codec):
    """The GPU path at quick scale: model and pages on CUDA, pages registered through CUDA IPC with a Manager
    in its own process (its GPU path), ans available. Same invariants as on the CPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA")
    out = tmp_path / "res"
    argv = SMALL + ["--device", "cuda", "--codecs", f"none,{codec}", "--variants", "ssd,dram", "--no-plots",
                    "--ssd-dir", str(tmp_path), "--out", str(out)]
    assert bench_cohort.main(argv) == 0
    res = _load(out)
    assert res["device"] == "cuda" and res["manager_mode"] == "process" and not res["skipped"]
    assert [(r["variant"], r["codec"]) for r in res["runs"]] == [
        ("control", "recompute"), ("ssd", "none"), ("ssd", codec), ("dram", "none"), ("dram", codec)]
    for run in res["runs"]:
        _check_run(run, res["recipe"], control=run["codec"] == "recompute", device="cuda")
    if codec == "ans":  # exact: restored requests generate what the exact `none` restore generates
        for a, b in zip(res["runs"][3]["records"], res["runs"][4]["records"]):
            assert a["tokens"] == b["tokens"]


def test_ssd_dir_is_made_or_refused_before_any_run(tmp_path):
    """An --ssd-dir that cannot be made is a usage error before the control runs (a missing one is made:
    test_cohort_with_manager_process)."""
    blocker = tmp_path / "a-file"
    blocker.write_bytes(b"")
    with pytest.raises(SystemExit) as e:
        bench_cohort.main(SMALL + ["--variants", "ssd", "--ssd-dir", str(blocker / "ssd"), "--no-plots",
                                   "--out", str(tmp_path / "res")])
    assert e.value.code == 2
    assert not (tmp_path / "res").exists()


def test_gather_lays_out_pages_in_token_order():
    """The engine's page gather: per layer, K and V of token t are the halves of row t % block_size of block
    blocks[t // block_size], for any block order and a prefix ending inside a block."""
    torch = pytest.importorskip("torch")
    recipe = bench_cohort.QUICK
    m = recipe.model
    model = bench_cohort.build_model(m, "cpu", 0)
    gen = torch.Generator().manual_seed(1)
    pages = [torch.randn((12, m.kv_heads, recipe.block_size, 2 * m.head_dim), generator=gen).to(torch.bfloat16)
             for _ in range(m.layers)]
    engine = bench_cohort.Engine(model, recipe, pages)
    blocks = [7, 2, 11, 0]
    n_tokens = len(blocks) * recipe.block_size - 3
    cache = engine._gather(blocks, n_tokens)
    bs, d = recipe.block_size, m.head_dim
    for layer, pg in enumerate(pages):
        want = torch.stack([pg[blocks[t // bs], :, t % bs] for t in range(n_tokens)], dim=1).float()  # [H, T, 2D]
        lay = cache.layers[layer]
        assert lay.keys.shape == (1, m.kv_heads, n_tokens, d) and lay.keys.dtype == model.dtype
        assert torch.equal(lay.keys[0], want[..., :d]) and torch.equal(lay.values[0], want[..., d:])
    assert engine._gather([], 0).get_seq_length() == 0


def test_step_lock_serves_in_arrival_order_one_holder_at_a_time():
    """Waiters get the lock in the order they asked for it, and a holder that releases and asks again goes
    behind them (a plain ``threading.Lock`` usually hands it straight back: a decoding request would keep
    the GPU for all its steps)."""
    lock = bench_cohort.StepLock()
    order: list[object] = []
    inside = [0]
    overlaps: list[object] = []

    def take(name: object) -> None:
        with lock:
            inside[0] += 1
            if inside[0] > 1:
                overlaps.append(name)
            time.sleep(0.002)  # room for another thread to get in, were it let in
            order.append(name)
            inside[0] -= 1

    lock.acquire()
    threads = []
    for i in range(4):
        threads.append(threading.Thread(target=take, args=(i,)))
        threads[-1].start()
        assert wait_until(lambda: lock.waiting == i + 1, interval=0.001)  # queued before the next one starts
    lock.release()
    lock.acquire()  # straight back: a fair lock queues this behind the four
    if inside[0]:
        overlaps.append("again")
    order.append("again")
    lock.release()
    for t in threads:
        t.join(10)
    assert order == [0, 1, 2, 3, "again"]
    assert not overlaps and lock.waiting == 0


def test_engine_forwards_never_overlap_and_queue_wait_is_its_own_phase():
    """Every forward of a run goes through the step lock, one at a time; the wait for it is ``queue_s``
    (in TTFT, not in ``prefill_s``). Four cold requests start at once, then four reuse requests hit the HBM
    cache (one-token prefills after a page gather); no Manager."""
    torch = pytest.importorskip("torch")
    recipe = dataclasses.replace(bench_cohort.QUICK, requests=8, concurrency=4, input_tokens=128, output_tokens=3,
                                 warm_requests=8, prefixes=4, hbm_tokens=512)
    m = recipe.model
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, m.vocab, recipe.input_tokens, dtype=np.int64) for _ in range(4)]
    cohort = [bench_cohort.RequestSpec(i, i % 4, i < 4, prompts[i % 4]) for i in range(8)]
    pages = [torch.zeros((bench_cohort.Engine.blocks_needed(recipe), m.kv_heads, recipe.block_size, 2 * m.head_dim),
                         dtype=torch.bfloat16) for _ in range(m.layers)]
    engine = bench_cohort.Engine(bench_cohort.build_model(m, "cpu", 0), recipe, pages)
    real, calls, spans = engine.forward, itertools.count(), []

    def forward(ids, cache):
        t = time.perf_counter()
        if next(calls) == 0:  # hold the first forward until the other three workers queue behind it
            assert wait_until(lambda: engine._steps.waiting == recipe.concurrency - 1, interval=0.001)
            time.sleep(0.01)
        time.sleep(0.001)  # room for another worker's forward to start, were it let in
        lp = real(ids, cache)
        spans.append((t, time.perf_counter()))
        return lp

    engine.forward = forward
    records, wall = bench_cohort.run_requests(engine, cohort, bench_cohort.request_streams("cpu", recipe.concurrency))
    assert len(spans) == recipe.requests * recipe.output_tokens
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert [r.computed_tokens for r in records] == [recipe.input_tokens] * 4 + [1] * 4
    assert sum(r.queue_s >= 0.01 for r in records[:4]) == recipe.concurrency - 1
    for r in records:
        assert r.ttft_s >= r.lookup_s + r.restore_s + r.gather_s + r.queue_s + r.prefill_s
        assert r.prefill_s >= 0.001 and r.decode_s >= 0.001 * (recipe.output_tokens - 1) and r.decode_queue_s > 0
    # the lock's holds are disjoint: forward times without the waits add up to at most the run's wall time
    assert sum(r.prefill_s + r.decode_s for r in records) <= wall
    assert engine.hbm_pins() == 0
