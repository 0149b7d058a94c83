"""topics.yaml, the topic contract: load and validate it, check a broker's view against it, render it.

A pure module: no Kafka client, no broker calls, no import of :mod:`pipeline.bus`. Creating,
applying (with drift report) and inspecting topics on a broker is :mod:`pipeline.bus.admin`;
the ``pipeline topics`` command is :mod:`pipeline.topics_cli`. :func:`render` writes Strimzi
``KafkaTopic`` resources (``strimzi``), the ``kafka-topics.sh`` commands the compose topic job
runs (``kafka-cli``) or the normalised specs (``json``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from pipeline.config import Config
from pipeline.events import EVENT_TYPES
from pipeline.errors import PipelineError


class TopicsError(PipelineError, ValueError):
    """topics.yaml is unreadable or invalid, or the broker refused an operation."""


@dataclass
class TopicSpec:
    """One topic as declared in topics.yaml (``name`` is logical; see ``topics.prefix``)."""

    name: str
    partitions: int
    replication_factor: int
    key: str
    values: list[str]
    config: dict[str, str] = field(default_factory=dict)
    description: str = ""


def load_topics(path: str | Path) -> list[TopicSpec]:
    """Parse and validate topics.yaml. Raises :class:`TopicsError` naming the bad entry."""
    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise TopicsError(f"cannot read {path}: {e}") from e
    if not isinstance(data, dict) or not isinstance(data.get("topics"), dict):
        raise TopicsError(f"{path}: expected a mapping with a 'topics' mapping")
    specs = []
    for name, t in data["topics"].items():
        if not isinstance(t, dict):
            raise TopicsError(f"{path}: topic {name!r} must be a mapping")
        try:
            spec = TopicSpec(
                name=str(name), partitions=int(t["partitions"]), replication_factor=int(t["replication_factor"]),
                key=str(t.get("key", "")), values=[str(v) for v in t.get("values", [])],
                config={str(k): str(v) for k, v in (t.get("config") or {}).items()},
                description=" ".join(str(t.get("description", "")).split()),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise TopicsError(f"{path}: topic {name!r}: missing or invalid {e}") from e
        if spec.partitions < 1 or spec.replication_factor < 1:
            raise TopicsError(f"{path}: topic {name!r}: partitions and replication_factor must be >= 1")
        unknown = [v for v in spec.values if v not in EVENT_TYPES]
        if unknown:
            raise TopicsError(f"{path}: topic {name!r}: unknown event types {unknown}")
        specs.append(spec)
    return specs


#: the logical topics each stage command reads or writes (DLQs included); observers (dashboard,
#: tail) write nothing and are not listed. Checked by :func:`pipeline.bus.admin.ensure_topics`
#: before the stage runs.
STAGE_TOPICS: dict[str, tuple[str, ...]] = {
    "proxy": ("turns", "control", "control.dlq"),
    "judge": ("turns", "samples", "turns.dlq"),
    "trainer": ("samples", "control", "metrics", "samples.dlq", "control.dlq"),
    "syncer": ("control", "control.dlq"),
    "evaluator": ("control", "metrics", "samples", "turns", "control.dlq", "metrics.dlq", "samples.dlq", "turns.dlq"),
    "archive": ("turns", "turns.dlq"),
    "replay": ("turns",),
    "import": ("turns",),
}
#: topics whose contract fixes the partition count whatever topics.yaml says (total order)
SINGLE_PARTITION = ("control",)


def apply_command(config: Config) -> str:
    """The ``pipeline topics apply`` command line that creates ``config``'s topics (prefix and
    bootstrap included): the fix an error message names. No errors."""
    cmd = "pipeline topics apply"
    if config.topics.prefix:
        cmd += f" --set topics.prefix={config.topics.prefix}"
    return cmd + f" --bootstrap {config.kafka.bootstrap_servers}"


def shape_problems(config: Config, specs: list[TopicSpec], states: dict) -> list[str]:
    """How the broker's topics differ from ``specs``: one sentence per problem, [] when none.

    ``states`` maps physical names to the broker's view of each existing topic (anything with
    ``partitions`` and ``cleanup_policy``, None when unknown: :class:`pipeline.bus.admin.TopicState`);
    missing topics are no problem here. ``control`` must have exactly one partition whatever the
    broker says. No broker calls, no errors.
    """
    problems = []
    for s in specs:
        phys = config.topics.name(s.name)
        if s.name in SINGLE_PARTITION and s.partitions != 1:
            problems.append(f"topics.yaml declares {s.partitions} partitions for {s.name!r}; it needs exactly one "
                            "(one total order of weight-sync epochs)")
        st = states.get(phys)
        if st is None:
            continue
        if st.partitions != s.partitions:
            problems.append(f"topic {phys!r} has {st.partitions} partitions on the broker, topics.yaml declares "
                            f"{s.partitions}")
        want = s.config.get("cleanup.policy")
        if want and st.cleanup_policy is not None and st.cleanup_policy != want:
            problems.append(f"topic {phys!r} has cleanup.policy={st.cleanup_policy} on the broker, topics.yaml "
                            f"declares {want}")
    return problems


def render(specs: list[TopicSpec], fmt: str, prefix: str = "", cluster: str = "pipeline",
           replication_factor: int | None = None) -> str:
    """Render specs as ``strimzi`` (KafkaTopic YAML), ``kafka-cli`` (shell) or ``json``."""
    if fmt == "json":
        return json.dumps([asdict(s) | {"name": prefix + s.name} for s in specs], indent=2)
    if fmt == "strimzi":
        docs = []
        for s in specs:
            docs.append({
                "apiVersion": "kafka.strimzi.io/v1beta2", "kind": "KafkaTopic",
                "metadata": {"name": (prefix + s.name).replace(".", "-").replace("_", "-").lower(),
                             "labels": {"strimzi.io/cluster": cluster},
                             "annotations": {"pipeline/description": s.description, "pipeline/key": s.key,
                                             "pipeline/values": ",".join(s.values)}},
                "spec": {"topicName": prefix + s.name, "partitions": s.partitions,
                         "replicas": replication_factor or s.replication_factor, "config": dict(s.config)},
            })
        return yaml.safe_dump_all(docs, sort_keys=False)
    if fmt == "kafka-cli":
        lines = ["#!/bin/sh", "# Generated from topics.yaml by `pipeline topics render --format kafka-cli`.",
                 'set -eu', 'BS="${BOOTSTRAP:-kafka:9092}"', 'KT="${KAFKA_TOPICS:-/opt/kafka/bin/kafka-topics.sh}"']
        for s in specs:
            cfg = " ".join(f"--config {k}={v}" for k, v in s.config.items())
            lines.append(f'"$KT" --bootstrap-server "$BS" --create --if-not-exists --topic {prefix + s.name} '
                         f"--partitions {s.partitions} --replication-factor {replication_factor or s.replication_factor} {cfg}")
        return "\n".join(lines) + "\n"
    raise TopicsError(f"unknown render format {fmt!r} (strimzi, kafka-cli, json)")
