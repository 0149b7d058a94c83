"""topics.yaml: load, apply to a broker (idempotent, with drift report), list and render.

``pipeline topics apply`` creates missing topics with their partitions, replication factor and
configs, and reports drift (partition count; configs where the broker supports DescribeConfigs)
for existing ones without changing them. ``pipeline topics render --format strimzi`` writes
Strimzi ``KafkaTopic`` resources, ``--format kafka-cli`` the ``kafka-topics.sh`` commands the
compose topic job runs, ``--format json`` the normalised specs.
"""

from __future__ import annotations

import json
import logging
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from pipeline.config import Config
from pipeline.events import EVENT_TYPES
from pipeline.errors import PipelineError

log = logging.getLogger(__name__)
HELP = "Apply (create missing, report drift), list or render the topics of topics.yaml."


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


def _admin(config: Config):
    from pipeline.bus.admin import admin_client

    return admin_client(config)


def _partition_counts(admin, names: list[str]) -> dict[str, int]:
    from pipeline.bus.admin import partition_counts

    return partition_counts(admin, names)


def apply_topics(config: Config, specs: list[TopicSpec], replication_factor: int | None = None) -> ApplyReport:
    """Create the missing topics (physical names with ``topics.prefix``); report drift.

    Existing topics are never altered: a differing partition count or config is reported as
    drift. Raises :class:`TopicsError` when the broker refuses a creation.
    """
    from pipeline.bus.admin import create_topics

    report = ApplyReport()
    admin = _admin(config)
    try:
        existing = set(admin.list_topics())
        missing = [s for s in specs if config.topics.name(s.name) not in existing]
        if missing:
            new = [(config.topics.name(s.name), s.partitions, replication_factor or s.replication_factor, s.config)
                   for s in missing]
            try:
                create_topics(admin, new)
            except Exception as e:
                raise TopicsError(f"broker refused to create topics: {e}") from e
            report.created = [config.topics.name(s.name) for s in missing]
        present = [s for s in specs if s not in missing]
        counts = _partition_counts(admin, [config.topics.name(s.name) for s in present]) if present else {}
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
    from pipeline.bus.admin import topic_configs

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


#: the logical topics each stage command reads or writes (DLQs included); observers (dashboard,
#: tail) write nothing and are not listed. Checked by :func:`ensure_topics` before the stage runs.
STAGE_TOPICS: dict[str, tuple[str, ...]] = {
    "proxy": ("turns", "control", "control.dlq"),
    "judge": ("turns", "samples", "turns.dlq"),
    "trainer": ("samples", "control", "metrics", "samples.dlq", "control.dlq"),
    "syncer": ("control", "control.dlq"),
    "archive": ("turns", "turns.dlq"),
    "replay": ("turns",),
    "import": ("turns",),
}
#: topics whose contract fixes the partition count whatever topics.yaml says (total order)
SINGLE_PARTITION = ("control",)


def _apply_command(config: Config) -> str:
    cmd = "pipeline topics apply"
    if config.topics.prefix:
        cmd += f" --set topics.prefix={config.topics.prefix}"
    return cmd + f" --bootstrap {config.kafka.bootstrap_servers}"


def _shape_problems(config: Config, specs: list[TopicSpec], states: dict) -> list[str]:
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


def ensure_topics(config: Config, logical: tuple[str, ...] | list[str]) -> list[str]:
    """Check that the topics ``logical`` exist on the broker with the shape topics.yaml declares
    (partition count, ``cleanup.policy`` where the broker answers DescribeConfigs, ``control``
    exactly one partition); create the missing ones from topics.yaml when
    ``topics.create_missing`` allows. Topics never come from a broker's auto-creation.

    Returns the physical names created. Raises :class:`TopicsError` with the fix (a topic of
    the wrong shape: recreate it or change topics.yaml; missing topics and creation not
    allowed or refused: the ``pipeline topics apply`` command to run).
    """
    from pipeline.bus.admin import describe_topics

    declared = {s.name: s for s in load_topics(config.topics.file)}
    unknown = [n for n in logical if n not in declared]
    if unknown:
        raise TopicsError(f"{config.topics.file} declares no topic {', '.join(unknown)}")
    specs = [declared[n] for n in logical]
    states = describe_topics(config, [config.topics.name(s.name) for s in specs])
    problems = _shape_problems(config, specs, states)
    if problems:
        raise TopicsError("; ".join(problems) + ". Refusing to start: a topic of another shape breaks the contract "
                          "(docs/consuming.md). Delete and recreate it with '" + _apply_command(config)
                          + "', or use another topics.prefix")
    missing = [s for s in specs if config.topics.name(s.name) not in states]
    if not missing:
        return []
    names = ", ".join(config.topics.name(s.name) for s in missing)
    if not config.topics.create_missing:
        raise TopicsError(f"missing topics {names} (topics.create_missing is off). Refusing to start: create them "
                          f"with '{_apply_command(config)}'")
    try:
        created = apply_topics(config, missing).created
    except TopicsError as e:
        raise TopicsError(f"missing topics {names} and {e}. Refusing to start: create them with "
                          f"'{_apply_command(config)}'") from e
    log.info("created missing topics from %s: %s", config.topics.file, ", ".join(created))
    return created


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


def add_arguments(parser) -> None:
    parser.add_argument("action", choices=["apply", "list", "render"])
    parser.add_argument("--file", help="topics file (default: topics.file from config)")
    parser.add_argument("--format", default="strimzi", choices=["strimzi", "kafka-cli", "json"], help="for render")
    parser.add_argument("--cluster", default="pipeline", help="Strimzi cluster label (render)")
    parser.add_argument("--replication-factor", type=int, help="override every topic's replication factor")
    parser.add_argument("--output", "-o", help="write render output to this file instead of stdout")


def run(args, config: Config) -> int:
    try:
        specs = load_topics(args.file or config.topics.file)
        if args.action == "render":
            text = render(specs, args.format, config.topics.prefix, args.cluster, args.replication_factor)
            if args.output:
                Path(args.output).write_text(text)
            else:
                sys.stdout.write(text)
            return 0
        if args.action == "apply":
            for line in apply_topics(config, specs, args.replication_factor).lines():
                print(line)
            return 0
        admin = _admin(config)
        try:
            existing = set(admin.list_topics())
            counts = _partition_counts(admin, [config.topics.name(s.name) for s in specs
                                               if config.topics.name(s.name) in existing])
        finally:
            admin.close()
        print(f"{'topic':<24} {'partitions':>10} {'rf':>3}  {'on broker':<12} values")
        for s in specs:
            phys = config.topics.name(s.name)
            state = f"{counts[phys]} partitions" if phys in counts else "MISSING"
            print(f"{phys:<24} {s.partitions:>10} {s.replication_factor:>3}  {state:<12} {','.join(s.values)}")
        return 0
    except TopicsError as e:
        print(f"pipeline topics: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # broker unreachable etc.: a clear message, not a traceback
        print(f"pipeline topics: cannot reach the broker at {config.kafka.bootstrap_servers}: {e}", file=sys.stderr)
        return 1
