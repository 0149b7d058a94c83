"""Kafka admin operations the stages need (kafka-python's ``KafkaAdminClient``): the one place
outside the producer and readers that talks to the broker about topics.

- :func:`admin_client`: a client with :func:`pipeline.bus.settings.admin_kwargs`.
- :func:`broker_reachable`: a TCP probe of the first bootstrap server (no Kafka client, no wait).
- :func:`describe_topics`: partition count and ``cleanup.policy`` of existing topics.
- :func:`topic_configs`: the configs of topics (None where the broker does not answer
  DescribeConfigs: Tansu 0.6.0).
- :func:`create_topics`: create topics, a concurrent creation of the same ones being no error.
- :func:`metadata_answers`: one metadata request to a bootstrap address (a readiness probe).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

from pipeline.config import Config


def admin_client(config: Config):
    """A ``KafkaAdminClient`` for ``config`` (close it). Raises kafka-python's connection errors."""
    from kafka import KafkaAdminClient

    from pipeline.bus.settings import admin_kwargs

    return KafkaAdminClient(**admin_kwargs(config))


def broker_reachable(config: Config, timeout_s: float = 2.0) -> bool:
    """True when the first bootstrap server accepts a TCP connection (a broker that is down
    is answered at once, without a Kafka client's 30 s of bootstrap retries)."""
    first = config.kafka.bootstrap_servers.split(",")[0].strip()
    host, _, port = first.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


@dataclass(frozen=True)
class TopicState:
    """One topic as the broker has it: partition count and ``cleanup.policy`` (None: unknown)."""

    name: str
    partitions: int
    cleanup_policy: str | None


def partition_counts(admin, names: list[str]) -> dict[str, int]:
    """Partition count of each existing topic of ``names`` (missing ones are left out)."""
    counts = {}
    for t in admin.describe_topics(names):
        if not t.get("error_code"):
            counts[t.get("name") or t.get("topic")] = len(t.get("partitions") or [])
    return counts


def parse_describe_configs(res, names: list[str]) -> list[dict[str, str]]:
    """``{config: value}`` per topic of ``names`` (in order) from a kafka-python ``describe_configs`` answer.

    kafka-python 3 answers ``{"topic": {name: {config: {"value": ...}}}}``; older versions a list
    of DescribeConfigs responses with ``resources`` tuples. Raises ``ValueError`` for anything else.
    """
    if isinstance(res, dict):
        topics = res.get("topic")
        if not isinstance(topics, dict):
            raise ValueError(f"no 'topic' mapping in {str(res)[:200]}")
        return [{k: (v.get("value") if isinstance(v, dict) else v) for k, v in (topics.get(n) or {}).items()}
                for n in names]
    by_name = {}
    for resp in res if isinstance(res, list) else [res]:
        for r in getattr(resp, "resources", []):
            name, entries = (r[3], r[4]) if isinstance(r, tuple) else (r.resource_name, r.configs)
            by_name[name] = {e[0]: e[1] for e in entries}
    return [by_name.get(n, {}) for n in names]


def topic_configs(admin, names: list[str]) -> dict[str, dict[str, str]] | None:
    """Configs of existing topics ``names``; None when the broker does not answer DescribeConfigs."""
    from kafka.admin import ConfigResource, ConfigResourceType

    if not names:
        return {}
    try:
        res = admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, n) for n in names])
        return dict(zip(names, parse_describe_configs(res, names)))
    except Exception:  # Tansu 0.6.0 answers no DescribeConfigs
        return None


def describe_topics(config: Config, names: list[str]) -> dict[str, TopicState]:
    """State of each existing topic of ``names`` (physical names); missing ones are left out.

    Raises:
        kafka-python's connection errors when the broker does not answer.
    """
    admin = admin_client(config)
    try:
        existing = set(admin.list_topics())
        present = [n for n in names if n in existing]
        counts = partition_counts(admin, present) if present else {}
        configs = topic_configs(admin, [n for n in present if n in counts]) or {}
    finally:
        admin.close()
    return {n: TopicState(n, c, configs.get(n, {}).get("cleanup.policy")) for n, c in counts.items()}


def create_topics(admin, topics: list[tuple[str, int, int, dict[str, str]]], timeout_ms: int = 30_000) -> None:
    """Create ``(name, partitions, replication_factor, configs)`` topics; one that another
    client created meanwhile is no error. Raises whatever else the broker answers."""
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    try:
        admin.create_topics([NewTopic(n, p, rf, topic_configs=c) for n, p, rf, c in topics], timeout_ms=timeout_ms)
    except TopicAlreadyExistsError:
        pass  # raced with another applier


def metadata_answers(bootstrap: str, timeout_ms: int = 2000) -> bool:
    """True when a metadata request (list topics) to ``bootstrap`` succeeds within ``timeout_ms``."""
    from kafka import KafkaAdminClient

    try:
        admin = KafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=timeout_ms)
    except Exception:
        return False
    try:
        admin.list_topics()
        return True
    except Exception:
        return False
    finally:
        admin.close()
