"""``python -m pipeline simulate``: simulated GSM8K / MT-Bench users talking to the proxy.

Examples::

    pipeline simulate --dataset gsm8k --sessions 16 --log runs/sim.jsonl
    pipeline simulate --dataset mt_bench --sessions 8 --proxy-url http://127.0.0.1:8000
    pipeline simulate --evaluate --engine-url http://127.0.0.1:30000   # held-out 32, no training data

Prints a progress bar, then one JSON summary line on stdout (sessions, requests, success rate,
mean words per reply, GSM8K accuracy, and the same per policy version). SIGTERM/SIGINT cancel
the sessions in flight and still print the summary (exit 0); ``--log`` has every reply so far.
"""

from __future__ import annotations

import asyncio
import signal
import sys

import orjson

from pipeline.engine_api.errors import EngineError

HELP = "Simulated users (GSM8K feedback loop, MT-Bench two-turn) talking to the proxy; or --evaluate the engine."


def add_arguments(parser) -> None:
    from pipeline.simulate.feedback import POLICIES
    from pipeline.simulate.runner import DATASETS

    parser.add_argument("--dataset", choices=DATASETS, default="gsm8k", help="which users (default gsm8k)")
    parser.add_argument("--sessions", type=int, default=16, help="number of sessions (default 16)")
    parser.add_argument("--proxy-url", help="proxy base URL (default http://<proxy.host>:<proxy.port>)")
    parser.add_argument("--model", help="the request's model field (default engine.served_model_name or 'default')")
    parser.add_argument("--concurrency", type=int, default=8, help="sessions in flight at once (default 8)")
    parser.add_argument("--max-tokens", type=int, default=96, help="max_tokens of each request (default 96)")
    parser.add_argument("--closing-max-tokens", type=int, default=16,
                        help="max_tokens of the closing request that carries the last feedback (default 16)")
    parser.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0: on-policy)")
    parser.add_argument("--max-turns", type=int, default=3, help="graded replies per GSM8K session at most (default 3)")
    parser.add_argument("--max-words", type=int, default=40, help="brevity limit in words (default 40)")
    parser.add_argument("--max-reply-tokens", type=int, default=64, help="brevity limit in tokens (default 64)")
    parser.add_argument("--feedback", choices=POLICIES, default="brevity",
                        help="GSM8K feedback policy: brevity (default; learnable at 135M) or correctness")
    parser.add_argument("--thumbs", action="store_true",
                        help="GSM8K users also thumb each graded reply up (+1) or down (-1) through POST /v1/feedback, "
                             "a correction's hint as the comment (explicit feedback: docs/feedback.md)")
    parser.add_argument("--split", choices=("train", "heldout"), default="train", help="GSM8K problems (default train)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="consecutive sessions that ask the same problem (a group of users; default 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the problem choice and messages (default 0)")
    parser.add_argument("--system", dest="system_prompt", help="system prompt of every session (default none)")
    parser.add_argument("--session-prefix", help="session id prefix (default sim-<dataset>-<random>)")
    parser.add_argument("--log", help="append one JSON line per reply to this file")
    parser.add_argument("--api-key", help="bearer token (default: the first of proxy.api_keys, if any)")
    parser.add_argument("--tenant", help="send X-Tenant-Id: TENANT with every request (docs/tenants.md)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--evaluate", action="store_true",
                        help="evaluate the engine on the 32 held-out GSM8K problems instead (no proxy, no training data)")
    parser.add_argument("--engine-url", help="engine base URL for --evaluate (default engine.url)")


def run(args, config) -> int:
    from pipeline.simulate.users import UserSettings

    model = args.model or config.engine.served_model_name or "default"
    if args.sessions < 0 or args.concurrency < 1 or args.max_turns < 1 or args.max_tokens < 1:
        print("pipeline simulate: --sessions >= 0, --concurrency, --max-turns and --max-tokens >= 1", file=sys.stderr)
        return 2
    if args.evaluate:
        from pipeline.simulate.evaluate import evaluate

        try:
            out = evaluate(args.engine_url or config.engine.url, None, args.max_tokens,
                           temperature=args.temperature, max_words=args.max_words,
                           max_reply_tokens=args.max_reply_tokens, feedback=args.feedback, model=model,
                           system_prompt=args.system_prompt, timeout_s=config.engine.request_timeout_s)
        except EngineError as e:
            print(f"pipeline simulate --evaluate: {e}", file=sys.stderr)
            return 1
        print(orjson.dumps(out).decode(), flush=True)
        return 0

    from pipeline.simulate.runner import SimulationPlan, simulate

    api_key = args.api_key
    if api_key is None and config.proxy.api_keys:
        api_key = config.proxy.api_keys[0].get_secret_value()
    url = args.proxy_url or f"http://{config.proxy.host}:{config.proxy.port}"
    plan = SimulationPlan(dataset=args.dataset, sessions=args.sessions, seed=args.seed, concurrency=args.concurrency,
                          split=args.split, session_prefix=args.session_prefix,
                          repeat=args.repeat)
    settings = UserSettings(feedback=args.feedback, max_turns=args.max_turns, max_tokens=args.max_tokens,
                            closing_max_tokens=args.closing_max_tokens, temperature=args.temperature,
                            max_words=args.max_words, max_reply_tokens=args.max_reply_tokens,
                            system_prompt=args.system_prompt, thumbs=args.thumbs)

    async def main() -> dict:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):  # stop cleanly: cancel sessions, print the summary
            loop.add_signal_handler(sig, stop.set)
        return await simulate(url, plan, settings, model=model, api_key=api_key,
                              timeout_s=config.proxy.engine_timeout_s, log_path=args.log,
                              progress=not args.no_progress, stop=stop, tenant=args.tenant)

    summary = asyncio.run(main())
    print(orjson.dumps(summary).decode(), flush=True)
    if summary["sessions"] and summary["sessions_failed"] == summary["sessions"]:
        print(f"pipeline simulate: every session failed, e.g. {summary['errors'][0]}", file=sys.stderr)
        return 1
    return 0
