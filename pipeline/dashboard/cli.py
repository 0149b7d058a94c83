"""``pipeline dashboard``: a live web view of the topics and the stages' Prometheus metrics.

It reads ``turns``, ``samples``, ``control``, ``metrics`` and their dead-letter topics in assign
mode (no consumer group, nothing committed: it never moves a stage's offsets), from the
beginning (default) or from now, and scrapes each ``--metrics NAME=URL``. Open the printed URL:
the overview updates live (server-sent events); the Sessions tab is the conversation browser.
Conversation text is served only with ``--show-text``; with ``proxy.api_keys`` set (environment
``PIPELINE_PROXY__API_KEYS``), the page asks for one of the proxy's keys.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

HELP = "Live web dashboard: traffic, judge votes, samples, trainer health, syncs, lag, DLQs; conversation browser."
log = logging.getLogger(__name__)


def add_arguments(parser) -> None:
    parser.add_argument("--host", help="listen address (dashboard.host, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (dashboard.port, default 8080; 0 picks a free one)")
    parser.add_argument("--show-text", action="store_true",
                        help="serve conversation text (requests, replies, next states, hints); default: ids, "
                             "lengths and scores only")
    parser.add_argument("--from", dest="start", choices=["beginning", "now"],
                        help="read the topics from the beginning (default) or only what arrives from now on")
    parser.add_argument("--metrics", action="append", default=[], metavar="STAGE=URL",
                        help="a stage's Prometheus endpoint, e.g. judge=http://127.0.0.1:9101/metrics (repeatable)")
    parser.add_argument("--run-dir", metavar="DIR",
                        help="show the run of `pipeline up`/`demo` in DIR, finished or not: its config.yaml, and "
                             "its durable broker restarted from DIR/broker when it is not running")


def build(config):
    """State, topic follower, scraper and app for ``config`` (threads not started)."""
    from pipeline.dashboard.app import create_app
    from pipeline.dashboard.sources import Scraper, TopicFollower
    from pipeline.dashboard.state import DashboardState

    state = DashboardState(config)
    follower = TopicFollower(config, state)
    scraper = Scraper(config, follower)
    return state, follower, scraper, create_app(config, state, follower, scraper)


def open_run(run_dir: Path, overrides: list[str]):
    """``(config, supervisor or None)`` for the run in ``run_dir``: its saved config; its embedded
    broker started from ``run_dir/broker`` (the same durable log, read by this dashboard only)
    when nothing answers at the saved address. Raises ValueError when ``run_dir`` holds no run."""
    from pipeline.broker import kafka_answers
    from pipeline.config import load_config
    from pipeline.orchestrate.supervisor import Supervisor
    from pipeline.orchestrate.up import broker_stage_args

    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ValueError(f"{run_dir} holds no run (no config.yaml): give the --run-dir of `pipeline up` or the "
                         f"run folder of `pipeline demo` (REPORT_DIR/run)")
    config = load_config(cfg_file, overrides=overrides)
    if kafka_answers(config.kafka.bootstrap_servers):
        return config, None
    if not (run_dir / "broker").is_dir():
        raise ValueError(f"the run's broker at {config.kafka.bootstrap_servers} does not answer and {run_dir} has "
                         f"no durable broker log (a --memory-broker run): nothing to show")
    sup = Supervisor(run_dir / "logs")
    bargs, port = broker_stage_args(run_dir)
    bootstrap = f"127.0.0.1:{port}"
    try:
        sup.start("broker-dashboard", bargs, ready=lambda: kafka_answers(bootstrap), timeout_s=180)
    except BaseException:  # not ready, or a SIGTERM while it starts: stop what started
        sup.stop_all()
        raise
    print(f"dashboard: the run's broker restarted from {run_dir / 'broker'} on {bootstrap}", flush=True)
    # a finished run's stages are gone: their metrics endpoints are not scraped
    return config.replace(kafka={"bootstrap_servers": bootstrap}, dashboard={"metrics_urls": {}}), sup


def _exit_on_sigterm(*_) -> None:
    raise SystemExit(0)


def run(args, config) -> int:
    # uvicorn re-raises the SIGTERM it caught once it has shut down; with the default action that
    # would end this process before the finally below stops the broker it started
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    sup = None
    try:
        if args.run_dir:
            try:
                config, sup = open_run(Path(args.run_dir), args.overrides)
            except ValueError as e:
                print(f"pipeline dashboard: {e}")
                return 2
        return _serve(args, config)
    finally:
        if sup is not None:
            sup.stop_all()


def _serve(args, config) -> int:
    import uvicorn

    from pipeline.procutil import free_port

    flags = {"host": args.host, "port": args.port, "start": args.start, "show_text": args.show_text or None}
    flags = {k: v for k, v in flags.items() if v is not None}
    urls = dict(config.dashboard.metrics_urls)
    for item in args.metrics:
        name, sep, url = item.partition("=")
        if not sep or not name or not url.startswith(("http://", "https://")):
            print(f"pipeline dashboard: --metrics wants STAGE=http://host:port/metrics, got {item!r}")
            return 2
        urls[name] = url
    flags["metrics_urls"] = urls
    if flags.get("port", config.dashboard.port) == 0:
        flags["port"] = free_port()
    config = config.replace(dashboard=flags)
    d = config.dashboard
    state, follower, scraper, app = build(config)
    follower.start()
    scraper.start()
    print(f"dashboard: http://{d.host}:{d.port}/  (conversation text {'shown' if d.show_text else 'hidden'}; "
          f"topics from {d.start})", flush=True)
    try:
        # open live streams never end by themselves: give them a few seconds at SIGTERM, then close them
        uvicorn.run(app, host=d.host, port=d.port, log_level="warning", access_log=False, timeout_graceful_shutdown=3)
    finally:
        scraper.stop()
        follower.stop()
    return 0
