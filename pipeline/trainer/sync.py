"""The trainer's side of a weight sync on ``control`` (one partition, total order).

Protocol for policy version ``V`` (epoch = ``V``):

1. trainer: ``pause``; then ``weights`` (``location`` = the exported folder, ``sha256`` of its
   ``model.safetensors``);
2. each syncer (``python -m pipeline syncer``, one per engine replica) verifies the checksum,
   calls the engine's ``/update_weights_from_disk`` (with retries) and answers ``applied`` or
   ``failed`` with its ``engine_id``;
3. trainer: once every engine of ``trainer.engines`` answered (with ``rollout.canary_engines`` a
   full-weight candidate's sync waits for those engines only: the others apply it at its
   ``promote``, docs/rollout.md), or after ``sync_timeout_s``
   (then it publishes a ``failed`` report for each silent engine), ``resume``. Engines are
   never left paused: ``resume`` is always sent, also when the wait is interrupted.

With ``rollout.canary_engines`` the engines outside the canary apply a promoted version at its
``promote``; before a full-weight candidate's sync the trainer waits for their ``applied`` of the
incumbent (:meth:`WeightPublisher.await_applied`, up to ``sync_timeout_s``, logged when one stays
silent), so no candidate opens while they still serve the version before it.

Answers are read from the offset of the trainer's own ``weights`` record onward (known from the
produce acknowledgement), so no end-offset lookup is needed (Tansu's is unreliable). They are
read with :class:`pipeline.bus.TopicReader`: a record that is not a valid ``control`` event goes
to ``control.dlq`` and the wait goes on (if the dead letter cannot be written within
``DLQ_GIVE_UP_S`` the record is logged as an error and passed over: the wait commits nothing).

With ``trainer.lora`` each update of a tenant ``T`` is synced the same way, every record
carrying ``tenant`` T and the adapter ``A`` (:meth:`WeightPublisher.sync_adapter`; epoch =
policy_version = ``T``'s update count): the answers that count are ``T``'s about ``A.version``,
and ``resume`` names ``A`` when every engine applied it, else the adapter ``T`` was served by
before (None: the base). The protocol is docs/tenants.md's "Adapter sync".

Once the broker holds the (full) ``weights`` event, the trainer also records it in
``<export_dir>/published.json`` (:func:`pipeline.weightsync.write_published`): the last version
it published, which a (re)starting syncer reconciles its engine to when ``control`` has aged it
out. The checksum, that record and the syncer's metrics are :mod:`pipeline.weightsync`, shared
with the syncer (which imports nothing of the trainer).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from pipeline import events
from pipeline.bus import EventProducer, Offset, TopicReader
from pipeline.config import Config
from pipeline.weightsync import PUBLISHED, Published, write_published

log = logging.getLogger(__name__)

DLQ_GIVE_UP_S = 5.0  # the sync wait passes over a bad record whose dead letter cannot be written


@dataclass
class SyncReport:
    """Outcome of one sync: which engines applied, which failed (with why), how long it took.

    ``resumed``: for an adapter sync, the adapter its ``resume`` named (the new one when every
    engine applied it, else the one the tenant was served by before; None: the base model).
    ``offset``: where its ``resume`` record is on ``control`` (None: not acknowledged), so a
    reader of ``control`` can wait until it has read the trainer's own records.
    """

    policy_version: int
    applied: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    resumed: dict | None = None
    offset: int | None = None

    @property
    def ok(self) -> bool:
        """True when no engine failed or timed out."""
        return not self.failed


class WeightPublisher:
    """Publishes pause/weights/resume for the trainer and waits for the syncers' answers."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.cfg = config.trainer
        self.topic = config.topics.name("control")
        self.producer = EventProducer(config, name="trainer")

    def _send(self, ev: events.Control):
        meta = self.producer.send(self.topic, ev, key=ev.run_id).get(timeout=30)
        return meta

    def _control(self, action: str, version: int, **kw) -> events.Control:
        return events.Control(action=action, epoch=version, policy_version=version, run_id=self.cfg.run_id,
                              created_at=events.now_ms(), **kw)

    def sync(self, version: int, location: str, sha256: str, stop: threading.Event | None = None,
             engines: list[str] | None = None) -> SyncReport:
        """Run the protocol of the module docstring for ``version``; returns a :class:`SyncReport`.
        ``engines``: whose answers it waits for (None: ``trainer.engines``; a full-weight candidate
        with ``rollout.canary_engines``: those alone, :meth:`engines_for`)."""
        return self._sync(version, str(location), sha256, stop, {}, None, engines)

    def engines_for(self, candidate: bool) -> list[str]:
        """The engines a full-weight sync waits for: ``rollout.canary_engines`` when rollout is on and
        the version is a ``candidate`` (not the scope's incumbent: the other engines apply it at
        its ``promote``), else every engine of ``trainer.engines``."""
        ro = self.config.rollout
        return list(ro.canary_engines) if candidate and ro.enabled and ro.canary_engines else list(self.cfg.engines)

    def declare(self, version: int, location: str, sha256: str) -> None:
        """A lone full-weight ``weights`` record of ``version`` (recorded as published, no ``pause``,
        no wait, no ``resume``): the folder and sha256 of weights every engine already serves
        (the first incumbent, v0, with ``rollout.enabled``), so a rollback to them has an order to
        re-apply. A syncer applies it like any order (the same weights) and answers ``applied``."""
        self._send(self._control("weights", version, location=str(location), sha256=sha256))
        self._published(version, str(location), sha256)

    def await_applied(self, version: int, offset: int, engines: list[str],
                      stop: threading.Event | None = None) -> SyncReport:
        """Wait (up to ``sync_timeout_s``) for ``applied`` of the full weights' ``version`` from each
        of ``engines``, read on ``control`` from ``offset`` (its ``weights`` order) on, as a sync
        waits for its answers; publishes nothing. The engines outside ``rollout.canary_engines``
        apply a promoted version at its ``promote``: the trainer's next candidate sync waits for
        them first (docs/rollout.md). Returns the report; a silent engine is in ``failed`` (logged)."""
        t0 = time.perf_counter()
        report = SyncReport(version)
        waiting = list(dict.fromkeys(engines))
        if waiting:
            self._await(version, 0, offset, waiting, report, stop)
        self._silent(waiting, report)
        report.seconds = time.perf_counter() - t0
        if report.failed:
            log.warning("v%d (the promoted incumbent): not applied by %s; the next candidate's sync goes on",
                        version, report.failed)
        return report

    def sync_adapter(self, tenant: str, n: int, adapter: dict, location: str, previous: dict | None,
                     stop: threading.Event | None = None) -> SyncReport:
        """The adapter sync of ``tenant``'s update ``n`` (docs/tenants.md, "Adapter sync"): ``pause``
        (tenant, adapter), ``weights`` (``location``, ``sha256 = adapter["sha256"]``), the engines'
        ``applied``/``failed`` for ``adapter["version"]``, ``resume`` naming ``adapter`` when
        every engine applied it, else ``previous`` (the adapter the tenant was served by; with
        ``rollout.enabled`` the scope's incumbent; None: the base). ``epoch = policy_version =
        n``. Returns the report (``resumed`` set)."""
        return self._sync(n, str(location), adapter["sha256"], stop, {"tenant": tenant, "adapter": adapter},
                          previous)

    def resume_adapter(self, tenant: str, n: int, adapter: dict | None) -> None:
        """A lone ``resume`` (tenant, ``adapter``; None: the base model): ``reset`` and ``delete``."""
        self._send(self._control("resume", n, tenant=tenant, adapter=adapter))

    def _sync(self, version: int, location: str, sha256: str, stop: threading.Event | None, about: dict,
              previous: dict | None, engines: list[str] | None = None) -> SyncReport:
        """The one protocol: full weights (``about`` empty) or a tenant's adapter (``about`` names
        ``tenant`` and ``adapter``; ``previous``: what its ``resume`` names if an engine failed);
        ``engines``: whose answers count (None: ``trainer.engines``)."""
        t0 = time.perf_counter()
        report = SyncReport(version)
        self._send(self._control("pause", version, **about))
        try:
            meta = self._send(self._control("weights", version, location=location, sha256=sha256, **about))
            if not about:
                self._published(version, location, sha256)
            waiting = list(dict.fromkeys(self.cfg.engines if engines is None else engines))
            if waiting:
                self._await(version, meta.partition, meta.offset, waiting, report, stop, sha256, about)
            for engine in self._silent(waiting, report):
                self._send(self._control("failed", version, engine_id=engine,
                                         message=f"trainer: {report.failed[engine]}", **about))
        finally:
            if about:
                report.resumed = about["adapter"] if not report.failed and len(report.applied) == len(
                    dict.fromkeys(self.cfg.engines)) else previous
                meta = self._send(self._control("resume", version, tenant=about["tenant"], adapter=report.resumed))
            else:
                meta = self._send(self._control("resume", version))
            report.offset = meta.offset
        report.seconds = time.perf_counter() - t0
        if report.failed:
            log.warning("sync of %s%d: applied by %s, failed on %s", f"{about['tenant']}'s adapter n=" if about
                        else "v", version, report.applied, report.failed)
        return report

    def _silent(self, waiting: list[str], report: SyncReport) -> list[str]:
        """The engines of ``waiting`` that neither applied nor failed: each is put in
        ``report.failed`` as timed out; returns them."""
        silent = [e for e in waiting if e not in report.applied and e not in report.failed]
        for engine in silent:
            report.failed[engine] = f"no answer within {self.cfg.sync_timeout_s:.0f} s"
        return silent

    def _published(self, version: int, location: str, sha256: str) -> None:
        """The broker has the ``weights`` event: record it (gauge, ``published.json``)."""
        from pipeline.trainer import prom

        prom.PUBLISHED_VERSION.set(version)
        try:
            write_published(self.cfg.export_dir, Published(self.cfg.run_id, version, location, sha256,
                                                           events.now_ms()))
        except OSError as e:  # control is the primary record; this one is the fallback
            log.warning("could not write %s: %s", Path(self.cfg.export_dir) / PUBLISHED, e)

    @staticmethod
    def _answers(ev: events.Control, about: dict) -> bool:
        """Whether ``ev`` is about what this sync published: the full weights, or the same tenant's
        same adapter version."""
        if not about:
            return ev.full_weights
        return ev.tenant == about["tenant"] and ev.adapter is not None and \
            ev.adapter["version"] == about["adapter"]["version"]

    def _await(self, version: int, partition: int, offset: int, engines: list[str], report: SyncReport,
               stop: threading.Event | None, sha256: str | None = None, about: dict | None = None) -> None:
        """Collect the engines' answers for ``version``; an answer about other content (another
        ``sha256`` under the same number: an earlier export) is not an answer to this sync."""
        consumer = TopicReader(self.config, self.topic, Offset(offset), partitions=[partition], name="trainer",
                               dlq=True, dlq_give_up_s=DLQ_GIVE_UP_S, stop=stop)
        try:
            deadline = time.monotonic() + self.cfg.sync_timeout_s
            pending = set(engines)
            while pending and time.monotonic() < deadline and not (stop is not None and stop.is_set()):
                for rec in consumer.poll(timeout_ms=200):
                    ev = rec.event
                    # an adapter's answer is matched by tenant and content (its version), not by number
                    if ev.run_id != self.cfg.run_id or (not about and ev.policy_version != version) \
                            or ev.engine_id not in pending or not self._answers(ev, about or {}):
                        continue
                    if sha256 is not None and ev.sha256 is not None and ev.sha256 != sha256:
                        continue
                    if ev.action == "applied":
                        report.applied.append(ev.engine_id)
                        pending.discard(ev.engine_id)
                    elif ev.action == "failed":
                        report.failed[ev.engine_id] = ev.message or "failed"
                        pending.discard(ev.engine_id)
        finally:
            consumer.close()

    def close(self) -> None:
        """Flush and close the producer."""
        self.producer.close()

