"""LoRA adapters in the CPU engine: the adapter folder (read and checked against the served
model), its content id, the registry of loaded adapters, and the per-row LoRA delta added to the
served model's projections, so rows of different adapters (and of the base model) decode in one
batch.

The folder (the contract with the trainer, docs/tenants.md) is Hugging Face PEFT's LoRA format:
``adapter_config.json`` (``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``target_modules`` among
:data:`SUPPORTED_TARGETS`, ``bias: "none"``) and ``adapter_model.safetensors`` with PEFT's names,
``base_model.model.<module>.lora_A.weight`` ``[r, in]`` and ``...lora_B.weight`` ``[out, r]``.
Its version is its content: :func:`pipeline.weightsync.adapter_version` over those two files.

The delta (Hu et al. 2021, "LoRA", eq. 3): a target projection ``y = x W^T`` becomes
``y = x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r``. It is applied by a
forward hook on each target ``nn.Linear`` (the module and its ``state_dict`` stay those of the
served checkpoint, so weight updates and ``check_fits`` see the plain model), reading the
adapter of each row from one :class:`LoraPlan` that the model thread sets before every forward:
rows of one adapter share a 2-D matmul, a mixed batch gathers each row's ``A`` and ``B`` (zeros
for a base row or a module the row's adapter leaves out, ranks zero-padded to the largest of the
step) and runs two batched matmuls. Adding zeros leaves a row's value unchanged, so a base row
of a mixed batch equals the base model up to matmul rounding. A forward with no adapter row
skips the hook's work entirely.

Why not PEFT's mixed-batch forward (``adapter_names=[...]``): it injects every adapter into the
model's modules (loading and unloading mutate the model the model thread is running, and a new
version of an adapter would replace the old one under requests still decoding on it), must be
re-injected into every new base model after ``/update_weights_from_disk``, and in each LoRA layer
rebuilds the per-adapter row lists and loops over the adapters present, every module of every
step. Here an adapter is an immutable object a request holds from admission to its end (a
request never mixes versions), loading touches no module, and a step gathers once per module.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from pipeline.config import LORA_TARGETS
from pipeline.errors import PipelineError
from pipeline.weightsync import ADAPTER_CONFIG as CONFIG_FILE
from pipeline.weightsync import ADAPTER_FILE as WEIGHTS_FILE
from pipeline.weightsync import read_adapter_files, verify_adapter

log = logging.getLogger(__name__)

SUPPORTED_TARGETS = LORA_TARGETS
PEFT_PREFIX = "base_model.model."
#: SGLang's message when LoRA is off (``--enable-lora``)
NOT_ENABLED = "LoRA is not enabled. Please set `--enable-lora` to enable LoRA."


class LoraError(PipelineError, ValueError):
    """An adapter that cannot be loaded or used (answered 400 in the route's own shape)."""


def adapter_sha256(path: str | os.PathLike) -> str:
    """The adapter folder's content id (hex sha256 of its two files, docs/tenants.md), after its
    tensors are checked against their ``.sha256`` side file when it has one (a torn or tampered
    copy is refused, as the trainer refuses it: :func:`pipeline.weightsync.verify_adapter`).

    Raises:
        LoraError: a file is missing or unreadable, or the tensors do not match their checksum.
    """
    try:
        return verify_adapter(path)
    except (OSError, ValueError) as e:
        raise LoraError(f"cannot load the adapter at {path}: {e}") from e


@dataclass(eq=False)
class LoraAdapter:
    """One loaded adapter, immutable once built (requests hold it until they finish).

    Attributes:
        name: the name it was loaded under (``lora_name``).
        path: the folder it came from.
        sha256: its content id (:func:`adapter_sha256`).
        rank, alpha: ``r`` and ``lora_alpha`` of its config; ``scaling = alpha / rank``.
        weights: module path (e.g. ``model.layers.0.self_attn.q_proj``) -> ``(A [r, in],
            B_scaled [out, r])``, fp32, ``B_scaled = scaling * B``.
    """

    name: str
    path: str
    sha256: str
    rank: int
    alpha: float
    targets: tuple[str, ...]
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def info(self) -> dict[str, Any]:
        return {"lora_name": self.name, "lora_path": self.path, "sha256": self.sha256, "r": self.rank,
                "lora_alpha": self.alpha, "target_modules": list(self.targets)}


def target_linears(model, targets: tuple[str, ...] | list[str]) -> dict[str, torch.nn.Linear]:
    """Module path -> ``nn.Linear`` of every module of ``model`` whose last name is in ``targets``."""
    return {name: mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and name.rsplit(".", 1)[-1] in targets}


def read_config(folder: Path, *, max_rank: int, targets: tuple[str, ...], raw: bytes | None = None) -> dict[str, Any]:
    """``adapter_config.json`` (``raw``: its bytes, already read) checked against the contract
    and the engine's LoRA settings.

    Raises:
        LoraError: not PEFT LoRA, a rank outside ``1..max_rank``, a target outside ``targets``,
            a bias, DoRA, rsLoRA, per-module rank/alpha patterns or modules_to_save (none of
            which the delta implements: refused rather than served wrong).
    """
    f = folder / CONFIG_FILE
    try:
        cfg = json.loads(f.read_bytes() if raw is None else raw)
    except (OSError, ValueError) as e:
        raise LoraError(f"cannot read {f}: {e}") from e
    if not isinstance(cfg, dict) or cfg.get("peft_type") != "LORA":
        raise LoraError(f"{f}: peft_type must be 'LORA', got {cfg.get('peft_type') if isinstance(cfg, dict) else cfg!r}")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha")
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"{f}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(f"LoRA rank {r} of {folder} is above the engine's --max-lora-rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"{f}: lora_alpha must be a finite number, got {alpha!r}")
    mods = cfg.get("target_modules")
    if not isinstance(mods, list) or not mods or not all(isinstance(m, str) for m in mods):
        raise LoraError(f"{f}: target_modules must be a non-empty list of module names, got {mods!r}")
    bad = sorted(set(mods) - set(targets))
    if bad:
        raise LoraError(f"target modules {bad} of {folder} are not among the engine's LoRA targets {list(targets)}")
    if cfg.get("bias", "none") != "none":
        raise LoraError(f"{f}: bias must be 'none', got {cfg.get('bias')!r}")
    for key in ("use_dora", "use_rslora"):
        if cfg.get(key):
            raise LoraError(f"{f}: {key} is not supported (scaling is lora_alpha / r)")
    for key in ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_pattern"):
        if cfg.get(key):
            raise LoraError(f"{f}: {key} is not supported")
    return cfg


def read_adapter(name: str, path: str | os.PathLike, linears: dict[str, torch.nn.Linear], *,
                 max_rank: int, targets: tuple[str, ...]) -> LoraAdapter:
    """Read and check the adapter folder at ``path`` against the served model's ``linears``.

    Checked: the contract of :func:`read_config`; every tensor named
    ``base_model.model.<module>.lora_{A,B}.weight`` with ``<module>`` a target linear of the served
    model whose kind is in the config's ``target_modules``; both halves present; ``A`` is
    ``[r, in_features]`` and ``B`` ``[out_features, r]``; floating point and finite. Each file is
    read once (:func:`pipeline.weightsync.read_adapter_files`): the content id is that of the
    very bytes parsed, so a folder changed meanwhile can never be served under the old id.

    Raises:
        LoraError: the first problem found, named.
    """
    from safetensors.torch import load as load_bytes

    folder = Path(os.path.expanduser(str(path)))
    if not folder.is_dir():
        raise LoraError(f"LoRA adapter folder {path} does not exist")
    try:
        sha, raw_config, raw_tensors = read_adapter_files(folder)
    except (OSError, ValueError) as e:
        raise LoraError(f"cannot load the adapter at {path}: {e}") from e
    cfg = read_config(folder, max_rank=max_rank, targets=targets, raw=raw_config)
    r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    try:
        tensors = load_bytes(raw_tensors)
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad adapter
        raise LoraError(f"cannot read {folder / WEIGHTS_FILE}: {type(e).__name__}: {e}") from e
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        mod, half = _split_key(key, folder)
        if mod not in linears or mod.rsplit(".", 1)[-1] not in cfg["target_modules"]:
            raise LoraError(f"tensor {key} of {folder} names no LoRA target of the served model")
        if not t.is_floating_point():
            raise LoraError(f"tensor {key} of {folder} must be finite floating point")
        halves.setdefault(mod, {})[half] = t.to(torch.float32)
    if not halves:
        raise LoraError(f"{folder / WEIGHTS_FILE} holds no LoRA tensors")
    if not all_finite([t for pair in halves.values() for t in pair.values()]):
        bad = next(key for key, t in tensors.items() if not all_finite([t.to(torch.float32)]))
        raise LoraError(f"tensor {bad} of {folder} must be finite floating point")
    weights = {}
    for mod, pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise LoraError(f"module {mod} of {folder} has lora_{'A' if 'B' in pair else 'B'} missing")
        lin = linears[mod]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (r, lin.in_features) or tuple(b.shape) != (lin.out_features, r):
            raise LoraError(f"module {mod} of {folder}: lora_A {list(a.shape)} / lora_B {list(b.shape)} do not fit "
                            f"the served model's [{r}, {lin.in_features}] / [{lin.out_features}, {r}]")
        weights[mod] = (a.contiguous(), (b * (alpha / r)).contiguous())
    return LoraAdapter(name, str(path), sha, r, alpha, tuple(cfg["target_modules"]), weights)


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Every element of every fp32 tensor of ``tensors`` is finite (no NaN, no +-inf).

    One ``torch.aminmax`` per tensor (NaN propagates to both ends, an infinity is an end) and one
    ``isfinite`` over all the ends: the check is a few ops per tensor, not a bool tensor of every
    element (``isfinite(t).all()`` per tensor took 9 of a SmolLM2 adapter's 26 ms of reading:
    420 tensors, 5M values). Empty tensors are finite.
    """
    ends = [end for t in tensors if t.numel() for end in torch.aminmax(t)]
    return not ends or bool(torch.isfinite(torch.stack(ends)).all())


def _split_key(key: str, folder: Path) -> tuple[str, str]:
    for half in ("A", "B"):
        suffix = f".lora_{half}.weight"
        if key.startswith(PEFT_PREFIX) and key.endswith(suffix):
            return key[len(PEFT_PREFIX):-len(suffix)], half
    raise LoraError(f"tensor {key} of {folder} is not a PEFT LoRA weight "
                    f"({PEFT_PREFIX}<module>.lora_A.weight / .lora_B.weight)")


# ---- the per-row delta (model thread) -------------------------------------------------------------
class LoraPlan:
    """The adapter of each row of the next forward, and the per-module stacks gathered from them.

    The model thread calls :meth:`set` before every forward; the hooks call :meth:`stacks`. Rows
    given as the same objects in the same order as the previous step reuse the gathered stacks.
    Owned by the model thread; no lock.
    """

    def __init__(self) -> None:
        self.rows: list[LoraAdapter | None] = []
        self.active = False
        self._cache: dict[str, Any] = {}
        self._zeros: dict[tuple[int, int], torch.Tensor] = {}

    def set(self, rows: list[LoraAdapter | None]) -> None:
        if len(rows) == len(self.rows) and all(a is b for a, b in zip(rows, self.rows)):
            return
        self.rows = list(rows)
        self.active = any(a is not None for a in rows)
        self._cache = {}

    def stacks(self, key: str) -> tuple[str, torch.Tensor, torch.Tensor] | None:
        """For module ``key``: None (no row adapts it); ``("shared", A [r, in], B [out, r])`` when
        every row has the same weights; else ``("rows", A^T [n, in, r], B^T [n, r, out])`` with
        zeros for rows without weights and ranks zero-padded to the largest."""
        if key in self._cache:
            return self._cache[key]
        ws = [a.weights.get(key) if a is not None else None for a in self.rows]
        present = [w for w in ws if w is not None]
        if not present:
            res = None
        elif len(present) == len(ws) and all(w is present[0] for w in ws):
            res = ("shared", present[0][0], present[0][1])
        else:
            r = max(w[0].shape[0] for w in present)
            in_f, out_f = present[0][0].shape[1], present[0][1].shape[0]
            a_rows = [self._pad(w[0], r, 0) if w is not None else self._zero(r, in_f) for w in ws]
            b_rows = [self._pad(w[1], r, 1) if w is not None else self._zero(out_f, r) for w in ws]
            # transposed once here, contiguous, so each forward's two bmm read plain row-major stacks
            res = ("rows", torch.stack(a_rows).transpose(1, 2).contiguous(),
                   torch.stack(b_rows).transpose(1, 2).contiguous())
        self._cache[key] = res
        return res

    def _zero(self, m: int, n: int) -> torch.Tensor:
        z = self._zeros.get((m, n))
        if z is None:
            z = self._zeros[(m, n)] = torch.zeros(m, n)
        return z

    @staticmethod
    def _pad(t: torch.Tensor, r: int, dim: int) -> torch.Tensor:
        if t.shape[dim] == r:
            return t
        pad = (0, r - t.shape[1]) if dim == 1 else (0, 0, 0, r - t.shape[0])
        return torch.nn.functional.pad(t, pad)


def lora_delta(x: torch.Tensor, entry: tuple[str, torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``scaling * (x A^T) B^T`` of every row: ``x`` ``[n, T, in]`` -> ``[n, T, out]`` (``B`` is
    already scaled, see :class:`LoraAdapter`)."""
    kind, a, b = entry
    if kind == "shared":
        return (x @ a.t()) @ b.t()
    return torch.bmm(torch.bmm(x, a), b)  # a, b: the transposed row stacks of LoraPlan.stacks


def install(model, plan: LoraPlan, targets: tuple[str, ...]) -> dict[str, torch.nn.Linear]:
    """Hook every target linear of ``model`` so that its output gets the delta of ``plan``'s rows.

    Returns the hooked modules (path -> module): the shapes adapters are checked against.
    """
    linears = target_linears(model, targets)
    for key, mod in linears.items():
        mod.register_forward_hook(_hook(plan, key))
    return linears


def _hook(plan: LoraPlan, key: str):
    def hook(module, args, out):
        if not plan.active:
            return None
        entry = plan.stacks(key)
        if entry is None:
            return None
        x = args[0]
        return out + lora_delta(x.reshape(len(plan.rows), -1, x.shape[-1]), entry).view_as(out)

    return hook


# ---- the registry (asyncio side) ----------------------------------------------------------------
@dataclass
class LoraSettings:
    """The engine's LoRA switches (SGLang's flags): ``enabled`` (``--enable-lora``), ``max_rank``
    (``--max-lora-rank``), ``targets`` (``--lora-target-modules``), ``max_per_batch``
    (``--max-loras-per-batch``: distinct adapters in one batch, the base model counting as one,
    as in SGLang)."""

    enabled: bool = False
    max_rank: int = 64
    targets: tuple[str, ...] = SUPPORTED_TARGETS
    max_per_batch: int = 8


@dataclass
class LoraRegistry:
    """Name -> :class:`LoraAdapter` of the loaded adapters. Loads and unloads are serialised by
    one asyncio lock (a load reads the folder in a worker thread) and replace :attr:`adapters`
    by a new dict, so a reader on the event loop never iterates a dict being changed; a request
    resolves its adapter once, at admission, and keeps the object."""

    settings: LoraSettings
    linears: dict[str, torch.nn.Linear] = field(default_factory=dict)
    adapters: dict[str, LoraAdapter] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.lock = asyncio.Lock()

    def resolve(self, names: list[str | None]) -> list[LoraAdapter | None]:
        """The adapters of ``names`` (None: the base model).

        Raises:
            LoraError: LoRA is off, or a name is not loaded (SGLang's message).
        """
        if any(n is not None for n in names) and not self.settings.enabled:
            raise LoraError(NOT_ENABLED)
        missing = sorted({n for n in names if n is not None and n not in self.adapters})
        if missing:
            raise LoraError(f"The following requested LoRA adapters are not loaded: {', '.join(missing)}\n"
                            f"Loaded adapters: {sorted(self.adapters)}.")
        return [None if n is None else self.adapters[n] for n in names]

    def load_sync(self, name: str, path: str) -> tuple[LoraAdapter, bool]:
        """Load ``path`` as ``name`` (blocking; call it under :attr:`lock`). Returns ``(adapter,
        loaded)``: ``loaded`` False when ``name`` already holds the same content (idempotent).

        Raises:
            LoraError: LoRA off, an empty name, a bad folder (:func:`read_adapter`), or ``name``
                loaded with other content (unload it first).
        """
        if not self.settings.enabled:
            raise LoraError(NOT_ENABLED)
        if not name or ":" in name:
            raise LoraError(f"lora_name must be non-empty and without ':' (got {name!r})")
        if not Path(os.path.expanduser(path)).is_dir():
            raise LoraError(f"LoRA adapter folder {path} does not exist")
        old = self.adapters.get(name)
        if old is not None:
            sha = adapter_sha256(Path(os.path.expanduser(path)))
            if sha == old.sha256:
                return old, False
            raise LoraError(f"LoRA with name {name} already exists with other content (sha256 {old.sha256[:12]}..., "
                            f"the folder's is {sha[:12]}...); unload it first. Loaded LoRAs: {sorted(self.adapters)}")
        s = self.settings
        adapter = read_adapter(name, path, self.linears, max_rank=s.max_rank, targets=s.targets)
        self.adapters = {**self.adapters, name: adapter}  # copy on write: readers never see a dict change
        log.info("loaded LoRA adapter %s from %s (r %d, sha256 %s)", name, path, adapter.rank, adapter.sha256)
        return adapter, True

    def unload(self, name: str) -> LoraAdapter:
        """Forget ``name``: new requests for it are refused; requests already admitted finish on it.

        Raises:
            LoraError: LoRA off or ``name`` not loaded (SGLang's message).
        """
        if not self.settings.enabled:
            raise LoraError(NOT_ENABLED)
        if name not in self.adapters:
            raise LoraError(f"LoRA with name {name} does not exist. Loaded LoRAs: {sorted(self.adapters)}")
        adapter = self.adapters[name]
        self.adapters = {n: a for n, a in self.adapters.items() if n != name}
        return adapter

    def paths(self) -> dict[str, str]:
        """``loaded_adapters`` of SGLang's answer: name -> path."""
        return {n: a.path for n, a in self.adapters.items()}

    def versions(self) -> dict[str, str]:
        """Name -> content id (:attr:`LoraAdapter.sha256`) of every loaded adapter."""
        return {n: a.sha256 for n, a in self.adapters.items()}
