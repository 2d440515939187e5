"""Engine adapters: thin layers that map an engine's blocks to OrbitKV-FS chunk keys and forward calls.

* :mod:`.common` -- engine-independent logic (key derivation, block math, failure handling); no engine,
  no torch, no GPU needed.
* :mod:`.staging` -- K/V views of vLLM's layouts per attention backend, and the bounded, pipelined staging
  area for engine KV the Manager cannot import (torch imported lazily).
* :mod:`.hf` -- Hugging Face transformers ``DynamicCache`` save/restore (torch imported lazily).
* :mod:`.vllm` -- ``OrbitKVConnector``, a vLLM ``KVConnectorBase_V1`` subclass.
* :mod:`.sglang` -- ``OrbitKVHiCacheStorage``, an SGLang ``HiCacheStorage`` backend.

Importing this package (or any adapter module) never imports vllm, sglang or torch when they are absent.
"""
