"""``pipeline judge``: consume ``turns``, pair each main turn with its next state, emit ``samples``.

    python -m pipeline judge --mode rl|opd|combine [--backend llm|choice|embedding|pkg.mod:Class]
    python -m pipeline judge --eval tests/fixtures/judge_next_states.jsonl --backend embedding [--misses]
    python -m pipeline judge --fit          # build (and cache) the backend's models, then exit

Several processes with the same ``judge.group_id`` split the partitions of ``turns``.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time

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
                        help="score a labelled JSONL set of next states and print agreement, coverage (share "
                             "scored non-zero), sign errors (+1 scored -1 or the reverse), the confusion matrix, "
                             "the same per next-state role and category, and the OPD hint path; then exit")
    parser.add_argument("--fit", action="store_true",
                        help="build the backend's models and exit (the embedding backend fine-tunes MiniLM on its "
                             "labelled replies once, about two minutes on two cores, and caches it in "
                             "engine.cache_dir)")
    parser.add_argument("--misses", action="store_true", help="with --eval: list the ids of the rows scored wrong")
    parser.add_argument("--no-hints", action="store_true", help="with --eval: skip the OPD hint path")
    parser.add_argument("--by", action="append", default=[], metavar="FIELD",
                        help="with --eval: also break the figures down by this row field (repeatable, e.g. style)")
    parser.add_argument("--min-agreement", type=float, metavar="SHARE",
                        help="with --eval: exit 1 when agreement is below SHARE (e.g. 0.8)")
    parser.add_argument("--max-sign-errors", type=float, metavar="SHARE",
                        help="with --eval: exit 1 when the share of sign errors is above SHARE (e.g. 0.03)")
    parser.add_argument("--write-conversations", metavar="OUT",
                        help="with --eval: also write the set as labelled conversations for `pipeline import` "
                             "(a judge consuming them reports pipeline_judge_labelled_* metrics)")


def _apply(args, config):
    """``config`` with the judge flags given on the command line (a validated copy)."""
    flags = {name: getattr(args, name, None) for name in ("mode", "backend", "group_id", "url", "votes")}
    return config.replace(judge={k: v for k, v in flags.items() if v is not None})


def _eval(args, config) -> int:
    import orjson

    from pipeline.judge.backends import make_backend
    from pipeline.judge.evaluate import evaluate, load_rows, report, row_conversation

    rows = load_rows(args.eval)
    if not rows:
        print(f"pipeline judge: {args.eval} has no labelled rows: nothing to measure")
        return 2
    for field in args.by:
        if not any(field in row for row in rows):
            print(f"pipeline judge: warning: no row of {args.eval} has the field {field!r} (--by {field})")
    if args.write_conversations:
        with open(args.write_conversations, "wb") as f:
            for row in rows:
                f.write(orjson.dumps(row_conversation(row)) + b"\n")
    backend = make_backend(config.judge.backend, config)

    async def go():
        await backend.start()
        try:
            return await evaluate(backend, rows, concurrency=max(1, min(8, config.judge.max_in_flight)),
                                  hints=not args.no_hints, by=tuple(args.by))
        finally:
            await backend.aclose()

    res, preds = asyncio.run(go())
    print(report(res, rows, preds, misses=args.misses))
    failed = []  # a gate on a figure without data (no rows) fails: nothing was shown to pass
    if args.min_agreement is not None and (res.agreement is None or res.agreement < args.min_agreement):
        failed.append(f"agreement {'n/a' if res.agreement is None else f'{res.agreement:.1%}'} "
                      f"< {args.min_agreement:.1%}")
    if args.max_sign_errors is not None and (res.sign_error_rate is None or res.sign_error_rate > args.max_sign_errors):
        failed.append(f"sign errors {'n/a' if res.sign_error_rate is None else f'{res.sign_error_rate:.1%}'} "
                      f"> {args.max_sign_errors:.1%}")
    if failed:
        print("FAILED: " + "; ".join(failed))
        return 1
    return 0


def _fit(config) -> int:
    from pipeline.judge.backends import make_backend

    t0 = time.monotonic()
    make_backend(config.judge.backend, config)
    built = (f"models cached in {config.engine.cache_dir}" if config.judge.backend == "embedding"
             else "nothing to build ahead for this backend")
    print(f"judge backend {config.judge.backend!r} ready in {time.monotonic() - t0:.0f} s ({built})")
    return 0


def run(args, config) -> int:
    """Run the judge (or ``--eval``). Returns 0, 1 on a fatal delivery error, 2 on bad settings."""
    from pipeline.judge.backends import BackendError
    from pipeline.metrics import serve_metrics

    config = _apply(args, config)  # a bad flag: ConfigError, reported by pipeline.cli
    # The Kafka client's I/O thread gives up the GIL at every socket call and must win it back
    # from the judging threads (CPU-bound Python), which hand it over only every switch
    # interval: at the default 5 ms one I/O step could take 100+ ms of waiting (kafka-python
    # warns "task ... is blocking the event loop"). At 1 ms such steps were 3-4x rarer in a
    # consumer beside a CPU-bound thread (the cost: more GIL hand-overs per second).
    sys.setswitchinterval(0.001)
    try:
        if args.eval and args.fit:
            print("pipeline judge: --fit and --eval are separate steps (--eval builds what it needs)")
            return 2
        if args.eval:
            return _eval(args, config)
        if args.fit:
            return _fit(config)
        from pipeline.judge.app import JudgeApp

        app = JudgeApp(config)
    except (BackendError, ValueError, OSError) as e:
        print(f"pipeline judge: {e}")
        return 2
    serve_metrics(config.metrics_port)
    log.info("judge: mode=%s backend=%s group=%s votes=%d", app.mode, app.judge_name, config.judge.group_id,
             config.judge.votes)
    return app.run()
