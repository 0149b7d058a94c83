"""Build and serve an engine: model + tokenizer + model thread + FastAPI app + uvicorn."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time

from pipeline.engine.lora import LoraError, LoraSettings
from pipeline.engine.model import ModelLoadError, load_model, load_tokenizer
from pipeline.engine.prefix_cache import PrefixCache
from pipeline.engine.server import EngineState, create_app
from pipeline.engine.worker import EngineWorker

log = logging.getLogger(__name__)


def build_state(model: str, *, cache_dir: str | None = None, context_length: int | None = None,
                max_batch_size: int = 16, weight_version: str = "0", seed: int = 0, threads: int | None = None,
                served_model_name: str | None = None, prefix_cache_bytes: int = 1 << 30,
                prefix_cache_entries: int = 64, prefix_cache_min_tokens: int = 16,
                lora: LoraSettings | None = None, lora_paths: dict[str, str] | None = None) -> EngineState:
    """Resolve ``model`` (``smollm2-135m`` | ``tiny-random`` | HF folder), load it in fp32 and
    start its model thread.

    Args:
        context_length: prompt + output limit in tokens (capped by the model's own limit);
            None uses the model's ``max_position_embeddings``.
        threads: torch intra-op threads (process-wide); None = all cores.
        prefix_cache_bytes, prefix_cache_entries, prefix_cache_min_tokens: bounds of the prefix
            cache (:class:`pipeline.engine.prefix_cache.PrefixCache`; 0 bytes disables it).
        lora: LoRA switches (SGLang's ``--enable-lora`` and friends); None: LoRA off.
        lora_paths: adapters to load at start, name -> folder (SGLang's ``--lora-paths``);
            enables LoRA when given.
    Raises:
        pipeline.models.ModelNotFound, pipeline.engine.model.ModelLoadError (also for an
        adapter of ``lora_paths`` that does not load).
    """
    import torch

    from pipeline.models import resolve_model

    torch.set_num_threads(max(1, threads or os.cpu_count() or 1))
    t0 = time.perf_counter()
    path = resolve_model(model, cache_dir)
    loaded = load_model(path)
    tokenizer = load_tokenizer(path)
    ctx = loaded.max_position_embeddings if context_length is None else min(context_length,
                                                                             loaded.max_position_embeddings)
    worker = EngineWorker(loaded, tokenizer, context_length=ctx, max_batch_size=max_batch_size,
                          weight_version=str(weight_version), seed=seed,
                          prefix_cache=PrefixCache(prefix_cache_bytes, prefix_cache_entries, prefix_cache_min_tokens),
                          lora=lora_settings(lora, lora_paths))
    state = EngineState(worker=worker, tokenizer=tokenizer, served_model_name=served_model_name or model,
                        model_path=str(path), tokenizer_path=str(path), context_length=ctx, cache_dir=cache_dir)
    for name, folder in (lora_paths or {}).items():
        try:
            state.lora.load_sync(name, folder)
        except LoraError as e:
            raise ModelLoadError(f"--lora-paths {name}={folder}: {e}") from e
    worker.start()
    log.info("loaded %s from %s in %.1fs (context %d, batch %d, %d threads, prefix cache %d MiB)", model, path,
             time.perf_counter() - t0, ctx, max_batch_size, torch.get_num_threads(), prefix_cache_bytes >> 20)
    return state


def lora_settings(lora: LoraSettings | None, lora_paths: dict[str, str] | None) -> LoraSettings:
    """``lora`` (default: off), switched on when start-up adapters are given (as SGLang does)."""
    import dataclasses

    lora = lora or LoraSettings()
    return dataclasses.replace(lora, enabled=True) if lora_paths and not lora.enabled else lora


def make_server(state: EngineState, *, api_key: str | None = None, log_level: str = "warning"):
    """A ``uvicorn.Server`` for ``state`` (not started)."""
    import uvicorn

    app = create_app(state, api_key=api_key)
    config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve(state: EngineState, host: str, port: int, *, api_key: str | None = None,
          sock: socket.socket | None = None, log_level: str = "warning") -> None:
    """Serve until SIGINT/SIGTERM (main thread) or ``server.should_exit``; stops the model thread."""
    server = make_server(state, api_key=api_key, log_level=log_level)
    if sock is None:
        server.config.host, server.config.port = host, port
    try:
        asyncio.run(server.serve(sockets=[sock] if sock is not None else None))
    finally:
        state.shutting_down = True
        state.worker.stop()
