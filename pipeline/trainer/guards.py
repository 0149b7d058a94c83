"""Finite-value guards of the trainer: what keeps NaN/inf out of the policy's weights.

Three independent lines of defence:

1. **Samples boundary** (:func:`nonfinite_fields`): a sample carrying a NaN or an infinity in any
   numeric field (reward, rollout / teacher log-probs, teacher top-k, any float a later schema
   adds) is refused before it reaches a batch; the trainer sends it to ``samples.dlq`` with the
   field named. The check walks the event's fields generically, so it follows schema changes.
2. **Step** (:func:`PolicyTrainer.train_batch <pipeline.trainer.policy.PolicyTrainer.train_batch>`):
   the loss and the gradients are checked after the backward pass and the gradient all-reduce,
   on every rank, with the verdict all-reduced so every rank skips together. Needed because
   Megatron's fp32 optimizer always reports success and the bf16 one checks only when a loss
   scaler is configured.
3. **Weights** (:func:`nonfinite_parameters`): before a checkpoint, an export or a sync, and
   after a restore, the parameters themselves are checked; non-finite weights raise
   :class:`NonFiniteWeights` and are never written.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Iterable

import numpy as np
import torch

from pipeline.errors import PipelineError


class NonFiniteWeights(PipelineError, FloatingPointError):
    """The policy's parameters hold NaN or infinite values (they are never saved or served)."""


#: fields where -inf is a legal value: a top-k entry the teacher did not return (no probability)
NEG_INF_ALLOWED = frozenset({"teacher_topk_log_probs"})


def _bad_mask(arr: np.ndarray, allow_neg_inf: bool) -> np.ndarray:
    bad = ~np.isfinite(arr)
    return bad & ~np.isneginf(arr) if allow_neg_inf else bad


def _floats(values: Any) -> np.ndarray | None:
    """A numeric sequence as a 1-D float64 array, or None when it is not one (strings, dicts,
    nested lists). ``None`` entries are absent values (a failed PRM vote), not numbers: they are
    checked as a finite 0.0, so they are never reported as NaN."""
    if not isinstance(values, np.ndarray):
        values = [0.0 if v is None else v for v in values]
    try:
        arr = np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError):
        return None
    return arr if arr.ndim == 1 else None


def _first_bad(values: Any, allow_neg_inf: bool = False) -> tuple[int, float] | None:
    """``(index, value)`` of the first non-finite number in a numeric sequence (``-inf`` passes
    when ``allow_neg_inf``; ``None`` entries are absent, never bad), else None."""
    arr = _floats(values)
    if arr is None:
        return None
    bad = np.flatnonzero(_bad_mask(arr, allow_neg_inf))
    return (int(bad[0]), float(arr[bad[0]])) if bad.size else None


def nonfinite_fields(event: Any) -> list[str]:
    """Each numeric field of a dataclass event holding NaN/inf, as ``"name=value"`` or
    ``"name[i]=value"`` (first bad element, and how many), in field order; ``[]`` when all are
    finite. ``None`` fields, ``None`` entries of a list (absent values, such as failed PRM votes
    in ``votes``) and non-numeric fields are skipped; ``-inf`` is legal in the fields of
    :data:`NEG_INF_ALLOWED` (NaN and ``+inf`` are not).
    """
    out: list[str] = []
    for f in dataclasses.fields(event):
        v = getattr(event, f.name)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, float):
            if not math.isfinite(v):
                out.append(f"{f.name}={v}")
        elif isinstance(v, (list, tuple, np.ndarray)) and len(v):
            neg_ok = f.name in NEG_INF_ALLOWED
            first = _first_bad(v, neg_ok)
            if first is not None:
                n = int(_bad_mask(_floats(v), neg_ok).sum())
                out.append(f"{f.name}[{first[0]}]={first[1]}" + (f" ({n} non-finite)" if n > 1 else ""))
    return out


def nonfinite_parameters(named: Iterable[tuple[str, torch.Tensor]]) -> list[str]:
    """Names of the tensors in ``named`` (``(name, tensor)`` pairs) holding NaN or inf."""
    return [name for name, t in named if t.is_floating_point() and not bool(torch.isfinite(t).all())]
