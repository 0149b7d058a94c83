"""Start stages as child processes with per-stage logs, readiness checks and clean shutdown.

Each child runs in its own process group, so a stage's own children (e.g. torchrun workers)
are stopped with it. :meth:`Supervisor.stop_all` sends SIGTERM in reverse start order, waits,
then SIGKILLs what is left: no orphan processes.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx

from pipeline.procutil import die_with_parent
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)


class StageFailed(PipelineError, RuntimeError):
    """A stage exited or did not become ready in time (the message names its log file)."""


def http_ok(url: str) -> Callable[[], bool]:
    """Readiness probe: GET ``url`` answers 2xx."""
    def probe() -> bool:
        try:
            return httpx.get(url, timeout=2.0).is_success
        except httpx.HTTPError:
            return False
    return probe


@dataclass
class Stage:
    """A running child process."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    ready: Callable[[], bool] | None = None
    started_at: float = field(default_factory=time.monotonic)

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 15) -> str:
        """The last ``n`` lines of the stage's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Supervisor:
    """Owns the stage processes of one run; logs go to ``log_dir/<stage>.log``."""

    def __init__(self, log_dir: str | Path, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.stages: list[Stage] = []

    def start(self, name: str, args: list[str], ready: Callable[[], bool] | None = None,
              timeout_s: float = 300.0, env: dict[str, str] | None = None) -> Stage:
        """Start ``python -m pipeline <args>`` and wait until ``ready()`` is true.

        Raises:
            StageFailed: the process exited, or was not ready within ``timeout_s``.
        """
        argv = [sys.executable, "-m", "pipeline", *args]
        log_path = self.log_dir / f"{name}.log"
        out = open(log_path, "ab")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**self.env, **(env or {})}, start_new_session=True,
                                preexec_fn=die_with_parent)
        out.close()
        stage = Stage(name, argv, log_path, proc, ready)
        self.stages.append(stage)
        log.info("started %s (pid %d), log %s", name, proc.pid, log_path)
        deadline = time.monotonic() + timeout_s
        while ready is not None and not ready():
            if not stage.alive:
                raise StageFailed(f"{name} exited with {proc.returncode} during start-up; see {log_path}:\n{stage.tail()}")
            if time.monotonic() > deadline:
                raise StageFailed(f"{name} not ready after {timeout_s:.0f} s; see {log_path}:\n{stage.tail()}")
            time.sleep(0.5)
        return stage

    def dead(self) -> list[Stage]:
        """Stages whose process has exited."""
        return [s for s in self.stages if not s.alive]

    def stop(self, stage: Stage, timeout_s: float = 30.0) -> int | None:
        """SIGTERM the stage's process group, wait, then SIGKILL. Returns the exit code."""
        if stage.proc is None:
            return None
        if stage.alive:
            _signal_group(stage.proc, signal.SIGTERM)
            try:
                stage.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing", stage.name, timeout_s)
        _signal_group(stage.proc, signal.SIGKILL)  # stragglers in the group (e.g. torchrun workers)
        try:
            stage.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return stage.proc.returncode

    def stop_all(self, timeout_s: float = 30.0) -> dict[str, int | None]:
        """Stop every stage in reverse start order; returns exit codes by stage name."""
        codes = {}
        for stage in reversed(self.stages):
            codes[stage.name] = self.stop(stage, timeout_s)
        return codes

    def pids(self) -> list[int]:
        """PIDs of every started stage process."""
        return [s.proc.pid for s in self.stages if s.proc is not None]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
