"""Start a real engine (ours, on the CPU) for tests and benchmarks: ``running_engine(model) -> base_url``.

Usage::

    from pipeline.testing.engine import running_engine

    def test_something():
        with running_engine("tiny-random") as url:          # in this process, ~1-3 s
            ...  # EngineClient(url), httpx, the proxy pointed at url ...

    @pytest.fixture(scope="module")   # one engine for a whole test file
    def url():
        with running_engine("tiny-random", threads=2) as u:
            yield u

(``tests/conftest.py`` has such a fixture, ``engine_url``.)

``subprocess=True`` runs ``python -m pipeline engine`` instead (own process and torch threads,
~5-8 s to start; use it when a test needs to kill the engine or must not share torch's
process-wide thread setting). Both bind 127.0.0.1 on a free port and shut down cleanly on exit.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess as sp
import sys
import threading
import time
from typing import Any, Iterator

from pipeline.testing.servers import serve_server


@contextlib.contextmanager
def running_engine(model: str = "tiny-random", cache_dir: str | None = None, *, subprocess: bool = False,
                   threads: int | None = None, weight_version: str = "0", max_batch_size: int = 16,
                   context_length: int | None = 2048, api_key: str | None = None, seed: int = 0,
                   start_timeout_s: float = 180.0, prefix_cache_bytes: int = 1 << 30,
                   lora: Any = None, lora_paths: dict[str, str] | None = None) -> Iterator[str]:
    """Serve ``model`` (``tiny-random`` | ``smollm2-135m`` | HF folder) and yield its base URL.

    Args:
        cache_dir: where built-in models live (default ``~/.cache/openclaw-pipeline``).
        subprocess: run the engine as a child process instead of a thread of this process.
        threads: torch threads (in-process mode changes this process's setting); None = all cores.
        weight_version, max_batch_size, context_length, api_key, seed, prefix_cache_bytes: engine
            settings (``prefix_cache_bytes=0``: no prefix cache).
        lora, lora_paths: LoRA settings (:class:`pipeline.engine.lora.LoraSettings`) and start-up
            adapters (name -> folder; in-process mode only). A child process gets ``lora`` as the
            engine's flags (``--enable-lora``, ``--max-lora-rank``, ``--lora-target-modules``,
            ``--max-loras-per-batch``).
    Raises:
        RuntimeError: the engine did not come up within ``start_timeout_s``.
    """
    if subprocess:
        if lora_paths:
            raise ValueError("lora_paths is for an in-process engine")
        with _subprocess_engine(model, cache_dir, threads, weight_version, max_batch_size, context_length,
                                api_key, seed, start_timeout_s, prefix_cache_bytes, lora) as url:
            yield url
        return
    from pipeline.engine.runtime import build_state, make_server

    state = build_state(model, cache_dir=cache_dir, context_length=context_length, max_batch_size=max_batch_size,
                        weight_version=weight_version, seed=seed, threads=threads,
                        prefix_cache_bytes=prefix_cache_bytes, lora=lora, lora_paths=lora_paths)
    try:
        with serve_server(make_server(state, api_key=api_key), backlog=128, start_timeout_s=start_timeout_s,
                          config_loop=False) as url:
            yield url
    finally:
        state.shutting_down = True
        state.worker.stop()


@contextlib.contextmanager
def _subprocess_engine(model, cache_dir, threads, weight_version, max_batch_size, context_length, api_key, seed,
                       start_timeout_s, prefix_cache_bytes, lora=None) -> Iterator[str]:
    cmd = [sys.executable, "-m", "pipeline", "engine", "--model", model, "--host", "127.0.0.1", "--port", "0",
           "--weight-version", str(weight_version), "--max-batch-size", str(max_batch_size), "--seed", str(seed),
           "--prefix-cache-bytes", str(prefix_cache_bytes)]
    if cache_dir:
        cmd += ["--cache-dir", str(cache_dir)]
    if threads:
        cmd += ["--threads", str(threads)]
    if context_length:
        cmd += ["--context-length", str(context_length)]
    if lora is not None and lora.enabled:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora.max_rank), "--max-loras-per-batch",
                str(lora.max_per_batch), "--lora-target-modules", *lora.targets]
    env = dict(os.environ)
    if api_key:
        env["PIPELINE_ENGINE__API_KEY"] = api_key
    proc = sp.Popen(cmd, stdout=sp.PIPE, stderr=None, text=True, env=env)
    url: list[str] = []

    def _read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("ENGINE READY ") and not url:
                url.append(line.split()[2])

    reader = threading.Thread(target=_read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not url:
            if proc.poll() is not None:
                raise RuntimeError(f"engine process exited with {proc.returncode} before it was ready")
            if time.monotonic() > deadline:
                raise RuntimeError("engine process did not become ready in time")
            time.sleep(0.05)
        _wait_health(url[0], deadline)
        yield url[0]
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except sp.TimeoutExpired:
                proc.kill()
                proc.wait(5)


def _wait_health(url: str, deadline: float) -> None:
    import httpx

    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"engine at {url} not healthy in time")


def perturbed_copy(out, model: str = "tiny-random", seed: int = 123, scale: float = 0.05):
    """Save into folder ``out`` a copy of ``model`` with every weight shifted by seeded Gaussian
    noise of std ``scale`` (same architecture and tokenizer: new weights an engine accepts)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.models import resolve_model

    src = resolve_model(model)
    net = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    net.save_pretrained(out)
    AutoTokenizer.from_pretrained(src).save_pretrained(out)
    return out
