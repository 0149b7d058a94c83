"""Follow the ``control`` topic: weight-sync pauses and the policy versions engines apply.

A daemon thread reads partition 0 of the control topic with no consumer group (manual
assignment, nothing committed) from the beginning, so a proxy that starts in the middle of a
sync learns that it is paused. State:

- ``pause`` (epoch e): a sync runs; the proxy holds new requests (see :class:`SyncGate`).
- ``resume``: the sync is over. ``failed`` does not resume by itself (the trainer decides).
- ``applied`` (engine, version): ``applied_version`` is the highest version an engine reported;
  it tags turns when the engine's response carries no usable ``weight_version``.

A pause older than ``max_pause_s`` (by its ``created_at``) is treated as over, so a trainer
that died mid-sync cannot hold traffic for ever. Broker trouble only delays these updates; the
thread reconnects with back-off (:class:`pipeline.bus.Follower`: from the record after the last
one applied) and never affects serving. Records that are not valid
``control`` events go to ``control.dlq`` (:class:`pipeline.bus.TopicReader` rules; if the
dead letter cannot be written within ``DLQ_GIVE_UP_S`` the record is logged as an error and
passed over: this reader commits nothing) and following goes on.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

from pipeline import events
from pipeline.bus import Follower, Offset
from pipeline.config import Config

log = logging.getLogger(__name__)

DLQ_GIVE_UP_S = 10.0  # a follower passes over a bad record whose dead letter cannot be written


@dataclass
class ControlState:
    """What the control topic says now.

    Attributes:
        paused: a weight sync is in progress.
        epoch: the epoch of the latest pause/resume.
        paused_at_ms: ``created_at`` of the pause (ms since the epoch), 0 when not paused.
        applied_version: highest policy version an engine reported as applied (-1: none seen).
    """

    paused: bool = False
    epoch: int = -1
    paused_at_ms: int = 0
    applied_version: int = -1


class ControlFollower:
    """Daemon thread applying control events to a :class:`ControlState` (a :class:`pipeline.bus.Follower`).

    Args:
        config: the process config (topic name from ``topics``, client settings from ``kafka``).
        on_change: called (from the follower thread) with a copy of the state after each poll that changed it.
    """

    def __init__(self, config: Config, on_change: Callable[[ControlState], None]) -> None:
        self.config = config
        self.topic = config.topics.name("control")
        self.on_change = on_change
        self.state = ControlState()
        self._changed = False
        self._follower = Follower(config, self.topic, self._record, name="proxy", start=Offset(0), partitions=[0],
                                  dlq=True, dlq_give_up_s=DLQ_GIVE_UP_S, after_batch=self._publish,
                                  poll_timeout_ms=300, bootstrap_timeout_ms=2000)

    @property
    def records(self) -> int:
        """Records read from ``control`` (dead-lettered ones included)."""
        return self._follower.records

    def start(self) -> "ControlFollower":
        """Start following."""
        self._follower.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the thread."""
        self._follower.stop(timeout_s)

    def apply(self, ev: events.Event) -> bool:
        """Apply one event to the state; True if it changed."""
        if not isinstance(ev, events.Control) or not ev.full_weights:
            return False
        s = self.state
        before = (s.paused, s.epoch, s.applied_version)
        if ev.action == "pause":
            s.paused, s.epoch, s.paused_at_ms = True, ev.epoch, ev.created_at or events.now_ms()
        elif ev.action == "resume":
            if ev.epoch >= s.epoch:
                s.paused, s.epoch, s.paused_at_ms = False, ev.epoch, 0
        elif ev.action == "applied":
            s.applied_version = max(s.applied_version, ev.policy_version)
        return before != (s.paused, s.epoch, s.applied_version)

    def _record(self, rec) -> None:
        self._changed |= self.apply(rec.event)

    def _publish(self) -> None:
        if self._changed:
            self._changed = False
            s = self.state
            log.info("control: paused=%s epoch=%d applied_version=%d", s.paused, s.epoch, s.applied_version)
            self.on_change(ControlState(s.paused, s.epoch, s.paused_at_ms, s.applied_version))


class SyncGate:
    """Event-loop side of the weight-sync hold.

    ``wait()`` returns at once when no sync runs; during one it waits until ``resume`` or until
    ``hold_timeout_s`` (then the request goes through, or gets 503 when ``strict``).

    Args:
        hold_timeout_s: the longest a request is held.
        max_pause_s: a pause older than this (from its ``created_at``) is ignored.
    """

    def __init__(self, hold_timeout_s: float, max_pause_s: float) -> None:
        import asyncio

        self.hold_timeout_s = hold_timeout_s
        self.max_pause_s = max_pause_s
        self._open = asyncio.Event()
        self._open.set()
        self.state = ControlState()

    @property
    def paused(self) -> bool:
        """A sync runs now (and its pause is not stale)."""
        s = self.state
        return s.paused and (time.time() * 1000 - s.paused_at_ms) < self.max_pause_s * 1000

    def update(self, state: ControlState) -> None:
        """Apply a new control state (call on the event loop thread)."""
        self.state = state
        if self.paused:
            self._open.clear()
        else:
            self._open.set()

    async def wait(self) -> float:
        """Hold while paused; returns the seconds held (0.0 when not paused).

        Raises:
            TimeoutError: the hold timed out (the caller decides: go through or 503).
        """
        if self._open.is_set() or not self.paused:
            return 0.0
        import asyncio

        t0 = time.monotonic()
        left = self.max_pause_s - (time.time() * 1000 - self.state.paused_at_ms) / 1000
        timeout = max(0.0, min(self.hold_timeout_s, left))
        try:
            await asyncio.wait_for(self._open.wait(), timeout)
        except asyncio.TimeoutError:
            if self.paused and timeout >= self.hold_timeout_s:
                raise TimeoutError(f"weight sync still running after {self.hold_timeout_s:.1f} s") from None
        return time.monotonic() - t0
