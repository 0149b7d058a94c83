"""``pipeline topics``: apply (create missing, report drift), list or render the topics of topics.yaml.

``pipeline topics apply`` creates missing topics with their partitions, replication factor and
configs, and reports drift (partition count; configs where the broker supports DescribeConfigs)
for existing ones without changing them (:func:`pipeline.bus.admin.apply_topics`). ``list``
shows each declared topic next to its partition count on the broker. ``render --format strimzi``
writes Strimzi ``KafkaTopic`` resources, ``--format kafka-cli`` the ``kafka-topics.sh`` commands
the compose topic job runs, ``--format json`` the normalised specs (:func:`pipeline.topics.render`,
no broker).
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.bus.admin import apply_topics, existing_partition_counts
from pipeline.config import Config
from pipeline.topics import TopicSpec, TopicsError, load_topics, render

HELP = "Apply (create missing, report drift), list or render the topics of topics.yaml."


def add_arguments(parser) -> None:
    """The flags of ``pipeline topics``."""
    parser.add_argument("action", choices=["apply", "list", "render"])
    parser.add_argument("--file", help="topics file (default: topics.file from config)")
    parser.add_argument("--format", default="strimzi", choices=["strimzi", "kafka-cli", "json"], help="for render")
    parser.add_argument("--cluster", default="pipeline", help="Strimzi cluster label (render)")
    parser.add_argument("--replication-factor", type=int, help="override every topic's replication factor")
    parser.add_argument("--output", "-o", help="write render output to this file instead of stdout")


def _list(config: Config, specs: list[TopicSpec]) -> None:
    """Print one line per declared topic: partitions and replication factor in topics.yaml, the
    partition count on the broker (or MISSING), the event types. Raises when the broker does not answer."""
    counts = existing_partition_counts(config, [config.topics.name(s.name) for s in specs])
    print(f"{'topic':<24} {'partitions':>10} {'rf':>3}  {'on broker':<12} values")
    for s in specs:
        phys = config.topics.name(s.name)
        state = f"{counts[phys]} partitions" if phys in counts else "MISSING"
        print(f"{phys:<24} {s.partitions:>10} {s.replication_factor:>3}  {state:<12} {','.join(s.values)}")


def run(args, config: Config) -> int:
    """Run ``pipeline topics ACTION``. Returns 0; 2 for an invalid topics.yaml or a refused
    creation; 1 when the broker cannot be reached (one line on stderr, no traceback)."""
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
        _list(config, specs)
        return 0
    except TopicsError as e:
        print(f"pipeline topics: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # broker unreachable etc.: a clear message, not a traceback
        print(f"pipeline topics: cannot reach the broker at {config.kafka.bootstrap_servers}: {e}", file=sys.stderr)
        return 1
