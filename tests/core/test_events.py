"""Event contracts: property-based round trips and every error path of decode()."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.legacy_records import sample_v1
from pipeline import events
from pipeline.events import (Control, DeadLetter, Evaluation, MalformedEvent, NextState, Sample, SessionEnd,
                             TrainStep, Turn, UnknownEventType, UnsupportedVersion, decode, encode)

f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
logprob = st.floats(-1e4, 0.0, width=32)  # the log-prob domain
i32 = st.integers(min_value=0, max_value=2**31 - 1)  # token ids
text = st.text(max_size=30)
ident = st.text(min_size=1, max_size=30)  # ids are non-empty
msgs = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", "assistant"]),
                                       "content": text}), max_size=4)


@st.composite
def turns(draw):
    n = draw(st.integers(0, 40))
    source = draw(st.sampled_from(["proxy", "import", "replay"]))
    main = draw(st.booleans())
    return Turn(session_id=draw(ident), turn_type="main" if main else "side",
                turn_index=draw(st.integers(0, 10**6)) if main else draw(st.none() | st.integers(0, 9)),
                request_id=draw(text), created_at=draw(st.integers(0, 2**53 - 1)), policy_version=draw(st.integers(0, 10**6)),
                model=draw(text), messages=draw(msgs), tools=draw(st.none() | st.just([{"type": "function"}])),
                sampling={"temperature": draw(f32)}, prompt_token_ids=draw(st.lists(i32, max_size=50)),
                response_token_ids=draw(st.lists(i32, min_size=n, max_size=n)),
                response_logprobs=draw(st.lists(logprob, min_size=n, max_size=n)),
                response={"content": draw(text)}, finish_reason=draw(st.none() | st.just("stop")), source=source)


@st.composite
def samples(draw):
    r = draw(st.integers(0, 30))
    p = draw(st.integers(0, 30))
    has_reward, has_teacher, has_rollout = draw(st.booleans()), draw(st.booleans()), draw(st.booleans())
    kind = events.sample_kind(has_reward, has_teacher) or draw(st.sampled_from(events.SAMPLE_KINDS))
    k = draw(st.integers(0, 3))
    teacher = draw(st.lists(logprob, min_size=r, max_size=r)) if has_teacher else None
    return Sample(sample_id=draw(ident), session_id=draw(ident), turn_index=draw(st.integers(0, 1000)),
                  policy_version=draw(st.integers(0, 100)), kind=kind, tokens=draw(st.lists(i32, min_size=p + r, max_size=p + r)),
                  response_length=r,
                  rollout_log_probs=draw(st.lists(logprob, min_size=r, max_size=r)) if has_rollout else None,
                  rollout_temperature=draw(st.floats(1e-6, 100.0)),
                  reward=draw(st.sampled_from([-1.0, 0.0, 1.0, 0.5])) if has_reward else None,
                  loss_mask=draw(st.sampled_from([0, 1])) if (has_reward or has_teacher) else 0,
                  teacher_log_probs=teacher, teacher_top_k=k if teacher else 0,
                  teacher_topk_ids=draw(st.lists(i32, min_size=k * r, max_size=k * r)) if teacher else [],
                  teacher_topk_log_probs=draw(st.lists(logprob, min_size=k * r, max_size=k * r)) if teacher else [],
                  votes=draw(st.lists(st.sampled_from([1, 0, -1, None]), max_size=5)), hint=draw(st.none() | text))


controls = st.builds(Control, action=st.sampled_from(["pause", "resume"]), epoch=st.integers(0, 10**6),
                     policy_version=st.integers(0, 10**6), run_id=ident, message=text) | st.builds(
    Control, action=st.just("weights"), epoch=st.integers(0, 99), location=st.text(min_size=1),
    sha256=st.text("0123456789abcdef", min_size=64, max_size=64)) | st.builds(
    Control, action=st.sampled_from(["applied", "failed"]), epoch=st.integers(0, 99), engine_id=ident)
any_event = (turns() | samples() | controls
             | st.builds(NextState, session_id=ident, messages=msgs, after_turn_index=st.none() | st.integers(0, 99))
             | st.builds(SessionEnd, session_id=ident, reason=ident)
             | st.builds(DeadLetter, source_topic=text, partition=st.integers(0, 99), offset=st.integers(0, 2**40),
                         error=text, key=st.none() | st.binary(max_size=8), raw=st.binary(max_size=64))
             | st.builds(TrainStep, step=st.integers(1, 10**6), policy_version=st.integers(0, 10**6), run_id=ident,
                         skipped=st.booleans(), metrics=st.dictionaries(text, st.floats(allow_nan=False), max_size=5),
                         sample_ids=st.lists(text, max_size=5),
                         trained=st.dictionaries(text, st.floats(allow_nan=False), max_size=5))
             | st.builds(Evaluation, policy_version=st.integers(0, 99), n=st.integers(0, 1000), name=text,
                         metrics=st.dictionaries(text, st.floats(allow_nan=False), max_size=3)))


@settings(max_examples=300, deadline=None)
@given(any_event)
def test_round_trip(ev):
    assert decode(encode(ev)) == ev


@settings(max_examples=50, deadline=None)
@given(turns())
def test_arrays_are_packed_little_endian(t):
    obj = msgpack.unpackb(encode(t), raw=False)
    assert obj["type"] == "turn" and obj["v"] == 1
    assert obj["prompt_token_ids"] == np.asarray(t.prompt_token_ids, "<i4").tobytes()
    assert obj["response_logprobs"] == np.asarray(t.response_logprobs, "<f4").tobytes()


def _raw(**over):
    base = {"type": "session_end", "v": 1, "session_id": "s", "reason": "header", "created_at": 1}
    base.update(over)
    return msgpack.packb({k: v for k, v in base.items() if v is not ...}, use_bin_type=True)


@pytest.mark.parametrize("data, exc, needle", [
    (None, MalformedEvent, "tombstone"),
    (b"\xc1", MalformedEvent, "not a msgpack"),
    (msgpack.packb([1, 2]), MalformedEvent, "map"),
    (_raw(type="nope"), UnknownEventType, "nope"),
    (_raw(type=...), UnknownEventType, "None"),
    (_raw(v=2), UnsupportedVersion, "version 2"),
    (_raw(v=True), UnsupportedVersion, "version"),
    (_raw(session_id=...), MalformedEvent, "session_id is missing"),
    (_raw(session_id=5), MalformedEvent, "session_id must be str"),
    (_raw(created_at="x"), MalformedEvent, "created_at must be int"),
    (_raw(created_at=True), MalformedEvent, "created_at must be int"),
    (_raw(reason=None), MalformedEvent, "must not be null"),
])
def test_decode_errors(data, exc, needle):
    with pytest.raises(exc, match=needle):
        decode(data)


def test_cross_field_validation():
    t = Turn(session_id="s", turn_index=0, response_token_ids=[1, 2], response_logprobs=[-1.0])
    with pytest.raises(MalformedEvent, match="1 entries for 2 response tokens"):
        encode(t)
    with pytest.raises(MalformedEvent, match="turn_index is required"):
        encode(Turn(session_id="s", turn_type="main"))
    with pytest.raises(MalformedEvent, match="turn_type"):
        encode(Turn(session_id="s", turn_type="other", turn_index=1))
    # imported turns may come without log-probs (they were not sampled)
    assert decode(encode(Turn(session_id="s", turn_index=0, response_token_ids=[1], source="import"))).source == "import"
    with pytest.raises(MalformedEvent, match="rollout_log_probs has 0 entries"):
        encode(Sample(sample_id="a", session_id="s", turn_index=0, tokens=[1, 2], response_length=1, reward=1.0,
                      rollout_log_probs=[]))
    with pytest.raises(MalformedEvent, match="rollout_log_probs"):
        encode(Sample(sample_id="a", session_id="s", turn_index=0, tokens=[1, 2], response_length=1, reward=1.0,
                      rollout_log_probs=[-1.0, -2.0]))
    with pytest.raises(MalformedEvent, match="logprob_temperature"):
        encode(Turn(session_id="s", turn_index=0, logprob_temperature=0.0))
    with pytest.raises(MalformedEvent, match="location and sha256"):
        encode(Control(action="weights", epoch=1))
    with pytest.raises(MalformedEvent, match="needs engine_id"):
        encode(Control(action="applied", epoch=1))
    with pytest.raises(MalformedEvent, match="action"):
        encode(Control(action="explode", epoch=1))
    bad_packed = msgpack.packb({"type": "turn", "v": 1, "session_id": "s", "turn_index": 0,
                                "response_token_ids": b"\x01\x02\x03"}, use_bin_type=True)
    with pytest.raises(MalformedEvent, match="packed i32"):
        decode(bad_packed)
    with pytest.raises(MalformedEvent, match="cannot pack"):
        encode(Turn(session_id="s", turn_index=0, prompt_token_ids=[2**40]))


def test_every_type_registered():
    assert set(events.EVENT_TYPES) == {"turn", "next_state", "session_end", "feedback", "sample", "control", "dead_letter",
                                       "train_step", "evaluation"}


def test_observer_events_refuse_bad_values():
    with pytest.raises(MalformedEvent, match="step must be >= 1"):
        encode(TrainStep(step=0))
    with pytest.raises(MalformedEvent, match="sample_ids must be strings"):
        encode(TrainStep(step=1, sample_ids=[1]))
    with pytest.raises(MalformedEvent, match="n must be >= 0"):
        encode(Evaluation(policy_version=0, n=-1))


# ------------------------------------------------------------------ sample v2: explicit signals


def _s(**kw) -> Sample:
    base = dict(sample_id="a", session_id="s", turn_index=0, tokens=[1, 2, 3], response_length=2)
    base.update(kw)
    return Sample(**base)


@pytest.mark.parametrize("kw, needle", [
    (dict(), "carries no signal"),  # loss_mask 1, neither a reward nor a teacher
    (dict(reward=1.0, kind="opd+rl"), "does not name the signals"),
    (dict(teacher_log_probs=[-1.0, -2.0], kind="rl"), "does not name the signals"),
    (dict(reward=1.0, teacher_log_probs=[-1.0, -2.0], kind="opd"), "does not name the signals"),
    (dict(reward=float("nan")), "reward must be finite"),
    (dict(reward=1.0, rollout_log_probs=[-1.0, float("-inf")]), "non-finite"),
    (dict(kind="opd", teacher_log_probs=[-1.0, float("nan")]), "non-finite"),
    (dict(kind="opd", teacher_log_probs=[-1.0]), "teacher_log_probs has 1 entries"),
    (dict(reward=1.0, rollout_temperature=0.0), "rollout_temperature must be > 0"),
    (dict(reward=1.0, teacher_top_k=1, teacher_topk_ids=[1, 2], teacher_topk_log_probs=[-1.0, -2.0]),
     "without teacher_log_probs"),
])
def test_sample_signals_are_explicit_and_consistent(kw, needle):
    with pytest.raises(MalformedEvent, match=needle):
        encode(_s(**kw))


def test_absent_signals_travel_as_nil():
    s = _s(reward=None, kind="opd", teacher_log_probs=[-0.5, -0.25], rollout_log_probs=None)
    obj = msgpack.unpackb(encode(s), raw=False)
    assert obj["v"] == 2 and obj["reward"] is None and obj["rollout_log_probs"] is None
    assert obj["teacher_log_probs"] == np.asarray([-0.5, -0.25], "<f4").tobytes()
    back = decode(encode(s))
    assert (back.has_reward, back.has_teacher, back.has_rollout_log_probs) == (False, True, False)
    # a carried-for-accounting sample may hold no signal at all (loss_mask 0)
    flushed = decode(encode(_s(loss_mask=0, rollout_log_probs=[-1.0, -1.0])))
    assert flushed.reward is None and flushed.teacher_log_probs is None and flushed.kind == "rl"


@pytest.mark.parametrize("over, want", [
    # combine, vote only: v1 put the rollout log-probs where the teacher goes
    (dict(), dict(kind="rl", reward=1.0, teacher=None, rollout=[-0.5, -1.5])),
    # combine, hint and vote
    (dict(hint="a real hint", teacher_log_probs=[-0.25, -0.75]),
     dict(kind="opd+rl", reward=1.0, teacher=[-0.25, -0.75], rollout=[-0.5, -1.5])),
    # combine, hint only: v1 wrote reward 0
    (dict(hint="a real hint", reward=0.0, teacher_log_probs=[-0.25, -0.75]),
     dict(kind="opd", reward=None, teacher=[-0.25, -0.75], rollout=[-0.5, -1.5])),
    # opd mode: reward 0 was a stand-in
    (dict(kind="opd", reward=0.0, hint="a real hint", teacher_log_probs=[-0.25, -0.75]),
     dict(kind="opd", reward=None, teacher=[-0.25, -0.75], rollout=[-0.5, -1.5])),
    # imported turn: zeros stood in for the rollout log-probs (and for the teacher)
    (dict(source="import", reward=-1.0, rollout_log_probs=[0.0, 0.0], teacher_log_probs=[0.0, 0.0]),
     dict(kind="rl", reward=-1.0, teacher=None, rollout=None)),
    # rl mode: the at-least-one candidate keeps its real vote of 0
    (dict(kind="rl", reward=0.0, votes=[0, 0], teacher_log_probs=b""),
     dict(kind="rl", reward=0.0, teacher=None, rollout=[-0.5, -1.5])),
    # rl mode: flushed without a next state (no votes, masked): no reward
    (dict(kind="rl", reward=0.0, votes=[], loss_mask=0, teacher_log_probs=b""),
     dict(kind="rl", reward=None, teacher=None, rollout=[-0.5, -1.5])),
    # rl mode: every vote failed, reward 0 was a stand-in, even where the at-least-one rule trained it
    (dict(kind="rl", reward=0.0, votes=[None, None], loss_mask=1, teacher_log_probs=b""),
     dict(kind="rl", reward=None, teacher=None, rollout=[-0.5, -1.5], loss_mask=0)),
])
def test_v1_samples_are_read_with_their_meaning(over, want):
    s = decode(sample_v1(**over))
    assert s.kind == want["kind"] and s.reward == want["reward"]
    assert s.loss_mask == want.get("loss_mask", over.get("loss_mask", 1))
    for got, exp in ((s.teacher_log_probs, want["teacher"]), (s.rollout_log_probs, want["rollout"])):
        assert (got is None) == (exp is None) and (exp is None or got == pytest.approx(exp))
    assert s.rollout_temperature == pytest.approx(0.7)
    assert decode(encode(s)) == s  # and it is written back as a v2 record


def test_v1_greedy_sample_is_read_at_temperature_one_and_bad_v1_goes_to_the_dlq():
    assert decode(sample_v1(rollout_temperature=0.0)).rollout_temperature == 1.0
    with pytest.raises(MalformedEvent, match="rollout_log_probs has 1 entries"):
        decode(sample_v1(rollout_log_probs=[-1.0]))
    with pytest.raises(UnsupportedVersion, match="reads v1, v2"):
        decode(sample_v1(v=3))
    assert events.readable_versions("sample") == [1, 2] and events.readable_versions("turn") == [1]


def _evidence(**over):
    ev = {"rule": "newcombe-noninferiority-v1", "reason": "reward_fell", "config": {"min_n": 400},
          "incumbent": 4, "arms": {"candidate": {"reward": [3, 60]}, "incumbent": {"reward": [30, 60]}},
          "bounds": {"reward": [-0.6, -0.3]}}
    ev.update(over)
    return ev


def test_rollout_decisions_carry_their_evidence():
    """Issue 39: promote/rollback on control, with the evidence, its domain checked at decode."""
    for action in ("promote", "rollback"):
        c = Control(action=action, epoch=5, policy_version=5, evidence=_evidence())
        assert decode(encode(c)) == c
    with pytest.raises(MalformedEvent, match="evidence is required"):
        encode(Control(action="rollback", epoch=5))
    with pytest.raises(MalformedEvent, match="evidence is required"):
        encode(Control(action="pause", epoch=5, evidence=_evidence()))
    bad = [_evidence(bounds={"reward": [0.5, -0.5]}), _evidence(arms={"candidate": {"reward": [7, 3]},
                                                                          "incumbent": {}}),
           _evidence(arms={"candidate": {}}), _evidence(incumbent="v4"), _evidence(rule=""),
           {k: v for k, v in _evidence().items() if k != "config"}]
    for ev in bad:
        raw = msgpack.packb({"type": "control", "v": 1, "action": "rollback", "epoch": 5, "evidence": ev},
                            use_bin_type=True)
        with pytest.raises(MalformedEvent, match="control.evidence"):
            decode(raw)
    t = Turn(session_id="s", turn_index=0, canary="candidate")
    assert decode(encode(t)).canary == "candidate"
    with pytest.raises(MalformedEvent, match="turn.canary"):
        decode(msgpack.packb({"type": "turn", "v": 1, "session_id": "s", "turn_index": 0, "canary": "both"},
                             use_bin_type=True))


def test_an_evaluation_may_name_a_tenants_adapter_and_older_records_decode():
    import msgpack

    version = "c" * 64
    ad = {"name": events.adapter_name("alice", version), "version": version, "sha256": "d" * 64}
    ev = events.Evaluation(policy_version=0, n=3, tenant="alice", adapter=ad, metrics={"accuracy": 1.0})
    assert events.decode(events.encode(ev)) == ev
    old = msgpack.unpackb(events.encode(events.Evaluation(policy_version=2, n=3)), raw=False)
    del old["tenant"], old["adapter"]  # a record written before these fields
    back = events.decode(msgpack.packb(old, use_bin_type=True))
    assert back.tenant is None and back.adapter is None and back.policy_version == 2
    with pytest.raises(events.MalformedEvent, match="needs its tenant"):
        events.encode(events.Evaluation(policy_version=0, n=3, adapter=ad))
    with pytest.raises(events.MalformedEvent, match="not tenant 'bob'"):
        events.decode(events.encode(events.Evaluation(policy_version=0, n=3, tenant="bob", adapter=ad)))
