"""Engine benchmark: generation tokens/s and the latency of scoring a 512-token sequence.

    .venv/bin/python bench/engine.py                      # both models
    .venv/bin/python bench/engine.py --models tiny-random --tokens 32 --concurrency 8

For each model it starts the real engine (in this process, uvicorn on a free port), talks to it
over HTTP with :class:`pipeline.client.EngineClient`, and measures in the same run:

- ``gen 1``: one request, ``--tokens`` new tokens (ignore_eos) -> tokens/s;
- ``gen N``: ``--concurrency`` requests at once (continuous batching) -> aggregate tokens/s;
- ``score 512``: ``/generate`` prefill-only scoring of 512 tokens (median latency, ms);
- baselines, outside the server: HF ``model.generate`` for one request and a plain HF forward
  for the 512-token scoring, on the same weights and threads.
It prints ratios against those baselines; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.client import EngineClient  # noqa: E402
from tests.support.engine import running_engine  # noqa: E402


def _prompt(n: int) -> list[int]:
    base = [1, 4093, 198, 504, 3893, 253, 1789, 2030, 28, 2, 198, 1, 520, 9531, 198]
    return (base * (n // len(base) + 1))[:n]


async def _engine_numbers(url: str, tokens: int, concurrency: int, score_len: int, repeats: int) -> dict:
    sp = {"max_new_tokens": tokens, "ignore_eos": True, "temperature": 1.0}
    async with EngineClient(url, 600) as c:
        await c.generate(_prompt(20), sampling_params=dict(sp, max_new_tokens=4))  # warm-up
        t = time.perf_counter()
        out = await c.generate(_prompt(40), sampling_params=sp)
        single = len(out["output_ids"]) / (time.perf_counter() - t)
        t = time.perf_counter()
        outs = await asyncio.gather(*(c.generate(_prompt(30 + 7 * i), sampling_params=sp)
                                      for i in range(concurrency)))
        batched = sum(len(o["output_ids"]) for o in outs) / (time.perf_counter() - t)
        seq = _prompt(score_len)
        await c.score(seq, score_len // 2)
        lat = []
        for _ in range(repeats):
            t = time.perf_counter()
            lps = await c.score(seq, score_len // 2)
            lat.append(time.perf_counter() - t)
        assert len(lps) == score_len - score_len // 2
    return {"single": single, "batched": batched, "score_ms": 1000 * statistics.median(lat)}


def _hf_baseline(model_name: str, tokens: int, score_len: int, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.models import resolve_model

    path = resolve_model(model_name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        x = torch.tensor([_prompt(40)])
        model.generate(x, max_new_tokens=4, do_sample=True, pad_token_id=2)
        t = time.perf_counter()
        out = model.generate(x, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True, top_k=None,
                             top_p=None, pad_token_id=2)
        gen = (out.shape[1] - x.shape[1]) / (time.perf_counter() - t)
        seq = torch.tensor([_prompt(score_len)])
        model(seq)
        lat = []
        for _ in range(repeats):
            t = time.perf_counter()
            logits = model(seq).logits[0, :-1].float()
            torch.log_softmax(logits, -1).gather(-1, seq[0, 1:, None])
            lat.append(time.perf_counter() - t)
    return {"gen": gen, "score_ms": 1000 * statistics.median(lat)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny-random", "smollm2-135m"])
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--score-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    args = ap.parse_args(argv)
    rows = []
    for name in args.models:
        with running_engine(name, threads=args.threads, max_batch_size=args.concurrency) as url:
            eng = asyncio.run(_engine_numbers(url, args.tokens, args.concurrency, args.score_len, args.repeats))
        base = _hf_baseline(name, args.tokens, args.score_len, args.repeats)
        rows.append((name, eng, base))
        print(f"{name}: gen 1 = {eng['single']:.1f} tok/s, gen {args.concurrency} = {eng['batched']:.1f} tok/s "
              f"({eng['batched'] / eng['single']:.1f}x single), HF generate = {base['gen']:.1f} tok/s "
              f"(engine single {eng['single'] / base['gen']:.2f}x); score {args.score_len} tokens = "
              f"{eng['score_ms']:.0f} ms over HTTP (HF forward {base['score_ms']:.0f} ms)", flush=True)
    print()
    print(f"| model | gen 1 req (tok/s) | gen {args.concurrency} concurrent (tok/s) | batch speed-up | "
          f"HF generate (tok/s) | score {args.score_len} tok (ms) | HF forward (ms) |")
    print("|---|---|---|---|---|---|---|")
    for name, eng, base in rows:
        print(f"| {name} | {eng['single']:.1f} | {eng['batched']:.1f} | {eng['batched'] / eng['single']:.1f}x | "
              f"{base['gen']:.1f} | {eng['score_ms']:.0f} | {base['score_ms']:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
