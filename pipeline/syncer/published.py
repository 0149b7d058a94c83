"""What the trainer published, read back from ``control`` (a syncer's start-up reconciliation).

:func:`scan_control` reads ``control`` (one partition) from its beginning to its end once and
returns both halves of what a (re)starting syncer must restore: the newest full-weight
``weights`` event of the run (:func:`last_published`, with the trainer's ``published.json``
fallback) and every tenant's adapter state (:class:`TenantServing`: the ``weights`` record of
each adapter version, the adapter of each tenant's last ``resume`` and, with ``rollout.enabled``,
the serving view: its incumbent and its canary's candidate, for the full weights too, with the
``weights`` record of each full-weight version: :meth:`TenantServing.full_target`).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pipeline import events
from pipeline.config import Config
from pipeline.rollout.serving import ServingView, version_of
from pipeline.weightsync import TenantAdapters


@dataclass
class TenantServing(TenantAdapters):
    """:class:`pipeline.weightsync.TenantAdapters` and, with rollout on, the run's
    :class:`pipeline.rollout.serving.ServingView` (``view``; None: rollout off), fed together in
    log order by :meth:`see`. Which adapters of a tenant must be on an engine:

    - rollout off: the adapter of its last ``resume`` (:attr:`current`);
    - rollout on: its incumbent and its live candidate (both serve during a canary); a
      rolled-back candidate is neither, whatever a later ``resume`` names.

    With rollout on the full weights' records are folded too (:meth:`see_full`): ``full_orders``
    maps each full-weight policy version to its ``weights`` record, and :meth:`full_target` says
    which of them an engine must serve (the candidate's only on an engine that takes candidates).
    """

    view: ServingView | None = None
    full_orders: dict[int, events.Control] = field(default_factory=dict)

    @classmethod
    def of(cls, config: Config, run_id: str) -> "TenantServing":
        """An empty state for ``run_id`` (with a serving view when ``config.rollout.enabled``)."""
        return cls(view=ServingView(run_id) if config.rollout.enabled else None)

    def see(self, ev: events.Control) -> None:
        """Record a tenant's ``weights``, ``resume`` (and, rollout on, every serving change)."""
        super().see(ev)
        if self.view is not None and ev.tenant is not None:
            self.view.apply(ev)

    def see_full(self, ev: events.Control) -> None:
        """Rollout on: fold a full-weight record of the run into the view and keep each ``weights``
        record by policy version (rollout off: nothing; the newest order is the target)."""
        if self.view is None:
            return
        if ev.action == "weights":
            self.full_orders[ev.policy_version] = ev
        self.view.apply(ev)

    def full_target(self, published: events.Control | None, candidate: bool = True) -> events.Control | None:
        """The full weights the engine must serve. Rollout off: ``published`` (the newest order).
        Rollout on: the order of the scope's candidate (live or still syncing) when this engine
        takes candidates (``candidate``: one full-weight engine, or an engine of
        ``rollout.canary_engines``), else of its incumbent (an engine outside the canary applies
        a version at its ``promote``); never a rolled-back version. ``published`` (the newest
        order, or the trainer's ``published.json`` record) stands in when it is that version and
        its order was not read (control aged it out). None: the incumbent is version 0 without an
        order (the engine's base model)."""
        if self.view is None:
            return published
        s = self.view.scope(None)
        want = s.candidate if s.candidate is not None and candidate else s.incumbent
        got = self.full_orders.get(want)
        if got is None and published is not None and published.policy_version == want:
            return published
        return got

    def known(self) -> list[str]:
        """Every tenant with an order (sorted)."""
        scoped = () if self.view is None else (t for t in self.view.scopes if t is not None)
        return sorted(set(self.current) | set(scoped))

    def served(self, tenant: str) -> list[dict]:
        """The adapters that serve ``tenant``'s requests now (see the class docstring; empty: the
        base model alone)."""
        if self.view is None:
            a = self.current.get(tenant)
            return [] if a is None else [a]
        s = self.view.scope(tenant)
        both = [s.incumbent, s.candidate if s.live else None]
        return [a for i, a in enumerate(both) if a is not None and (i == 0 or version_of(a) != version_of(both[0]))]

    def needed(self, tenant: str) -> list[dict]:
        """:meth:`served` and, rollout on, a candidate whose sync runs (not live yet)."""
        out = self.served(tenant)
        cand = None if self.view is None else self.view.scope(tenant).candidate
        return out + [cand] if cand is not None and version_of(cand) not in map(version_of, out) else out

    def rolled_back(self, tenant: str, adapter: dict) -> bool:
        """``adapter`` of ``tenant`` was rolled back (never false with rollout off)."""
        return self.view is not None and adapter["version"] in self.view.scope(tenant).rolled_back

    def folder_of(self, tenant: str, adapter: dict) -> events.Control | None:
        """The ``weights`` record of ``tenant``'s ``adapter`` (None: never seen, or aged out)."""
        return self.folders.get((tenant, adapter["version"]))


def _full_weights_of(ev: object, run_id: str) -> bool:
    return isinstance(ev, events.Control) and ev.full_weights and ev.action == "weights" and ev.run_id == run_id


def scan_control(config: Config, run_id: str, timeout_s: float = 60.0,
                 stop: threading.Event | None = None) -> tuple[events.Control | None, TenantServing]:
    """Read ``control`` from the beginning to its end (the high watermark seen after a fetch).

    Returns ``(last full weights, tenants)``: the newest full-weight ``weights`` event of
    ``run_id`` (:func:`last_published`'s answer without the ``published.json`` fallback) and
    the :class:`TenantServing` of the run's records (tenants', and with rollout on the full
    weights' too), in log order. Bad records are passed over (an observer: the syncer's own group dead-letters them).

    Raises:
        TimeoutError: the end of ``control`` was not reached within ``timeout_s``.
    """
    from pipeline.bus import TopicReader

    best: events.Control | None = None
    tenants = TenantServing.of(config, run_id)
    topic = config.topics.name("control")
    with TopicReader(config, topic, "beginning", partitions=[0], name="syncer-reconcile") as reader:
        deadline = time.monotonic() + timeout_s
        while True:
            for rec in reader.poll(timeout_ms=200):
                ev = getattr(rec, "event", None)
                if _full_weights_of(ev, run_id) and (best is None or ev.policy_version >= best.policy_version):
                    best = ev
                if isinstance(ev, events.Control) and ev.run_id == run_id:
                    (tenants.see_full if ev.full_weights else tenants.see)(ev)
            if reader.caught_up():
                break
            if time.monotonic() > deadline or (stop is not None and stop.is_set()):
                raise TimeoutError(f"could not read {topic} to its end within {timeout_s:.0f} s")
    return best, tenants


def with_published_record(config: Config, run_id: str, best: events.Control | None) -> events.Control | None:
    """``best``, or the trainer's ``<trainer.export_dir>/published.json`` record as a ``weights``
    event when it is newer (control retention may have deleted the event)."""
    from pipeline.weightsync import read_published

    rec = read_published(config.trainer.export_dir)
    if rec is not None and rec.run_id == run_id and (best is None or rec.policy_version > best.policy_version):
        best = events.Control(action="weights", epoch=rec.policy_version, policy_version=rec.policy_version,
                              run_id=run_id, location=rec.location, sha256=rec.sha256, created_at=rec.created_at)
    return best


def last_published(config: Config, run_id: str, timeout_s: float = 60.0,
                   stop: threading.Event | None = None) -> events.Control | None:
    """The last weights the trainer of ``run_id`` published, as a ``weights`` :class:`events.Control`.

    Reads ``control`` (one partition) from the beginning to its end (the high watermark seen
    after a fetch; no end-offset lookup) and keeps the newest ``weights`` event of the run; the
    trainer's ``<trainer.export_dir>/published.json`` record counts too when it is newer (control
    retention may have deleted the event). None when the run never published.

    Raises:
        TimeoutError: the end of ``control`` was not reached within ``timeout_s``.
    """
    best, _ = scan_control(config, run_id, timeout_s, stop)
    return with_published_record(config, run_id, best)
