"""LoRA serving benchmark: throughput and time to first token with 1, 4 and 16 adapters active vs
the base model alone, same load, one engine, one run.

    .venv/bin/python bench/lora_serving.py                                  # tiny-random
    .venv/bin/python bench/lora_serving.py --model smollm2-135m --tokens 16 --concurrency 8

It starts the real CPU engine (in this process, LoRA on, prefix cache off so every prompt is
prefilled), writes ``max(--adapters)`` random rank-``--rank`` adapters on all seven projections
(:func:`pipeline.testing.lora.write_random_adapter`) and loads them over HTTP. Each round sends
``--concurrency`` streamed ``/generate`` requests at once (distinct ``--prompt-tokens`` prompts,
``--tokens`` new tokens each, ignore_eos), request ``i`` naming adapter ``i mod k`` (``k = 0``:
none, the base model), and records the aggregate generated tokens/s (all tokens over the wall
time of the round) and each request's time to its first streamed token. Rounds of the
configurations are interleaved ``--repeats`` times (so machine load drifts hit all alike);
medians are printed with each configuration's ratio to the base.

``--step`` adds the cost of the delta itself, outside the server: one batched decode forward
(``--concurrency`` rows, one new token each, a ``--prompt-tokens`` KV cache) of the served model
with this engine's hooks (:mod:`pipeline.engine.lora`) and, for comparison, of the same model
wrapped by PEFT with the same adapters and its mixed-batch forward (``adapter_names=[...]``
per row), each with 0 (base rows only), 1, 4 and 16 adapters among the rows; the fastest of
``--step-repeats`` forwards (min: the least disturbed by other load on a shared machine). Nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.engine_api.client import EngineClient  # noqa: E402
from pipeline.engine.lora import LoraSettings  # noqa: E402
from pipeline.testing.engine import running_engine  # noqa: E402
from pipeline.testing.lora import write_random_adapter  # noqa: E402


def _prompt(n: int, shift: int) -> list[int]:
    base = [1, 4093, 198, 504, 3893, 253, 1789, 2030, 28, 2, 198, 1, 520, 9531, 198]
    return [shift % 400 + 600] + (base * (n // len(base) + 1))[:n - 1]


async def _one(c: EngineClient, ids: list[int], tokens: int, lora: str | None) -> tuple[float, int]:
    """(seconds to the first streamed token, tokens generated) of one streamed request."""
    t, first, last = time.perf_counter(), None, None
    extra = {"lora_path": lora} if lora is not None else {}
    async for ev in c.generate_stream(ids, sampling_params={"max_new_tokens": tokens, "ignore_eos": True}, **extra):
        if first is None and ev["output_ids"]:
            first = time.perf_counter() - t
        last = ev
    return first, len(last["output_ids"])


async def _round(c: EngineClient, k: int, args) -> tuple[float, list[float]]:
    """(aggregate tokens/s, TTFTs in ms) of one round with ``k`` adapters (0: the base)."""
    t = time.perf_counter()
    outs = await asyncio.gather(*(_one(c, _prompt(args.prompt_tokens, i + 37 * k), args.tokens,
                                       f"a{i % k}" if k else None) for i in range(args.concurrency)))
    wall = time.perf_counter() - t
    return sum(n for _, n in outs) / wall, [1000 * f for f, _ in outs]


async def _measure(url: str, folders: list[Path], args) -> dict[int, dict[str, list[float]]]:
    res: dict[int, dict[str, list[float]]] = {k: {"tps": [], "ttft": []} for k in [0] + args.adapters}
    async with EngineClient(url, 3600) as c:
        for i, f in enumerate(folders):
            await c.load_lora_adapter(f"a{i}", str(f))
        await _round(c, max(args.adapters), args)  # warm-up
        for _ in range(args.repeats):
            for k in res:
                tps, ttft = await _round(c, k, args)
                res[k]["tps"].append(tps)
                res[k]["ttft"].extend(ttft)
    return res


def _decoder(model, rows: int, ctx: int, **kw):
    """A function that runs one more ``[rows, 1]`` decode forward of ``model`` on its own KV cache
    (prefilled with ``ctx`` tokens) and returns its milliseconds."""
    import torch
    from transformers import DynamicCache

    ids = torch.tensor([_prompt(ctx, i) for i in range(rows)])
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(input_ids=ids, cache=cache, use_cache=True, **kw)
    step = [ctx]

    def run() -> float:
        with torch.inference_mode():
            t = time.perf_counter()
            model(input_ids=ids[:, -1:], cache=cache, use_cache=True, position_ids=torch.full((rows, 1), step[0]),
                  **kw)
            step[0] += 1
            return 1000 * (time.perf_counter() - t)

    return run


def _step_numbers(args, folders: list[Path]) -> dict[str, dict[int, float]]:
    """{"ours" | "peft": {k adapters among the rows: fastest decode-step ms}}: every configuration
    has its own model copy and KV cache, and the repeats go round all of them in turn (so a burst
    of load on the shared machine hits every configuration alike)."""
    import copy

    import torch

    from pipeline.engine.lora import LoraPlan, install, read_adapter
    from pipeline.engine.model import load_model
    from pipeline.models import resolve_model

    torch.set_num_threads(args.threads)
    plain = load_model(resolve_model(args.model)).model
    targets, B, ks = LoraSettings().targets, args.concurrency, [0] + args.adapters
    linears = install(copy.deepcopy(plain), LoraPlan(), targets)
    adapters = [read_adapter(f"a{i}", f, linears, max_rank=args.rank, targets=targets) for i, f in enumerate(folders)]
    runners = {}
    for k in ks:
        model, plan = copy.deepcopy(plain), LoraPlan()
        install(model, plan, targets)
        plan.set([adapters[i % k] if k else None for i in range(B)])
        runners[("ours", k)] = _decoder(model, B, args.prompt_tokens)
    try:
        from peft import PeftModel

        peft = PeftModel.from_pretrained(copy.deepcopy(plain), str(folders[0]), adapter_name="a0").eval()
        for i, f in enumerate(folders[1:], 1):
            peft.load_adapter(str(f), adapter_name=f"a{i}")
        for k in ks:
            names = [f"a{i % k}" if k else "__base__" for i in range(B)]
            runners[("peft", k)] = _decoder(peft, B, args.prompt_tokens, adapter_names=names)
    except ImportError:
        pass
    times: dict = {key: [] for key in runners}
    for _ in range(args.step_repeats):
        for key, run in runners.items():
            times[key].append(run())
    out: dict[str, dict[int, float]] = {}
    for (impl, k), v in times.items():
        out.setdefault(impl, {})[k] = min(v)  # the cost least disturbed by other load
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--adapters", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--step", action="store_true", help="also time one decode forward: ours vs PEFT's")
    ap.add_argument("--only-step", action="store_true", help="time only the decode forward (no server)")
    ap.add_argument("--step-repeats", type=int, default=20)
    args = ap.parse_args(argv)
    n = max(args.adapters)
    with tempfile.TemporaryDirectory() as tmp:
        folders = [write_random_adapter(Path(tmp) / f"a{i}", args.model, r=args.rank, alpha=2.0 * args.rank, seed=i)
                   for i in range(n)]
        res = {} if args.only_step else _serve(args, folders)
        steps = _step_numbers(args, folders) if args.step or args.only_step else {}
    if res:
        _serving_table(args, res)
    if steps:
        _step_table(args, steps)
    return 0


def _serve(args, folders: list[Path]) -> dict[int, dict[str, list[float]]]:
    n = max(args.adapters)
    lora = LoraSettings(enabled=True, max_rank=args.rank, max_per_batch=n + 1)
    with running_engine(args.model, threads=args.threads, max_batch_size=args.concurrency, lora=lora,
                        prefix_cache_bytes=0, context_length=args.prompt_tokens + args.tokens + 8) as url:
        return asyncio.run(_measure(url, folders, args))


def _serving_table(args, res: dict[int, dict[str, list[float]]]) -> None:
    base_tps = statistics.median(res[0]["tps"])
    base_ttft = statistics.median(res[0]["ttft"])
    print(f"model {args.model}, rank {args.rank}, {args.concurrency} concurrent requests x {args.tokens} tokens "
          f"({args.prompt_tokens}-token prompts), {args.repeats} rounds each, {args.threads} threads")
    print("| adapters active | tokens/s (median) | vs base | TTFT median (ms) | TTFT p90 (ms) | TTFT vs base |")
    print("|---|---|---|---|---|---|")
    for k, r in res.items():
        tps, ttft = statistics.median(r["tps"]), statistics.median(r["ttft"])
        p90 = statistics.quantiles(r["ttft"], n=10)[-1]
        print(f"| {k or 'base only'} | {tps:.0f} | {tps / base_tps:.2f} | {ttft:.0f} | {p90:.0f} | "
              f"{ttft / base_ttft:.2f} |")


def _step_table(args, steps: dict[str, dict[int, float]]) -> None:
    if steps:
        print(f"\none decode forward, {args.concurrency} rows, {args.prompt_tokens}-token cache (fastest of "
              f"{args.step_repeats}; ratio to the same implementation's base-only rows)")
        print("| adapters among the rows | " + " | ".join(f"{n} ms | {n} vs base" for n in steps) + " |")
        print("|---|" + "---|---|" * len(steps))
        for k in [0] + args.adapters:
            print(f"| {k or 'base only'} | " + " | ".join(f"{v[k]:.1f} | {v[k] / v[0]:.2f}" for v in steps.values())
                  + " |")


if __name__ == "__main__":
    sys.exit(main())
