"""Kafka admin operations (kafka-python's ``KafkaAdminClient``): the one home of topic creation
and inspection, and the one place that constructs an admin client. The contract the topics are
checked against is :mod:`pipeline.topics` (pure, no broker calls).

- :func:`admin_client`: a client with :func:`pipeline.bus.settings.admin_kwargs`.
- :func:`apply_topics`: create the missing topics of topics.yaml, report drift (:class:`ApplyReport`).
- :func:`ensure_topics`: a stage's topics exist with topics.yaml's shape (created when allowed).
- :func:`create_topic_if_missing`: one topic (replay targets, dead-letter topics).
- :func:`existing_partition_counts`: partition count of each existing topic (``pipeline topics list``).
- :func:`group_lag`: consumer-group lag per topic (the dashboard).
- :func:`is_unreachable`: whether an exception means the broker did not answer.
- :func:`broker_reachable`: a TCP probe of the first bootstrap server (no Kafka client, no wait).
- :func:`describe_topics`: partition count and ``cleanup.policy`` of existing topics.
- :func:`topic_configs`: the configs of topics (None where the broker does not answer
  DescribeConfigs: Tansu 0.6.0).
- :func:`create_topics`: create topics, a concurrent creation of the same ones being no error.
- :func:`metadata_answers`: one metadata request to a bootstrap address (a readiness probe).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass, field
from typing import Any

from pipeline.config import Config
from pipeline.topics import TopicSpec, TopicsError, apply_command, load_topics, shape_problems

log = logging.getLogger(__name__)


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


def create_topic_if_missing(config: Config, name: str, partitions: int, replication_factor: int,
                            configs: dict[str, str], what: str = "topic") -> bool:
    """Create topic ``name`` (physical) with ``partitions``, ``replication_factor`` and ``configs``
    unless the broker has it. True when created; False when it existed (or another client
    created it meanwhile).

    Raises:
        pipeline.topics.TopicsError: the broker refused the creation
            ("broker refused to create ``what`` ``name``: ...").
        kafka.errors.KafkaError: the broker could not be reached.
    """
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = admin_client(config)
    try:
        if name in set(admin.list_topics()):
            return False
        try:
            admin.create_topics([NewTopic(name, partitions, replication_factor, topic_configs=configs)],
                                timeout_ms=30_000)
        except TopicAlreadyExistsError:
            return False
        except Exception as e:
            if is_unreachable(e):  # not a refusal: the CLI's "cannot reach the Kafka broker" line
                raise
            raise TopicsError(f"broker refused to create {what} {name}: {e}") from e
        return True
    finally:
        admin.close()


def existing_partition_counts(config: Config, names: list[str]) -> dict[str, int]:
    """Partition count of each of ``names`` (physical) that exists on the broker; missing ones are
    left out. Raises kafka-python's connection errors when the broker does not answer."""
    admin = admin_client(config)
    try:
        existing = set(admin.list_topics())
        return partition_counts(admin, [n for n in names if n in existing])
    finally:
        admin.close()


@dataclass
class ApplyReport:
    """What :func:`apply_topics` did: created, unchanged and drifted topics, and notes."""

    created: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    drift: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        """Human-readable summary, one line each."""
        out = [f"created   {n}" for n in self.created] + [f"exists    {n}" for n in self.unchanged]
        out += [f"DRIFT     {d}" for d in self.drift] + [f"note      {n}" for n in self.notes]
        if not self.created:
            out.append("nothing to create: every topic already exists" + (" (with drift, see above)" if self.drift else ""))
        return out


def apply_topics(config: Config, specs: list[TopicSpec], replication_factor: int | None = None) -> ApplyReport:
    """Create the missing topics of ``specs`` (physical names with ``topics.prefix``; every one with
    ``replication_factor`` when given, else its own); report drift.

    Existing topics are never altered: a differing partition count or config is reported as
    drift. Raises :class:`pipeline.topics.TopicsError` when the broker refuses a creation,
    kafka-python's connection errors when it does not answer.
    """
    report = ApplyReport()
    admin = admin_client(config)
    try:
        existing = set(admin.list_topics())
        missing = [s for s in specs if config.topics.name(s.name) not in existing]
        if missing:
            new = [(config.topics.name(s.name), s.partitions, replication_factor or s.replication_factor, s.config)
                   for s in missing]
            try:
                create_topics(admin, new)
            except Exception as e:
                if is_unreachable(e):  # not a refusal: the CLI's "cannot reach the Kafka broker" line
                    raise
                raise TopicsError(f"broker refused to create topics: {e}") from e
            report.created = [config.topics.name(s.name) for s in missing]
        present = [s for s in specs if s not in missing]
        counts = partition_counts(admin, [config.topics.name(s.name) for s in present]) if present else {}
        for s in present:
            phys = config.topics.name(s.name)
            have = counts.get(phys)
            if have is not None and have != s.partitions:
                report.drift.append(f"{phys}: {have} partitions on the broker, {s.partitions} in topics.yaml")
            else:
                report.unchanged.append(phys)
        if present:
            _config_drift(admin, config, present, report)
    finally:
        admin.close()
    return report


def _config_drift(admin, config: Config, specs: list[TopicSpec], report: ApplyReport) -> None:
    """Add to ``report`` each config of ``specs`` the broker has with another value (or a note
    when the broker does not answer DescribeConfigs)."""
    configs = topic_configs(admin, [config.topics.name(s.name) for s in specs])
    if configs is None:  # Tansu does not implement DescribeConfigs (docs/environment.md §6)
        report.notes.append("config drift not checked: the broker does not answer DescribeConfigs")
        return
    for s in specs:
        r = configs.get(config.topics.name(s.name), {})
        for k, want in s.config.items():
            have = r.get(k)
            if have is not None and str(have) != want:
                report.drift.append(f"{config.topics.name(s.name)}: {k}={have} on the broker, {want} in topics.yaml")


def ensure_topics(config: Config, logical: tuple[str, ...] | list[str]) -> list[str]:
    """Check that the topics ``logical`` exist on the broker with the shape topics.yaml declares
    (:func:`pipeline.topics.shape_problems`: partition count, ``cleanup.policy`` where the broker
    answers DescribeConfigs, ``control`` exactly one partition); create the missing ones from
    topics.yaml when ``topics.create_missing`` allows. Topics never come from a broker's
    auto-creation.

    Returns the physical names created. Raises :class:`pipeline.topics.TopicsError` with the fix
    (a topic of the wrong shape: recreate it or change topics.yaml; missing topics and creation
    not allowed or refused: the ``pipeline topics apply`` command to run).
    """
    declared = {s.name: s for s in load_topics(config.topics.file)}
    unknown = [n for n in logical if n not in declared]
    if unknown:
        raise TopicsError(f"{config.topics.file} declares no topic {', '.join(unknown)}")
    specs = [declared[n] for n in logical]
    states = describe_topics(config, [config.topics.name(s.name) for s in specs])
    problems = shape_problems(config, specs, states)
    if problems:
        raise TopicsError("; ".join(problems) + ". Refusing to start: a topic of another shape breaks the contract "
                          "(docs/consuming.md). Delete and recreate it with '" + apply_command(config)
                          + "', or use another topics.prefix")
    missing = [s for s in specs if config.topics.name(s.name) not in states]
    if not missing:
        return []
    names = ", ".join(config.topics.name(s.name) for s in missing)
    if not config.topics.create_missing:
        raise TopicsError(f"missing topics {names} (topics.create_missing is off). Refusing to start: create them "
                          f"with '{apply_command(config)}'")
    try:
        created = apply_topics(config, missing).created
    except TopicsError as e:
        raise TopicsError(f"missing topics {names} and {e}. Refusing to start: create them with "
                          f"'{apply_command(config)}'") from e
    log.info("created missing topics from %s: %s", config.topics.file, ", ".join(created))
    return created


def _group_id(listed: Any) -> str:
    """The id of one ``KafkaAdminClient.list_groups()`` entry (a dict in kafka-python 3, a tuple before)."""
    if isinstance(listed, dict):
        return str(listed.get("group_id"))
    return str(listed[0] if isinstance(listed, (tuple, list)) else listed)


def group_lag(admin, high_watermarks: dict[tuple[str, int], int]) -> list[dict]:
    """Lag of every consumer group on the topics of ``high_watermarks`` (``{(topic, partition):
    end offset}``): ``[{"group", "topic", "lag"}]`` in records, summed over partitions, sorted by
    group then topic; partitions a group never committed are left out.

    Raises whatever ``admin`` raises (a broker without ListGroups / OffsetFetch).
    """
    groups = [_group_id(g) for g in admin.list_groups()]
    out = []
    topics = {t for t, _ in high_watermarks}
    for g in sorted(set(groups)):
        offsets = admin.list_group_offsets({g: None}).get(g, {})
        per_topic: dict[str, int] = {}
        for tp, om in offsets.items():
            key = (tp.topic, tp.partition)
            if tp.topic in topics and key in high_watermarks and om.offset >= 0:
                per_topic[tp.topic] = per_topic.get(tp.topic, 0) + max(0, high_watermarks[key] - om.offset)
        for topic, n in sorted(per_topic.items()):
            out.append({"group": g, "topic": topic, "lag": n})
    return out


def is_unreachable(e: BaseException) -> bool:
    """True when ``e`` is kafka-python's way of saying the broker did not answer (broker not
    available, connection refused, time-out)."""
    from kafka.errors import BrokerNotAvailableError, KafkaConnectionError, KafkaTimeoutError

    return isinstance(e, (BrokerNotAvailableError, KafkaConnectionError, KafkaTimeoutError))


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
