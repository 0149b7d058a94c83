"""Issue 24, cases 1 and 3: the OPD teacher is a checked, fixed, named model.

Real parts: the CPU engine serving tiny-random (the teacher), the judge's :class:`Teacher`, a
real :class:`pipeline.judge.app.JudgeApp` on the broker for the start-up refusal. SGLang is
:class:`pipeline.testing.sglang_style.SglangStyleEngine`, a stand-in (our CPU engine answering as
SGLang does), configured both ways: started with ``SGLANG_TEMP_SCALED_LOGPROBS=1`` (prompt
log-probs at the requested temperature) and without it (at T = 1 whatever is asked).

- Case 1: the teacher's self-check (a fixed sequence at T = 0.5 and T = 1: log-prob differences
  must double) passes on the CPU engine and on the correctly started stand-in, and refuses the
  misconfigured one with an error naming the fix; a judge refuses to start with it.
- Case 3: without ``engine.teacher_url`` the live policy is refused as teacher; allowed
  (``judge.live_policy_teacher``), it scores a turn only with the weights that generated it; a
  sample records the teacher's identity and version.
"""

from __future__ import annotations

import asyncio

import pytest

from pipeline import events
from pipeline.engine_api.render import ChatRenderer
from pipeline.config import load_config
from pipeline.judge.samples import opd_sample
from pipeline.judge.teacher import Teacher, TeacherMisconfigured, TeacherUnsupported
from pipeline.testing.engine import running_engine
from pipeline.testing.judge import make_turn
from pipeline.testing.servers import serve_app
from pipeline.testing.sglang_style import SglangStyleEngine


def _check(config, tokenizer) -> None:
    async def go():
        t = Teacher(config, tokenizer=tokenizer)
        await t.start()
        try:
            await t.check_at_start()
            return t.model, t.checked
        finally:
            await t.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("where", ["cpu-engine", "sglang-scaled"])
def test_a_temperature_scaled_teacher_passes_the_self_check(engine_url, tokenizer, where):
    if where == "cpu-engine":
        model, checked = _check(load_config(None, engine={"teacher_url": engine_url}), tokenizer)
    else:
        with serve_app(SglangStyleEngine(engine_url, temp_scaled_logprobs=True)) as url:
            model, checked = _check(load_config(None, engine={"teacher_url": url}), tokenizer)
    assert checked and model and "tiny-random" in model  # named by the engine's model path


def test_a_teacher_without_temperature_scaling_is_refused(engine_url, tokenizer):
    with serve_app(SglangStyleEngine(engine_url, temp_scaled_logprobs=False)) as url:
        with pytest.raises(TeacherMisconfigured, match="SGLANG_TEMP_SCALED_LOGPROBS=1") as err:
            _check(load_config(None, engine={"teacher_url": url}), tokenizer)
    assert "1.000 times" in str(err.value)  # the differences did not move with T at all


def test_the_judge_does_not_start_with_a_misconfigured_teacher(kafka_config, engine_url):
    from pipeline.judge.app import JudgeApp

    with serve_app(SglangStyleEngine(engine_url, temp_scaled_logprobs=False)) as url:
        c = kafka_config.replace(judge={"mode": "combine", "backend": "llm", "url": url,
                                        "group_id": f"{kafka_config.topics.prefix}judge"},
                                 engine={"model": "tiny-random", "teacher_url": url})
        app = JudgeApp(c)
        with pytest.raises(TeacherMisconfigured, match="SGLANG_TEMP_SCALED_LOGPROBS"):
            app.run(install_signals=False)


def test_the_live_policy_is_no_teacher_by_default(engine_url, tokenizer):
    config = load_config(None, engine={"url": engine_url, "model": "tiny-random"}, judge={"mode": "opd"})
    assert config.engine.teacher_url is None
    with pytest.raises(TeacherMisconfigured, match="engine.teacher_url"):
        asyncio.run(Teacher(config, tokenizer=tokenizer).start())


def test_live_policy_teacher_scores_only_with_the_turns_own_weights(tmp_path, tokenizer):
    """Allowed explicitly: a v0 turn is scored while the engine serves v0; after a sync to v1 the
    same turn gets no teacher (reason ``teacher_version``) instead of v1's log-probs."""
    from pipeline.engine_api.client import EngineClient
    from pipeline.testing.trainer import shifted_export

    renderer = ChatRenderer(tokenizer)
    turn = make_turn("live", 0, renderer=renderer, policy_version=0)
    v1, _ = shifted_export(tmp_path / "weights", 1)
    with running_engine("tiny-random", threads=1) as url:
        config = load_config(None, engine={"url": url, "model": "tiny-random"},
                             judge={"live_policy_teacher": True})

        async def go():
            t = Teacher(config, tokenizer=tokenizer)
            await t.start()
            try:
                before = await t.log_probs(turn, "Answer briefly.")
                async with EngineClient(url, timeout_s=60) as eng:
                    await eng.update_weights_from_disk(str(v1), weight_version="1")
                with pytest.raises(TeacherUnsupported) as err:
                    await t.log_probs(turn, "Answer briefly.")
                return before, err.value.reason
            finally:
                await t.aclose()

        before, reason = asyncio.run(go())
    assert before.version == "0" and len(before.log_probs) == len(turn.response_token_ids)
    assert reason == "teacher_version"


def test_the_sample_records_the_teachers_identity_and_version(engine_url, tokenizer):
    renderer = ChatRenderer(tokenizer)
    turn = make_turn("named", 0, renderer=renderer, policy_version=3)
    config = load_config(None, engine={"teacher_url": engine_url, "model": "tiny-random"})

    async def go():
        t = Teacher(config, tokenizer=tokenizer)
        await t.start()
        try:
            return await t.log_probs(turn, "Answer briefly.")
        finally:
            await t.aclose()

    out = asyncio.run(go())
    s = events.decode(events.encode(opd_sample(turn, "Answer briefly.", out, [1], "llm")))
    assert s.policy_version == 3  # the student's version ...
    assert "tiny-random" in s.teacher_model and s.teacher_version == "0"  # ... and the frozen teacher's
    bad = events.Sample(sample_id="x:0:rl", session_id="x", turn_index=0, kind="rl", reward=1.0,
                        teacher_model="m")  # identity of a teacher that gave nothing
    with pytest.raises(events.MalformedEvent, match="teacher_model"):
        events.decode(events.encode(bad))
