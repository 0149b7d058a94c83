"""What the two local brokers share (:mod:`pipeline.broker`: Tansu; :mod:`pipeline.kafka_broker`:
Apache Kafka): the error, the readiness probe, their children's pid files, stopping a child, and
:class:`LocalBroker`, the base of both (address, data-dir lock and state file, context manager).

It imports neither broker module, so each of them (and ``pipeline broker``, which picks one)
imports it without a circle.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Callable

from pipeline.errors import PipelineError
from pipeline.files import lock_with_pid
from pipeline.procutil import free_port

log = logging.getLogger(__name__)


class BrokerError(PipelineError, RuntimeError):
    """The broker or object-store binary is missing, failed to start, or never became ready."""



def kafka_answers(bootstrap: str, timeout_ms: int = 2000) -> bool:
    """One metadata request to ``bootstrap``: True when it succeeds (a readiness probe).

    A port that refuses connections is answered False at once, without a Kafka client: a
    client bootstrapping against a broker that is still starting retries with back-off for
    about 30 s (whatever ``timeout_ms``) and logs every refused connection as an error.
    """
    host, _, port = bootstrap.split(",")[0].rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_ms / 1000).close()
    except (OSError, ValueError):
        return False
    from pipeline.bus.admin import metadata_answers

    return metadata_answers(bootstrap, timeout_ms)


def wait_ready(bootstrap: str, timeout_s: float = 30.0, alive: Callable[[], bool] | None = None) -> None:
    """Block until a Kafka metadata request to ``bootstrap`` succeeds.

    Raises:
        BrokerError: not ready within ``timeout_s``, or ``alive()`` turned false.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if kafka_answers(bootstrap, 3000):
            return
        if alive is not None and not alive():
            raise BrokerError(f"the broker at {bootstrap} exited during start-up")
        time.sleep(0.2)
    raise BrokerError(f"broker at {bootstrap} not ready after {timeout_s:.0f} s")


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except (OSError, IndexError):
        return True


def write_pid(path: Path, proc: subprocess.Popen, marker: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(f"{proc.pid}\n{marker}\n")
    os.replace(tmp, path)


def kill_leftover(path: Path) -> None:
    """SIGKILL the process named in the pid file ``path`` if it still runs the same command."""
    try:
        pid_s, marker = path.read_text().splitlines()[:2]
        pid = int(pid_s)
    except (OSError, ValueError):
        return
    if marker and marker in _cmdline(pid):
        log.warning("killing pid %d left running by an earlier broker on this data dir", pid)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    path.unlink(missing_ok=True)


def stop_proc(proc: subprocess.Popen | None, grace_s: float) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tail(path: str | None, n: int = 12) -> str:
    if not path:
        return ""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


# ---- the base of both brokers ---------------------------------------------------------------------
class LocalBroker:
    """A local broker subprocess on ``host:port``, durable in ``data_dir`` or not.

    Args:
        port: listener port; None picks a free one (with ``data_dir``: left to :meth:`start`,
            which reuses the last run's when it is free).
        host: listen address.
        log_file: append the broker's log here.
        data_dir: durable storage in this folder, ``flock``-ed while the broker runs.

    Subclasses set ``kind`` and ``version`` and implement ``storage``, ``start``, ``alive`` and
    ``stop``; ``store`` is the object store of a durable Tansu broker (None otherwise).
    """

    kind = "?"
    version = "?"

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_file: str | None = None,
                 data_dir: str | os.PathLike | None = None) -> None:
        self.host = host
        self.port = port
        self.log_file = log_file
        self.data_dir = Path(data_dir).expanduser().resolve() if data_dir is not None else None
        self.proc: subprocess.Popen | None = None
        self.store = None  # Tansu's object store when durable (pipeline.broker.ObjectStore); Kafka: none
        self.started_in_s = float("nan")
        self._lock_fd: int | None = None
        if self.data_dir is None and self.port is None:
            self.port = free_port(host)

    @property
    def bootstrap(self) -> str:
        """``host:port`` for clients."""
        return f"{self.host}:{self.port}"

    @property
    def durable(self) -> bool:
        """True with a data dir."""
        return self.data_dir is not None

    def _lock(self) -> None:
        assert self.data_dir is not None
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd, holder = lock_with_pid(self.data_dir / "broker.lock")
        if fd is None:
            raise BrokerError(f"{self.data_dir} is in use by another broker (pid {holder or '?'})")
        self._lock_fd = fd

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _state(self) -> dict:
        try:
            return json.loads((self.data_dir / "broker.json").read_text())
        except (OSError, ValueError):
            return {}

    @property
    def storage(self) -> str:
        raise NotImplementedError

    def alive(self) -> bool:
        raise NotImplementedError

    def start(self, timeout_s: float = 120.0) -> "LocalBroker":
        raise NotImplementedError

    def stop(self, timeout_s: float | None = None) -> None:
        raise NotImplementedError

    def __enter__(self) -> "LocalBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
