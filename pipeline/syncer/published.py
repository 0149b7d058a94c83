"""What the trainer published, read back from ``control`` (a syncer's start-up reconciliation).

:func:`scan_control` reads ``control`` (one partition) from its beginning to its end once and
returns both halves of what a (re)starting syncer must restore: the newest full-weight
``weights`` event of the run (:func:`last_published`, with the trainer's ``published.json``
fallback) and every tenant's adapter state (:class:`TenantAdapters`: the ``weights`` record of
each adapter version, and the adapter of each tenant's last ``resume``).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from pipeline import events
from pipeline.config import Config


@dataclass
class TenantAdapters:
    """The tenants' adapter orders a syncer has read from ``control`` (docs/tenants.md, "Adapter sync").

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


def _full_weights_of(ev: object, run_id: str) -> bool:
    return isinstance(ev, events.Control) and ev.full_weights and ev.action == "weights" and ev.run_id == run_id


def scan_control(config: Config, run_id: str, timeout_s: float = 60.0,
                 stop: threading.Event | None = None) -> tuple[events.Control | None, TenantAdapters]:
    """Read ``control`` from the beginning to its end (the high watermark seen after a fetch).

    Returns ``(last full weights, tenants)``: the newest full-weight ``weights`` event of
    ``run_id`` (:func:`last_published`'s answer without the ``published.json`` fallback) and
    the :class:`TenantAdapters` of the run's tenant ``weights`` and ``resume`` records, in log
    order. Bad records are passed over (an observer: the syncer's own group dead-letters them).

    Raises:
        TimeoutError: the end of ``control`` was not reached within ``timeout_s``.
    """
    from pipeline.bus import TopicReader

    best: events.Control | None = None
    tenants = TenantAdapters()
    topic = config.topics.name("control")
    with TopicReader(config, topic, "beginning", partitions=[0], name="syncer-reconcile") as reader:
        deadline = time.monotonic() + timeout_s
        while True:
            for rec in reader.poll(timeout_ms=200):
                ev = getattr(rec, "event", None)
                if _full_weights_of(ev, run_id) and (best is None or ev.policy_version >= best.policy_version):
                    best = ev
                elif isinstance(ev, events.Control) and ev.tenant is not None and ev.run_id == run_id:
                    tenants.see(ev)
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
