"""``pipeline judge``: consume ``turns``, pair each main turn with its next state, emit ``samples``.

    python -m pipeline judge --mode rl|opd|combine [--backend llm|choice|embedding|pkg.mod:Class]
    python -m pipeline judge --eval tests/fixtures/judge_next_states.jsonl --backend embedding

Several processes with the same ``judge.group_id`` split the partitions of ``turns``.
"""

from __future__ import annotations

import asyncio
import logging

HELP = "pair turns with next states and emit scored samples (Binary RL, OPD, combine)"

log = logging.getLogger(__name__)


def add_arguments(parser) -> None:
    """Flags of ``pipeline judge``."""
    parser.add_argument("--mode", choices=("rl", "opd", "combine"), help="judge.mode (default from config: rl)")
    parser.add_argument("--backend", help="judge.backend: llm, choice, embedding, constant or package.module:Class")
    parser.add_argument("--group-id", help="consumer group (judge.group_id)")
    parser.add_argument("--url", help="judge endpoint for llm/choice (judge.url)")
    parser.add_argument("--votes", type=int, help="PRM votes per turn (judge.votes)")
    parser.add_argument("--eval", metavar="FILE",
                        help="print the backend's agreement with a labelled JSONL set of next states and exit")


def _apply(args, config) -> None:
    jc = config.judge
    for flag, attr in (("mode", "mode"), ("backend", "backend"), ("group_id", "group_id"), ("url", "url"),
                       ("votes", "votes")):
        value = getattr(args, flag, None)
        if value is not None:
            setattr(jc, attr, value)


def _eval(path: str, config) -> int:
    from pipeline.judge.backends import make_backend
    from pipeline.judge.evaluate import evaluate, load_rows, report

    rows = load_rows(path)
    backend = make_backend(config.judge.backend, config)

    async def go():
        await backend.start()
        try:
            return await evaluate(backend, rows, concurrency=max(1, min(8, config.judge.max_in_flight)))
        finally:
            await backend.aclose()

    res, preds = asyncio.run(go())
    print(report(res, rows, preds))
    return 0


def run(args, config) -> int:
    """Run the judge (or ``--eval``). Returns 0, 1 on a fatal delivery error, 2 on bad settings."""
    from pipeline.judge.backends import BackendError
    from pipeline.metrics import serve_metrics

    try:
        _apply(args, config)
    except ValueError as e:  # pydantic validation of an assignment
        print(f"pipeline judge: {e}")
        return 2
    try:
        if args.eval:
            return _eval(args.eval, config)
        from pipeline.judge.app import JudgeApp

        app = JudgeApp(config)
    except (BackendError, ValueError, FileNotFoundError) as e:
        print(f"pipeline judge: {e}")
        return 2
    serve_metrics(config.metrics_port)
    log.info("judge: mode=%s backend=%s group=%s votes=%d", app.mode, app.judge_name, config.judge.group_id,
             config.judge.votes)
    return app.run()
