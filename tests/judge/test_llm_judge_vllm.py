"""The method's own judge (the ``llm`` backend: m = 3 sampled PRM votes, majority, and the hint
path) pointed at a real vLLM serving SmolLM2-135M-Instruct (issue 38).

SmolLM2-135M is a weak judge (docs/judge.md gives its figures): what is tested is the path. Every
vote is a real vLLM answer; the backend's verdict must be the reference's majority of the votes it
parsed (``tests/reference_method.py``), a vote that vLLM answered without a box is a failed vote
(None), never a 0, and the evaluation over labelled rows runs to its figures.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline.config import load_config
from pipeline.judge.backends.llm import LLMBackend
from pipeline.judge.evaluate import evaluate, load_rows
from pipeline.judge.prompts import JudgeInput
from pipeline.judge.parse import parse_score
from pipeline.testing.vllm import require_vllm, running_vllm
from tests import reference_method as ref

pytestmark = pytest.mark.slow
ROWS = "pipeline/judge/data/tools_everyday_next_states.jsonl"


@pytest.fixture(scope="module")
def judge_url():
    require_vllm()
    with running_vllm("smollm2-135m", enable_lora=False, max_model_len=4096) as url:
        yield url


def _backend(url: str, **judge):
    cfg = load_config(None, judge={"backend": "llm", "url": url, "model": "smollm2-135m", "votes": 3,
                                   "max_tokens": 48, "retries": 0, "vote_timeout_s": 120, **judge})
    return LLMBackend(cfg)


def test_votes_are_real_answers_and_the_verdict_is_their_majority(judge_url):
    inputs = [JudgeInput("What is 2 + 2?", "2 + 2 = 4.", [{"role": "user", "content": "Thanks, that's right!"}]),
              JudgeInput("List the files.", "ls", [{"role": "tool", "content": "bash: ls: command not found"}]),
              JudgeInput("Translate 'cat' to French.", "chat", [{"role": "user", "content": "No, that's wrong."}])]
    backend = _backend(judge_url)
    seen: list = []

    async def go():
        await backend.start()
        real = backend.http._sample  # one vote's request (the HTTP judge client the backend uses)

        async def recording(body):  # what vLLM answered, as the backend received it
            text = await real(body)
            seen.append(text)
            return text

        backend.http._sample = recording
        try:
            return [await backend.score(i) for i in inputs], [await backend.hint(i) for i in inputs]
        finally:
            await backend.aclose()

    verdicts, hints = asyncio.run(go())
    assert len(seen) == 2 * 3 * len(inputs) and all(t is not None for t in seen)  # every call answered
    for v in verdicts:
        assert len(v.votes) == 3 and all(x in (1, 0, -1, None) for x in v.votes)
        assert v.score == ref.majority_vote(v.votes)
    # the three votes run concurrently, so they finish in any order: compare as multisets
    # (an unboxed answer is a failed vote, None, never a 0)
    assert sorted(map(repr, (parse_score(t) for t in seen[:3]))) == sorted(map(repr, verdicts[0].votes))
    for h in hints:
        assert len(h.votes) == 3
        assert h.hint is None or isinstance(h.hint, str)


def test_labelled_rows_run_to_their_figures(judge_url):
    rows = load_rows(ROWS)[:6]
    backend = _backend(judge_url)

    async def go():
        await backend.start()
        try:
            return await evaluate(backend, rows, concurrency=4, hints=True)
        finally:
            await backend.aclose()

    agreement, preds = asyncio.run(go())
    assert set(preds) == {r["id"] for r in rows}
    assert all(p in (1, 0, -1, None) for p in preds.values())
    assert agreement.total.n == len(rows)
