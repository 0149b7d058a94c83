"""Durable file writes (the trainer's checkpoints and exports, the weight-sync record) and the
pid lock that keeps a folder to one process (the broker's data dir, the proxy's event buffer).

Torch-free and stage-free (only ``os`` and ``fcntl``), so any stage may use it. A rename is atomic but not
durable by itself: after a power loss the directory entry of the renamed folder (or of a
replaced file) may be gone even though the data was fsynced. The recipe used everywhere is
therefore: write into a temporary name, fsync the file(s), fsync the temporary folder, rename,
fsync the parent folder (POSIX ``rename(2)`` and ``fsync(2)`` on a directory descriptor; what
ext4/xfs need for the rename to survive a crash).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a directory's entries (the names in it) to stable storage.

    Raises ``OSError`` when ``path`` cannot be opened (e.g. it does not exist).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Replace ``path`` with ``text`` atomically and durably.

    Writes ``.<name>.tmp-<pid>`` beside it, fsyncs it, ``os.replace``-s it over ``path`` and
    fsyncs the parent folder, so a reader (or a restart after a power loss) sees the old
    content or the new one, never a torn or missing file.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_folder(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Build a folder that appears at ``out_dir`` complete or not at all.

    Yields a temporary sibling folder (``.<name>.tmp-*``) to fill; when the block ends without
    an exception it is fsynced, renamed to ``out_dir`` and the parent is fsynced (the recipe
    above). On an exception the temporary folder is removed and the exception propagates. Files
    written inside must be fsynced by their writer. Raises ``FileExistsError`` (before the block
    runs) if ``out_dir`` exists; creates the parent folder when missing.
    """
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"export target {out} exists")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        fsync_dir(tmp)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def lock_with_pid(path: str | os.PathLike) -> tuple[int | None, str]:
    """Take an exclusive ``flock`` on ``path`` (created if missing) and write this process's pid in it.

    Returns ``(fd, "")`` when taken (keep ``fd`` open for as long as the lock is held; closing it,
    or the process ending, releases it), or ``(None, holder)`` when another process holds it,
    ``holder`` being the pid it wrote (``""`` if none). The caller words its own error. Raises
    ``OSError`` when ``path`` cannot be opened.
    """
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        return None, holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    return fd, ""
