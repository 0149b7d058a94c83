"""Positions in a topic as people write them: a time or offsets (``--from``/``--to`` of
``pipeline replay``, ``pipeline retrain`` and ``pipeline tail``).

Forms: ``2024-05-01``, ``2024-05-01T10:00:00`` (UTC unless an offset such as ``+02:00`` is
given), ``ms:1714557600000``, ``now``, ``-2h`` / ``-30m`` / ``-1d`` (relative to now), or offsets:
``1200`` (the same offset on every partition) or ``0:120,1:88`` (per partition).
:func:`reader_start` turns a bound into a :class:`~pipeline.bus.TopicReader` start position.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime, timezone

from pipeline import events
from pipeline.bus.reader import Offset, Start, Time
from pipeline.errors import PipelineError

_REL = re.compile(r"^-(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


class BoundError(PipelineError, ValueError):
    """A ``--from``/``--to`` value that is neither a time nor offsets."""


@dataclass(frozen=True)
class Bound:
    """One end of a range of records (replay, retrain, tail): a time (``time_ms``, ms since the
    epoch), one offset for every partition (``offset``), or offsets per partition (``offsets``;
    unlisted partitions: unbounded)."""

    time_ms: int | None = None
    offset: int | None = None
    offsets: dict[int, int] | None = None

    def offset_for(self, partition: int) -> int | None:
        """The offset bound of ``partition`` (None: no offset bound)."""
        if self.offset is not None:
            return self.offset
        return (self.offsets or {}).get(partition)


def parse_bound(text: str, now_ms: int | None = None) -> Bound:
    """Parse a ``--from``/``--to`` value (module docstring). Raises :class:`BoundError`."""
    s = text.strip()
    now = events.now_ms() if now_ms is None else now_ms
    if re.fullmatch(r"\d+", s):
        return Bound(offset=int(s))
    if re.fullmatch(r"\d+:\d+(,\d+:\d+)*", s):
        return Bound(offsets={int(p): int(o) for p, o in (x.split(":") for x in s.split(","))})
    if s.startswith("ms:") and s[3:].isdigit():
        return Bound(time_ms=int(s[3:]))
    if s == "now":
        return Bound(time_ms=now)
    m = _REL.match(s)
    if m:
        return Bound(time_ms=now - int(float(m.group(1)) * _UNIT_S[m.group(2)] * 1000))
    try:
        dt = datetime.fromisoformat(s.replace("Z", "+00:00"))
    except ValueError:
        raise BoundError(f"{text!r} is not a time (2024-05-01[T10:00[:00][+02:00]], ms:<epoch ms>, -2h) "
                         "nor offsets (1200 or 0:120,1:88)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return Bound(time_ms=int(dt.timestamp() * 1000))


def in_range(rec, start: Bound | None, end: Bound | None) -> bool:
    """True when ``start <= rec < end`` (time on ``timestamp_ms``, offsets on ``offset``; ``rec``: any
    record with ``partition``, ``offset`` and ``timestamp_ms``, e.g. a :class:`~pipeline.bus.Record`)."""
    if start is not None:
        if start.time_ms is not None and rec.timestamp_ms < start.time_ms:
            return False
        o = start.offset_for(rec.partition)
        if o is not None and rec.offset < o:
            return False
    if end is not None:
        if end.time_ms is not None and rec.timestamp_ms >= end.time_ms:
            return False
        o = end.offset_for(rec.partition)
        if o is not None and rec.offset >= o:
            return False
    return True


def reader_start(bound: Bound) -> Start:
    """The :class:`~pipeline.bus.TopicReader` start of a ``--from`` bound: :class:`Time` for a time,
    :class:`Offset` for offsets (partitions a per-partition bound does not list: the beginning)."""
    if bound.time_ms is not None:
        return Time(bound.time_ms)
    if bound.offsets is not None:
        return Offset(per_partition=bound.offsets)
    return Offset(bound.offset or 0)
