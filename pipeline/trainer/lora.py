"""LoRA adapters in the Megatron-core trainer: many tenants' adapters over one frozen base model.

Which implementation, and why
-----------------------------
Megatron-core 0.16.1 has no LoRA of its own. NVIDIA's Megatron-Bridge has one
(``megatron.bridge.peft``: ``LoRA`` on the fused layers, ``CanonicalLoRA`` with separate q/k/v and
gate/up adapters), but its PyPI wheel 0.6.2 does not run here: it requires Python ``>=3.12,<3.13``
(this project runs 3.11), ``transformers<=5.12.1`` (we run 5.24), and its
``megatron/bridge/peft/lora_layers.py`` imports ``transformer_engine.pytorch`` at module level,
which needs CUDA (found by downloading the wheel and reading it; nothing of it was installed).
PEFT itself wraps ``torch.nn.Linear`` modules of a Hugging Face model, not Megatron's
tensor-parallel layers. So this module is a small LoRA on Megatron's ``ColumnParallelLinear`` /
``RowParallelLinear`` (local layer spec), and PEFT is used where it fits: the exported folder is
PEFT's format, and the tests load it with ``peft.PeftModel`` and compare logits.

The definition
--------------
A target projection ``y = W x`` (HF ``W`` ``[out, in]``) becomes
``y = W x + (alpha / r) * B (A x)`` with ``A`` ``[r, in]`` and ``B`` ``[out, r]``; ``W`` is frozen.
``B`` starts at zero, so a fresh adapter is the base model exactly; ``A`` starts as PEFT's default
(Kaiming-uniform with ``a = sqrt(5)``, i.e. ``U(-1/sqrt(in), 1/sqrt(in))``), drawn from a generator
seeded by the sha256 of (seed, adapter name, layer, target): the same adapter on any TP size.

How it attaches
---------------
A forward hook on each targeted Megatron linear adds the update to its output: the base model
keeps its parameter names (the HF mapping of :mod:`pipeline.trainer.model` is unchanged) and is
never copied. Megatron's fused layers keep one adapter per HF module, so the export is PEFT's
layout as is:

=====================  ============================  =========================================
HF target              Megatron layer (local spec)   the update's place in the layer's output
=====================  ============================  =========================================
``q_proj/k_proj/v_proj``  ``self_attention.linear_qkv``  per query group ``[its q heads, k, v]``
``o_proj``             ``self_attention.linear_proj``  row parallel, the whole output
``gate_proj/up_proj``  ``mlp.linear_fc1``              ``[gate; up]`` (each rank: its shard of both)
``down_proj``          ``mlp.linear_fc2``              row parallel, the whole output
=====================  ============================  =========================================

Tensor parallelism (the way the base layer splits)
--------------------------------------------------
- Column-parallel layers: ``A`` replicated, ``B`` sharded by output rows (rank ``t`` holds the
  rows of its query groups / its FFN slice). ``h = A x`` is the same on every rank; it passes
  through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward), so
  the gradient of ``A`` (and of ``x``) sums every rank's rows, as it must.
- Row-parallel layers: ``A`` sharded by input columns, ``B`` replicated. Each rank's partial
  ``A_t x_t`` is summed over ranks (``reduce_from_tensor_model_parallel_region``: all-reduce
  forward, identity backward) before ``B``, as the base layer sums its partial products.

Sharded tensors carry Megatron's ``tensor_model_parallel`` attributes, so the optimizer's
gradient norm counts each shard once and each replicated tensor once.

Many adapters, one base
-----------------------
:class:`LoraModel` holds any number of named adapters (one per tenant) for one base model;
:meth:`LoraModel.using` selects the one the hooks apply (``None``: the base model). Each
:class:`Adapter` is its own module, so the trainer gives each its own Megatron DDP grad buffer
and optimizer (:mod:`pipeline.trainer.policy`): a step of one tenant never touches another's.

Exported folder (Hugging Face PEFT LoRA)
----------------------------------------
``adapter_config.json`` (``peft_type`` LORA, ``r``, ``lora_alpha``, ``target_modules``,
``base_model_name_or_path``, ``bias`` none), ``adapter_model.safetensors`` with tensors
``base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight`` ``[r, in]`` and
``...lora_B.weight`` ``[out, r]`` (``mlp.gate_proj`` etc. likewise), and
``adapter_model.safetensors.sha256`` (the tensors' checksum). The adapter's version is its
content, :func:`pipeline.weightsync.adapter_version` over the config and the tensors, the same
id the engine serves it under; :func:`pipeline.weightsync.verify_adapter` checks both.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline import weightsync
from pipeline.files import atomic_folder
from pipeline.trainer import model as M


@dataclass(frozen=True)
class Target:
    """Where an HF projection lives in Megatron: ``layer`` (the linear inside a transformer
    layer), ``parallel`` (``column`` or ``row``) and ``hf_block`` (``self_attn`` or ``mlp``)."""

    layer: str
    parallel: str
    hf_block: str


TARGETS = {
    "q_proj": Target("self_attention.linear_qkv", "column", "self_attn"),
    "k_proj": Target("self_attention.linear_qkv", "column", "self_attn"),
    "v_proj": Target("self_attention.linear_qkv", "column", "self_attn"),
    "o_proj": Target("self_attention.linear_proj", "row", "self_attn"),
    "gate_proj": Target("mlp.linear_fc1", "column", "mlp"),
    "up_proj": Target("mlp.linear_fc1", "column", "mlp"),
    "down_proj": Target("mlp.linear_fc2", "row", "mlp"),
}
#: the HF projections packed into each Megatron layer's output, in packing order
PACKED = {"self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
          "self_attention.linear_proj": ("o_proj",),
          "mlp.linear_fc1": ("gate_proj", "up_proj"),
          "mlp.linear_fc2": ("down_proj",)}


def hf_shape(arch: M.Arch, target: str) -> tuple[int, int]:
    """``(out, in)`` of the HF weight of ``target`` (so ``A`` is ``[r, in]``, ``B`` ``[out, r]``)."""
    h, q, kv, f = arch.hidden_size, arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim, \
        arch.ffn_hidden_size
    return {"q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
            "gate_proj": (f, h), "up_proj": (f, h), "down_proj": (h, f)}[target]


def peft_name(layer: int, target: str, which: str) -> str:
    """PEFT's tensor name: ``base_model.model.model.layers.{layer}.{block}.{target}.lora_{which}.weight``."""
    return f"base_model.model.model.layers.{layer}.{TARGETS[target].hf_block}.{target}.lora_{which}.weight"


def sharded_dim(target: str, which: str) -> int | None:
    """The dimension a tensor is split on under TP (None: replicated): column targets split
    ``B`` by rows (0), row targets split ``A`` by columns (1)."""
    if TARGETS[target].parallel == "column":
        return 0 if which == "B" else None
    return 1 if which == "A" else None


def _init_seed(seed: int, name: str, key: str) -> int:
    """A 63-bit generator seed from the content (seed, adapter name, tensor key)."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}\0{key}".encode()).digest()[:8], "big") >> 1


class Adapter(torch.nn.Module):
    """One named adapter: this TP rank's ``A`` and ``B`` of every (layer, target).

    ``A[key]`` / ``B[key]`` with ``key = f"{layer}_{target}"``; shapes are the HF ``[r, in]`` /
    ``[out, r]`` with the sharded dimension (:func:`sharded_dim`) divided by the TP size. It
    carries the base model's Megatron ``config`` so that Megatron DDP can wrap it alone.
    """

    def __init__(self, lora: LoraModel, name: str, seed: int) -> None:
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        super().__init__()
        self.config = lora.model.config  # what Megatron's DDP and optimizer read from a model chunk
        self.name = name
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        param = next(lora.model.parameters())
        for layer, target in lora.sites():
            key = f"{layer}_{target}"
            out, inp = hf_shape(lora.arch, target)
            a = torch.empty(lora.rank, inp, dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5),
                                           generator=torch.Generator().manual_seed(_init_seed(seed, name, key)))
            for which, full in (("A", a), ("B", torch.zeros(out, lora.rank))):
                p = torch.nn.Parameter(lora.shard(target, which, full).to(param.device, param.dtype))
                dim = sharded_dim(target, which)
                set_tensor_model_parallel_attributes(p, dim is not None and lora.tp > 1, -1 if dim is None else dim, 1)
                getattr(self, which)[key] = p


class LoraModel:
    """LoRA on a Megatron ``GPTModel`` (local spec): freezes the base and hooks its target layers.

    Args:
        model: the ``GPTModel`` (or a DDP wrapper of it), built with ``local_spec=True`` and
            loaded; its parameters are set ``requires_grad=False`` here.
        arch: its shape.
        rank, alpha, targets: ``trainer.lora`` (``targets`` among :data:`TARGETS`).
    Raises:
        pipeline.trainer.model.UnsupportedModel: a target layer is not Megatron's own column /
            row parallel linear (the Transformer Engine spec), or a target is unknown.
    """

    def __init__(self, model, arch: M.Arch, rank: int, alpha: int | float, targets: list[str]) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        unknown = sorted(set(targets) - set(TARGETS))
        if unknown:
            raise M.UnsupportedModel(f"LoRA targets {unknown} are not among {sorted(TARGETS)}")
        self.model, self.arch = M._unwrap(model), arch
        self.rank, self.alpha, self.scaling = rank, alpha, alpha / rank
        self.targets = [t for t in TARGETS if t in targets]  # canonical order
        self.tp, self.tp_rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
        self.adapters: dict[str, Adapter] = {}
        self.active: str | None = None
        self.model.requires_grad_(False)
        kinds = {"column": ColumnParallelLinear, "row": RowParallelLinear}
        self._hooks = []
        for i, block in enumerate(self.model.decoder.layers):
            for layer in dict.fromkeys(TARGETS[t].layer for t in self.targets):
                sub = block.get_submodule(layer)
                if type(sub) is not kinds[TARGETS[PACKED[layer][0]].parallel]:
                    raise M.UnsupportedModel(f"LoRA needs Megatron's local spec: {layer} is {type(sub).__name__}")
                self._hooks.append(sub.register_forward_hook(functools.partial(self._hook, i, layer)))

    def sites(self) -> Iterator[tuple[int, str]]:
        """Every adapted ``(layer index, HF target)``, layer by layer in canonical target order."""
        for i in range(self.arch.num_layers):
            for t in self.targets:
                yield i, t

    # ------------------------------------------------------------ TP layout

    def shard(self, target: str, which: str, full: torch.Tensor) -> torch.Tensor:
        """This TP rank's part of the full HF-shaped ``A`` or ``B`` of ``target``."""
        dim = sharded_dim(target, which)
        return full if dim is None or self.tp == 1 else full.chunk(self.tp, dim=dim)[self.tp_rank].contiguous()

    def _local_out(self, target: str) -> int:
        out = hf_shape(self.arch, target)[0]
        return out // self.tp if TARGETS[target].parallel == "column" else out

    # ------------------------------------------------------------ forward

    def _hook(self, layer: int, module_name: str, module, args, output):
        """Forward hook of a target linear: ``(out, bias) -> (out + update, bias)`` when an adapter is active."""
        if self.active is None:
            return None
        out, bias = output
        return out + self._update(self.adapters[self.active], layer, module_name, args[0]), bias

    def _update(self, ad: Adapter, layer: int, module_name: str, x: torch.Tensor) -> torch.Tensor:
        """``scaling * B (A x)`` of every target packed in ``module_name``, laid out like its output.

        ``x`` ``[s, b, in]`` (row parallel: this rank's input columns) -> ``[s, b, out_local]``.
        """
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region,
                                                            reduce_from_tensor_model_parallel_region)

        parts = []
        for t in PACKED[module_name]:
            key = f"{layer}_{t}"
            if t not in self.targets:
                parts.append(x.new_zeros(*x.shape[:-1], self._local_out(t)))
            elif TARGETS[t].parallel == "column":
                h = copy_to_tensor_model_parallel_region(F.linear(x, ad.A[key]))
                parts.append(F.linear(h, ad.B[key]))
            else:
                h = reduce_from_tensor_model_parallel_region(F.linear(x, ad.A[key]))
                parts.append(F.linear(h, ad.B[key]))
        if module_name == "self_attention.linear_qkv":
            g = self.arch.num_kv_heads // self.tp
            lead = x.shape[:-1]
            update = torch.cat([p.reshape(*lead, g, -1) for p in parts], dim=-1).reshape(*lead, -1)
        else:
            update = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
        return update * self.scaling

    @contextlib.contextmanager
    def using(self, name: str | None) -> Iterator[None]:
        """Apply adapter ``name`` (None: none, the base model) inside the block; restores the previous one.

        Raises ``KeyError`` for an adapter that does not exist.
        """
        if name is not None and name not in self.adapters:
            raise KeyError(f"no LoRA adapter {name!r} (have: {sorted(self.adapters)})")
        before, self.active = self.active, name
        try:
            yield
        finally:
            self.active = before

    # ------------------------------------------------------------ adapters

    def add(self, name: str, seed: int = 0) -> Adapter:
        """A fresh adapter ``name`` (``B = 0``: it is the base model until trained). Raises
        ``ValueError`` if it exists."""
        if name in self.adapters:
            raise ValueError(f"LoRA adapter {name!r} exists")
        self.adapters[name] = Adapter(self, name, seed)
        return self.adapters[name]

    def remove(self, name: str) -> None:
        """Forget adapter ``name`` (``KeyError`` if absent); never the active one."""
        if self.active == name:
            raise ValueError(f"LoRA adapter {name!r} is in use")
        del self.adapters[name]

    def hf_tensors(self, name: str, dtype: torch.dtype | None = None, dst: int = 0,
                   grads: bool = False) -> dict[str, torch.Tensor] | None:
        """Adapter ``name`` in PEFT names and full HF shapes, gathered over TP onto global rank ``dst``.

        Collective over the TP group (every rank calls it); other ranks get ``None``. CPU,
        contiguous, in ``dtype`` (default: the adapter's). ``grads``: the gradients of the last
        step instead (Megatron DDP's ``main_grad``, reduced over DP), for tests and diagnostics.
        """
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        ad = self.adapters[name]
        me = dist.get_rank() if dist.is_initialized() else 0
        out: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for layer, t in self.sites():
                for which in ("A", "B"):
                    p = getattr(ad, which)[f"{layer}_{t}"]
                    p = p.main_grad if grads else p.detach()
                    dim = sharded_dim(t, which)
                    if self.tp > 1 and dim is not None:
                        shards = [torch.empty_like(p) for _ in range(self.tp)]
                        dist.all_gather(shards, p.contiguous(), group=ps.get_tensor_model_parallel_group())
                        p = torch.cat(shards, dim=dim)
                    if me == dst:
                        out[peft_name(layer, t, which)] = p.to(device="cpu", dtype=dtype or p.dtype).contiguous()
        return out if me == dst else None

    def load_hf_tensors(self, name: str, tensors: dict[str, torch.Tensor]) -> None:
        """Copy PEFT-named full tensors into adapter ``name`` (this rank's shards).

        Raises ``KeyError`` naming a missing tensor and ``ValueError`` on a shape mismatch or an
        extra tensor (an adapter of other targets).
        """
        ad = self.adapters[name]
        want = {peft_name(layer, t, w): (layer, t, w) for layer, t in self.sites() for w in ("A", "B")}
        extra = sorted(set(tensors) - set(want))
        if extra:
            raise ValueError(f"adapter tensors not in this LoRA (targets {self.targets}): {extra[:3]}")
        with torch.no_grad():
            for n, (layer, t, which) in want.items():
                if n not in tensors:
                    raise KeyError(f"adapter tensor {n} is missing")
                out, inp = hf_shape(self.arch, t)
                shape = (self.rank, inp) if which == "A" else (out, self.rank)
                if tuple(tensors[n].shape) != shape:
                    raise ValueError(f"{n}: shape {tuple(tensors[n].shape)}, this LoRA needs {shape}")
                p = getattr(ad, which)[f"{layer}_{t}"]
                p.copy_(self.shard(t, which, tensors[n]).to(p.dtype))

    def peft_config(self, base_model: str) -> dict:
        """``adapter_config.json`` of this LoRA (PEFT ``LoraConfig`` fields; dropout 0, no bias)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                "target_modules": list(self.targets), "base_model_name_or_path": base_model, "bias": "none",
                "lora_dropout": 0.0, "fan_in_fan_out": False, "use_rslora": False, "use_dora": False,
                "init_lora_weights": True, "inference_mode": True, "modules_to_save": None}

    def check_config(self, config: dict, where: str) -> None:
        """Raise ``ValueError`` unless a PEFT ``config`` has this LoRA's type, rank, alpha and targets."""
        mine = self.peft_config("")
        for k in ("peft_type", "r", "lora_alpha"):
            if config.get(k) != mine[k]:
                raise ValueError(f"{where}: {k} is {config.get(k)!r}, this trainer's LoRA has {mine[k]!r}")
        if sorted(config.get("target_modules") or []) != sorted(self.targets):
            raise ValueError(f"{where}: target_modules {config.get('target_modules')}, this trainer's LoRA has "
                             f"{self.targets}")
        extras = [k for k in ("use_dora", "use_rslora", "rank_pattern", "alpha_pattern", "modules_to_save",
                              "layers_pattern", "layers_to_transform") if config.get(k)]
        if config.get("bias", "none") != "none" or extras:
            raise ValueError(f"{where}: only plain LoRA is supported (bias none; no {', '.join(extras) or 'bias'}): "
                             "the scaling must be lora_alpha / r for every target")


def write_adapter_folder(tensors: dict[str, torch.Tensor], config: dict, out_dir: str | os.PathLike) -> M.Exported:
    """Write a PEFT adapter folder atomically (:func:`pipeline.files.atomic_folder`).

    ``adapter_model.safetensors`` (hashed while written, :func:`pipeline.trainer.model.write_safetensors`),
    ``adapter_model.safetensors.sha256`` (``"<hex>  adapter_model.safetensors"``) and
    ``adapter_config.json``. Returns :class:`pipeline.trainer.model.Exported` (``sha256`` is the
    adapter's version, :func:`pipeline.weightsync.adapter_version`). Raises ``FileExistsError`` if
    ``out_dir`` exists.
    """
    t0 = time.perf_counter()
    with atomic_folder(out_dir) as tmp:
        digest = M.write_safetensors(tensors, tmp / weightsync.ADAPTER_FILE)
        (tmp / weightsync.ADAPTER_CHECKSUM_FILE).write_text(f"{digest}  {weightsync.ADAPTER_FILE}\n")
        (tmp / weightsync.ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    out = Path(out_dir)
    return M.Exported(out, weightsync.adapter_version(out), (out / weightsync.ADAPTER_FILE).stat().st_size,
                      time.perf_counter() - t0)


def read_adapter_folder(path: str | os.PathLike, sha256: str | None = None) -> tuple[dict, dict[str, torch.Tensor], str]:
    """``(adapter_config, tensors, sha256)`` of a PEFT adapter folder, its checksum verified first.

    Raises ``FileNotFoundError`` (no tensors or no config) and ``ValueError`` (checksum mismatch
    with ``sha256`` or the checksum file: :func:`pipeline.weightsync.verify_adapter`).
    """
    from safetensors.torch import load_file

    path = Path(path)
    digest = weightsync.verify_adapter(path, sha256)
    config = json.loads((path / weightsync.ADAPTER_CONFIG).read_text())
    return config, load_file(path / weightsync.ADAPTER_FILE), digest
