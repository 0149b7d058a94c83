"""Read topics without a consumer group: assign mode, nothing committed, nothing written.

:class:`TopicReader` is for observers (``pipeline tail``, the dashboard, reports): it assigns
itself every partition of the given topics, seeks to a start position and decodes each record
through :func:`pipeline.events.decode`. It never joins a group, never commits and never writes
a dead letter (an observer must not change what the stages see); a record that does not decode
comes back as :class:`Undecodable` with the error.

Start positions: ``"beginning"``, ``"end"`` (only what arrives from now on), ``Offset(n)``
(every partition, or per partition; clamped by the broker to what exists) or ``Time(ms)`` (the first record whose
timestamp is at or after ``ms``). Records older than a ``"end"``/``Time`` start are also
dropped client-side, so a broker whose end-offset or time look-up is off (Tansu: its end
offset is the last record's, and a time past the end answers offset 0) still yields exactly
the records from the start point on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Iterable, Iterator, Union

from kafka import KafkaConsumer
from kafka.structs import TopicPartition

from pipeline import events
from pipeline.bus.consumer import Record
from pipeline.bus.settings import consumer_kwargs
from pipeline.config import Config

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Offset:
    """Start every partition at ``offset``, or partition ``p`` at ``per_partition[p]`` when given
    (unlisted partitions then start at the beginning). The broker clamps to what exists."""

    offset: int = 0
    per_partition: dict[int, int] | None = None

    def for_partition(self, partition: int) -> int:
        """The start offset of ``partition``."""
        if self.per_partition is not None:
            return self.per_partition.get(partition, 0)
        return self.offset


@dataclass(frozen=True)
class Time:
    """Start at the first record whose timestamp is ``>= ms`` (milliseconds since the epoch)."""

    ms: int


Start = Union[str, Offset, Time]


@dataclass
class Undecodable:
    """A record :func:`pipeline.events.decode` refused (``error`` says why)."""

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


class TopicReader:
    """Assign-mode reader of one or more topics (see the module docstring).

    Args:
        config: process config (``kafka`` section).
        topics: physical topic names; a topic that does not exist yet is picked up by
            :meth:`refresh` once it does.
        start: ``"beginning"`` (default), ``"end"``, :class:`Offset` or :class:`Time`.
        partitions: read only these partition numbers (default: all).
        consumer_overrides: extra kafka-python consumer settings.

    Raises:
        ValueError: an unknown ``start``.
    """

    def __init__(self, config: Config, topics: Iterable[str], start: Start = "beginning",
                 partitions: Iterable[int] | None = None, **consumer_overrides) -> None:
        if not (start in ("beginning", "end") or isinstance(start, (Offset, Time))):
            raise ValueError(f"start must be 'beginning', 'end', Offset(n) or Time(ms), got {start!r}")
        self.topics = list(dict.fromkeys(topics))
        self.start = start
        self.partitions = set(partitions) if partitions is not None else None
        self._min_ts = start.ms if isinstance(start, Time) else (events.now_ms() if start == "end" else None)
        self._consumer = KafkaConsumer(**consumer_kwargs(config, None, **consumer_overrides))
        self._assigned: list[TopicPartition] = []
        self.refresh()

    # ---- assignment -------------------------------------------------------------------------
    def refresh(self) -> list[TopicPartition]:
        """Assign partitions of the topics that appeared since the last call; returns the new ones."""
        known = set(self._assigned)
        new: list[TopicPartition] = []
        for topic in self.topics:
            parts = self._consumer.partitions_for_topic(topic)
            for p in sorted(parts or ()):
                tp = TopicPartition(topic, p)
                if tp not in known and (self.partitions is None or p in self.partitions):
                    new.append(tp)
        if not new:
            return []
        self._consumer.assign(self._assigned + new)
        self._seek(new)
        self._assigned += new
        return new

    def _seek(self, tps: list[TopicPartition]) -> None:
        if self.start == "beginning":
            self._consumer.seek_to_beginning(*tps)
        elif self.start == "end":
            self._consumer.seek_to_end(*tps)
        elif isinstance(self.start, Offset):
            for tp in tps:
                self._consumer.seek(tp, max(0, self.start.for_partition(tp.partition)))
        else:
            found = self._consumer.offsets_for_times({tp: self.start.ms for tp in tps})
            for tp in tps:
                hit = found.get(tp)
                if hit is None or hit.timestamp < 0:  # nothing at or after the time
                    self._consumer.seek_to_end(tp)
                else:
                    self._consumer.seek(tp, hit.offset)

    def assignment(self) -> list[tuple[str, int]]:
        """``(topic, partition)`` pairs being read."""
        return [(tp.topic, tp.partition) for tp in self._assigned]

    # ---- reading ------------------------------------------------------------------------------
    def poll(self, timeout_ms: int = 200) -> list[Record | Undecodable]:
        """The records fetched within ``timeout_ms``, in offset order per partition."""
        if not self._assigned:
            self.refresh()
            if not self._assigned:
                time.sleep(timeout_ms / 1000)
                return []
        out: list[Record | Undecodable] = []
        for tp, recs in self._consumer.poll(timeout_ms=timeout_ms).items():
            for r in recs:
                if self._min_ts is not None and r.timestamp < self._min_ts:
                    continue
                key = r.key.decode("utf-8", "replace") if r.key is not None else None
                try:
                    ev = events.decode(r.value)
                except events.EventError as e:
                    out.append(Undecodable(tp.topic, tp.partition, r.offset, key, f"{type(e).__name__}: {e}",
                                           r.timestamp, len(r.value or b"")))
                    continue
                out.append(Record(tp.topic, tp.partition, r.offset, key, ev, r.timestamp))
        return out

    def caught_up(self) -> bool:
        """True when every assigned partition's position has reached its known high watermark."""
        if not self._assigned:
            return False
        for tp in self._assigned:
            hw = self._consumer.highwater(tp)
            if hw is None or self._consumer.position(tp) < hw:
                return False
        return True

    def lag(self) -> dict[tuple[str, int], int]:
        """Records between this reader's position and the high watermark, per partition (known ones)."""
        out = {}
        for tp in self._assigned:
            hw = self._consumer.highwater(tp)
            if hw is not None:
                out[(tp.topic, tp.partition)] = max(0, hw - self._consumer.position(tp))
        return out

    def high_watermarks(self) -> dict[tuple[str, int], int]:
        """The last known high watermark (next offset to be written) of each assigned partition."""
        out = {}
        for tp in self._assigned:
            hw = self._consumer.highwater(tp)
            if hw is not None:
                out[(tp.topic, tp.partition)] = hw
        return out

    def read(self, follow: bool = False, idle_timeout_s: float = 3.0, stop=None,
             poll_timeout_ms: int = 200) -> Iterator[Record | Undecodable]:
        """Yield records from the start position.

        ``follow``: keep waiting for new records until ``stop`` (a ``threading.Event``) is set.
        Otherwise stop once caught up with the high watermarks, or after ``idle_timeout_s``
        without a record (a topic that does not exist, a broker that reports no watermark).
        """
        last = time.monotonic()
        refreshed = time.monotonic()
        while stop is None or not stop.is_set():
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

    def close(self) -> None:
        """Close the consumer (no commit: there is no group)."""
        self._consumer.close(autocommit=False)

    def __enter__(self) -> TopicReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
