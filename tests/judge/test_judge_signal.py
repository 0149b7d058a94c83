"""Issue 11, judge side: cases 1, 2, 5, 6, 7 (case 8: tests/proxy/test_proxy_abort.py), each with its
right value, through the real topics (broker), the real proxy and, where the engine matters, the
real CPU engine (tiny-random). ``StandInJudge`` (stand-in judge, answers scripted in the
next-state text; with ``teacher_logits``, a stand-in teacher with fixed logits) is not a model.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from pipeline import events
from pipeline.engine_api.render import PromptSpec
from pipeline.judge.prompts import inject_hint
from pipeline.testing.judge import JudgeThread, make_next_state, make_turn, short_id
from pipeline.testing.proxy import running_proxy
from pipeline.testing.servers import Reply, StandInEngine, StandInJudge, serve_app
from pipeline.testing.topics import publish, read_events

CHAT = "/v1/chat/completions"
UP = "<<score: \\boxed{1}>>"


def hint_directive(text: str) -> str:
    return f"<<hint: \\boxed{{1}} [HINT_START]{text}[HINT_END]>>"


def configure(c, judge_url, mode="rl", teacher_url=None, group=None, **judge):
    return c.replace(judge={"backend": "llm", "url": judge_url, "mode": mode,
                            "group_id": group or f"{c.topics.prefix}judge", "vote_timeout_s": 5.0, "retries": 0,
                            "retry_backoff_s": 0.05, **judge},
                     engine={"model": "tiny-random", "teacher_url": teacher_url or judge_url})


def samples_by_key(config, n, **kw):
    out = {}
    for s in read_events(config, "samples", n, **kw):
        out.setdefault(short_id(s.sample_id), []).append(s)
    return out


# ---- case 1: the teacher scores at the rollout's temperature ---------------------------------------
def test_case1_teacher_scores_at_the_rollout_temperature(kafka_config, judge_server, renderer):
    """Sampled at T=0.6, a hint that changes nothing (the stand-in teacher's logits ignore the
    prompt): logits [2, 1, 0], token 0 -> teacher -0.2026 = rollout -0.2026, OPD advantage 0
    (scored at T=1 it would be -0.4076, advantage -0.2050)."""
    with StandInJudge(teacher_logits=(2.0, 1.0, 0.0)) as teacher:
        # (no start-up self-check: the fixed text it scores lies outside this stand-in's 3-token support)
        c = configure(kafka_config, judge_server.url, mode="combine", teacher_url=teacher.url,
                      teacher_self_check=False)
        ids = [0, 1, 0, 2]
        rollout = [teacher.log_prob(t, 0.6) for t in ids]  # what the engine reported at T=0.6
        assert rollout[0] == pytest.approx(-0.2026, abs=1e-4)
        turn = make_turn("t1", 0, response_ids=ids, temperature=0.6, renderer=renderer, response_logprobs=rollout)
        publish(c, [turn, make_next_state("t1", 0, "use metres " + UP + hint_directive("Use metres, not feet.")),
                    events.SessionEnd(session_id="t1")])
        with JudgeThread(c):
            got = samples_by_key(c, 1)
    s = got["t1:0:combine"][0]
    assert s.kind == "opd+rl" and s.rollout_temperature == pytest.approx(0.6)
    assert s.teacher_log_probs[0] == pytest.approx(-0.2026, abs=1e-4)
    assert [a - b for a, b in zip(s.teacher_log_probs, s.rollout_log_probs)] == pytest.approx([0.0] * 4, abs=1e-6)
    assert teacher.generate_bodies[-1]["sampling_params"]["temperature"] == pytest.approx(0.6)


# ---- case 2: the teacher's prompt is the student's prompt plus the hint -------------------------------
def test_case2_teacher_prompt_is_the_student_prompt_with_the_hint(kafka_config, judge_server, tokenizer, renderer):
    """An OPD turn whose request has tools (and tool_choice, chat_template_kwargs), served by the
    real engine through the proxy: the teacher's prompt ids are the student's with the hint
    inserted, nothing else changed (the tools the student saw, no default system prompt)."""
    from pipeline.testing.engine import running_engine

    c = configure(kafka_config, judge_server.url, mode="opd")
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                               "parameters": {"type": "object",
                                                              "properties": {"city": {"type": "string"}}}}},
             {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    request = "What is the weather in Paris?"
    body = {"messages": [{"role": "user", "content": request}], "tools": tools, "max_tokens": 6,
            "tool_choice": "auto", "chat_template_kwargs": {"enable_thinking": False}}
    hint = "Give the temperature in Celsius."
    with running_engine("tiny-random", threads=1, context_length=1024) as eng, running_proxy(c, eng) as (url, app):
        h = {"X-Session-Id": "tools"}
        r = httpx.post(url + CHAT, json=body, headers=h, timeout=60)
        assert r.status_code == 200, r.text
        follow = dict(body, messages=body["messages"] + [r.json()["choices"][0]["message"],
                                                         {"role": "user", "content": "In C please " +
                                                          hint_directive(hint)}])
        assert httpx.post(url + CHAT, json=follow, headers={**h, "X-Session-Done": "true"}, timeout=60).status_code == 200
        assert app.publisher.wait_idle(10)
    turn = next(e for e in read_events(c, "turns", 4) if isinstance(e, events.Turn) and e.turn_index == 0)
    assert turn.chat_options == {k: body[k] for k in ("tool_choice", "chat_template_kwargs")}
    judge_server.generate_bodies.clear()
    with JudgeThread(c):
        got = samples_by_key(c, 1, settle_s=0.5)
    assert got["tools:0:opd"][0].hint == hint
    R = len(turn.response_token_ids)
    sent = next(b for b in judge_server.generate_bodies if b["input_ids"][len(b["input_ids"]) - R:] ==
                list(turn.response_token_ids))
    teacher_prompt = sent["input_ids"][:-R] if R else sent["input_ids"]
    student_text = tokenizer.decode(turn.prompt_token_ids)
    assert "get_weather" in student_text and "get_time" in student_text  # the tools the engine rendered
    assert student_text.count(request) == 1
    assert tokenizer.decode(teacher_prompt) == student_text.replace(request, f"{request}\n\n[Hint] {hint}")
    spec = PromptSpec.from_request(body)
    assert teacher_prompt == renderer.render_spec(spec.with_messages(inject_hint(spec.messages, hint)))


# ---- case 5: greedy turns are trained at the temperature of their log-probs -------------------------
def test_case5_greedy_turns_carry_the_engines_effective_temperature(kafka_config, judge_server):
    from pipeline.engine_api.client import EngineClient
    from pipeline.testing.engine import running_engine

    c = configure(kafka_config, judge_server.url, mode="rl")
    with running_engine("tiny-random", threads=1, context_length=1024) as eng, running_proxy(c, eng) as (url, app):
        msgs = [{"role": "user", "content": "Say hi."}]
        for k, done in ((0, "false"), (1, "true")):
            r = httpx.post(url + CHAT, json={"messages": msgs, "temperature": 0, "max_tokens": 5},
                           headers={"X-Session-Id": "greedy", "X-Session-Done": done}, timeout=60)
            assert r.status_code == 200, r.text
            msgs = msgs + [r.json()["choices"][0]["message"], {"role": "user", "content": f"thanks {UP}"}]
        assert app.publisher.wait_idle(10)
        turns = [e for e in read_events(c, "turns", 4) if isinstance(e, events.Turn)]

        async def engine_scores():
            async with EngineClient(eng) as client:
                return [await client.score(list(t.prompt_token_ids) + list(t.response_token_ids),
                                           len(t.prompt_token_ids), temperature=1.0) for t in turns]
        ref = asyncio.run(engine_scores())
    assert [t.logprob_temperature for t in turns] == [1.0, 1.0] and turns[0].sampling["temperature"] == 0
    for t, lp in zip(turns, ref):  # greedy log-probs are those of softmax(logits): temperature 1
        assert t.response_logprobs == pytest.approx(lp, abs=1e-4)
    with JudgeThread(c):
        got = samples_by_key(c, 2)
    s0, s1 = got["greedy:0:rl"][0], got["greedy:1:rl"][0]
    assert (s0.rollout_temperature, s1.rollout_temperature) == (1.0, 1.0)
    assert (s0.reward, s0.loss_mask) == (1.0, 1)


# ---- case 6: a reused session id is a new conversation with its own sample ids ------------------------
def test_case6_reused_session_ids_never_share_a_sample_id_and_replays_reproduce_them(kafka_config, judge_server):
    c = configure(kafka_config, judge_server.url, mode="rl")
    up = StandInEngine(lambda req: Reply(content="ok"))
    with serve_app(up) as up_url, running_proxy(c, up_url) as (url, app):
        for conv in ("first", "second"):
            msgs = [{"role": "user", "content": f"{conv} conversation"}]
            for k, done in ((0, "false"), (1, "true")):
                r = httpx.post(url + CHAT, json={"messages": msgs}, headers={"X-Session-Id": "reused",
                                                                             "X-Session-Done": done})
                assert r.status_code == 200 and r.headers["x-turn-index"] == str(k)
                msgs = msgs + [{"role": "assistant", "content": "ok"}, {"role": "user", "content": f"yes {UP}"}]
        assert app.publisher.wait_idle(10)
    with JudgeThread(c):
        first = read_events(c, "samples", 4)
    ids = [s.sample_id for s in first]
    assert len(ids) == 4 and len(set(ids)) == 4  # the trainer de-duplicates by id: nothing is lost
    assert sorted(short_id(i) for i in ids) == ["reused:0:rl", "reused:0:rl", "reused:1:rl", "reused:1:rl"]
    assert sorted((s.turn_index, s.loss_mask) for s in first) == [(0, 1), (0, 1), (1, 0), (1, 0)]
    # a second judge group replaying the same records reproduces the same samples, byte for byte
    c = c.replace(judge={"group_id": f"{c.topics.prefix}replay"})
    with JudgeThread(c):
        both = read_events(c, "samples", 8)
    enc = {}
    for s in both:
        enc.setdefault(s.sample_id, set()).add(events.encode(s))
    assert set(enc) == set(ids) and all(len(v) == 1 for v in enc.values())


# ---- case 7: a lagging judge decides from the records, not from its clock -----------------------------
def test_case7_a_stalled_judge_still_judges_the_next_state_in_the_log(kafka_config, judge_server):
    """The turn is read; the judge stalls (a slow vote holds its only job slot) for longer than
    idle_timeout_s; meanwhile the next state is appended. It is judged, not flushed as idle."""
    c = configure(kafka_config, judge_server.url, mode="rl", idle_timeout_s=1.0, max_in_flight=1)
    slow = "<<score: !sleep 3 \\boxed{1}>>"
    publish(c, [make_turn("lag", 0), make_turn("slow", 0), make_next_state("slow", 0, "fine " + slow),
                make_turn("slow2", 0), make_next_state("slow2", 0, "fine " + UP)])
    before = judge_server.calls["/v1/chat/completions"]
    with JudgeThread(c) as jt:
        deadline = time.monotonic() + 30
        while judge_server.calls["/v1/chat/completions"] == before and time.monotonic() < deadline:
            time.sleep(0.02)  # the slow vote is in flight: the judge is now stalled
        assert jt.app.joiner.waiting >= 1 and "lag" in jt.app.joiner.sessions
        publish(c, [make_next_state("lag", 0, "thanks " + UP)])  # 20 s after the turn, say; in the log now
        got = samples_by_key(c, lambda out: {"lag:0:rl", "slow:0:rl", "slow2:0:rl"} <= {short_id(s.sample_id)
                                                                                        for s in out},
                             timeout_s=60, settle_s=2.0)
    lag = got["lag:0:rl"][0]
    assert (lag.reward, lag.loss_mask) == (1.0, 1)  # judged on its next state, not masked as idle


# ---- variants of the same kinds ------------------------------------------------------------------------
def test_options_that_shape_the_log_probs_are_recorded_and_the_teacher_refuses_them(kafka_config, judge_server):
    """A penalty or a logit bias changes the rollout's distribution in a way a scoring pass cannot
    reproduce: the turn says so, and a combine sample keeps its reward but gets no OPD term."""
    from prometheus_client import REGISTRY

    from pipeline.testing.engine import running_engine

    c = configure(kafka_config, judge_server.url, mode="combine")
    before = REGISTRY.get_sample_value("pipeline_judge_teacher_unsupported_total",
                                       {"reason": "logprob_processors"}) or 0.0
    with running_engine("tiny-random", threads=1, context_length=1024) as eng, running_proxy(c, eng) as (url, app):
        for sid, extra in (("pen", {"repetition_penalty": 1.3}), ("bias", {"logit_bias": {"42": 2.0}}),
                           ("plain", {"top_p": 0.9, "top_k": 20, "seed": 3})):
            msgs = [{"role": "user", "content": "Hello there."}]
            r = httpx.post(url + CHAT, json={"messages": msgs, "max_tokens": 4, **extra},
                           headers={"X-Session-Id": sid}, timeout=60)
            assert r.status_code == 200, r.text
            msgs += [r.json()["choices"][0]["message"],
                     {"role": "user", "content": "ok " + UP + hint_directive("Greet the user by name.")}]
            r = httpx.post(url + CHAT, json={"messages": msgs, "max_tokens": 4, **extra},
                           headers={"X-Session-Id": sid, "X-Session-Done": "true"}, timeout=60)
            assert r.status_code == 200, r.text
        assert app.publisher.wait_idle(10)
    turns = {e.session_id: e for e in read_events(c, "turns", 12) if isinstance(e, events.Turn) and e.turn_index == 0}
    assert turns["pen"].logprob_processors == ["repetition_penalty"]
    assert turns["bias"].logprob_processors == ["logit_bias"]
    assert turns["plain"].logprob_processors == []  # truncation does not change the reported log-probs
    with JudgeThread(c):
        got = samples_by_key(c, 3, settle_s=0.5)
    assert {k: v[0].kind for k, v in got.items()} == {"pen:0:combine": "rl", "bias:0:combine": "rl",
                                                      "plain:0:combine": "opd+rl"}
    assert got["pen:0:combine"][0].teacher_log_probs is None and got["pen:0:combine"][0].reward == 1.0
    after = REGISTRY.get_sample_value("pipeline_judge_teacher_unsupported_total", {"reason": "logprob_processors"})
    assert after == before + 2


def test_a_prompt_the_renderer_cannot_reproduce_gets_no_teacher(renderer):
    from pipeline.config import load_config
    from pipeline.judge.teacher import Teacher, TeacherUnsupported

    teacher = Teacher(load_config(None, engine={"model": "tiny-random"}), tokenizer=renderer.tokenizer)
    good = make_turn("m", 0, renderer=renderer)
    assert teacher.prompt_ids(good, None) == good.prompt_token_ids
    hinted = teacher.prompt_ids(good, "Be brief.")
    assert hinted != good.prompt_token_ids and renderer.tokenizer.decode(hinted).count("[Hint] Be brief.") == 1
    other_options = make_turn("m", 0, renderer=renderer)
    other_options.chat_options = {"continue_final_message": True}  # rendered without it
    for bad in (make_turn("m", 0, prompt_ids=[5, 6, 7]), other_options):  # e.g. a request sent as raw input_ids
        with pytest.raises(TeacherUnsupported) as e:
            teacher.prompt_ids(bad, "Be brief.")
        assert e.value.reason == "prompt_mismatch"
