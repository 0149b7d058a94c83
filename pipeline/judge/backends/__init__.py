"""Judge backends, selectable by name (``judge.backend``) or by import path for users' own.

- ``llm``: m sampled ``\\boxed{}`` votes from an OpenAI-compatible endpoint (production default);
- ``choice``: log-prob scoring of ``\\boxed{1|0|-1}`` with ``/generate`` (SGLang API);
- ``embedding``: MiniLM prototype classifier of the next state (CPU, single-machine default);
- ``constant``: instant +1 (benchmarks only);
- ``package.module:ClassName`` (or ``package.module.ClassName``): a :class:`Backend` subclass,
  constructed with the process :class:`pipeline.config.Config`.
"""

from __future__ import annotations

import importlib

from pipeline.judge.backends.base import Backend, HintVerdict, Verdict

BUILTIN = {
    "llm": "pipeline.judge.backends.llm:LLMBackend",
    "choice": "pipeline.judge.backends.choice:ChoiceBackend",
    "embedding": "pipeline.judge.backends.embedding:EmbeddingBackend",
    "constant": "pipeline.judge.backends.constant:ConstantBackend",
}


class BackendError(ValueError):
    """``judge.backend`` names no built-in backend and no importable Backend class."""


def backend_class(spec: str) -> type[Backend]:
    """The backend class for a name or import path. Raises :class:`BackendError`."""
    path = BUILTIN.get(spec, spec)
    if ":" in path:
        mod_name, _, attr = path.partition(":")
    else:
        mod_name, _, attr = path.rpartition(".")
    if not mod_name or not attr:
        raise BackendError(f"judge.backend {spec!r}: use one of {', '.join(BUILTIN)} or 'package.module:Class'")
    try:
        cls = getattr(importlib.import_module(mod_name), attr)
    except (ImportError, AttributeError) as e:
        raise BackendError(f"judge.backend {spec!r}: cannot import {path}: {e}") from e
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"judge.backend {spec!r}: {path} is not a pipeline.judge.backends.Backend subclass")
    return cls


def make_backend(spec: str, config) -> Backend:
    """Construct the backend ``spec`` for ``config`` (may load models: call it off the hot path)."""
    return backend_class(spec)(config)


__all__ = ["Backend", "Verdict", "HintVerdict", "BackendError", "backend_class", "make_backend", "BUILTIN"]
