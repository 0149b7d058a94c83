"""Judge output parsing, votes, hints, prompts and sample rules (no broker, no HTTP)."""

from __future__ import annotations

import pytest

from pipeline import events
from pipeline.engine_api.errors import EngineError
from pipeline.judge.backends import BackendError, backend_class
from pipeline.judge.backends.base import Verdict
from pipeline.judge.parse import (best_hint, hint_block, hint_rejection, last_boxed, parse_hint,
                                  parse_score)
from pipeline.judge.prompts import JudgeInput, hint_messages, inject_hint, prm_messages
from pipeline.judge.samples import combine_sample, rl_flush_sample, rl_sample, sample_id
from pipeline.judge.teacher import TeacherOutput
from pipeline.votes import majority_vote


@pytest.mark.parametrize("text,want", [
    ("\\boxed{1}", 1), ("\\boxed{+1}", 1), ("\\boxed{-1}", -1), ("\\boxed{0}", 0),
    ("\\boxed{1.0}", 1), ("\\boxed{-1.00}", -1), ("\\boxed{ 1 }", 1), ("\\boxed{ - 1 }", -1),
    ("\\boxed{$1$}", 1), ("\\boxed{\\text{-1}}", -1), ("score: \\boxed{0.0}.", 0),
    ("first \\boxed{1} then on reflection \\boxed{-1}", -1),  # the last box counts
    ("no box at all", None), ("", None), (None, None), ("\\boxed{}", None), ("\\boxed{2}", None),
    ("\\boxed{0.5}", None), ("\\boxed{good}", None), ("\\boxed{1", None),  # unterminated
    ("\\boxed{1} and a truncated \\boxed{-", 1),  # unterminated last box: the earlier complete one
])
def test_parse_score(text, want):
    assert parse_score(text) == want


def test_last_boxed_balances_braces():
    assert last_boxed("\\boxed{\\frac{1}{2}}") == "\\frac{1}{2}"


@pytest.mark.parametrize("votes,want", [
    ([1, 1, -1], 1), ([-1, -1, 1], -1), ([1, -1, 0], 0),  # three-way tie
    ([1, -1, None], 0),  # tie among valid votes
    ([1, None, None], 1), ([0, 0, 1], 0), ([1, 1, 0, 0], 0),
    ([None, None, None], None), ([], None),  # no valid vote: no judgement (absent), never a 0
])
def test_majority_vote(votes, want):
    got = majority_vote(votes)
    assert got == want and (got is None) == (want is None)


def test_parse_hint_rules():
    ok = "\\boxed{1} [HINT_START]Give the answer in kilometres.[HINT_END]"
    assert parse_hint(ok) == (1, "Give the answer in kilometres.")
    # exactly 10 characters does not count; 11 does
    assert parse_hint("\\boxed{1} [HINT_START]0123456789[HINT_END]") == (1, None)
    assert parse_hint("\\boxed{1} [HINT_START]01234567890[HINT_END]") == (1, "01234567890")
    assert parse_hint("\\boxed{-1} [HINT_START]Use fewer words, please.[HINT_END]") == (-1, None)
    assert parse_hint("[HINT_START]Use fewer words, please.[HINT_END]") == (None, None)  # no vote
    assert parse_hint("\\boxed{0}") == (None, None)  # 0 is not a hint vote
    assert parse_hint("\\boxed{1} [HINT_START]never closed") == (1, None)
    assert best_hint([None, "short hint!", "a much longer hint text", "mid length hint"]) == "a much longer hint text"
    assert best_hint([None, None]) is None


def _turn(**kw):
    base = dict(session_id="s1", turn_index=0, messages=[{"role": "system", "content": "be brief"},
                                                          {"role": "user", "content": "What is 2+2?"}],
                prompt_token_ids=[1, 2, 3], response_token_ids=[4, 5], response_logprobs=[-0.5, -0.25],
                response={"content": "4", "tool_calls": [{"function": {"name": "calc", "arguments": "{\"x\": 1}"}}]},
                sampling={"temperature": 0.7}, policy_version=3, created_at=123, request_id="r1")
    base.update(kw)
    return events.Turn(**base)


def test_prompts_show_request_response_and_next_state_with_role():
    inp = JudgeInput.from_turn(_turn(), [{"role": "tool", "name": "calc", "content": "Error: overflow"}])
    assert inp.request == "What is 2+2?"
    assert "calc({\"x\": 1})" in inp.response
    user = prm_messages(inp)[1]["content"]
    assert "What is 2+2?" in user and "[tool result: calc] Error: overflow" in user and "Next state (tool)" in user
    assert "[HINT_START]" in hint_messages(inp)[0]["content"]
    assert "[user reply] thanks" in JudgeInput("q", "a", [{"role": "user", "content": "thanks"}]).next_state_text()


def test_inject_hint_into_last_user_message():
    msgs = [{"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": "second"}]
    out = inject_hint(msgs, "Be concise.")
    assert out[2]["content"] == "second\n\n[Hint] Be concise." and msgs[2]["content"] == "second"
    assert out[0]["content"] == "first"
    parts = inject_hint([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "Be concise.")
    assert parts[0]["content"][-1]["text"].endswith("Be concise.")
    # the hint ends the last text part, so any joining of parts (nothing: ours; a newline: vLLM) reads
    # it as the end of the message's text
    two = inject_hint([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}],
                      "Be concise.")[0]["content"]
    assert [p["text"] for p in two] == ["a", "b\n\n[Hint] Be concise."]
    assert inject_hint([{"role": "system", "content": "s"}], "Be concise.")[-1]["role"] == "user"


def test_rl_sample_rules():
    t = _turn()
    s = rl_sample(t, Verdict(-1, [-1, -1, 1]), candidate=False, judge="llm", decided_at=456)
    assert (s.reward, s.loss_mask, s.kind, s.sample_id) == (-1.0, 1, "rl", "s1:0:rl:r1")
    assert s.tokens == [1, 2, 3, 4, 5] and s.response_length == 2 and s.rollout_temperature == pytest.approx(0.7)
    assert (s.created_at, s.turn_created_at) == (456, 123)  # event times from the records, not the clock
    assert rl_sample(t, Verdict(0, [1, -1, 0]), candidate=False, judge="llm", decided_at=0).loss_mask == 0
    promoted = rl_sample(t, Verdict(0, [1, -1, None]), candidate=True, judge="llm", decided_at=0)
    assert (promoted.reward, promoted.loss_mask) == (0.0, 1)  # a tie on turn 0: trained with reward 0
    # every vote failed: no judgement, so no reward and never trained, not even as the candidate
    for candidate in (True, False):
        failed = rl_sample(t, Verdict(None, [None, None, None]), candidate=candidate, judge="llm", decided_at=0)
        assert (failed.reward, failed.loss_mask, failed.kind, failed.votes) == (None, 0, "rl", [None, None, None])
        assert events.decode(events.encode(failed)).reward is None
    flushed = rl_flush_sample(t, "llm", 0)
    assert (flushed.reward, flushed.loss_mask) == (None, 0)  # no next state: no reward at all
    assert sample_id(t, "combine") == "s1:0:combine:r1"
    # records without a request id get a content digest: stable for the same record, not shared
    legacy = _turn(request_id="")
    assert sample_id(legacy, "rl") == sample_id(_turn(request_id=""), "rl") != sample_id(
        _turn(request_id="", response_token_ids=[4, 6]), "rl")
    events.decode(events.encode(s))  # valid on the wire
    assert rl_sample(_turn(sampling={}), Verdict(1, [1]), False, "x", 0).rollout_temperature == 1.0
    # greedy (temperature 0): the engine's log-probs are of softmax(logits), i.e. temperature 1
    assert rl_sample(_turn(sampling={"temperature": 0.0}), Verdict(1, [1]), False, "x", 0).rollout_temperature == 1.0
    # the recorded effective temperature wins over the request's value
    assert rl_sample(_turn(sampling={"temperature": 0.0}, logprob_temperature=0.5), Verdict(1, [1]), False, "x",
                     0).rollout_temperature == 0.5
    # an imported turn has no rollout log-probs: explicitly absent, never zeros
    imported = rl_sample(_turn(response_logprobs=[], source="import"), Verdict(1, [1]), False, "x", 0)
    assert imported.rollout_log_probs is None and imported.response_length == 2
    events.decode(events.encode(imported))


def test_combine_sample_cases():
    t = _turn()
    teacher = TeacherOutput([-1.0, -2.0])
    both = combine_sample(t, 1, "hint text here", teacher, [[1], [1]], "llm", 0)
    assert (both.kind, both.reward, both.teacher_log_probs, both.hint) == ("opd+rl", 1.0, [-1.0, -2.0], "hint text here")
    hint_only = combine_sample(t, 0, "hint text here", teacher, [[0], [1]], "llm", 0)
    assert (hint_only.kind, hint_only.reward, hint_only.teacher_log_probs) == ("opd", None, [-1.0, -2.0])
    score_only = combine_sample(t, -1, None, None, [[-1], [-1]], "llm", 0)
    # no hint: no teacher log-probs at all (never the rollout log-probs as a stand-in)
    assert (score_only.kind, score_only.reward, score_only.teacher_log_probs) == ("rl", -1.0, None)
    assert combine_sample(t, 0, None, None, [[0], [-1]], "llm", 0) is None
    # every PRM vote failed: no RL signal (only the hint's, when there is one)
    assert combine_sample(t, None, None, None, [[None], [-1]], "llm", 0) is None
    failed_hint = combine_sample(t, None, "hint text here", teacher, [[None], [1]], "llm", 0)
    assert (failed_hint.kind, failed_hint.reward) == ("opd", None)
    for s in (both, hint_only, score_only):
        assert s.sample_id == "s1:0:combine:r1"
        events.decode(events.encode(s))


def test_teacher_scores_through_the_client_aligned_with_top_k_and_refuses_bad_answers():
    """The teacher's scoring is EngineClient.score_result over real HTTP: the last R entries are the
    response, top-k flattened row-major (missing: id 0, -inf); too few entries, a null log-prob,
    misaligned ids and a failing endpoint are EngineErrors."""
    import asyncio
    import math

    from pipeline.engine_api.render import load_tokenizer
    from pipeline.config import load_config
    from pipeline.judge.teacher import Teacher
    from pipeline.testing.servers import StandInJudge

    entries = [[-0.1, 11, None], [-0.2, 12, None], [-0.3, 13, None]]
    tops = [[[-0.1, 11, None], [-2.0, 99, None]], [[-0.2, 12, None]], None]
    answer: list = []

    def meta(**mi):
        return {"text": "", "output_ids": [], "meta_info": {"weight_version": "t", **mi}}

    async def score(url, response):
        config = load_config(None, engine={"teacher_url": url}, judge={"teacher_top_k": 2, "retries": 1,
                                                               "retry_backoff_s": 0.01})
        teacher = Teacher(config, tokenizer=load_tokenizer("tiny-random"))
        await teacher.start()
        try:
            return await teacher.score([11], response, 1.0)
        finally:
            await teacher.aclose()

    def generate(body):
        if answer[0] == "fail":
            raise RuntimeError("a failing teacher")  # uvicorn answers 500
        return answer[0]

    with StandInJudge(generate_script=generate) as srv:
        answer[:] = [meta(input_token_logprobs=entries, input_top_logprobs=tops)]
        out = asyncio.run(score(srv.url, [12, 13]))
        (body,) = srv.generate_bodies
        assert body["input_ids"] == [11, 12, 13] and body["logprob_start_len"] == 0 and body["top_logprobs_num"] == 2
        assert body["sampling_params"] == {"max_new_tokens": 0, "temperature": 1.0}
        assert out.log_probs == pytest.approx([-0.2, -0.3])  # the last R entries are the response
        assert out.topk_ids == [12, 0, 0, 0] and out.topk_log_probs[0] == pytest.approx(-0.2)
        assert all(math.isinf(x) for x in out.topk_log_probs[1:])
        answer[:] = [meta(input_token_logprobs=entries[:1])]
        with pytest.raises(EngineError):
            asyncio.run(score(srv.url, [12, 13]))
        answer[:] = [meta(input_token_logprobs=[[None, 11, None], [None, 12, None], [-1.0, 13, None]])]
        with pytest.raises(EngineError):
            asyncio.run(score(srv.url, [12, 13]))
        answer[:] = [meta(input_token_logprobs=entries)]
        with pytest.raises(EngineError, match="aligned"):
            asyncio.run(score(srv.url, [13, 12]))
        before = srv.calls["/generate"]
        answer[:] = ["fail"]
        with pytest.raises(EngineError, match="500"):
            asyncio.run(score(srv.url, [12, 13]))
        assert srv.calls["/generate"] - before == 2  # retried once (judge.retries = 1), then given up


def test_backend_names_and_import_paths():
    assert backend_class("constant").name == "constant"
    assert backend_class("pipeline.judge.backends.llm:LLMBackend").name == "llm"
    assert backend_class("pipeline.judge.backends.llm.LLMBackend").name == "llm"
    with pytest.raises(BackendError):
        backend_class("nonexistent_backend")
    with pytest.raises(BackendError, match="not a pipeline.judge.backends.Backend subclass"):
        backend_class("pipeline.judge.parse:parse_score")  # not a Backend
    with pytest.raises(BackendError, match="cannot import pipeline.judge.nothing:X: ModuleNotFoundError"):
        backend_class("pipeline.judge.nothing:X")


def test_the_llm_backend_votes_through_the_shared_judge_client():
    """The llm backend's votes (pipeline/engine_api/judging.py, shared with the eval set's judge
    checks): judge.votes concurrent calls, the model "default" kept when /v1/models is not served,
    a vote without a box failed, the verdict their majority."""
    import asyncio

    from pipeline.config import Config
    from pipeline.judge.backends.llm import LLMBackend
    from pipeline.testing.servers import StandInJudge

    async def score(url, directive):
        backend = LLMBackend(Config().replace(judge={"backend": "llm", "url": url, "votes": 3, "retries": 0}))
        await backend.start()
        try:
            return backend.model, await backend.score(JudgeInput("q", "a", [{"role": "user", "content": directive}]))
        finally:
            await backend.aclose()

    with StandInJudge() as srv:
        model, verdict = asyncio.run(score(srv.url, "<<score: \\boxed{1} || no box || \\boxed{1}>>"))
        assert (model, verdict.score, sorted(map(repr, verdict.votes))) == ("default", 1, ["1", "1", "None"])
        assert srv.calls["/v1/chat/completions"] == 3 and srv.calls["/v1/models"] == 1


def test_hint_is_the_last_complete_block():
    """Issue 24 case 10: a complete block followed by an unfinished one (a truncated answer) keeps
    the complete block's hint. Was: the unfinished block's start hid it (no hint)."""
    text = ("\\boxed{1} [HINT_START]Give the answer in kilometres.[HINT_END] "
            "[HINT_START]and also round it to")
    assert hint_block(text) == "Give the answer in kilometres."
    assert parse_hint(text) == (1, "Give the answer in kilometres.")
    assert hint_rejection([text]) is None
    two = "\\boxed{1} [HINT_START]first hint, complete.[HINT_END] [HINT_START]second hint, complete.[HINT_END]"
    assert parse_hint(two) == (1, "second hint, complete.")  # the last complete block wins
    assert hint_block("[HINT_END] stray end, then [HINT_START]open") is None
