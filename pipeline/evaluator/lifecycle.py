"""The lifecycle both evaluator threads share (the decider and the eval runner): a daemon thread
running the owner's ``run``, started once and stopped by the owner's ``stop`` event."""

from __future__ import annotations

import threading


class DaemonThread:
    """Mixin: call :meth:`_init_thread` in ``__init__`` (after ``self.stop`` is set); the class
    provides ``run``. :meth:`close` sets ``stop`` and joins (not from the thread itself), then
    calls :meth:`_closed` for what the owner must release."""

    def _init_thread(self, name: str) -> None:
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)

    def start(self):
        """Run in a daemon thread; returns self."""
        self._thread.start()
        return self

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop and join the thread (at most ``timeout_s``), then :meth:`_closed`."""
        self.stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)
        self._closed()

    def _closed(self) -> None:
        """After the join: release what the thread left (default: nothing)."""
