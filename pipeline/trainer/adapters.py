"""The trainer stage's per-tenant adapters (``trainer.lora``): export, adapter sync, commands.

Layout under ``trainer.export_dir``::

    adapters/<events.tenant_slug(T)>/<first 16 hex digits of the version>/   # one folder per content
        adapter_config.json  adapter_model.safetensors  adapter_model.safetensors.sha256

An update of tenant ``T`` is exported into a staging folder beside (written atomically by
:meth:`pipeline.trainer.policy.PolicyTrainer.export_adapter`), its version computed from its
content (:func:`pipeline.weightsync.adapter_version`) and the folder renamed to its version's
name; an existing folder of that version that verifies is reused (the staging copy removed), one
that does not is replaced. The newest ``trainer.keep_exports`` folders of ``T`` (by update count)
are kept, and never the one ``T``'s last ``resume`` names.

``<trainer.checkpoint_dir>/adapters_synced.json`` (``{tenant: {"n": n, "published": adapter |
null}}``, replaced atomically) records each finished sync's ``resume``, so a restart knows what
every tenant is served by even when the checkpoint is older.

Commands (``control`` records with ``action`` in :data:`pipeline.events.ADAPTER_COMMANDS`, this
run's ``run_id``) are read by rank 0 between steps and while it waits for samples
(:class:`CommandReader`) from the position
kept in the checkpoint's ``commands_offset`` (every command below it was applied), applied in
log order and broadcast with the batch: ``freeze``/``unfreeze`` set the flag; ``reset`` removes
``T``'s adapter and optimizer state on every rank, forgets its version table and publishes
``resume`` (T, None); ``delete`` is ``reset`` plus the removal of ``T``'s export folders.

With ``rollout.enabled`` (docs/rollout.md) the reader also folds every ``control`` record of the
run into the stage's :class:`pipeline.rollout.serving.ServingView` and hands over the
``promote``/``rollback`` decisions with the commands, in log order. A ``rollback`` of ``T``'s
newest exported version restores ``T``'s incumbent (:meth:`TenantAdapters.rollback`); a sync's
``previous`` is ``T``'s incumbent; the incumbent's folder is never pruned.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from pathlib import Path

from pipeline import events, weightsync
from pipeline.bus import Offset, TopicReader, Undecodable
from pipeline.config import Config
from pipeline.files import atomic_write_text, fsync_dir
from pipeline.trainer.tenants import TenantTable

log = logging.getLogger(__name__)

SYNCED_FILE = "adapters_synced.json"
EMPTY_POLLS = 3  # polls without a record before the command reader calls itself caught up


def tenant_dir(export_dir: str | os.PathLike, tenant: str) -> Path:
    """``<export_dir>/adapters/<tenant_slug(tenant)>``: every exported version of ``tenant``."""
    return Path(export_dir) / "adapters" / events.tenant_slug(tenant)


def adapter_folder(export_dir: str | os.PathLike, tenant: str, version: str) -> Path:
    """The folder of ``tenant``'s adapter ``version`` (the contract's ``location``)."""
    return tenant_dir(export_dir, tenant) / version[:16]


def read_synced(ckpt_dir: str | os.PathLike) -> dict[str, dict]:
    """``adapters_synced.json`` (``{}`` when absent or unreadable)."""
    try:
        data = json.loads((Path(ckpt_dir) / SYNCED_FILE).read_text())
        return {str(t): {"n": int(v["n"]), "published": v.get("published")} for t, v in data.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


class CommandReader:
    """Rank 0's reader of ``control``: the adapter commands from ``offset`` on (one partition) and,
    with ``view`` (``rollout.enabled``), every record of the run folded into that
    :class:`pipeline.rollout.serving.ServingView` and the rollout decisions.

    ``poll()`` returns the actions that arrived (this run's, in log order) and stops once the
    reader has caught up with the partition's end (or after :data:`EMPTY_POLLS` empty polls);
    :attr:`position` is the offset after the last record read. Records that do not decode are
    passed over (the stages that act on them dead-letter them).

    Actions are tuples: ``(command, tenant)`` for :data:`pipeline.events.ADAPTER_COMMANDS`, and
    with ``view`` also ``(decision, tenant, version, incumbent)`` for ``promote``/``rollback``
    (``tenant`` None: the full weights; ``version``: the decided adapter content id, or policy
    version; ``incumbent``: the scope's incumbent once the record is folded, an adapter dict, None
    for the base model, or a policy version). With ``view`` the reader starts at the beginning of
    ``control`` (the view needs the whole history: who is the incumbent) and returns only the
    actions at or above ``offset`` (those below were applied before the checkpoint that kept it).
    :attr:`full_orders`: the run's full-weight ``weights`` orders read so far, policy version ->
    offset of its first order (with ``view``, from the beginning: whether v0 was declared, where
    the engines' answers to the incumbent's order begin).
    """

    def __init__(self, config: Config, offset: int, view=None) -> None:
        self.run_id = config.trainer.run_id
        self.view = view
        self.start = offset
        self.reader = TopicReader(config, config.topics.name("control"),
                                  Offset(per_partition={0: 0 if view is not None else offset}),
                                  partitions=[0], name="trainer")
        self.position = offset
        self.full_orders: dict[int, int] = {}

    def _action(self, ev: events.Control, offset: int) -> tuple | None:
        """The action ``ev`` (at ``offset``) asks of the trainer (folded into the view first), or None."""
        if ev.run_id != self.run_id:
            return None
        if self.view is not None:
            self.view.apply(ev)
        if ev.action == "weights" and ev.full_weights:
            self.full_orders.setdefault(ev.policy_version, offset)
        if ev.action in events.ADAPTER_COMMANDS:
            return ev.action, ev.tenant
        if self.view is not None and ev.action in events.ROLLOUT_DECISIONS:
            tenant = None if ev.full_weights else ev.tenant
            version = ev.policy_version if tenant is None else (ev.adapter or {}).get("version")
            return ev.action, tenant, version, self.view.scope(tenant).incumbent
        return None

    def poll(self) -> list[tuple]:
        """The actions read since the last call, oldest first (see the class docstring)."""
        out: list[tuple] = []
        empty = 0
        while empty < EMPTY_POLLS:
            got = self.reader.poll(timeout_ms=100)
            for rec in got:
                if isinstance(rec, Undecodable):
                    self.position = max(self.position, rec.offset + 1)
                    continue
                action = self._action(rec.event, rec.offset)
                if action is not None and rec.offset >= self.start:
                    out.append(action)
                self.position = max(self.position, rec.offset + 1)
            if got:
                empty = 0
            elif self.reader.caught_up():
                break
            else:
                empty += 1
        return out

    def catch_up(self, offset: int, stop: threading.Event | None = None) -> list[tuple]:
        """Poll until the record at ``offset`` was read (the trainer's own ``resume``, acknowledged
        by the broker, so the view holds what the trainer published) or ``stop`` is set; returns
        the actions read meanwhile."""
        out: list[tuple] = []
        while self.position <= offset and not (stop is not None and stop.is_set()):
            out += self.poll()
        return out

    def close(self) -> None:
        """Close the reader."""
        self.reader.close()


class TenantAdapters:
    """Exports, syncs and commands of every tenant's adapter (see the module docstring).

    Args:
        config: the process config.
        policy: the :class:`pipeline.trainer.policy.PolicyTrainer` (``trainer.lora`` on).
        is_main: rank 0 (it alone talks to Kafka and writes files).
        meta: the checkpoint's ``tenants`` (None: a new run).
    """

    def __init__(self, config: Config, policy, is_main: bool, meta: dict | None = None) -> None:
        cfg = config.trainer
        self.cfg, self.policy, self.is_main = cfg, policy, is_main
        self.export_dir, self.ckpt_dir = Path(cfg.export_dir), Path(cfg.checkpoint_dir)
        self.table = TenantTable(max(64, (cfg.max_staleness or 0) + 1), meta)
        self.publisher = None  # rank 0: the stage's WeightPublisher
        #: rank 0 with ``rollout.enabled``: the stage's :class:`pipeline.rollout.serving.ServingView`
        #: (a sync's ``previous`` is the incumbent; the incumbent's folder is never pruned)
        self.view = None
        if is_main:
            self._restore_synced()

    def _restore_synced(self) -> None:
        """Take each tenant's last finished sync from ``adapters_synced.json``; a sync newer than
        the checkpoint (``checkpoint_every > 1``) makes the restored update count one more, so
        the restored adapter is published again under a higher number."""
        for tenant, rec in read_synced(self.ckpt_dir).items():
            s = self.table[tenant]
            if rec["n"] > s.updates:
                log.warning("engines may serve %s's adapter n=%d, newer than the checkpoint's n=%d: the restored "
                            "adapter is published as n=%d", tenant, rec["n"], s.updates, rec["n"] + 1)
                s.updates = rec["n"] + 1
            if rec["n"] >= s.synced:
                s.synced, s.published = rec["n"], rec["published"]
        for tdir in (self.export_dir / "adapters").glob("*/.*") if (self.export_dir / "adapters").is_dir() else []:
            shutil.rmtree(tdir, ignore_errors=True)  # staging folders of a crashed export

    def need_sync(self) -> list[str]:
        """Tenants with an adapter whose last update was exported but not synced (rank 0)."""
        return [t for t in self.table.unsynced() if t in self.policy.adapters()]

    # ------------------------------------------------------------ export

    def export(self, tenant: str) -> tuple[dict, Path] | None:
        """Export ``tenant``'s adapter (collective over TP); rank 0 gets ``(adapter record,
        folder)`` and the version is recorded at ``n_T``, the other ranks get None."""
        tdir = tenant_dir(self.export_dir, tenant)
        staging = tdir / f".staging-{self.table.updates(tenant)}"
        if self.is_main:
            shutil.rmtree(staging, ignore_errors=True)
        exported = self.policy.export_adapter(tenant, staging)
        if exported is None:
            return None
        version = exported.sha256  # the adapter's version (weightsync.adapter_version)
        final = adapter_folder(self.export_dir, tenant, version)
        reuse = False
        if final.exists():
            try:
                reuse = weightsync.verify_adapter(final, version) == version
            except (OSError, ValueError):
                shutil.rmtree(final, ignore_errors=True)
        if reuse:
            shutil.rmtree(staging, ignore_errors=True)
        else:
            os.rename(staging, final)
            fsync_dir(tdir)
        sha = weightsync.verify_folder(final, file=weightsync.ADAPTER_FILE)
        self.table.record(tenant, version)
        return {"name": events.adapter_name(tenant, version), "version": version, "sha256": sha}, final

    def prune(self, tenant: str) -> None:
        """Keep ``tenant``'s newest ``keep_exports`` folders (by update count; folders of versions
        the table forgot are the oldest) and always the one its last ``resume`` names."""
        tdir = tenant_dir(self.export_dir, tenant)
        s = self.table[tenant]
        n_of = {v[:16]: n for v, n in s.versions.items()}
        keep = {s.published["version"][:16]} if s.published else set()
        incumbent = self.view.scope(tenant).incumbent if self.view is not None else None
        if incumbent is not None:
            keep.add(incumbent["version"][:16])  # a rollback restores it (and engines serve it)
        folders = sorted((p for p in tdir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                         key=lambda p: (n_of.get(p.name, -1), p.name)) if tdir.is_dir() else []
        for p in folders[:max(0, len(folders) - self.cfg.keep_exports)]:
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)

    # ------------------------------------------------------------ sync

    def sync(self, tenant: str, adapter: dict, location: Path, stop: threading.Event | None):
        """Rank 0: the adapter sync of ``tenant``'s current update; records its ``resume``. Its
        ``previous`` (named by ``resume`` when an engine failed) is what ``tenant``'s last ``resume``
        named, or with ``rollout.enabled`` the scope's incumbent (the candidate is not served by all)."""
        s = self.table[tenant]
        previous = self.view.scope(tenant).incumbent if self.view is not None else s.published
        report = self.publisher.sync_adapter(tenant, s.updates, adapter, str(location.resolve()), previous,
                                             stop=stop)
        self.table.synced_to(tenant, s.updates, report.resumed)
        self._write_synced()
        self.prune(tenant)
        return report

    def _write_synced(self) -> None:
        data = {t: {"n": s.synced, "published": s.published} for t, s in sorted(self.table.tenants.items())}
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.ckpt_dir / SYNCED_FILE, json.dumps(data, sort_keys=True) + "\n")

    # ------------------------------------------------------------ commands

    def apply(self, commands: list[tuple[str, str]]) -> None:
        """Apply ``(action, tenant)`` commands in order (every rank; rank 0 also publishes and
        removes folders)."""
        for action, tenant in commands:
            if action in ("freeze", "unfreeze"):
                self.table[tenant].frozen = action == "freeze"
            else:  # reset, delete
                if tenant in self.policy.adapters():
                    self.policy.remove_adapter(tenant)
                s = self.table.reset(tenant)
                if self.is_main:
                    self.publisher.resume_adapter(tenant, s.updates, None)
                    self._write_synced()
                    if action == "delete":
                        shutil.rmtree(tenant_dir(self.export_dir, tenant), ignore_errors=True)
            if self.is_main:
                log.info("adapter command %s applied to tenant %s", action, tenant)

    def rollback(self, tenant: str, version: str | None, incumbent: dict | None, decided: bool | None = None) -> bool:
        """``rollout.enabled``: the canary of ``tenant``'s adapter ``version`` was rolled back (every
        rank). When ``version`` is the newest this trainer exported for ``tenant`` (the head of
        what it trains), ``tenant`` continues from ``incumbent``: its adapter is loaded from the
        incumbent's export folder (None: the base model, a fresh adapter as ``reset`` makes),
        its optimizer state starts fresh, the incumbent counts as the current update ``n_T``
        (its samples are on-policy; ``n_T`` itself stays: versions never repeat) and nothing is
        pending (the updates trained since ``version`` are dropped with its weights). Returns
        whether it restored. A rollback of an older version (superseded, or decided twice) is
        logged and changes nothing; so is one whose incumbent folder is gone or does not verify
        (an error: the trainer goes on from its own state). ``decided``: rank 0's verdict, which
        the other TP ranks follow (their tables do not record the exported versions)."""
        if decided is not None:
            if decided:
                self._restore(tenant, version, incumbent)
            return decided
        s = self.table.tenants.get(tenant)
        newest = max(s.versions, key=s.versions.__getitem__) if s is not None and s.versions else None
        if version is None or version != newest:
            if self.is_main:
                log.info("rollback of %s's adapter %s: not the newest it trained (%s): nothing to restore",
                         tenant, (version or "none")[:16], (newest or "none")[:16])
            return False
        folder = adapter_folder(self.export_dir, tenant, incumbent["version"]) if incumbent is not None else None
        try:
            if folder is not None:
                weightsync.verify_adapter(folder, incumbent["version"])
        except (OSError, ValueError) as e:
            log.error("rollback of %s's adapter %s: the incumbent's folder %s cannot be loaded (%s): the trainer "
                      "goes on from its own state", tenant, version[:16], folder, e)
            return False
        self._restore(tenant, version, incumbent)
        return True

    def _restore(self, tenant: str, version: str, incumbent: dict | None) -> None:
        """:meth:`rollback`'s restore of ``incumbent`` as ``tenant``'s adapter (every rank)."""
        s = self.table[tenant]
        folder = adapter_folder(self.export_dir, tenant, incumbent["version"]) if incumbent is not None else None
        if tenant in self.policy.adapters():
            self.policy.remove_adapter(tenant)
        if folder is None:
            s.base = s.updates  # the fresh adapter (B = 0) is the base model: its samples are on-policy
        else:
            self.policy.load_adapter(tenant, folder, incumbent["version"])
            self.table.record(tenant, incumbent["version"])
        s.synced, s.published = s.updates, incumbent
        if self.is_main:
            self._write_synced()
            log.warning("rollback of %s's adapter %s: continuing from the incumbent %s (fresh optimizer state, "
                        "n stays %d)", tenant, version[:16], incumbent["version"][:16] if incumbent else "(base "
                        "model)", s.updates)

    def why_not_trained(self, tenant: str | None) -> str | None:
        """Why a batch of ``tenant`` trains nothing: ``no_tenant`` (the base is frozen; untenanted
        traffic is served by the base), ``frozen``, or None (it trains)."""
        if tenant is None:
            return "no_tenant"
        return "frozen" if self.table[tenant].frozen else None
