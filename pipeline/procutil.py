"""Child processes that cannot outlive their parent (Linux): no orphans after a crash."""

from __future__ import annotations

import ctypes
import ctypes.util
import signal
import sys

_PR_SET_PDEATHSIG = 1
try:  # loaded in the parent: the child (after fork) only makes the system call
    _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True) \
        if sys.platform.startswith("linux") else None
except OSError:
    _LIBC = None


def die_with_parent() -> None:
    """``preexec_fn`` for :class:`subprocess.Popen`: the child gets SIGTERM when the parent dies.

    Uses ``prctl(PR_SET_PDEATHSIG)``; a no-op where that is unavailable (non-Linux).
    """
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def killed_with_parent() -> None:
    """``preexec_fn``: the child gets SIGKILL when the parent dies (for servers whose SIGTERM
    handling is slow and whose acknowledged data is already safe, e.g. the broker's children)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
