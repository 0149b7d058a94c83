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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from pipeline import events
from pipeline.syncer.published import TenantAdapters

log = logging.getLogger("pipeline.syncer")


def backoff_s(check_interval_s: float, failures: int) -> float:
    """The wait (s) before the next reconcile try after ``failures`` consecutive failed ones:
    ``check_interval_s * 2**failures``, at most 300 s."""
    return min(300.0, check_interval_s * 2 ** failures)


class AdapterSync:
    """Mixin of :class:`pipeline.syncer.core.Syncer`: tenants' adapters (see the module docstring).

    Attributes:
        tenants: the tenant orders read from ``control`` (:class:`TenantAdapters`).
        adapters_loaded: engine adapter name -> tenant, for the adapters this syncer loaded (or,
            after a restart, found on the engine under a name of a known tenant's adapter).
        adapters_missing: tenant -> why its current adapter is not served (empty: all served).
    """

    def _init_adapters(self) -> None:
        self.tenants = TenantAdapters()
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
        ``recs`` keeps only its current adapter, the one before it (unless resumed to the base)
        and one whose ``weights`` came later."""
        newest: dict[str, tuple[int, events.Control]] = {}
        resumed: dict[str, int] = {}
        before: dict[str, dict | None] = {}  # tenant -> its adapter before its last resume here
        for i, ev in enumerate(recs):
            if ev.action == "resume":
                before[ev.tenant] = self.tenants.current.get(ev.tenant)
            self.tenants.see(ev)
            if ev.action == "weights" and ev.adapter is not None:
                if ev.tenant in newest:
                    log.info("%s: tenant %s: adapter %s superseded by %s", self.engine_id, ev.tenant,
                             newest[ev.tenant][1].adapter["name"], ev.adapter["name"])
                newest[ev.tenant] = (i, ev)
            elif ev.action == "resume":
                resumed[ev.tenant] = i
        for _, ev in newest.values():
            # live: T is already resumed on it (an engine the trainer does not wait for, a replay)
            ok, msg = self.apply_adapter(ev, live=self.tenants.current.get(ev.tenant) == ev.adapter)
            self._publish(producer, "applied" if ok else "failed", ev, msg)
        for tenant, at in resumed.items():
            cur, prev = self.tenants.current.get(tenant), before.get(tenant)
            keep = {a["name"] for a in (cur, prev if cur is not None else None) if a is not None}
            if tenant in newest and newest[tenant][0] > at:
                keep.add(newest[tenant][1].adapter["name"])
            self.unload_others(tenant, keep)
        if resumed:
            self._observe_adapters()

    # ------------------------------------------------------------ reconciliation

    def reconcile_adapters(self, producer) -> bool:
        """Load every tenant's current adapter the engine lacks (see the module docstring).
        Returns True when every tenant's current adapter is served; an engine that does not
        answer is left for the next check."""
        listed = self.engine_adapters()
        if listed is None:
            return not self.adapters_missing
        for name, tenant in self._known_names().items():  # after a restart: adopt what the engine holds
            if name in listed:
                self.adapters_loaded.setdefault(name, tenant)
        for name in [n for n in self.adapters_loaded if n not in listed]:
            del self.adapters_loaded[name]  # the engine restarted: loaded again below if still current
        for tenant, adapter in sorted(self.tenants.current.items()):
            if adapter is None or adapter["name"] in listed:
                self._served_again(tenant)
                continue
            self._reload(producer, tenant, adapter)
        self._observe_adapters()
        return not self.adapters_missing

    def _known_names(self) -> dict[str, str]:
        """Engine name -> tenant of every adapter version a ``weights`` record named."""
        return {ev.adapter["name"]: tenant for (tenant, _), ev in self.tenants.folders.items()}

    def _served_again(self, tenant: str) -> None:
        if self.adapters_missing.pop(tenant, None) is not None:
            log.info("%s: tenant %s's adapter is served again", self.engine_id, tenant)
        self._adapter_retry.pop(tenant, None)

    def _reload(self, producer, tenant: str, adapter: dict) -> None:
        """Load ``tenant``'s current ``adapter`` the engine lacks; answer ``applied``/``failed``."""
        from pipeline import weightsync

        failures, retry_at = self._adapter_retry.get(tenant, (0, 0.0))
        if time.monotonic() < retry_at:
            return
        ev = self.tenants.weights_of(tenant)
        if ev is None:
            why = f"no weights record of its adapter {adapter['name']} on control (aged out?)"
            if self.adapters_missing.get(tenant) != why:
                log.error("%s: tenant %s is served by adapter %s, which cannot be loaded: %s", self.engine_id,
                          tenant, adapter["name"], why)
            self.adapters_missing[tenant] = why
            return
        log.warning("%s: the engine lacks tenant %s's adapter %s: loading %s", self.engine_id, tenant,
                    adapter["name"], ev.location)
        weightsync.SYNCER_RECONCILES.labels(self.engine_id).inc()
        ok, msg = self.apply_adapter(ev, live=True)
        if ok:
            self._served_again(tenant)
        else:
            wait = backoff_s(self.cfg.check_interval_s, failures + 1)
            self._adapter_retry[tenant] = (failures + 1, time.monotonic() + wait)
            if self.adapters_missing.get(tenant) != msg:
                log.error("%s: cannot serve tenant %s's adapter %s (%s); next try in %.0f s", self.engine_id,
                          tenant, adapter["name"], msg, wait)
            self.adapters_missing[tenant] = msg
        self._publish(producer, "applied" if ok else "failed", ev, msg if ok else f"reconcile: {msg}")

    def _observe_adapters(self) -> None:
        from pipeline import weightsync

        weightsync.SYNCER_ADAPTERS_MISSING.labels(self.engine_id).set(len(self.adapters_missing))

    def adapters_ok(self) -> bool:
        """Every tenant's current adapter is served (what ``/readyz`` adds to the weights' check)."""
        return not self.adapters_missing

    def readiness(self) -> dict[str, Any]:
        """The adapter part of ``/readyz``'s body: tenants whose adapter is not served, and why."""
        return {"adapters_missing": dict(sorted(self.adapters_missing.items()))}
