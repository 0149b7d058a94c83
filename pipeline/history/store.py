"""The archive's on-disk format and its reader (shared by ``archive`` and ``replay``).

Layout of an archive directory::

    DIR/ARCHIVE.json                      {"format": "pipeline-archive", "version": 1, "topic": ...}
    DIR/YYYY-MM-DD/partition-P.jsonl      one line per record, UTC day of the record's timestamp

Each line is a JSON object::

    {"topic": str, "partition": int, "offset": int, "timestamp_ms": int, "key": str | null,
     "event": <Event.to_dict(): "type", "v" and every field, token ids / log-probs as lists>}

Within a partition, lines are in offset order across the day files (the archiver appends in
poll order). Log-probs are float32 on the wire; written as the double of that float32 they
convert back exactly, so an archived event re-encodes to the same bytes.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import os
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Iterable, Iterator

import orjson

from pipeline import events
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)

MANIFEST = "ARCHIVE.json"
FORMAT = "pipeline-archive"
VERSION = 1
_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")
_PART = re.compile(r"^partition-(\d+)\.jsonl$")


class ArchiveError(PipelineError, RuntimeError):
    """The directory is not a usable archive (wrong topic, unreadable manifest, conflicting log)."""


@dataclass
class ArchivedRecord:
    """One record of the ``turns`` history: where it was (topic, partition, offset), when
    (``timestamp_ms``, broker/producer time in ms), its key and the decoded event."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    key: str | None
    event: events.Event


def day_of(timestamp_ms: int) -> str:
    """``YYYY-MM-DD`` (UTC) of a timestamp in ms."""
    return datetime.fromtimestamp(timestamp_ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d")


def partition_file(directory: Path, timestamp_ms: int, partition: int) -> Path:
    """``DIR/<UTC day>/partition-<P>.jsonl`` for a record."""
    return Path(directory) / day_of(timestamp_ms) / f"partition-{partition}.jsonl"


def to_line(topic: str, partition: int, offset: int, timestamp_ms: int, key: str | None,
            event: events.Event) -> bytes:
    """One archive line (with the trailing newline) for a record."""
    return orjson.dumps({"topic": topic, "partition": partition, "offset": offset, "timestamp_ms": timestamp_ms,
                         "key": key, "event": event.to_dict()}) + b"\n"


def event_from_dict(d: dict) -> events.Event:
    """Rebuild an event from :meth:`pipeline.events.Event.to_dict` output, validated exactly as
    :func:`pipeline.events.decode` validates wire bytes.

    Raises:
        pipeline.events.EventError: unknown type or version, missing or ill-typed fields.
    """
    if not isinstance(d, dict):
        raise events.MalformedEvent(f"archived event must be an object, got {type(d).__name__}")
    cls = events.EVENT_TYPES.get(d.get("type"))
    if cls is None:
        raise events.UnknownEventType(f"unknown event type {d.get('type')!r}")
    if d.get("v") != cls.V:
        raise events.UnsupportedVersion(f"{cls.TYPE}: schema version {d.get('v')!r} not supported in archives "
                                        f"(this code writes and reads v{cls.V})")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - names - {"type", "v"}
    if unknown:
        raise events.MalformedEvent(f"{cls.TYPE}: unknown fields {sorted(unknown)}")
    try:
        ev = cls(**{k: v for k, v in d.items() if k in names})
        return events.decode(events.encode(ev))  # the wire validation, field types included
    except TypeError as e:
        raise events.MalformedEvent(f"{cls.TYPE}: {e}") from None


def parse_line(line: bytes | str) -> ArchivedRecord:
    """Parse one archive line. Raises :class:`pipeline.events.EventError` or ``ValueError``."""
    d = orjson.loads(line)
    if not isinstance(d, dict):
        raise ValueError("archive line is not an object")
    try:
        return ArchivedRecord(topic=str(d["topic"]), partition=int(d["partition"]), offset=int(d["offset"]),
                              timestamp_ms=int(d["timestamp_ms"]), key=d.get("key"),
                              event=event_from_dict(d["event"]))
    except KeyError as e:
        raise ValueError(f"archive line lacks {e}") from None


def read_manifest(directory: Path) -> dict | None:
    """The archive's manifest, or None if the directory has none. Raises :class:`ArchiveError`."""
    p = Path(directory) / MANIFEST
    if not p.exists():
        return None
    try:
        m = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise ArchiveError(f"{p}: unreadable manifest: {e}") from e
    if m.get("format") != FORMAT or m.get("version") != VERSION:
        raise ArchiveError(f"{p}: not a {FORMAT} v{VERSION} manifest")
    return m


def partition_files(directory: Path) -> dict[int, list[Path]]:
    """Archive files per partition, oldest day first."""
    out: dict[int, list[Path]] = {}
    root = Path(directory)
    if not root.is_dir():
        return out
    for day in sorted(p for p in root.iterdir() if p.is_dir() and _DAY.match(p.name)):
        for f in day.iterdir():
            m = _PART.match(f.name)
            if m:
                out.setdefault(int(m.group(1)), []).append(f)
    for files in out.values():
        files.sort(key=lambda f: f.parent.name)
    return out


def count_lines(directory: Path) -> int:
    """Number of complete lines in an archive (for progress bars)."""
    n = 0
    for files in partition_files(directory).values():
        for f in files:
            with f.open("rb") as fh:
                n += sum(chunk.count(b"\n") for chunk in iter(lambda: fh.read(1 << 20), b""))
    return n


def _read_partition(files: list[Path], stats: dict) -> Iterator[ArchivedRecord]:
    last = -1
    for f in files:
        with f.open("rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.endswith(b"\n"):  # a write cut short by a crash: never acknowledged
                    log.warning("%s:%d: incomplete last line skipped", f, lineno)
                    stats["bad"] += 1
                    continue
                try:
                    rec = parse_line(line)
                except (ValueError, events.EventError) as e:
                    log.warning("%s:%d: skipped: %s", f, lineno, e)
                    stats["bad"] += 1
                    continue
                if rec.offset <= last:  # duplicate (should not happen; the archiver dedupes)
                    stats["duplicates"] += 1
                    continue
                last = rec.offset
                yield rec


def read_archive(directory: str | os.PathLike, partitions: Iterable[int] | None = None,
                 stats: dict | None = None) -> Iterator[ArchivedRecord]:
    """Every archived record: each partition in offset order, partitions merged by timestamp.

    Unparsable lines are skipped with a warning and counted in ``stats["bad"]``; repeated offsets
    in ``stats["duplicates"]``. Per-partition (hence per-session) order is always kept: the merge
    only pulls a partition's next line after yielding its previous one.
    """
    stats = stats if stats is not None else {}
    stats.setdefault("bad", 0)
    stats.setdefault("duplicates", 0)
    files = partition_files(Path(directory))
    wanted = set(partitions) if partitions is not None else None
    streams = [_read_partition(fs, stats) for p, fs in sorted(files.items()) if wanted is None or p in wanted]
    yield from heapq.merge(*streams, key=lambda r: (r.timestamp_ms, r.partition))
