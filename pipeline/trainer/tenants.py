"""Per-tenant adapter state of the trainer with ``trainer.lora`` (pure: no Kafka, no torch).

For each tenant ``T`` the trainer keeps (:class:`TenantState`, checkpointed in ``meta.json`` as
``tenants``):

- ``updates`` (``n_T``): how many adapter updates of ``T`` were trained. It is the ``epoch`` and
  ``policy_version`` of ``T``'s adapter sync records and the version ``T``'s samples are stale
  against. It never goes back (a ``reset`` keeps it), so a tenant's records count up like the
  full weights' versions do.
- ``versions``: ``{adapter version: n}``, the update count that produced each exported adapter
  content (:func:`pipeline.weightsync.adapter_version`), the newest :data:`VERSIONS_KEPT` (or
  ``max_staleness + 1`` when larger) kept. A sample records the adapter that served it
  (``sample.adapter.version``), so its staleness is ``n_T - versions[version]``.
- ``base``: the ``n`` a sample served by the base model (``sample.adapter`` None) counts as:
  0, or ``n_T`` at the last ``reset``/``delete`` (the fresh adapter, ``B = 0``, *is* the base
  model, so the base's samples are on-policy for it).
- ``frozen``: ``T``'s batches are consumed and train nothing (``pipeline adapters freeze``).
- ``published``: the adapter the last ``resume`` of ``T`` named (``{name, version, sha256}``;
  None: the base model), what ``T`` is served by.
- ``synced``: the ``n`` of the last update whose sync finished (its ``resume`` was sent). A
  restored tenant with ``synced < updates`` and an adapter is exported and synced again.

Unknown versions (a sample served by an adapter version the table does not hold: evicted as old,
forgotten by a ``reset``, or from another run): :meth:`TenantTable.produced_by` returns None and
the source treats the sample as older than any staleness limit (dropped with ``stale_policy:
drop``, down-weighted to the smallest weight with ``downweight``; counted as ``unknown_adapter``).
Without a limit (``max_staleness: None``) nothing is ever stale and it is trained. It is never
trained as fresh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

#: adapter versions remembered per tenant (at least; ``max_staleness + 1`` when larger)
VERSIONS_KEPT = 64


@dataclass
class TenantState:
    """One tenant's adapter bookkeeping (see the module docstring)."""

    updates: int = 0
    versions: dict[str, int] = field(default_factory=dict)
    base: int = 0
    frozen: bool = False
    published: dict | None = None
    synced: int = 0


class TenantTable:
    """Every tenant's :class:`TenantState`; ``keep``: versions remembered per tenant."""

    def __init__(self, keep: int = VERSIONS_KEPT, meta: dict | None = None) -> None:
        self.keep = max(1, keep)
        self.tenants: dict[str, TenantState] = {}
        for t, s in (meta or {}).items():
            self.tenants[t] = TenantState(int(s["updates"]), {str(k): int(v) for k, v in s["versions"].items()},
                                          int(s.get("base", 0)), bool(s.get("frozen", False)), s.get("published"),
                                          int(s.get("synced", 0)))

    def __getitem__(self, tenant: str) -> TenantState:
        return self.tenants.setdefault(tenant, TenantState())

    def updates(self, tenant: str | None) -> int:
        """``n_T`` (0 for an unknown tenant or None)."""
        s = self.tenants.get(tenant) if tenant is not None else None
        return s.updates if s is not None else 0

    def produced_by(self, tenant: str | None, adapter: dict | None) -> int | None:
        """The ``n`` of the policy that served a sample of ``tenant`` with ``adapter`` (its record,
        None: the base model), or None when the version is unknown (module docstring)."""
        s = self.tenants.get(tenant) if tenant is not None else None
        if adapter is None:
            return s.base if s is not None else 0
        return s.versions.get(adapter["version"]) if s is not None else None

    def bump(self, tenant: str) -> int:
        """Count one trained update of ``tenant``; returns the new ``n_T``."""
        s = self[tenant]
        s.updates += 1
        return s.updates

    def record(self, tenant: str, version: str) -> None:
        """``tenant``'s adapter at ``n_T`` was exported with content ``version``."""
        s = self[tenant]
        s.versions.pop(version, None)
        s.versions[version] = s.updates
        while len(s.versions) > self.keep:  # the oldest by n
            del s.versions[min(s.versions, key=s.versions.__getitem__)]

    def synced_to(self, tenant: str, n: int, published: dict | None) -> None:
        """The sync of ``tenant``'s update ``n`` finished; its ``resume`` named ``published``."""
        s = self[tenant]
        s.synced, s.published = n, published

    def reset(self, tenant: str) -> TenantState:
        """``reset``/``delete``: forget ``tenant``'s versions; the base counts as ``n_T`` from now
        on; nothing published. ``updates`` and ``frozen`` stay."""
        s = self[tenant]
        s.versions.clear()
        s.base = s.updates
        s.published = None
        s.synced = s.updates
        return s

    def unsynced(self) -> list[str]:
        """Tenants whose last update's sync did not finish, sorted."""
        return sorted(t for t, s in self.tenants.items() if s.synced < s.updates)

    def to_meta(self) -> dict:
        """JSON form for the checkpoint's ``meta.json`` (read back by the constructor)."""
        return {t: asdict(s) for t, s in sorted(self.tenants.items())}
