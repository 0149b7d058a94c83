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


def shifted_export(export_dir, version: int, shift: float = 0.01, model: str = "tiny-random"):
    """Write ``<export_dir>/v<version>`` as the trainer would, with every weight of ``model`` plus
    ``shift``: "trained" weights that are recognisably not the base model's. Returns the folder
    and its sha256 (what a ``weights`` event carries)."""
    from pathlib import Path

    from safetensors.torch import load_file

    from pipeline.models import resolve_model
    from pipeline.trainer.model import write_hf_folder

    src = resolve_model(model)
    tensors = {k: v + shift for k, v in load_file(src / "model.safetensors").items()}
    out = write_hf_folder(tensors, src, Path(export_dir) / f"v{version:06d}", torch.float32)
    return out.path, out.sha256


def policy_trainer(par, **trainer_settings):
    """A :class:`pipeline.trainer.policy.PolicyTrainer` of ``tiny-random`` on the runtime ``par``
    (what :func:`megatron_runtime` yields): learning rate 1e-3, micro-batches of 4 samples, and
    ``trainer_settings`` overriding any field of the ``trainer`` config section."""
    from pipeline.config import load_config
    from pipeline.models import resolve_model
    from pipeline.trainer.policy import PolicyTrainer

    t = dict(model="tiny-random", lr=1e-3, micro_batch_size=4)
    t.update(trainer_settings)
    return PolicyTrainer(load_config(None, trainer=t).trainer, resolve_model("tiny-random"), par)


def param_copies(pt) -> dict:
    """Detached copies of the parameters of ``pt.model`` by name (to compare across a step)."""
    return {n: p.detach().clone() for n, p in pt.model.named_parameters()}


def random_adapter(pt, name: str, seed: int = 0, scale: float = 0.05) -> dict:
    """Give LoRA adapter ``name`` of ``pt`` (created when missing) random weights on every rank
    alike: ``A ~ N(0, 1/in)``, ``B ~ N(0, scale^2)`` (a trained-looking adapter: with ``B = 0``
    the gradient of ``A`` is 0). Returns the full tensors in PEFT names."""
    from pipeline.trainer.lora import hf_shape, peft_name

    lora = pt.lora
    if name not in pt.adapters():
        pt.add_adapter(name)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer, t in lora.sites():
        out, inp = hf_shape(lora.arch, t)
        tensors[peft_name(layer, t, "A")] = torch.randn(lora.rank, inp, generator=g) / inp ** 0.5
        tensors[peft_name(layer, t, "B")] = torch.randn(out, lora.rank, generator=g) * scale
    lora.load_hf_tensors(name, tensors)
    pt.trainables[name].optimizer.reload_model_params()
    return tensors
