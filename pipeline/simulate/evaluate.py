"""Held-out evaluation of one policy version, straight against the ENGINE (not the proxy).

Evaluation must not produce training data, so requests go to the engine's OpenAI chat endpoint
without session headers and never pass the proxy (which would publish them as turns). All
prompts are sent at once (bounded by ``concurrency``) so the engine decodes them as a batch.

Metrics, per reply (single-turn, no feedback):
- ``success_rate``: the feedback policy's success (default ``brevity``: at most ``max_words``
  words and ``max_reply_tokens`` tokens, or a correct final number) — the reward's target;
- ``brief_rate``: the brevity property alone (9% for the base model, docs/environment.md §7);
- ``stepwise_rate``: the *steps* property alone (at least 4 lines holding a word; the second
  tenant's preference in the two-tenant demo, docs/tenants.md);
- ``accuracy``: GSM8K final number right — the guard metric (with ``words_per_reply``) that
  shows reward hacking (short nonsense) next to the reward.
"""

from __future__ import annotations

import asyncio
import random
from statistics import fmean
from typing import Sequence

from pipeline.engine_api.errors import EngineError
from pipeline.simulate.client import ChatClient
from pipeline.simulate.datasets import GSM8KProblem, load_gsm8k
from pipeline.simulate.feedback import decide
from pipeline.simulate.grading import grade_reply


async def evaluate_async(engine_url: str, prompts: Sequence[GSM8KProblem] | None = None, max_tokens: int = 96, *,
                         temperature: float = 1.0, max_words: int = 40, max_reply_tokens: int = 64,
                         feedback: str = "brevity", samples_per_prompt: int = 1, concurrency: int = 32,
                         model: str = "default", api_key: str | None = None, system_prompt: str | None = None,
                         timeout_s: float = 600.0, seed: int | None = None) -> dict:
    """Evaluate the engine at ``engine_url`` on ``prompts`` (default: the 32 held-out GSM8K problems).

    Returns ``{n, success_rate, brief_rate, stepwise_rate, accuracy, words_per_reply, completion_tokens,
    policy_versions, errors}`` (rates in [0, 1]; ``n`` = replies received; ``policy_versions`` =
    the distinct weight versions reported by the engine, normally one).

    Raises:
        EngineError: every request failed (e.g. the engine is down).
    """
    problems = list(prompts) if prompts is not None else load_gsm8k("heldout")
    sem = asyncio.Semaphore(max(1, concurrency))
    client = ChatClient(engine_url, model=model, api_key=api_key, timeout_s=timeout_s,
                        max_connections=max(8, concurrency))

    async def one(p: GSM8KProblem, k: int):
        msgs = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
            {"role": "user", "content": p.question}]
        # a fixed seed per (prompt, sample): every policy version is scored on the same random
        # numbers (common random numbers), so differences between versions are less noisy
        extra = {"seed": seed + k} if seed is not None else None
        async with sem:
            try:
                return p, await client.chat(msgs, max_tokens=max_tokens, temperature=temperature, extra=extra)
            except EngineError as e:
                return p, e

    try:
        results = await asyncio.gather(*(one(p, i * samples_per_prompt + j) for i, p in enumerate(problems)
                                         for j in range(samples_per_prompt)))
    finally:
        await client.aclose()
    rng = random.Random(0)
    succ, brief, stepwise, correct, words, toks, versions, errors = [], [], [], [], [], [], set(), []
    for p, r in results:
        if isinstance(r, EngineError):
            errors.append(str(r))
            continue
        g = grade_reply(r.content, completion_tokens=r.completion_tokens, finish_reason=r.finish_reason,
                        gold=p.answer.final, max_words=max_words, max_tokens=max_reply_tokens)
        succ.append(decide(feedback, g, p.answer, rng, max_words=max_words).success)
        brief.append(g.brief)
        stepwise.append(g.stepwise)
        correct.append(bool(g.correct))
        words.append(g.words)
        if r.completion_tokens is not None:
            toks.append(r.completion_tokens)
        versions.add(r.policy_version)
    if results and not succ:
        raise EngineError(f"every evaluation request failed: {errors[0]}")

    def mean(xs):
        return round(fmean(xs), 4) if xs else None

    return {"n": len(succ), "success_rate": mean(succ), "brief_rate": mean(brief), "stepwise_rate": mean(stepwise),
            "accuracy": mean(correct),
            "words_per_reply": mean(words), "completion_tokens": mean(toks),
            "policy_versions": sorted(versions, key=str), "errors": len(errors)}


def evaluate(engine_url: str, prompts: Sequence[GSM8KProblem] | None = None, max_tokens: int = 96, **kw) -> dict:
    """Synchronous wrapper of :func:`evaluate_async` (do not call from a running event loop)."""
    return asyncio.run(evaluate_async(engine_url, prompts, max_tokens, **kw))
