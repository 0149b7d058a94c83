"""One consumer-group application per process: poll, decode, handle, ack, commit.

Commit rule: for each partition the committed offset is the lowest offset that has been
polled but not yet acknowledged (or one past the last polled offset when everything is
acknowledged). A handler acknowledges a record by returning ``None``/``True``, or defers it by
returning ``False`` and calling :meth:`ConsumerApp.ack` later (from any thread). So nothing is
committed before its output exists, and a crash re-delivers exactly the unfinished tail; the
consumer of the output deduplicates by a deterministic id (e.g. ``sample_id``).

Records that fail to decode, carry an event type their topic does not (``topics.yaml``), or
whose handler raises, go to ``<topic>.dlq`` as a :class:`pipeline.events.DeadLetter` (error
text, source partition and offset, the raw bytes) and are acknowledged only once the broker has
the dead letter: never lost, never blocking. These rules live in
:class:`pipeline.bus.records.RecordIntake`, shared with :class:`pipeline.bus.TopicReader`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Callable, Iterable

from kafka import ConsumerRebalanceListener, KafkaConsumer
from kafka.errors import CommitFailedError, KafkaError
from kafka.structs import OffsetAndMetadata, TopicPartition

from pipeline.bus.producer import EventProducer
from pipeline.bus.records import DECLARED, DeadLetterError, IntakeCounts, Record, RecordIntake, stop_on_signals
from pipeline.bus.settings import consumer_kwargs
from pipeline.config import Config
from pipeline.metrics import COMMITS, CONSUMER_LAG, IN_FLIGHT

log = logging.getLogger(__name__)

__all__ = ["ConsumerApp", "Record"]


class _Tracker:
    """Outstanding offsets of one partition, in poll order."""

    __slots__ = ("outstanding", "acked", "next_offset", "committed", "generation")

    def __init__(self, generation: int) -> None:
        self.outstanding: deque[int] = deque()
        self.acked: set[int] = set()
        self.next_offset: int | None = None
        self.committed: int | None = None
        self.generation = generation

    def add(self, offset: int) -> None:
        self.outstanding.append(offset)
        self.next_offset = offset + 1

    def ack(self, offset: int) -> None:
        self.acked.add(offset)
        while self.outstanding and self.outstanding[0] in self.acked:
            self.acked.discard(self.outstanding.popleft())

    def safe_offset(self) -> int | None:
        return self.outstanding[0] if self.outstanding else self.next_offset


def keep_join_awaited(consumer: KafkaConsumer) -> None:
    """Make the next ``poll`` finish a group join that an earlier poll left in flight.

    kafka-python 3.0.12 runs JoinGroup + SyncGroup as a task; a poll whose time-out ends first
    returns and leaves the task running, and the next poll awaits it only while the coordinator
    still says it needs to rejoin. A rejoin caused by a metadata change (a subscribed topic that
    appeared or grew, seen by the group leader) or a subscription change clears that reason
    inside the task itself (the assignment snapshot and the joined subscription are taken when
    the requests are built), so no later poll took the finished task's assignment: the member
    never owned its partitions and never heartbeated again, silently (the broker expelled it
    after ``session_timeout_ms``). Reproduced about once in 100 joins with 100 ms polls, every
    time with 1 ms polls (``tests/bus/test_bus.py``). Marking the rejoin as needed while a join task
    exists makes the poll await that same task (no second JoinGroup); a task that already ended
    unawaited is replaced by a fresh join (as kafka-python itself does for any join that ends
    between two polls), skipping the revoke listener, which already ran. A no-op on a client
    without these attributes: the test above then fails again."""
    coordinator = getattr(consumer, "_coordinator", None)
    if coordinator is not None and getattr(coordinator, "_join_task", None) is not None:
        coordinator.request_rejoin()


class ConsumerApp(IntakeCounts):
    """Run a handler over a consumer group's records with commit-after-processing semantics.

    Args:
        config: process config (``kafka`` and ``topics`` sections).
        group_id: the consumer group.
        topics: physical topic names to subscribe to.
        name: stage name (metrics, logs, dead letters).
        max_in_flight: pause all partitions while more records than this are unacknowledged,
            resume below half of it (backpressure).
        dlq: route undecodable records to ``<topic><dlq_suffix>``; False re-raises instead.
        producer: the producer for dead letters (default: one made on the first dead letter).
        accept: event classes the topics may carry (default ``DECLARED``: ``topics.yaml``; None:
            any); see :class:`pipeline.bus.records.RecordIntake`.
        consumer_overrides: extra kafka-python consumer settings.

    A dead letter that cannot be delivered is retried with back-off (the record stays
    unacknowledged, so the commit cannot pass it) until it is delivered or the app is stopped.
    """

    def __init__(self, config: Config, group_id: str, topics: Iterable[str], name: str,
                 max_in_flight: int = 10_000, dlq: bool = True, producer: EventProducer | None = None,
                 accept=DECLARED, **consumer_overrides) -> None:
        self.config = config
        self.name = name
        self.group_id = group_id
        self.topics = list(topics)
        self.max_in_flight = max_in_flight
        self.dlq = dlq
        self._consumer = KafkaConsumer(**consumer_kwargs(config, group_id, **consumer_overrides))
        self._stop = threading.Event()
        self.intake = RecordIntake(config, name, producer=producer, dlq=dlq, accept=accept, stop=self._stop)
        self._trackers: dict[TopicPartition, _Tracker] = {}
        self._rewind: dict[TopicPartition, int] = {}  # safe offsets at the last revocation
        self._acks: queue.SimpleQueue = queue.SimpleQueue()
        self._paused = False
        self._generation = 0
        self._on_assigned: Callable | None = None
        self._on_revoked: Callable | None = None

    # ---- public API -------------------------------------------------------------------------
    def ack(self, record: Record) -> None:
        """Mark a deferred record done (thread-safe). Ignored if its partition moved away since."""
        self._acks.put((TopicPartition(record.topic, record.partition), record.offset, record.generation))

    def stop(self) -> None:
        """Ask :meth:`run` to finish: it drains acks, commits and closes (thread/signal-safe)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stop.is_set()

    def assignment(self) -> set[tuple[str, int]]:
        """Partitions currently owned by this member."""
        return {(tp.topic, tp.partition) for tp in self._trackers}

    def caught_up(self, tp: tuple[str, int]) -> bool:
        """True when this member owns ``tp`` and has handed every record up to the partition's
        last known end (the high watermark of the latest fetch) to the handler. Call from the
        consumer thread (``handle``/``tick``)."""
        t = TopicPartition(*tp)
        tracker = self._trackers.get(t)
        hw = self._consumer.highwater(t) if tracker is not None else None
        return hw is not None and tracker.next_offset is not None and tracker.next_offset >= hw

    def in_flight(self) -> int:
        """Records polled but not yet acknowledged."""
        return sum(len(t.outstanding) for t in self._trackers.values())

    def run(self, handle: Callable[[Record], bool | None], tick: Callable[[], None] | None = None,
            tick_interval_s: float = 1.0, on_assigned: Callable[[set], None] | None = None,
            on_revoked: Callable[[set], None] | None = None, poll_timeout_ms: int = 100,
            drain_timeout_s: float = 10.0, install_signals: bool = True,
            on_stop: Callable[[], None] | None = None) -> None:
        """Consume until :meth:`stop` (or SIGTERM/SIGINT when ``install_signals``).

        ``handle(record)`` returns ``None``/``True`` when the record is done, ``False`` when the
        stage will :meth:`ack` it later. ``tick()`` runs every ``tick_interval_s`` (timers such as
        idle time-outs). ``on_assigned``/``on_revoked`` get sets of ``(topic, partition)``; on
        revocation the safe offsets are committed first and later acks for those partitions are
        ignored. At stop, ``on_stop()`` runs, then deferred acks are awaited up to
        ``drain_timeout_s``, the final offsets committed and the consumer closed.
        """
        self._on_assigned, self._on_revoked = on_assigned, on_revoked
        if install_signals:
            stop_on_signals(self.stop)
        self._consumer.subscribe(self.topics, listener=_Listener(self))
        next_tick = time.monotonic() + tick_interval_s
        try:
            while not self._stop.is_set():
                self._drain_acks()
                keep_join_awaited(self._consumer)
                batch = self._consumer.poll(timeout_ms=poll_timeout_ms)
                for tp, recs in batch.items():
                    tracker = self._trackers.get(tp)
                    if tracker is None:  # revoked during this poll
                        continue
                    self.intake.polled(tp.topic, len(recs))
                    for r in recs:
                        self._process(tp, tracker, r, handle)
                self._drain_acks()
                self._backpressure()
                if tick is not None and time.monotonic() >= next_tick:
                    next_tick = time.monotonic() + tick_interval_s
                    self._safe_call(tick)
                    self._drain_acks()
                self._commit()
        finally:
            self._shutdown(on_stop, drain_timeout_s)

    # ---- internals ----------------------------------------------------------------------------
    def _process(self, tp: TopicPartition, tracker: _Tracker, r, handle) -> None:
        tracker.add(r.offset)
        try:
            rec = self.intake.decode(r, tracker.generation)
            if rec is None:  # dead-lettered: the broker has it
                tracker.ack(r.offset)
                return
            try:
                done = handle(rec)
            except Exception as e:  # a stage never crashes on one record
                log.exception("%s: handler failed on %s[%d]@%d", self.name, tp.topic, tp.partition, r.offset)
                self.intake.dead_letter(r, f"handler error: {type(e).__name__}: {e}")
                done = True
        except DeadLetterError as e:  # stopping: left unacknowledged, re-delivered after a restart
            log.warning("%s", e)
            return
        if done is not False:
            tracker.ack(r.offset)

    def _drain_acks(self) -> None:
        while True:
            try:
                tp, offset, gen = self._acks.get_nowait()
            except queue.Empty:
                break
            tracker = self._trackers.get(tp)
            if tracker is not None and tracker.generation == gen:
                tracker.ack(offset)
        IN_FLIGHT.labels(self.name).set(self.in_flight())

    def _backpressure(self) -> None:
        n = self.in_flight()
        parts = list(self._trackers)
        if not self._paused and n > self.max_in_flight and parts:
            self._consumer.pause(*parts)
            self._paused = True
            log.info("%s: %d records in flight, pausing %d partitions", self.name, n, len(parts))
        elif self._paused and n <= self.max_in_flight // 2:
            self._consumer.resume(*self._consumer.paused())
            self._paused = False
            log.info("%s: %d records in flight, resuming", self.name, n)

    def _commit(self, only: Iterable[TopicPartition] | None = None) -> None:
        offsets = {}
        for tp in (only if only is not None else list(self._trackers)):
            t = self._trackers.get(tp)
            if t is None:
                continue
            safe = t.safe_offset()
            if safe is not None and safe != t.committed:
                offsets[tp] = OffsetAndMetadata(safe, "", -1)
        if not offsets:
            return
        try:
            self._consumer.commit(offsets=offsets)
        except (CommitFailedError, KafkaError) as e:
            log.warning("%s: commit failed (will retry): %s", self.name, e)
            return
        except RuntimeError as e:
            # kafka-python 3 sometimes runs the rebalance listener on its own IO thread, where a
            # blocking commit is refused: send it without waiting. If it is lost, the records
            # after the last commit are re-delivered (at-least-once; outputs carry stable ids).
            log.info("%s: commit from the consumer's IO thread, sent asynchronously (%s)", self.name, e)
            try:
                self._consumer.commit_async(offsets=offsets)
            except Exception as e2:
                log.warning("%s: asynchronous commit failed: %s", self.name, e2)
                return
        COMMITS.labels(self.name).inc()
        for tp, om in offsets.items():
            self._trackers[tp].committed = om.offset
            hw = self._consumer.highwater(tp)
            if hw is not None:
                CONSUMER_LAG.labels(self.name, tp.topic, str(tp.partition)).set(max(0, hw - om.offset))

    def _safe_call(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:
            log.exception("%s: callback %s failed", self.name, getattr(fn, "__name__", fn))

    def _assigned(self, tps) -> None:
        self._generation += 1
        for tp in tps:
            self._trackers[tp] = _Tracker(self._generation)
            # kafka-python keeps the fetch position of a partition that is revoked and assigned
            # back in the same (eager) rebalance; rewind it to what was unacknowledged at the
            # revocation, or deferred records would never be re-delivered
            rewind = self._rewind.get(tp)
            if rewind is not None:
                self._consumer.seek(tp, rewind)
        self._rewind.clear()
        if self._paused:
            self._consumer.pause(*tps)
        log.info("%s: assigned %s", self.name, sorted((t.topic, t.partition) for t in tps))
        if self._on_assigned:
            self._safe_call(self._on_assigned, {(t.topic, t.partition) for t in tps})

    def _revoked(self, tps) -> None:
        self._drain_acks()
        self._commit(only=tps)
        for tp in tps:
            t = self._trackers.pop(tp, None)
            if t is not None and t.safe_offset() is not None:
                self._rewind[tp] = t.safe_offset()
        log.info("%s: revoked %s", self.name, sorted((t.topic, t.partition) for t in tps))
        if self._on_revoked:
            self._safe_call(self._on_revoked, {(t.topic, t.partition) for t in tps})

    def _shutdown(self, on_stop, drain_timeout_s: float) -> None:
        if on_stop is not None:
            self._safe_call(on_stop)
        deadline = time.monotonic() + drain_timeout_s
        while self.in_flight() and time.monotonic() < deadline:
            self._drain_acks()
            if self.in_flight():
                time.sleep(0.02)
        self._drain_acks()
        try:
            self._commit()
        finally:
            try:
                self._consumer.close(autocommit=False)
            finally:
                self.intake.close()
        log.info("%s: stopped (%d consumed, %d dead-lettered, %d left unacknowledged)",
                 self.name, self.consumed, self.dead_lettered, self.in_flight())


class _Listener(ConsumerRebalanceListener):
    def __init__(self, app: ConsumerApp) -> None:
        self.app = app

    # an exception raised here would abort kafka-python's rebalance and the whole consumer
    def on_partitions_revoked(self, revoked) -> None:
        try:
            self.app._revoked(list(revoked))
        except Exception:
            log.exception("%s: handling revoked partitions failed", self.app.name)

    def on_partitions_assigned(self, assigned) -> None:
        try:
            self.app._assigned(list(assigned))
        except Exception:
            log.exception("%s: handling assigned partitions failed", self.app.name)
