"""The proxy's durable event buffer: a FIFO of encoded events in a local SQLite database.

Every event the proxy records is appended here *before* the response that produced it completes
(:class:`pipeline.proxy.publisher.EventPublisher` makes the response wait), and deleted only
after the broker acknowledged it. A proxy killed with ``kill -9`` leaves its undelivered events
in the file; the next proxy on the same folder sends them first. This is the disk buffer of log
shippers (Vector, Filebeat, Fluent Bit), built on SQLite — a well-kept library from Python's
standard library — instead of a file format of our own:

- **Group commit.** The publisher appends the events of one event-loop iteration (or, from its
  writer thread, everything that arrived while the previous commit ran) in one transaction: one
  ``write()`` (and with ``fsync=True`` one ``fsync``) per group, not per event. The rows of a
  group go in as one multi-row ``INSERT`` (up to ``ROWS_PER_INSERT`` rows a statement) with ids
  given here, not read back: Python's sqlite3 releases and re-takes the GIL around every SQLite
  step, and the event loop commits itself (``EventPublisher(inline_commit=True)``), so a commit
  is one step, not one per row plus a query. Deletions, checkpoints and compaction are the
  publisher's writer thread's. Measured here: ~30 us of CPU per request's
  commit (bench/proxy_stages.py), ~350 us per commit with fsync.
- **Durability.** Journal mode WAL. ``fsync=False`` (default, ``synchronous=NORMAL``): a commit
  is in the operating system before the response goes out, so it survives the proxy's crash or
  ``kill -9``; a power loss can take back the last commits (the database stays consistent).
  ``fsync=True`` (``synchronous=FULL``): every group is on the disk before its responses go out.
- **Append-only, crash-safe compaction.** Rows are appended with increasing ids; delivered rows
  are deleted in a transaction; :meth:`compact` (``VACUUM`` + WAL truncation, run when the
  buffer has drained and the file grew) is atomic. A crash at any point of any of these, or a
  torn last write of the WAL, leaves either the old or the new state: nothing committed is lost,
  nothing is half-written (SQLite checksums WAL frames and ignores a torn tail).
- **Bounded.** ``max_bytes`` caps the database (``PRAGMA max_page_count``); a full buffer, a full
  disk or an I/O error raise :class:`EventBufferFull` / :class:`EventBufferError` from :meth:`append` and
  the caller decides (the publisher keeps such events in memory and counts them).
- **One owner.** The folder is locked (``flock`` on ``LOCK``) while a buffer is open: a second
  proxy pointed at the same folder fails at start instead of interleaving with the first.

Threads: one writer at a time (``append``, ``delete_through``, ``compact``, ``maybe_checkpoint``;
the publisher serialises its event loop and its writer thread) and one reader (``read``); each
uses its own connection (WAL lets the reader run beside the writer). The writer connection does
not checkpoint on its own (``wal_autocheckpoint=0``): :meth:`maybe_checkpoint` does, from the
publisher's writer thread.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import threading
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.files import lock_with_pid

log = logging.getLogger(__name__)
Item = tuple  # (topic: str, key: str | None, value: bytes)
Row = tuple  # (id: int, topic: str, key: str | None, value: bytes)
DB_NAME = "events.sqlite"

CHECKPOINT_EVERY = 256  # commits between two checkpoints of the WAL
WAL_KEEP_BYTES = 16 << 20  # the WAL file is cut back to this after a checkpoint let it start over
ROWS_PER_INSERT = 128  # rows per INSERT statement (4 parameters each; SQLite allows 32,766 since 3.32)


def _insert_sql(n: int) -> str:
    return "INSERT INTO events(id, topic, key, value) VALUES " + ",".join(("(?,?,?,?)",) * n)


# ids are given by :meth:`DiskBuffer.append` (files made before that have AUTOINCREMENT: the same order)
_SCHEMA = ("CREATE TABLE IF NOT EXISTS events ("
           "id INTEGER PRIMARY KEY, topic TEXT NOT NULL, key TEXT, value BLOB NOT NULL)")


class EventBufferError(PipelineError, OSError):
    """The buffer cannot be opened, or a write failed (I/O error, disk full)."""


class EventBufferFull(EventBufferError):
    """The buffer reached ``max_bytes`` or the disk is full: the append was rolled back."""


class EventBufferLocked(EventBufferError):
    """Another process holds the buffer folder."""


class DiskBuffer:
    """Durable FIFO of ``(topic, key, value)`` in ``<directory>/events.sqlite``.

    Args:
        directory: the buffer's folder (created). Events left by an earlier process are kept and
            read first.
        max_bytes: size bound of the database (rounded to pages; at least 64 pages).
        fsync: fsync every commit (``synchronous=FULL``) instead of leaving it to the OS.

    Raises:
        EventBufferLocked: another process has the folder open.
        EventBufferError: the database cannot be opened or is not a buffer.
    """

    def __init__(self, directory: str | os.PathLike, max_bytes: int = 1 << 30, fsync: bool = False) -> None:
        self.dir = Path(directory).expanduser()
        self.dir.mkdir(parents=True, exist_ok=True)
        self.path = self.dir / DB_NAME
        self.fsync = fsync
        self._lock_fd = self._lock()
        try:
            self._w = self._connect()
            self._w.execute("PRAGMA wal_autocheckpoint=0")  # never inside a commit: maybe_checkpoint()
            self._w.execute(f"PRAGMA journal_size_limit={WAL_KEEP_BYTES}")  # the WAL file left after a spike
            self._w.execute(_SCHEMA)
            page = self._w.execute("PRAGMA page_size").fetchone()[0]
            self.max_pages = max(64, int(max_bytes) // page)
            self._w.execute(f"PRAGMA max_page_count={self.max_pages}")
            self._r = self._connect()
            self.count, self.last_id = self._w.execute("SELECT count(*), coalesce(max(id), 0) FROM events").fetchone()
        except sqlite3.Error as e:
            self._unlock()
            raise EventBufferError(f"cannot open the event buffer {self.path}: {e}") from e
        self._commits = 0  # commits since the last checkpoint
        self._rlock = threading.Lock()
        if self.count:
            log.warning("event buffer %s holds %d undelivered events from an earlier run: sending them first",
                        self.path, self.count)

    # ---- setup ------------------------------------------------------------------------------------
    def _lock(self) -> int:
        fd, holder = lock_with_pid(self.dir / "LOCK")
        if fd is None:
            raise EventBufferLocked(f"the event buffer {self.dir} is in use by another process (pid {holder or '?'}); "
                                    "give each proxy its own proxy.buffer_dir")
        return fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _connect(self) -> sqlite3.Connection:
        c = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=30,
                            cached_statements=ROWS_PER_INSERT + 32)  # one INSERT per group size
        c.execute("PRAGMA journal_mode=WAL")
        c.execute(f"PRAGMA synchronous={'FULL' if self.fsync else 'NORMAL'}")
        return c

    # ---- writer thread ----------------------------------------------------------------------------
    def append(self, items: list[Item], delete_through: int | None = None) -> int:
        """Append ``items`` in order (and delete rows ``<= delete_through``) in one transaction.

        Row ids are given here, ``last_id + 1`` on: one writer owns the file (the folder lock), so
        no query for the id is needed. The rows go in as multi-row ``INSERT`` statements of up to
        ``ROWS_PER_INSERT`` rows: one SQLite step (one release and re-acquisition of the GIL) per chunk,
        not per row; a group that needs a single statement and deletes nothing is that statement
        alone, committed by itself (a statement is atomic).

        Returns the id of the last appended row. Raises :class:`EventBufferFull` (size bound or disk
        full) or :class:`EventBufferError` (other I/O errors); then nothing of the call was applied
        (and an id already in the file, which only a bug could give, re-reads ``last_id``).
        """
        w = self._w
        first = self.last_id + 1
        alone = delete_through is None and len(items) <= ROWS_PER_INSERT
        try:
            if w.in_transaction:  # left by a failed rollback: what it holds was reported failed already
                w.execute("ROLLBACK")
            if not alone:
                w.execute("BEGIN IMMEDIATE")
            freed = self._delete(delete_through) if delete_through is not None else 0
            for i in range(0, len(items), ROWS_PER_INSERT):
                part = items[i:i + ROWS_PER_INSERT]
                params = []
                for j, (topic, key, value) in enumerate(part, first + i):
                    params += (j, topic, key, value)
                w.execute(_insert_sql(len(part)), params)
            if not alone:
                w.execute("COMMIT")
        except sqlite3.Error as e:
            if w.in_transaction:
                try:
                    w.execute("ROLLBACK")
                except sqlite3.Error:
                    pass
            if isinstance(e, sqlite3.OperationalError) and "full" in str(e):
                raise EventBufferFull(f"event buffer {self.path} is full ({e})") from e
            if isinstance(e, sqlite3.IntegrityError):
                self._resync()
            raise EventBufferError(f"event buffer {self.path}: {e}") from e
        self.count += len(items) - freed
        self.last_id = first + len(items) - 1
        self._commits += 1
        return self.last_id

    def _resync(self) -> None:
        try:
            self.count, self.last_id = self._w.execute("SELECT count(*), coalesce(max(id), 0) FROM events").fetchone()
        except sqlite3.Error:
            pass

    def checkpoint_due(self, every: int = CHECKPOINT_EVERY) -> bool:
        """True once ``every`` commits were made since the last checkpoint (:meth:`maybe_checkpoint`)."""
        return self._commits >= every

    def maybe_checkpoint(self, every: int = CHECKPOINT_EVERY) -> bool:
        """Copy the WAL into the database (``PRAGMA wal_checkpoint(PASSIVE)``) once ``every``
        commits were made since the last time; True when it ran. The writer connection never
        checkpoints by itself (``wal_autocheckpoint=0``): a commit made on the proxy's event loop
        never includes a checkpoint and its syncs. A writer call like the others (the publisher
        runs it holding its commit lock: with no commit beside it, it copies the whole WAL, and
        the next commit starts the WAL over). Crash-safe as every SQLite checkpoint. Raises
        :class:`EventBufferError`."""
        if self._commits < every:
            return False
        self._commits = 0
        try:
            self._w.execute("PRAGMA wal_checkpoint(PASSIVE)")
        except sqlite3.Error as e:
            raise EventBufferError(f"event buffer {self.path}: checkpoint failed: {e}") from e
        return True

    def _delete(self, through: int) -> int:
        return self._w.execute("DELETE FROM events WHERE id <= ?", (through,)).rowcount

    def delete_through(self, last_id: int) -> int:
        """Delete every row with id ``<= last_id`` (delivered). Returns how many were deleted."""
        try:
            self._w.execute("BEGIN IMMEDIATE")
            freed = self._delete(last_id)
            self._w.execute("COMMIT")
        except sqlite3.Error as e:
            try:
                self._w.execute("ROLLBACK")
            except sqlite3.Error:
                pass
            raise EventBufferError(f"event buffer {self.path}: {e}") from e
        self.count -= freed
        return freed

    def file_bytes(self) -> int:
        """Bytes of the database and its WAL on disk."""
        total = 0
        for suffix in ("", "-wal"):
            try:
                total += os.path.getsize(f"{self.path}{suffix}")
            except OSError:
                pass
        return total

    def compact(self) -> None:
        """Give disk space back: ``VACUUM`` (an atomic rewrite) and truncate the WAL.

        Crash-safe at every point (SQLite's own transaction). Raises :class:`EventBufferError`.
        """
        try:
            with self._rlock:  # no read transaction may pin the WAL meanwhile
                self._w.execute("VACUUM")
                self._w.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            raise EventBufferError(f"event buffer {self.path}: compaction failed: {e}") from e

    # ---- reader thread ----------------------------------------------------------------------------
    def read(self, after_id: int, n: int) -> list[Row]:
        """Up to ``n`` of the oldest rows with id ``> after_id``, in order."""
        with self._rlock:
            return self._r.execute("SELECT id, topic, key, value FROM events WHERE id > ? ORDER BY id LIMIT ?",
                                   (after_id, n)).fetchall()

    def close(self) -> None:
        """Close both connections (the last one checkpoints the WAL) and release the folder."""
        for c in (self._r, self._w):
            try:
                c.close()
            except sqlite3.Error:
                pass
        self._unlock()

    def __len__(self) -> int:
        return self.count


__all__ = ["ROWS_PER_INSERT", "DiskBuffer", "EventBufferError", "EventBufferFull", "EventBufferLocked", "DB_NAME"]
