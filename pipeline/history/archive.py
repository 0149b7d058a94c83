"""``python -m pipeline archive``: write the ``turns`` topic to local JSONL files.

A consumer group (default ``archive``) on ``turns`` appends every record to
``DIR/<UTC day>/partition-<P>.jsonl`` (format: :mod:`pipeline.history.store`), so history
outlives broker retention and the memory-only embedded broker.

Durability: records are buffered, written, flushed and ``fsync``-ed in batches (every
``--flush-every`` records or ``--flush-interval-s``), and only then acknowledged to the
:class:`pipeline.bus.ConsumerApp`, whose commit is the lowest unacknowledged offset. So a
committed offset is always on disk (commit-after-write); a crash re-delivers at most the
unflushed tail.

De-duplication on restart: before writing the first record of a partition, the archiver reads
the highest offset already archived for it (the last complete line of its files) and skips
records at or below it. A half-written last line (crash during a write) is cut off first. The
first skipped record is compared with the archived line at the same offset (key, type,
session, created_at): if they differ, the directory belongs to another log (e.g. a broker that
was replaced and restarted at offset 0), and the archiver stops with an error instead of
silently dropping the new records. One directory archives one topic (``ARCHIVE.json``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import orjson

from pipeline import events
from pipeline.history.store import (FORMAT, MANIFEST, VERSION, ArchiveError, partition_file, partition_files,
                                    read_manifest, to_line)

log = logging.getLogger(__name__)
HELP = "Archive the turns topic to local JSONL files (DIR/<day>/partition-<P>.jsonl), commit after fsync."

_TAIL_BYTES = 4 << 20  # how much of a partition's newest file is indexed for the conflict check


def _fingerprint(key: str | None, ev: dict) -> tuple:
    return (key, ev.get("type"), ev.get("session_id"), ev.get("created_at"), ev.get("request_id"))


class _PartitionState:
    __slots__ = ("last_offset", "tail", "checked")

    def __init__(self, last_offset: int, tail: dict[int, tuple]) -> None:
        self.last_offset = last_offset
        self.tail = tail  # offset -> fingerprint of the newest archived lines
        self.checked = False


def _repair_and_scan(files: list[Path]) -> _PartitionState:
    """Cut a half-written last line off each file; return the highest archived offset and an
    index of the newest file's tail (for the conflict check)."""
    last, tail = -1, {}
    for f in files:
        size = f.stat().st_size
        if not size:
            continue
        with f.open("rb+") as fh:
            start = max(0, size - _TAIL_BYTES)
            fh.seek(start)
            chunk = fh.read()
            if not chunk.endswith(b"\n"):
                cut = chunk.rfind(b"\n") + 1
                log.warning("%s: removing a half-written last line (%d bytes)", f, len(chunk) - cut)
                fh.truncate(start + cut)
                chunk = chunk[:cut]
        lines = chunk.split(b"\n")
        if start > 0:
            lines = lines[1:]  # the first line of the window may be cut
        file_tail = {}
        for line in lines:
            if not line:
                continue
            try:
                d = orjson.loads(line)
                file_tail[int(d["offset"])] = _fingerprint(d.get("key"), d.get("event") or {})
            except (ValueError, KeyError, TypeError):
                continue
        if file_tail:
            last = max(last, max(file_tail))
            tail = file_tail
    return _PartitionState(last, tail)


class Archiver:
    """The archive consumer's state: buffered lines per file, flushed with fsync, then acked.

    Args:
        directory: the archive directory (created; ``ARCHIVE.json`` written on first use).
        topic: physical topic name being archived (must match an existing manifest).
        flush_every: flush when this many records are buffered.
        fsync: ``os.fsync`` each written file before acknowledging (keep on outside tests).
    Raises:
        ArchiveError: the directory archives another topic.
    """

    def __init__(self, directory: str | os.PathLike, topic: str, flush_every: int = 1000, fsync: bool = True) -> None:
        self.dir = Path(directory)
        self.topic = topic
        self.flush_every = flush_every
        self.fsync = fsync
        self.app = None
        self.archived = 0
        self.skipped = 0
        self.error: str | None = None
        self.last_record_at = time.monotonic()
        self._pending: list = []  # (record, path, line)
        self._parts: dict[tuple[str, int], _PartitionState] = {}
        self._lock = threading.Lock()
        self.dir.mkdir(parents=True, exist_ok=True)
        manifest = read_manifest(self.dir)
        if manifest is None:
            (self.dir / MANIFEST).write_text(json.dumps(
                {"format": FORMAT, "version": VERSION, "topic": topic, "created_at": events.now_ms()}, indent=1))
        elif manifest.get("topic") != topic:
            raise ArchiveError(f"{self.dir} archives topic {manifest.get('topic')!r}, not {topic!r}: use another --dir")

    def _state(self, topic: str, partition: int) -> _PartitionState:
        st = self._parts.get((topic, partition))
        if st is None:
            st = _repair_and_scan(partition_files(self.dir).get(partition, []))
            self._parts[(topic, partition)] = st
            if st.last_offset >= 0:
                log.info("archive: %s[%d] already archived up to offset %d", topic, partition, st.last_offset)
        return st

    def handle(self, record) -> bool | None:
        """ConsumerApp handler: buffer the record (deferred ack) or skip an archived duplicate.

        After a conflict (see the module docstring) nothing more is acknowledged, so the group's
        committed offsets stay where they were.
        """
        self.last_record_at = time.monotonic()
        if self.error:
            return False
        st = self._state(record.topic, record.partition)
        if record.offset <= st.last_offset:
            if not st.checked:
                st.checked = True
                self._check_same_log(record, st)
                if self.error:
                    return False
            self.skipped += 1
            return True
        st.last_offset = record.offset
        st.checked = True
        path = partition_file(self.dir, record.timestamp_ms, record.partition)
        line = to_line(record.topic, record.partition, record.offset, record.timestamp_ms, record.key, record.event)
        self._pending.append((record, path, line))
        if len(self._pending) >= self.flush_every:
            self.flush()
        return False

    def _check_same_log(self, record, st: _PartitionState) -> None:
        want = st.tail.get(record.offset)
        got = _fingerprint(record.key, record.event.to_dict())
        if want is not None and want != got:
            self.error = (f"{record.topic}[{record.partition}]@{record.offset} is archived with a different record "
                          f"({want[1]} of {want[2]!r}, not {got[1]} of {got[2]!r}): {self.dir} belongs to another "
                          "log (a replaced broker?); archive into a new --dir")
            log.error("archive: %s", self.error)
            if self.app is not None:
                self.app.stop()

    def flush(self) -> None:
        """Write, flush and fsync every buffered line, then acknowledge their records."""
        if not self._pending:
            return
        by_file: dict[Path, list[bytes]] = defaultdict(list)
        for _rec, path, line in self._pending:
            by_file[path].append(line)
        for path, lines in by_file.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as fh:
                fh.write(b"".join(lines))
                fh.flush()
                if self.fsync:
                    os.fsync(fh.fileno())
        done, self._pending = self._pending, []
        self.archived += len(done)
        if self.app is not None:
            for rec, _path, _line in done:
                self.app.ack(rec)

    def on_revoked(self, partitions: set) -> None:
        """Drop buffered lines of lost partitions: their new owner archives them (nothing was acked)."""
        self._pending = [p for p in self._pending if (p[0].topic, p[0].partition) not in partitions]
        for tp in partitions:
            self._parts.pop(tp, None)


def add_arguments(parser) -> None:
    parser.add_argument("--dir", default="runs/archive", help="archive directory (default runs/archive)")
    parser.add_argument("--group", default="archive", help="consumer group (default archive)")
    parser.add_argument("--topic", default="turns", help="logical topic to archive (default turns)")
    parser.add_argument("--flush-every", type=int, default=1000, help="records per write batch (default 1000)")
    parser.add_argument("--flush-interval-s", type=float, default=0.5, help="max seconds a record waits (default 0.5)")
    parser.add_argument("--no-fsync", action="store_true", help="skip fsync (faster, not crash-safe)")
    parser.add_argument("--until-idle", type=float, metavar="S",
                        help="exit once no record arrived for S seconds (batch mode); default: run until stopped")


def archive_topic(config, directory: str | os.PathLike, *, group: str = "archive", topic: str = "turns",
                  flush_every: int = 1000, flush_interval_s: float = 0.5, fsync: bool = True,
                  until_idle_s: float | None = None, install_signals: bool = True,
                  on_ready=None) -> Archiver:
    """Run the archive consumer until stopped (or idle for ``until_idle_s`` seconds).

    ``on_ready(archiver)`` is called before consuming (tests use ``archiver.app.stop()``).
    Returns the :class:`Archiver` (counts in ``archived``/``skipped``; ``error`` on a conflict).

    Raises:
        ArchiveError: the directory archives another topic.
    """
    from pipeline.bus import ConsumerApp

    physical = config.topics.name(topic)
    archiver = Archiver(directory, physical, flush_every=max(1, flush_every), fsync=fsync)
    app = ConsumerApp(config, group_id=group, topics=[physical], name="archive",
                      max_in_flight=max(10 * flush_every, 10_000))
    archiver.app = app

    def tick() -> None:
        archiver.flush()
        if until_idle_s is not None and time.monotonic() - archiver.last_record_at > until_idle_s:
            app.stop()

    if on_ready is not None:
        on_ready(archiver)
    log.info("archive: %s -> %s (group %s)", physical, directory, group)
    app.run(archiver.handle, tick=tick, tick_interval_s=flush_interval_s, on_revoked=archiver.on_revoked,
            on_stop=archiver.flush, drain_timeout_s=3.0, install_signals=install_signals)
    return archiver


def run(args, config) -> int:
    try:
        archiver = archive_topic(config, args.dir, group=args.group, topic=args.topic, flush_every=args.flush_every,
                                 flush_interval_s=args.flush_interval_s, fsync=not args.no_fsync,
                                 until_idle_s=args.until_idle)
    except ArchiveError as e:
        print(f"pipeline archive: {e}", file=sys.stderr)
        return 2
    print(orjson.dumps({"archived": archiver.archived, "skipped_duplicates": archiver.skipped,
                        "dir": str(args.dir), "topic": archiver.topic}).decode(), flush=True)
    if archiver.error:
        print(f"pipeline archive: {archiver.error}", file=sys.stderr)
        return 2
    return 0
