"""``pipeline up``: the whole loop on one machine, each stage its own process.

Order: embedded broker (unless ``--external-broker``) -> ``topics apply`` -> policy engine
(unless ``--engine-url``) -> OPD teacher engine (frozen initial policy; only for judge modes
opd/combine) -> proxy -> judge -> trainer -> syncer. Each stage gets the same generated config
file (``<run-dir>/config.yaml``), its own log (``<run-dir>/logs/<stage>.log``) and a metrics
port; readiness is an HTTP probe (``/health`` of engines, ``/healthz`` of the proxy,
``/metrics`` of the consumer stages). Ctrl-C (SIGINT) or SIGTERM stops everything in reverse
order; nothing is left running.

The embedded broker is a stage like the others (``pipeline broker``, log ``logs/broker.log``, its
servers' own log ``logs/broker-servers.log``) with durable storage in ``<run-dir>/broker`` (see
:mod:`pipeline.broker`): a second ``up`` on the same run directory carries on from the same log —
every recorded turn, the consumer groups' committed offsets, the trainer's checkpoints — on the
same broker port when it is free. ``--memory-broker`` keeps the log in memory instead (gone at stop).
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import yaml
from prometheus_client.parser import text_string_to_metric_families

from pipeline.broker import free_port, kafka_answers, port_free
from pipeline.config import Config, redacted
from pipeline.orchestrate.supervisor import StageFailed, Supervisor, http_ok

log = logging.getLogger(__name__)
HELP = "Start broker, engine(s), proxy, judge, trainer and syncer as processes; Ctrl-C stops all."


@dataclass
class Stack:
    """A running single-machine deployment."""

    config: Config
    run_dir: Path
    supervisor: Supervisor
    broker_data_dir: Path | None = None  # durable embedded broker's storage; None: external or memory
    metrics: dict[str, str] = field(default_factory=dict)  # stage -> metrics URL

    @property
    def proxy_url(self) -> str:
        """Base URL of the OpenAI-compatible proxy."""
        return f"http://{self.config.proxy.host}:{self.config.proxy.port}"

    def stop(self) -> dict[str, int | None]:
        """Stop every stage in reverse start order (the embedded broker last)."""
        return self.supervisor.stop_all()


def add_arguments(parser) -> None:
    parser.add_argument("--run-dir", help="where config, logs, weights and checkpoints go (default runs/<time>)")
    parser.add_argument("--external-broker", action="store_true",
                        help="use kafka.bootstrap_servers as is instead of starting the embedded broker")
    parser.add_argument("--memory-broker", action="store_true",
                        help="embedded broker with memory storage (everything is gone at stop) instead of its "
                             "durable log in <run-dir>/broker")
    parser.add_argument("--engine-url", help="use a running engine (e.g. SGLang) instead of starting one")
    parser.add_argument("--model", help="policy model: smollm2-135m (default), tiny-random or an HF folder")
    parser.add_argument("--judge-mode", choices=["rl", "opd", "combine"], help="judge.mode")
    parser.add_argument("--no-trainer", action="store_true", help="serve and judge only (collect data)")


def _apply_defaults(config: Config, run_dir: Path, args) -> None:
    if args.model:
        config.engine.model = args.model
        config.trainer.model = args.model
    if args.judge_mode:
        config.judge.mode = args.judge_mode
    if args.engine_url:
        config.engine.url = args.engine_url
    config.trainer.checkpoint_dir = str(run_dir / "checkpoints")
    config.trainer.export_dir = str(run_dir / "weights")
    config.trainer.metrics_file = str(run_dir / "trainer_metrics.jsonl")


def broker_stage_args(run_dir: Path, durable: bool = True) -> tuple[list[str], int]:
    """``pipeline broker`` arguments for the embedded broker of ``run_dir`` and its port.

    Durable: data in ``run_dir/broker``, on the port its last run used when that is free (so a
    restarted broker, or a second ``up``, is found where clients expect it). Memory: a free port.
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
    args = ["broker", "--port", str(port), "--broker-log", str(run_dir / "logs" / "broker-servers.log")]
    if durable:
        args += ["--data-dir", str(data_dir)]
    return args, port


def start_stack(config: Config, run_dir: Path, external_broker: bool = False, engine_url: str | None = None,
                trainer: bool = True, ready_timeout_s: float = 600.0, durable_broker: bool = True) -> Stack:
    """Start every stage for ``config`` (mutated: ports, URLs, paths) and wait until ready.

    ``durable_broker``: the embedded broker keeps its log in ``run_dir/broker`` (a later call on
    the same ``run_dir`` carries on from it); False: memory storage.

    Raises:
        StageFailed: a stage exited or did not become ready (its log tail is in the message).
    """
    run_dir.mkdir(parents=True, exist_ok=True)
    sup = Supervisor(run_dir / "logs")
    stack = Stack(config, run_dir, sup)
    try:
        if not external_broker:
            bargs, bport = broker_stage_args(run_dir, durable_broker)
            bootstrap = f"127.0.0.1:{bport}"
            sup.start("broker", bargs, ready=lambda: kafka_answers(bootstrap), timeout_s=min(ready_timeout_s, 180.0))
            config.kafka.bootstrap_servers = bootstrap
            stack.broker_data_dir = run_dir / "broker" if durable_broker else None
        from pipeline.topics import apply_topics, load_topics

        apply_topics(config, load_topics(config.topics.file))
        if engine_url is None:
            config.engine.port = free_port()
            config.engine.url = f"http://127.0.0.1:{config.engine.port}"
        if config.judge.mode != "rl" and not config.engine.teacher_url:
            config.engine.teacher_url = "pending"
        config.proxy.port = free_port()
        if config.proxy.buffer_dir is not None:  # the proxy's durable event buffer lives with the run
            config.proxy.buffer_dir = str(run_dir / "proxy-buffer")
        cfg_path = run_dir / "config.yaml"

        def write_config() -> None:
            data = redacted(config)
            from pipeline.config import SECRETS

            for section, key in SECRETS:  # secrets stay in the environment, children inherit it
                data[section].pop(key, None)
            cfg_path.write_text(yaml.safe_dump(data, sort_keys=False))

        def stage(name: str, args: list[str], ready_path: str | None = None, port: int | None = None,
                  timeout_s: float = ready_timeout_s):
            mport = free_port()
            stack.metrics[name] = f"http://127.0.0.1:{port or mport}/metrics"
            ready = http_ok(f"http://127.0.0.1:{port}{ready_path}") if ready_path else http_ok(stack.metrics[name])
            return sup.start(name, [*args, "--config", str(cfg_path), "--set", f"metrics_port={mport}"],
                             ready=ready, timeout_s=timeout_s)

        if engine_url is None:
            write_config()
            stage("engine", ["engine", "--model", config.engine.model, "--port", str(config.engine.port)],
                  "/health", config.engine.port)
        if config.engine.teacher_url == "pending":
            tport = free_port()
            config.engine.teacher_url = f"http://127.0.0.1:{tport}"
            write_config()
            stage("teacher", ["engine", "--model", config.engine.model, "--port", str(tport)], "/health", tport)
        write_config()
        stage("proxy", ["proxy"], "/healthz", config.proxy.port)
        stage("judge", ["judge", "--mode", config.judge.mode])
        if trainer:
            stage("trainer", ["trainer"])
            stage("syncer", ["syncer", "--engine", config.engine.url])
    except BaseException:
        stack.stop()
        raise
    return stack


def scrape(url: str) -> dict[str, float]:
    """Sum of each Prometheus sample name at ``url`` (labels summed). Empty dict if unreachable."""
    try:
        text = httpx.get(url, timeout=2.0).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def status_line(stack: Stack) -> str:
    """One console line: stage liveness and the main counters."""
    alive = " ".join(f"{s.name}:{'up' if s.alive else 'DOWN'}" for s in stack.supervisor.stages)
    p = scrape(stack.metrics.get("proxy", ""))
    j = scrape(stack.metrics.get("judge", ""))
    t = scrape(stack.metrics.get("trainer", ""))
    return (f"[{time.strftime('%H:%M:%S')}] {alive} | requests {p.get('pipeline_proxy_requests_total', 0):.0f}"
            f" | samples {j.get('pipeline_judge_samples_total', 0):.0f}"
            f" | trainer steps {t.get('pipeline_trainer_steps_total', 0):.0f}"
            f" | policy version {t.get('pipeline_trainer_policy_version', 0):.0f}")


def run(args, config: Config) -> int:
    run_dir = Path(args.run_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}")
    _apply_defaults(config, run_dir, args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"starting the stack in {run_dir} (logs in {run_dir / 'logs'}) ...", flush=True)
    try:
        stack = start_stack(config, run_dir, args.external_broker, args.engine_url, trainer=not args.no_trainer,
                            durable_broker=not args.memory_broker)
    except StageFailed as e:
        print(f"pipeline up: {e}", file=sys.stderr)
        return 1
    storage = ("external" if args.external_broker else
               f"durable log in {stack.broker_data_dir}" if stack.broker_data_dir else "memory storage")
    print(f"ready: proxy {stack.proxy_url}/v1  engine {config.engine.url}  broker {config.kafka.bootstrap_servers}"
          f" ({storage})", flush=True)
    print("point an OpenAI client at the proxy (headers X-Session-Id, X-Turn-Type, X-Session-Done); Ctrl-C stops",
          flush=True)
    rc = 0
    while not stop.wait(10):
        print(status_line(stack), flush=True)
        dead = stack.supervisor.dead()
        if dead:
            for s in dead:
                print(f"stage {s.name} exited with {s.proc.returncode}; log {s.log_path}:\n{s.tail()}", file=sys.stderr)
            rc = 1
            break
    print("stopping ...", flush=True)
    codes = stack.stop()
    print("stopped: " + ", ".join(f"{k}={v}" for k, v in codes.items()), flush=True)
    return rc
