"""Run megatron-core on a CPU-only torch build (gloo), for tests and the embedded trainer.

Megatron-core assumes CUDA: it passes ``torch.cuda.current_device()`` as ``device=``, seeds a
"cuda" RNG tracker, builds causal masks with ``device="cuda"``, allocates optimizer and grad
buffers on ``"cuda"``, calls ``torch.cuda.synchronize()`` and asserts
``param.type() == "torch.cuda.FloatTensor"``. :func:`apply` maps each of these to the CPU:

1. ``torch.cuda.current_device`` returns ``torch.device("cpu")``;
2. the "cuda" RNG state used by Megatron's RNG tracker is the CPU default generator;
3. Megatron's causal / sliding-window mask helpers build CPU masks;
4. synchronize / empty_cache / streams become no-ops;
5. a :class:`torch.overrides.TorchFunctionMode`, pushed on the calling thread, rewrites
   ``device="cuda"`` (or an int device) to the CPU, makes ``Tensor.cuda()`` the identity and
   makes ``Tensor.type()`` report ``torch.cuda.*`` names (Megatron's optimizer asserts them).

Only enabled without CUDA: on a machine with CUDA :func:`apply` returns ``False`` and changes
nothing (the GPU path runs the same trainer code with fusions on). Torch function modes are
thread-local, so Megatron code must run on the thread that called :func:`apply`.
:func:`remove` undoes everything (tests use it so other tests in the process run unpatched).

Measured with megatron-core 0.16.1 and torch 2.13 on the CPU (docs/environment.md §3).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch
from torch.overrides import TorchFunctionMode

_CPU = torch.device("cpu")
_lock = threading.Lock()
_saved: list[tuple[object, str, object]] = []  # (owner, attribute, original value)
_mode: TorchFunctionMode | None = None


def _is_cuda_device(d: object) -> bool:
    if isinstance(d, bool):
        return False
    if isinstance(d, str):
        return d.startswith("cuda")
    if isinstance(d, torch.device):
        return d.type == "cuda"
    return isinstance(d, int)  # Megatron passes a CUDA ordinal as ``device=<int>``


class _CudaToCpu(TorchFunctionMode):
    """Rewrite CUDA device arguments of every torch call to the CPU (see module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name = func(*args)
            return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
        d = kwargs.get("device")
        if d is not None and _is_cuda_device(d):
            kwargs = dict(kwargs, device=_CPU)
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda_device(args[1]):
            args = (args[0], _CPU, *args[2:])
        return func(*args, **kwargs)


class _NullStream:
    def wait_event(self, *a, **k): ...
    def wait_stream(self, *a, **k): ...
    def synchronize(self): ...
    def record_event(self, *a, **k): return None
    def query(self): return True


@functools.lru_cache(maxsize=16)
def _causal_mask(sq: int) -> torch.Tensor:
    """[sq, sq] bool, True above the diagonal (masked), like Megatron's default causal mask."""
    return torch.triu(torch.ones(sq, sq, dtype=torch.bool), diagonal=1)


def _sliding_window_mask(sq: int, skv: int, window_size) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    upper = torch.triu(m, diagonal=skv - sq - window_size[0])
    return ~torch.tril(upper, diagonal=skv - sq + window_size[1])


def _patch(owner: object, name: str, value: object) -> None:
    _saved.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def apply() -> bool:
    """Patch torch/Megatron for CPU execution; idempotent. Returns ``True`` if it patched.

    Call before building any Megatron model, on the thread that will run it. Returns ``False``
    (and does nothing) when CUDA is available.
    """
    global _mode
    if torch.cuda.is_available():
        return False
    with _lock:
        if _mode is not None:
            return True
        import megatron.core.fusions.fused_softmax as fused_softmax
        import megatron.core.tensor_parallel.random as mrandom
        import megatron.core.transformer.utils as tutils

        _patch(torch.cuda, "current_device", lambda: _CPU)
        _patch(torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state())
        _patch(torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(int(seed)))
        _patch(mrandom, "_get_cuda_rng_state",
               lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state())
        _patch(mrandom, "_set_cuda_rng_state",
               lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state))
        for mod in (tutils, fused_softmax):
            if hasattr(mod, "get_default_causal_mask"):
                _patch(mod, "get_default_causal_mask", _causal_mask)
            if hasattr(mod, "get_sliding_window_causal_mask"):
                _patch(mod, "get_sliding_window_causal_mask", _sliding_window_mask)
        stream = _NullStream()
        _patch(torch.cuda, "synchronize", lambda device=None: None)
        _patch(torch.cuda, "empty_cache", lambda: None)
        _patch(torch.cuda, "current_stream", lambda device=None: stream)
        _patch(torch.cuda, "default_stream", lambda device=None: stream)
        _patch(torch.cuda, "stream", lambda s=None: contextlib.nullcontext())
        _mode = _CudaToCpu()
        _mode.__enter__()
        return True


def remove() -> None:
    """Undo :func:`apply` (restore every patched attribute, pop the mode). Idempotent.

    Must be called on the thread that called :func:`apply`.
    """
    global _mode
    with _lock:
        if _mode is None:
            return
        _mode.__exit__(None, None, None)
        _mode = None
        while _saved:
            owner, name, value = _saved.pop()
            setattr(owner, name, value)
