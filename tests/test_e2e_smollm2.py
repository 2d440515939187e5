"""Real-model end to end on the CPU: SmolLM2-135M (transformers, offline) over a Manager PROCESS with DRAM
and SSD tiers, through the transformers adapter (:mod:`orbitkv_fs.connectors.hf`).

Flows (issue 7):

1. Cold control: engine process A prefills each prompt's block-aligned prefix, saves its KV, and generates
   32 greedy tokens. The prompts share prefixes (two system texts x two questions).
2. ``POST /v1/admin/flush-dram`` demotes everything to SSD. Engine process B (a fresh process: no KV of
   its own) restores every prefix from the SSD tier and generates: token-identical to the control.
3. One SSD record (one layer's segment) of a block that only one prompt uses is corrupted on disk after
   another flush: that prompt's restore stops at the block (a miss), the rest of its prompt is recomputed,
   the output is still identical; the other prompts still hit in full.
4. Lossy codecs (fp8, turboquant-4, turboquant-3): token agreement with the control, max |logprob|
   difference of the control tokens (teacher-forced) and perplexity change on a held-out text are
   REPORTED (written to ``$ORBITKV_E2E_REPORT`` when set, printed otherwise), never asserted.

The engine prefills in block-aligned chunks (chunked prefill at block granularity, as vLLM does with
chunked prefill): a block's KV is then computed the same way whether the blocks before it were computed or
restored, so "identical" tests that restored KV is bit-exact (also checked byte for byte) and that recovery
from a miss recomputes exactly what was lost. One prompt generated from a single full prefill is reported
for information (a different computation order, so not gated). This module is also the engine process: ``python
tests/test_e2e_smollm2.py engine`` reads JSON commands on stdin and answers JSON lines on stdout.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

BLOCK = 16
NEW_TOKENS = 32
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"

SYSTEMS = [
    "You are a careful assistant for a storage team. The cache keeps attention keys and values so that later "
    "requests sharing a prefix skip the prefill, and every record carries a checksum. ",
    "Context: In 1969 the Apollo 11 crew landed on the Moon; Neil Armstrong stepped out first, followed by Buzz "
    "Aldrin, while Michael Collins orbited above in the command module. ",
]
QUESTIONS = [
    ["Question: why does sharing a prefix between two requests save time on a busy server? Answer:",
     "Question: what should a cache do when one of its stored records fails its checksum? Answer:"],
    ["Question: which astronaut was the first person to step onto the surface of the Moon? Answer:",
     "Question: which member of the crew stayed in orbit while the other two walked outside? Answer:"],
]
PROMPTS = [s + q for s, qs in zip(SYSTEMS, QUESTIONS) for q in qs]
LOSSY = ("fp8", "turboquant-4", "turboquant-3")


# ============================================================================== engine process (child side)


class Engine:
    """The transformers engine process: model, tokenizer and one HFPrefixStore per codec."""

    MODEL_NAME = MODEL_NAME
    #: FP32 compute with a BF16 KV cache (as an engine with kv_cache_dtype=bfloat16): the codecs take
    #: BF16, and CPU BF16 matmuls would be several times slower.
    KV_DTYPE = "bfloat16"

    def __init__(self, manager: str, model_dir: str) -> None:
        import torch

        from orbitkv_fs.connectors.common import connect_client
        from orbitkv_fs.tools.models import load_smollm2

        self.torch = torch
        torch.manual_seed(0)
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        # Its own disk cache of the dequantised model makes the next engine process start fast. ``model_dir`` is
        # the subclasses' (a model of their own); a GGUF-loaded model cannot be saved there (transformers refuses).
        self.model, self.tok = load_smollm2()
        self.model.eval()
        self.client = connect_client(manager, timeout_s=120)
        self.stores: dict[str, Any] = {}

    def store(self, codec: str) -> Any:
        from orbitkv_fs.connectors.hf import HFPrefixStore

        if codec not in self.stores:
            self.stores[codec] = HFPrefixStore.for_model(self.client, self.model, model=self.MODEL_NAME,
                                                         block_size=BLOCK, slots=16, codec=codec, dtype=self.KV_DTYPE)
            assert self.stores[codec].session is not None, "registration with the Manager failed"
        return self.stores[codec]

    def ids(self, prompt: str) -> Any:
        return self.tok(prompt, return_tensors="pt").input_ids

    def cut(self, n: int) -> int:
        return (n - 1) // BLOCK * BLOCK

    def new_cache(self) -> Any:
        return self.store("none").new_cache()

    def extend(self, cache: Any, ids: Any, start: int, end: int) -> Any:
        """Compute tokens ``[start, end)`` into ``cache`` in block-aligned chunks (chunked prefill at block
        granularity): a block's KV then comes from the same computation whether the blocks before it were
        computed here or restored, which is what makes recovery from a miss token-identical."""
        with self.torch.inference_mode():
            s = start
            while s < end:
                e = min((s // BLOCK + 1) * BLOCK, end)
                self.model(input_ids=ids[:, s:e], past_key_values=cache, use_cache=True)
                s = e
        return cache

    def prefill(self, ids: Any, n: int) -> Any:
        return self.extend(self.new_cache(), ids, 0, n)

    def generate(self, ids: Any, cache: Any, *, monolithic: bool = False) -> tuple[list[int], list[float]]:
        """32 greedy tokens after ``ids``, continuing ``cache`` (None: empty). The rest of the prompt but its
        last token goes through :meth:`extend` unless ``monolithic`` (one prefill of everything left)."""
        torch = self.torch
        cache = cache if cache is not None else self.new_cache()
        if not monolithic:
            self.extend(cache, ids, cache.get_seq_length(), ids.shape[1] - 1)
        with torch.inference_mode():
            out = self.model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                      max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                      output_logits=True, return_dict_in_generate=True)
        toks = out.sequences[0, ids.shape[1]:].tolist()
        lps = [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, toks)]
        return toks, lps

    def forced_logprobs(self, ids: Any, cache: Any, n_cached: int, tokens: list[int]) -> list[float]:
        """Log-probabilities of ``tokens`` following ``ids`` given a cache of the first ``n_cached`` tokens."""
        torch = self.torch
        seq = torch.cat([ids[0, n_cached:], torch.tensor(tokens[:-1], dtype=ids.dtype, device=ids.device)])
        seq = seq.unsqueeze(0)
        with torch.inference_mode():
            logits = self.model(input_ids=seq, past_key_values=cache, use_cache=True).logits[0].float()
        lp = torch.log_softmax(logits, -1)
        first = ids.shape[1] - n_cached - 1  # position predicting tokens[0]
        return [float(lp[first + i, t]) for i, t in enumerate(tokens)]

    # -- commands --------------------------------------------------------------------------------------

    def op_control(self, prompts: list[str], save: bool, codec: str = "none") -> dict[str, Any]:
        res: dict[str, Any] = {"tokens": [], "logprobs": [], "cut": [], "saved": [], "full_prefill_tokens": [],
                               "keys": []}
        store = self.store(codec)
        for p in prompts:
            ids = self.ids(p)
            n = self.cut(ids.shape[1])
            cache = self.prefill(ids, n)
            res["saved"].append(store.save(ids[:, :n], cache) if save else 0)
            toks, lps = self.generate(ids, cache)
            res["tokens"].append(toks)
            res["logprobs"].append(lps)
            res["cut"].append(n)
            res["keys"].append([k.hex() for k in store.keys(ids[:, :n])])
            if not res["full_prefill_tokens"]:  # for information, one prompt: a single full prefill
                res["full_prefill_tokens"].append(self.generate(ids, None, monolithic=True)[0])
        return res

    def op_restore(self, prompts: list[str], codec: str = "none") -> dict[str, Any]:
        res: dict[str, Any] = {"tokens": [], "logprobs": [], "restored": [], "kv_exact": []}
        store = self.store(codec)
        for p in prompts:
            ids = self.ids(p)
            cache, n = store.restore(ids)
            if n:
                # The restored bytes against a local prefill of the same tokens (bit-exact for `none`).
                local = self.prefill(ids, n)
                res["kv_exact"].append(all(
                    self.torch.equal(a.keys, b.keys) and self.torch.equal(a.values, b.values)
                    for a, b in zip(cache.layers, local.layers)))
            else:
                res["kv_exact"].append(None)
            toks, lps = self.generate(ids, cache)
            res["tokens"].append(toks)
            res["logprobs"].append(lps)
            res["restored"].append(n)
        return res

    def op_lossy(self, prompts: list[str], codec: str, control: list[list[int]], heldout: str) -> dict[str, Any]:
        """Save with ``codec``, restore, and measure against the exact (local) KV."""
        store = self.store(codec)
        agree, max_lp, first_div, restored = [], 0.0, [], []
        for p, ctl in zip(prompts, control):
            ids = self.ids(p)
            n = self.cut(ids.shape[1])
            store.save(ids[:, :n], self.prefill(ids, n))
            cache, got = store.restore(ids)
            restored.append(got)
            toks, _ = self.generate(ids, cache)
            agree.append(sum(a == b for a, b in zip(toks, ctl)) / len(ctl))
            first_div.append(next((i for i, (a, b) in enumerate(zip(toks, ctl)) if a != b), None))
            again = store.restore(ids)[0]
            lossy_lp = self.forced_logprobs(ids, again if again is not None else self.new_cache(), got, ctl)
            exact_lp = self.forced_logprobs(ids, self.prefill(ids, got), got, ctl)
            max_lp = max(max_lp, max(abs(a - b) for a, b in zip(lossy_lp, exact_lp)))
        # Perplexity of a held-out continuation given a stored context.
        ids = self.ids(heldout)
        n_ctx = min(self.cut(ids.shape[1]), 6 * BLOCK)
        ctx_ids, cont = ids[:, : n_ctx + 1], ids[0, n_ctx:].tolist()
        store.save(ids[:, :n_ctx], self.prefill(ids, n_ctx))
        lossy_cache, got = store.restore(ctx_ids)
        assert got == n_ctx, f"held-out context restored {got} of {n_ctx} tokens"
        ppl = {}
        for name, cache in (("exact", self.prefill(ids, n_ctx)), ("lossy", lossy_cache)):
            lps = self.forced_logprobs(ids[:, : n_ctx + 1], cache, n_ctx, cont[1:])
            ppl[name] = float(self.torch.tensor(lps).neg().mean().exp())
        return {"codec": codec, "token_agreement": agree, "first_divergence": first_div, "restored": restored,
                "max_abs_logprob_diff": max_lp, "heldout_context_tokens": got, "heldout_tokens": len(cont) - 1,
                "perplexity_exact": ppl["exact"], "perplexity_lossy": ppl["lossy"],
                "perplexity_change": ppl["lossy"] - ppl["exact"]}

    def close(self) -> None:
        for s in self.stores.values():
            s.close()
        self.client.close()


def engine_main(engine_cls: type = Engine) -> int:
    """JSON-lines command loop: one command per stdin line, one answer per stdout line."""
    out = sys.stdout
    sys.stdout = sys.stderr  # library chatter must not corrupt the protocol
    first = json.loads(sys.stdin.readline())
    t0 = time.monotonic()
    engine = engine_cls(first["manager"], first["model_dir"])
    out.write(json.dumps({"ok": True, "load_seconds": time.monotonic() - t0}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        t0 = time.monotonic()
        try:
            res = getattr(engine, f"op_{op}")(**cmd)
            res["seconds"] = time.monotonic() - t0
            out.write(json.dumps({"ok": True, "result": res}) + "\n")
        except Exception as e:  # reported to the test, which fails with it
            import traceback

            out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()}) + "\n")
        out.flush()
    engine.close()
    return 0


# ================================================================================= test side (parent process)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineProcess:
    """An engine process (``script engine``) driven over its stdin/stdout."""

    def __init__(self, manager: str, model_dir: Path, *, script: str = __file__) -> None:
        self.proc = subprocess.Popen([sys.executable, script, "engine"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1",
                                                                           "TRANSFORMERS_OFFLINE": "1"})
        self.ready = self._send({"manager": manager, "model_dir": str(model_dir)})

    def _send(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin and self.proc.stdout
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"engine process died (rc={self.proc.wait(30)})")
        msg = json.loads(line)
        if not msg["ok"]:
            raise AssertionError(f"engine error: {msg['error']}\n{msg.get('traceback', '')}")
        return msg.get("result", msg)

    def __call__(self, op: str, **kw: Any) -> dict[str, Any]:
        return self._send({"op": op, **kw})

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write('{"op": "exit"}\n')
                self.proc.stdin.flush()
                self.proc.wait(60)
            except Exception:
                self.proc.kill()
                self.proc.wait()


class ManagerProcess:
    """``orbitkv-cache-manager`` with DRAM, an SSD shard and the HTTP plane, on loopback."""

    def __init__(self, tmp: Path, *, device: str = "cpu", pool_size: str = "256mib",
                 ssd_capacity: str = "256mib") -> None:
        self.data_plane = f"tcp://127.0.0.1:{_free_port()}"
        self.http = f"127.0.0.1:{_free_port()}"
        self.ssd = tmp / "ssd0.log"
        self.log = open(tmp / "manager.log", "w")
        argv = [sys.executable, "-m", "orbitkv_fs.server.cli", "--pool-size", pool_size, "--device", device,
                "--shm-dir", "/dev/shm" if os.path.isdir("/dev/shm") else str(tmp),
                "--data-plane", self.data_plane, "--http-addr", self.http,
                "--ssd-cache-path", str(self.ssd), "--ssd-cache-capacity", ssd_capacity]
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        self._wait_ready()

    def _wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"manager exited rc={self.proc.returncode}: {Path(self.log.name).read_text()[-3000:]}")
            try:
                if httpx.get(f"http://{self.http}/readyz", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise AssertionError("manager not ready after 60 s")

    def flush_dram(self) -> dict[str, Any]:
        import httpx

        r = httpx.post(f"http://{self.http}/v1/admin/flush-dram", timeout=120)
        assert r.status_code == 200, r.text
        return r.json()

    def stats(self) -> dict[str, Any]:
        import httpx

        r = httpx.get(f"http://{self.http}/v1/stats", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def corrupt_ssd_records(path: Path, chunk: bytes, *, limit: int = 1) -> list[tuple[int, int, int]]:
    """Flip one payload byte in up to ``limit`` committed records of ``chunk`` (each generation of the
    first matching (layer, role)). Returns ``(offset, layer, role)`` of what was corrupted."""
    from orbitkv_fs.tiers.ssd.record import RECORD_HEADER_SIZE
    from orbitkv_fs.tiers.ssd.recovery import Status, recover_shard

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        entries = [e for e in recover_shard(mm).records if e.status == Status.VALID and e.header.key is not None
                   and e.header.key.chunk == chunk]
    assert entries, "no SSD record of the chunk to corrupt"
    target = (entries[0].header.key.layer, entries[0].header.key.role)
    done = []
    fd = os.open(path, os.O_RDWR)
    try:
        for e in entries:
            if (e.header.key.layer, e.header.key.role) != target:
                continue
            pos = e.offset + RECORD_HEADER_SIZE + 64 + 17  # a payload byte, past both headers
            b = os.pread(fd, 1, pos)
            os.pwrite(fd, bytes([b[0] ^ 0x5A]), pos)
            done.append((e.offset, target[0], int(target[1])))
            if len(done) >= limit:
                break
        os.fsync(fd)
    finally:
        os.close(fd)
    return done


def heldout_text() -> str:
    from orbitkv_fs.tools.models import SAMPLE_TEXT

    return SAMPLE_TEXT


def report(name: str, data: Any) -> None:
    """Record a finding: into ``$ORBITKV_E2E_REPORT`` (JSON, merged) when set, and on stdout."""
    path = os.environ.get("ORBITKV_E2E_REPORT")
    if path:
        p = Path(path)
        doc = json.loads(p.read_text()) if p.is_file() else {}
        doc[name] = data
        p.write_text(json.dumps(doc, indent=1))
    print(f"\n[e2e report] {name}: {json.dumps(data)}")


@pytest.fixture(scope="module")
def smollm2_available() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from orbitkv_fs.tools.models import ModelUnavailable, gguf_path

    try:
        gguf_path()
    except ModelUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.e2e
def test_smollm2_save_flush_restore_corrupt_and_lossy(tmp_path: Path, smollm2_available: None) -> None:
    manager = ManagerProcess(tmp_path)
    engines: list[EngineProcess] = []
    try:
        model_dir = tmp_path / "model-bf16"
        # 1. Cold control in engine process A, saving every prompt's prefix.
        a = EngineProcess(manager.data_plane, model_dir)
        engines.append(a)
        control = a("control", prompts=PROMPTS, save=True)
        a.close()
        assert all(n > 0 for n in control["cut"])
        assert control["saved"] == control["cut"]
        keys = [[bytes.fromhex(k) for k in ks] for ks in control["keys"]]
        shared = set(keys[0]) & set(keys[1])
        assert shared, "the prompts were meant to share prefix blocks"

        # 2. Flush DRAM to SSD; a fresh engine process restores from SSD.
        flushed = manager.flush_dram()
        b = EngineProcess(manager.data_plane, model_dir)
        engines.append(b)
        hot = b("restore", prompts=PROMPTS)
        assert hot["restored"] == control["cut"], "every saved prefix must hit in full"
        assert all(hot["kv_exact"]), "restored KV must be bit-identical to a local prefill"
        assert hot["tokens"] == control["tokens"], "exact codec: token-identical to the cold control"

        # 3. Corrupt one SSD record of a block only prompt 1 uses; flush so DRAM holds no copy.
        others = {k for i, ks in enumerate(keys) if i != 1 for k in ks}
        victim = next(i for i, k in enumerate(keys[1]) if k not in others)
        manager.flush_dram()
        corrupted = corrupt_ssd_records(manager.ssd, keys[1][victim], limit=8)
        after = b("restore", prompts=PROMPTS)
        expect = list(control["cut"])
        expect[1] = victim * BLOCK
        assert after["restored"] == expect, "the corrupt block is a miss, the others still hit"
        assert after["tokens"] == control["tokens"], "recomputing past the miss gives the same tokens"
        stats = manager.stats()

        # 4. Lossy codecs: report, never gate.
        # One prompt per shared prefix keeps the run short; the held-out text adds 6 blocks of context.
        lossy = {c: b("lossy", prompts=PROMPTS[::2], codec=c, control=control["tokens"][::2], heldout=heldout_text())
                 for c in LOSSY}
        b.close()
        report("exact", {
            "prompts": len(PROMPTS), "block_size": BLOCK, "new_tokens": NEW_TOKENS, "cut_tokens": control["cut"],
            "restored_from_ssd": hot["restored"], "token_identical": hot["tokens"] == control["tokens"],
            "restored_after_corruption": after["restored"], "corrupted_records": corrupted,
            "identical_after_corruption": after["tokens"] == control["tokens"],
            "prompt0_control_equals_single_full_prefill": control["tokens"][0] == control["full_prefill_tokens"][0],
            "flush": flushed, "engine_load_seconds": [a.ready.get("load_seconds"), b.ready.get("load_seconds")],
            "manager_stats": {k: stats.get(k) for k in ("hits", "misses", "decode_failures", "lower")},
        })
        for c, r in lossy.items():
            report(f"lossy:{c}", r)
    finally:
        for e in engines:
            e.close()
        manager.close()


if __name__ == "__main__" and sys.argv[1:] == ["engine"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(engine_main())
