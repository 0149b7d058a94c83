"""Sticky canary assignment: which arm serves a session (pure; the proxy would call it).

A session's arm is decided once, at its first turn, from a hash of (tenant, session id,
candidate version) against the canary share, and kept for the session's life
(:class:`SessionArms`): a session that began on the incumbent is never moved to the candidate,
whatever the share or the candidate becomes later. One that began on a candidate that was then
rolled back or superseded goes to the incumbent (a rolled-back version serves no one new); one
that began on a candidate that was promoted stays on it (it is the incumbent now).
"""

from __future__ import annotations

import hashlib

CANDIDATE, INCUMBENT = "candidate", "incumbent"


def canary_point(tenant: str | None, session_id: str, candidate) -> float:
    """A session's point in [0, 1): the first 8 bytes of sha256(tenant, session id, candidate
    version) as a fraction (uniform over sessions; a new candidate reshuffles new sessions)."""
    key = "\x00".join(("" if tenant is None else f"t:{tenant}", session_id, str(candidate)))
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64


def assign_arm(tenant: str | None, session_id: str, candidate, share: float) -> str:
    """:data:`CANDIDATE` when the session's :func:`canary_point` is below ``share`` (in [0, 1]),
    else :data:`INCUMBENT`; :data:`INCUMBENT` when there is no candidate (None). Raises ValueError
    when ``share`` is outside [0, 1]."""
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"canary share must be in [0, 1], got {share}")
    if candidate is None:
        return INCUMBENT
    return CANDIDATE if canary_point(tenant, session_id, candidate) < share else INCUMBENT


class SessionArms:
    """The version each live session is pinned to, decided at its first turn.

    :meth:`serve` returns ``(arm, version)`` for a turn; ``incumbent`` / ``candidate`` are the
    scope's versions now (``candidate`` None: no canary). Memory: one entry per session seen
    (:meth:`end` forgets one).
    """

    def __init__(self):
        self._pinned: dict[tuple, tuple[str, object]] = {}

    def serve(self, tenant: str | None, session_id: str, incumbent, candidate, share: float) -> tuple[str, object]:
        key = (tenant, session_id)
        pinned = self._pinned.get(key)
        if pinned is not None:
            arm, version = pinned
            if arm == INCUMBENT or version in (candidate, incumbent):
                return (INCUMBENT if version == incumbent and arm == CANDIDATE else arm), version
            self._pinned[key] = (INCUMBENT, incumbent)  # its candidate was rolled back or superseded
            return INCUMBENT, incumbent
        arm = assign_arm(tenant, session_id, candidate, share)
        self._pinned[key] = (arm, candidate if arm == CANDIDATE else incumbent)
        return self._pinned[key]

    def end(self, tenant: str | None, session_id: str) -> None:
        self._pinned.pop((tenant, session_id), None)
