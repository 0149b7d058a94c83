"""One command line for every stage: ``python -m pipeline <command> ...`` (or ``pipeline ...``).

Each command lives in its own module and is imported only when it runs, so ``pipeline broker``
never pays for importing torch. A command module exposes::

    HELP: str                                  # one line for ``pipeline --help``
    def add_arguments(parser) -> None          # its own flags
    def run(args, config) -> int | None        # the work; the exit status

Every command also takes ``--config FILE`` (YAML) and ``--set section.key=value`` overrides on
top of environment variables (``PIPELINE_<SECTION>__<KEY>``); see :mod:`pipeline.config`.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

#: command name -> (module path, one-line help). Modules are imported lazily.
COMMANDS: dict[str, tuple[str, str]] = {
    "config": ("pipeline.config_cli", "show the effective configuration (YAML + env + flags)"),
    "broker": ("pipeline.broker", "run a local broker: Apache Kafka (when installed) or the embedded Tansu"),
    "topics": ("pipeline.topics_cli", "apply / list / render the topics of topics.yaml"),
    "engine": ("pipeline.engine.cli", "CPU inference server speaking SGLang's HTTP API"),
    "proxy": ("pipeline.proxy.cli", "OpenAI-compatible proxy that records every turn on Kafka"),
    "judge": ("pipeline.judge.cli", "pair turns with next states and emit scored samples"),
    "trainer": ("pipeline.trainer.cli", "Megatron-core policy updates from sample batches"),
    "syncer": ("pipeline.syncer", "apply published weights to one engine replica"),
    "evaluator": ("pipeline.evaluator.cli", "decide canaries (promote/rollback) and run the eval set per version"),
    "adapters": ("pipeline.trainer.adapters_cli", "freeze / unfreeze / reset / delete / export a tenant's LoRA adapter"),
    "up": ("pipeline.orchestrate.up", "start broker, engine, proxy, judge, trainer and syncer"),
    "front": ("pipeline.orchestrate.front", "round-robin HTTP load balancer in front of replicas"),
    "simulate": ("pipeline.simulate.cli", "simulated users (GSM8K, MT-Bench) talking to the proxy"),
    "demo": ("pipeline.orchestrate.demo", "the main job: up + simulate until K steps, then report"),
    "archive": ("pipeline.history.archive", "write the turns topic to local JSONL files"),
    "replay": ("pipeline.history.replay", "re-feed archived or historical turns to a topic"),
    "import": ("pipeline.history.importer", "load OpenAI-format conversation JSONL as turns"),
    "retrain": ("pipeline.history.retrain", "offline retraining: archive or topic range -> replay -> judge -> trainer"),
    "dashboard": ("pipeline.dashboard.cli", "live web dashboard and conversation browser"),
    "tail": ("pipeline.dashboard.tail", "print a topic's events decoded (no consumer group, no commit)"),
    "clean": ("pipeline.orchestrate.clean", "remove a finished run's folder (checkpoints, weights, broker data)"),
    "connect": ("pipeline.connect", "write the running stack's proxy into an agent's config (openclaw)"),
}


def _top_parser() -> argparse.ArgumentParser:
    lines = "\n".join(f"  {name:<10} {help_}" for name, (_, help_) in COMMANDS.items())
    p = argparse.ArgumentParser(
        prog="pipeline",
        description="Online RL pipeline: every chat turn becomes a Kafka event, a judge scores it, "
        "a Megatron-core trainer learns from it and syncs weights back to the engine.",
        epilog=f"commands:\n{lines}\n\nRun 'pipeline <command> --help' for a command's flags.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("command", nargs="?", help="one of the commands below")
    return p


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags every command takes: config file, overrides, bootstrap servers, log level."""
    g = parser.add_argument_group("common")
    g.add_argument("--config", metavar="FILE", help="YAML config file (default: $PIPELINE_CONFIG)")
    g.add_argument(
        "--set", metavar="KEY=VALUE", action="append", default=[], dest="overrides",
        help="override one config value, e.g. --set judge.votes=5 (repeatable)",
    )
    g.add_argument("--bootstrap", metavar="HOST:PORT", help="Kafka bootstrap servers (kafka.bootstrap_servers)")
    g.add_argument("--log-level", default=None, help="DEBUG, INFO (default), WARNING, ERROR")


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m pipeline`` and the ``pipeline`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        return 0
    name = argv[0]
    if name not in COMMANDS:
        top.error(f"unknown command {name!r}; choose from: {', '.join(COMMANDS)}")
    module_path, help_ = COMMANDS[name]
    try:
        module = importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        if e.name and module_path.startswith(e.name):
            print(f"pipeline: command {name!r} is not available in this build ({e})", file=sys.stderr)
            return 2
        raise
    parser = argparse.ArgumentParser(prog=f"pipeline {name}", description=getattr(module, "HELP", help_))
    module.add_arguments(parser)
    add_common_arguments(parser)
    args = parser.parse_args(argv[1:])

    from pipeline.config import ConfigError, load_config

    try:
        config = load_config(args.config, overrides=args.overrides, bootstrap=args.bootstrap)
    except ConfigError as e:
        print(f"pipeline: configuration error: {e}", file=sys.stderr)
        return 2
    from pipeline.stack import NoStack, resolve

    try:  # no broker address given: the running `pipeline up` stack's, or one clear line
        config = resolve(name, args, config)
    except NoStack as e:
        print(f"pipeline {name}: {e}", file=sys.stderr)
        return 1
    level = (args.log_level or config.log_level).upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    if level != "DEBUG":  # kafka-python logs every connection at INFO
        for noisy in ("kafka", "httpx", "httpcore", "matplotlib"):  # chatty at INFO
            logging.getLogger(noisy).setLevel(logging.WARNING)
    from pipeline.bus.settings import explain_kafka_client_logs

    explain_kafka_client_logs()
    rc = _check_topics(name, config, args)
    if rc:
        return rc
    try:
        rc = module.run(args, config)
    except KeyboardInterrupt:
        return 130
    except ConfigError as e:  # a flag that makes the configuration invalid
        print(f"pipeline {name}: configuration error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a broker that never answers is a clear one-line error, not a traceback
        from pipeline.bus.admin import is_unreachable

        if is_unreachable(e):
            print(f"pipeline {name}: cannot reach the Kafka broker at {config.kafka.bootstrap_servers} "
                  f"({type(e).__name__}: {e}); start one with 'pipeline broker' or set --bootstrap",
                  file=sys.stderr)
            return 1
        raise
    return int(rc or 0)


def _check_topics(name: str, config, args) -> int:
    """Before a stage runs: its topics exist with topics.yaml's shape (:func:`pipeline.bus.admin.ensure_topics`).

    0 to go on; 2 (after a message naming the fix) when a topic has the wrong shape or is missing
    and may not be created. A broker that does not accept connections is left to the stage (the
    proxy buffers, the others report it): checked again at its next start.
    """
    from pipeline.stack import COMMANDS as TALKS_TO_BROKER
    from pipeline.topics import STAGE_TOPICS, TopicsError

    if name not in STAGE_TOPICS or (name in TALKS_TO_BROKER and not TALKS_TO_BROKER[name](args)):
        return 0  # not a stage, or an offline mode of one (judge --fit / --eval)
    from pipeline.bus.admin import broker_reachable, ensure_topics

    if not broker_reachable(config):
        logging.getLogger(__name__).warning("topics not checked: the broker at %s does not answer",
                                            config.kafka.bootstrap_servers)
        return 0
    try:
        ensure_topics(config, STAGE_TOPICS[name])
    except TopicsError as e:
        print(f"pipeline {name}: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # the broker accepted the connection but did not answer: left to the stage
        logging.getLogger(__name__).warning("topics not checked: %s: %s", type(e).__name__, e)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
