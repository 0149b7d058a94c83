"""Issue 40 through the real topics: a real :class:`JudgeApp` reads turns, next states, feedback
and session ends from the broker and publishes samples that say where their reward came from.

``StandInJudge`` is a stand-in judge LLM (votes scripted in the next-state text; NOT a model). The
OPD case scores with the real CPU engine (tiny-random) as the teacher and checks the sample's
token advantage against ``tests/reference_method.py`` with teacher log-probs this test computes
itself (the student's prompt ids with ``\\n\\n[Hint] <comment>`` inserted in the last user
message, re-encoded, scored by the engine's ``/generate``).
"""

from __future__ import annotations

import numpy as np
import pytest

from pipeline import events
from pipeline.testing.judge import JudgeThread, make_next_state, make_turn, short_id
from pipeline.testing.topics import publish, read_events

from tests import reference_method as ref
from tests.e2e.test_signal_reference_e2e import hinted_prompt_ids, score

UP = "<<score: \\boxed{1}>>"


def configure(c, judge_url, mode="rl", teacher_url=None, group=None, **judge):
    return c.replace(judge={"backend": "llm", "url": judge_url, "mode": mode, "group_id": group or f"{c.topics.prefix}judge",
                            "vote_timeout_s": 5.0, "retries": 0, "retry_backoff_s": 0.05, **judge},
                     engine={"model": "tiny-random", "teacher_url": teacher_url or judge_url})


def fb(sid, k, score, comment=None, source="user", n=0):
    return events.Feedback(session_id=sid, turn_index=k, score=score, feedback_id=f"{sid}-{k}-{n}",
                           turn_request_id=f"{sid}-{k}", comment=comment, source=source, created_at=events.now_ms())


def _script():
    """Feedback before the decision (conflicting: the last wins), after the decision (late), a
    session outcome, and a turn judged by its votes alone."""
    a = [make_turn("fa", 0), fb("fa", 0, 1.0), fb("fa", 0, -1.0, "Answer in metres, not feet.", n=1),
         make_next_state("fa", 0, "ok " + UP),
         make_turn("fa", 1), make_next_state("fa", 1, "great " + UP), fb("fa", 1, -1.0, source="reviewer"),
         make_turn("fa", 2), events.SessionEnd(session_id="fa", outcome=0.5, created_at=events.now_ms())]
    b = [make_turn("fb", 0), make_next_state("fb", 0, "thanks " + UP), events.SessionEnd(session_id="fb")]
    return a + b


def _by_id(samples) -> dict:
    out: dict = {}
    for s in samples:
        out.setdefault(short_id(s.sample_id), []).append(s)
    return out


def test_feedback_outcome_and_votes_each_decide_and_a_replay_decides_the_same(kafka_config, judge_server):
    c = configure(kafka_config, judge_server.url, mode="rl")
    publish(c, _script())
    with JudgeThread(c) as jt:
        first = _by_id(read_events(c, "samples", 4))
        late = dict(jt.app.joiner.late)
    s0, s1, s2, b0 = (first[k][0] for k in ("fa:0:rl", "fa:1:rl", "fa:2:rl", "fb:0:rl"))
    # a thumbs-down with a correction: reward -1 from the feedback, the comment as hint, no judge call
    assert (s0.reward, s0.reward_source, s0.reward_rule, s0.feedback_score) == (-1.0, "feedback", "precedence", -1.0)
    assert (s0.hint, s0.hint_source, s0.loss_mask, s0.votes) == ("Answer in metres, not feet.", "feedback", 1, [])
    # judged by its votes; the reviewer's thumbs-down came after the decision: counted, not used
    assert (s1.reward, s1.reward_source, s1.feedback_score, s1.loss_mask) == (1.0, "judge", None, 1)
    assert late == {"after_decision": 1}
    # the last turn never got a next state: the session outcome trains it
    assert (s2.reward, s2.reward_source, s2.outcome_reward, s2.loss_mask) == (0.5, "outcome", 0.5, 1)
    assert (b0.reward, b0.reward_source, b0.outcome_reward) == (1.0, "judge", None)
    # a replay of the log by another judge (its own group) writes identical samples
    with JudgeThread(c.replace(judge={"group_id": f"{c.topics.prefix}replay"})):
        both = _by_id(read_events(c, "samples", lambda evs: len(evs) >= 8))
    for key, copies in both.items():
        assert len(copies) == 2 and copies[0].to_dict() == copies[1].to_dict(), key


def test_weighted_rule_with_a_grace_window(kafka_config, judge_server):
    """Weighted (judge 1, feedback 3): a feedback read 1 s after the next state, within a 5 s
    grace window, still counts: (1 * 1 + 3 * -1) / 4 = -0.5, source judge+feedback."""
    c = configure(kafka_config, judge_server.url, mode="rl", reward_rule="weighted",
                  reward_weights={"judge": 1.0, "feedback": 3.0}, feedback_grace_s=5.0)
    t0 = 1_700_000_000_000
    turn = make_turn("fw", 0, created_at=t0)
    state = make_next_state("fw", 0, "fine " + UP)
    state.created_at = t0 + 1000
    late_fb = fb("fw", 0, -1.0)
    late_fb.created_at = t0 + 2000
    after = make_turn("fw", 1, created_at=t0 + 7000)  # 6 s past the next state: turn 0 is decided
    too_late = fb("fw", 0, 1.0, n=1)
    too_late.created_at = t0 + 8000
    publish(c, [turn, state, late_fb, after, too_late])
    with JudgeThread(c) as jt:
        got = _by_id(read_events(c, "samples", 1))
        late = dict(jt.app.joiner.late)
    s = got["fw:0:rl"][0]
    assert (s.reward, s.reward_source, s.reward_rule, s.feedback_score) == (-0.5, "judge+feedback", "weighted", -1.0)
    assert s.votes == [1, 1, 1] and late == {"after_decision": 1}


# ---- a comment is the OPD hint: the exact advantage of the reference ---------------------------------
@pytest.mark.parametrize("mode", ["opd", "combine"])
def test_comment_is_the_hint_with_the_references_opd_advantage(kafka_config, judge_server, tokenizer, renderer,
                                                                mode):
    from pipeline.testing.engine import running_engine

    comment = "Give the distance in kilometres."
    with running_engine("tiny-random", threads=1, context_length=1024) as eng:
        c = configure(kafka_config, judge_server.url, mode=mode, teacher_url=eng)
        turn = make_turn("fo", 0, request="How far is Lyon from Paris?", response_ids=[345, 99, 1021, 7],
                         temperature=0.8, renderer=renderer)
        publish(c, [turn, fb("fo", 0, -1.0, comment), make_next_state("fo", 0, "hm " + UP),
                    events.SessionEnd(session_id="fo")])
        with JudgeThread(c):
            (s,) = _by_id(read_events(c, "samples", 1))[f"fo:0:{mode}"]
        expected = score(eng, hinted_prompt_ids(tokenizer, turn.prompt_token_ids, comment),
                         list(turn.response_token_ids), 0.8)
        unhinted = score(eng, list(turn.prompt_token_ids), list(turn.response_token_ids), 0.8)
    assert (s.kind, s.reward, s.reward_source, s.hint, s.hint_source) == ("opd+rl", -1.0, "feedback", comment,
                                                                          "feedback")
    assert s.votes == ([] if mode == "opd" else [[], []])  # no PRM vote, no hint judge: the feedback decided both
    got = np.asarray(s.teacher_log_probs) - np.asarray(s.rollout_log_probs)
    want = ref.opd_advantage(expected, turn.response_logprobs)
    assert got == pytest.approx(want, abs=1e-5)
    assert not np.allclose(expected, unhinted, atol=1e-4)  # the comment changed the teacher: it was the hint
