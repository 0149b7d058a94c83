"""Helpers for the processes a stage starts: children that cannot outlive their parent (Linux: no
orphans after a crash), stopping a child's process group, and free TCP ports for the servers they run."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import random
import signal
import socket
import subprocess
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``, chosen below the kernel's ephemeral
    range (Linux ``ip_local_port_range``, usually 32768-60999) so that no outgoing connection
    (a Kafka client's, an HTTP client's) is given it as its local port before the caller binds it;
    a random port of ``[10000, lo)`` that binds now (up to 64 tries), else one the kernel picks
    (port 0, as before). Another process may still take it before the caller binds it."""
    lo = _ephemeral_low()
    pick = random.SystemRandom()  # not the seeded module RNG: parallel test workers would draw alike
    for _ in range(64 if lo > 10001 else 0):
        port = pick.randrange(10000, lo)
        with socket.socket() as s:
            try:
                s.bind((host, port))
                return port
            except OSError:
                continue
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The first port of the kernel's ephemeral range; 32768 (Linux's default) when unreadable."""
    try:
        return int(open(path).read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def port_free(port: int, host: str = "127.0.0.1") -> bool:
    """True when ``host:port`` can be bound now."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def stop_group(proc: subprocess.Popen, wait_s: float, resume_first: bool = False) -> int:
    """Stop the process group that ``proc`` leads (started with ``start_new_session=True``): SIGTERM,
    up to ``wait_s`` seconds for ``proc`` to exit, then SIGKILL. ``resume_first`` sends SIGCONT
    before (a stopped group handles SIGTERM only once continued). A group that is already gone is
    not an error. Returns ``proc``'s exit status."""
    def signal_group(sig: int) -> None:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    if proc.poll() is None:
        if resume_first:
            signal_group(signal.SIGCONT)
        signal_group(signal.SIGTERM)
        try:
            proc.wait(wait_s)
        except subprocess.TimeoutExpired:
            signal_group(signal.SIGKILL)
            proc.wait()
    return proc.returncode
