"""Who serves a scope now: its incumbent, its candidate, the versions it rolled back (pure).

Folded from the ``control`` records of one run alone (one partition: log order decides), so the
proxy, every syncer and the trainer that read the same log agree. A scope is the full weights
(``None``; versions are ``policy_version`` ints, the first incumbent is version 0) or a tenant's
adapter (versions are adapter content ids; the incumbent is an adapter dict ``{name, version,
sha256}`` or None: the base model, until a first promotion). With rollout on:

- ``weights`` of a version that is not the incumbent and was not rolled back opens a canary:
  it becomes the **candidate** (a newer one supersedes an older candidate, dropped undecided);
  it serves nobody until it is **live**:
- ``resume`` naming the candidate makes it live (every engine holds it: the proxy may route
  the canary share to it). A ``resume`` naming anything else while a canary is open ends the
  canary undecided (the sync failed and the trainer resumed on the previous version), except a
  version that was rolled back, which never serves again. A tenant's ``resume`` to the base model
  (after ``reset``/``delete``) clears the scope.
- ``promote`` of the candidate makes it the incumbent; ``rollback`` adds it to
  :attr:`Scope.rolled_back` and closes the canary (whichever comes first, the decision or the
  ``resume``: a rolled-back version never goes live).

Nothing here reads a clock. :meth:`ServingView.apply` returns whether the record changed anything.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline import events


@dataclass
class Scope:
    """One scope's serving state (see the module docstring). ``incumbent`` / ``candidate``: a
    policy version (full weights) or an adapter dict (tenants; None: the base model / no
    candidate); ``live``: the candidate may serve; ``rolled_back``: versions (ints or adapter
    content ids) that never serve new sessions."""

    incumbent: int | dict | None
    candidate: int | dict | None = None
    live: bool = False
    rolled_back: set = field(default_factory=set)
    opened: int = 0  # canaries opened in this scope (its candidates, superseded ones included)


def version_of(v: int | dict | None):
    """The identity of a scope's version: an int policy version, an adapter's content id, or None."""
    return v["version"] if isinstance(v, dict) else v


class ServingView:
    """The serving state of every scope from ``control`` records of ``run_id``."""

    def __init__(self, run_id: str = "default"):
        self.run_id = run_id
        self.scopes: dict[str | None, Scope] = {None: Scope(incumbent=0)}

    def scope(self, tenant: str | None) -> Scope:
        """The scope of ``tenant`` (None: the full weights); a tenant never seen: the base model."""
        return self.scopes.get(tenant) or Scope(incumbent=None if tenant is not None else 0)

    def canary_open(self, tenant: str | None) -> bool:
        """A candidate of the scope awaits its decision (live or not yet)."""
        return self.scope(tenant).candidate is not None

    def apply(self, ev: events.Event) -> bool:
        """Fold one record; True when the scope's state changed."""
        if not isinstance(ev, events.Control) or ev.run_id != self.run_id:
            return False
        key = None if ev.full_weights else ev.tenant
        if key is None and not ev.full_weights:
            return False
        s = self.scopes.setdefault(key, Scope(incumbent=None if key is not None else 0))
        before = (s.incumbent, s.candidate, s.live, len(s.rolled_back))
        this = ev.policy_version if key is None else ev.adapter
        if ev.action == "weights":
            self._weights(s, this)
        elif ev.action == "resume":
            self._resume(s, this, key)
        elif ev.action in ("reset", "delete") and key is not None:
            s.incumbent, s.candidate, s.live = None, None, False
        elif ev.action == "promote" and s.candidate is not None and version_of(s.candidate) == version_of(this):
            s.incumbent, s.candidate, s.live = s.candidate, None, False
        elif ev.action == "rollback" and this is not None:
            s.rolled_back.add(version_of(this))
            if s.candidate is not None and version_of(s.candidate) == version_of(this):
                s.candidate, s.live = None, False
        return before != (s.incumbent, s.candidate, s.live, len(s.rolled_back))

    @staticmethod
    def _weights(s: Scope, this) -> None:
        v = version_of(this)
        if this is None or v == version_of(s.incumbent) or v in s.rolled_back:
            return
        if s.candidate is None or version_of(s.candidate) != v:
            s.candidate, s.live, s.opened = this, False, s.opened + 1

    @staticmethod
    def _resume(s: Scope, this, key) -> None:
        if key is not None and this is None:  # a tenant back on the base model (reset, delete)
            s.incumbent, s.candidate, s.live = None, None, False
            return
        if key is None:  # the full weights' resume names no version: it ends the open sync
            if s.candidate is not None:
                s.live = True
            return
        v = version_of(this)
        if s.candidate is not None and version_of(s.candidate) == v:
            s.live = True
        elif v != version_of(s.incumbent) and v not in s.rolled_back:
            s.candidate, s.live, s.opened = this, True, s.opened + 1  # its order preceded this view's rules
        else:
            s.candidate, s.live = None, False  # the sync failed: the previous version serves on
