"""A FIFO of encoded events in a local file: the overflow of the proxy's publish buffer.

Format: a sequence of records ``<u32 little-endian length><msgpack [topic, key, value]>`` where
``value`` is the encoded event (:func:`pipeline.events.encode`). The read position of the
oldest undelivered record is kept in ``<file>.pos`` (written after each delivered batch), so a
restarted proxy re-sends from there: delivery is at-least-once, in order. When every record has
been read the file is truncated. Only the publisher thread touches a :class:`SpillFile`.
"""

from __future__ import annotations

import logging
import os
import struct
from pathlib import Path

import msgpack

log = logging.getLogger(__name__)
_LEN = struct.Struct("<I")
Item = tuple  # (topic: str, key: str | None, value: bytes)


class SpillFile:
    """Append-at-the-end, read-from-the-front queue of ``(topic, key, value)`` in one file.

    Args:
        path: the file (created with its folder if missing; existing records are resumed).
        max_bytes: appends beyond this size are refused (:meth:`append` returns False).
    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike, max_bytes: int = 1 << 30) -> None:
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.pos_path = self.path.with_name(self.path.name + ".pos")
        self.max_bytes = max_bytes
        self._f = open(self.path, "a+b")
        self._read_pos = self._load_pos()
        self._size = self._f.seek(0, os.SEEK_END)
        if self._read_pos > self._size:
            self._read_pos = 0
        self.count = self._count_from(self._read_pos)
        self._commit_pos = self._read_pos
        self._read_since_commit = 0
        if self.count:
            log.warning("spill file %s holds %d undelivered events from an earlier run", self.path, self.count)

    def _load_pos(self) -> int:
        try:
            return int(self.pos_path.read_text().strip() or 0)
        except (OSError, ValueError):
            return 0

    def _count_from(self, pos: int) -> int:
        n = 0
        self._f.seek(pos)
        while True:
            head = self._f.read(4)
            if len(head) < 4:
                break
            (ln,) = _LEN.unpack(head)
            if self._f.seek(ln, os.SEEK_CUR) > self._size:
                break
            n += 1
        return n

    def __len__(self) -> int:
        return self.count

    @property
    def reading(self) -> bool:
        """Items were read but neither committed nor rewound."""
        return self._read_since_commit > 0

    @property
    def size_bytes(self) -> int:
        """Bytes in the file (read and unread)."""
        return self._size

    def append(self, items: list[Item]) -> int:
        """Append items in order; returns how many fit under ``max_bytes`` (the rest are refused)."""
        buf = bytearray()
        n = 0
        for topic, key, value in items:
            rec = msgpack.packb([topic, key, value], use_bin_type=True)
            if self._size + len(buf) + 4 + len(rec) > self.max_bytes:
                break
            buf += _LEN.pack(len(rec))
            buf += rec
            n += 1
        if buf:
            self._f.seek(0, os.SEEK_END)
            self._f.write(buf)
            self._f.flush()
            self._size += len(buf)
            self.count += n
        return n

    def read(self, n: int) -> list[Item]:
        """Remove and return up to ``n`` of the oldest items (commit with :meth:`commit`)."""
        out: list[Item] = []
        self._f.seek(self._read_pos)
        while len(out) < n and self.count:
            head = self._f.read(4)
            (ln,) = _LEN.unpack(head)
            topic, key, value = msgpack.unpackb(self._f.read(ln), raw=False)
            out.append((topic, key, value))
            self._read_pos += 4 + ln
            self.count -= 1
        self._read_since_commit += len(out)
        return out

    def rewind(self) -> None:
        """Undo the reads since the last :meth:`commit` (their delivery failed)."""
        self._read_pos = self._commit_pos
        self.count += self._read_since_commit
        self._read_since_commit = 0

    def commit(self) -> None:
        """Everything read so far is delivered: persist the position, truncate when empty."""
        if self.count == 0:
            self._f.truncate(0)
            self._f.flush()
            self._size = 0
            self._read_pos = 0
        self._commit_pos = self._read_pos
        self._read_since_commit = 0
        self._write_pos()

    def _write_pos(self) -> None:
        tmp = self.pos_path.with_name(self.pos_path.name + ".tmp")
        tmp.write_text(str(self._read_pos))
        os.replace(tmp, self.pos_path)

    def rewrite(self, head: list[Item]) -> int:
        """Replace the file by ``head`` followed by the unread items (used at shutdown).

        Returns the number of items now in the file; items beyond ``max_bytes`` are not kept (the
        caller counts them as dropped).
        """
        self.rewind()
        rest = self.read(self.count)
        self._f.truncate(0)
        self._size = 0
        self._read_pos = self._commit_pos = self._read_since_commit = 0
        self.count = 0
        self.append(list(head) + rest)
        self._write_pos()
        return self.count

    def close(self) -> None:
        """Close the file handle."""
        self._f.close()
