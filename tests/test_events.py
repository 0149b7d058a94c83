"""Event contracts: property-based round trips and every error path of decode()."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline import events
from pipeline.events import (Control, DeadLetter, MalformedEvent, NextState, Sample, SessionEnd, Turn,
                             UnknownEventType, UnsupportedVersion, decode, encode)

f32 = st.floats(allow_nan=False, allow_infinity=False, width=32)
i32 = st.integers(min_value=-(2**31), max_value=2**31 - 1)
text = st.text(max_size=30)
msgs = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "tool", "assistant"]),
                                       "content": text}), max_size=4)


@st.composite
def turns(draw):
    n = draw(st.integers(0, 40))
    source = draw(st.sampled_from(["proxy", "import", "replay"]))
    main = draw(st.booleans())
    return Turn(session_id=draw(text), turn_type="main" if main else "side",
                turn_index=draw(st.integers(0, 10**6)) if main else draw(st.none() | st.integers(0, 9)),
                request_id=draw(text), created_at=draw(st.integers(0, 2**62)), policy_version=draw(st.integers(0, 10**6)),
                model=draw(text), messages=draw(msgs), tools=draw(st.none() | st.just([{"type": "function"}])),
                sampling={"temperature": draw(f32)}, prompt_token_ids=draw(st.lists(i32, max_size=50)),
                response_token_ids=draw(st.lists(i32, min_size=n, max_size=n)),
                response_logprobs=draw(st.lists(f32, min_size=n, max_size=n)),
                response={"content": draw(text)}, finish_reason=draw(st.none() | st.just("stop")), source=source)


@st.composite
def samples(draw):
    r = draw(st.integers(0, 30))
    p = draw(st.integers(0, 30))
    kind = draw(st.sampled_from(["rl", "opd", "opd+rl"]))
    if kind != "rl":
        r = max(r, 1)  # a distillation sample has teacher log-probs, so at least one response token
    k = draw(st.integers(0, 3))
    teacher = draw(st.lists(f32, min_size=r, max_size=r)) if kind != "rl" else []
    return Sample(sample_id=draw(text), session_id=draw(text), turn_index=draw(st.integers(0, 1000)),
                  policy_version=draw(st.integers(0, 100)), kind=kind, tokens=draw(st.lists(i32, min_size=p + r, max_size=p + r)),
                  response_length=r, rollout_log_probs=draw(st.lists(f32, min_size=r, max_size=r)),
                  rollout_temperature=draw(f32), reward=draw(st.sampled_from([-1.0, 0.0, 1.0])),
                  loss_mask=draw(st.sampled_from([0, 1])), teacher_log_probs=teacher,
                  teacher_top_k=k if teacher else 0,
                  teacher_topk_ids=draw(st.lists(i32, min_size=k * r, max_size=k * r)) if teacher else [],
                  teacher_topk_log_probs=draw(st.lists(f32, min_size=k * r, max_size=k * r)) if teacher else [],
                  votes=draw(st.lists(st.sampled_from([1, 0, -1, None]), max_size=5)), hint=draw(st.none() | text))


controls = st.builds(Control, action=st.sampled_from(["pause", "resume"]), epoch=st.integers(0, 10**6),
                     policy_version=st.integers(0, 10**6), run_id=text, message=text) | st.builds(
    Control, action=st.just("weights"), epoch=st.integers(0, 99), location=st.text(min_size=1),
    sha256=st.text(min_size=1)) | st.builds(Control, action=st.sampled_from(["applied", "failed"]),
                                            epoch=st.integers(0, 99), engine_id=st.text(min_size=1))
any_event = (turns() | samples() | controls
             | st.builds(NextState, session_id=text, messages=msgs, after_turn_index=st.none() | st.integers(0, 99))
             | st.builds(SessionEnd, session_id=text, reason=text)
             | st.builds(DeadLetter, source_topic=text, partition=st.integers(0, 99), offset=st.integers(0, 2**40),
                         error=text, key=st.none() | st.binary(max_size=8), raw=st.binary(max_size=64)))


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
    with pytest.raises(MalformedEvent, match="rollout_log_probs"):
        encode(Sample(sample_id="a", session_id="s", turn_index=0, tokens=[1, 2], response_length=1,
                      rollout_log_probs=[-1.0, -2.0]))
    # no rollout log-probs (an imported turn was never sampled): explicitly absent, not zeros
    assert decode(encode(Sample(sample_id="a", session_id="s", turn_index=0, tokens=[1, 2],
                                response_length=1))).rollout_log_probs == []
    with pytest.raises(MalformedEvent, match="logprob_temperature"):
        encode(Turn(session_id="s", turn_index=0, logprob_temperature=0.0))
    with pytest.raises(MalformedEvent, match="needs teacher_log_probs"):
        encode(Sample(sample_id="a", session_id="s", turn_index=0, kind="opd", tokens=[1, 2], response_length=1,
                      rollout_log_probs=[-1.0]))
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
    assert set(events.EVENT_TYPES) == {"turn", "next_state", "session_end", "sample", "control", "dead_letter"}
