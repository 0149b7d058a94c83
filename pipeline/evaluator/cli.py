"""``python -m pipeline evaluator``: the decider and the eval runner (:mod:`pipeline.evaluator`).

Typical::

    pipeline evaluator --bootstrap 127.0.0.1:9092 --set rollout.enabled=true \\
        [--engine http://127.0.0.1:30000] [--eval-set evals/team.jsonl]

Exits 2 when ``rollout.enabled`` is false (nothing to decide) or the eval set is bad; otherwise
runs until SIGTERM/SIGINT. Metrics on ``metrics_port`` (``pipeline_evaluator_*``).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from pipeline.config import Config, ConfigError
from pipeline.errors import PipelineError

HELP = "decide canaries (promote/rollback on control) and run the eval set on every new version"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--engine URL``, ``--eval-set FILE``."""
    parser.add_argument("--engine", dest="engine_url", help="engine the eval set runs against (engine.url)")
    parser.add_argument("--eval-set", help="eval set JSONL (rollout.eval_set; none: live reward only)")


def run(args: argparse.Namespace, config: Config) -> int:
    """Start :class:`pipeline.evaluator.Evaluator` and wait for a signal."""
    from pipeline.evaluator import Evaluator

    try:
        ev = Evaluator(config, engine_url=args.engine_url, eval_set=args.eval_set)
    except ConfigError as e:
        print(f"pipeline evaluator: {e}", file=sys.stderr)
        return 2
    except (PipelineError, ValueError) as e:  # a bad eval set
        print(f"pipeline evaluator: eval set: {e}", file=sys.stderr)
        return 2
    from pipeline.metrics import serve_metrics

    serve_metrics(config.metrics_port)
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: ev.stop.set())
    ev.start()
    try:
        while not ev.stop.wait(1.0):
            pass
    finally:
        ev.close()
    return 0
