"""Follow the ``control`` topic: weight-sync pauses and the policy versions engines apply.

A daemon thread reads partition 0 of the control topic with no consumer group (manual
assignment, nothing committed) from the beginning, so a proxy that starts in the middle of a
sync learns that it is paused. State:

- ``pause`` (epoch e): a sync runs; the proxy holds new requests (see :class:`SyncGate`).
- ``resume``: the sync is over. ``failed`` does not resume by itself (the trainer decides).
- ``applied`` (engine, version): ``applied_version`` is the highest version an engine reported;
  it tags turns when the engine's response carries no usable ``weight_version``.
- a tenant's ``pause`` / ``resume`` (``tenant`` set: adapter sync, docs/tenants.md): that
  tenant's requests only are held (:class:`TenantState`), every other tenant and untenanted
  traffic is served throughout; the tenant's ``resume`` names the adapter that serves it from
  then on (None: the base model), which the proxy routes its requests to and records on its turns.
- with ``rollout.enabled`` (docs/rollout.md) a tenant's adapter is its serving view's instead
  (:class:`pipeline.rollout.serving.ServingView`, folded from the same records, ``promote`` and
  ``rollback`` included): its incumbent, and a live candidate for the canary share of new
  sessions (:mod:`pipeline.proxy.canary`). Off: the last ``resume``'s adapter, as above.
- with ``rollout.canary_engines`` too, the full weights' serving view (incumbent, live candidate)
  under :data:`pipeline.proxy.canary.FULL_WEIGHTS`: the canary share of new sessions goes to
  ``proxy.canary_engine_url`` (:meth:`SyncGate.serve_full`).

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
from dataclasses import dataclass, field, replace
from typing import Callable

from pipeline import events
from pipeline.bus import Follower, Offset
from pipeline.config import Config
from pipeline.proxy.canary import FULL_WEIGHTS, Arms, CanaryRoutes, arms_of, full_session
from pipeline.rollout.serving import ServingView

log = logging.getLogger(__name__)

DLQ_GIVE_UP_S = 10.0  # a follower passes over a bad record whose dead letter cannot be written


@dataclass(frozen=True)
class TenantState:
    """One tenant's adapter sync as the control topic says it now.

    Attributes:
        paused: a sync of the tenant's adapter runs (its requests are held).
        epoch: the epoch of the tenant's latest pause/resume.
        paused_at_ms: ``created_at`` of that pause (ms since the epoch), 0 when not paused.
        adapter: ``{name, version, sha256}`` of the tenant's last ``resume`` (None: the base model).
    """

    paused: bool = False
    epoch: int = -1
    paused_at_ms: int = 0
    adapter: dict | None = None


@dataclass
class ControlState:
    """What the control topic says now.

    Attributes:
        paused: a full-weight sync is in progress.
        epoch: the epoch of the latest full-weight pause/resume.
        paused_at_ms: ``created_at`` of the pause (ms since the epoch), 0 when not paused.
        applied_version: highest policy version an engine reported as applied (-1: none seen).
        tenants: tenant -> :class:`TenantState` (immutable: a copy of the dict is a snapshot).
        serving: tenant -> :class:`pipeline.proxy.canary.Arms` of the rollout serving view (None:
            rollout off; immutable values: a copy of the dict is a snapshot); with
            ``rollout.canary_engines`` also the full weights' under ``FULL_WEIGHTS``.
    """

    paused: bool = False
    epoch: int = -1
    paused_at_ms: int = 0
    applied_version: int = -1
    tenants: dict[str, TenantState] = field(default_factory=dict)
    serving: dict[str | None, Arms] | None = None

    def copy(self) -> "ControlState":
        """A snapshot (for the event loop while the follower thread goes on)."""
        return replace(self, tenants=dict(self.tenants),
                       serving=None if self.serving is None else dict(self.serving))


class ControlFollower:
    """Daemon thread applying control events to a :class:`ControlState` (a :class:`pipeline.bus.Follower`).

    Args:
        config: the process config (topic name from ``topics``, client settings from ``kafka``).
        on_change: called (from the follower thread) with a copy of the state after each poll that changed it.

    Attributes:
        view: the rollout serving view of the run's ``control`` records (None: rollout off).
        full_canary: a full-weight canary over several engines (``rollout.canary_engines``).
    """

    view: ServingView | None = None
    full_canary: bool = False  # rollout.canary_engines: the full weights' arms are in the view's snapshot too

    def __init__(self, config: Config, on_change: Callable[[ControlState], None]) -> None:
        self.config = config
        self.topic = config.topics.name("control")
        self.on_change = on_change
        self.run_id = config.syncer.run_id or config.trainer.run_id  # the run whose adapter orders count
        self.state = ControlState()
        self.full_canary = config.rollout.enabled and bool(config.rollout.canary_engines)
        if config.rollout.enabled:
            self.view, self.state.serving = ServingView(self.run_id), arms_of(ServingView(self.run_id),
                                                                               self.full_canary)
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
        if not isinstance(ev, events.Control):
            return False
        if ev.tenant is not None:
            return self._apply_tenant(ev) | self._apply_serving(ev)
        if not ev.full_weights:
            return False
        changed = self.full_canary and self._apply_serving(ev)
        s = self.state
        before = (s.paused, s.epoch, s.applied_version)
        if ev.action == "pause":
            s.paused, s.epoch, s.paused_at_ms = True, ev.epoch, ev.created_at or events.now_ms()
        elif ev.action == "resume":
            if ev.epoch >= s.epoch:
                s.paused, s.epoch, s.paused_at_ms = False, ev.epoch, 0
        elif ev.action == "applied":
            s.applied_version = max(s.applied_version, ev.policy_version)
        return changed or before != (s.paused, s.epoch, s.applied_version)

    def _apply_tenant(self, ev: events.Control) -> bool:
        """A tenant's ``pause`` holds its requests; its ``resume`` releases them and names its
        adapter, whatever its epoch: ``control`` is one partition, so log order decides, exactly
        as it does for the syncers (a trainer restarted from an older checkpoint resumes with a
        lower epoch). Records of another run, and other tenant records, change nothing here."""
        if ev.run_id != self.run_id:
            return False
        t = self.state.tenants.get(ev.tenant, TenantState())
        if ev.action == "pause":
            new = replace(t, paused=True, epoch=ev.epoch, paused_at_ms=ev.created_at or events.now_ms())
        elif ev.action == "resume":
            new = TenantState(False, ev.epoch, 0, ev.adapter)
        else:
            return False
        self.state.tenants[ev.tenant] = new
        return new != t

    def _apply_serving(self, ev: events.Control) -> bool:
        """Fold a tenant's record (with ``rollout.canary_engines`` also a full-weight one) into the
        rollout serving view (rollout on; the view keeps only this run's records); True when a
        scope's :class:`Arms` changed."""
        if self.view is None or not self.view.apply(ev):
            return False
        self.state.serving = arms_of(self.view, self.full_canary)  # a new dict: the event loop's snapshot is never touched
        return True

    def _record(self, rec) -> None:
        self._changed |= self.apply(rec.event)

    def _publish(self) -> None:
        if self._changed:
            self._changed = False
            s = self.state
            log.info("control: paused=%s epoch=%d applied_version=%d tenants paused=%s", s.paused, s.epoch,
                     s.applied_version, sorted(k for k, t in s.tenants.items() if t.paused))
            self.on_change(s.copy())


class SyncGate:
    """Event-loop side of the weight-sync hold.

    ``wait(tenant)`` returns at once when neither a full-weight sync nor a sync of ``tenant``'s
    adapter runs (another tenant's sync holds nothing here); otherwise it waits until the
    ``resume`` that ends what holds it, or until ``hold_timeout_s`` (then the request goes
    through, or gets 503 when ``strict``).

    :meth:`serve` says which adapter serves a tenant's turn (with rollout on: its canary arm,
    :class:`pipeline.proxy.canary.CanaryRoutes`).

    Args:
        hold_timeout_s: the longest a request is held.
        max_pause_s: a pause older than this (from its ``created_at``) is ignored.
        canary_share: the canary's share of new sessions (``rollout.share``; used with rollout on).
        max_pins: the most sessions pinned to a tenant's candidate (``proxy.max_sessions``).
    """

    def __init__(self, hold_timeout_s: float, max_pause_s: float, canary_share: float = 0.1,
                 max_pins: int = 100_000) -> None:
        import asyncio

        self.hold_timeout_s = hold_timeout_s
        self.max_pause_s = max_pause_s
        self.routes = CanaryRoutes(canary_share, max_pins)
        self._changed = asyncio.Event()  # set (and replaced) at every update: wakes the waiters
        self.state = ControlState()

    def _live(self, paused: bool, paused_at_ms: int) -> bool:
        return paused and (time.time() * 1000 - paused_at_ms) < self.max_pause_s * 1000

    @property
    def paused(self) -> bool:
        """A full-weight sync runs now (and its pause is not stale)."""
        return self._live(self.state.paused, self.state.paused_at_ms)

    def tenant_paused(self, tenant: str | None) -> bool:
        """A sync of ``tenant``'s adapter runs now (and its pause is not stale); False for None."""
        t = self.state.tenants.get(tenant) if tenant is not None else None
        return t is not None and self._live(t.paused, t.paused_at_ms)

    def held(self, tenant: str | None = None) -> bool:
        """A request of ``tenant`` (None: untenanted) is held now."""
        return self.paused or self.tenant_paused(tenant)

    def adapter_of(self, tenant: str | None) -> dict | None:
        """The adapter of ``tenant``'s last ``resume`` (None: the base model, or no tenant)."""
        t = self.state.tenants.get(tenant) if tenant is not None else None
        return None if t is None else t.adapter

    def serve(self, tenant: str | None, session_id: str | None, first: bool) -> tuple[dict | None, str | None]:
        """``(adapter, canary)`` of a turn of ``tenant``'s session ``session_id`` (None: not
        recorded); ``first``: its first turn. Rollout off (or no tenant): the tenant's
        :meth:`adapter_of` and no canary; on: :meth:`pipeline.proxy.canary.CanaryRoutes.route`."""
        if tenant is None or self.state.serving is None:
            return self.adapter_of(tenant), None
        return self.routes.route(tenant, self.state.serving.get(tenant) or Arms(), session_id, first)

    def serve_full(self, tenant: str | None, session_id: str | None, first: bool) -> tuple[bool, str | None]:
        """``(to_canary, canary)`` of a turn of ``tenant``'s session ``session_id`` (None: not
        recorded) in a full-weight canary over several engines: ``to_canary`` when the turn goes to
        ``proxy.canary_engine_url`` (a candidate session), ``canary`` its arm while the full
        weights' canary is open (None: no canary, or no full-weight canary configured). The rule
        is :meth:`pipeline.proxy.canary.CanaryRoutes.route`'s, under ``FULL_WEIGHTS``."""
        arms = None if self.state.serving is None else self.state.serving.get(FULL_WEIGHTS)
        if arms is None:
            return False, None
        version, canary = self.routes.route(FULL_WEIGHTS, arms, full_session(tenant, session_id), first)
        return canary == "candidate" and version == arms.candidate, canary

    def _stale_in(self, tenant: str | None) -> float:
        """Seconds until every pause that holds ``tenant`` now is stale (``max_pause_s``)."""
        now = time.time() * 1000
        ats = [self.state.paused_at_ms] if self.paused else []
        if self.tenant_paused(tenant):
            ats.append(self.state.tenants[tenant].paused_at_ms)
        return max((self.max_pause_s * 1000 - (now - at)) / 1000 for at in ats) if ats else 0.0

    def update(self, state: ControlState) -> None:
        """Apply a new control state (call on the event loop thread)."""
        import asyncio

        self.state = state
        if state.serving is not None:
            self.routes.forget_closed(state.serving)
        woken, self._changed = self._changed, asyncio.Event()
        woken.set()

    async def wait(self, tenant: str | None = None) -> float:
        """Hold while a request of ``tenant`` is held (:meth:`held`); returns the seconds held (0.0
        when not held).

        Raises:
            TimeoutError: the hold timed out (the caller decides: go through or 503).
        """
        if not self.held(tenant):
            return 0.0
        import asyncio

        t0 = time.monotonic()
        while self.held(tenant):
            left = self.hold_timeout_s - (time.monotonic() - t0)
            if left <= 0:
                raise TimeoutError(f"weight sync still running after {self.hold_timeout_s:.1f} s")
            try:
                await asyncio.wait_for(self._changed.wait(), max(0.0, min(left, self._stale_in(tenant))))
            except asyncio.TimeoutError:
                pass
        return time.monotonic() - t0
