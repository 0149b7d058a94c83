"""Assign-mode reading: chosen partitions from chosen offsets, no consumer group membership.

One reader, :class:`TopicReader`, for two kinds of users:

- **stages that own their offsets** (``dlq=True``): the trainer (offsets in its checkpoints),
  the followers of ``control`` (the proxy reads it from offset 0, the trainer's sync wait from
  its own ``weights`` record, the syncer from its group's commit) and replay (a time or offset
  range). Bad records go through the same :class:`~pipeline.bus.records.RecordIntake` as
  :class:`~pipeline.bus.ConsumerApp`'s: decoded, type-checked against ``topics.yaml``,
  dead-lettered to ``<topic>.dlq`` (delivered before the reader passes over them), counted;
  :meth:`TopicReader.poll` returns only good :class:`Record` s.
- **observers** (``dlq=False``, the default): ``pipeline tail``, the dashboard, reports. They
  must not change what the stages see, so nothing is ever written: a bad record comes back as
  :class:`Undecodable` with the error. No group is joined or created, nothing is committed.

Start positions (``start``): ``"beginning"``, ``"end"`` (only what arrives from now on),
``"committed"`` (the offsets ``group_id`` committed; the beginning where there are none),
:class:`Offset` (one offset for every partition, or per partition, the others starting per
``Offset.otherwise``) or :class:`Time` (the first record whose timestamp is at or after ``ms``).
Records older than an ``"end"``/``Time`` start are also dropped client-side, so a broker whose
end-offset or time look-up is off (Tansu: its end offset is the last record's, and a time past
the end answers offset 0) still yields exactly the records from the start point on. The broker
clamps an offset that no longer exists to the beginning of the log.

Typical stage loop::

    with TopicReader(config, config.topics.name("control"), name="proxy", partitions=[0],
                     start=Offset(0), dlq=True, dlq_give_up_s=10) as reader:
        while not reader.stopping:
            for rec in reader.poll(timeout_ms=300):
                apply(rec.event)

A stage that needs exact positions around records it has not handed on yet (the trainer keeps a
buffer across batches) uses :meth:`TopicReader.poll_raw` and decodes each record with
:meth:`TopicReader.decode` when it takes it.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Union

from kafka import KafkaConsumer
from kafka.structs import OffsetAndMetadata, TopicPartition

from pipeline import events
from pipeline.bus.records import DECLARED, IntakeCounts, RecordIntake, stop_on_signals
from pipeline.bus.settings import consumer_kwargs
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.metrics import CONSUMER_LAG

log = logging.getLogger(__name__)


class TopicMissing(PipelineError, LookupError):
    """A topic has no partitions on the broker (it does not exist)."""


@dataclass(frozen=True)
class Offset:
    """Start every partition at ``offset``, or partition ``p`` at ``per_partition[p]`` when given;
    partitions not in ``per_partition`` start per ``otherwise`` (``beginning``, ``end`` or
    ``committed``). The broker clamps an offset that no longer exists to the beginning."""

    offset: int = 0
    per_partition: dict[int, int] | None = None
    otherwise: str = "beginning"

    def for_partition(self, partition: int) -> int | None:
        """The start offset of ``partition`` (None: start per ``otherwise``)."""
        if self.per_partition is not None:
            return self.per_partition.get(partition)
        return self.offset


@dataclass(frozen=True)
class Time:
    """Start at the first record whose timestamp is ``>= ms`` (milliseconds since the epoch)."""

    ms: int


Start = Union[str, Offset, Time]
_NAMED = ("beginning", "end", "committed")


@dataclass
class Undecodable:
    """A record an observer could not read as an event of its topic (``error`` says why)."""

    topic: str
    partition: int
    offset: int
    key: str | None
    error: str
    timestamp_ms: int
    size: int

    @property
    def tp(self) -> tuple[str, int]:
        """``(topic, partition)``."""
        return (self.topic, self.partition)


class TopicReader(IntakeCounts):
    """Assign-mode reader of one or more topics (see the module docstring).

    Args:
        config: the process config (``kafka``, ``topics``).
        topics: a physical topic name or several. A topic that does not exist yet is picked up
            by :meth:`refresh` once it does (unless ``wait_s`` makes its absence an error).
        start: ``"beginning"`` (default), ``"end"``, ``"committed"``, :class:`Offset` or :class:`Time`.
        partitions: read only these partition numbers (default: all).
        name: the reader's stage name (metrics labels, logs, the dead letters' ``stage``).
        group_id: a consumer group whose committed offsets ``"committed"`` starts from and
            :meth:`commit` writes (never joined: no rebalancing, no membership).
        dlq: True for stages (bad records dead-lettered, never returned); False for observers
            (bad records returned as :class:`Undecodable`, nothing written).
        accept / dlq_give_up_s / producer: see :class:`~pipeline.bus.records.RecordIntake`.
        stop: a stop flag shared with the owner (default: a new one; :meth:`stop` sets it); it
            also ends a dead-letter retry.
        wait_s: wait up to this long for every topic to exist, then raise :class:`TopicMissing`
            (default: don't wait).
        consumer_overrides: extra kafka-python consumer settings.

    Raises:
        TopicMissing: a topic did not appear within ``wait_s``.
        ValueError: an unknown ``start``, or ``"committed"`` without ``group_id``.
        kafka.errors.NoBrokersAvailable: the broker is unreachable.
    """

    def __init__(self, config: Config, topics: str | Iterable[str], start: Start = "beginning",
                 partitions: Iterable[int] | None = None, *, name: str = "reader", group_id: str | None = None,
                 dlq: bool = False, accept=DECLARED, dlq_give_up_s: float | None = None, producer=None,
                 stop: threading.Event | None = None, wait_s: float | None = None, **consumer_overrides) -> None:
        if not (start in _NAMED or isinstance(start, (Offset, Time))):
            raise ValueError(f"start must be 'beginning', 'end', 'committed', Offset(n) or Time(ms), got {start!r}")
        otherwise = start.otherwise if isinstance(start, Offset) else None
        if otherwise is not None and otherwise not in _NAMED:
            raise ValueError(f"Offset.otherwise must be one of {_NAMED}, got {otherwise!r}")
        if "committed" in (start, otherwise) and group_id is None:
            raise ValueError("starting from committed offsets needs a group_id")
        self.config, self.name, self.group_id = config, name, group_id
        self.topics = [topics] if isinstance(topics, str) else list(dict.fromkeys(topics))
        self.start = start
        self.dlq = dlq
        self._only = set(partitions) if partitions is not None else None
        self._min_ts = start.ms if isinstance(start, Time) else (events.now_ms() if start == "end" else None)
        self._stop = stop if stop is not None else threading.Event()
        self.intake = RecordIntake(config, name, producer=producer, dlq=dlq, accept=accept,
                                   dlq_give_up_s=dlq_give_up_s, stop=self._stop)
        self.consumer = KafkaConsumer(**consumer_kwargs(config, group_id, **consumer_overrides))
        self._assigned: list[TopicPartition] = []
        try:
            self.refresh()
            if wait_s is not None:
                self._wait_for_topics(wait_s)
        except BaseException:
            self.consumer.close(autocommit=False)
            raise

    # ---- assignment -----------------------------------------------------------------------------
    def refresh(self) -> list[TopicPartition]:
        """Assign partitions of the topics that appeared since the last call; returns the new ones."""
        known = set(self._assigned)
        new: list[TopicPartition] = []
        for topic in self.topics:
            for p in sorted(self.consumer.partitions_for_topic(topic) or ()):
                tp = TopicPartition(topic, p)
                if tp not in known and (self._only is None or p in self._only):
                    new.append(tp)
        if not new:
            return []
        self.consumer.assign(self._assigned + new)
        self._seek(new)
        self._assigned += new
        return new

    def _wait_for_topics(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            missing = [t for t in self.topics if not any(tp.topic == t for tp in self._assigned)]
            if not missing:
                return
            if time.monotonic() > deadline or self._stop.is_set():
                raise TopicMissing(f"topic {missing[0]!r} has no partitions on "
                                   f"{self.config.kafka.bootstrap_servers} (does it exist?)")
            self.consumer.topics()  # refresh metadata
            time.sleep(0.2)
            self.refresh()

    def _seek(self, tps: list[TopicPartition]) -> None:
        start = self.start
        if isinstance(start, Time):
            found = self.consumer.offsets_for_times({tp: start.ms for tp in tps})
            for tp in tps:
                hit = found.get(tp)
                if hit is None or hit.timestamp < 0:  # nothing at or after the time
                    self.consumer.seek_to_end(tp)
                else:
                    self.consumer.seek(tp, hit.offset)
            return
        for tp in tps:
            how = start
            if isinstance(start, Offset):
                o = start.for_partition(tp.partition)
                if o is not None:
                    self.consumer.seek(tp, max(0, int(o)))
                    continue
                how = start.otherwise
            if how == "committed":
                committed = self.consumer.committed(tp)
                if committed is not None:
                    self.consumer.seek(tp, int(committed))
                    continue
                how = "beginning"
            if how == "end":
                self.consumer.seek_to_end(tp)
            else:
                self.consumer.seek_to_beginning(tp)

    def assignment(self) -> list[tuple[str, int]]:
        """``(topic, partition)`` pairs being read."""
        return [(tp.topic, tp.partition) for tp in self._assigned]

    @property
    def partitions(self) -> list[int]:
        """The partition numbers being read (of every topic)."""
        return sorted({tp.partition for tp in self._assigned})

    # ---- reading --------------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 200) -> list:
        """The records fetched within ``timeout_ms``, in offset order per partition.

        Stages (``dlq=True``) get only :class:`Record` s (bad records were dead-lettered);
        observers get :class:`Record` and :class:`Undecodable` items.

        Raises:
            pipeline.bus.records.DeadLetterError: stopped while a dead letter could not be
                delivered (that record and the rest of this poll are not handed on).
        """
        out = []
        for raw in self.poll_raw(timeout_ms):
            rec = self.decode(raw)
            if rec is not None:
                out.append(rec)
        return out

    def poll_raw(self, timeout_ms: int = 200) -> list:
        """kafka-python records as polled (counted in the metrics, lag updated), not decoded.
        Records older than an ``"end"``/:class:`Time` start are left out."""
        if not self._assigned:
            self.refresh()
            if not self._assigned:
                time.sleep(timeout_ms / 1000)
                return []
        batch = self.consumer.poll(timeout_ms=timeout_ms)
        out = []
        for tp, recs in batch.items():
            self.intake.polled(tp.topic, len(recs))
            if self._min_ts is not None:
                recs = [r for r in recs if r.timestamp >= self._min_ts]
            out.extend(recs)
        if batch:
            for tp in batch:
                hw = self.consumer.highwater(tp)
                if hw is not None:
                    CONSUMER_LAG.labels(self.name, tp.topic, str(tp.partition)).set(
                        max(0, hw - self.consumer.position(tp)))
        return out

    def decode(self, raw, stop: threading.Event | None = None):
        """A record from :meth:`poll_raw` as a :class:`Record`; for a bad record None once it is
        dead-lettered (stages) or an :class:`Undecodable` (observers). See
        :meth:`RecordIntake.decode <pipeline.bus.records.RecordIntake.decode>` for the errors."""
        if self.dlq:
            return self.intake.decode(raw, stop=stop)
        try:
            return self.intake.decode(raw)
        except events.EventError as e:
            key = raw.key.decode("utf-8", "replace") if raw.key is not None else None
            return Undecodable(raw.topic, raw.partition, raw.offset, key, f"{type(e).__name__}: {e}", raw.timestamp,
                               len(raw.value or b""))

    def dead_letter(self, rec, error: str, stop: threading.Event | None = None) -> bool:
        """Dead-letter a record the stage itself rejects (see :meth:`RecordIntake.dead_letter
        <pipeline.bus.records.RecordIntake.dead_letter>`)."""
        return self.intake.dead_letter(rec, error, stop=stop)

    def read(self, follow: bool = False, idle_timeout_s: float = 3.0, stop: threading.Event | None = None,
             poll_timeout_ms: int = 200) -> Iterator:
        """Yield records (as :meth:`poll` returns them) from the start position.

        ``follow``: keep waiting for new records until ``stop`` (or :meth:`stop`) is set.
        Otherwise stop once caught up with the high watermarks, or after ``idle_timeout_s``
        without a record (a topic that does not exist, a broker that reports no watermark).
        """
        last = refreshed = time.monotonic()
        while not self.stopping and (stop is None or not stop.is_set()):
            batch = self.poll(poll_timeout_ms)
            if batch:
                last = time.monotonic()
                yield from batch
                continue
            if follow:
                if time.monotonic() - refreshed > 5.0:
                    refreshed = time.monotonic()
                    self.refresh()
                continue
            if self.caught_up() or time.monotonic() - last > idle_timeout_s:
                return

    # ---- positions (partition numbers of a single-topic reader) ---------------------------------
    def _tp(self, partition: int) -> TopicPartition:
        if len(self.topics) != 1:
            raise ValueError(f"{self.name}: partition-level calls need a single-topic reader, not {self.topics}")
        return TopicPartition(self.topics[0], partition)

    def seek(self, partition: int, offset: int) -> None:
        """Read ``partition`` from ``offset`` next."""
        self.consumer.seek(self._tp(partition), offset)

    def seek_to_end(self, partition: int) -> None:
        """Read only records produced after now from ``partition``."""
        self.consumer.seek_to_end(self._tp(partition))

    def position(self, partition: int) -> int:
        """The offset of the next record of ``partition`` that :meth:`poll_raw` will return."""
        return int(self.consumer.position(self._tp(partition)))

    def positions(self) -> dict[int, int]:
        """:meth:`position` of every assigned partition."""
        return {p: self.position(p) for p in self.partitions}

    def committed(self) -> dict[int, int | None]:
        """The offsets ``group_id`` has committed, per partition (None: none), asked of the broker now."""
        if self.group_id is None:
            raise ValueError(f"{self.name}: committed offsets need a group_id")
        return {p: self.consumer.committed(self._tp(p)) for p in self.partitions}

    def commit(self, offsets: dict[int, int]) -> None:
        """Commit ``{partition: next offset}`` for ``group_id``.

        Raises:
            kafka.errors.KafkaError: the commit failed.
            ValueError: the reader has no ``group_id``.
        """
        if self.group_id is None:
            raise ValueError(f"{self.name}: commit needs a group_id")
        self.consumer.commit({self._tp(p): OffsetAndMetadata(int(o), "", -1) for p, o in offsets.items()})

    def beginning_offsets(self) -> dict[int, int]:
        """The first offset still in the log, per assigned partition."""
        got = self.consumer.beginning_offsets([self._tp(p) for p in self.partitions])
        return {tp.partition: int(o) for tp, o in got.items()}

    def offsets_for_times(self, time_ms: int) -> dict:
        """kafka-python's ``offsets_for_times`` per assigned partition (``{partition: OffsetAndTimestamp | None}``)."""
        got = self.consumer.offsets_for_times({self._tp(p): time_ms for p in self.partitions})
        return {tp.partition: v for tp, v in got.items()}

    def highwater(self, partition: int) -> int | None:
        """The partition's high watermark as of the last fetch (None before one)."""
        return self.consumer.highwater(self._tp(partition))

    def pause(self, *partitions: int) -> None:
        """Stop fetching ``partitions``."""
        self.consumer.pause(*(self._tp(p) for p in partitions))

    # ---- progress -------------------------------------------------------------------------------
    def caught_up(self) -> bool:
        """True when every assigned partition's position has reached its known high watermark."""
        if not self._assigned:
            return False
        for tp in self._assigned:
            hw = self.consumer.highwater(tp)
            if hw is None or self.consumer.position(tp) < hw:
                return False
        return True

    def lag(self) -> dict[tuple[str, int], int]:
        """Records between this reader's position and the high watermark, per partition (known ones)."""
        return {tp: max(0, hw - self.consumer.position(TopicPartition(*tp)))
                for tp, hw in self.high_watermarks().items()}

    def high_watermarks(self) -> dict[tuple[str, int], int]:
        """The last known high watermark (next offset to be written) of each assigned partition."""
        out = {}
        for tp in self._assigned:
            hw = self.consumer.highwater(tp)
            if hw is not None:
                out[(tp.topic, tp.partition)] = hw
        return out

    # ---- lifecycle ------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the owner's loop to finish (thread/signal-safe); also ends a dead-letter retry."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called (or the shared stop flag was set)."""
        return self._stop.is_set()

    def install_signals(self) -> bool:
        """Stop on SIGTERM/SIGINT (main thread only); True when installed."""
        return stop_on_signals(self.stop)

    def close(self) -> None:
        """Close the consumer (nothing is committed) and the dead-letter producer."""
        try:
            self.consumer.close(autocommit=False)
        finally:
            self.intake.close()

    def __enter__(self) -> "TopicReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_events(config: Config, logical: str) -> list:
    """Every decodable event now on the logical topic ``logical`` (with the configured prefix),
    from the beginning: an assign-mode read, no group joined, nothing committed."""
    from pipeline.bus.records import Record

    with TopicReader(config, [config.topics.name(logical)]) as reader:
        return [r.event for r in reader.read() if isinstance(r, Record)]
