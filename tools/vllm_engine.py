"""A real vLLM engine process for tests and benchmarks: JSON commands on stdin, JSON answers on stdout.

Run by :class:`~orbitkv_fs.tools.vllm_env.VllmEngineProcess` inside the vLLM venv (never imported in the
main environment, which has no vLLM). The first line is the engine's settings (:func:`make_llm`); every
later line is a command: ``generate`` (greedy, per prompt: tokens, their log-probabilities,
``num_cached_tokens``, seconds), ``reset_prefix_cache``, ``connector`` (the worker connector's load/save
counters), ``scheduler`` (the scheduler's preemptions) or ``exit``. vLLM runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the connector's
scheduler and worker sides live here too.

Invariants: library output never reaches stdout (the protocol); an error in a command is answered (the
driver fails with it), never swallowed; the ``__main__`` guard vLLM's CPU build needs is here.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any


def make_llm(model: str, *, connector: dict[str, Any] | None = None, module_path: str = "orbitkv_fs.connectors.vllm",
             connector_name: str = "OrbitKVConnector", max_model_len: int = 2048, block_size: int | None = None,
             dtype: str = "float32", seed: int = 0, max_num_seqs: int = 4, kv_cache_dtype: str = "auto",
             kv_cache_memory_bytes: int | None = None) -> Any:
    """A vLLM ``LLM`` of ``model`` (greedy-ready, prefix caching on), with OrbitKV-FS's connector when
    ``connector`` (its ``kv_connector_extra_config``) is given; ``kv_cache_memory_bytes`` sizes its KV cache
    (vLLM's own option: on the CPU backend it replaces ``VLLM_CPU_KVCACHE_SPACE``)."""
    from vllm import LLM

    kw: dict[str, Any] = {}
    if kv_cache_memory_bytes is not None:
        kw["kv_cache_memory_bytes"] = kv_cache_memory_bytes
    if connector is not None:
        from vllm.config import KVTransferConfig

        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector=connector_name, kv_connector_module_path=module_path, kv_role="kv_both",
            kv_load_failure_policy="recompute", kv_connector_extra_config=connector)
    if block_size is not None:
        kw["block_size"] = block_size
    # enforce_eager: the CPU build's torch.compile warm-up costs over a minute per process on 2 cores.
    return LLM(model=model, dtype=dtype, seed=seed, max_model_len=max_model_len, enable_prefix_caching=True,
               max_num_seqs=max_num_seqs, enforce_eager=True, kv_cache_dtype=kv_cache_dtype, **kw)


class Engine:
    def __init__(self, settings: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        self.llm = make_llm(**settings)
        self.load_seconds = time.perf_counter() - t0
        self.preemptions: int | None = 0
        self._count_preemptions()

    def _count_preemptions(self) -> None:
        """Count the scheduler's preemptions (vLLM's in-process engine core: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``).
        Private to vLLM: where it is not found the count stays None and the other commands work as before."""
        try:
            scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
            preempt = scheduler._preempt_request
        except AttributeError:
            self.preemptions = None
            return

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.preemptions = (self.preemptions or 0) + 1
            return preempt(*args, **kwargs)

        scheduler._preempt_request = counted

    def op_tokenize(self, texts: list[str]) -> dict[str, Any]:
        tok = self.llm.get_tokenizer()
        return {"ids": [tok.encode(t, add_special_tokens=False) for t in texts]}

    def op_generate(self, prompts: list[list[int]], max_tokens: int, cache_salt: str | None = None,
                    one_by_one: bool = True) -> dict[str, Any]:
        """Greedy completions of token-id prompts; ``one_by_one`` times each request on its own."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, min_tokens=max_tokens, logprobs=0, seed=0)
        inputs = [{"prompt_token_ids": p, **({"cache_salt": cache_salt} if cache_salt else {})} for p in prompts]
        batches = [[x] for x in inputs] if one_by_one else [inputs]
        res: dict[str, Any] = {"tokens": [], "logprobs": [], "num_cached_tokens": [], "seconds": []}
        for batch in batches:
            t0 = time.perf_counter()
            outs = self.llm.generate(batch, sp, use_tqdm=False)
            dt = time.perf_counter() - t0
            for o in outs:
                c = o.outputs[0]
                res["tokens"].append(list(c.token_ids))
                res["logprobs"].append([float(lp[t].logprob) for lp, t in zip(c.logprobs or [], c.token_ids)])
                res["num_cached_tokens"].append(int(o.num_cached_tokens or 0))
                res["seconds"].append(dt)
        return res

    def op_scheduler(self) -> dict[str, Any]:
        """The scheduler's counts: requests preempted so far (None: this vLLM's scheduler was not found)."""
        return {"preemptions": self.preemptions}

    def op_reset_prefix_cache(self) -> dict[str, Any]:
        return {"reset": bool(self.llm.reset_prefix_cache())}

    def op_connector(self) -> dict[str, Any]:
        """The worker connector's counters (``OrbitKVConnector.timings``); empty without a connector."""
        from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

        if not has_kv_transfer_group():
            return {}
        conn = get_kv_transfer_group()
        timings = getattr(conn, "timings", None)
        return {"type": type(conn).__name__, "staged": type(getattr(conn, "_session", None)).__name__ == "StagedSession",
                **(dict(timings) if timings else {})}


def main() -> int:
    out = sys.stdout
    sys.stdout = sys.stderr  # vLLM's and the libraries' chatter must not corrupt the protocol
    engine = Engine(json.loads(sys.stdin.readline()))
    out.write(json.dumps({"ok": True, "load_seconds": engine.load_seconds}) + "\n")
    out.flush()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            res = getattr(engine, f"op_{op}")(**cmd)
            out.write(json.dumps({"ok": True, "result": res}) + "\n")
        except Exception as e:  # answered: the driver fails with it
            import traceback

            out.write(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}",
                                  "traceback": traceback.format_exc()}) + "\n")
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
