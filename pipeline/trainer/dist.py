"""Process-group and Megatron parallel-state setup for the trainer (one process or torchrun).

Single process (no ``WORLD_SIZE`` in the environment): a world of one on a free loopback port.
Under ``torchrun --nproc-per-node N``: the launcher's rank variables; ``N`` must be a multiple of
the tensor-parallel size (the rest is data parallel). Backend: NCCL with CUDA, gloo otherwise; on
the CPU the :mod:`pipeline.trainer.cpu_shim` patches are applied first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipeline.procutil import free_port
from pipeline.trainer import cpu_shim

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Parallel:
    """Where this process sits: global rank/world, tensor-parallel rank/size, data-parallel."""

    rank: int
    world: int
    tp_rank: int
    tp: int
    dp_rank: int
    dp: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        """Rank 0: the process that talks to Kafka and writes files."""
        return self.rank == 0


def device() -> torch.device:
    """``cuda:<LOCAL_RANK>`` when CUDA is available, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def init(tp: int = 1, seed: int = 1234) -> Parallel:
    """Initialise torch.distributed and Megatron's parallel state (idempotent for the same ``tp``).

    Raises:
        ValueError: the world size is not a multiple of ``tp``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    if "WORLD_SIZE" not in os.environ and not dist.is_initialized():
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0",
                          WORLD_SIZE="1", LOCAL_RANK="0")
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    dev = device()
    if dev.type == "cpu":
        cpu_shim.apply()
    else:
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo")
    world = dist.get_world_size()
    if world % tp:
        raise ValueError(f"world size {world} is not a multiple of tensor parallel size {tp}")
    if ps.model_parallel_is_initialized() and ps.get_tensor_model_parallel_world_size() != tp:
        ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
    return current()


def current() -> Parallel:
    """The :class:`Parallel` of this process (after :func:`init`)."""
    from megatron.core import parallel_state as ps

    return Parallel(
        rank=dist.get_rank(), world=dist.get_world_size(),
        tp_rank=ps.get_tensor_model_parallel_rank(), tp=ps.get_tensor_model_parallel_world_size(),
        dp_rank=ps.get_data_parallel_rank(), dp=ps.get_data_parallel_world_size(), device=device(),
    )


def broadcast_object(obj, src: int = 0):
    """Send a picklable object from rank ``src`` to every rank (identity in a world of one)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def shutdown() -> None:
    """Destroy Megatron's parallel state and the process group (end of a process or test)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
