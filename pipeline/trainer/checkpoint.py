"""Trainer checkpoints: model + optimizer shards, step, policy version, consumed offsets.

Layout under ``trainer.checkpoint_dir``::

    step_00000012/
        tp00.pt ... tpNN.pt   # one per tensor-parallel rank: model shard, optimizer state, counters
        meta.json             # step, policy_version, offsets {topic: {partition: next offset}},
                              # dedup window of sample_ids, the step's metrics record,
                              # resume: trainer.per_tenant's pending records above the offsets
                              # (pipeline/trainer/buffers.py), null otherwise
    latest                    # text: "step_00000012" (replaced atomically)
    synced.json               # {"policy_version": V}: the last version every engine was told about

A checkpoint is written into ``.step_N.tmp`` (every file fsynced, then the folder), renamed
when complete and the parent folder fsynced; then ``latest`` is replaced the same way (see
:mod:`pipeline.files`). So a crash or a power loss leaves either the previous
checkpoint or the new one, never a torn one. :func:`latest` trusts the pointer only when it
names a complete folder; otherwise it falls back to the newest complete ``step_*`` folder.
The consumed offsets inside ``meta.json`` are the source of truth on restart (the consumer
group's committed offsets only show lag). Data-parallel replicas hold identical state, so only
the ranks with DP rank 0 write. Restoring needs the same tensor-parallel size. With several
machines, ``checkpoint_dir`` must be a shared filesystem.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pipeline.trainer.dist import Parallel
from pipeline.files import atomic_write_text, fsync_dir

log = logging.getLogger(__name__)

LATEST = "latest"
SYNCED = "synced.json"


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()


def save(root: str | os.PathLike, step: int, par: Parallel, state: dict[str, Any], meta: dict[str, Any],
         keep: int = 2) -> Path:
    """Write checkpoint ``step`` (collective: every rank calls it). Returns its folder.

    ``state`` is this rank's :meth:`PolicyTrainer.state_dict`; ``meta`` (JSON-serialisable) is
    taken from rank 0. Keeps the newest ``keep`` checkpoints.
    """
    root = Path(root)
    name = f"step_{step:08d}"
    tmp = root / f".{name}.tmp"
    if par.is_main:
        if not root.is_dir():
            root.mkdir(parents=True)
            fsync_dir(root.parent)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier()
    if par.dp_rank == 0:
        path = tmp / f"tp{par.tp_rank:02d}.pt"
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
    _barrier()
    final = root / name
    if par.is_main:
        atomic_write_text(tmp / "meta.json", json.dumps({**meta, "step": step, "tp": par.tp}, sort_keys=True))
        fsync_dir(tmp)  # the shards' and meta.json's names are on disk before the rename
        if final.exists():  # re-doing a step after a crash that happened past this point
            shutil.rmtree(final)
        os.rename(tmp, final)
        fsync_dir(root)  # the rename itself survives a power loss
        atomic_write_text(root / LATEST, name + "\n")
        old = sorted(p for p in root.glob("step_*") if p.is_dir() and p.name != name)
        for p in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(p, ignore_errors=True)
    _barrier()
    return final


def complete(path: str | os.PathLike) -> bool:
    """True when ``path`` is a finished checkpoint: ``meta.json`` and one shard per TP rank."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        tp = int(meta.get("tp", 1))
    except (OSError, ValueError, TypeError):
        return False
    return all((path / f"tp{r:02d}.pt").is_file() for r in range(tp))


def pointer(root: str | os.PathLike) -> str | None:
    """The folder name the ``latest`` file names, or None when there is no pointer."""
    try:
        return (Path(root) / LATEST).read_text().strip() or None
    except FileNotFoundError:
        return None


def latest(root: str | os.PathLike) -> Path | None:
    """The checkpoint to restore: the folder ``latest`` names when it is complete, else the newest
    complete ``step_*`` folder (a warning says so), else None.

    The pointer is replaced only after its folder was renamed into place, so the newest complete
    folder is never older than the pointer's; falling back to it loses nothing.
    """
    root = Path(root)
    name = pointer(root)
    if name is not None and complete(root / name):
        return root / name
    done = sorted(p for p in root.glob("step_*") if p.is_dir() and complete(p)) if root.is_dir() else []
    if name is not None:
        if done:
            log.warning("checkpoint pointer %s names %s, which is missing or incomplete: using the newest "
                        "complete checkpoint %s", root / LATEST, name, done[-1].name)
        else:
            log.warning("checkpoint pointer %s names %s, which is missing or incomplete, and no complete "
                        "checkpoint exists", root / LATEST, name)
    return done[-1] if done else None


def load(path: str | os.PathLike, par: Parallel) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(meta, state)`` of this rank from checkpoint folder ``path``.

    Raises ``ValueError`` when the checkpoint was written with another tensor-parallel size.
    """
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    if int(meta.get("tp", 1)) != par.tp:
        raise ValueError(f"checkpoint {path} has tensor parallel size {meta.get('tp')}, this run {par.tp}")
    state = torch.load(path / f"tp{par.tp_rank:02d}.pt", map_location=par.device, weights_only=False)
    return meta, state


def read_synced(root: str | os.PathLike) -> int:
    """The last policy version whose sync finished (0 if none)."""
    try:
        return int(json.loads((Path(root) / SYNCED).read_text())["policy_version"])
    except (FileNotFoundError, KeyError, ValueError):
        return 0


def write_synced(root: str | os.PathLike, version: int) -> None:
    """Record that the sync of ``version`` finished (atomic)."""
    Path(root).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(root) / SYNCED, json.dumps({"policy_version": version}) + "\n")
