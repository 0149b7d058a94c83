"""Durable, ordered, loss-accounted event publishing: serving never waits for Kafka.

Flow of one event::

    event loop --publish()--> (end of the loop iteration) group commit --> disk buffer --sender--> Kafka
                   |            on the loop, or by the writer thread         + memory mirror
                   |            (backlog, fsync)                             (memory if no disk)
                   +-- DurableSend: the response's last byte waits until its events are committed

- :meth:`EventPublisher.publish` only appends to a list (a few microseconds); it never blocks
  and never raises. The events of one event-loop iteration are committed together right after
  it (one callback): encoded (msgpack) and appended to the
  :class:`pipeline.proxy.buffer.DiskBuffer` in one transaction (group commit). The event loop
  does this itself (``inline_commit``, the default): one SQLite statement, no hand-off to a
  thread and back. The writer thread commits instead with ``buffer_fsync`` (a commit waits for
  the disk), while earlier events are still in its hands (order), right after a checkpoint
  (its commit starts the WAL over, which syncs), or when it holds the buffer for more than
  ``INLINE_LOCK_WAIT_S``; it commits everything that arrived meanwhile at once. Work whose
  length grows with the data stays on the writer thread: deleting what the broker
  acknowledged, WAL checkpoints, compaction and housekeeping hooks. Then the responses
  waiting in :meth:`durable` are released. A response is completed only after its events are
  committed (:class:`DurableSend` holds its last body message): a proxy killed right after it
  answered loses nothing, the next proxy on the same buffer folder sends what it left.
- If the disk buffer refuses a group (``buffer_max_bytes`` reached, disk full, I/O error), those
  events are held in memory (up to ``max_buffer``, counted in
  ``pipeline_proxy_events_not_durable_total{reason}`` and logged) and, until that memory backlog
  has drained, newer events go there too so the backlog stays one FIFO. Beyond ``max_buffer``
  an event is dropped and counted. Serving never fails because of the buffer.
- Without a buffer folder (``buffer_dir=None``: tests and benchmarks only) the backlog is the
  memory deque alone and :meth:`durable` returns at once.
- The sender thread owns one idempotent producer (acks=all; librdkafka or kafka-python, see
  :mod:`pipeline.bus.window_producer`). It takes a window of the oldest events (gathered for up to
  ``linger_s``) from the memory mirror of the rows just committed (up to ``mirror_max_bytes``;
  past it, read back from the buffer), sends it, and waits until each record is acknowledged or failed. The
  acknowledged prefix is deleted from the buffer; the rest is sent again after a back-off with a
  fresh producer (a broker that restarted does not know the old producer id). Events stay
  queued for as long as the broker is away; nothing times out of the backlog.

Order: one sender and one window at a time, in buffer order, so events are delivered in the
order they were published (per session partition too). Delivery is at-least-once: a window
whose acknowledgement was lost (broker or proxy crash) is sent again. Consumers de-duplicate by
the events' ids: ``request_id`` of ``turn`` and ``next_state`` events (``<process prefix>-<n>``,
unique per proxy process), ``session_id`` of ``session_end``.

At :meth:`close`, undelivered events stay in the disk buffer for the next start; without one
(or what was held in memory and still does not fit) they are counted as dropped
(``reason="shutdown"``).
"""

from __future__ import annotations

import asyncio
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
from pipeline.proxy.buffer import CHECKPOINT_EVERY, DiskBuffer, EventBufferError, EventBufferFull
from pipeline.bus.window_producer import have_librdkafka, make_transport

log = logging.getLogger(__name__)
# the event loop waits this long for the writer thread's commit lock (it holds it to delete one
# acknowledged window: well under a millisecond) before it hands its group to the writer instead
INLINE_LOCK_WAIT_S = 0.001
_WAKE = object()  # inbox marker: work for the writer besides a group (delete what the sender delivered, housekeeping)


class _Encoded:
    """A group the event loop encoded but could not commit: the writer thread commits it."""

    __slots__ = ("items", "n")

    def __init__(self, items: list, n: int) -> None:
        self.items = items  # (topic, key, msgpack bytes)
        self.n = n  # events published (those that failed to encode were counted already)


class EventPublisher:
    """Background publisher of events to Kafka through a durable disk buffer.

    Args:
        config: the process config (``kafka`` section for the producer).
        max_buffer: events held in memory when the disk buffer refuses them (or, without a
            buffer folder, in all); beyond it events are dropped and counted.
        buffer_dir: folder of the durable buffer (:class:`pipeline.proxy.buffer.DiskBuffer`,
            locked while open); None: memory only, nothing survives a crash (tests, benchmarks).
        buffer_max_bytes: size bound of the disk buffer.
        buffer_fsync: fsync every group commit (survives power loss) instead of leaving the
            writes to the operating system (survives a crash of the proxy).
        window: most events in flight at once.
        linger_s: how long the sender gathers events before sending a window (fewer produce
            requests; adds at most this much to the delivery delay, never to a response).
        kafka_client: ``auto`` (librdkafka when installed), ``librdkafka`` or ``kafka-python``
            (see :mod:`pipeline.bus.window_producer`).
        delivery_timeout_ms: how long the Kafka client retries one window before it is failed and
            retried by this class with a fresh producer.
        compact_bytes: when the buffer has drained and its files are larger than this, they are
            compacted (:meth:`DiskBuffer.compact`).
        name: stage label for the bus metrics.
        mirror_max_bytes: most bytes of committed events kept in memory beside the disk buffer, so
            that the sender takes them from there instead of reading them back from SQLite
            (:meth:`_committed`); beyond it (a broker away for long) the sender reads the buffer.
        checkpoint_every: commits between two checkpoints of the buffer's WAL (:meth:`_housekeep`).
        inline_commit: commit a loop iteration's events on the event loop when the writer thread
            holds nothing (:meth:`_commit_inline`). On by default since the commit became one
            SQLite statement (a multi-row ``INSERT``, ids given by the buffer): the loop releases
            the GIL once per commit instead of once per row and query, and the hand-off to the
            writer thread and back (two wake-ups, a future per response) is gone. Measured with
            ``bench/proxy.py`` (docs/guide.md, n=3): 16-client throughput 2.87-3.29x the naive
            forwarder's (2.46-2.61x before), streaming TTFT within naive's at 1 and 16 clients in
            every run. Off: every group goes through the writer thread.

    Raises:
        ImportError: ``kafka_client="librdkafka"`` without confluent-kafka installed.
        ValueError: an unknown ``kafka_client``.
        pipeline.proxy.buffer.EventBufferError: the buffer folder cannot be opened or is locked
            by another process.
    """

    def __init__(self, config: Config, max_buffer: int = 10_000, buffer_dir: str | None = None,
                 buffer_max_bytes: int = 1 << 30, buffer_fsync: bool = False, window: int = 2000,
                 delivery_timeout_ms: int = 30_000, linger_s: float = 0.01, kafka_client: str = "auto",
                 compact_bytes: int = 64 << 20, name: str = "proxy", inline_commit: bool = True,
                 mirror_max_bytes: int = 64 << 20, checkpoint_every: int = CHECKPOINT_EVERY) -> None:
        if kafka_client == "librdkafka" and not have_librdkafka():
            raise ImportError("proxy.kafka_client=librdkafka needs: pip install confluent-kafka")
        if kafka_client not in ("auto", "librdkafka", "kafka-python"):
            raise ValueError(f"kafka_client must be auto, librdkafka or kafka-python, got {kafka_client!r}")
        self.config = config
        self.name = name
        self.max_buffer = max(1, max_buffer)
        self.inbox_max = self.max_buffer + 10_000  # safety net only: the writer thread drains it continuously
        self.window = max(1, window)
        self.linger_s = max(0.0, linger_s)
        self.delivery_timeout_ms = delivery_timeout_ms
        self.compact_bytes = compact_bytes
        self.inline_commit = inline_commit
        self.kafka_client = kafka_client
        self._buf = DiskBuffer(buffer_dir, buffer_max_bytes, buffer_fsync) if buffer_dir else None
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # lists of (topic, key, event), _Encoded, _WAKE, None (stop)
        self._pending: deque = deque()  # published in this loop iteration, not yet handed to the writer
        self._flush_scheduled = False
        self._hooks: list = []  # run after each group commit (add_commit_hook)
        self._housekeeping_hooks: list = []  # run by the writer thread (add_housekeeping_hook)
        # the writer thread makes the next commit: the WAL is new (at start, after a checkpoint or a
        # compaction) and its first commit syncs its header (never on the event loop)
        self._writer_commits_next = True
        self._wake_asked = False  # an inline commit asked the writer thread for a checkpoint
        self._commit_lock = threading.Lock()  # one committer at a time: the writer thread or the event loop
        self._in = 0  # events accepted by publish() (event loop only)
        self._out = 0  # events the writer has committed or accounted for (writer only)
        self._waiters: deque = deque()  # (seq, future), event loop only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._mem: deque = deque()  # memory backlog (no buffer folder, or the disk refused)
        self._lock = threading.Condition()
        self._inflight: list = []  # a window taken from memory, while it is sent
        self._mirror: deque = deque()  # committed buffer rows (id, topic, key, value), contiguous ids, for the sender
        self._mirror_bytes = 0
        self._committed_id = self._buf.last_id if self._buf is not None else 0  # newest row the sender may send
        self.mirror_max_bytes = mirror_max_bytes
        self.checkpoint_every = max(1, checkpoint_every)
        self._sent_id = 0  # last buffer row acknowledged by the broker (sender)
        self._deleted_id = 0  # last buffer row deleted (writer)
        self._transport = None
        self._stop = threading.Event()
        self._writer_done = threading.Event()
        self._deadline = float("inf")
        self._finished = False
        self._threads: list[threading.Thread] = []
        self._drop_lock = threading.Lock()
        self.dropped: dict[str, int] = {}
        self.not_durable: dict[str, int] = {}
        self.delivered = 0
        self.broker_connected = False
        self._last_error_log = 0.0
        self._backoff = 0.2

    # ---- caller side (event loop) -------------------------------------------------------------
    def publish(self, topic: str, event: events.Event, key: str | None) -> bool:
        """Queue one event; never blocks. Returns False (and counts a drop) if it was refused."""
        if self._stop.is_set():
            self._drop("closed", 1)
            return False
        if self._in - self._out >= self.inbox_max:  # writer thread stalled: protect memory
            self._drop("inbox_full", 1)
            return False
        self._in += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # outside an event loop (tests, tools): straight to the writer
            self._inbox.put([(topic, key, event)])
            return True
        self._pending.append((topic, key, event))
        if not self._flush_scheduled:  # one hand-over (one wake of the writer) per loop iteration
            self._flush_scheduled = True
            loop.call_soon(self._hand_over)
        return True

    def _hand_over(self, inline: bool = True) -> None:
        """Commit every event published since the last hand-over as one group (event loop; also
        :meth:`close`, with ``inline`` False): the events of one loop iteration go into one
        group commit. When the writer thread has nothing in hand (every earlier event is
        committed, nothing else holds the buffer) and commits do not fsync, the group is
        committed right here with ``inline_commit`` (:meth:`_commit_inline`): no hand-off to the
        writer thread and back (two thread wake-ups and GIL hand-offs per group). Otherwise it
        goes to the writer."""
        self._flush_scheduled = False
        batch = []
        pending = self._pending
        while pending:
            batch.append(pending.popleft())
        if not batch:
            return
        if inline and self._commit_inline(batch):
            return
        self._inbox.put(batch)

    def _commit_inline(self, batch: list) -> bool:
        """Encode and commit ``batch`` on the event loop, in order after everything published
        before it, and release the responses waiting for it. Only an append: deleting what was
        delivered, checkpoints (and the WAL's start-over that follows one, which syncs),
        compaction and housekeeping hooks stay with the writer thread. False (nothing done)
        when the writer thread must commit: ``inline_commit`` off, no disk buffer, fsync on
        every commit, stopping, events still in the writer's hands or in the memory backlog
        (order), a checkpoint just ran, or the writer holds the buffer for longer than
        ``INLINE_LOCK_WAIT_S`` (measured: waiting that long instead of handing over at once cut
        the groups that went to the writer at 16 clients from 30% to 3%, and the proxy's CPU per
        request by 10%). A group the buffer refuses (full, I/O error: nothing of it applied)
        goes to the writer thread encoded."""
        buf = self._buf
        if (not self.inline_commit or buf is None or buf.fsync or not self._threads or self._stop.is_set()
                or self._writer_commits_next or self._out != self._in - len(batch)
                or not self._commit_lock.acquire(True, INLINE_LOCK_WAIT_S)):
            return False
        try:
            if (self._stop.is_set() or self._writer_commits_next or self._out != self._in - len(batch)
                    or self._in_memory()):
                return False  # re-checked under the lock: the writer may have moved on while the loop waited
            items: list = []
            self._encode(batch, items)
            before = buf.last_id
            t0 = time.perf_counter()
            try:
                buf.append(items)
            except EventBufferError:
                self._inbox.put(_Encoded(items, len(batch)))  # the writer's fallbacks: halves, memory
                return True
            M.BUFFER_COMMIT.observe(time.perf_counter() - t0)
            self._committed(before + 1, items)
            self._run_commit_hooks()
            self._out += len(batch)
            if buf.checkpoint_due(self.checkpoint_every) and not self._wake_asked:
                self._wake_asked = True  # also while the broker is away (no acknowledgement wakes it)
                self._inbox.put(_WAKE)
        finally:
            self._commit_lock.release()
        self._wake()
        with self._lock:
            self._lock.notify_all()
        return True

    @property
    def durable_enabled(self) -> bool:
        """True when events go to a disk buffer (False: memory only)."""
        return self._buf is not None

    async def durable(self) -> None:
        """Wait until every event published so far (from this event loop) is committed to the
        disk buffer, or was refused by it and accounted for. Returns at once without a buffer."""
        seq = self._in
        if self._buf is None or self._out >= seq or self._writer_done.is_set():
            return
        loop = self._loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiters.append((seq, fut))
        if self._out >= seq or self._writer_done.is_set():  # the writer may have passed meanwhile
            self._wake()
        await fut

    def _wake(self) -> None:  # event loop
        out = self._out
        done = self._writer_done.is_set()
        while self._waiters and (self._waiters[0][0] <= out or done):
            _, fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(None)

    def _notify_waiters(self) -> None:  # writer thread
        loop = self._loop
        if self._waiters and loop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(self._wake)
            except RuntimeError:  # loop closed meanwhile
                pass

    def start(self) -> "EventPublisher":
        """Start the writer and sender threads."""
        for target, name in ((self._writer, "proxy-publish-writer"), (self._sender, "proxy-publish-sender")):
            t = threading.Thread(target=target, name=name, daemon=True)
            t.start()
            self._threads.append(t)
        return self

    @property
    def buffered(self) -> int:
        """Events accepted but not yet acknowledged (inbox + disk buffer + memory + in flight)."""
        return ((self._in - self._out) + (self._buf.count if self._buf is not None else 0) + len(self._mem)
                + len(self._inflight))

    def stats(self) -> dict[str, Any]:
        """Counters for tests, logs and ``/readyz``."""
        return {"buffered": self.buffered, "delivered": self.delivered,
                "on_disk": self._buf.count if self._buf is not None else 0, "in_memory": len(self._mem),
                "not_durable": dict(self.not_durable), "dropped": dict(self.dropped),
                "dropped_total": sum(self.dropped.values()), "broker_connected": self.broker_connected,
                "buffer": str(self._buf.dir) if self._buf is not None else None}

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until nothing is buffered (True) or ``timeout_s`` passes (False). For tests/bench."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.buffered == 0:
                return True
            time.sleep(0.01)
        return self.buffered == 0

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop accepting, deliver what is possible within ``timeout_s``; the rest stays on disk."""
        if self._stop.is_set():
            return
        self._deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._hand_over(inline=False)  # what was published in the loop's last iteration, to the writer
        self._inbox.put(None)
        with self._lock:
            self._lock.notify_all()
        for t in self._threads:
            t.join(timeout_s + 5)
        self._finish()

    # ---- writer thread ------------------------------------------------------------------------
    def _writer(self) -> None:
        try:
            while True:
                first = self._inbox.get()
                batch = [first]
                while len(batch) < 4096:  # group commit: everything that arrived meanwhile
                    try:
                        batch.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                stop = False
                n = 0
                items = []
                for it in batch:
                    if it is None:
                        stop = True
                    elif isinstance(it, _Encoded):
                        n += it.n
                        items.extend(it.items)
                    elif it is not _WAKE:
                        n += len(it)
                        self._encode(it, items)
                with self._commit_lock:
                    self._store(items)
                    self._run_commit_hooks()
                    self._out += n
                self._notify_waiters()
                with self._lock:
                    self._lock.notify_all()
                self._housekeep()
                M.EVENTS_BUFFERED.set(self.buffered)
                if stop:
                    break
        finally:
            self._writer_done.set()
            self._notify_waiters()

    def add_commit_hook(self, hook) -> None:
        """Run ``hook()`` in the writer thread after each group commit, before the responses
        waiting for it are released (:class:`DurableSend`): what it writes is on disk before
        those responses complete (the proxy's turn index, :class:`pipeline.proxy.feedback.TurnIndex`).
        A hook runs on the event loop when the loop commits (``inline_commit``): it must not
        block for long (one write, no rewrite of a file) and must not raise (an exception is
        logged and ignored); long work goes to :meth:`add_housekeeping_hook`."""
        self._hooks.append(hook)

    def add_housekeeping_hook(self, hook) -> None:
        """Run ``hook()`` in the writer thread with each checkpoint of the buffer (every
        ``checkpoint_every`` commits, also while the broker is away), holding the commit lock:
        no commit and no commit hook runs meanwhile, and never on the event loop, so it may take
        long (the turn index's rewrite). It must not raise (an exception is logged and ignored)."""
        self._housekeeping_hooks.append(hook)

    def _run_commit_hooks(self, hooks: list | None = None) -> None:
        for hook in self._hooks if hooks is None else hooks:
            try:
                hook()
            except Exception as e:  # noqa: BLE001 - the writer thread must go on
                self._log_error(f"commit hook {getattr(hook, '__qualname__', hook)!r} failed: {e}")

    def _encode(self, published: list, items: list) -> None:
        """Append ``(topic, key, msgpack bytes)`` of each ``(topic, key, event)`` of ``published``
        to ``items``; an event that cannot be encoded is dropped and counted."""
        for topic, key, ev in published:
            try:
                items.append((topic, key, events.encode(ev)))
            except Exception as e:  # a bug upstream must not kill the thread
                self._drop("invalid", 1)
                log.error("event %s could not be encoded: %s", getattr(ev, "TYPE", "?"), e)

    def _store(self, items: list) -> None:
        """Commit ``items`` and delete what the broker acknowledged, in one transaction — to disk,
        else to the memory backlog (writer thread, holding ``_commit_lock``). A group the buffer
        cannot take whole: what fits is committed, the rest goes to memory, counted."""
        buf = self._buf
        if buf is None:
            self._to_memory(items, None)
            return
        ack = self._sent_id if self._sent_id > self._deleted_id else None
        if items and self._in_memory():  # the memory backlog must drain first: one FIFO
            self._to_memory(items, "behind_memory")
            items = []
        if not items and ack is None:
            return
        t0 = time.perf_counter()
        before = buf.last_id
        err = None
        try:
            try:
                buf.append(items, delete_through=ack)
                done = len(items)
            except EventBufferFull:
                if ack is not None:
                    buf.delete_through(ack)  # free what was delivered first
                done, err = self._append_what_fits(items)
            if ack is not None:
                self._deleted_id = ack
        except EventBufferError as e:  # nothing of the group was applied
            self._to_memory(items, "disk_error")
            self._log_error(f"event buffer refused {len(items)} event(s), held in memory: {e}")
            return
        if done or ack is not None:
            self._writer_commits_next = False  # this commit started the WAL over if a checkpoint asked it
        self._committed(before + 1, items[:done])
        if done < len(items):
            reason = "disk_error" if err is not None and not isinstance(err, EventBufferFull) else "buffer_full"
            self._to_memory(items[done:], reason)
            self._log_error(f"event buffer {buf.dir} refused {len(items) - done} event(s) ({err}): held in memory")
        if items:
            M.BUFFER_COMMIT.observe(time.perf_counter() - t0)

    def _in_memory(self) -> bool:
        """Whether events wait in the memory backlog, or in a window the sender took from it (a
        failed window goes back there, ahead of what is on disk)."""
        with self._lock:
            return bool(self._mem or self._inflight)

    def _housekeep(self) -> None:
        """Writer thread, after each wake-up: copy the WAL into the database once
        ``checkpoint_every`` commits were made (holding the commit lock, so that it copies all of
        it; then the writer thread makes the next commit, which starts the WAL over and syncs
        its header, never the event loop) and run the housekeeping hooks in the same hold, and
        compact the buffer once it has drained and its files grew beyond ``compact_bytes``."""
        buf = self._buf
        self._wake_asked = False
        if buf is None:
            return
        if buf.checkpoint_due(self.checkpoint_every):
            with self._commit_lock:
                try:
                    self._writer_commits_next = buf.maybe_checkpoint(self.checkpoint_every) or self._writer_commits_next
                except EventBufferError as e:
                    self._log_error(str(e))
                self._run_commit_hooks(self._housekeeping_hooks)
        if not buf.count and buf.file_bytes() > self.compact_bytes:
            with self._commit_lock:
                if buf.count == 0:
                    try:
                        buf.compact()
                    except EventBufferError as e:
                        self._log_error(str(e))
                    self._writer_commits_next = True  # the WAL was truncated: a new one starts

    def _committed(self, first_id: int, items: list) -> None:
        """Show the sender the rows just committed (ids ``first_id`` on), and keep them in memory
        so that it sends them without reading them back from SQLite. The mirror holds contiguous
        ids only: rows that find it full (``mirror_max_bytes``) are left out, and so is every row
        after them until the sender has emptied it; meanwhile the sender reads the buffer, and
        takes the mirror again once its first row is the next one to send."""
        if not items:
            return
        size = sum(len(v) for _, _, v in items)
        with self._lock:
            self._committed_id = first_id + len(items) - 1
            m = self._mirror
            if (m and m[-1][0] != first_id - 1) or self._mirror_bytes + size > self.mirror_max_bytes:
                return
            m.extend((first_id + i, t, k, v) for i, (t, k, v) in enumerate(items))
            self._mirror_bytes += size

    def _mirror_drop_through(self, last_id: int) -> None:
        """Forget mirrored rows with id ``<= last_id`` (delivered). Caller holds ``_lock``."""
        m = self._mirror
        while m and m[0][0] <= last_id:
            self._mirror_bytes -= len(m.popleft()[3])

    def _take_rows(self) -> list | None:
        """The next window of buffer rows from the mirror when it starts at the next row to send;
        None when the sender must read the buffer. Caller holds ``_lock``."""
        self._mirror_drop_through(self._sent_id)
        m = self._mirror
        if not m or m[0][0] != self._sent_id + 1:
            return None
        return [m[i] for i in range(min(self.window, len(m)))]

    def _append_what_fits(self, items: list) -> tuple[int, EventBufferError | None]:
        """Append the longest prefix of ``items`` the buffer takes, halving the group while it is
        full; returns how many were appended and the error that stopped the rest (None: all).
        Never raises: rows already appended stay counted even when a later half fails."""
        if not items:
            return 0, None
        try:
            self._buf.append(items)
            return len(items), None
        except EventBufferFull as e:
            if len(items) == 1:
                return 0, e
        except EventBufferError as e:
            return 0, e
        half = len(items) // 2
        n, err = self._append_what_fits(items[:half])
        if n < half:
            return n, err
        m, err = self._append_what_fits(items[half:])
        return half + m, err

    def _to_memory(self, items: list, reason: str | None) -> None:
        if not items:
            return
        with self._lock:
            room = self.max_buffer - len(self._mem) - len(self._inflight)
            take = items[:max(0, room)]
            self._mem.extend(take)
        if take and reason is not None:
            self.not_durable[reason] = self.not_durable.get(reason, 0) + len(take)
            M.EVENTS_NOT_DURABLE.labels(reason).inc(len(take))
        if len(take) < len(items):
            self._drop("buffer_full", len(items) - len(take))

    # ---- sender thread ------------------------------------------------------------------------
    def _disk_pending(self) -> bool:
        return self._committed_id > self._sent_id

    def _sender(self) -> None:
        while True:
            with self._lock:
                while not self._disk_pending() and not self._mem:
                    if self._stop.is_set() and self._writer_done.is_set():
                        return
                    self._lock.wait(0.5)
                if self._stop.is_set() and time.monotonic() > self._deadline:
                    return
            if self.linger_s > 0:  # gather a bigger window (one produce request per window); woken
                self._stop.wait(self.linger_s)  # only by close(), not by each group commit meanwhile
            with self._lock:
                if self._finished:
                    return
                from_disk = self._disk_pending()
                rows = self._take_rows() if from_disk else None
                if not from_disk:
                    k = min(self.window, len(self._mem))
                    self._inflight = [self._mem.popleft() for _ in range(k)]
            if from_disk:
                if rows is None:
                    try:
                        rows = self._buf.read(self._sent_id, self.window)
                    except Exception as e:  # noqa: BLE001 - the buffer's reader must not kill the thread
                        self._log_error(f"event buffer read failed: {e}")
                        time.sleep(0.5)
                        continue
                items = [(t, k, v) for _, t, k, v in rows]
            else:
                items = self._inflight
            ok = self._send_window(items)
            with self._lock:
                if self._finished:  # close() gave up waiting and already accounted for this window
                    return
                good = sum(ok)
                if from_disk:
                    prefix = next((i for i, g in enumerate(ok) if not g), len(ok))
                    if prefix:
                        self._sent_id = rows[prefix - 1][0]
                        self._mirror_drop_through(self._sent_id)
                        self._inbox.put(_WAKE)  # the writer deletes them in its next commit
                    failed = len(ok) - prefix
                else:
                    back = [it for it, g in zip(items, ok) if not g]
                    self._mem.extendleft(reversed(back))
                    self._inflight = []
                    failed = len(back)
                self.delivered += good
            M.EVENTS_BUFFERED.set(self.buffered)
            if failed:
                self._on_window_failed(failed)
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
        while time.monotonic() < end and not self._give_up():
            time.sleep(0.05)
        self._backoff = min(self._backoff * 2, 5.0)

    def _reset_producer(self) -> None:
        t, self._transport = self._transport, None
        if t is not None:
            t.close()

    def _give_up(self) -> bool:
        return self._stop.is_set() and time.monotonic() > self._deadline

    def _send_window(self, items: list) -> list[bool]:
        """Send ``items`` and wait for every acknowledgement; per item, whether it was acknowledged."""
        if not items:
            return []
        try:
            if self._transport is None:
                self._transport = make_transport(self.config, self.kafka_client, self.delivery_timeout_ms)
        except Exception as e:
            log.debug("producer not available: %s", e)
            return [False] * len(items)
        if self._finished:
            return [False] * len(items)
        ok = self._transport.send_window(items, self._give_up)
        done = sum(ok)
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
        if done < len(items):
            EVENTS_FAILED.labels(self.name, items[0][0]).inc(len(items) - done)
        return ok

    # ---- shutdown and accounting ----------------------------------------------------------------
    def _finish(self) -> None:
        with self._lock:
            self._finished = True
            rest = list(self._inflight) + list(self._mem)
            self._inflight, self._mem = [], deque()
        rest += self._left_in_inbox()
        buf = self._buf
        if buf is not None:
            locked = self._commit_lock.acquire(timeout=5.0)  # an event-loop commit still running finishes first
            if rest:  # held in memory while the disk refused them: one more try
                try:
                    buf.append(rest)
                    rest = []
                except EventBufferError as e:
                    log.error("event buffer still refuses %d event(s) at shutdown: %s", len(rest), e)
            if self._sent_id > self._deleted_id:
                try:
                    buf.delete_through(self._sent_id)
                    self._deleted_id = self._sent_id
                except EventBufferError:
                    pass  # sent again by the next process: at-least-once
            if buf.count:
                log.warning("%d undelivered events kept in %s for the next start", buf.count, buf.dir)
            buf.close()
            if locked:
                self._commit_lock.release()
        if rest:
            self._drop("shutdown", len(rest))
        self._reset_producer()
        M.EVENTS_BUFFERED.set(self.buffered)

    def _left_in_inbox(self) -> list:
        """Encoded events the writer thread did not take before it stopped (a group handed over
        by the event loop while :meth:`close` ran): kept with the rest, or counted as dropped."""
        items: list = []
        while True:
            try:
                it = self._inbox.get_nowait()
            except queue.Empty:
                return items
            if isinstance(it, _Encoded):
                items.extend(it.items)
                self._out += it.n
            elif isinstance(it, list):
                self._encode(it, items)
                self._out += len(it)

    def _log_error(self, msg: str) -> None:
        now = time.monotonic()
        if now - self._last_error_log > 5.0:
            self._last_error_log = now
            log.error(msg)

    def _drop(self, reason: str, n: int) -> None:
        with self._drop_lock:
            self.dropped[reason] = self.dropped.get(reason, 0) + n
            total = sum(self.dropped.values())
        M.EVENTS_DROPPED.labels(reason).inc(n)
        self._log_error(f"dropped {n} event(s) ({reason}); {total} dropped in total since start")


class DurableSend:
    """An ASGI ``send`` that completes a response only once its events are in the disk buffer.

    The last body message (``more_body`` false) waits for :meth:`EventPublisher.durable`; just
    before, ``before_final`` (if set) runs once — the proxy publishes ``session_end`` there, so
    that event too is committed before the client sees the end of the response.
    """

    __slots__ = ("_send", "_publisher", "before_final")

    def __init__(self, send, publisher: EventPublisher) -> None:
        self._send = send
        self._publisher = publisher
        self.before_final = None

    def run_before_final(self) -> None:
        """Run ``before_final`` if it has not run yet."""
        cb, self.before_final = self.before_final, None
        if cb is not None:
            cb()

    async def __call__(self, message: dict) -> None:
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            self.run_before_final()
            await self._publisher.durable()
        await self._send(message)
