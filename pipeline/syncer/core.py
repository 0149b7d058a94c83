"""The syncer of one engine replica (:class:`Syncer`; its command is :mod:`pipeline.syncer`).

Runs beside each engine replica (Kubernetes: a sidecar). It reads ``control`` from the offsets
committed by its own consumer group (``syncer.group_id``, default ``syncer-<engine_id>``;
assigned, never joined: one syncer per engine) and, for each ``weights`` event of its run:

1. verifies the sha256 of ``<location>/model.safetensors`` against the event (a torn or
   half-copied folder is never loaded; :func:`pipeline.weightsync.verify_folder`);
2. calls the engine's ``POST /update_weights_from_disk`` with ``model_path = location`` and
   ``weight_version = str(policy_version)`` (through :class:`pipeline.engine_api.client.EngineClient`).
   Only a failure that can pass is retried (``syncer.retries`` times, exponential back-off from
   ``syncer.retry_backoff_s`` plus jitter, :mod:`pipeline.retry`): the engine unreachable, a
   time-out, a 5xx, 408, 409, 425 or 429. A refusal that another try cannot change fails at once:
   a missing folder, a checksum mismatch, another 4xx (the engine refused these weights);
3. publishes ``applied`` (engine_id, policy_version) or ``failed`` (with the last error).

A version is its content: "already serving" (nothing reloaded, ``applied`` published again)
needs both the engine reporting that version (``/model_info`` ``weight_version``) and this
syncer having loaded that very sha256 into it (:attr:`Syncer.loaded`). The engine reports a
number only, so a ``weights`` event with that number but another sha256 (a re-export, a
same-path folder with new content), and any version after a syncer restart (what the engine
holds is then unknown), are applied again, or refused loudly (``failed``: the folder does
not match its sha256), never reported as served. When several
``weights`` events are waiting (catching up after downtime) only the newest is applied, and a
version older than one already applied is never applied again. The offset is committed after
the answer is published. Records that are not valid ``control``
events go to ``control.dlq`` (:class:`pipeline.bus.TopicReader`; the offset is committed only
once the dead letter is delivered).

Reconciliation (engine or syncer restarts). A syncer that starts first finds the last version
the trainer published (:func:`pipeline.syncer.published.last_published`: the newest ``weights`` event of its run on
``control``, or the trainer's ``published.json`` record when control has aged it out:
:func:`pipeline.weightsync.read_published`) and, if
the engine serves anything else (a restarted engine comes back with its base model as v0),
applies it and publishes ``applied`` before it reads its consumer group. Then, every
``syncer.check_interval_s``, it compares the engine's served version with the last published
one again, so an engine restarted without its syncer is caught too. A mismatch that cannot be
repaired (weights folder gone, checksum wrong, engine down) is never silent: ``failed`` on
``control``, an error in the log, ``pipeline_syncer_engine_versions_behind`` above 0 and
``/readyz`` answering 503. ``GET /readyz`` on ``syncer.ready_port`` answers 200 only while the
engine serves the last published version (or, while a newer version fails to apply, the one it
was last confirmed on): use it as the replica's readiness probe so a restarted engine takes no
traffic before it is reconciled.

With ``rollout.enabled`` (docs/rollout.md, "Serving") the full weights follow the run's serving
view (:class:`pipeline.syncer.published.TenantServing`, :meth:`~pipeline.syncer.published.TenantServing.full_target`):
the engine serves the scope's candidate (one full-weight engine takes it: its ``weights`` order is
applied as without rollout) or else its incumbent. A ``rollback`` of the candidate re-applies the
incumbent's own ``weights`` order (its folder, verified against its sha256 like any apply; the
trainer keeps that folder) and publishes ``applied`` for it; a ``promote`` reloads nothing (the
engine already serves the candidate). Reconciliation after a restart targets the same (the
candidate or the incumbent, never a rolled-back version, whatever ``published.json`` says).

Full-weight ``pause``/``resume`` need no action here: the engine lets in-flight requests finish
on the old weights during the swap (SGLang's ``/update_weights_from_disk`` waits for them), and
the proxy holds new requests while paused. A tenant's records (``tenant`` set: its LoRA adapter)
are :class:`pipeline.syncer.adapters.AdapterSync`'s; ``/readyz`` is 503 while any tenant's
current adapter cannot be served.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from pipeline import events
from pipeline.config import Config
from pipeline.engine_api.backend import engine_client
from pipeline.engine_api.errors import EngineError
from pipeline.errors import PipelineError
from pipeline.syncer.adapters import AdapterSync, backoff_s

log = logging.getLogger("pipeline.syncer")


class Syncer(AdapterSync):
    """One engine replica's weight syncer (see the module docstring).

    Args:
        config: ``syncer`` section (engine id/url, retries, back-off), ``trainer.run_id``
            (``syncer.run_id`` overrides it), ``kafka``/``topics``.
        stop: set it to finish the current apply and exit :meth:`run`.
    """

    def __init__(self, config: Config, stop: threading.Event | None = None) -> None:
        self.config = config
        self.cfg = config.syncer
        self.engine_id = self.cfg.engine_id
        self.url = self.cfg.engine_url or config.engine.url
        self.run_id = self.cfg.run_id or config.trainer.run_id
        self.group_id = self.cfg.group_id or f"syncer-{self.engine_id}"
        #: this engine applies a full-weight candidate at its ``weights`` order (no
        #: ``rollout.canary_engines``: the one engine does; else only the engines listed there)
        canary = config.rollout.canary_engines
        self.takes_candidate = not canary or self.engine_id in canary
        self.topic = config.topics.name("control")
        self.stop = stop or threading.Event()
        self.applied: list[int] = []  # versions applied by this process (for tests and logs)
        self.failed: list[int] = []
        self.ready = threading.Event()  # set once the consumer has its assignment
        self.in_sync = threading.Event()  # set while the engine serves the last published version
        self.target: events.Control | None = None  # the last published weights (None: nothing published)
        self.served: str | None = None  # the engine's weight_version at the last check (None: unknown)
        self.confirmed: str | None = None  # the last version seen in sync (published and served)
        #: (weight_version, sha256) this process loaded into the engine and the engine then reported;
        #: None: what the engine holds is unknown (nothing loaded by this process yet, or it restarted)
        self.loaded: tuple[str, str] | None = None
        self.reconciles = 0  # re-applies after finding the engine on another version
        self._failures = 0  # consecutive failed re-applies (back-off: check_interval_s * 2**n, <= 300 s)
        self._retry_at = 0.0
        self._reported: tuple | None = None  # last unrepairable mismatch logged (log it once)
        self._loop: asyncio.AbstractEventLoop | None = None  # see _engine_call
        self._engine = None
        self._init_adapters()

    # ------------------------------------------------------------ engine side

    def _engine_call(self, call: Callable[[Any], Awaitable[Any]]) -> Any:
        """``await call(engine_client)`` on the syncer's own event loop, with its one engine client.

        Both live as long as the syncer (closed by :meth:`close`): building an HTTP client loads
        the TLS trust store, tens of ms of CPU that, every check interval, kept the Kafka client's
        I/O thread waiting for the GIL (kafka-python's "task is blocking the event loop").
        """
        if self._loop is None:
            self._loop = asyncio.new_event_loop()
        if self._engine is None:
            api_key = self.config.engine.api_key.get_secret_value() if self.config.engine.api_key else None
            self._engine = engine_client(self.config.engine.kind, self.url, timeout_s=10.0, api_key=api_key,
                                         initial_version=self.config.engine.weight_version)
        return self._loop.run_until_complete(call(self._engine))

    def close(self) -> None:
        """Close the engine client and the event loop (:meth:`run` does it when it ends)."""
        if self._loop is not None:
            if self._engine is not None:
                self._loop.run_until_complete(self._engine.aclose())
            self._loop.close()
        self._loop = self._engine = None

    def knows_content(self, served: str | None, target: events.Control | None) -> bool:
        """The engine, reporting ``served``, holds ``target``'s weights by content: this syncer
        loaded that sha256 as that version (``target`` None: the base model, version "0")."""
        if target is None:
            return served == "0"
        return served == str(target.policy_version) and self.loaded == (served, target.sha256)

    async def _apply_async(self, eng, location: str, version: int, sha256: str) -> str:
        want = (str(version), sha256)
        try:
            served = await eng.weight_version()
            if served == want[0] and self.loaded == want:
                return f"already serving (sha256 {sha256[:12]})"
            if served == want[0]:
                log.warning("%s: the engine reports v%d but its content is not known to be sha256 %s (%s): "
                            "reloading", self.engine_id, version, sha256[:12],
                            "this syncer loaded nothing yet" if self.loaded is None else
                            f"this syncer loaded sha256 {self.loaded[1][:12]} as v{self.loaded[0]}")
        except Exception:  # noqa: BLE001 - fall through to the update, which reports properly
            pass
        self.loaded = None  # until the engine confirms the new weights
        out = await eng.update_weights_from_disk(location, weight_version=want[0],
                                                 timeout_s=self.cfg.apply_timeout_s)
        if str(await eng.weight_version()) == want[0]:
            self.loaded = want
        return str(out.get("message", "ok"))

    def apply(self, ev: events.Control) -> tuple[bool, str]:
        """Verify and apply one full-weight ``weights`` event. Returns ``(ok, message)``; never raises.

        Retried (``syncer.retries`` more tries, jittered exponential back-off): the engine
        unreachable, a time-out, HTTP 5xx, 408, 409, 425 or 429
        (:attr:`pipeline.engine_api.errors.EngineError.retryable`).
        Not retried: a missing folder, a checksum mismatch, a 4xx answer (the engine refused the
        weights), any other error. :attr:`stop` ends the waits between tries.
        """
        def check() -> None:
            from pipeline.weightsync import verify_folder

            if not Path(ev.location).is_dir():
                raise FileNotFoundError(f"weights folder {ev.location} not found")
            verify_folder(ev.location, ev.sha256)

        return self.retried(f"v{ev.policy_version}", check,
                            lambda eng: self._apply_async(eng, ev.location, ev.policy_version, ev.sha256))

    def retried(self, what: str, check: Callable[[], Any], call: Callable[[Any], Awaitable[str]]) -> tuple[bool, str]:
        """``check()`` then ``await call(engine_client)`` (the engine's answer message), with the
        syncer's retry rule (see :meth:`apply`): every try runs both, only a retryable
        :class:`EngineError` is tried again. ``what`` names the update in the log.
        Returns ``(ok, message)``; never raises."""
        from pipeline.retry import Transient, retrying_sync

        tries = self.cfg.retries + 1

        def stoppable_sleep(seconds: float) -> None:
            if self.stop.wait(seconds):
                raise _Stopped()

        try:
            for attempt in retrying_sync(tries, self.cfg.retry_backoff_s, sleep=stoppable_sleep):
                with attempt:
                    n = attempt.retry_state.attempt_number
                    t0 = time.perf_counter()
                    check()
                    try:
                        msg = self._engine_call(call)
                    except EngineError as e:
                        if not e.retryable:
                            raise
                        log.warning("%s: apply of %s failed (try %d/%d, will retry if tries are left): %s: %s",
                                    self.engine_id, what, n, tries, type(e).__name__, e)
                        raise Transient(f"{type(e).__name__}: {e}") from e
                    log.info("%s: %s applied in %.2f s (%s)", self.engine_id, what, time.perf_counter() - t0, msg)
                    return True, msg
        except _Stopped:
            return False, "stopped while retrying"
        except Transient as e:
            return False, f"{e} (after {tries} tries)"
        except Exception as e:  # noqa: BLE001 - a refusal another try cannot change: reported at once
            log.warning("%s: apply of %s refused, not retried: %s: %s", self.engine_id, what, type(e).__name__, e)
            return False, f"{type(e).__name__}: {e}"
        return False, "no try made"  # unreachable: the loop makes at least one try

    # ------------------------------------------------------------ Kafka side

    def _publish(self, producer, action: str, ev: events.Control, message: str = "") -> None:
        out = events.Control(action=action, epoch=ev.epoch, policy_version=ev.policy_version, run_id=self.run_id,
                             engine_id=self.engine_id, location=ev.location, sha256=ev.sha256,
                             message=message[:2000], created_at=events.now_ms(), tenant=ev.tenant,
                             adapter=ev.adapter)
        producer.send(self.topic, out, key=self.run_id).get(timeout=30)

    # ------------------------------------------------------------ reconciliation

    def served_version(self) -> str | None:
        """The engine's ``/model_info`` ``weight_version`` now, or None when it does not answer."""
        try:
            v = self._engine_call(lambda eng: eng.weight_version())
            return None if v is None else str(v)
        except Exception as e:  # noqa: BLE001 - an engine that is down has no version
            log.debug("%s: /model_info failed: %s", self.engine_id, e)
            return None

    def _observe(self) -> None:
        from pipeline import weightsync

        # unknown (no engine answer yet, nothing published, a version that is not a number) reads
        # NaN, never a number that could be mistaken for a version (was -1, and "behind" then
        # read published + 1)
        nan = float("nan")
        published = float(self.target.policy_version) if self.target is not None else nan
        try:
            served = float(int(self.served)) if self.served is not None else nan
        except ValueError:
            served = nan
        weightsync.SYNCER_ENGINE_VERSION.labels(self.engine_id).set(served)
        weightsync.SYNCER_PUBLISHED_VERSION.labels(self.engine_id).set(published)
        weightsync.SYNCER_BEHIND.labels(self.engine_id).set(published - served)  # NaN when either is unknown
        weightsync.SYNCER_RECONCILES.labels(self.engine_id)  # exported at 0 before the first reconcile
        if self.served is not None and self.knows_content(self.served, self.target):
            self.confirmed = self.served
            self.in_sync.set()
        else:
            self.in_sync.clear()

    def serving_ok(self) -> bool:
        """What ``/readyz`` answers: the engine serves the last published version, or still the
        version it was confirmed in sync on while a newer one fails to apply (reported by
        ``failed`` and the metrics, and retried); and every tenant's current adapter is served
        (:meth:`adapters_ok`). False for an engine that came back on another version (a restart:
        base weights, no adapters) until it is reconciled, and before the first check."""
        weights_ok = self.in_sync.is_set() or (self.served is not None and self.served == self.confirmed)
        return weights_ok and self.adapters_ok()

    def reconcile(self, producer) -> bool:
        """Make the engine serve :attr:`target` (the last published weights; v0 when none).

        Asks the engine for its version; on a mismatch logs a warning, re-applies the target
        (checksum verified, retries) and publishes ``applied`` or ``failed``. Returns True when
        the engine serves the target afterwards. An engine that does not answer is left for the
        next check (nothing to apply to), reported as unknown.
        """
        self.served = self.served_version()
        target = self.target
        want = str(target.policy_version) if target is not None else "0"
        if self.served is not None and self.loaded is not None and self.served != self.loaded[0]:
            self.loaded = None  # the engine changed under us (a restart): its content is unknown again
        if self.served is None or self.knows_content(self.served, target):
            if self.served is not None:
                self._failures, self._retry_at, self._reported = 0, 0.0, None
            self._observe()
            return self.served is not None
        if target is None:
            if self._reported != (self.served, None):
                log.error("%s serves weight version %r, but run %s published no weights: a version the "
                          "trainer did not publish (restart the engine with its base model as version 0)",
                          self.engine_id, self.served, self.run_id)
                self._reported = (self.served, None)
            self._observe()
            return False
        if time.monotonic() < self._retry_at:  # the last re-apply failed: back off
            self._observe()
            return False
        from pipeline import weightsync

        log.warning("%s serves weight version %r%s, the trainer's last published version is v%d (sha256 %s): "
                    "re-applying %s", self.engine_id, self.served,
                    " of unknown content" if self.served == want else "", target.policy_version,
                    target.sha256[:12], target.location)
        self.reconciles += 1
        weightsync.SYNCER_RECONCILES.labels(self.engine_id).inc()
        ok, msg = self.apply(target)
        (self.applied if ok else self.failed).append(target.policy_version)
        if ok:
            self._failures, self._retry_at = 0, 0.0
        else:
            self._failures += 1
            wait = backoff_s(self.cfg.check_interval_s, self._failures)
            self._retry_at = time.monotonic() + wait
            log.error("%s: cannot serve the published v%d (%s); it keeps serving %r (next try in %.0f s)",
                      self.engine_id, target.policy_version, msg, self.served, wait)
        self._publish(producer, "applied" if ok else "failed", target,
                      msg if ok else f"reconcile: engine serves {self.served!r}; {msg}")
        self.served = self.served_version()
        self._observe()
        return self.in_sync.is_set()

    def serve_ready(self, port: int, host: str = "0.0.0.0") -> int:
        """Serve ``GET /readyz`` on ``host:port`` in a daemon thread; returns the bound port.

        200 when :meth:`serving_ok`, else 503; the JSON body says ``engine_id``, ``served`` (the
        engine's version), ``published`` and ``in_sync``. ``/healthz`` is always 200 (liveness).
        """
        import json
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        syncer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's naming
                if self.path.split("?")[0] not in ("/readyz", "/healthz"):
                    self.send_error(404, "GET /readyz or /healthz")
                    return
                ok = syncer.serving_ok() or self.path.startswith("/healthz")
                body = json.dumps({"engine_id": syncer.engine_id, "served": syncer.served,
                                   "published": syncer.target.policy_version if syncer.target else None,
                                   "in_sync": syncer.in_sync.is_set(), **syncer.readiness()}).encode()
                self.send_response(200 if ok else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):  # noqa: D102 - quiet
                pass

        server = ThreadingHTTPServer((host, port), Handler)
        threading.Thread(target=server.serve_forever, name="syncer-readyz", daemon=True).start()
        return server.server_address[1]

    def run(self) -> None:
        """Consume ``control`` and apply ``weights`` events until :attr:`stop` is set."""
        from pipeline.bus import DeadLetterError, EventProducer, TopicReader
        from pipeline.syncer.published import scan_control, with_published_record

        producer = EventProducer(self.config, name=f"syncer-{self.engine_id}")
        try:
            best, self.tenants = scan_control(self.config, self.run_id, stop=self.stop)
            self.target = self.tenants.full_target(with_published_record(self.config, self.run_id, best),
                                                   self.takes_candidate)
        except Exception:
            producer.close()
            raise
        self.reconcile(producer)  # before the group: a restarted engine gets the published weights first
        self.reconcile_adapters(producer)  # ... and every tenant's current adapter
        next_check = time.monotonic() + self.cfg.check_interval_s
        try:
            consumer = TopicReader(self.config, self.topic, "committed", name=f"syncer-{self.engine_id}",
                                   group_id=self.group_id, dlq=True, stop=self.stop)
        except Exception:
            producer.close()
            self.close()
            raise
        self.ready.set()
        log.info("syncer %s -> %s (group %s, run %s, published v%s, engine serves %s, %d tenant adapter(s))",
                 self.engine_id, self.url, self.group_id, self.run_id,
                 self.target.policy_version if self.target else "-", self.served,
                 sum(a is not None for a in self.tenants.current.values()))
        try:
            while not self.stop.is_set():
                polled = consumer.poll_raw(timeout_ms=500)
                if time.monotonic() >= next_check:
                    self.reconcile(producer)  # an engine restarted without its syncer comes back on v0
                    self.reconcile_adapters(producer)  # ... and without adapters
                    next_check = time.monotonic() + self.cfg.check_interval_s
                if not polled:
                    continue
                latest, tenant_recs, ends = self._drain(consumer, polled)
                if latest is not None:
                    self._apply_full(producer, latest)
                if tenant_recs:
                    self.handle_tenant_records(producer, tenant_recs)
                consumer.commit(ends)
        except DeadLetterError as e:  # stopped while a dead letter was undeliverable: not committed past it
            log.warning("%s", e)
        finally:
            try:
                consumer.close()
            finally:
                producer.close()
                self.close()

    def _drain(self, consumer, polled) -> tuple[events.Control | None, list[events.Control], dict[int, int]]:
        """Decode ``polled`` and what else is already there (a bad record goes to control.dlq).

        Returns ``(full weights to apply, tenant records, end offsets)``. Rollout off: of the
        full-weight ``weights`` events of this run only the newest matters (an older one than the
        one already published is dropped, logged). Rollout on: every full-weight record of the
        run is folded into the serving view (:meth:`TenantServing.see_full`) and the weights to
        apply are :meth:`TenantServing.full_target`'s when they differ from :attr:`target` (a
        new candidate, or after its ``rollback`` the incumbent again). The tenant records of this
        run are kept in log order for :meth:`handle_tenant_records`."""
        latest: events.Control | None = None
        tenant_recs: list[events.Control] = []
        ends: dict[int, int] = {}
        more = polled
        while more:
            for rec in more:
                got = consumer.decode(rec)  # a bad record goes to control.dlq first
                ends[rec.partition] = rec.offset + 1
                ev = got.event if got is not None else None
                if not isinstance(ev, events.Control) or ev.run_id != self.run_id:
                    continue
                if ev.tenant is not None:
                    tenant_recs.append(ev)
                    continue
                if ev.full_weights:
                    self.tenants.see_full(ev)
                if ev.full_weights and ev.action == "weights" \
                        and (latest is None or ev.policy_version >= latest.policy_version):
                    if latest is not None:
                        log.info("%s: v%d superseded by v%d", self.engine_id, latest.policy_version,
                                 ev.policy_version)
                    latest = ev
            more = consumer.poll_raw(timeout_ms=0)
        if self.tenants.view is not None:
            return self._full_change(), tenant_recs, ends
        if latest is not None and self.target is not None and latest.policy_version < self.target.policy_version:
            log.info("%s: v%d is older than the published v%d: not applied", self.engine_id,
                     latest.policy_version, self.target.policy_version)
            latest = None
        return latest, tenant_recs, ends

    def _full_change(self) -> events.Control | None:
        """Rollout on: the full weights the serving view now wants (:meth:`TenantServing.full_target`)
        when they are not :attr:`target` by version and sha256, else None (nothing to reload: a
        ``promote`` keeps what the engine already serves)."""
        want = self.tenants.full_target(self.target, self.takes_candidate)
        if want is None and self.target is not None:
            log.error("%s: the engine must serve the incumbent v%s, but control holds no weights order of it: "
                      "it keeps serving v%d", self.engine_id, self.tenants.view.scope(None).incumbent,
                      self.target.policy_version)
        if want is None or (self.target is not None and (want.policy_version, want.sha256)
                            == (self.target.policy_version, self.target.sha256)):
            return None
        if self.target is not None and want.policy_version < self.target.policy_version:
            log.warning("%s: v%d was rolled back: re-applying the incumbent v%d (%s)", self.engine_id,
                        self.target.policy_version, want.policy_version, want.location)
        return want

    def _apply_full(self, producer, latest: events.Control) -> None:
        """Apply the newest full weights of a poll, answer on ``control``, read the engine back."""
        from pipeline import weightsync

        self.target = latest
        t0 = time.perf_counter()
        ok, msg = self.apply(latest)
        weightsync.SYNCER_SECONDS.observe(time.perf_counter() - t0)
        (weightsync.SYNCER_APPLIED if ok else weightsync.SYNCER_FAILED).inc()
        (self.applied if ok else self.failed).append(latest.policy_version)
        self._publish(producer, "applied" if ok else "failed", latest, msg)
        self.served = self.served_version()  # what the engine says, not what the apply call claimed
        self._observe()


class _Stopped(PipelineError):
    """Raised by :meth:`Syncer.apply`'s back-off sleep when the syncer is stopping."""
