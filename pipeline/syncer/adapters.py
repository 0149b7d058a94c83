"""A syncer's half of adapter sync: tenants' LoRA adapters on its engine (docs/tenants.md).

:class:`AdapterSync` is mixed into :class:`pipeline.syncer.core.Syncer`; it uses the syncer's
engine client (``_engine_call``), its retry rule (``retried``, the one of full weights) and its
``control`` answers (``_publish``). What it does with the tenant records of ``control``:

- ``weights`` (T, A, location): the folder is verified against ``A.version`` (the tensors'
  checksum file and the content id of config + tensors: by this syncer,
  :func:`pipeline.weightsync.verify_adapter`, or by an engine that reports the id of what it
  parsed; :meth:`AdapterSync.apply_adapter`) and loaded as ``A.name`` (``POST
  /load_lora_adapter``); the answer is ``applied`` / ``failed`` (T, A, ``engine_id``). Of
  several waiting records, each tenant's newest is applied.
- ``resume`` (T, A'): A' serves T from now on (None: the base model); every other adapter of T
  this syncer loaded is unloaded (``POST /unload_lora_adapter``), except one whose ``weights``
  came after the resume (a sync still running) and the one T was served by before: kept until
  T's next ``resume``, so a request the proxy routed to it just before it read this ``resume``
  (a lagging follower, a hold that timed out) is still served, not refused. A resume to the base
  model (``reset``, ``delete``) keeps nothing of T loaded.
- reconciliation (:meth:`AdapterSync.reconcile_adapters`, at start and every
  ``syncer.check_interval_s``): every tenant's current adapter (its last ``resume``; the folder
  from the matching ``weights`` record) is loaded when the engine's ``/v1/models`` does not list
  it (a restarted engine has none; loading the same content under the same name is a no-op).
  A tenant whose adapter cannot be served (folder gone or torn, its ``weights`` record aged out,
  the engine refusing it) is reported (``failed``, an error log once,
  ``pipeline_syncer_adapters_missing``) and keeps ``/readyz`` at 503 until it is served.

With ``rollout.enabled`` (docs/rollout.md) what a tenant is served by is its serving view's
(:class:`pipeline.syncer.published.TenantServing`): its incumbent and its live candidate, loaded
side by side during a canary. Unloading runs for each tenant with a ``resume``, ``promote`` or
``rollback`` in the drained records and keeps the incumbent, the candidate (live or still
syncing), a ``weights`` read after the last of those records, and what served the tenant before
it, until the tenant's next such record (in-flight requests): the incumbent a ``promote``
replaced, the version a failed sync resumed away from. A **rolled-back candidate is never kept**:
its ``rollback`` unloads it at once (a request the proxy routed to it just before reading the
``rollback`` may then be refused by the engine), and reconciliation never loads it again, whatever
a later ``resume`` names. Reconciliation loads the incumbent and a live candidate (a restarted
engine gets both back). Rollout off: exactly the rules above.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pipeline import events
from pipeline.syncer.published import TenantServing

log = logging.getLogger("pipeline.syncer")


def backoff_s(check_interval_s: float, failures: int) -> float:
    """The wait (s) before the next reconcile try after ``failures`` consecutive failed ones:
    ``check_interval_s * 2**failures``, at most 300 s."""
    return min(300.0, check_interval_s * 2 ** failures)


class AdapterSync:
    """Mixin of :class:`pipeline.syncer.core.Syncer`: tenants' adapters (see the module docstring).

    Attributes:
        tenants: the tenant orders read from ``control`` (:class:`TenantServing`).
        adapters_loaded: engine adapter name -> tenant, for the adapters this syncer loaded (or,
            after a restart, found on the engine under a name of a known tenant's adapter).
        adapters_missing: tenant -> why its current adapter is not served (empty: all served).
    """

    def _init_adapters(self) -> None:
        self.tenants = TenantServing.of(self.config, self.run_id)
        self.adapters_loaded: dict[str, str] = {}
        self.adapters_missing: dict[str, str] = {}
        self._adapter_retry: dict[str, tuple[int, float]] = {}  # tenant -> (failures, monotonic retry time)
        self._engine_reports_versions = False  # its last load answer had adapter_versions (see apply_adapter)

    # ------------------------------------------------------------ engine calls

    def apply_adapter(self, ev: events.Control, *, live: bool = False) -> tuple[bool, str]:
        """Verify and load one tenant ``weights`` record's adapter. Returns ``(ok, message)``;
        never raises. Retried as a full-weight apply (:meth:`Syncer.retried`): only what can pass.
        Not retried: a missing or torn folder, a version mismatch, the engine refusing the adapter.

        The folder is hashed once per engine: by this syncer before the load
        (:func:`pipeline.weightsync.verify_adapter`), or, when the engine's last answer reported
        the content id of what it parsed (the CPU engine's ``adapter_versions``; SGLang has none),
        by the engine alone, its id then compared with ``A.version``. A load that nobody verified
        (an engine that stopped reporting ids) is verified after it. A mismatch unloads the name
        (no request reaches it: the tenant is resumed on it only after every engine's
        ``applied``) and answers ``failed``. ``live``: the name may already be routed (the
        tenant's current adapter: reloaded by reconciliation, or its ``weights`` read after the
        ``resume`` naming it), so the folder is always verified before the load: wrong content is
        never loaded under it, not even for a moment.
        """
        from pipeline.weightsync import verify_adapter

        name, version = ev.adapter["name"], ev.adapter["version"]
        verified: list[bool] = []

        def check() -> None:
            verified.clear()
            if live or not self._engine_reports_versions:
                verify_adapter(ev.location, version)
                verified.append(True)

        async def call(eng) -> str:
            out = await eng.load_lora_adapter(name, ev.location)
            got = (out.get("adapter_versions") or {}).get(name)
            self._engine_reports_versions = got is not None
            try:
                if got is not None and got != version:
                    raise ValueError(f"{ev.location}: the engine loaded content {got}, the record names {version}")
                if got is None and not verified:
                    verify_adapter(ev.location, version)
            except (OSError, ValueError):
                await self._unload_refused(eng, name, ev.tenant)
                raise
            return f"loaded {name} ({len(out.get('loaded_adapters') or {})} adapters on the engine)"

        from pipeline import weightsync

        t0 = time.perf_counter()
        ok, msg = self.retried(f"adapter {name} of tenant {ev.tenant}", check, call)
        weightsync.SYNCER_ADAPTER_SECONDS.observe(time.perf_counter() - t0)
        weightsync.SYNCER_ADAPTER_LOADS.labels(self.engine_id, "applied" if ok else "failed").inc()
        if ok:
            self.adapters_loaded[name] = ev.tenant
        return ok, msg

    async def _unload_refused(self, eng, name: str, tenant: str) -> None:
        """Unload ``name``, loaded with content its record does not name; one that cannot be
        unloaded now is kept in :attr:`adapters_loaded` for the tenant's next ``resume``."""
        try:
            await eng.unload_lora_adapter(name)
        except Exception as e:  # noqa: BLE001 - the refusal is reported either way
            log.warning("%s: unload of the refused adapter %s failed: %s", self.engine_id, name, e)
            self.adapters_loaded[name] = tenant

    def engine_adapters(self) -> set[str] | None:
        """The adapter names the engine lists on ``/v1/models`` (cards with a ``parent``); None
        when it does not answer."""
        try:
            body = self._engine_call(lambda eng: eng.models())
        except Exception as e:  # noqa: BLE001 - an engine that is down lists nothing
            log.debug("%s: /v1/models failed: %s", self.engine_id, e)
            return None
        cards = body.get("data") if isinstance(body, dict) else None
        return {m["id"] for m in cards or () if isinstance(m, dict) and m.get("parent") is not None
                and isinstance(m.get("id"), str)}

    def unload_others(self, tenant: str, keep: set[str]) -> list[str]:
        """Unload every adapter of ``tenant`` this syncer loaded whose name is not in ``keep``;
        returns the names unloaded. A name the engine no longer has (it restarted) is forgotten;
        an engine that cannot be reached keeps the name for the next ``resume``."""
        from pipeline import weightsync
        from pipeline.engine_api.errors import EngineError

        gone = []
        for name in [n for n, t in self.adapters_loaded.items() if t == tenant and n not in keep]:
            try:
                self._engine_call(lambda eng: eng.unload_lora_adapter(name))
            except EngineError as e:
                if e.status != 400:  # 400: not loaded (any more) on the engine
                    log.warning("%s: unload of %s (tenant %s) failed: %s", self.engine_id, name, tenant, e)
                    continue
            except Exception as e:  # noqa: BLE001 - unreachable: tried again at the tenant's next resume
                log.warning("%s: unload of %s (tenant %s) failed: %s", self.engine_id, name, tenant, e)
                continue
            del self.adapters_loaded[name]
            weightsync.SYNCER_ADAPTER_UNLOADS.labels(self.engine_id).inc()
            gone.append(name)
        if gone:
            log.info("%s: tenant %s: unloaded %s", self.engine_id, tenant, ", ".join(gone))
        return gone

    # ------------------------------------------------------------ control records

    def handle_tenant_records(self, producer, recs: list[events.Control]) -> None:
        """Apply the tenant records of one drained poll, in log order (see the module docstring):
        each tenant's newest ``weights`` is loaded and answered, then each tenant resumed in
        ``recs`` (rollout on: also promoted or rolled back) keeps only what serves it now, what
        served it before (unless it is on the base model alone now; never a rolled-back version)
        and one whose ``weights`` came later."""
        turns = ("resume",) if self.tenants.view is None else ("resume", "promote", "rollback")
        newest: dict[str, tuple[int, events.Control]] = {}
        resumed: dict[str, int] = {}
        before: dict[str, list[dict]] = {}  # tenant -> what served it before its last turn here
        for i, ev in enumerate(recs):
            if ev.action in turns:
                before[ev.tenant] = self.tenants.served(ev.tenant)
            self.tenants.see(ev)
            if ev.action == "weights" and ev.adapter is not None:
                if ev.tenant in newest:
                    log.info("%s: tenant %s: adapter %s superseded by %s", self.engine_id, ev.tenant,
                             newest[ev.tenant][1].adapter["name"], ev.adapter["name"])
                newest[ev.tenant] = (i, ev)
            elif ev.action in turns:
                resumed[ev.tenant] = i
        for _, ev in newest.values():
            # live: T is already served by it (an engine the trainer does not wait for, a replay)
            live = any(a["version"] == ev.adapter["version"] for a in self.tenants.served(ev.tenant))
            ok, msg = self.apply_adapter(ev, live=live)
            self._publish(producer, "applied" if ok else "failed", ev, msg)
        for tenant, at in resumed.items():
            keep = self._kept(tenant, before.get(tenant, []))
            if tenant in newest and newest[tenant][0] > at:
                keep.add(newest[tenant][1].adapter["name"])
            self.unload_others(tenant, keep)
        if resumed:
            self._observe_adapters()

    def _kept(self, tenant: str, before: list[dict]) -> set[str]:
        """The adapter names of ``tenant`` kept loaded after its resume / promote / rollback: what
        it needs now (:meth:`TenantServing.needed`) and ``before`` (what served it before), unless
        it needs nothing now (the base model alone) or a version of ``before`` was rolled back."""
        now = self.tenants.needed(tenant)
        grace = [a for a in before if not self.tenants.rolled_back(tenant, a)] if now else []
        return {a["name"] for a in now + grace}

    # ------------------------------------------------------------ reconciliation

    def reconcile_adapters(self, producer) -> bool:
        """Load every adapter serving a tenant that the engine lacks (see the module docstring;
        rollout on: its incumbent and its live candidate) and unload rolled-back ones. Returns
        True when every tenant's adapters are served; an engine that does not answer is left for
        the next check."""
        listed = self.engine_adapters()
        if listed is None:
            return not self.adapters_missing
        for name, tenant in self._known_names().items():  # after a restart: adopt what the engine holds
            if name in listed:
                self.adapters_loaded.setdefault(name, tenant)
        for name in [n for n in self.adapters_loaded if n not in listed]:
            del self.adapters_loaded[name]  # the engine restarted: loaded again below if still current
        self._unload_rolled_back()
        for tenant in self.tenants.known():
            lacking = [a for a in self.tenants.served(tenant) if a["name"] not in listed]
            if not lacking:
                self._served_again(tenant)
                continue
            failures, retry_at = self._adapter_retry.get(tenant, (0, 0.0))
            if time.monotonic() < retry_at:
                continue
            if all([self._reload(producer, tenant, a, failures) for a in lacking]):
                self._served_again(tenant)
        self._observe_adapters()
        return not self.adapters_missing

    def _unload_rolled_back(self) -> None:
        """Unload every rolled-back adapter still loaded (rollout on): one adopted from the engine
        after a syncer restart, or one whose unload failed at its ``rollback``."""
        gone = {ev.adapter["name"]: t for (t, _), ev in self.tenants.folders.items()
                if ev.adapter["name"] in self.adapters_loaded and self.tenants.rolled_back(t, ev.adapter)}
        for tenant in set(gone.values()):
            self.unload_others(tenant, {n for n, t in self.adapters_loaded.items() if t == tenant and n not in gone})

    def _known_names(self) -> dict[str, str]:
        """Engine name -> tenant of every adapter version a ``weights`` record named."""
        return {ev.adapter["name"]: tenant for (tenant, _), ev in self.tenants.folders.items()}

    def _served_again(self, tenant: str) -> None:
        if self.adapters_missing.pop(tenant, None) is not None:
            log.info("%s: tenant %s's adapter is served again", self.engine_id, tenant)
        self._adapter_retry.pop(tenant, None)

    def _reload(self, producer, tenant: str, adapter: dict, failures: int) -> bool:
        """Load ``adapter``, serving ``tenant``, that the engine lacks; answer ``applied``/``failed``.
        ``failures``: the tenant's consecutive failed tries before (its back-off). True when loaded."""
        from pipeline import weightsync

        ev = self.tenants.folder_of(tenant, adapter)
        if ev is None:
            why = f"no weights record of its adapter {adapter['name']} on control (aged out?)"
            if self.adapters_missing.get(tenant) != why:
                log.error("%s: tenant %s is served by adapter %s, which cannot be loaded: %s", self.engine_id,
                          tenant, adapter["name"], why)
            self.adapters_missing[tenant] = why
            return False
        log.warning("%s: the engine lacks tenant %s's adapter %s: loading %s", self.engine_id, tenant,
                    adapter["name"], ev.location)
        weightsync.SYNCER_RECONCILES.labels(self.engine_id).inc()
        ok, msg = self.apply_adapter(ev, live=True)
        if not ok:
            wait = backoff_s(self.cfg.check_interval_s, failures + 1)
            self._adapter_retry[tenant] = (failures + 1, time.monotonic() + wait)
            if self.adapters_missing.get(tenant) != msg:
                log.error("%s: cannot serve tenant %s's adapter %s (%s); next try in %.0f s", self.engine_id,
                          tenant, adapter["name"], msg, wait)
            self.adapters_missing[tenant] = msg
        self._publish(producer, "applied" if ok else "failed", ev, msg if ok else f"reconcile: {msg}")
        return ok

    def _observe_adapters(self) -> None:
        from pipeline import weightsync

        weightsync.SYNCER_ADAPTERS_MISSING.labels(self.engine_id).set(len(self.adapters_missing))

    def adapters_ok(self) -> bool:
        """Every tenant's current adapter is served (what ``/readyz`` adds to the weights' check)."""
        return not self.adapters_missing

    def readiness(self) -> dict[str, Any]:
        """The adapter part of ``/readyz``'s body: tenants whose adapter is not served, and why."""
        return {"adapters_missing": dict(sorted(self.adapters_missing.items()))}
