"""``python -m pipeline ...`` as a child process whose output is read as it comes (the broker and
proxy crash tests: tests/core/test_broker_durable.py, tests/proxy/test_proxy_crash.py)."""

from __future__ import annotations

import queue
import re
import subprocess
import sys
import threading
import time

import pytest


class PipelineProcess:
    """``python -m pipeline ARGS`` as a child (stdin closed, stderr into stdout); a thread keeps
    every output line in :attr:`output` and hands it to :meth:`wait_line`."""

    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "pipeline", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, stdin=subprocess.DEVNULL)
        self.lines: queue.Queue = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.output.append(line)
            self.lines.put(line)
        self.lines.put(None)

    def wait_line(self, pattern: str, failure: str, timeout_s: float) -> re.Match:
        """The match of the first output line from now on that starts with ``pattern`` (a regex).

        Raises:
            pytest.fail.Exception: the process ended or ``timeout_s`` passed first (``failure``,
                then its whole output, in the message).
        """
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=1.0)
            except queue.Empty:
                continue
            if line is None:
                break
            m = re.match(pattern, line)
            if m:
                return m
        pytest.fail(f"{failure}; output:\n{''.join(self.output)}")
