"""The eval runner: the team's eval set against every version that serves, one
:class:`~pipeline.events.Evaluation` per version on ``metrics`` (issue 39; docs/rollout.md).

Its own thread (the decider is never blocked by an engine). It follows ``control`` (who serves
what: :class:`pipeline.rollout.serving.ServingView` of the run) and ``metrics`` (the evaluations
already published: a restart evaluates nothing twice), both from offset 0 as an observer (the
decider dead-letters bad records), and once it has read both to their end it evaluates, in this
order, every version of :meth:`EvalRunner.wanted` that has no evaluation of this eval set yet:

- the **incumbent** of every scope: the full weights' (version 0 at the first start, or the
  promoted one) and each tenant's (its promoted adapter, or the base model: ``adapter`` None);
- every **live candidate**: a version evaluates when it goes live (the ``resume`` that names it,
  sent once every engine applied it), not at its ``weights`` order.

Each eval-set item is one chat request to ``engine.url`` (or the canary engines', below) (:data:`EVAL_CONCURRENCY` in flight) (``engine.kind``'s client), greedy
(``temperature`` 0; ``seed`` = ``rollout.eval_seed`` for engines that sample anyway),
``max_tokens`` = ``rollout.eval_max_tokens``; an adapter is named by the request's ``model``
(:func:`pipeline.engine_api.backend.adapter_model` of ``engine.served_model_name`` or
``engine.model``), as the proxy does. The result (:func:`pipeline.rollout.evalset.evaluate`)
is published with ``tenant``/``adapter`` set for a tenant's scope and ``policy_version`` = the
full weights' incumbent (a tenant's scope) or the version (full weights).

A version is evaluated only while it serves: a full-weight reply whose ``metadata.weight_version``
names another version, or an adapter reply whose ``lora_name`` names another adapter, discards
the evaluation (:class:`NotServing`). With one full-weight engine the incumbent is therefore
evaluated at start (before its successor is applied) or as the candidate it once was. With
``rollout.canary_engines`` (a full-weight canary over several engines) the live full-weight
candidate is evaluated at ``proxy.canary_engine_url`` (the engines that serve it) and the
incumbent at ``engine.url`` (:meth:`EvalRunner.url_of`).

An eval set with ``judge`` checks is graded by the LLM judge of ``config.judge``
(:class:`pipeline.evaluator.judged.EvalJudge`, the judge stage's client and vote rules), asked once
every reply is in; an eval set without them never opens it, and one with them and no LLM judge
(``judge.backend`` not ``llm``) is refused when the runner is made. A judge check the judge gave
no verdict on is absent from that evaluation (logged), never a failure. Engine
errors and versions not served are logged and retried with back-off (1 s doubling to 60 s),
for as long as the version is wanted; the runner never stops on one.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from pipeline import events
from pipeline.bus import EventProducer, Offset, TopicReader
from pipeline.config import Config
from pipeline.errors import PipelineError
from pipeline.engine_api.backend import adapter_model, engine_client
from pipeline.evaluator import prom
from pipeline.evaluator.lifecycle import DaemonThread
from pipeline.evaluator.decider import run_id_of
from pipeline.evaluator.judged import EvalJudge, require_llm_judge
from pipeline.rollout.evalset import EvalSet, Judge, evaluate
from pipeline.rollout.serving import ServingView, version_of

log = logging.getLogger(__name__)
EVAL_CONCURRENCY = 8  # eval-set requests in flight per version (the engine batches them)


class NotServing(PipelineError, RuntimeError):
    """The engine answered with another version than the one being evaluated."""


class EvalRunner(DaemonThread):
    """Evaluate every version that serves (module docstring). Runs in its own thread.

    Args:
        config: the process config (``engine``, ``rollout``, ``kafka``, ``topics``).
        eval_set: the loaded eval set (:func:`pipeline.rollout.evalset.load_eval_set`).
        stop: the owner's stop flag (default: its own).

    Raises:
        pipeline.rollout.evalset.EvalSetError: the eval set has ``judge`` checks and no LLM judge is
            configured (:func:`pipeline.evaluator.judged.require_llm_judge`).

    Attributes:
        published: the evaluations this process published, in order.
        done: ``(scope, version)`` evaluated with this eval set (read back or published).
        idle: set while the runner has read ``control`` and ``metrics`` to their end and nothing
            is left to evaluate (cleared when something is).
    """

    def __init__(self, config: Config, eval_set: EvalSet, stop: threading.Event | None = None,
                 retry_s: float = 1.0, max_retry_s: float = 60.0) -> None:
        require_llm_judge(config, eval_set)
        self.config, self.eval_set, self.run_id = config, eval_set, run_id_of(config)
        self.stop = stop if stop is not None else threading.Event()
        self.retry_s, self.max_retry_s = retry_s, max_retry_s
        self.view = ServingView(self.run_id)
        self.done: set = set()
        self.published: list[events.Evaluation] = []
        self.idle = threading.Event()
        self._retry: dict[tuple, tuple[float, float]] = {}  # (scope, version) -> (next try, back-off)
        self._init_thread("evaluator-evals")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._clients: dict[str, object] = {}  # engine URL -> engine.kind's client
        self._producer: EventProducer | None = None
        self._judge = EvalJudge(config) if eval_set.uses_judge else None  # grades the judge checks

    # ---- what to evaluate -----------------------------------------------------------------------
    def wanted(self) -> list[tuple]:
        """``(scope, version, adapter)`` to evaluate now, incumbents first (``adapter``: the
        tenant's adapter dict, None for the base model and for full weights)."""
        out = []
        for scope, s in sorted(self.view.scopes.items(), key=lambda kv: (kv[0] is not None, kv[0] or "")):
            arms = [s.incumbent] + ([s.candidate] if s.candidate is not None and s.live else [])
            for v in arms:
                key = (scope, version_of(v))
                if key not in self.done and key not in [(o[0], o[1]) for o in out]:
                    out.append((scope, version_of(v), v if isinstance(v, dict) else None))
        return out

    def _apply(self, ev) -> None:
        if isinstance(ev, events.Control):
            self.view.apply(ev)
        elif isinstance(ev, events.Evaluation) and ev.run_id == self.run_id and ev.name == self.eval_set.name[:256]:
            scope = ev.tenant
            self.done.add((scope, (ev.adapter or {}).get("version") if scope is not None else ev.policy_version))

    # ---- the loop -------------------------------------------------------------------------------
    def run(self) -> None:
        """Follow and evaluate until :attr:`stop` (blocking); reconnects after broker errors."""
        self._loop = asyncio.new_event_loop()
        try:
            while not self.stop.is_set():
                try:
                    self._follow()
                except Exception as err:  # broker trouble: read everything again
                    log.warning("evaluator: eval runner failed (%s: %s); again in %.1f s", type(err).__name__, err,
                                self.retry_s)
                    self.stop.wait(self.retry_s)
        finally:
            self.close_clients()
            self._loop.close()
            if self._producer is not None:
                self._producer.close()

    def _follow(self) -> None:
        self.view, self.done = ServingView(self.run_id), set()
        self.idle.clear()
        topics = [self.config.topics.name("control"), self.config.topics.name("metrics")]
        with TopicReader(self.config, topics, Offset(0), name="evaluator-evals", stop=self.stop, wait_s=10.0) as r:
            caught_up = False
            while not self.stop.is_set():
                for rec in r.poll(300):
                    self._apply(getattr(rec, "event", None))
                caught_up = caught_up or r.caught_up()
                if caught_up:
                    self._evaluate_wanted()

    def _evaluate_wanted(self) -> None:
        now = time.monotonic()
        wanted = self.wanted()
        (self.idle.clear if wanted else self.idle.set)()
        for scope, version, adapter in wanted:
            key = (scope, version)
            if self._retry.get(key, (0.0, 0.0))[0] > now or self.stop.is_set():
                continue
            try:
                t0 = time.monotonic()
                ev = self.evaluate(scope, version, adapter)
            except Exception as err:  # an engine error, a version not served (yet): later
                wait = min(self._retry.get(key, (0.0, self.retry_s / 2))[1] * 2, self.max_retry_s)
                self._retry[key] = (time.monotonic() + wait, wait)
                prom.EVALUATIONS.labels("failed").inc()
                log.warning("evaluator: evaluating %s %s failed (%s: %s); again in %.0f s", scope or "full weights",
                            version, type(err).__name__, err, wait)
                continue
            self._retry.pop(key, None)
            self._publish(ev, time.monotonic() - t0)
            self.done.add(key)
            return  # read control again before the next one: the scope may have moved on

    def evaluate(self, scope: str | None, version, adapter: dict | None) -> events.Evaluation:
        """Run the eval set against the engine serving ``version`` of ``scope``.

        Raises:
            pipeline.engine_api.errors.EngineError: the engine failed a request.
            NotServing: the engine answered with another version.
        """
        e, ro = self.config.engine, self.config.rollout
        base = e.served_model_name or e.model
        model = adapter_model(e.kind, base, adapter["name"]) if adapter is not None else base
        url = self.url_of(scope, version)
        if url not in self._clients:
            key = e.api_key.get_secret_value() if e.api_key is not None else None
            self._clients[url] = engine_client(e.kind, url, e.request_timeout_s, key)
        client = self._clients[url]

        async def ask(messages: list, gate: asyncio.Semaphore) -> str:
            body = {"model": model, "messages": messages, "max_tokens": ro.eval_max_tokens, "temperature": 0.0,
                    "seed": ro.eval_seed}
            async with gate:
                out = await client.chat(body)
            meta = out.get("metadata") or {}
            if scope is None and "weight_version" in meta and str(meta["weight_version"]) != str(version):
                raise NotServing(f"the engine serves version {meta['weight_version']}, not {version}")
            if scope is not None and "lora_name" in meta and meta["lora_name"] != (adapter or {}).get("name"):
                raise NotServing(f"the engine served adapter {meta['lora_name']!r}, not {(adapter or {}).get('name')!r}")
            return (out["choices"][0].get("message") or {}).get("content") or ""

        async def ask_all() -> list[str]:  # EVAL_CONCURRENCY requests in flight: the engine batches them
            gate = asyncio.Semaphore(EVAL_CONCURRENCY)
            return list(await asyncio.gather(*(ask(it["messages"], gate) for it in self.eval_set.items)))

        replies = self._loop.run_until_complete(ask_all())  # in item order, as evaluate asks them
        judge, left = self._judge_of(replies), iter(replies)
        pv = version if scope is None else self.view.scope(None).incumbent
        ev = evaluate(self.eval_set, lambda _messages: next(left), pv, run_id=self.run_id,
                      created_at=events.now_ms(), judge=judge)
        ev.tenant, ev.adapter = scope, adapter
        return ev

    def _judge_of(self, replies: list[str]) -> Judge | None:
        """The eval set's judge checks of these replies (in item order), judged concurrently, as
        :func:`pipeline.rollout.evalset.evaluate`'s ``judge``; None when it has none."""
        if self._judge is None:
            return None
        verdicts = self._loop.run_until_complete(self._judge.verdicts(self.eval_set.items, replies))
        return lambda criterion, item, _reply: verdicts[(id(item), criterion)]

    def close_clients(self) -> None:
        """Close the engine clients and the judge's, on the runner's event loop."""
        for client in self._clients.values():
            self._loop.run_until_complete(client.aclose())
        self._clients.clear()
        if self._judge is not None:
            self._loop.run_until_complete(self._judge.aclose())

    def url_of(self, scope: str | None, version) -> str:
        """The engine that serves ``version`` of ``scope``: ``proxy.canary_engine_url`` for the full
        weights' candidate with ``rollout.canary_engines``, else ``engine.url``."""
        url = self.config.proxy.canary_engine_url
        if scope is None and self.config.rollout.canary_engines and url and version == self.view.scope(None).candidate:
            return url
        return self.config.engine.url

    def _publish(self, ev: events.Evaluation, seconds: float = 0.0) -> None:
        if self._producer is None:
            self._producer = EventProducer(self.config, name="evaluator")
        self._producer.send(self.config.topics.name("metrics"), ev, key=ev.run_id).get(timeout=30)
        self.published.append(ev)
        prom.EVALUATIONS.labels("published").inc()
        shown = {k: round(v, 3) for k, v in ev.metrics.items() if not k.endswith(("_n", "_low", "_high"))}
        log.info("evaluator: published evaluation of %s %s: %s (n=%d, %.0f s)", ev.tenant or "full weights",
                 (ev.adapter or {}).get("name", ev.policy_version), shown, ev.n, seconds)
