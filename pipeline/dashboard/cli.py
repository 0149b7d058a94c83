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


def build(config):
    """State, topic follower, scraper and app for ``config`` (threads not started)."""
    from pipeline.dashboard.app import create_app
    from pipeline.dashboard.sources import Scraper, TopicFollower
    from pipeline.dashboard.state import DashboardState

    state = DashboardState(config)
    follower = TopicFollower(config, state)
    scraper = Scraper(config, follower)
    return state, follower, scraper, create_app(config, state, follower, scraper)


def run(args, config) -> int:
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
