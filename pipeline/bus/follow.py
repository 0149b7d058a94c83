"""Follow topics for as long as a process runs: read, hand each record on, reconnect, go on.

:class:`Follower` is the one "read a topic, reconnect on errors, go on" loop of the pipeline
(the proxy's ``control`` follower, the dashboard's topic reader). It wraps a
:class:`~pipeline.bus.TopicReader` (assign mode: no group, nothing committed) and adds what a
long-lived follower needs and a bounded read does not:

- **Reconnect.** Any error of the reader (broker gone, topic deleted, a time-out) closes it,
  reports the error (:attr:`Follower.error`, ``on_error``), waits ``backoff_s`` (doubling up to
  ``max_backoff_s``; reset by the next successful poll) and opens a new reader. With
  ``resume=True`` the new reader starts after the last record already handed on, per partition
  (nothing handed on twice, nothing skipped); with ``resume=False`` it starts at ``start``
  again and ``on_error`` is where the owner forgets what it had folded (the dashboard).
- **The record rules of** :class:`~pipeline.bus.ConsumerApp`: records that do not decode or do
  not belong on their topic are dead-lettered by the reader (``dlq=True``) or handed on as
  :class:`~pipeline.bus.Undecodable` (``dlq=False``, observers); a handler that raises
  dead-letters its record (``dlq=True``; observers log it) and following goes on: one record
  never stops the follower.
- **Shutdown as** :class:`~pipeline.bus.ConsumerApp`: :meth:`Follower.stop` (thread/signal-safe)
  ends the loop after the records of the current poll, also ends a dead-letter retry
  (:class:`~pipeline.bus.DeadLetterError`: the record is not passed over, the follower stops),
  and closes the reader. Nothing is committed, ever.

Typical use (a daemon thread)::

    follower = Follower(config, config.topics.name("control"), apply, name="proxy",
                        start=Offset(0), partitions=[0], dlq=True, dlq_give_up_s=10).start()
    ...
    follower.stop()
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Iterable

from pipeline.bus.reader import Offset, Start, TopicReader, Undecodable
from pipeline.bus.records import DeadLetterError
from pipeline.config import Config

log = logging.getLogger(__name__)


class Follower:
    """Follow ``topics`` until stopped, reconnecting on errors (see the module docstring).

    Args:
        config: the process config (``kafka``, ``topics``).
        topics: a physical topic name or several (``resume=True`` needs exactly one).
        handle: called with each record (a :class:`~pipeline.bus.Record`, or for observers
            also an :class:`~pipeline.bus.Undecodable`), from the follower's thread.
        name: the stage name (metrics labels, logs, dead letters; the thread is ``<name>-follow``).
        start: where the first reader starts (see :class:`~pipeline.bus.TopicReader`).
        resume: after a reconnect, start after the last record handed on (True) or at ``start``
            again (False).
        partitions: read only these partition numbers (default: all).
        dlq / dlq_give_up_s: see :class:`~pipeline.bus.TopicReader`.
        after_batch: called after each non-empty poll (e.g. to publish a folded state once).
        on_error: called with the exception after the reader failed and was closed.
        backoff_s / max_backoff_s: the wait before reconnecting, doubling up to the maximum.
        refresh_s: how often topics that appeared meanwhile are picked up.
        poll_timeout_ms: the longest one poll waits for records.
        reader_options: extra :class:`~pipeline.bus.TopicReader` keywords (kafka-python
            consumer settings such as ``bootstrap_timeout_ms``).

    Attributes:
        records: raw records polled (dead-lettered ones included) since the follower started.
        error: ``"<type>: <message>"`` of the last reader failure; None again after a good poll.
        caught_up: the current reader reached every partition's high watermark at least once.
        reader: the current reader (None between two).

    Raises:
        ValueError: ``resume=True`` with several topics (offsets are kept per partition).
    """

    def __init__(self, config: Config, topics: str | Iterable[str], handle: Callable, *, name: str,
                 start: Start = "beginning", resume: bool = True, partitions: Iterable[int] | None = None,
                 dlq: bool = False, dlq_give_up_s: float | None = None, after_batch: Callable[[], None] | None = None,
                 on_error: Callable[[Exception], None] | None = None, backoff_s: float = 0.5,
                 max_backoff_s: float = 5.0, refresh_s: float = 5.0, poll_timeout_ms: int = 200,
                 **reader_options) -> None:
        self.topics = [topics] if isinstance(topics, str) else list(topics)
        if resume and len(self.topics) != 1:
            raise ValueError(f"{name}: resume=True needs a single topic, not {self.topics}")
        self.config, self.handle, self.name = config, handle, name
        self.start_at, self.resume = start, resume
        self.partitions = list(partitions) if partitions is not None else None
        self.dlq, self.dlq_give_up_s = dlq, dlq_give_up_s
        self.after_batch, self.on_error = after_batch, on_error
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.refresh_s, self.poll_timeout_ms = refresh_s, poll_timeout_ms
        self.reader_options = reader_options
        self.records = 0
        self.error: str | None = None
        self.caught_up = False
        self.reader: TopicReader | None = None
        self._backoff = backoff_s
        self._next: dict[int, int] = {}  # partition -> offset after the last record handed on
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self.run, name=f"{name}-follow", daemon=True)

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Follower":
        """Follow in a daemon thread."""
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Ask the loop to finish (also ends a dead-letter retry); join the thread if started."""
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called."""
        return self._stop.is_set()

    def high_watermarks(self) -> dict[tuple[str, int], int]:
        """The current reader's known high watermarks (empty between readers; any thread)."""
        r = self.reader
        try:
            return r.high_watermarks() if r is not None else {}
        except Exception:  # noqa: BLE001 - the follower thread may be closing it
            return {}

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Follow until :meth:`stop` (blocking; :meth:`start` runs it in a thread)."""
        self._backoff = self.backoff_s
        while not self._stop.is_set():
            try:
                self.reader = self._open()
                self._follow(self.reader)
            except DeadLetterError as e:  # stopped while a dead letter was undeliverable: not passed over
                log.warning("%s", e)
            except Exception as e:  # broker gone, topic missing: report, wait, reconnect
                self._failed(e)
                continue
            finally:
                self._close()
            return

    def _failed(self, e: Exception) -> None:
        first = self.error is None
        self.error = f"{type(e).__name__}: {e}"
        self.caught_up = False
        log.log(logging.WARNING if first else logging.DEBUG, "%s: following %s failed (%s); reconnecting in %.1f s",
                self.name, ", ".join(self.topics), self.error, self._backoff)
        self._close()
        if self.on_error is not None:
            self._safe(self.on_error, e)
        self._stop.wait(self._backoff)
        self._backoff = min(self._backoff * 2, self.max_backoff_s)

    def _open(self) -> TopicReader:
        """A reader at ``start``; when resuming, after the last record handed on of each partition
        read so far (the others per ``start``, or per ``Offset.otherwise``)."""
        start = self.start_at
        if self.resume and self._next:
            if isinstance(start, Offset):
                start = Offset(per_partition={**(start.per_partition or {}), **self._next}, otherwise=start.otherwise)
            else:
                start = Offset(per_partition=dict(self._next), otherwise=start)
        return TopicReader(self.config, self.topics, start, self.partitions, name=self.name, dlq=self.dlq,
                           dlq_give_up_s=self.dlq_give_up_s, stop=self._stop, **self.reader_options)

    def _follow(self, reader: TopicReader) -> None:
        refreshed = time.monotonic()
        while not self._stop.is_set():
            batch = reader.poll_raw(self.poll_timeout_ms)
            self._backoff, self.error = self.backoff_s, None
            for raw in batch:
                rec = reader.decode(raw)  # a bad record: dead-lettered first (None) or Undecodable
                self._next[raw.partition] = raw.offset + 1
                self.records += 1
                if rec is not None:
                    self._handle(reader, raw, rec)
            if batch and self.after_batch is not None:
                self._safe(self.after_batch)
            self.caught_up = self.caught_up or reader.caught_up()
            if time.monotonic() - refreshed > self.refresh_s:
                refreshed = time.monotonic()
                reader.refresh()

    def _handle(self, reader: TopicReader, raw, rec) -> None:
        try:
            self.handle(rec)
        except Exception as e:  # a follower never stops on one record
            log.exception("%s: handler failed on %s[%d]@%d", self.name, raw.topic, raw.partition, raw.offset)
            if self.dlq and not isinstance(rec, Undecodable):
                reader.dead_letter(raw, f"handler error: {type(e).__name__}: {e}")

    def _safe(self, fn, *args) -> None:
        try:
            fn(*args)
        except Exception:  # noqa: BLE001 - an owner's callback never stops the follower
            log.exception("%s: callback %s failed", self.name, getattr(fn, "__name__", fn))

    def _close(self) -> None:
        r, self.reader = self.reader, None
        if r is not None:
            try:
                r.close()
            except Exception:  # noqa: BLE001 - closing a reader of a broker that is gone
                pass
