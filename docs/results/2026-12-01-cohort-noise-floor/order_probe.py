"""Does computation order alone move greedy tokens the way cohort-7's `none` did (0.695 agreement)?

The cohort engine serves a restored 4,096-token prompt as 4,095 cached tokens plus a one-token prefill; the
recompute control prefills all 4,096 at once. With EXACT cached KV (taken from the whole-prompt prefill
itself, as a bit-exact restore gives it) this probe compares, per prompt, 16 greedy tokens generated both
ways, on random-weight Qwen3 shapes (the cohort's tiny one, and one with Qwen3-8B's vocabulary, KV heads and
head_dim on a smaller body), in float32 and in BF16 (cohort-7's dtype on the H200).
No Manager is involved: whatever differs is the engine's arithmetic, not a restore.

    python docs/results/2026-12-01-cohort-noise-floor/order_probe.py > order_probe.json
"""

from __future__ import annotations

import json
import sys

import torch

from orbitkv_fs.tools.bench_cohort import QWEN3_TINY, ModelShape, _Forward, _new_cache, build_model

PROMPTS, TOKENS, NEW = 24, 1024, 16
#: Qwen3-8B's vocabulary, KV heads and head_dim on a body small enough for this CPU: random weights over a
#: 151,936-token vocabulary give the near-ties among top logits that greedy decoding flips on.
QWEN3_8B_VOCAB = ModelShape("qwen3-8b-vocab-8L", layers=8, kv_heads=8, head_dim=128, hidden=1024, heads=8,
                            intermediate=3072, vocab=151936)


def greedy(fwd: _Forward, cache, first_lp, n: int) -> list[int]:
    toks = [int(first_lp.argmax())]
    for _ in range(n - 1):
        toks.append(int(fwd(torch.tensor([[toks[-1]]]), cache).argmax()))
    return toks


def main() -> int:
    torch.set_num_threads(1)
    out = {}
    for shape, dtype in ((QWEN3_TINY, torch.float32), (QWEN3_TINY, torch.bfloat16),
                         (QWEN3_8B_VOCAB, torch.float32), (QWEN3_8B_VOCAB, torch.bfloat16)):
        model = build_model(shape, "cpu", 0).to(dtype)
        fwd = _Forward(model)
        g = torch.Generator().manual_seed(1)
        agree = total = identical = 0
        max_first = 0.0
        with torch.inference_mode():
            for _ in range(PROMPTS):
                ids = torch.randint(0, shape.vocab, (1, TOKENS), generator=g)
                whole = _new_cache(model)
                lp_whole = fwd(ids, whole)  # the recompute control: one prefill of the whole prompt
                # The served path: the same (exact) KV of the first TOKENS-1 tokens, then a one-token prefill.
                cached = _new_cache(model)
                for layer, lay in enumerate(whole.layers):
                    cached.update(lay.keys[:, :, : TOKENS - 1].clone(), lay.values[:, :, : TOKENS - 1].clone(), layer)
                lp_cached = fwd(ids[:, TOKENS - 1:], cached)
                max_first = max(max_first, float((lp_whole - lp_cached).abs().max()))
                a = greedy(fwd, whole, lp_whole, NEW)
                b = greedy(fwd, cached, lp_cached, NEW)
                agree += sum(x == y for x, y in zip(a, b))
                total += NEW
                identical += a == b
        out[f"{shape.name} {str(dtype).removeprefix('torch.')}"] = {"prompts": PROMPTS, "prompt_tokens": TOKENS, "new_tokens": NEW,
                                                  "token_agreement": agree / total, "identical_requests": identical,
                                                  "first_token_max_abs_logprob_diff": max_first}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
