"""Idempotent event producer with a bounded in-flight buffer and delivery accounting."""

from __future__ import annotations

import logging
import threading
from typing import Callable

from kafka import KafkaProducer
from kafka.errors import KafkaTimeoutError

from pipeline import events
from pipeline.bus.settings import producer_kwargs
from pipeline.config import Config
from pipeline.metrics import EVENTS_FAILED, EVENTS_PRODUCED, PRODUCER_BUFFERED
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)


class BufferFull(PipelineError, RuntimeError):
    """More than ``max_pending`` events are unacknowledged and none freed within the wait."""


#: what :meth:`EventProducer.send` raises when it did not queue the record, which may be sent
#: again later: the bound on unacknowledged events stayed full (:class:`BufferFull`), or the
#: topic's metadata did not come within ``max_block_ms`` (kafka-python's ``KafkaTimeoutError``).
NOT_QUEUED: tuple[type[Exception], ...] = (BufferFull, KafkaTimeoutError)


class EventProducer:
    """Publish :class:`pipeline.events.Event` values (or pre-encoded bytes) to Kafka.

    Settings: ``acks=all``, idempotence on (no duplicates from internal retries, per-partition
    order kept), compression from config, unlimited retries within ``delivery_timeout_ms``.
    At most ``max_pending`` events may be sent-but-unacknowledged; :meth:`send` waits up to
    ``block_s`` for room and then raises :class:`BufferFull` (callers that must never block,
    like the proxy, keep their own queue in front). Delivered/failed events are counted in
    ``pipeline_events_produced_total`` / ``pipeline_events_failed_total`` labelled by ``name``.

    Args:
        config: the process config (``kafka`` section).
        name: the stage name used in metrics and logs.
        max_pending: bound on unacknowledged events.
    """

    def __init__(self, config: Config, name: str, max_pending: int = 100_000, **overrides) -> None:
        self.name = name
        self._producer = KafkaProducer(**{**producer_kwargs(config), **overrides})
        self._slots = threading.BoundedSemaphore(max_pending)
        self._pending = 0
        self._lock = threading.Lock()
        self.delivered = 0
        self.failed = 0

    def send(self, topic: str, event: events.Event | bytes, key: str | None = None,
             headers: list[tuple[str, bytes]] | None = None, block_s: float = 5.0,
             on_delivery: Callable[[Exception | None], None] | None = None):
        """Send one event; returns kafka-python's future (``.get(timeout)`` for the metadata).

        Raises:
            BufferFull: the in-flight bound was hit for ``block_s`` seconds.
            pipeline.events.MalformedEvent: the event fails validation.
            kafka.errors.KafkaTimeoutError: metadata for ``topic`` was unavailable for ``max_block_ms``.
        """
        value = event if isinstance(event, (bytes, bytearray)) else events.encode(event)
        if not self._slots.acquire(timeout=block_s):
            raise BufferFull(f"{self.name}: producer buffer full ({self._pending} events unacknowledged)")
        with self._lock:
            self._pending += 1
        PRODUCER_BUFFERED.labels(self.name).set(self._pending)
        try:
            fut = self._producer.send(topic, value=bytes(value), key=key.encode() if key is not None else None,
                                      headers=headers)
        except Exception:
            self._release()
            raise

        def ok(_meta):
            self._release()
            self.delivered += 1
            EVENTS_PRODUCED.labels(self.name, topic).inc()
            if on_delivery:
                on_delivery(None)

        def err(exc):
            self._release()
            self.failed += 1
            EVENTS_FAILED.labels(self.name, topic).inc()
            log.error("%s: delivery to %s failed: %s", self.name, topic, exc)
            if on_delivery:
                on_delivery(exc)

        fut.add_callback(ok)
        fut.add_errback(err)
        return fut

    def _release(self) -> None:
        with self._lock:
            self._pending -= 1
        self._slots.release()
        PRODUCER_BUFFERED.labels(self.name).set(self._pending)

    @property
    def pending(self) -> int:
        """Events sent but not yet acknowledged by the broker."""
        return self._pending

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every sent event is acknowledged or failed (``timeout_s`` None: forever)."""
        self._producer.flush(timeout=timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush and close the underlying producer."""
        try:
            self._producer.flush(timeout=timeout_s)
        finally:
            self._producer.close(timeout=timeout_s)
