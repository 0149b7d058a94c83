"""Which client speaks to an engine: one factory for every server family (``engine.kind``).

==========  ==================================================================================
kind        server and client
==========  ==================================================================================
native      this package's CPU engine (``pipeline engine``): :class:`EngineClient`
sglang      SGLang: :class:`EngineClient` (streamed ids through ``/v1/tokenize`` + ``/generate``)
vllm        vLLM's OpenAI server: :class:`pipeline.engine_api.vllm.VllmClient`
==========  ==================================================================================

The proxy, the judge's teacher and the syncers ask :func:`engine_client` and see one interface.
"""

from __future__ import annotations

import os
from typing import Any

from pipeline.engine_api.client import EngineClient
from pipeline.engine_api.vllm import VllmClient

#: the server families ``engine.kind`` names
ENGINE_KINDS = ("native", "sglang", "vllm")


def engine_client(kind: str, base_url: str, timeout_s: float = 300.0, api_key: str | None = None, *,
                  initial_version: str = "0", reference_dir: str | os.PathLike | None = None,
                  **kw: Any) -> EngineClient:
    """A client of the ``kind`` server at ``base_url`` (``initial_version``, ``reference_dir``:
    vLLM's, see :class:`VllmClient`; other kwargs: :class:`EngineClient`'s).

    Raises:
        ValueError: an unknown kind.
    """
    if kind == "vllm":
        return VllmClient(base_url, timeout_s, api_key, initial_version=initial_version,
                          reference_dir=reference_dir, **kw)
    if kind in ("native", "sglang"):
        return EngineClient(base_url, timeout_s, api_key, **kw)
    raise ValueError(f"engine kind {kind!r}: expected one of {', '.join(ENGINE_KINDS)}")


def adapter_model(kind: str, base: str, adapter_name: str) -> str:
    """The chat ``model`` that selects a loaded LoRA adapter on a ``kind`` server."""
    return adapter_name if kind == "vllm" else f"{base}:{adapter_name}"
