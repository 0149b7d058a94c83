"""Judge backends, selectable by name (``judge.backend``) or by import path for users' own.

- ``llm``: m sampled ``\\boxed{}`` votes from an OpenAI-compatible endpoint (production default);
- ``choice``: log-prob scoring of ``\\boxed{1|0|-1}`` with ``/generate`` (SGLang API);
- ``embedding``: tool-result structure + MiniLM classifier of the next state (CPU, single-machine default);
- ``constant``: instant +1 (benchmarks only);
- ``package.module:ClassName`` (or ``package.module.ClassName``): a :class:`Backend` subclass,
  constructed with the process :class:`pipeline.config.Config`.

Agreement with the 40 labelled next states of ``tests/fixtures/judge_next_states.jsonl``
(``pipeline judge --eval FILE --backend NAME``), measured on the CPU when this was written:
``embedding`` 38/40; SmolLM2-135M-Instruct as ``choice``
14/40 (it picks +1 every time: the base rate); as ``llm`` (3 votes, 96 tokens) 10/40, all three
votes unparseable on 34 of 40 turns. A small CPU model is no judge; production uses a GPU judge.
"""

from __future__ import annotations

from pipeline.errors import PipelineError
from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.plugins import PluginError, load_object

BUILTIN = {
    "llm": "pipeline.judge.backends.llm:LLMBackend",
    "choice": "pipeline.judge.backends.choice:ChoiceBackend",
    "embedding": "pipeline.judge.backends.embedding:EmbeddingBackend",
    "constant": "pipeline.judge.backends.constant:ConstantBackend",
}


class BackendError(PipelineError, ValueError):
    """``judge.backend`` names no built-in backend and no importable Backend class."""


def backend_class(spec: str) -> type[Backend]:
    """The backend class for a name or import path (:func:`pipeline.plugins.load_object`).
    Raises :class:`BackendError`."""
    path = BUILTIN.get(spec, spec)
    try:
        cls = load_object(path)
    except PluginError as e:
        raise BackendError(f"judge.backend {spec!r}: {e} (use one of {', '.join(BUILTIN)} or "
                           "'package.module:Class')") from e
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise BackendError(f"judge.backend {spec!r}: {path} is not a pipeline.judge.backends.Backend subclass")
    return cls


def make_backend(spec: str, config) -> Backend:
    """Construct the backend ``spec`` for ``config`` (may load models: call it off the hot path)."""
    return backend_class(spec)(config)


__all__ = ["Backend", "Verdict", "HintVerdict", "BackendError", "backend_class", "make_backend", "BUILTIN"]
