"""The rules every Kafka reader of the pipeline shares: decode, check, dead-letter, count, stop.

:class:`RecordIntake` is the one implementation behind both readers of :mod:`pipeline.bus`
(:class:`~pipeline.bus.ConsumerApp` for consumer groups, :class:`~pipeline.bus.TopicReader`
for stages that own their offsets). For each raw record polled from the broker it:

1. decodes it with :func:`pipeline.events.decode` (msgpack, known ``type``, schema version
   ``v``, every field checked);
2. checks that the event's type is one the topic carries: by default the ``values`` of the
   topic in ``topics.yaml`` (a ``sample`` on ``control`` is as wrong as garbage bytes);
3. sends every record that fails 1 or 2 to ``<topic>.dlq`` as a :class:`pipeline.events.DeadLetter`
   (error text, stage, source partition and offset, key, raw bytes) and hands it to no handler.
   A dead letter is *delivered* (the broker acknowledged it) before the reader passes over its
   record. If the dead-letter topic is missing it is created from ``topics.yaml`` first, rather
   than left to the broker's auto-creation (off on most clusters; on Tansu it makes a topic of
   another shape);
4. counts ``pipeline_records_consumed_total``, ``pipeline_dead_letters_total`` and
   ``pipeline_dead_letters_failed_total`` (labels ``stage``, ``topic``).

When the dead letter cannot be delivered (the broker or the DLQ refuses it), the reader's
``dlq_give_up_s`` decides:

- ``None`` (readers whose position is durable: consumer groups, the trainer's checkpointed
  offsets, the syncer): retry with back-off (0.5 s doubling to 5 s) for as long as it takes; the
  record is never passed over without its dead letter. A stop request ends the wait with
  :class:`DeadLetterError`, and the caller leaves the record unconsumed (re-read at restart).
- a number of seconds (followers that commit nothing, such as the proxy's control follower, the
  trainer's sync wait and replay): after that long, log an error naming the record and pass
  over it. The record itself stays in its topic at that offset.

A reader that re-reads a topic from its start (the proxy's control follower does at every
start) dead-letters the same bad record again; dead letters are told apart by ``stage``,
``source_topic``, ``partition`` and ``offset``.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from pipeline import events
from pipeline.bus.producer import EventProducer
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.metrics import DEAD_LETTER_FAILURES, DEAD_LETTERS, RECORDS_CONSUMED

log = logging.getLogger(__name__)


class DeadLetterError(PipelineError, RuntimeError):
    """A dead letter could not be delivered and the reader was stopped while retrying.

    The source record was not passed over: the caller must not consume or commit past it.
    """


class WrongTopic(events.EventError):
    """A valid event of a type its topic does not carry (e.g. a ``sample`` on ``control``)."""


class _Declared:
    def __repr__(self) -> str:
        return "DECLARED"


DECLARED = _Declared()
"""``accept=DECLARED``: the event types a topic carries are those listed in ``topics.yaml``."""


@dataclass
class Record:
    """A decoded record as handed to a stage (``event`` is the validated event).

    ``timestamp_ms``: the record's broker timestamp (ms since the epoch). ``value``: the raw
    bytes (for a dead letter written by the stage itself). ``generation``: the consumer
    group assignment it was polled under (:class:`~pipeline.bus.ConsumerApp` ignores
    acknowledgements from an older one; 0 for assigned readers).
    """

    topic: str
    partition: int
    offset: int
    key: str | None
    event: events.Event
    timestamp_ms: int
    generation: int = 0
    value: bytes = field(default=b"", repr=False, compare=False)

    @property
    def tp(self) -> tuple[str, int]:
        """``(topic, partition)``."""
        return (self.topic, self.partition)


def stop_on_signals(stop: Callable[[], None]) -> bool:
    """Call ``stop()`` on SIGTERM and SIGINT (only possible from the main thread).

    Returns True when the handlers were installed.
    """
    if threading.current_thread() is not threading.main_thread():
        return False
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop())
    return True


class IntakeCounts:
    """The counts of a reader that hands its records to ``self.intake`` (a :class:`RecordIntake`):
    mixed into :class:`~pipeline.bus.ConsumerApp` and :class:`~pipeline.bus.TopicReader`."""

    intake: "RecordIntake"

    @property
    def consumed(self) -> int:
        """Records polled so far."""
        return self.intake.consumed

    @property
    def dead_lettered(self) -> int:
        """Records sent to the DLQ so far (undecodable, of a type the topic does not carry, or
        rejected by the stage: a handler that raised)."""
        return self.intake.dead_lettered


class RecordIntake:
    """Decode, check, dead-letter and count the records of one stage (see the module docstring).

    Args:
        config: the process config (``kafka``, ``topics``).
        name: the stage name (metrics labels, logs, the dead letters' ``stage``).
        producer: an :class:`~pipeline.bus.EventProducer` for dead letters (default: one is made
            on the first dead letter and closed by :meth:`close`).
        dlq: False raises the :class:`pipeline.events.EventError` instead of dead-lettering (for
            readers that write nothing: :class:`~pipeline.bus.TopicReader` in observer mode
            returns it as :class:`~pipeline.bus.Undecodable`; never a production stage).
        accept: the event classes the topics may carry: ``DECLARED`` (``topics.yaml``; a topic
            not declared there takes any event), ``None`` (any), or a tuple of classes.
        dlq_give_up_s: None: retry an undeliverable dead letter until delivered or stopped;
            seconds: give up after that long (see the module docstring).
        stop: the owner's stop flag; it ends a dead-letter retry.
    """

    def __init__(self, config: Config, name: str, *, producer=None, dlq: bool = True, accept=DECLARED,
                 dlq_give_up_s: float | None = None, stop: threading.Event | None = None) -> None:
        self.config = config
        self.name = name
        self.dlq = dlq
        self.accept = accept
        self.dlq_give_up_s = dlq_give_up_s
        self.stop = stop if stop is not None else threading.Event()
        self._producer = producer
        self._own_producer = producer is None
        self._accepted: dict[str, tuple[type, ...] | None] = {}
        self._dlq_ready: set[str] = set()
        self.consumed = 0
        self.dead_lettered = 0
        self.dead_letter_failures = 0

    # ---- counting -------------------------------------------------------------------------------
    def polled(self, topic: str, n: int) -> None:
        """Count ``n`` records polled from ``topic``."""
        if n:
            self.consumed += n
            RECORDS_CONSUMED.labels(self.name, topic).inc(n)

    # ---- decoding -------------------------------------------------------------------------------
    def accepted_types(self, topic: str) -> tuple[type, ...] | None:
        """The event classes ``topic`` (a physical name) may carry; None: any."""
        if self.accept is None:
            return None
        if not isinstance(self.accept, _Declared):
            return tuple(self.accept)
        if topic not in self._accepted:
            spec = _declared_spec(self.config, topic)
            self._accepted[topic] = (tuple(events.EVENT_TYPES[v] for v in spec.values)
                                     if spec is not None and spec.values else None)
        return self._accepted[topic]

    def check(self, topic: str, data) -> events.Event:
        """Decode ``data`` and check its type against ``topic``.

        Raises:
            pipeline.events.EventError: undecodable, invalid, unknown schema version, or
                :class:`WrongTopic` (an event type the topic does not carry).
        """
        ev = events.decode(data)
        allowed = self.accepted_types(topic)
        if allowed is not None and not isinstance(ev, allowed):
            names = ", ".join(c.TYPE for c in allowed)
            raise WrongTopic(f"a {ev.TYPE!r} event does not belong on {topic} (it carries {names})")
        return ev

    def decode(self, raw, generation: int = 0, stop: threading.Event | None = None) -> Record | None:
        """A :class:`Record` for the kafka-python record ``raw``, or None when it was dead-lettered.

        Raises:
            DeadLetterError: the dead letter could not be delivered before a stop request.
            pipeline.events.EventError: the record is bad and this intake has ``dlq=False``.
        """
        try:
            ev = self.check(raw.topic, raw.value)
        except events.EventError as e:
            if not self.dlq:
                raise
            self.dead_letter(raw, f"{type(e).__name__}: {e}", stop=stop)
            return None
        key = raw.key.decode("utf-8", "replace") if raw.key is not None else None
        return Record(raw.topic, raw.partition, raw.offset, key, ev, raw.timestamp, generation, raw.value or b"")

    # ---- dead letters ---------------------------------------------------------------------------
    def dead_letter(self, rec, error: str, stop: threading.Event | None = None) -> bool:
        """Write ``rec`` (a kafka-python record or a :class:`Record`) to ``<topic>.dlq``.

        Returns True once the broker has the dead letter; False when it gave up after
        ``dlq_give_up_s`` (logged as an error and counted).

        Raises:
            DeadLetterError: ``dlq_give_up_s`` is None and a stop was requested while retrying.
            pipeline.events.MalformedEvent: this intake has ``dlq=False``.
        """
        if not self.dlq:
            raise events.MalformedEvent(error)
        key = rec.key if isinstance(rec.key, (bytes, type(None))) else rec.key.encode()
        raw = rec.value or b""
        dl = events.DeadLetter(source_topic=rec.topic, partition=rec.partition, offset=rec.offset,
                               error=error[:4000], stage=self.name, key=key, raw=bytes(raw),
                               created_at=events.now_ms())
        target = self.dlq_topic(rec.topic)
        where = f"{rec.topic}[{rec.partition}]@{rec.offset}"
        t0 = time.monotonic()
        delay = 0.5
        while True:
            try:
                self._ensure_dlq(target)
                if self._producer is None:
                    self._producer = EventProducer(self.config, name=self.name)
                self._producer.send(target, dl, key=key.decode("utf-8", "replace") if key else None).get(timeout=30)
                break
            except Exception as e:  # noqa: BLE001 - every failure of the DLQ path is retried or reported
                failure = f"{type(e).__name__}: {e}"
            self.dead_letter_failures += 1
            DEAD_LETTER_FAILURES.labels(self.name, rec.topic).inc()
            stopped = self.stop.is_set() or (stop is not None and stop.is_set())
            if self.dlq_give_up_s is not None and (stopped or time.monotonic() - t0 + delay > self.dlq_give_up_s):
                log.error("%s: could not dead-letter %s (%s); passing over it (it stays in %s at that "
                          "offset): %s", self.name, where, failure, rec.topic, error)
                return False
            if stopped:
                raise DeadLetterError(f"{self.name}: dead letter of {where} not delivered ({failure}); "
                                      "stopped before it could be")
            log.error("%s: could not dead-letter %s (%s); retrying in %.1f s", self.name, where, failure, delay)
            self._wait(delay, stop)
            delay = min(delay * 2, 5.0)
        self.dead_lettered += 1
        DEAD_LETTERS.labels(self.name, rec.topic).inc()
        log.warning("%s: %s -> %s: %s", self.name, where, target, error)
        return True

    def dlq_topic(self, topic: str) -> str:
        """The dead-letter topic of a physical topic name (``<topic><dlq_suffix>``)."""
        return f"{topic}{self.config.topics.dlq_suffix}"

    def _wait(self, seconds: float, stop: threading.Event | None) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end and not self.stop.is_set() and not (stop is not None and stop.is_set()):
            time.sleep(min(0.05, max(0.0, end - time.monotonic())))

    def _ensure_dlq(self, target: str) -> None:
        if target in self._dlq_ready:
            return
        ensure_dlq_topic(self.config, target)
        self._dlq_ready.add(target)

    def close(self) -> None:
        """Close the dead-letter producer if this intake made it."""
        if self._own_producer and self._producer is not None:
            self._producer.close()
            self._producer = None


# ---- topics.yaml lookups -------------------------------------------------------------------------
_SPECS: dict[str, dict] = {}


def _specs(config: Config) -> dict:
    path = str(config.topics.file)
    if path not in _SPECS:
        from pipeline.topics import TopicsError, load_topics

        try:
            _SPECS[path] = {s.name: s for s in load_topics(path)}
        except TopicsError as e:
            log.warning("event types are not checked against topics: %s", e)
            _SPECS[path] = {}
    return _SPECS[path]


def _declared_spec(config: Config, topic: str):
    """The ``topics.yaml`` spec of a physical topic name (prefix removed), or None."""
    prefix = config.topics.prefix
    if prefix and not topic.startswith(prefix):
        return None
    return _specs(config).get(topic[len(prefix):])


def ensure_dlq_topic(config: Config, target: str) -> bool:
    """Create the dead-letter topic ``target`` (physical) if the broker lacks it; True if created.

    Its partitions and configs come from ``topics.yaml`` when declared there, else one
    partition with the shape of the first declared dead-letter topic.

    Raises:
        pipeline.topics.TopicsError: the broker refused the creation.
        kafka.errors.KafkaError: the broker could not be reached.
    """
    from pipeline.bus.admin import create_topic_if_missing

    spec = _declared_spec(config, target)
    if spec is None:
        like = next((s for n, s in _specs(config).items() if n.endswith(config.topics.dlq_suffix)), None)
        parts, rf, cfg = (1, like.replication_factor, like.config) if like else (1, 1, {})
    else:
        parts, rf, cfg = spec.partitions, spec.replication_factor, spec.config
    if not create_topic_if_missing(config, target, parts, rf, cfg, what="dead-letter topic"):
        return False
    log.info("created dead-letter topic %s (%d partitions)", target, parts)
    return True


