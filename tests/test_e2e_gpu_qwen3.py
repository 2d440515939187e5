"""GPU end to end (device machine): a randomly initialised Qwen3 (head_dim 128) in transformers on the GPU,
a separate ``orbitkv-cache-manager`` process importing the engine's GPU pages through CUDA IPC, GPU codecs,
DRAM and SSD tiers.

Flows, as the CPU test (``test_e2e_smollm2.py``) but on the GPU:

1. Per exact codec (``none``, ``ans``): engine process A prefills each prompt's block-aligned prefix,
   saves its KV and generates 32 greedy tokens (the control); the Manager flushes DRAM to SSD; engine
   process B restores every prefix (SSD -> DRAM -> GPU decode into B's pages) and generates:
   token-identical, KV bit-exact.
2. Under ``ans``, one SSD record of a block only one prompt uses is corrupted after another flush: that
   prompt restores up to the block and recomputes the rest (identical tokens), the others hit in full.
3. Lossy codecs (``fp8``, ``turboquant-4``, ``turboquant-3``) are reported, never gated.

The model's weights come from a fixed seed, so every process builds the same model; token ids are bytes
of the text (the model is random, a real tokenizer adds nothing). Run on the device with::

    ORBITKV_E2E_REPORT=out.json pytest -m gpu tests/test_e2e_gpu_qwen3.py -s
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_e2e_smollm2 as cpu  # noqa: E402  (the shared harness: engine loop, Manager process, SSD corruption)

QWEN3 = dict(vocab_size=512, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=8, head_dim=128, max_position_embeddings=4096, tie_word_embeddings=True)
MODEL_NAME = "qwen3-random-seed0-hd128"


class ByteTokenizer:
    """UTF-8 bytes as token ids (plus 3): enough for a randomly initialised model."""

    def __call__(self, text: str, return_tensors: str = "pt") -> SimpleNamespace:
        import torch

        return SimpleNamespace(input_ids=torch.tensor([[b + 3 for b in text.encode()]]))


class GpuEngine(cpu.Engine):
    """The engine process on the GPU: BF16 model, BF16 KV, staging pages on the GPU (CUDA IPC)."""

    MODEL_NAME = MODEL_NAME
    KV_DTYPE = "bfloat16"

    def __init__(self, manager: str, model_dir: str) -> None:
        import torch
        import transformers

        from orbitkv_fs.connectors.common import connect_client

        self.torch = torch
        torch.manual_seed(0)
        self.model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**QWEN3)).to(torch.bfloat16)
        self.model = self.model.to("cuda").eval()
        self.tok = ByteTokenizer()
        self.client = connect_client(manager, timeout_s=120)
        self.stores: dict[str, Any] = {}

    def ids(self, prompt: str) -> Any:
        return self.tok(prompt).input_ids.to("cuda")


@pytest.mark.gpu
@pytest.mark.e2e
def test_qwen3_gpu_cuda_ipc_exact_codecs_corruption_and_lossy(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    manager = cpu.ManagerProcess(tmp_path, device="auto", pool_size="2gib", ssd_capacity="2gib")
    engines: list[cpu.EngineProcess] = []
    try:
        for codec in ("none", "ans"):
            a = cpu.EngineProcess(manager.data_plane, tmp_path, script=__file__)
            engines.append(a)
            control = a("control", prompts=cpu.PROMPTS, save=True, codec=codec)
            a.close()
            assert control["saved"] == control["cut"] and all(control["cut"])
            manager.flush_dram()
            b = cpu.EngineProcess(manager.data_plane, tmp_path, script=__file__)
            engines.append(b)
            hot = b("restore", prompts=cpu.PROMPTS, codec=codec)
            assert hot["restored"] == control["cut"], codec
            assert all(hot["kv_exact"]), f"{codec}: restored KV must be bit-exact"
            assert hot["tokens"] == control["tokens"], f"{codec}: token-identical to the control"
            report: dict[str, Any] = {"codec": codec, "cut_tokens": control["cut"], "restored": hot["restored"],
                                      "token_identical": True, "seconds": {"control": control["seconds"],
                                                                           "restore": hot["seconds"]}}
            if codec == "ans":
                keys = [[bytes.fromhex(k) for k in ks] for ks in control["keys"]]
                others = {k for i, ks in enumerate(keys) if i != 1 for k in ks}
                victim = next(i for i, k in enumerate(keys[1]) if k not in others)
                manager.flush_dram()
                report["corrupted_records"] = cpu.corrupt_ssd_records(manager.ssd, keys[1][victim], limit=8)
                after = b("restore", prompts=cpu.PROMPTS, codec=codec)
                expect = list(control["cut"])
                expect[1] = victim * cpu.BLOCK
                assert after["restored"] == expect
                assert after["tokens"] == control["tokens"]
                report["restored_after_corruption"] = after["restored"]
                lossy = {c: b("lossy", prompts=cpu.PROMPTS, codec=c, control=control["tokens"],
                              heldout=cpu.heldout_text()) for c in cpu.LOSSY}
                for c, r in lossy.items():
                    cpu.report(f"gpu:lossy:{c}", r)
            b.close()
            cpu.report(f"gpu:exact:{codec}", report)
        cpu.report("gpu:manager_stats", manager.stats())
    finally:
        for e in engines:
            e.close()
        manager.close()


if __name__ == "__main__" and sys.argv[1:] == ["engine"]:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.exit(cpu.engine_main(GpuEngine))
