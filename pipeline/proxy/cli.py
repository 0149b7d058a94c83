"""``python -m pipeline proxy``: serve the OpenAI-compatible proxy (see :mod:`pipeline.proxy`)."""

from __future__ import annotations

import logging
import socket
import sys

HELP = "OpenAI-compatible proxy that records every turn on Kafka"
log = logging.getLogger(__name__)


def add_arguments(parser) -> None:
    parser.add_argument("--host", help="listen address (proxy.host, default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="listen port (proxy.port, default 8000; 0 = any free port)")
    parser.add_argument("--engine-url", help="engine base URL (engine.url)")
    parser.add_argument("--buffer-dir", help="folder of the durable event buffer, one per proxy (proxy.buffer_dir, "
                        "default ./proxy-buffer); a restarted proxy sends what a killed one left there")
    parser.add_argument("--no-control", action="store_true", help="do not follow the control topic")


def _pick(name: str, fallback: str) -> str:
    try:
        __import__(name)
        return name
    except ImportError:
        return fallback


def run(args, config) -> int:
    import uvicorn

    from pipeline.proxy.app import ProxyApp

    pc: dict = {}
    if args.host:
        pc["host"] = args.host
    if args.port is not None:
        pc["port"] = args.port
    if args.buffer_dir:
        pc["buffer_dir"] = args.buffer_dir
    if args.no_control:
        pc["follow_control"] = False
    config = config.replace(proxy=pc, **({"engine": {"url": args.engine_url}} if args.engine_url else {}))
    pc = config.proxy
    if logging.getLogger().level > logging.DEBUG:
        # kafka-python logs every failed reconnect; the publisher reports broker state changes itself
        logging.getLogger("kafka").setLevel(logging.CRITICAL)
        logging.getLogger("rdkafka").setLevel(logging.CRITICAL)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((pc.host, pc.port))
    sock.listen(2048)
    port = sock.getsockname()[1]
    from pipeline.proxy.buffer import EventBufferError

    try:
        app = ProxyApp(config, follow_control=pc.follow_control)
    except EventBufferError as e:
        print(f"pipeline proxy: {e}", file=sys.stderr)
        sock.close()
        return 1
    url = f"http://{pc.host}:{port}"
    app.on_started = lambda: print(f"PROXY READY {url}", flush=True)
    cfg = uvicorn.Config(app, loop=_pick("uvloop", "asyncio"), http=_pick("httptools", "h11"), lifespan="on",
                         access_log=False, log_level="warning", timeout_keep_alive=75,
                         timeout_graceful_shutdown=max(5, int(pc.shutdown_flush_s)))
    server = uvicorn.Server(cfg)
    server.run(sockets=[sock])
    return 0
