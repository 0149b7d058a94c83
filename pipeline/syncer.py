"""``python -m pipeline syncer --engine URL``: apply published weights to one engine replica.

Runs beside each engine replica (Kubernetes: a sidecar). It reads ``control`` from the offsets
committed by its own consumer group (``syncer.group_id``, default ``syncer-<engine_id>``;
assigned, never joined: one syncer per engine) and, for each ``weights`` event of its run:

1. verifies the sha256 of ``<location>/model.safetensors`` against the event (a torn or
   half-copied folder is never loaded);
2. calls the engine's ``POST /update_weights_from_disk`` with ``model_path = location`` and
   ``weight_version = str(policy_version)`` (through :class:`pipeline.client.EngineClient`),
   retrying ``syncer.retries`` times with exponential back-off from ``syncer.retry_backoff_s``;
3. publishes ``applied`` (engine_id, policy_version) or ``failed`` (with the last error).

If the engine already reports that version (``/model_info`` ``weight_version``), nothing is
reloaded and ``applied`` is published again (idempotent after a syncer restart). When several
``weights`` events are waiting (catching up after downtime) only the newest is applied. The
offset is committed after the answer is published. Records that are not valid ``control``
events go to ``control.dlq`` (:class:`pipeline.bus.TopicReader`; the offset is committed only
once the dead letter is delivered). ``pause``/``resume`` need no action here:
the engine lets in-flight requests finish on the old weights during the swap (SGLANG_API.md
3.1), and the proxy holds new requests while paused.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import threading
import time
from pathlib import Path

from pipeline import events
from pipeline.config import Config

log = logging.getLogger("pipeline.syncer")

HELP = "apply published weights (control topic) to one engine replica via /update_weights_from_disk"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine URL``, ``--engine-id``, ``--group-id``."""
    parser.add_argument("--engine", dest="engine_url", help="engine base URL (syncer.engine_url; default engine.url)")
    parser.add_argument("--engine-id", help="this replica's id in applied/failed reports (syncer.engine_id)")
    parser.add_argument("--group-id", help="consumer group (default syncer-<engine_id>)")


def run(args: argparse.Namespace, config: Config) -> int:
    """Apply the flags to ``config.syncer`` and run the :class:`Syncer` until SIGTERM/SIGINT."""
    s = config.syncer
    if args.engine_url:
        s.engine_url = args.engine_url
    if args.engine_id:
        s.engine_id = args.engine_id
    if args.group_id:
        s.group_id = args.group_id
    from pipeline.metrics import serve_metrics

    serve_metrics(config.metrics_port)
    syncer = Syncer(config)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: syncer.stop.set())
    syncer.run()
    return 0


class Syncer:
    """One engine replica's weight syncer (see the module docstring).

    Args:
        config: ``syncer`` section (engine id/url, retries, back-off), ``trainer.run_id``
            (``syncer.run_id`` overrides it), ``kafka``/``topics``.
        stop: set it to finish the current apply and exit :meth:`run`.
    """

    def __init__(self, config: Config, stop: threading.Event | None = None) -> None:
        self.config = config
        self.cfg = config.syncer
        self.engine_id = self.cfg.engine_id
        self.url = self.cfg.engine_url or config.engine.url
        self.run_id = self.cfg.run_id or config.trainer.run_id
        self.group_id = self.cfg.group_id or f"syncer-{self.engine_id}"
        self.topic = config.topics.name("control")
        self.stop = stop or threading.Event()
        self.applied: list[int] = []  # versions applied by this process (for tests and logs)
        self.failed: list[int] = []
        self.ready = threading.Event()  # set once the consumer has its assignment

    # ------------------------------------------------------------ engine side

    async def _apply_async(self, location: str, version: int) -> str:
        from pipeline.client import EngineClient

        api_key = self.config.engine.api_key.get_secret_value() if self.config.engine.api_key else None
        async with EngineClient(self.url, timeout_s=self.cfg.apply_timeout_s, api_key=api_key) as eng:
            try:
                if await eng.weight_version() == str(version):
                    return "already serving"
            except Exception:  # noqa: BLE001 - fall through to the update, which reports properly
                pass
            out = await eng.update_weights_from_disk(location, weight_version=str(version))
            return str(out.get("message", "ok"))

    def apply(self, ev: events.Control) -> tuple[bool, str]:
        """Verify and apply one ``weights`` event with retries. Returns ``(ok, message)``."""
        from pipeline.trainer.checksum import verify_folder

        delay = self.cfg.retry_backoff_s
        last = ""
        for attempt in range(self.cfg.retries + 1):
            if attempt:
                if self.stop.wait(delay):
                    return False, f"stopped while retrying: {last}"
                delay *= 2
            t0 = time.perf_counter()
            try:
                if not Path(ev.location).is_dir():
                    raise FileNotFoundError(f"weights folder {ev.location} not found")
                verify_folder(ev.location, ev.sha256)
                msg = asyncio.run(self._apply_async(ev.location, ev.policy_version))
                log.info("%s: v%d applied in %.2f s (%s)", self.engine_id, ev.policy_version,
                         time.perf_counter() - t0, msg)
                return True, msg
            except Exception as e:  # noqa: BLE001 - every failure is retried, then reported
                last = f"{type(e).__name__}: {e}"
                log.warning("%s: apply of v%d failed (attempt %d/%d): %s", self.engine_id, ev.policy_version,
                            attempt + 1, self.cfg.retries + 1, last)
        return False, last

    # ------------------------------------------------------------ Kafka side

    def _publish(self, producer, action: str, ev: events.Control, message: str = "") -> None:
        out = events.Control(action=action, epoch=ev.epoch, policy_version=ev.policy_version, run_id=self.run_id,
                             engine_id=self.engine_id, location=ev.location, sha256=ev.sha256,
                             message=message[:2000], created_at=events.now_ms())
        producer.send(self.topic, out, key=self.run_id).get(timeout=30)

    def run(self) -> None:
        """Consume ``control`` and apply ``weights`` events until :attr:`stop` is set."""
        from pipeline.bus import DeadLetterError, EventProducer, TopicReader
        from pipeline.trainer import prom

        consumer = TopicReader(self.config, self.topic, "committed", name=f"syncer-{self.engine_id}",
                               group_id=self.group_id, dlq=True, stop=self.stop)
        producer = EventProducer(self.config, name=f"syncer-{self.engine_id}")
        self.ready.set()
        log.info("syncer %s -> %s (group %s, run %s)", self.engine_id, self.url, self.group_id, self.run_id)
        try:
            while not self.stop.is_set():
                polled = consumer.poll_raw(timeout_ms=500)
                if not polled:
                    continue
                latest: events.Control | None = None
                ends: dict[int, int] = {}
                more = polled
                while more:  # drain what is already there: only the newest weights matter
                    for rec in more:
                        got = consumer.decode(rec)  # a bad record goes to control.dlq first
                        ends[rec.partition] = rec.offset + 1
                        ev = got.event if got is not None else None
                        if isinstance(ev, events.Control) and ev.action == "weights" and ev.run_id == self.run_id:
                            if latest is not None:
                                log.info("%s: v%d superseded by v%d", self.engine_id, latest.policy_version,
                                         ev.policy_version)
                            latest = ev
                    more = consumer.poll_raw(timeout_ms=0)
                if latest is not None:
                    t0 = time.perf_counter()
                    ok, msg = self.apply(latest)
                    prom.SYNCER_SECONDS.observe(time.perf_counter() - t0)
                    (prom.SYNCER_APPLIED if ok else prom.SYNCER_FAILED).inc()
                    (self.applied if ok else self.failed).append(latest.policy_version)
                    self._publish(producer, "applied" if ok else "failed", latest, msg)
                consumer.commit(ends)
        except DeadLetterError as e:  # stopped while a dead letter was undeliverable: not committed past it
            log.warning("%s", e)
        finally:
            try:
                consumer.close()
            finally:
                producer.close()
