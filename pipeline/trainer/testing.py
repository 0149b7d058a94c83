"""Helpers for tests and benches of the trainer (real Megatron, real models; no mocks)."""

from __future__ import annotations

import contextlib
import os
import warnings

import torch


@contextlib.contextmanager
def megatron_runtime(tp: int = 1, threads: int = 2):
    """A world-of-one Megatron runtime for the duration of the block; yields :class:`dist.Parallel`.

    Sets torch threads, applies the CPU shim (without CUDA), initialises gloo + Megatron parallel
    state, and undoes all of it on exit, so other tests in the same process run unpatched.
    """
    from pipeline.trainer import cpu_shim, dist

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    warnings.filterwarnings("ignore", message=".*Apex.*")
    old_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    saved = {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    try:
        yield dist.init(tp)
    finally:
        dist.shutdown()
        cpu_shim.remove()
        torch.set_num_threads(old_threads)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
