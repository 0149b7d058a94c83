"""Random LoRA adapters in the trainer's export format (docs/tenants.md), for tests and benchmarks.

``write_random_adapter(out, model)`` writes a PEFT LoRA folder (``adapter_config.json`` +
``adapter_model.safetensors``) whose ``A`` and ``B`` are seeded Gaussian noise, ``B`` nonzero
(PEFT initialises ``B`` to zero, which would make an adapter indistinguishable from the base).
"""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(out, model: str = "tiny-random", *, r: int = 4, alpha: float = 8.0,
                         targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 0, std: float = 0.05) -> Path:
    """Write a random adapter for ``model`` into folder ``out`` (created) and return it.

    ``A`` ``[r, in]`` and ``B`` ``[out, r]`` of every ``targets`` projection are N(0, ``std``^2),
    drawn from ``torch.Generator().manual_seed(seed)`` in module order, saved under PEFT's names.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline.models import resolve_model

    src = resolve_model(model)
    with torch.device("meta"):
        net = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src))
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, mod in net.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets:
            key = f"base_model.model.{name}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, mod.in_features, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(mod.out_features, r, generator=g) * std
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha, "lora_dropout": 0.0,
           "target_modules": sorted(targets), "bias": "none", "base_model_name_or_path": str(src),
           "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}
    (folder / "adapter_config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return folder


def export_tenant_adapter(export_dir, tenant: str, model: str = "tiny-random", **random) -> tuple[Path, dict]:
    """What the trainer's export leaves for ``tenant`` (docs/tenants.md "Adapter sync"): a random
    adapter (:func:`write_random_adapter` with ``random``) with its checksum file, in
    ``<export_dir>/adapters/<tenant_slug>/<version[:16]>/``. Returns ``(folder, adapter)``, the
    adapter being the records' ``{name, version, sha256}``."""
    import shutil
    import tempfile

    from pipeline import events, weightsync

    base = Path(export_dir) / "adapters" / events.tenant_slug(tenant)
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=base))
    write_random_adapter(tmp, model, **random)
    sha = weightsync.sha256_file(tmp / weightsync.ADAPTER_FILE)
    (tmp / weightsync.ADAPTER_CHECKSUM_FILE).write_text(f"{sha}  {weightsync.ADAPTER_FILE}\n")
    version = weightsync.adapter_version(tmp)
    folder = base / version[:16]
    if folder.exists():
        shutil.rmtree(tmp)
    else:
        tmp.rename(folder)
    return folder, {"name": events.adapter_name(tenant, version), "version": version, "sha256": sha}


def adapter_order(action: str, tenant: str, adapter: dict | None, folder=None, *, epoch: int = 1,
                  run_id: str = "default", engine_id: str | None = None):
    """A tenant's ``control`` record as the trainer (``pause``/``weights``/``resume``) or a
    syncer (``applied``/``failed``, with ``engine_id``) writes it; ``folder`` for ``weights``."""
    from pipeline import events

    return events.Control(action=action, epoch=epoch, run_id=run_id, tenant=tenant, adapter=adapter,
                          location=None if folder is None else str(folder),
                          sha256=adapter["sha256"] if action == "weights" else None, engine_id=engine_id,
                          created_at=events.now_ms())
