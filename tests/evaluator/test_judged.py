"""The eval set's ``judge`` checks graded by the LLM judge (pipeline/evaluator/judged.py) through the
eval runner, against the stand-in judge (scripted votes, not a model) and a stand-in engine: a
majority of positive votes passes, a majority of negative ones fails, and a judge that never
answers (or answers without a vote) leaves the check absent, out of the metric's rate and ``n``.
An eval set with judge checks and no LLM judge configured is refused when the evaluator loads it.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from pipeline.config import Config
from pipeline.evaluator import Evaluator
from pipeline.evaluator.judged import criterion_messages
from pipeline.evaluator.runner import EvalRunner
from pipeline.rollout.evalset import EvalSetError, load_eval_set
from pipeline.testing.servers import StandInEngine, StandInJudge

CRITERION = "the reply gives the number asked for"


def _eval_set(path, prompts: dict) -> str:
    rows = [{"eval_set": "judged", "guards": ["right"]}]
    rows += [{"id": i, "prompt": p, "checks": {"right": {"judge": CRITERION}, "brief": {"max_words": 3}}}
             for i, p in prompts.items()]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def _evaluate(config: Config, path: str):
    """One evaluation of version 0 by the eval runner (its own event loop), and the runner."""
    runner = EvalRunner(config, load_eval_set(path))
    runner._loop = asyncio.new_event_loop()
    try:
        return runner.evaluate(None, 0, None), runner
    finally:
        runner.close_clients()
        runner._loop.close()


def _config(engine_url: str, judge_url: str, **judge) -> Config:
    return Config().replace(engine={"url": engine_url}, rollout={"enabled": True}, trainer={"lora": {"rank": 4}},
                            judge={"backend": "llm", "url": judge_url, "model": "judge", "votes": 3, "retries": 0,
                                   "vote_timeout_s": 5.0, **judge})


def test_the_judge_votes_pass_one_item_and_fail_another(tmp_path):
    path = _eval_set(tmp_path / "es.jsonl", {
        "pass": "6*7? <<score: \\boxed{1} || \\boxed{-1} || \\boxed{1}>>",       # 2 of 3 votes yes
        "fail": "6*8? <<score: \\boxed{-1} || I think \\boxed{1} || \\boxed{-1}>>",  # 2 of 3 votes no
    })
    with StandInEngine(lambda req: "42", weight_version="0") as engine, StandInJudge() as judge:
        ev, runner = _evaluate(_config(engine.url, judge.url), path)
    assert runner._judge is not None and judge.calls["/v1/chat/completions"] == 6  # judge.votes per item
    assert (ev.n, ev.metrics["right"], ev.metrics["right_n"]) == (2, 0.5, 2)
    assert (ev.metrics["brief"], ev.metrics["brief_n"]) == (1.0, 2)


def test_a_judge_that_never_answers_leaves_the_check_absent_not_failed(tmp_path):
    path = _eval_set(tmp_path / "es.jsonl", {
        "pass": "6*7? <<score: \\boxed{1}>>",
        "hangs": "6*8? <<score: !hang>>",           # every vote times out (judge.vote_timeout_s)
        "no-vote": "6*9? <<score: no box here>>",    # answers, never with a parsable vote
    })
    with StandInEngine(lambda req: "42", weight_version="0") as engine, StandInJudge(hang_s=2.0) as judge:
        ev, _ = _evaluate(_config(engine.url, judge.url, vote_timeout_s=0.3), path)
    assert (ev.n, ev.metrics["right"], ev.metrics["right_n"]) == (3, 1.0, 1)  # the absent two: not failures
    assert ev.metrics["brief_n"] == 3
    path = _eval_set(tmp_path / "es2.jsonl", {"hangs": "6*8? <<score: !hang>>"})
    with StandInEngine(lambda req: "42", weight_version="0") as engine, StandInJudge(hang_s=2.0) as judge:
        ev, _ = _evaluate(_config(engine.url, judge.url, vote_timeout_s=0.3, votes=1), path)
    assert "right" not in ev.metrics and "right_n" not in ev.metrics and ev.metrics["brief_n"] == 1


def test_the_judge_is_asked_about_the_conversation_the_reply_and_the_criterion():
    messages = criterion_messages(CRITERION, [{"role": "user", "content": [{"type": "text", "text": "6*7?"}]}], "42")
    assert [m["role"] for m in messages] == ["system", "user"] and "\\boxed{1}" in messages[0]["content"]
    assert all(part in messages[1]["content"] for part in ("[user] 6*7?", "42", CRITERION))


def test_judge_checks_without_an_llm_judge_are_refused_at_load_and_a_set_without_them_opens_no_judge(tmp_path):
    path = _eval_set(tmp_path / "es.jsonl", {"q": "6*7?"})
    config = Config().replace(rollout={"enabled": True, "eval_set": path}, judge={"backend": "embedding"},
                              trainer={"lora": {"rank": 4}})  # tenants' adapters: no full-weight gate on guard sizes
    with pytest.raises(EvalSetError, match="has judge checks and judge.backend is 'embedding', not an LLM judge"):
        Evaluator(config)
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "x", "checks": {"a": {"exact": "y"}}}) + "\n")
    assert Evaluator(config.replace(rollout={"eval_set": str(plain)})).runner._judge is None
