"""Canary routing of a tenant's sessions between its incumbent and its candidate adapter
(docs/rollout.md, "Serving"; on only with ``rollout.enabled``).

The control follower folds a :class:`pipeline.rollout.serving.ServingView` and hands the event
loop an immutable :class:`Arms` per tenant (:func:`arms_of`). :class:`CanaryRoutes` decides which
adapter serves a turn of a tenant's session:

- no canary (no candidate): the incumbent (an adapter dict, or None: the base model); the turn's
  ``canary`` is None and the tenant's pins are forgotten.
- a canary whose candidate is not live yet (its sync runs): the incumbent, ``canary`` =
  ``"incumbent"``.
- a live candidate: a session's arm is decided **at its first turn** (turn index 0) by
  :func:`pipeline.rollout.assign.assign_arm` (hash of tenant, session id, candidate version
  against ``share``) and pinned for the session while that candidate stays the candidate. Only
  candidate sessions are pinned: every unpinned session is on the incumbent, so a session that
  began before the candidate went live (its later turns have index > 0), a side turn of an
  unpinned session and a request without a recorded session never reach the candidate.
- ``rollback`` (or a newer candidate superseding it, or a failed sync): the candidate is no
  longer the scope's candidate, its pins are dropped and its sessions go to the incumbent; it
  never serves again. ``promote``: the candidate is the incumbent, so everyone is served by it.

Memory: the pins of one candidate per tenant, at most ``max_pins`` sessions per tenant (least
recently used dropped first: such a session goes to the incumbent, the safe direction), dropped
when the tenant's canary closes (:meth:`CanaryRoutes.forget_closed`, at every control update).

**The full weights over several engines** (``rollout.canary_engines``): the same routing, under
the scope key :data:`FULL_WEIGHTS` (None: :func:`~pipeline.rollout.assign.assign_arm` hashes no
tenant prefix) with sessions named by :func:`full_session` (tenant and session id); the arm says
which upstream serves the turn (the candidate: ``proxy.canary_engine_url``; the incumbent:
``engine.url``), not an adapter (``Arms`` then holds policy versions).

A proxy restarted mid-canary folds the same view from ``control`` but has no pins: new sessions
are assigned as before (the same hash), sessions already under way (turn index > 0) go to the
incumbent, never to the candidate. A candidate session is thus moved to the incumbent by a
restart (or by an LRU eviction of its pin); a session never moves the other way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from pipeline.rollout.assign import CANDIDATE, INCUMBENT, assign_arm
from pipeline.rollout.serving import ServingView, version_of

#: the full weights' scope key in :class:`CanaryRoutes` and in :func:`arms_of`'s map
FULL_WEIGHTS = None


@dataclass(frozen=True, slots=True)
class Arms:
    """One tenant's serving state (a snapshot: the follower thread never mutates it).

    Attributes:
        incumbent: the adapter ``{name, version, sha256}`` serving everyone outside the canary
            (None: the base model); the full weights' (:data:`FULL_WEIGHTS`): a policy version.
        candidate: the canary's adapter or policy version (None: no canary open).
        live: the candidate is loaded on every engine and may serve its share.
    """

    incumbent: dict | int | None = None
    candidate: dict | int | None = None
    live: bool = False


def arms_of(view: ServingView, full_weights: bool = False) -> dict[str | None, Arms]:
    """Tenant -> :class:`Arms` of every tenant scope of ``view``, and with ``full_weights`` (a
    full-weight canary over several engines) the full weights' under :data:`FULL_WEIGHTS` (else
    they are not routed by the proxy: one engine serves them, the eval set gates them). A new dict
    of frozen values: safe to hand to another thread while ``view`` goes on changing."""
    return {t: Arms(s.incumbent, s.candidate, s.live) for t, s in view.scopes.items()
            if t is not None or full_weights}


def full_session(tenant: str | None, session_id: str | None) -> str | None:
    """The key of a session in the full weights' scope: its id, prefixed by its tenant and a NUL
    (two tenants' sessions never share a pin); None stays None (no recorded session)."""
    return session_id if tenant is None or session_id is None else f"{tenant}\x00{session_id}"


class _Pins:
    """The sessions of one tenant pinned to one candidate version (LRU, at most ``limit``)."""

    __slots__ = ("version", "sessions", "limit")

    def __init__(self, version: str | int, limit: int) -> None:
        self.version, self.limit = version, limit
        self.sessions: OrderedDict[str, None] = OrderedDict()

    def has(self, sid: str) -> bool:
        if sid not in self.sessions:
            return False
        self.sessions.move_to_end(sid)
        return True

    def add(self, sid: str) -> None:
        self.sessions[sid] = None
        if len(self.sessions) > self.limit:
            self.sessions.popitem(last=False)


class CanaryRoutes:
    """Sticky canary arms of tenants' sessions (see the module docstring). Event-loop side only:
    no method awaits, so one session's concurrent first turns get one arm.

    Args:
        share: the canary's share of new sessions, in [0, 1] (``rollout.share``).
        max_pins: the most candidate sessions pinned per tenant (``proxy.max_sessions``).

    Raises:
        ValueError: ``share`` outside [0, 1] or ``max_pins`` < 1.
    """

    def __init__(self, share: float, max_pins: int = 100_000) -> None:
        if not 0.0 <= share <= 1.0 or max_pins < 1:
            raise ValueError(f"canary share must be in [0, 1] and max_pins >= 1, got {share}, {max_pins}")
        self.share, self.max_pins = share, max_pins
        self._pins: dict[str, _Pins] = {}

    def pinned(self, tenant: str | None) -> int:
        """Sessions of ``tenant`` pinned to its candidate now."""
        p = self._pins.get(tenant)
        return 0 if p is None else len(p.sessions)

    def route(self, tenant: str | None, arms: Arms, session_id: str | None,
              first: bool) -> tuple[dict | int | None, str | None]:
        """``(version, canary)`` of one turn of ``tenant``'s session ``session_id`` (None: a request
        without a recorded session); ``first``: the session's first turn (turn index 0).
        ``version``: what serves it (an adapter, None: the base model; the full weights'
        scope :data:`FULL_WEIGHTS`: a policy version); ``canary``: ``"candidate"`` /
        ``"incumbent"`` while the scope's canary is open, else None."""
        cand = arms.candidate
        if cand is None:
            self._pins.pop(tenant, None)
            return arms.incumbent, None
        pins = self._pins.get(tenant)
        version = version_of(cand)
        if pins is not None and pins.version != version:  # superseded (or reopened): start again
            del self._pins[tenant]
            pins = None
        if not arms.live or session_id is None:
            return arms.incumbent, INCUMBENT
        if pins is not None and pins.has(session_id):
            return cand, CANDIDATE
        if first and assign_arm(tenant, session_id, version, self.share) == CANDIDATE:
            if pins is None:
                pins = self._pins[tenant] = _Pins(version, self.max_pins)
            pins.add(session_id)
            return cand, CANDIDATE
        return arms.incumbent, INCUMBENT

    def forget_closed(self, serving: dict[str | None, Arms] | None) -> None:
        """Drop the pins of every tenant whose pinned candidate is no longer its candidate
        (promoted, rolled back, superseded, reset), so memory stays bounded by open canaries."""
        for tenant, pins in list(self._pins.items()):
            arms = (serving or {}).get(tenant)
            if arms is None or arms.candidate is None or version_of(arms.candidate) != pins.version:
                del self._pins[tenant]
