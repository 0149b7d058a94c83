"""Assign-mode reading for stages that own their offsets.

The trainer (offsets in its checkpoints), the followers of ``control`` (the proxy reads it from
the start, the trainer's sync wait from its own ``weights`` record, the syncer from its group's
commit) and replay (a time or offset range) choose their partitions and start offsets
themselves: no group membership, no rebalancing. :class:`TopicReader` gives them that with the
same decode, type check, dead-letter, metrics and stop rules as
:class:`~pipeline.bus.ConsumerApp` (both use :class:`~pipeline.bus.records.RecordIntake`).

Typical loop::

    with TopicReader(config, config.topics.name("control"), name="proxy",
                     partitions=[0], start={0: 0}, dlq_give_up_s=10) as reader:
        while not reader.stopping:
            for rec in reader.poll(timeout_ms=300):
                apply(rec.event)

A stage that needs exact positions around records it has not handed on yet (the trainer keeps
a buffer across batches) uses :meth:`TopicReader.poll_raw` and decodes each record with
:meth:`TopicReader.decode` when it takes it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterable

from kafka import KafkaConsumer
from kafka.structs import OffsetAndMetadata, TopicPartition

from pipeline.bus.records import DECLARED, Record, RecordIntake, stop_on_signals
from pipeline.bus.settings import consumer_kwargs
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.metrics import CONSUMER_LAG

log = logging.getLogger(__name__)


class TopicMissing(PipelineError, LookupError):
    """The topic has no partitions on the broker (it does not exist)."""


class TopicReader:
    """Read chosen partitions of one topic from chosen offsets (see the module docstring).

    Args:
        config: the process config (``kafka``, ``topics``).
        topic: the physical topic name.
        name: stage name (metrics, logs, the dead letters' ``stage``).
        partitions: the partitions to read (default: all of them, waiting up to
            ``metadata_timeout_s`` for the topic to appear).
        start: ``{partition: offset}`` to start from; other partitions start per ``fallback``.
        fallback: ``committed`` (the group's committed offset, else the beginning; needs
            ``group_id``), ``earliest`` or ``latest``.
        group_id: a consumer group whose committed offsets are read and written by
            :meth:`commit` (never joined: no rebalancing); None for none.
        accept / dlq / dlq_give_up_s / producer: see :class:`~pipeline.bus.records.RecordIntake`.
        stop: a stop flag shared with the owner (default: a new one; :meth:`stop` sets it).
        consumer_overrides: extra kafka-python consumer settings.

    Raises:
        TopicMissing: ``partitions`` is None and the topic did not appear in time.
        kafka.errors.NoBrokersAvailable: the broker is unreachable.
    """

    def __init__(self, config: Config, topic: str, name: str, *, partitions: Iterable[int] | None = None,
                 start: dict[int, int] | None = None, fallback: str = "committed", group_id: str | None = None,
                 accept=DECLARED, dlq: bool = True, dlq_give_up_s: float | None = None, producer=None,
                 stop: threading.Event | None = None, metadata_timeout_s: float = 30.0,
                 **consumer_overrides) -> None:
        if fallback not in ("committed", "earliest", "latest"):
            raise ValueError(f"fallback must be committed, earliest or latest, got {fallback!r}")
        self.config, self.topic, self.name, self.group_id = config, topic, name, group_id
        self._stop = stop if stop is not None else threading.Event()
        self.intake = RecordIntake(config, name, producer=producer, dlq=dlq, accept=accept,
                                   dlq_give_up_s=dlq_give_up_s, stop=self._stop)
        self.consumer = KafkaConsumer(**consumer_kwargs(config, group_id, **consumer_overrides))
        try:
            parts = sorted(partitions) if partitions is not None else self._wait_partitions(metadata_timeout_s)
            self._tps = {p: TopicPartition(topic, p) for p in parts}
            self.consumer.assign(list(self._tps.values()))
            start = start or {}
            for p, tp in self._tps.items():
                if p in start:
                    self.consumer.seek(tp, int(start[p]))
                    continue
                committed = self.consumer.committed(tp) if fallback == "committed" and group_id is not None else None
                if committed is not None:
                    self.consumer.seek(tp, int(committed))
                elif fallback == "latest":
                    self.consumer.seek_to_end(tp)
                else:
                    self.consumer.seek_to_beginning(tp)
        except BaseException:
            self.consumer.close(autocommit=False)
            raise

    def _wait_partitions(self, timeout_s: float) -> list[int]:
        deadline = time.monotonic() + timeout_s
        while True:
            parts = self.consumer.partitions_for_topic(self.topic)
            if parts:
                return sorted(parts)
            if time.monotonic() > deadline or self._stop.is_set():
                raise TopicMissing(f"topic {self.topic!r} has no partitions on "
                                   f"{self.config.kafka.bootstrap_servers} (does it exist?)")
            self.consumer.topics()  # refresh metadata
            time.sleep(0.2)

    # ---- reading --------------------------------------------------------------------------------
    @property
    def partitions(self) -> list[int]:
        """The partitions this reader reads."""
        return list(self._tps)

    def poll(self, timeout_ms: int = 200) -> list[Record]:
        """Decoded, checked records (in offset order per partition); bad ones are dead-lettered.

        Raises:
            pipeline.bus.records.DeadLetterError: stopped while a dead letter could not be
                delivered (that record and the rest of this poll are not handed on).
        """
        out = []
        for raw in self.poll_raw(timeout_ms):
            rec = self.intake.decode(raw)
            if rec is not None:
                out.append(rec)
        return out

    def poll_raw(self, timeout_ms: int = 200) -> list:
        """kafka-python records as polled (counted in the metrics; lag updated), undecoded."""
        batch = self.consumer.poll(timeout_ms=timeout_ms)
        out = []
        for tp, recs in batch.items():
            self.intake.polled(tp.topic, len(recs))
            out.extend(recs)
        if batch:
            self._observe_lag(batch)
        return out

    def decode(self, raw, stop: threading.Event | None = None) -> Record | None:
        """Decode a record from :meth:`poll_raw`; None when it went to the DLQ (see
        :meth:`RecordIntake.decode <pipeline.bus.records.RecordIntake.decode>`)."""
        return self.intake.decode(raw, stop=stop)

    def dead_letter(self, rec, error: str, stop: threading.Event | None = None) -> bool:
        """Dead-letter a record the stage itself rejects (see :meth:`RecordIntake.dead_letter
        <pipeline.bus.records.RecordIntake.dead_letter>`)."""
        return self.intake.dead_letter(rec, error, stop=stop)

    def _observe_lag(self, batch) -> None:
        for tp in batch:
            hw = self.consumer.highwater(tp)
            if hw is not None:
                CONSUMER_LAG.labels(self.name, tp.topic, str(tp.partition)).set(max(0, hw - self.consumer.position(tp)))

    # ---- positions ------------------------------------------------------------------------------
    def seek(self, partition: int, offset: int) -> None:
        """Read ``partition`` from ``offset`` next."""
        self.consumer.seek(self._tps[partition], offset)

    def seek_to_end(self, partition: int) -> None:
        """Read only records produced after now from ``partition``."""
        self.consumer.seek_to_end(self._tps[partition])

    def position(self, partition: int) -> int:
        """The offset of the next record of ``partition`` that :meth:`poll_raw` will return."""
        return int(self.consumer.position(self._tps[partition]))

    def positions(self) -> dict[int, int]:
        """:meth:`position` of every partition."""
        return {p: self.position(p) for p in self._tps}

    def committed(self) -> dict[int, int | None]:
        """The offsets ``group_id`` has committed, per partition (None: none), asked of the broker now."""
        if self.group_id is None:
            raise ValueError(f"{self.name}: committed offsets need a group_id")
        return {p: self.consumer.committed(tp) for p, tp in self._tps.items()}

    def beginning_offsets(self) -> dict[int, int]:
        """The first offset still in the log, per partition."""
        got = self.consumer.beginning_offsets(list(self._tps.values()))
        return {tp.partition: int(o) for tp, o in got.items()}

    def offsets_for_times(self, time_ms: int) -> dict:
        """kafka-python's ``offsets_for_times`` for every partition (``{partition: OffsetAndTimestamp | None}``)."""
        got = self.consumer.offsets_for_times({tp: time_ms for tp in self._tps.values()})
        return {tp.partition: v for tp, v in got.items()}

    def highwater(self, partition: int) -> int | None:
        """The partition's high watermark as of the last fetch (None before one)."""
        return self.consumer.highwater(self._tps[partition])

    def pause(self, *partitions: int) -> None:
        """Stop fetching ``partitions``."""
        self.consumer.pause(*(self._tps[p] for p in partitions))

    def commit(self, offsets: dict[int, int]) -> None:
        """Commit ``{partition: next offset}`` for ``group_id``.

        Raises:
            kafka.errors.KafkaError: the commit failed.
            ValueError: the reader has no ``group_id``.
        """
        if self.group_id is None:
            raise ValueError(f"{self.name}: commit needs a group_id")
        self.consumer.commit({self._tps[p]: OffsetAndMetadata(int(o), "", -1) for p, o in offsets.items()})

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

    @property
    def consumed(self) -> int:
        """Records polled so far."""
        return self.intake.consumed

    @property
    def dead_lettered(self) -> int:
        """Records sent to the DLQ so far."""
        return self.intake.dead_lettered

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
