"""The CPU policy engine: a small inference server that speaks the subset of SGLang's HTTP API
the pipeline uses (SGLang commit 004c82e).

Modules (torch is imported only by the ones that run the model):
- ``params``: sampling parameters and their validation (pure Python).
- ``grammar``: constrained decoding (llguidance grammars for tool calls, JSON schemas and regexes;
  the per-row matcher). See ``docs/constrained-decoding.md``.
- ``tools``: tool-call parsers (pure Python; the client reuses them). Prompts are rendered by
  :mod:`pipeline.engine_api.render`, shared with the judge's OPD teacher.
- ``model``, ``sampler``, ``worker``: fp32 model loading, sampling/log-probs, the batching thread.
- ``prefix_cache``: the KV of recent prompts, reused by prompts that start with the same token
  ids (LRU, bounded by ``engine.prefix_cache_bytes`` / ``prefix_cache_entries``, emptied on every
  weight swap; docs/prefix-cache.md).
- ``lora``: LoRA adapters (the PEFT folder, its sha256, the registry, the per-row delta hooked
  into the target projections so adapters and the base decode in one batch; docs/tenants.md).
- ``generation``, ``protocol``, ``server``, ``metrics``: the FastAPI app and its shapes.
- ``runtime``: build + serve; ``cli``: ``python -m pipeline engine``.

The client for this engine and for SGLang is :mod:`pipeline.engine_api.client`.
"""
