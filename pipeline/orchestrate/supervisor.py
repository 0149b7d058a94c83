"""Start stages as child processes with per-stage logs, readiness checks, restarts and clean shutdown.

Each child runs in its own process group, so a stage's own children (e.g. torchrun workers)
are stopped with it. :meth:`Supervisor.stop_all` sends SIGTERM in reverse start order, waits,
then SIGKILLs what is left: no orphan processes.

Restarts (what systemd's ``Restart=always`` with ``RestartSec`` growing, or a Kubernetes pod's
CrashLoopBackOff, do): :meth:`Supervisor.check`, called periodically (or :meth:`Supervisor.watch`
in a thread), restarts a stage whose process exited with the same command line, after a back-off
that doubles with every consecutive *fast* failure (the stage ran less than
:attr:`RestartPolicy.stable_s`) from :attr:`RestartPolicy.backoff_s` up to
:attr:`RestartPolicy.max_backoff_s`; a run that lasted ``stable_s`` resets it. Restarts are
counted per stage (:attr:`Stage.restarts`). Only :attr:`RestartPolicy.max_fast_failures` fast
failures in a row give up: :meth:`check` raises :class:`StageFailed` with the stage's log tail.
A restarted stage is not waited for: its readiness probe is polled by :meth:`check` and shown
by :attr:`Stage.state` (``up``, ``starting``, ``restarting in N s``).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
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


@dataclass(frozen=True)
class StopOutcome:
    """How a stage ended when the supervisor stopped it.

    Attributes:
        code: the process's exit status (negative: the signal that ended it), None if never started.
        how: ``stopped`` (it ended on the SIGTERM, with status 0 or by the signal itself, as
            uvicorn re-raises it), ``failed`` (it ended on the SIGTERM with another status),
            ``killed`` (it ignored SIGTERM for ``timeout_s`` and was SIGKILLed), ``exited`` (it
            had already exited before the stop) or ``not started``.
    """

    code: int | None
    how: str

    @property
    def clean(self) -> bool:
        """True when the stage stopped as asked."""
        return self.how == "stopped"

    def __str__(self) -> str:
        if self.how in ("stopped", "not started"):
            return self.how
        return f"{self.how} (exit {self.code})"


@dataclass(frozen=True)
class RestartPolicy:
    """When and how fast :class:`Supervisor` restarts a stage whose process exited.

    Attributes:
        restart: restart exited stages at all (False: :meth:`Supervisor.check` raises at the first exit).
        backoff_s: delay before the first restart after a fast failure (seconds); doubles per
            consecutive fast failure.
        max_backoff_s: upper bound of that delay.
        stable_s: a run at least this long (seconds) is not a fast failure: it resets the back-off
            and its stage is restarted at once.
        max_fast_failures: this many fast failures in a row stop the stack.
    """

    restart: bool = True
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    stable_s: float = 30.0
    max_fast_failures: int = 5


@dataclass
class Stage:
    """A supervised child process (the current one of its restarts)."""

    name: str
    argv: list[str]
    log_path: Path
    proc: subprocess.Popen | None = None
    ready: Callable[[], bool] | None = None
    started_at: float = field(default_factory=time.monotonic)
    env: dict[str, str] | None = None
    restarts: int = 0  # times this stage was restarted after its process exited
    fast_failures: int = 0  # consecutive exits after less than RestartPolicy.stable_s
    restart_at: float | None = None  # monotonic time of the scheduled restart (process exited)
    is_ready: bool = False  # the readiness probe answered since the last (re)start
    exits: list[int | None] = field(default_factory=list)  # exit codes of the processes that ended

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """PID of the current process (None before the first start)."""
        return self.proc.pid if self.proc is not None else None

    @property
    def state(self) -> str:
        """``up``, ``starting`` (running, not ready yet), ``restarting in N s`` or ``DOWN``."""
        if self.alive:
            return "up" if self.is_ready or self.ready is None else "starting"
        if self.restart_at is not None:
            return f"restarting in {max(0.0, self.restart_at - time.monotonic()):.0f} s"
        return "DOWN"

    def tail(self, n: int = 15) -> str:
        """The last ``n`` lines of the stage's log."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


class Supervisor:
    """Owns the stage processes of one run; logs go to ``log_dir/<stage>.log``.

    Args:
        log_dir: folder of the per-stage logs (appended to across restarts).
        env: extra environment of every child.
        policy: the :class:`RestartPolicy` of :meth:`check`.
    """

    def __init__(self, log_dir: str | Path, env: dict[str, str] | None = None,
                 policy: RestartPolicy | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.policy = policy or RestartPolicy()
        self.stages: list[Stage] = []
        self.stopping = False
        self._outcomes: dict[str, StopOutcome] = {}  # how each stage stopped, once stop_all stopped it
        self._lock = threading.RLock()  # check() (a watch thread) against stop()/start()

    def _spawn(self, stage: Stage) -> None:
        out = open(stage.log_path, "ab")
        try:
            stage.proc = subprocess.Popen(stage.argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                          env={**self.env, **(stage.env or {})}, start_new_session=True,
                                          preexec_fn=die_with_parent)
        finally:
            out.close()
        stage.started_at = time.monotonic()
        stage.is_ready = False
        stage.restart_at = None

    def start(self, name: str, args: list[str], ready: Callable[[], bool] | None = None,
              timeout_s: float = 300.0, env: dict[str, str] | None = None) -> Stage:
        """Start ``python -m pipeline <args>`` and wait until ``ready()`` is true.

        Raises:
            StageFailed: the process exited, or was not ready within ``timeout_s``.
        """
        argv = [sys.executable, "-m", "pipeline", *args]
        stage = Stage(name, argv, self.log_dir / f"{name}.log", ready=ready, env=env)
        with self._lock:
            self._spawn(stage)
            self.stages.append(stage)
        log.info("started %s (pid %d), log %s", name, stage.pid, stage.log_path)
        deadline = time.monotonic() + timeout_s
        while ready is not None and not ready():
            if not stage.alive:
                raise StageFailed(f"{name} exited with {stage.proc.returncode} during start-up; "
                                  f"see {stage.log_path}:\n{stage.tail()}")
            if time.monotonic() > deadline:
                raise StageFailed(f"{name} not ready after {timeout_s:.0f} s; see {stage.log_path}:\n{stage.tail()}")
            time.sleep(0.5)
        stage.is_ready = True
        return stage

    def get(self, name: str) -> Stage:
        """The stage called ``name``. Raises KeyError."""
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(name)

    def dead(self) -> list[Stage]:
        """Stages whose process has exited (and is not restarted yet)."""
        return [s for s in self.stages if not s.alive]

    def check(self, now: float | None = None) -> list[str]:
        """One supervision pass: schedule and perform restarts, poll readiness of (re)starting stages.

        Returns human-readable lines of what happened (exits seen, restarts made).

        Raises:
            StageFailed: a stage failed fast :attr:`RestartPolicy.max_fast_failures` times in a row
                (or exited at all when restarts are off); the message has its log tail.
        """
        pol = self.policy
        events_: list[str] = []
        with self._lock:
            if self.stopping:
                return events_
            for st in self.stages:
                now_ = time.monotonic() if now is None else now
                if st.alive:
                    if not st.is_ready and st.ready is not None:
                        try:
                            st.is_ready = bool(st.ready())
                        except Exception:  # noqa: BLE001 - a probe that fails means not ready
                            st.is_ready = False
                    continue
                if st.restart_at is None:  # a new exit
                    code = st.proc.returncode if st.proc is not None else None
                    st.exits.append(code)
                    ran = now_ - st.started_at
                    if not pol.restart:
                        raise StageFailed(f"stage {st.name} exited with {code}; log {st.log_path}:\n{st.tail()}")
                    st.fast_failures = st.fast_failures + 1 if ran < pol.stable_s else 0
                    if st.fast_failures >= pol.max_fast_failures:
                        raise StageFailed(
                            f"stage {st.name} failed {st.fast_failures} times in a row, each within "
                            f"{pol.stable_s:.0f} s of its start (last exit {code}); giving up. "
                            f"Log {st.log_path}:\n{st.tail(30)}")
                    delay = 0.0 if st.fast_failures == 0 else min(
                        pol.max_backoff_s, pol.backoff_s * 2 ** (st.fast_failures - 1))
                    st.restart_at = now_ + delay
                    msg = (f"stage {st.name} (pid {st.pid}) exited with {code} after {ran:.1f} s; "
                           f"restart #{st.restarts + 1} in {delay:.1f} s")
                    log.warning(msg)
                    events_.append(msg)
                if now_ >= st.restart_at:
                    self._spawn(st)
                    st.restarts += 1
                    msg = f"stage {st.name} restarted (pid {st.pid}, restart #{st.restarts})"
                    log.warning(msg)
                    events_.append(msg)
        return events_

    def watch(self, stop: threading.Event, interval_s: float = 0.5,
              on_event: Callable[[str], None] | None = None,
              on_fatal: Callable[[StageFailed], None] | None = None) -> None:
        """Run :meth:`check` every ``interval_s`` until ``stop`` is set (use it as a thread target).

        ``on_event`` gets each line :meth:`check` returns; ``on_fatal`` gets the
        :class:`StageFailed` that ends the watch (then ``stop`` is set too).
        """
        while not stop.wait(interval_s):
            try:
                for line in self.check():
                    if on_event is not None:
                        on_event(line)
            except StageFailed as e:
                if on_fatal is not None:
                    on_fatal(e)
                stop.set()
                return

    def restarts(self) -> dict[str, int]:
        """Restarts per stage name."""
        return {s.name: s.restarts for s in self.stages}

    def stop(self, stage: Stage, timeout_s: float = 30.0) -> StopOutcome:
        """SIGTERM the stage's process group, wait up to ``timeout_s``, then SIGKILL what is left.
        Returns how it ended (:class:`StopOutcome`)."""
        if stage.proc is None:
            return StopOutcome(None, "not started")
        stage.restart_at = None
        how = "exited"
        if stage.alive:
            _signal_group(stage.proc, signal.SIGTERM)
            try:
                code = stage.proc.wait(timeout_s)
                how = "stopped" if code in (0, -signal.SIGTERM) else "failed"
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop within %.0f s: killing", stage.name, timeout_s)
                how = "killed"
        _signal_group(stage.proc, signal.SIGKILL)  # stragglers in the group (e.g. torchrun workers)
        try:
            stage.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        return StopOutcome(stage.proc.returncode, how)

    def stop_all(self, timeout_s: float = 30.0, keep: tuple[str, ...] = ()) -> dict[str, StopOutcome]:
        """Stop every stage in reverse start order (no restarts from then on), except those named in
        ``keep`` (e.g. the broker, to read the topics once every writer has stopped); how each
        ended, by name (a later call stops the kept ones and returns every stage's outcome)."""
        with self._lock:
            self.stopping = True
        for stage in reversed(self.stages):
            if stage.name in keep or stage.name in self._outcomes:
                continue
            self._outcomes[stage.name] = self.stop(stage, timeout_s)
        return {st.name: self._outcomes[st.name] for st in reversed(self.stages)
                if st.name in self._outcomes and st.name not in keep}

    def pids(self) -> list[int]:
        """PIDs of every started stage process."""
        return [s.proc.pid for s in self.stages if s.proc is not None]


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass
