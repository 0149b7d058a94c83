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

from pipeline import events
from pipeline.config import Config
from pipeline.weightsync import TenantAdapters


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
