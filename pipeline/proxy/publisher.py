"""Asynchronous, ordered, loss-accounted event publishing: serving never waits for Kafka.

Flow of one event::

    event loop --publish()--> inbox --intake thread (encode)--> backlog --sender thread--> Kafka
                                                                 memory deque (<= max_buffer)
                                                                 then spill file (optional)

- :meth:`EventPublisher.publish` only appends to a ``queue.SimpleQueue`` (a few microseconds);
  it never blocks and never raises.
- The intake thread encodes events (msgpack) and appends them to the backlog: to memory while
  there is room, else to the spill file (``proxy.spill_file``) — once spilling has started every
  newer event goes to the file too, so the backlog stays one FIFO. With no room anywhere the
  event is dropped, counted in ``pipeline_proxy_events_dropped_total{reason}`` and logged.
- The sender thread owns one idempotent producer (acks=all; librdkafka or kafka-python, see
  :mod:`pipeline.proxy.transport`). It takes a window of the oldest events (gathered for up to
  ``linger_s``), sends them, and waits until each is acknowledged or failed. Failed events are
  put back at the front of the backlog (same order); the producer is then recreated (a broker
  that restarted does not know the old producer id) and the window is retried with back-off.
  Events stay queued for as long as the broker is away; nothing times out of the backlog.

Order: one sender and one window at a time, so events are delivered in the order they were
published (per session partition too). Delivery is at-least-once: a window whose
acknowledgement was lost is sent again, and a restart re-sends spilled events after the last
committed position. At :meth:`close`, what could not be delivered in time is written to the
spill file (and resent by the next process) or, without one, counted as dropped
(``reason="shutdown"``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

from pipeline import events
from pipeline.config import Config
from pipeline.metrics import EVENTS_FAILED, EVENTS_PRODUCED
from pipeline.proxy import metrics as M
from pipeline.proxy.spill import SpillFile
from pipeline.proxy.transport import have_librdkafka, make_transport

log = logging.getLogger(__name__)


class EventPublisher:
    """Background publisher of events to Kafka with a bounded buffer and an optional spill file.

    Args:
        config: the process config (``kafka`` section for the producer).
        max_buffer: events held in memory before spilling (or dropping).
        spill_file: path of the spill file, or None (overflow is dropped and counted).
        spill_max_bytes: size bound of the spill file; beyond it events are dropped and counted.
        window: most events in flight at once.
        linger_s: how long the threads gather events before encoding / sending a window (fewer
            wake-ups and produce requests; adds at most this much to the delivery delay).
        kafka_client: ``auto`` (librdkafka when installed), ``librdkafka`` or ``kafka-python``
            (see :mod:`pipeline.proxy.transport`).
        delivery_timeout_ms: how long the Kafka client retries one window before it is failed and
            retried by this class with a fresh producer.
        name: stage label for the bus metrics.

    Raises:
        ImportError: ``kafka_client="librdkafka"`` without confluent-kafka installed.
        ValueError: an unknown ``kafka_client``.
        OSError: the spill file cannot be opened.

    Order caveat: if the broker acknowledged a later event of a window but not an earlier one of
    the same partition (not seen with an idempotent producer, whose failures are suffixes), the
    earlier one is re-sent after it.
    """

    def __init__(self, config: Config, max_buffer: int = 10_000, spill_file: str | None = None,
                 spill_max_bytes: int = 1 << 30, window: int = 2000, delivery_timeout_ms: int = 30_000,
                 linger_s: float = 0.01, kafka_client: str = "auto", name: str = "proxy") -> None:
        self.config = config
        self.name = name
        self.max_buffer = max(1, max_buffer)
        self.inbox_max = self.max_buffer + 10_000  # safety net only: the intake thread drains it continuously
        self.window = max(1, window)
        self.linger_s = max(0.0, linger_s)
        self.delivery_timeout_ms = delivery_timeout_ms
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._in = 0  # written by publish() callers only
        self._out = 0  # written by the intake thread only
        self._mem: deque = deque()
        self._spill = SpillFile(spill_file, spill_max_bytes) if spill_file else None
        self._lock = threading.Condition()
        self._inflight: list = []
        self._inflight_from_spill = False
        if kafka_client == "librdkafka" and not have_librdkafka():
            raise ImportError("proxy.kafka_client=librdkafka needs: pip install confluent-kafka")
        if kafka_client not in ("auto", "librdkafka", "kafka-python"):
            raise ValueError(f"kafka_client must be auto, librdkafka or kafka-python, got {kafka_client!r}")
        self.kafka_client = kafka_client
        self._transport = None
        self._stop = threading.Event()
        self._intake_done = threading.Event()
        self._deadline = float("inf")
        self._finished = False
        self._threads: list[threading.Thread] = []
        self._drop_lock = threading.Lock()
        self.dropped: dict[str, int] = {}
        self.delivered = 0
        self.spilled = 0
        self.broker_connected = False
        self._last_drop_log = 0.0
        self._backoff = 0.2

    # ---- caller side (event loop) -------------------------------------------------------------
    def publish(self, topic: str, event: events.Event, key: str | None) -> bool:
        """Queue one event; never blocks. Returns False (and counts a drop) if it was refused."""
        if self._stop.is_set():
            self._drop("closed", 1)
            return False
        if self._in - self._out >= self.inbox_max:  # intake thread stalled: protect memory
            self._drop("inbox_full", 1)
            return False
        self._in += 1
        self._inbox.put((topic, key, event))
        return True

    def start(self) -> "EventPublisher":
        """Start the intake and sender threads."""
        for target, name in ((self._intake, "proxy-publish-intake"), (self._sender, "proxy-publish-sender")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def buffered(self) -> int:
        """Events accepted but not yet acknowledged (inbox + memory + spill + in flight)."""
        return (self._in - self._out) + len(self._mem) + (len(self._spill) if self._spill else 0) + len(
            self._inflight)

    def stats(self) -> dict[str, Any]:
        """Counters for tests, logs and ``/readyz``."""
        return {"buffered": self.buffered, "delivered": self.delivered, "spilled": self.spilled,
                "dropped": dict(self.dropped), "dropped_total": sum(self.dropped.values()),
                "broker_connected": self.broker_connected}

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing is buffered (True) or ``timeout_s`` passes (False). For tests/bench."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.buffered == 0:
                return True
            time.sleep(0.01)
        return self.buffered == 0

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, deliver what is possible within ``timeout_s``, then spill or count the rest."""
        if self._stop.is_set():
            return
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._inbox.put(None)
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout_s + 5)
        self._finish()

    # ---- intake thread ------------------------------------------------------------------------
    def _intake(self) -> None:
        while True:
            first = self._inbox.get()
            if first is not None and self.linger_s:
                # batch: one wake-up per linger period, not per event (GIL contention with the event loop)
                time.sleep(self.linger_s / 2)
            batch = [first]
            while len(batch) < 4096:
                try:
                    batch.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            stop = False
            items = []
            for it in batch:
                if it is None:
                    stop = True
                    continue
                topic, key, ev = it
                try:
                    items.append((topic, key, events.encode(ev)))
                except Exception as e:  # a bug upstream must not kill the thread
                    self._drop("invalid", 1)
                    log.error("event %s could not be encoded: %s", getattr(ev, "TYPE", "?"), e)
            with self._lock:
                self._append(items)
                self._out += len(batch) - (1 if stop else 0)
                self._lock.notify_all()
            M.EVENTS_BUFFERED.set(self.buffered)
            if stop:
                break
        self._intake_done.set()

    def _append(self, items: list) -> None:
        """Append encoded items to the backlog (caller holds the lock)."""
        if not items:
            return
        # once anything is in (or being read from) the spill file, newer events go there too
        spilling = self._spill is not None and (len(self._spill) > 0 or self._spill.reading)
        i = 0
        if not spilling:
            room = self.max_buffer - len(self._mem)
            take = items[:max(0, room)]
            self._mem.extend(take)
            i = len(take)
        rest = items[i:]
        if not rest:
            return
        if self._spill is not None:
            try:
                n = self._spill.append(rest)
            except OSError as e:
                log.error("spill file %s: %s", self._spill.path, e)
                n = 0
            if n:
                self.spilled += n
                M.EVENTS_SPILLED.inc(n)
            if n < len(rest):
                self._drop("spill_full", len(rest) - n)
        else:
            self._drop("buffer_full", len(rest))

    # ---- sender thread ------------------------------------------------------------------------
    def _take(self) -> list:
        """Next window from the front of the backlog (caller holds the lock)."""
        n = self.window
        if self._mem:
            k = min(n, len(self._mem))
            self._inflight_from_spill = False
            return [self._mem.popleft() for _ in range(k)]
        if self._spill is not None and len(self._spill):
            self._inflight_from_spill = True
            return self._spill.read(n)
        return []

    def _sender(self) -> None:
        while True:
            with self._lock:
                while not self._mem and not (self._spill and len(self._spill)):
                    if self._stop.is_set() and self._intake_done.is_set():
                        return
                    self._lock.wait(0.5)
                if self._stop.is_set() and time.monotonic() > self._deadline:
                    return
                linger_end = time.monotonic() + self.linger_s
                while len(self._mem) < self.window and not self._stop.is_set():
                    left = linger_end - time.monotonic()  # gather a bigger window: one produce request per window
                    if left <= 0:
                        break
                    self._lock.wait(left)
                self._inflight = self._take()
            failed = self._send_window(self._inflight)
            with self._lock:
                if self._finished:  # close() gave up waiting and already accounted for this window
                    return
                ok = len(self._inflight) - len(failed)
                if failed:
                    if self._inflight_from_spill:
                        self._spill.rewind()
                    else:
                        self._mem.extendleft(reversed(failed))
                elif self._inflight_from_spill:
                    self._spill.commit()
                self._inflight = []
                self.delivered += ok
            M.EVENTS_BUFFERED.set(self.buffered)
            if failed:
                self._on_window_failed(len(failed))
            else:
                self._backoff = 0.2

    def _on_window_failed(self, n: int) -> None:
        M.PUBLISH_RETRIES.inc()
        if self.broker_connected:
            log.warning("broker unavailable: %d events wait in the buffer and will be re-sent in order", n)
        self.broker_connected = False
        M.BROKER_UP.set(0)
        self._reset_producer()
        end = time.monotonic() + self._backoff
        while time.monotonic() < end and not (self._stop.is_set() and time.monotonic() > self._deadline):
            time.sleep(0.05)
        self._backoff = min(self._backoff * 2, 5.0)

    def _reset_producer(self) -> None:
        t, self._transport = self._transport, None
        if t is not None:
            t.close()

    def _give_up(self) -> bool:
        return self._stop.is_set() and time.monotonic() > self._deadline

    def _send_window(self, items: list) -> list:
        """Send ``items`` and wait for every acknowledgement; return the failed ones, in order."""
        if not items:
            return []
        try:
            if self._transport is None:
                self._transport = make_transport(self.config, self.kafka_client, self.delivery_timeout_ms)
        except Exception as e:
            log.debug("producer not available: %s", e)
            return items
        if self._finished:
            return items
        ok = self._transport.send_window(items, self._give_up)
        failed = [it for it, good in zip(items, ok) if not good]
        done = len(items) - len(failed)
        if done:
            if not self.broker_connected:
                log.info("broker reachable: publishing resumed")
            self.broker_connected = True
            M.BROKER_UP.set(1)
            M.EVENTS_DELIVERED.inc(done)
            by_topic: dict[str, int] = {}
            for it, good in zip(items, ok):
                if good:
                    by_topic[it[0]] = by_topic.get(it[0], 0) + 1
            for t, c in by_topic.items():
                EVENTS_PRODUCED.labels(self.name, t).inc(c)
        if failed:
            topic = failed[0][0]
            EVENTS_FAILED.labels(self.name, topic).inc(len(failed))
        return failed

    # ---- shutdown and accounting ----------------------------------------------------------------
    def _finish(self) -> None:
        with self._lock:
            self._finished = True
            rest = [] if self._inflight_from_spill else list(self._inflight)
            rest += list(self._mem)  # empty when the window came from the spill file
            self._inflight, self._mem = [], deque()
            if self._spill is not None:
                self._spill.rewind()
                total = len(rest) + len(self._spill)
                kept = self._spill.rewrite(rest)
                if kept < total:
                    self._drop("shutdown", total - kept)
                if kept:
                    log.warning("%d undelivered events kept in %s for the next start", kept, self._spill.path)
                self._spill.close()
            elif rest:
                self._drop("shutdown", len(rest))
        self._reset_producer()
        M.EVENTS_BUFFERED.set(self.buffered)

    def _drop(self, reason: str, n: int) -> None:
        with self._drop_lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
            total = sum(self.dropped.values())
        M.EVENTS_DROPPED.labels(reason).inc(n)
        now = time.monotonic()
        if now - self._last_drop_log > 5.0:
            self._last_drop_log = now
            log.error("dropped %d event(s) (%s); %d dropped in total since start", n, reason, total)
