"""The weight-sync protocol's shared parts: what the trainer and every syncer must agree on.

One module, torch-free and stage-free (it imports neither :mod:`pipeline.trainer` nor
:mod:`pipeline.syncer`), used by both sides of a sync:

- the exported folder's layout and its checksum: ``<folder>/model.safetensors`` plus
  ``model.safetensors.sha256`` (``"<hex>  model.safetensors"``, the ``sha256sum`` format),
  :func:`sha256_file`, :func:`verify_folder`; a LoRA adapter folder's content id is
  :func:`sha256_folder` over its two files (docs/tenants.md). The trainer writes them
  (:func:`pipeline.trainer.model.write_hf_folder`), a syncer checks them before any engine loads the
  folder;
- what each tenant's adapter is, from ``control`` (:func:`current_adapters`: the last ``resume``
  of each tenant and its ``weights`` record), for ``pipeline adapters export`` and the syncers;
- the published record ``<trainer.export_dir>/published.json`` (:class:`Published`,
  :func:`write_published`, :func:`read_published`): the last ``weights`` event the trainer
  published, which a (re)starting syncer falls back to when ``control`` has aged it out;
- the syncer's Prometheus metrics (``pipeline_syncer_*``), defined here once, when this module
  is first imported (a second definition of a name would raise in ``prometheus_client``).

The messages themselves (``pause`` -> ``weights`` -> ``applied``/``failed`` -> ``resume`` on
``control``) are :class:`pipeline.events.Control`; the trainer's half of the exchange is
:mod:`pipeline.trainer.sync`, the syncer's is :mod:`pipeline.syncer`.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from prometheus_client import Counter, Gauge, Histogram

from pipeline import events
from pipeline.files import atomic_write_text

# ---- the exported folder and its checksum -----------------------------------------------------

WEIGHTS_FILE = "model.safetensors"
CHECKSUM_FILE = "model.safetensors.sha256"
#: a LoRA adapter folder (Hugging Face PEFT layout): its tensors, their checksum, its config. The
#: adapter's version is :func:`adapter_version`, the content id of its config and tensors (both
#: decide what it computes: ``lora_alpha / r`` scales the tensors).
ADAPTER_FILE = "adapter_model.safetensors"
ADAPTER_CHECKSUM_FILE = "adapter_model.safetensors.sha256"
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_FILES = (ADAPTER_CONFIG, ADAPTER_FILE)


def sha256_file(path: str | os.PathLike, chunk: int = 8 << 20) -> str:
    """Hex sha256 (64 lowercase hex digits) of the file at ``path``, read ``chunk`` bytes at a time.

    ``chunk`` is in bytes (default 8 MiB: a multi-GiB safetensors file is never held in memory).
    Raises ``OSError`` (``FileNotFoundError`` included) when the file cannot be read.
    """
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def verify_folder(path: str | os.PathLike, sha256: str | None = None, file: str = WEIGHTS_FILE) -> str:
    """Recompute the sha256 of ``path/<file>``; compare it to ``sha256`` and the checksum file.

    Args:
        path: an exported weights folder (``v<N>`` under ``trainer.export_dir``) or adapter folder.
        sha256: the hex digest the ``weights`` event (or ``published.json``) names; None checks
            only against ``<file>.sha256`` (when that file exists).
        file: the checksummed tensors: :data:`WEIGHTS_FILE` (full weights) or
            :data:`ADAPTER_FILE` (a LoRA adapter).
    Returns:
        The hex digest of ``<file>``.
    Raises:
        FileNotFoundError: ``<file>`` is missing.
        ValueError: a mismatch with ``sha256`` or with the checksum file (a torn, half-copied or
            tampered folder): an engine must not load it.
    """
    path = Path(path)
    digest = sha256_file(path / file)
    if sha256 is not None and digest != sha256:
        raise ValueError(f"{path}: sha256 {digest} != published {sha256}")
    side = path / f"{file}.sha256"
    if side.exists() and side.read_text().split()[0] != digest:
        raise ValueError(f"{path}: sha256 {digest} != {side.name}")
    return digest


def sha256_folder(path: str | os.PathLike, files: list[str] | tuple[str, ...]) -> str:
    """Hex sha256 of a folder's ``files``: the digest of their ``sha256sum`` manifest.

    The manifest is one line ``"<hex>  <name>\n"`` per file (each hex from :func:`sha256_file`),
    sorted by name, encoded as UTF-8; its sha256 is the folder's content id (a LoRA adapter's
    version, docs/tenants.md). Two folders with byte-identical ``files`` get the same id whatever
    else they hold or where they are.

    Raises ``OSError`` (``FileNotFoundError`` included) when a file cannot be read.
    """
    return manifest_sha256({name: sha256_file(Path(path) / name) for name in files})


def manifest_sha256(digests: dict[str, str]) -> str:
    """The sha256 of the ``sha256sum`` manifest of ``digests`` (file name -> its hex sha256):
    :func:`sha256_folder` once each file's digest is known."""
    manifest = "".join(f"{digests[name]}  {name}\n" for name in sorted(digests))
    return hashlib.sha256(manifest.encode()).hexdigest()


def adapter_version(path: str | os.PathLike) -> str:
    """A LoRA adapter folder's version: :func:`sha256_folder` over :data:`ADAPTER_FILES`.

    Raises ``OSError`` (``FileNotFoundError`` included) when a file cannot be read.
    """
    return sha256_folder(path, ADAPTER_FILES)


def read_adapter_files(path: str | os.PathLike) -> tuple[str, bytes, bytes]:
    """Read an adapter folder's two files once: ``(version, config bytes, tensor bytes)``.

    ``version`` is :func:`adapter_version` of exactly the bytes returned, so whoever parses them
    parses what was hashed (no second read that a concurrent writer could change). The tensors
    are checked against their checksum file ``adapter_model.safetensors.sha256`` when it exists.
    An adapter is small (rank 16 on a 135M model: 19.6 MB), so both files are held in memory.

    Raises:
        OSError: a file is missing or unreadable (``FileNotFoundError`` included).
        ValueError: the tensors do not match their checksum file (torn, half-copied, tampered).
    """
    path = Path(path)
    tensors = (path / ADAPTER_FILE).read_bytes()
    config = (path / ADAPTER_CONFIG).read_bytes()
    digest = hashlib.sha256(tensors).hexdigest()
    side = path / ADAPTER_CHECKSUM_FILE
    if side.exists() and side.read_text().split()[0] != digest:
        raise ValueError(f"{path}: sha256 {digest} != {side.name}")
    return manifest_sha256({ADAPTER_FILE: digest, ADAPTER_CONFIG: hashlib.sha256(config).hexdigest()}), config, tensors


def verify_adapter(path: str | os.PathLike, sha256: str | None = None) -> str:
    """Check an adapter folder before it is loaded; return its :func:`adapter_version`.

    The tensors are checked against their checksum file (when that file exists) and the version
    against ``sha256`` (the one a record names; None: not compared); each file is read once
    (:func:`read_adapter_files`). Raises ``FileNotFoundError`` (a file missing) and
    ``ValueError`` (a mismatch: a torn, half-copied or tampered folder).
    """
    version, _, _ = read_adapter_files(path)
    if sha256 is not None and version != sha256:
        raise ValueError(f"{path}: adapter version {version} != published {sha256}")
    return version


@dataclass
class TenantAdapters:
    """The tenants' adapter orders read from ``control`` (docs/tenants.md, "Adapter sync"), fed in
    log order with :meth:`see` (a syncer's state; :func:`current_adapters`).

    Attributes:
        folders: ``(tenant, adapter version) -> its weights record`` (the folder to load it from).
        current: ``tenant -> adapter`` (``{name, version, sha256}``) of the tenant's last ``resume``;
            None: the tenant is served by the base model. A tenant never resumed is absent.
    """

    folders: dict[tuple[str, str], events.Control] = field(default_factory=dict)
    current: dict[str, dict | None] = field(default_factory=dict)

    def see(self, ev: events.Control) -> None:
        """Record a tenant's ``weights`` (its folder) or ``resume`` (what serves it from now on)."""
        if ev.tenant is None:
            return
        if ev.action == "weights" and ev.adapter is not None:
            self.folders[(ev.tenant, ev.adapter["version"])] = ev
        elif ev.action == "resume":
            self.current[ev.tenant] = ev.adapter

    def weights_of(self, tenant: str) -> events.Control | None:
        """The ``weights`` record of ``tenant``'s current adapter (None: base model, or its record
        was never seen: control aged it out)."""
        a = self.current.get(tenant)
        return None if a is None else self.folders.get((tenant, a["version"]))


def current_adapters(records, run_id: str) -> dict[str, tuple[dict, str] | None]:
    """What each tenant is served by, from ``control`` events in log order (docs/tenants.md,
    "Adapter sync"): ``{tenant: (adapter, location)}`` for the tenants of ``run_id`` with a
    ``resume``: the adapter its last ``resume`` names and the ``location`` of its ``weights``
    record; None when that ``resume`` names the base model (or no ``weights`` record of its
    version was seen). Other events, and other runs' orders, are passed over."""
    orders = TenantAdapters()
    for ev in records:
        if getattr(ev, "TYPE", None) == "control" and ev.run_id == run_id:
            orders.see(ev)
    out: dict[str, tuple[dict, str] | None] = {}
    for tenant, adapter in orders.current.items():
        w = orders.weights_of(tenant)
        out[tenant] = (adapter, w.location) if w is not None else None
    return out


# ---- the trainer's record of what it published ------------------------------------------------

PUBLISHED = "published.json"


@dataclass(frozen=True)
class Published:
    """A ``weights`` event the trainer published.

    Fields: ``run_id``; ``policy_version`` (the event's version and epoch); ``location`` (the
    exported folder); ``sha256`` (hex digest of its ``model.safetensors``); ``created_at`` (the
    event's time, ms since the epoch; 0 when unknown).
    """

    run_id: str
    policy_version: int
    location: str
    sha256: str
    created_at: int = 0


def write_published(export_dir: str | Path, rec: Published) -> None:
    """Record ``rec`` in ``<export_dir>/published.json`` (atomic and durable, sorted-key JSON).

    The trainer writes it right after the broker acknowledged the ``weights`` event, so it never
    names a version the trainer did not publish. Syncers fall back to it when ``control`` no
    longer holds any ``weights`` event of the run (retention), see
    :func:`pipeline.syncer.last_published`. Creates ``export_dir`` when missing.

    Raises:
        OSError: the folder or the file cannot be written.
    """
    Path(export_dir).mkdir(parents=True, exist_ok=True)
    atomic_write_text(Path(export_dir) / PUBLISHED, json.dumps(asdict(rec), sort_keys=True) + "\n")


def read_published(export_dir: str | Path) -> Published | None:
    """The record :func:`write_published` left in ``export_dir``.

    Returns None when it is absent or unreadable (not JSON, a field missing or of the wrong
    type): the caller then knows only what ``control`` holds. Never raises.
    """
    try:
        data = json.loads((Path(export_dir) / PUBLISHED).read_text())
        return Published(str(data["run_id"]), int(data["policy_version"]), str(data["location"]),
                         str(data["sha256"]), int(data.get("created_at", 0)))
    except (OSError, ValueError, KeyError, TypeError):
        return None


# ---- the syncer's Prometheus metrics (served on its metrics port) -----------------------------
# The trainer's own (steps, losses, pipeline_trainer_published_version, sync failures it saw)
# are in pipeline.trainer.prom.

SYNCER_APPLIED = Counter("pipeline_syncer_applied_total", "Weight versions applied to the engine")
SYNCER_FAILED = Counter("pipeline_syncer_failed_total", "Weight versions that could not be applied (after retries)")
SYNCER_ENGINE_VERSION = Gauge("pipeline_syncer_engine_weight_version",
                              "Weights version the engine serves (its /model_info; NaN: unknown or not a number)",
                              ["engine_id"])
SYNCER_PUBLISHED_VERSION = Gauge("pipeline_syncer_published_version",
                                 "Last policy version the trainer published, as this engine's syncer knows it "
                                 "(NaN: none yet)", ["engine_id"])
SYNCER_BEHIND = Gauge("pipeline_syncer_engine_versions_behind",
                      "Published minus served version (0: the engine serves the trainer's latest weights; NaN: either unknown)",
                      ["engine_id"])
SYNCER_RECONCILES = Counter("pipeline_syncer_reconciles_total",
                            "Times the engine was found serving another version than the last published one "
                            "(engine or syncer restart) and the published one was re-applied", ["engine_id"])
SYNCER_SECONDS = Histogram("pipeline_syncer_apply_seconds", "Checksum + /update_weights_from_disk, seconds",
                           buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300))
SYNCER_ADAPTER_LOADS = Counter("pipeline_syncer_adapter_loads_total",
                               "Tenant adapter loads (/load_lora_adapter after the folder's check), by result "
                               "(applied | failed)", ["engine_id", "result"])
SYNCER_ADAPTER_UNLOADS = Counter("pipeline_syncer_adapter_unloads_total",
                                 "Tenant adapters unloaded after a resume named another one", ["engine_id"])
SYNCER_ADAPTERS_MISSING = Gauge("pipeline_syncer_adapters_missing",
                                "Tenants whose current adapter (last resume) the engine does not serve", ["engine_id"])
SYNCER_ADAPTER_SECONDS = Histogram("pipeline_syncer_adapter_load_seconds",
                                   "Check + /load_lora_adapter of one tenant adapter (retries included), seconds",
                                   buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
