"""``pipeline up``: the whole loop on one machine, each stage its own process.

Order: embedded broker (unless ``--external-broker``) -> ``topics apply`` -> policy engine
(unless ``--engine-url``) -> OPD teacher engine (frozen initial policy; only for judge modes
opd/combine) -> proxy -> judge -> trainer -> syncer -> dashboard (unless ``--no-dashboard``).
Each stage gets the same generated config file (``<run-dir>/config.yaml``), its own log
(``<run-dir>/logs/<stage>.log``) and a metrics port; readiness is an HTTP probe (``/health`` of
engines, ``/healthz`` of the proxy and the dashboard, ``/metrics`` of the consumer stages).
Ctrl-C (SIGINT) or SIGTERM stops everything in reverse order; nothing is left running.

The embedded broker is a stage like the others (``pipeline broker``, log ``logs/broker.log``, its
servers' own log ``logs/broker-servers.log``) with durable storage in ``<run-dir>/broker`` (see
:mod:`pipeline.broker`): a second ``up`` on the same run directory carries on from the same log —
every recorded turn, the consumer groups' committed offsets, the trainer's checkpoints — on the
same broker port when it is free. ``--memory-broker`` keeps the log in memory instead (gone at stop).

Scaled out (``--replicas proxy=2,judge=2,engine=2`` or ``--scale``): N engines (``engine-<i>``),
each with its own syncer (``syncer-<i>``, engine id ``engine-<i>``; the trainer waits for all of
them at a sync) behind ``engine-front`` (round robin; a request that failed before its answer
started is tried on the next engine: generation has no side effect; an engine is in rotation
while its syncer's ``/readyz`` says it serves the published weights, when the syncer has one);
N proxies (``proxy-<i>``, each its own durable buffer ``<run-dir>/proxy-buffer-<i>``) behind
``front`` (round robin, the URL users get; moves on only from a refused connection, so a turn
is never recorded twice); N judges in one consumer group. Turns of one session may then arrive
through different proxies (see :mod:`pipeline.proxy.sessions` and :mod:`pipeline.judge.reorder`).

Supervision: a stage that exits is restarted with the same arguments after a back-off
(:class:`pipeline.orchestrate.supervisor.RestartPolicy`); restarts are counted in the status
line; only repeated fast failures stop the stack, with the stage's log tail.
"""

from __future__ import annotations

import functools
import json
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pipeline.broker import kafka_answers
from pipeline.config import Config, ConfigError, redacted
from pipeline.engine_api.client import ask_once
from pipeline.engine_api.errors import EngineError
from pipeline.orchestrate.supervisor import RestartPolicy, StageFailed, StopOutcome, Supervisor, http_ok
from pipeline.procutil import free_port, port_free
from pipeline.stack import STACK_FILE, clear_pointer, write_pointer, write_stack

log = logging.getLogger(__name__)
HELP = "Start broker, engine(s), proxy, judge, trainer and syncer as processes; Ctrl-C stops all."


@dataclass
class Stack:
    """A running single-machine deployment."""

    config: Config
    run_dir: Path
    supervisor: Supervisor
    broker_data_dir: Path | None = None  # durable embedded broker's storage; None: external or memory
    broker_kind: str = "external"  # kafka or tansu: the broker start_stack started
    metrics: dict[str, str] = field(default_factory=dict)  # stage -> metrics URL
    replicas: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_REPLICAS))
    front_url: str | None = None  # the round-robin front of several proxies (None: one proxy)
    dashboard_url: str | None = None  # the web dashboard, when started
    proxy_urls: dict[str, str] = field(default_factory=dict)  # proxy stage -> its own URL
    engine_urls: dict[str, str] = field(default_factory=dict)  # engine stage -> its own URL

    @property
    def proxy_url(self) -> str:
        """Base URL users talk to: the front of the proxies, or the one proxy."""
        return self.front_url or f"http://{self.config.proxy.host}:{self.config.proxy.port}"

    def stop(self, keep_broker: bool = False) -> dict[str, StopOutcome]:
        """Stop every stage in reverse start order (the embedded broker last, or not at all with
        ``keep_broker``: the topics can then be read with no writer left); how each ended."""
        return self.supervisor.stop_all(keep=("broker",) if keep_broker else ())


def add_arguments(parser) -> None:
    parser.add_argument("--run-dir", help="where config, logs, weights and checkpoints go (default runs/<time>)")
    parser.add_argument("--external-broker", action="store_true",
                        help="use kafka.bootstrap_servers as is instead of starting the embedded broker")
    parser.add_argument("--broker", choices=("auto", "kafka", "tansu"), default="auto", dest="broker_kind",
                        help="the broker to start: Apache Kafka (jars from deploy/install-kafka.sh, Java >= 17), the "
                             "embedded Tansu, or auto (default): Kafka when installed, else Tansu; a run dir keeps "
                             "the kind its broker log was written by")
    parser.add_argument("--memory-broker", action="store_true",
                        help="embedded broker with memory storage (everything is gone at stop) instead of its "
                             "durable log in <run-dir>/broker")
    parser.add_argument("--engine-url", help="use a running engine (e.g. SGLang) instead of starting one")
    parser.add_argument("--model", help="policy model: smollm2-135m (default), tiny-random or an HF folder")
    parser.add_argument("--engine", choices=("native", "vllm"), dest="engine_kind",
                        help="the engines to start (engine.kind): native (this package's CPU server, default) or "
                             "vllm (vLLM's OpenAI server from deploy/install-vllm.sh's venv; docs/vllm.md)")
    parser.add_argument("--judge-mode", choices=["rl", "opd", "combine"], help="judge.mode")
    parser.add_argument("--no-trainer", action="store_true", help="serve and judge only (collect data)")
    parser.add_argument("--rollout", action="store_true",
                        help="canary rollout (rollout.enabled): a new version serves rollout.share of new sessions "
                             "until the evaluator stage promotes or rolls it back from the records (docs/rollout.md)")
    parser.add_argument("--batch-size", type=int, metavar="N",
                        help=f"samples per trainer step (trainer.rollout_batch_size); default {CHAT_BATCH} unless the "
                             "config sets it: one person's chat of ten turns gives two steps (a bigger batch gives "
                             "steadier updates and needs more traffic)")
    parser.add_argument("--no-dashboard", action="store_true", help="do not start the web dashboard")
    parser.add_argument("--dashboard-port", type=int, help="port of the web dashboard (default: a free one)")
    parser.add_argument("--proxy-port", type=int, help="port of the proxy URL clients use (default: a free one); "
                        "keep it fixed so an agent's configured base URL stays valid across restarts")
    parser.add_argument("--replicas", metavar="STAGE=N,...", type=parse_replicas, default=None,
                        help="scale out the stateless stages, e.g. proxy=2,judge=2,engine=2: N proxies behind a "
                             "round-robin front, N judges in one consumer group, N engines (each with its syncer) "
                             "behind a round-robin engine front")
    parser.add_argument("--scale", action="store_true", help="shorthand for --replicas proxy=2,judge=2,engine=2")
    parser.add_argument("--max-fast-failures", type=int, default=RestartPolicy.max_fast_failures,
                        help="stop the stack when a stage exits this many times in a row, each within "
                             f"{RestartPolicy.stable_s:.0f} s of its start (otherwise it is restarted with back-off)")


DEFAULT_REPLICAS = {"proxy": 1, "judge": 1, "engine": 1}


def parse_replicas(text: str) -> dict[str, int]:
    """``proxy=2,judge=2,engine=2`` -> ``{"proxy": 2, "judge": 2, "engine": 2}`` (missing stages: 1).

    Raises:
        argparse.ArgumentTypeError: an unknown stage, or a count that is not an integer >= 1.
    """
    import argparse

    out = dict(DEFAULT_REPLICAS)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, n = part.partition("=")
        name = name.strip()
        if name not in DEFAULT_REPLICAS:
            raise argparse.ArgumentTypeError(f"cannot scale {name!r}: choose from {', '.join(DEFAULT_REPLICAS)} "
                                             "(the broker, trainer and teacher are single)")
        try:
            count = int(n)
        except ValueError:
            count = 0
        if count < 1:
            raise argparse.ArgumentTypeError(f"{name}={n!r}: the count must be an integer >= 1")
        out[name] = count
    return out


def replica_names(stage: str, n: int) -> list[str]:
    """Stage names of ``n`` replicas: ``[stage]`` for one, ``stage-0 .. stage-<n-1>`` for more."""
    return [stage] if n == 1 else [f"{stage}-{i}" for i in range(n)]


#: ``pipeline up``'s samples per trainer step when neither ``--batch-size`` nor the config says: a
#: person chatting with their agent sees a step within a few turns (each turn is judged when the
#: next one arrives), where ``trainer.rollout_batch_size``'s default of 16 needs 17 turns
CHAT_BATCH = 4
#: padded tokens per micro-batch under the chat default: an agent's long prompts (OpenClaw's are
#: ~3,200 tokens) go through the forward pass one at a time, short chats several at once
CHAT_MICRO_TOKENS = 4096
#: settings of the chat default besides the batch (each unless the config sets it): attention
#: scores recomputed in the backward pass (an agent's ~3,000-token prompts otherwise need over
#: 15 GiB for one SmolLM2 sample on the CPU; trainer.recompute_attention)
CHAT_TRAINER = {"micro_batch_tokens": CHAT_MICRO_TOKENS, "recompute_attention": True}


def batch_settings(config: Config, batch_size: int | None) -> dict:
    """``trainer`` settings for ``pipeline up``: ``--batch-size``, else the config's own
    ``rollout_batch_size`` when it sets one (file, ``--set`` or environment), else
    :data:`CHAT_BATCH`; with the chat default also :data:`CHAT_TRAINER`'s settings that the
    config does not set itself."""
    given = config.trainer.model_fields_set
    if batch_size is not None:
        return {"rollout_batch_size": batch_size}
    if "rollout_batch_size" in given:
        return {}
    return {"rollout_batch_size": CHAT_BATCH, **{k: v for k, v in CHAT_TRAINER.items() if k not in given}}


def _apply_defaults(config: Config, run_dir: Path, args) -> Config:
    """``config`` with ``pipeline up``'s flags and the run folder's paths (a validated copy)."""
    engine: dict = {"model": args.model} if args.model else {}
    if args.engine_url:
        engine["url"] = args.engine_url
    if getattr(args, "engine_kind", None):
        engine["kind"] = args.engine_kind
    return config.replace(
        engine=engine, judge={"mode": args.judge_mode} if args.judge_mode else {},
        rollout={"enabled": True} if getattr(args, "rollout", False) else {},
        trainer={**({"model": args.model} if args.model else {}), **batch_settings(config, getattr(args, "batch_size", None)),
                 "checkpoint_dir": str(run_dir / "checkpoints"),
                 "export_dir": str(run_dir / "weights"), "metrics_file": str(run_dir / "trainer_metrics.jsonl")})


def broker_stage_args(run_dir: Path, durable: bool = True, kind: str = "auto") -> tuple[list[str], int]:
    """``pipeline broker`` arguments for the embedded broker of ``run_dir`` and its port.

    Durable: data in ``run_dir/broker``, on the port its last run used when that is free (so a
    restarted broker, or a second ``up``, is found where clients expect it). Memory: a free port.
    ``kind``: ``pipeline broker --kind`` (auto: Apache Kafka when installed, else Tansu).
    """
    port = 0
    data_dir = run_dir / "broker"
    if durable:
        try:
            port = int(json.loads((data_dir / "broker.json").read_text()).get("port") or 0)
        except (OSError, ValueError):
            port = 0
        if port and not port_free(port):
            port = 0
    port = port or free_port()
    args = ["broker", "--kind", kind, "--port", str(port), "--broker-log", str(run_dir / "logs" / "broker-servers.log")]
    if durable:
        args += ["--data-dir", str(data_dir)]
    return args, port


def _local(port: int, path: str = "") -> str:
    """``http://127.0.0.1:<port><path>``: where a stage of the stack serves."""
    return f"http://127.0.0.1:{port}{path}"


@dataclass(frozen=True)
class BrokerChoice:
    """The embedded broker a stack starts (:func:`choose_broker`).

    Attributes:
        kind: ``kafka`` or ``tansu``.
        args: its ``pipeline broker`` command line.
        port: the port it listens on (clients bootstrap from ``127.0.0.1:<port>``).
        data_dir: its durable storage (None: memory storage).
    """

    kind: str
    args: tuple[str, ...]
    port: int
    data_dir: Path | None

    @property
    def bootstrap(self) -> str:
        """``kafka.bootstrap_servers`` of the stages."""
        return f"127.0.0.1:{self.port}"


def choose_broker(run_dir: Path, durable: bool, kind: str) -> BrokerChoice:
    """The embedded broker of ``run_dir``: ``kind`` resolved (:func:`pipeline.broker.resolve_kind`;
    ``auto`` keeps the kind a durable log was written by), its arguments and port
    (:func:`broker_stage_args`). Reads the run folder; starts nothing."""
    from pipeline.broker import resolve_kind

    data_dir = run_dir / "broker" if durable else None
    kind = resolve_kind(kind, data_dir)
    args, port = broker_stage_args(run_dir, durable, kind)
    return BrokerChoice(kind, tuple(args), port, data_dir)


@dataclass(frozen=True)
class PlannedStage:
    """One process of a stack: ``python -m pipeline <args>``, supervised as ``name`` (log ``logs/<name>.log``).

    Attributes:
        name: the stage's name.
        args: its ``pipeline`` command line.
        ready: what answers once it is ready (the next stage starts only then): a URL that answers
            2xx (``probe`` ``http``), or the broker's bootstrap address (``probe`` ``kafka``).
        timeout_s: how long it may take to become ready.
        metrics: its ``/metrics`` URL (None: it serves none).
        probe: ``http`` or ``kafka`` (see ``ready``).
    """

    name: str
    args: tuple[str, ...]
    ready: str
    timeout_s: float
    metrics: str | None = None
    probe: str = "http"


@dataclass(frozen=True)
class StackPlan:
    """Every process of a stack in start order, what they run with and where they serve (:func:`plan_stack`).

    Attributes:
        config: what the stages run with: ``config.yaml`` from the first stage after the broker on.
        final_config: ``config`` with the dashboard's port and every stage's metrics URL: the file
            is rewritten with it before the dashboard starts (without a dashboard: ``config``).
        config_path: ``<run-dir>/config.yaml``, every stage's ``--config``.
        broker: the embedded broker, started first (None: an external broker).
        stages: started once the topics exist, in order: engines, teacher, engine front, proxies,
            front, judges, trainer, syncers.
        dashboard: started last (None: no dashboard).
        broker_kind, broker_data_dir, replicas, metrics, engine_urls, proxy_urls, front_url,
            dashboard_url: as :class:`Stack`'s (``metrics``: each stage's, in start order).
    """

    config: Config
    final_config: Config
    config_path: Path
    broker: PlannedStage | None
    stages: tuple[PlannedStage, ...]
    dashboard: PlannedStage | None
    broker_kind: str
    broker_data_dir: Path | None
    replicas: dict[str, int]
    metrics: dict[str, str]
    engine_urls: dict[str, str]
    proxy_urls: dict[str, str]
    front_url: str | None
    dashboard_url: str | None


@dataclass(frozen=True)
class _Ports:
    """The ports a stack's stages serve on (metrics ports apart)."""

    engines: dict[str, int]  # engine stage -> port
    engine_front: int | None  # the front of several engines
    teacher: int | None  # the OPD teacher the stack starts (None: none, or a configured one)
    syncer_ready: dict[str, int]  # engine stage -> its syncer's /readyz (several engines, when syncers serve one)
    proxies: dict[str, int]  # proxy stage -> port
    front: int | None  # the front of several proxies


def serving_lora(config: Config) -> Config:
    """``config`` with the stack's own engines serving the trainer's adapters: ``trainer.lora``
    (one adapter per tenant) turns ``engine.enable_lora`` on, with a ``max_lora_rank`` and
    ``lora_target_modules`` that admit them (an engine without LoRA refused every adapter sync,
    and the trainer trained adapters nobody served). Unchanged without ``trainer.lora``."""
    lora = config.trainer.lora
    if lora is None:
        return config
    e = config.engine
    return config.replace(engine={"enable_lora": True, "max_lora_rank": max(e.max_lora_rank, lora.rank),
                                  "lora_target_modules": sorted(set(e.lora_target_modules) | set(lora.targets))})


def plan_stack(config: Config, run_dir: Path, new_port: Callable[[], int], broker: BrokerChoice | None = None,
               engine_url: str | None = None, trainer: bool = True, ready_timeout_s: float = 600.0,
               replicas: dict[str, int] | None = None, dashboard: bool = True, dashboard_port: int | None = None,
               proxy_port: int | None = None) -> StackPlan:
    """What :func:`start_stack` starts for the same arguments: every process's command line,
    readiness probe and metrics URL in start order, the configuration they run with and the
    addresses they serve. Starts, reads and writes nothing: ``broker`` is the embedded broker
    (:func:`choose_broker`; None: ``config``'s external one), ``new_port()`` gives every other
    port (:func:`pipeline.procutil.free_port`: a free one per call). The stack's own engines serve
    the trainer's adapters when it trains them (:func:`serving_lora`).

    Raises:
        ConfigError: several vLLM engines (not supported: the version bracket needs one engine);
            ``rollout.enabled`` with full weights (no ``trainer.lora``) over several engines the
            stack starts (one engine, gated by the eval set; the config itself refuses full-weight
            rollout without ``rollout.eval_set``); ``rollout.canary_engines`` with engines the
            stack starts (several full-weight engines are started by hand: docs/rollout.md).
    """
    reps = {**DEFAULT_REPLICAS, **(replicas or {})}
    if config.engine.kind == "vllm" and reps["engine"] > 1:
        # the proxy reads vLLM's version around each request: behind a round-robin front the reads
        # and the request could reach different engines (docs/vllm.md)
        raise ConfigError("--engine vllm serves from one engine: several vLLM engines behind one front are not "
                         "supported yet (drop engine=N from --replicas)")
    if config.rollout.canary_engines and engine_url is None:
        # the stack's own engines sit behind engine.url: proxy.canary_engine_url would point at nothing
        raise ConfigError("rollout.canary_engines with engines the stack starts itself: several full-weight engines "
                         "are started by hand (docs/rollout.md, 'Full-weight canaries over several engines'); pass "
                         "--engine-url of the incumbent's engines, or unset rollout.canary_engines")
    if config.rollout.enabled and trainer and config.trainer.lora is None and engine_url is None \
            and reps["engine"] > 1:
        # the eval-set gate assumes one engine serving the candidate to everyone (docs/rollout.md)
        raise ConfigError("rollout.enabled with full weights on the stack's own engines is built for one engine (the "
                         "eval set gates the candidate it serves): drop engine=N from --replicas; several "
                         "full-weight engines are started by hand (rollout.canary_engines, docs/rollout.md)")
    if engine_url is None:
        config = serving_lora(config)
    broker_stage = None
    if broker is not None:
        config = config.replace(kafka={"bootstrap_servers": broker.bootstrap})
        broker_stage = PlannedStage("broker", broker.args, broker.bootstrap, min(ready_timeout_s, 180.0),
                                    probe="kafka")
    engines = replica_names("engine", reps["engine"]) if engine_url is None else []
    proxies = replica_names("proxy", reps["proxy"])
    config, ports = _assign_ports(config, run_dir, engines, proxies, proxy_port, new_port)
    config_path = run_dir / "config.yaml"
    stage = functools.partial(_stage, new_port, config_path, ready_timeout_s)
    stages = (*_engine_stages(stage, config, ports), *_proxy_stages(stage, config, run_dir, ports),
              *_consumer_stages(stage, config, ports, replica_names("judge", reps["judge"]), trainer))
    metrics = {s.name: s.metrics for s in stages}
    final, dash, dash_url = config, None, None
    if dashboard:  # reads the topics and every stage's metrics; serves no /metrics of its own
        final = config.replace(dashboard={"port": dashboard_port or new_port(), "metrics_urls": metrics})
        dash_url = f"http://{final.dashboard.host}:{final.dashboard.port}/"
        dash = PlannedStage("dashboard", ("dashboard", "--config", str(config_path)), f"{dash_url}healthz",
                            ready_timeout_s)
    return StackPlan(config, final, config_path, broker_stage, stages, dash,
                     broker_kind=broker.kind if broker else "external",
                     broker_data_dir=broker.data_dir if broker else None, replicas=reps, metrics=metrics,
                     engine_urls={name: _local(port) for name, port in ports.engines.items()},
                     proxy_urls={name: _local(port) for name, port in ports.proxies.items()},
                     front_url=None if ports.front is None else _local(ports.front), dashboard_url=dash_url)


def _assign_ports(config: Config, run_dir: Path, engines: list[str], proxies: list[str], proxy_port: int | None,
                  new_port: Callable[[], int]) -> tuple[Config, _Ports]:
    """The service ports of ``engines`` (none: an engine URL was given), the teacher, ``proxies``
    and their fronts, and ``config`` pointed at them: the trainer waits for every engine at a sync,
    the policy URL is the engine front's (several engines) or the engine's, the teacher's URL is
    set when the judge mode needs one and none is configured, the proxy's port is the first
    proxy's, and its durable event buffer lives with the run. ``proxy_port``: the port users get
    (the one proxy's, or the front's of several; None: a free one)."""
    if len(engines) > 1:
        config = config.replace(trainer={"engines": [f"engine-{i}" for i in range(len(engines))]})
    engine_ports = {name: new_port() for name in engines}
    if engines:
        config = config.replace(engine={"port": engine_ports[engines[0]], "url": _local(engine_ports[engines[0]])})
    engine_front = new_port() if len(engines) > 1 else None
    if engine_front:  # proxies, judge backends and the teacher's default see the engine front
        config = config.replace(engine={"url": _local(engine_front)})
    teacher = None
    if config.judge.mode != "rl" and not config.engine.teacher_url:
        teacher = new_port()
        config = config.replace(engine={"teacher_url": _local(teacher)})
    readyz = len(engines) > 1 and "ready_port" in type(config.syncer).model_fields
    syncer_ready = {name: new_port() for name in engines} if readyz else {}
    proxy_ports = {name: (proxy_port if len(proxies) == 1 else None) or new_port() for name in proxies}
    config = config.replace(proxy={"port": proxy_ports[proxies[0]]})
    if config.proxy.buffer_dir is not None:  # the proxy's durable event buffer lives with the run
        config = config.replace(proxy={"buffer_dir": str(run_dir / "proxy-buffer")})
    front = (proxy_port or new_port()) if len(proxies) > 1 else None
    return config, _Ports(engine_ports, engine_front, teacher, syncer_ready, proxy_ports, front)


def _stage(new_port: Callable[[], int], config_path: Path, timeout_s: float, name: str, args: list[str],
           ready_path: str | None = None, port: int | None = None, ready_url: str | None = None) -> PlannedStage:
    """Stage ``name`` with ``args`` plus the stack's config file and a metrics port of its own
    (``--set metrics_port``). A stage with a ``port`` (engines, proxies, fronts) serves its
    metrics there, the others on the metrics port; it is ready when ``ready_url``, else
    ``ready_path`` on ``port``, else its metrics URL answers."""
    metrics_port = new_port()
    metrics = _local(port or metrics_port, "/metrics")
    ready = ready_url or (_local(port, ready_path) if ready_path else metrics)
    return PlannedStage(name, (*args, "--config", str(config_path), "--set", f"metrics_port={metrics_port}"),
                        ready, timeout_s, metrics)


def _engine_stages(stage: Callable[..., PlannedStage], config: Config, ports: _Ports) -> list[PlannedStage]:
    """The policy engines, the OPD teacher (the same model: the frozen initial policy) and, for
    several engines, their front (round robin; a request that failed before its answer started
    is tried on the next engine; an engine is in rotation while its syncer's ``/readyz`` says
    it serves the published weights, or, with no such syncer, while its ``/health`` answers)."""
    e = config.engine
    kind, teacher = ("vllm" if k == "vllm" else "native" for k in (e.kind, e.teacher_kind or e.kind))
    out = [stage(name, ["engine", "--kind", kind, "--model", e.model, "--port", str(port)], "/health", port)
           for name, port in ports.engines.items()]
    if ports.teacher is not None:
        # the teacher is the frozen base model: never LoRA (vLLM 0.32's CPU build with LoRA on crashed
        # scoring prompt log-probs beside other requests; docs/vllm.md)
        out.append(stage("teacher", ["engine", "--kind", teacher, "--model", e.model, "--port", str(ports.teacher),
                                     "--set", "engine.enable_lora=false", "--set", "engine.lora_paths={}"],
                         "/health", ports.teacher))
    if ports.engine_front is not None:
        probe = {name: _local(ports.syncer_ready[name], "/readyz") if name in ports.syncer_ready
                 else _local(port, "/health") for name, port in ports.engines.items()}
        backends = [a for name, port in ports.engines.items() for a in ("--backend", f"{_local(port)}={probe[name]}")]
        out.append(stage("engine-front", ["front", "--port", str(ports.engine_front), "--retry", "any", *backends],
                         ready_url=_local(ports.engine_front, "/_front/status")))
    return out


def _proxy_stages(stage: Callable[..., PlannedStage], config: Config, run_dir: Path,
                  ports: _Ports) -> list[PlannedStage]:
    """The proxies (several: each its own durable buffer ``proxy-buffer-<i>``) and, for several,
    their round-robin front."""
    own_buffers = len(ports.proxies) > 1 and config.proxy.buffer_dir is not None
    out = []
    for i, (name, port) in enumerate(ports.proxies.items()):
        buffer = ["--buffer-dir", str(run_dir / f"proxy-buffer-{i}")] if own_buffers else []
        out.append(stage(name, ["proxy", "--port", str(port), *buffer], "/healthz", port))
    if ports.front is not None:
        out.append(stage("front", ["front", "--port", str(ports.front), "--health-path", "/healthz",
                                   *[a for port in ports.proxies.values() for a in ("--backend", _local(port))]],
                         ready_url=_local(ports.front, "/_front/status")))
    return out


def _consumer_stages(stage: Callable[..., PlannedStage], config: Config, ports: _Ports, judges: list[str],
                     trainer: bool) -> list[PlannedStage]:
    """The judges (one consumer group) and, with ``trainer``, the trainer, the evaluator (with
    ``rollout.enabled``: it decides each canary) and the syncers (one per engine when there are
    several, each with its engine id)."""
    out = [stage(name, ["judge", "--mode", config.judge.mode]) for name in judges]
    if not trainer:
        return out
    out.append(stage("trainer", ["trainer"]))
    if config.rollout.enabled:
        out.append(stage("evaluator", ["evaluator"]))
    if len(ports.engines) <= 1:
        return [*out, stage("syncer", ["syncer", "--engine", config.engine.url])]
    for i, (name, port) in enumerate(ports.engines.items()):
        ready = ["--ready-port", str(ports.syncer_ready[name])] if name in ports.syncer_ready else []
        out.append(stage(f"syncer-{i}", ["syncer", "--engine", _local(port), "--engine-id", f"engine-{i}", *ready]))
    return out


def launch_stack(plan: StackPlan, supervisor: Supervisor) -> None:
    """Start ``plan``'s processes in order, each once the one before is ready: the embedded
    broker; then, the topics created and ``config.yaml`` written, every stage; then, the file
    rewritten with the dashboard's section, the dashboard. What started is left to the caller
    to stop.

    Raises:
        StageFailed: a stage exited or was not ready in time (its log tail is in the message).
    """
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    if plan.broker is not None:
        _launch(supervisor, plan.broker)
    apply_topics(plan.config, load_topics(plan.config.topics.file))
    write_config_file(plan.config, plan.config_path)
    for stage in plan.stages:
        _launch(supervisor, stage)
    if plan.dashboard is not None:
        write_config_file(plan.final_config, plan.config_path)
        _launch(supervisor, plan.dashboard)


def _launch(supervisor: Supervisor, stage: PlannedStage) -> None:
    """Start ``stage`` and wait until it is ready."""
    ready = (lambda: kafka_answers(stage.ready)) if stage.probe == "kafka" else http_ok(stage.ready)
    supervisor.start(stage.name, list(stage.args), ready=ready, timeout_s=stage.timeout_s)


def start_stack(config: Config, run_dir: Path, external_broker: bool = False, engine_url: str | None = None,
                trainer: bool = True, ready_timeout_s: float = 600.0, durable_broker: bool = True,
                replicas: dict[str, int] | None = None, restart: RestartPolicy | None = None,
                dashboard: bool = True, dashboard_port: int | None = None, proxy_port: int | None = None,
                broker_kind: str = "auto") -> Stack:
    """Start every stage for ``config`` and wait until ready: :func:`plan_stack`, then
    :func:`launch_stack`. The configuration the stages run with (``config`` plus the broker
    address, ports, URLs and paths chosen here) is ``stack.config``; ``config`` itself is not changed.

    ``durable_broker``: the embedded broker keeps its log in ``run_dir/broker`` (a later call on
    the same ``run_dir`` carries on from it); False: memory storage. ``broker_kind``: ``auto``
    (Apache Kafka when installed, else Tansu; :func:`pipeline.broker.resolve_kind`), ``kafka``
    or ``tansu``; the kind started is ``stack.broker_kind``. ``replicas``: counts of
    ``proxy``, ``judge`` and ``engine`` (see the module docstring; default 1 each). ``restart``:
    the supervisor's :class:`RestartPolicy` (restarts happen in :meth:`Supervisor.check` /
    :meth:`Supervisor.watch`, which the caller runs). ``proxy_port``: the port of the URL users
    get (the proxy, or the front of several; None: a free one). Once ready, the services'
    addresses are written to ``run_dir/stack.json`` (:mod:`pipeline.stack`). On any error or
    interrupt every stage started so far is stopped before it is re-raised.

    Raises:
        StageFailed: a stage exited or did not become ready (its log tail is in the message), or
            ``proxy_port`` is taken.
    """
    if proxy_port and not port_free(proxy_port):
        raise StageFailed(f"--proxy-port {proxy_port}: the port is in use (another `pipeline up`?)")
    run_dir.mkdir(parents=True, exist_ok=True)
    supervisor = Supervisor(run_dir / "logs", policy=restart)
    broker = None if external_broker else choose_broker(run_dir, durable_broker, broker_kind)
    plan = plan_stack(config, run_dir, free_port, broker=broker, engine_url=engine_url, trainer=trainer,
                      ready_timeout_s=ready_timeout_s, replicas=replicas, dashboard=dashboard,
                      dashboard_port=dashboard_port, proxy_port=proxy_port)
    stack = Stack(plan.final_config, run_dir, supervisor, broker_data_dir=plan.broker_data_dir,
                  broker_kind=plan.broker_kind, metrics=plan.metrics, replicas=plan.replicas,
                  front_url=plan.front_url, dashboard_url=plan.dashboard_url, proxy_urls=plan.proxy_urls,
                  engine_urls=plan.engine_urls)
    try:
        launch_stack(plan, supervisor)
        write_stack(run_dir, stack_record(stack))
    except BaseException:
        stack.stop()
        raise
    return stack


def write_config_file(config: Config, path: Path) -> None:
    """Write ``config`` as the YAML file every stage of a stack is started with (``--config``);
    secrets are left out (they stay in the environment, which the stages inherit)."""
    from pipeline.config import SECRETS

    data = redacted(config)
    for section, key in SECRETS:
        data[section].pop(key, None)
    path.write_text(yaml.safe_dump(data, sort_keys=False))


def served_model(config: Config) -> dict:
    """``{"id", "context_window"}`` of the policy engine as its ``/v1/models`` reports them (the
    CPU engine and SGLang both give ``max_model_len``); ``engine.model`` and None when it does not say."""
    key = config.engine.api_key.get_secret_value() if config.engine.api_key else None
    try:
        card = ask_once(config.engine.url, lambda c: c.models(), 10.0, key)["data"][0]
        window = card.get("max_model_len")
        return {"id": str(card["id"]), "context_window": window if isinstance(window, int) else None}
    except (EngineError, AttributeError, KeyError, IndexError, TypeError):
        return {"id": config.engine.served_model_name or config.engine.model, "context_window": None}


def stack_record(stack: Stack) -> dict:
    """What ``stack.json`` says about ``stack`` (see :mod:`pipeline.stack` for the fields)."""
    c = stack.config
    return {"bootstrap": c.kafka.bootstrap_servers, "topics_prefix": c.topics.prefix,
            "proxy_url": stack.proxy_url, "openai_base_url": f"{stack.proxy_url}/v1",
            "proxy_urls": dict(stack.proxy_urls), "engine_url": c.engine.url, "engine_urls": dict(stack.engine_urls),
            "teacher_url": c.engine.teacher_url, "dashboard_url": stack.dashboard_url, "metrics": dict(stack.metrics),
            "config": str((stack.run_dir / "config.yaml").resolve()), "model": served_model(c)}


def _samples(url: str) -> list:
    """The Prometheus samples served at ``url`` (empty if unreachable)."""
    try:
        text = httpx.get(url, timeout=2.0).text
    except httpx.HTTPError:
        return []
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def scrape(url: str) -> dict[str, float]:
    """Sum of each Prometheus sample name at ``url`` (labels summed). Empty dict if unreachable."""
    out: dict[str, float] = {}
    for s in _samples(url):
        out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def scrape_by_label(url: str, name: str, label: str) -> dict[str, float]:
    """The samples of counter/gauge ``name`` at ``url`` summed per value of ``label`` (replicas
    and other labels summed). Empty dict if unreachable or absent."""
    out: dict[str, float] = {}
    for s in _samples(url):
        if s.name == name and label in s.labels:
            out[s.labels[label]] = out.get(s.labels[label], 0.0) + s.value
    return out


def _stage_urls(stack: Stack, prefix: str) -> list[str]:
    """The metrics URLs of stage ``prefix`` and its replicas (``prefix-<i>``)."""
    return [url for name, url in stack.metrics.items()
            if name == prefix or name.startswith(prefix + "-") and name[len(prefix) + 1:].isdigit()]


def syncs_failed(stack: Stack) -> int:
    """Applies the syncers answered ``failed`` for, summed over syncers: full weights
    (``pipeline_syncer_failed_total``) and tenant adapter loads
    (``pipeline_syncer_adapter_loads_total{result="failed"}``), each after its retries.
    0 when no syncer answers (the status line then shows nothing)."""
    n = 0.0
    for url in _stage_urls(stack, "syncer"):
        for s in _samples(url):
            if s.name == "pipeline_syncer_failed_total" or (
                    s.name == "pipeline_syncer_adapter_loads_total" and s.labels.get("result") == "failed"):
                n += s.value
    return int(n)


def status_line(stack: Stack) -> str:
    """One console line: each stage's state and restart count, and the main counters (summed over
    replicas); ``| syncs failed N`` only when a syncer reported a failed apply (:func:`syncs_failed`)."""
    parts = []
    for s in stack.supervisor.stages:
        state = s.state
        parts.append(f"{s.name}:{state if state in ('up', 'starting') else state.replace(' ', '-')}"
                     + (f"(restarts {s.restarts})" if s.restarts else ""))

    def total(prefix: str, key: str) -> str:
        """The sum over the stage's replicas that serve ``key``; ``n/a`` when none does (a stage
        down or not started: no figure, never 0)."""
        hits = [v for url in _stage_urls(stack, prefix) for k, v in scrape(url).items() if k == key]
        return f"{sum(hits):.0f}" if hits else "n/a"

    return (f"[{time.strftime('%H:%M:%S')}] {' '.join(parts)}"
            f" | requests {total('proxy', 'pipeline_proxy_requests_total')}"
            f" | samples {total('judge', 'pipeline_judge_samples_total')}"
            f" | trainer steps {total('trainer', 'pipeline_trainer_steps_total')}"
            + _next_step_part(stack)
            + f" | policy version {total('trainer', 'pipeline_trainer_policy_version')}" + _served_part(stack)
            + (f" | syncs failed {failed}" if (failed := syncs_failed(stack)) else "")
            + f" | restarts {sum(stack.supervisor.restarts().values())}")


def _served_part(stack: Stack) -> str:
    """`` (engines serve v0)`` when an engine's served version differs from the trainer's (a
    canary held, a rollback restored the incumbent); empty otherwise or when no engine reports one."""
    trained = [v for url in _stage_urls(stack, "trainer") for k, v in scrape(url).items()
               if k == "pipeline_trainer_policy_version"]
    served = sorted({int(v) for url in _stage_urls(stack, "engine") for k, v in scrape(url).items()
                     if k == "pipeline_engine_weight_version"})
    if not served or [float(v) for v in served] == trained[:1] * len(served):
        return ""
    return f" (engines serve {', '.join(f'v{v}' for v in served)})"


def _next_step_part(stack: Stack) -> str:
    """`` (next step: 3 more samples)`` from the trainer's batch gauges; empty when it serves none."""
    for url in _stage_urls(stack, "trainer"):
        values = scrape(url)
        size, counted = values.get("pipeline_trainer_batch_size"), values.get("pipeline_trainer_batch_counted")
        if size and counted is not None:
            return f" (next step: {max(0, size - counted):.0f} more samples)"
    return ""


def start_interruptibly(stop: threading.Event, start: Callable[[], Stack]) -> Stack:
    """``start()`` (a :func:`start_stack` call) with Ctrl-C / SIGTERM raising KeyboardInterrupt
    inside it, so a signal during start-up stops every stage started so far at once (start_stack
    stops them before re-raising); once it returns, both signals only set ``stop``. Main thread only.

    Raises:
        KeyboardInterrupt: a signal arrived during start-up (a second one only sets ``stop``, so
            it cannot cut the clean-up short). Whatever ``start()`` raises.
    """
    def on_signal(*_) -> None:
        stop.set()

    def interrupt(*_) -> None:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)
        raise KeyboardInterrupt

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, interrupt)
    try:
        return start()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, on_signal)


def start_or_status(command: str, stop: threading.Event, start: Callable[[], Stack]) -> Stack | int:
    """:func:`start_interruptibly`, or the exit status of ``pipeline <command>`` when start-up ended
    early: 1 when a stage failed to start (its error printed), 130 when a signal stopped it (every
    stage started so far was stopped by :func:`start_stack`)."""
    try:
        return start_interruptibly(stop, start)
    except StageFailed as e:
        print(f"pipeline {command}: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"pipeline {command}: stopped during start-up; every stage it had started was stopped", file=sys.stderr)
        return 130


def run(args, config: Config) -> int:
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    config = _apply_defaults(config, run_dir, args)
    replicas = args.replicas or (parse_replicas("proxy=2,judge=2,engine=2") if args.scale else None)
    stop = threading.Event()
    print(f"starting the stack in {run_dir} (logs in {run_dir / 'logs'}) ...", flush=True)
    policy = RestartPolicy(max_fast_failures=max(1, args.max_fast_failures))
    stack = start_or_status("up", stop, lambda: start_stack(
        config, run_dir, args.external_broker, args.engine_url, trainer=not args.no_trainer,
        durable_broker=not args.memory_broker, replicas=replicas, restart=policy,
        dashboard=not args.no_dashboard, dashboard_port=args.dashboard_port,
        proxy_port=args.proxy_port, broker_kind=args.broker_kind))
    if isinstance(stack, int):
        return stack
    config = stack.config
    stack_file = run_dir / STACK_FILE
    write_pointer(stack_file)
    kind = {"kafka": "Apache Kafka, ", "tansu": "Tansu, "}.get(stack.broker_kind, "")
    storage = ("external" if args.external_broker else
               kind + (f"durable log in {stack.broker_data_dir}" if stack.broker_data_dir else
                       "temporary log, removed at stop" if stack.broker_kind == "kafka" else "memory storage"))
    print(f"ready: proxy {stack.proxy_url}/v1  engine {config.engine.url}  broker {config.kafka.bootstrap_servers}"
          f" ({storage})", flush=True)
    if stack.front_url:
        print(f"  proxies {', '.join(stack.proxy_urls.values())} behind the round-robin front {stack.front_url}",
              flush=True)
    if len(stack.engine_urls) > 1:
        print(f"  engines {', '.join(stack.engine_urls.values())} behind {config.engine.url}", flush=True)
    if stack.dashboard_url:
        print(f"dashboard: {stack.dashboard_url}  (conversation text "
              f"{'shown' if config.dashboard.show_text else 'hidden; --set dashboard.show_text=true shows it'})",
              flush=True)
    model = json.loads(stack_file.read_text()).get("model") or {}
    print(f"stack: {stack_file} (model {model.get('id')}, context {model.get('context_window')} tokens); "
          "`pipeline tail`, `pipeline connect openclaw` ... find it there", flush=True)
    if not args.no_trainer:
        print(f"trainer: one step per {config.trainer.rollout_batch_size} judged samples (--batch-size); a turn is "
              "judged when the next one arrives; the status line and the dashboard say how many the next step "
              "still needs", flush=True)
    print("point an OpenAI client at the proxy (headers X-Session-Id, X-Turn-Type, X-Session-Done); Ctrl-C stops",
          flush=True)
    fatal: list[StageFailed] = []
    watcher = threading.Thread(target=stack.supervisor.watch, name="supervisor", daemon=True,
                               kwargs=dict(stop=stop, on_event=lambda line: print(line, file=sys.stderr, flush=True),
                                           on_fatal=fatal.append))
    watcher.start()
    next_status = time.monotonic() + 10
    while not stop.wait(0.5):
        if time.monotonic() >= next_status:
            print(status_line(stack), flush=True)
            next_status = time.monotonic() + 10
    watcher.join(timeout=5)
    rc = 0
    if fatal:
        print(f"pipeline up: {fatal[0]}", file=sys.stderr, flush=True)
        rc = 1
    print("stopping ...", flush=True)
    clear_pointer(stack_file)
    print(stop_summary(stack.stop()), flush=True)
    print(run_dir_note(run_dir), flush=True)
    return rc


def run_dir_note(run_dir: Path) -> str:
    """The line ``pipeline up`` and ``pipeline demo`` end with: the run folder's size and how to free it."""
    from pipeline.orchestrate.clean import disk_usage, human

    return (f"the run folder {run_dir} takes {human(disk_usage(run_dir))} (checkpoints, exported weights, broker "
            f"data, logs); 'pipeline clean {run_dir}' removes it")


def stop_summary(outcomes: dict[str, StopOutcome]) -> str:
    """One line for the end of ``pipeline up``: ``stopped cleanly: a, b`` and, for any stage that
    did not stop as asked, ``name: killed (exit -9)`` / ``name: exited (exit 1)``."""
    clean = [name for name, o in outcomes.items() if o.clean or o.how == "not started"]
    other = [f"{name}: {o}" for name, o in outcomes.items() if not (o.clean or o.how == "not started")]
    parts = [f"stopped cleanly: {', '.join(clean)}"] if clean else []
    if other:
        parts.append("did not stop cleanly: " + "; ".join(other))
    return " | ".join(parts) or "nothing to stop"
