"""The engine's prefix cache: same log-probs and tokens as without it, bounded, never stale.

Two real engines (tiny-random, fp32, in this process) get the same requests, one with the prefix
cache and one without (``prefix_cache_bytes=0``); every answer must match to 1e-5 on log-probs and
exactly on tokens, while the cached engine reports the reused tokens in ``meta_info.cached_tokens``.
"""

from __future__ import annotations

import asyncio
import random
import re

import httpx
import pytest
import torch

from pipeline.engine_api.client import EngineClient
from pipeline.engine.prefix_cache import PrefixCache, common_prefix
from pipeline.testing.engine import running_engine

TOL = 1e-5


def _ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 49000) for _ in range(n)]


PREFIX = _ids(300, 1)  # the "system prompt and tools" every request starts with


# ---- the store itself (no model) --------------------------------------------------------------
class _Layer:
    def __init__(self, n: int, fill: float) -> None:
        self.keys = torch.full((1, 2, n + 5, 4), fill)  # spare capacity past n, as the engine's buffers
        self.values = torch.full((1, 2, n + 5, 4), -fill)


def _layers(n: int, fill: float = 1.0) -> list[_Layer]:
    return [_Layer(n, fill), _Layer(n, fill + 1)]


BYTES_PER_TOKEN = 2 * 2 * (2 * 4) * 4  # layers * (keys + values) * heads * dim * fp32


def test_common_prefix():
    t = torch.tensor
    assert common_prefix(t([1, 2, 3]), t([1, 2, 4])) == 2
    assert common_prefix(t([1, 2, 3]), t([1, 2])) == 2
    assert common_prefix(t([5]), t([1, 2])) == 0


def test_match_longest_prefix_and_copies_exact_positions():
    pc = PrefixCache(1 << 20, 8, min_tokens=4)
    a, b = list(range(100, 120)), list(range(100, 110)) + list(range(300, 320))
    assert pc.insert(a, _layers(20, 1.0)) and pc.insert(b, _layers(30, 5.0))
    n, e = pc.match(list(range(100, 115)) + [7, 7], limit=100)
    assert n == 15 and e.ids.tolist() == a and e.keys[0].shape == (1, 2, 20, 4)
    assert float(e.keys[1][0, 0, 0, 0]) == 2.0 and float(e.values[0][0, 0, 0, 0]) == -1.0
    n, e = pc.match(b + [1], limit=100)
    assert n == 30 and e.ids.tolist() == b
    assert pc.match(b, limit=12)[0] == 12  # never past the first position whose logits are needed
    assert pc.match(list(range(100, 103)) + [0] * 10, limit=100) == (0, None)  # shorter than min_tokens
    assert pc.stats.hits == 3 and pc.stats.reused_tokens == 15 + 30 + 12 and pc.stats.lookups == 4


def test_insert_replaces_covered_prefix_and_skips_covered_prompt():
    pc = PrefixCache(1 << 20, 8, min_tokens=4)
    turn1 = list(range(50))
    turn2 = turn1 + list(range(900, 920))
    assert pc.insert(turn1, _layers(50))
    assert pc.insert(turn2, _layers(70))  # the conversation grew: one entry, the longer one
    assert len(pc) == 1 and pc.nbytes == 70 * BYTES_PER_TOKEN
    assert not pc.insert(turn1, _layers(50))  # already covered by turn2's entry
    assert len(pc) == 1 and pc.stats.inserted == 2


def test_bounds_evict_least_recently_used():
    pc = PrefixCache(3 * 20 * BYTES_PER_TOKEN, 8, min_tokens=4)
    p = [[k * 1000 + i for i in range(20)] for k in range(4)]
    for ids in p[:3]:
        assert pc.insert(ids, _layers(20))
    assert pc.match(p[0], 20)[0] == 20  # p[0] is now the most recently used
    assert pc.insert(p[3], _layers(20))  # over the byte bound: p[1] (LRU) goes
    assert pc.nbytes <= pc.max_bytes and len(pc) == 3 and pc.stats.evicted == 1
    assert pc.match(p[1], 20) == (0, None) and pc.match(p[0], 20)[0] == 20
    assert not pc.insert(list(range(10**6, 10**6 + 400)), _layers(400))  # alone larger than the bound
    by_count = PrefixCache(1 << 20, 2, min_tokens=4)
    for ids in p:
        by_count.insert(ids, _layers(20))
    assert len(by_count) == 2 and by_count.match(p[0], 20) == (0, None)


def test_disabled_and_clear():
    off = PrefixCache(0, 8)
    assert not off.enabled and not off.insert(list(range(40)), _layers(40))
    assert off.match(list(range(40)), 40) == (0, None)
    assert off.stats.lookups == 0
    pc = PrefixCache(1 << 20, 8, min_tokens=4)
    pc.insert(list(range(40)), _layers(40))
    assert pc.clear() == 1 and len(pc) == 0 and pc.nbytes == 0
    assert pc.match(list(range(40)), 40) == (0, None)


# ---- real engines, with and without the cache ----------------------------------------------------
@pytest.fixture(scope="module")
def urls():
    with running_engine("tiny-random", threads=2, max_batch_size=8) as cached, \
            running_engine("tiny-random", threads=2, max_batch_size=8, prefix_cache_bytes=0) as plain:
        yield cached, plain


def _lps(entries: list) -> list[float | None]:
    return [e[0] for e in entries]


def _close(a: list, b: list) -> float:
    assert len(a) == len(b) and [x is None for x in a] == [y is None for y in b]
    return max([abs(x - y) for x, y in zip(a, b) if x is not None] or [0.0])


async def _both(urls, fn):
    async with EngineClient(urls[0], 120) as c, EngineClient(urls[1], 120) as p:
        return await fn(c), await fn(p)


def test_scoring_passes_equal_without_cache(urls):
    """OPD-teacher-style scoring (max_new_tokens=0, logprob_start_len): first a pass that stores
    the prefix, then passes that reuse it, each with the same log-probs as a full prefill."""
    seqs = [(PREFIX + _ids(40, 2), 300), (PREFIX + _ids(25, 3), 310), (PREFIX[:200] + _ids(30, 4), 150),
            (PREFIX + _ids(60, 5), 0), (PREFIX + _ids(40, 2)[:30] + _ids(9, 6), 305)]

    async def run(c):
        outs = []
        for ids, start in seqs:
            outs.append(await c.generate(ids, sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                         logprob_start_len=start))
        return outs

    cached, plain = asyncio.run(_both(urls, run))
    for (ids, start), a, b in zip(seqs, cached, plain):
        assert _close(_lps(a["meta_info"]["input_token_logprobs"]), _lps(b["meta_info"]["input_token_logprobs"])) <= TOL
        assert b["meta_info"]["cached_tokens"] == 0
    reused = [o["meta_info"]["cached_tokens"] for o in cached]
    # 2: the 300 shared tokens; 3: 200 shared, capped at its start 150 (the first position whose
    # logits it needs); 4: none (start 0 needs every position); 5: 330 shared, capped at 305
    assert reused == [0, 300, 150, 0, 305]


def test_batched_generation_equal_without_cache(urls):
    """Concurrent sampled requests with different shared-prefix lengths (continuous batching):
    the same tokens and log-probs with and without the cache.

    Rows sample from the top 8 (or greedily): tiny-random's next-token distribution is nearly
    uniform over 49k ids, so a full-vocabulary draw can land between two ids whose cumulative
    probabilities differ by 1e-6, the size of fp32 rounding between a one-piece and a two-piece
    prefill; the full-vocabulary case is checked against a scoring pass instead (below)."""
    prompts = [PREFIX + _ids(5 + 7 * i, 10 + i) for i in range(5)] + [PREFIX[:120 + 40 * i] + _ids(6, 20 + i)
                                                                     for i in range(3)]

    def params(i: int) -> dict:
        return {"max_new_tokens": 12 + i, "ignore_eos": True, "temperature": 0.0 if i % 4 == 3 else 0.9,
                "top_k": 8, "sampling_seed": 100 + i}

    async def run(c):
        await c.generate(PREFIX + [7], sampling_params={"max_new_tokens": 1})  # stores the prefix
        return await asyncio.gather(*(
            c.generate(ids, sampling_params=params(i), return_logprob=True,
                       logprob_start_len=len(ids) - 4 if i % 3 == 0 else None)
            for i, ids in enumerate(prompts)))

    cached, plain = asyncio.run(_both(urls, run))
    for a, b in zip(cached, plain):
        assert a["output_ids"] == b["output_ids"]
        ma, mb = a["meta_info"], b["meta_info"]
        assert _close(_lps(ma["output_token_logprobs"]), _lps(mb["output_token_logprobs"])) <= TOL
        assert _close(_lps(ma["input_token_logprobs"]), _lps(mb["input_token_logprobs"])) <= TOL
    assert all(o["meta_info"]["cached_tokens"] >= 120 for o in cached)
    assert all(o["meta_info"]["cached_tokens"] == 0 for o in plain)


def test_full_vocabulary_sampling_matches_scoring_without_cache(urls):
    """Full-vocabulary sampling on cached prefixes: each sampled token's log-prob equals a
    cache-less scoring pass of the same prompt + output (what the trainer recomputes)."""
    prompts = [PREFIX + _ids(9 + 5 * i, 50 + i) for i in range(4)]

    async def main():
        async with EngineClient(urls[0], 120) as c, EngineClient(urls[1], 120) as p:
            await c.generate(PREFIX + [8], sampling_params={"max_new_tokens": 1})
            outs = await asyncio.gather(*(c.generate(ids, sampling_params={"max_new_tokens": 10, "ignore_eos": True,
                                                                           "temperature": 1.0}, return_logprob=True)
                                          for ids in prompts))
            scores = [await p.score(ids + o["output_ids"], len(ids)) for ids, o in zip(prompts, outs)]
            return outs, scores

    outs, scores = asyncio.run(main())
    for o, s in zip(outs, scores):
        assert o["meta_info"]["cached_tokens"] >= 300
        assert _close(_lps(o["meta_info"]["output_token_logprobs"]), s) <= TOL


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_metrics_flush_and_chat_usage(urls):
    cached_url = urls[0]
    ids = PREFIX + _ids(20, 30)

    async def main():
        async with EngineClient(cached_url, 60) as c:
            before = httpx.get(cached_url + "/metrics").text
            first = await c.generate(ids, sampling_params={"max_new_tokens": 2})
            second = await c.generate(ids + [5, 6], sampling_params={"max_new_tokens": 2})
            after = httpx.get(cached_url + "/metrics").text
            info = (await c.server_info(refresh=True))["internal_states"][0]["prefix_cache"]
            flushed = httpx.post(cached_url + "/flush_cache")
            third = await c.generate(ids + [5, 6], sampling_params={"max_new_tokens": 2})
            return before, first, second, after, info, flushed, third

    before, first, second, after, info, flushed, third = asyncio.run(main())
    n = second["meta_info"]["cached_tokens"]
    assert n == len(ids)  # the first request's whole prompt
    name = "pipeline_engine_prefix_cache_"
    delta = {k: _metric(after, name + k) - _metric(before, name + k)
             for k in ("lookups_total", "hits_total", "reused_tokens_total")}
    assert delta["lookups_total"] == 2 and delta["hits_total"] >= 1
    assert delta["reused_tokens_total"] == first["meta_info"]["cached_tokens"] + n
    assert _metric(after, "pipeline_engine_prefix_cache_entries") >= 1
    assert info["enabled"] and info["entries"] >= 1 and 0 < info["bytes"] <= info["max_bytes"]
    assert flushed.status_code == 200 and "entries dropped" in flushed.text
    assert third["meta_info"]["cached_tokens"] == 0


def test_weight_update_never_reuses_stale_kv(perturbed_dir):
    """After /update_weights_from_disk the prefix computed by the old weights is not used: the
    cached engine's answers equal a cache-less engine's on the new weights."""
    prompt = PREFIX + _ids(30, 40)

    async def run(c):
        await c.generate(prompt, sampling_params={"max_new_tokens": 0}, return_logprob=True, logprob_start_len=300)
        warm = await c.generate(prompt + [9], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                logprob_start_len=300)
        assert (await c.update_weights_from_disk(str(perturbed_dir)))["success"]
        score = await c.generate(prompt + [9, 10], sampling_params={"max_new_tokens": 0}, return_logprob=True,
                                 logprob_start_len=300)
        gen = await c.generate(prompt + [11], sampling_params={"max_new_tokens": 6, "ignore_eos": True,
                                                               "sampling_seed": 3}, return_logprob=True)
        return warm, score, gen

    with running_engine("tiny-random", threads=2) as a, running_engine("tiny-random", threads=2,
                                                                       prefix_cache_bytes=0) as b:
        (warm, score, gen), (_, score_b, gen_b) = asyncio.run(_both((a, b), run))
    assert warm["meta_info"]["cached_tokens"] == 300  # the cache was in use before the update
    assert score["meta_info"]["weight_version"] == "1"
    assert _close(_lps(score["meta_info"]["input_token_logprobs"]),
                  _lps(score_b["meta_info"]["input_token_logprobs"])) <= TOL
    assert score["meta_info"]["cached_tokens"] == 0
    assert gen["meta_info"]["cached_tokens"] == 330  # the new weights' own KV, stored by the pass above
    assert gen["output_ids"] == gen_b["output_ids"]
    assert _close(_lps(gen["meta_info"]["output_token_logprobs"]),
                  _lps(gen_b["meta_info"]["output_token_logprobs"])) <= TOL


@pytest.mark.slow
def test_smollm2_conversation_equal_without_cache():
    """SmolLM2-135M-Instruct (fp32), a two-turn agent conversation rendered by the chat template:
    the OPD-style scoring pass, turn 1 and two concurrent turn-2 requests (different prefix
    lengths) give the same tokens and log-probs (1e-5) with and without the prefix cache."""
    from pipeline.engine_api.render import ChatRenderer
    from pipeline.engine.model import load_tokenizer
    from pipeline.models import resolve_model

    render = ChatRenderer(load_tokenizer(resolve_model("smollm2-135m"))).render_ids
    system = {"role": "system", "content": "You are a careful assistant with these tools:\n" + "\n".join(
        f"- tool_{k}: reads record {k} of the user's calendar and returns it as JSON" for k in range(24))}
    turn1 = [system, {"role": "user", "content": "What is on my calendar tomorrow?"}]
    sp = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 5}

    async def run(c):
        first = await c.generate(render(turn1), sampling_params=sp, return_logprob=True)
        scored = await c.generate(render(turn1) + first["output_ids"], sampling_params={"max_new_tokens": 0},
                                  return_logprob=True, logprob_start_len=len(render(turn1)))
        turn2 = [turn1[0], turn1[1], {"role": "assistant", "content": first["text"]}]
        prompts = [render(turn2 + [{"role": "user", "content": "Move the first meeting to Friday."}]),
                   render([system, {"role": "user", "content": "Cancel everything."}])]
        second = await asyncio.gather(*(c.generate(ids, sampling_params=dict(sp, sampling_seed=6 + i),
                                                   return_logprob=True, logprob_start_len=len(ids) - 3)
                                        for i, ids in enumerate(prompts)))
        return [first, scored, *second]

    with running_engine("smollm2-135m", threads=2, max_batch_size=4) as a, \
            running_engine("smollm2-135m", threads=2, max_batch_size=4, prefix_cache_bytes=0) as b:
        cached, plain = asyncio.run(_both((a, b), run))
    for x, y in zip(cached, plain):
        assert x["output_ids"] == y["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs"):
            assert _close(_lps(x["meta_info"][key]), _lps(y["meta_info"][key])) <= TOL
    assert [o["meta_info"]["cached_tokens"] > 0 for o in cached] == [False, True, True, True]
