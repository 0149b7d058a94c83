"""Apache Kafka 4.x, single node (KRaft: broker and controller in one JVM), from the official jars.

``deploy/install-kafka.sh`` fetches ``org.apache.kafka:kafka_2.13`` and its runtime classpath from
Maven Central (pinned :data:`KAFKA_VERSION`, every jar's sha256 checked) into
``~/.cache/openclaw-pipeline/kafka/<version>/libs`` (``PIPELINE_KAFKA_HOME`` overrides the
folder). :class:`KafkaBroker` runs it with Java >= 17::

    pipeline broker --kind kafka [--data-dir DIR] [--port P]

Layout of ``DIR`` (the same ``broker.lock`` / ``broker.json`` conventions as the Tansu broker of
:mod:`pipeline.broker`):

``kafka/``
    Kafka's log directory (``log.dirs``): formatted on first start (``StorageTool format``
    with a new cluster id), reused after.
``server.properties``, ``log4j2.properties``
    written at every start (ports may change: the quorum is static, ``controller.quorum.voters``).
``broker.json``
    ``kind: kafka``, the listener and controller ports of the last run (a restart without
    ``--port`` listens where the last run did).
``kafka.pid``
    the JVM of the last run (a ``kill -9``-ed parent's leftover is killed at the next start).

Without ``DIR`` the log lives in a temporary folder removed at stop (tests, throw-away runs).

Settings that differ from Kafka's defaults: ``auto.create.topics.enable=false`` (topics come
from ``topics.yaml`` only), ``group.initial.rebalance.delay.ms=0`` (a group's first join is not
held back 3 s), ``group.min.session.timeout.ms=1000`` (the stages' 2 s session timeout of
:class:`pipeline.config.KafkaConfig` is accepted), replication factor 1 for the internal topics
with 4 partitions each (instead of 50: faster first group and transaction), ``message.max.bytes``
64 MiB like the topics. Durability: one node has no replicas, so ``acks=all`` means the record is
in this broker's page cache; it survives a ``kill -9`` of the broker, not a power loss, unless
``log.flush.interval.messages=1`` (``flush_every_message``; measured in ``bench/broker.py``,
see docs/durability.md).

Stop: SIGTERM (Kafka's controlled shutdown flushes and closes its logs), SIGKILL after
``stop_timeout_s``. Start time: about 4 s on 2 cores (a JVM), plus ~1 s for the first format.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import uuid
from functools import lru_cache
from pathlib import Path

from pipeline.local_broker import BrokerError, LocalBroker, kill_leftover, log_tail, stop_proc, wait_ready, write_pid
from pipeline.procutil import free_port, port_free

KAFKA_VERSION = "4.1.1"
JAVA_MIN = 17

_LOG4J2 = """status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.out.ref = OUT
logger.started.name = kafka.server.KafkaRaftServer
logger.started.level = INFO
"""


def kafka_home() -> Path:
    """Folder of the installed jars: ``$PIPELINE_KAFKA_HOME`` or the default cache folder."""
    env = os.environ.get("PIPELINE_KAFKA_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "openclaw-pipeline" / "kafka" / KAFKA_VERSION


@lru_cache(maxsize=4)
def _java_major(java: str) -> int:
    try:
        out = subprocess.run([java, "-version"], capture_output=True, text=True, timeout=30).stderr
    except (OSError, subprocess.SubprocessError):
        return 0
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out)
    if not m:
        return 0
    major = int(m.group(1))
    return int(m.group(2) or 0) if major == 1 else major  # "1.8.0" is Java 8


def java_binary() -> str:
    """``$JAVA_HOME/bin/java`` or ``java`` on the PATH, version >= 17.

    Raises:
        BrokerError: no Java, or an older one.
    """
    home = os.environ.get("JAVA_HOME")
    java = str(Path(home) / "bin" / "java") if home and (Path(home) / "bin" / "java").exists() else shutil.which("java")
    if not java:
        raise BrokerError(f"Apache Kafka needs Java >= {JAVA_MIN}: none found (JAVA_HOME or java on the PATH)")
    major = _java_major(java)
    if major < JAVA_MIN:
        raise BrokerError(f"Apache Kafka needs Java >= {JAVA_MIN}; {java} is version {major or 'unknown'}")
    return java


def kafka_classpath() -> str:
    """The broker's class path (``<kafka_home>/libs/*``).

    Raises:
        BrokerError: the jars are not installed (run ``bash deploy/install-kafka.sh``).
    """
    home = kafka_home()
    libs = home / "libs"
    if not (home / "installed").exists() or not list(libs.glob("kafka_2.13-*.jar")):
        raise BrokerError(f"Apache Kafka's jars are not installed in {home}: run bash deploy/install-kafka.sh "
                          "(needs Java >= 17 and Maven)")
    return str(libs / "*")


def kafka_installed() -> bool:
    """True when Java >= 17 and the jars are there (``pipeline up`` then uses Apache Kafka)."""
    try:
        kafka_classpath()
        java_binary()
        return True
    except BrokerError:
        return False


def new_cluster_id() -> str:
    """A KRaft cluster id: 16 random bytes, URL-safe base64 without padding (Kafka's ``Uuid``;
    like Kafka's own, never starting with ``-``, which its command-line tools would read as an option)."""
    while True:
        out = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not out.startswith("-"):
            return out


def server_properties(port: int, controller_port: int, log_dir: Path, host: str = "127.0.0.1",
                      flush_every_message: bool = False) -> str:
    """``server.properties`` of a single-node KRaft broker+controller (see the module docstring)."""
    props = {
        "process.roles": "broker,controller", "node.id": "1",
        "controller.quorum.voters": f"1@{host}:{controller_port}",
        "listeners": f"PLAINTEXT://{host}:{port},CONTROLLER://{host}:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://{host}:{port}",
        "controller.listener.names": "CONTROLLER", "inter.broker.listener.name": "PLAINTEXT",
        "listener.security.protocol.map": "CONTROLLER:PLAINTEXT,PLAINTEXT:PLAINTEXT",
        "log.dirs": str(log_dir),
        "auto.create.topics.enable": "false", "num.partitions": "1",
        "group.initial.rebalance.delay.ms": "0", "group.min.session.timeout.ms": "1000",
        "offsets.topic.replication.factor": "1", "offsets.topic.num.partitions": "4",
        "transaction.state.log.replication.factor": "1", "transaction.state.log.min.isr": "1",
        "transaction.state.log.num.partitions": "4", "min.insync.replicas": "1",
        "message.max.bytes": str(64 * 1024 * 1024), "socket.request.max.bytes": str(128 * 1024 * 1024),
        "share.coordinator.state.topic.replication.factor": "1", "share.coordinator.state.topic.min.isr": "1",
    }
    if flush_every_message:
        props["log.flush.interval.messages"] = "1"
    return "".join(f"{k}={v}\n" for k, v in props.items())


def _storage_tool_format(log_dir: Path, java: str, classpath: str) -> None:
    """``kafka.tools.StorageTool format`` of ``log_dir`` (a JVM start: 1-7 s on 2 cores)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    props = log_dir.parent / f"{log_dir.name}.format.properties"
    props.write_text(server_properties(1, 2, log_dir))
    try:
        r = subprocess.run([java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-cp", classpath, "kafka.tools.StorageTool",
                            "format", "--cluster-id", new_cluster_id(), "--config", str(props)],
                           capture_output=True, text=True, timeout=300)
    finally:
        props.unlink(missing_ok=True)
    if r.returncode != 0:
        raise BrokerError(f"formatting {log_dir} failed ({r.returncode}): {(r.stdout + r.stderr)[-1500:]}")


def format_log_dir(log_dir: Path, java: str, classpath: str) -> None:
    """Format a new KRaft log directory with its own cluster and directory ids.

    ``StorageTool format`` runs once per Kafka version into ``<kafka_home>/format-template``
    (a static quorum's format writes only ``meta.properties``, the version's
    ``bootstrap.checkpoint`` and empty checkpoint files); later log directories are copies of it
    whose ``meta.properties`` gets new ids: a broker start then costs one JVM start, not two.
    Where the cache folder is not writable, each directory is formatted by the tool.

    Raises:
        BrokerError: the tool failed.
    """
    template = kafka_home() / "format-template"
    if not (template / "meta.properties").exists():
        try:
            tmp = Path(tempfile.mkdtemp(prefix="format-", dir=kafka_home()))
        except OSError:
            _storage_tool_format(log_dir, java, classpath)
            return
        try:
            _storage_tool_format(tmp / "dir", java, classpath)
            try:
                os.rename(tmp / "dir", template)
            except OSError:  # another process made it first
                pass
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    if not (template / "meta.properties").exists():  # a broken leftover template
        _storage_tool_format(log_dir, java, classpath)
        return
    shutil.copytree(template, log_dir, dirs_exist_ok=True)
    meta = log_dir / "meta.properties"
    lines = [ln for ln in meta.read_text().splitlines() if not ln.startswith(("cluster.id=", "directory.id="))]
    lines += [f"cluster.id={new_cluster_id()}", f"directory.id={new_cluster_id()}"]
    tmp_meta = meta.with_name("meta.properties.tmp")
    tmp_meta.write_text("\n".join(lines) + "\n")
    os.replace(tmp_meta, meta)


class KafkaBroker(LocalBroker):
    """An Apache Kafka broker (single-node KRaft) subprocess on ``host:port``.

    Args:
        port: listener port; None picks a free one (with ``data_dir``: the last run's, if free).
        host: listen address.
        log_file: append the JVM's log (WARN and up, plus the "started" line) here.
        data_dir: durable log in this folder (see the module docstring); None: a temporary
            folder removed at :meth:`stop`.
        heap_mb: the JVM's maximum heap (``-Xmx``).
        flush_every_message: ``log.flush.interval.messages=1`` (fsync per batch; see docs/durability.md).
        stop_timeout_s: SIGKILL after this long when SIGTERM has not stopped it.
        fast_start: C1-only JIT and a class-data archive (see :meth:`_start_opts`): a start
            3-4x faster on a busy 2-core machine, at some cost in peak throughput.

    Same interface as :class:`pipeline.broker.EmbeddedBroker` (both are :class:`pipeline.local_broker.LocalBroker`) (``bootstrap``, ``start``, ``stop``,
    ``alive``, ``started_in_s``). Raises :class:`BrokerError` from :meth:`start`.
    """

    kind = "kafka"
    version = KAFKA_VERSION

    def __init__(self, port: int | None = None, host: str = "127.0.0.1", log_file: str | None = None,
                 data_dir: str | os.PathLike | None = None, heap_mb: int = 512, flush_every_message: bool = False,
                 stop_timeout_s: float = 30.0, fast_start: bool = True) -> None:
        super().__init__(port=port, host=host, log_file=log_file, data_dir=data_dir)
        self.heap_mb = heap_mb
        self.flush_every_message = flush_every_message
        self.stop_timeout_s = stop_timeout_s
        self.controller_port: int | None = None
        self.fast_start = fast_start
        self._tmp: str | None = None
        self._jsa_tmp: Path | None = None
        self._t0 = 0.0

    @property
    def storage(self) -> str:
        """``temporary`` or ``durable (<data dir>)``."""
        return "temporary (removed at stop)" if self.data_dir is None else f"durable ({self.data_dir})"

    def _save_state(self) -> None:
        path = self.data_dir / "broker.json"
        tmp = path.with_name("broker.json.tmp")
        tmp.write_text(json.dumps({"kind": "kafka", "version": KAFKA_VERSION, "port": self.port, "host": self.host,
                                   "controller_port": self.controller_port}, indent=1))
        os.replace(tmp, path)

    def _pick_ports(self, state: dict) -> None:
        if not self.port:
            last = state.get("port")
            self.port = last if last and port_free(last, self.host) else free_port(self.host)
        last_c = state.get("controller_port")
        self.controller_port = last_c if last_c and last_c != self.port and port_free(last_c, self.host) else None
        while self.controller_port is None or self.controller_port == self.port:
            self.controller_port = free_port(self.host)

    def _prepare(self, base: Path, java: str, classpath: str) -> Path:
        """Write the properties files and format the log dir on first start; the properties path."""
        log_dir = base / "kafka"
        props = base / "server.properties"
        props.write_text(server_properties(self.port, self.controller_port, log_dir, self.host,
                                           self.flush_every_message))
        (base / "log4j2.properties").write_text(_LOG4J2)
        if not (log_dir / "meta.properties").exists():
            format_log_dir(log_dir, java, classpath)
        return props

    def start(self, timeout_s: float = 120.0) -> "KafkaBroker":
        """Format on first start, start the JVM and wait until it answers a metadata request
        (:meth:`launch`, then :meth:`wait_started`).

        Raises:
            BrokerError: no Java >= 17 or no jars, the data dir is in use, or the broker exited
                or was not ready within ``timeout_s`` (its log tail is in the message).
        """
        return self.launch().wait_started(timeout_s)

    def launch(self) -> "KafkaBroker":
        """Start the JVM without waiting for it (then :meth:`wait_started`). Call it from a
        thread that outlives the broker: the JVM gets SIGKILL when the thread that started it ends.

        Raises:
            BrokerError: no Java >= 17 or no jars, the data dir is in use, or formatting failed.
        """
        from pipeline.procutil import killed_with_parent

        self._t0 = time.monotonic()
        try:
            java, classpath = java_binary(), kafka_classpath()
            if self.data_dir is not None:
                self._lock()
                base = self.data_dir
                kill_leftover(base / "kafka.pid")
                state = self._state()
            else:
                self._tmp = tempfile.mkdtemp(prefix="pipeline-kafka-")
                base, state = Path(self._tmp), {}
            self._pick_ports(state)
            props = self._prepare(base, java, classpath)
            cmd = [java, f"-Xmx{self.heap_mb}m", "-Xms64m", "-XX:+UseSerialGC", *self._start_opts(),
                   "-Djava.awt.headless=true", f"-Dlog4j2.configurationFile={base / 'log4j2.properties'}",
                   "-cp", classpath, "kafka.Kafka", str(props)]
            out = open(self.log_file, "ab") if self.log_file else subprocess.DEVNULL
            try:
                self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             cwd=base, start_new_session=True, preexec_fn=killed_with_parent)
            finally:
                if out is not subprocess.DEVNULL:
                    out.close()
            if self.data_dir is not None:
                write_pid(base / "kafka.pid", self.proc, f"kafka.Kafka {props}")
                self._save_state()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_started(self, timeout_s: float = 120.0) -> "KafkaBroker":
        """Wait until the launched broker answers a metadata request; sets ``started_in_s``.

        Raises:
            BrokerError: it exited or was not ready within ``timeout_s`` (it is stopped).
        """
        try:
            wait_ready(self.bootstrap, timeout_s, alive=lambda: self.proc.poll() is None)
        except BrokerError as e:
            self.stop()
            raise BrokerError(f"Apache Kafka: {e}\n{log_tail(self.log_file)}") from None
        except BaseException:
            self.stop()
            raise
        self.started_in_s = time.monotonic() - self._t0
        return self

    def _start_opts(self) -> list[str]:
        """JVM options for a fast start (``fast_start``): C1 only, and a class-data archive.

        Measured on 2 cores shared with other work (load ~15): 15-16 s to ready with the JVM's
        defaults, 3.6-6.7 s with both (C2's compiler threads compete for the cores while the
        broker starts; the archive saves loading and verifying ~10k classes). The archive
        (``<kafka_home>/kafka.jsa``, ~50 MB) is written when the first broker stops cleanly
        (a start without it is the slow one) and ignored by a JVM it does not match.
        """
        if not self.fast_start:
            return []
        opts = ["-XX:TieredStopAtLevel=1"]
        jsa = kafka_home() / "kafka.jsa"
        if jsa.exists():
            return opts + [f"-XX:SharedArchiveFile={jsa}", "-Xshare:auto"]
        if os.access(kafka_home(), os.W_OK):
            self._jsa_tmp = kafka_home() / f"kafka.jsa.{os.getpid()}.{id(self)}.tmp"
            return opts + [f"-XX:ArchiveClassesAtExit={self._jsa_tmp}"]
        return opts

    def alive(self) -> bool:
        """True while the JVM runs."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float | None = None) -> None:
        """SIGTERM (controlled shutdown), SIGKILL after ``timeout_s`` (default ``stop_timeout_s``);
        a temporary log folder is removed."""
        stop_proc(self.proc, self.stop_timeout_s if timeout_s is None else timeout_s)
        if self._jsa_tmp is not None:
            if self.proc is not None and self.proc.returncode in (0, 143) and self._jsa_tmp.exists():
                os.replace(self._jsa_tmp, kafka_home() / "kafka.jsa")
            self._jsa_tmp.unlink(missing_ok=True)
            self._jsa_tmp = None
        if self.data_dir is not None and self._lock_fd is not None:  # not another broker's pid file
            (self.data_dir / "kafka.pid").unlink(missing_ok=True)
            self._unlock()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None


def warm_up() -> None:
    """Start and stop a throw-away broker once when Kafka is installed and the class-data
    archive is not written yet (``deploy/install.sh``); prints what it did, never raises."""
    if not kafka_installed() or (kafka_home() / "kafka.jsa").exists():
        return
    try:
        b = KafkaBroker().start()
        b.stop()
        print(f"Apache Kafka {KAFKA_VERSION}: first start {b.started_in_s:.1f} s; class-data archive "
              f"{'written' if (kafka_home() / 'kafka.jsa').exists() else 'not written'}")
    except BrokerError as e:
        print(f"warning: Apache Kafka did not start: {e}")
