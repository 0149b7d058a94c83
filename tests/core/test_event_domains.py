"""Issue 24, case 6: every field of every event has a domain, checked where the event is decoded.

A fuzz of corrupted records: valid ``turn``, ``session_end`` and ``sample`` records, each
corrupted at random (a field set to a value outside its domain, a field of the wrong type, a
length that no longer matches, or random bytes flipped in the encoded record). Every record
:func:`pipeline.events.decode` accepts must be valid by this file's own statement of the domains
(:func:`valid`, written from the issue, not from the code); every field-level corruption must be
refused with the field named in the error (what the dead-letter record carries).
"""

from __future__ import annotations

import math
import random

import msgpack
import numpy as np
import pytest

from pipeline import events
from pipeline.events import Feedback, MalformedEvent, Sample, SessionEnd, Turn, decode, encode

MAX_ID = 256
MAX_INDEX = 2**31 - 1


def _id_ok(v, limit=MAX_ID) -> bool:
    return isinstance(v, str) and 0 < len(v) <= limit


def _index_ok(v) -> bool:
    return isinstance(v, int) and 0 <= v <= MAX_INDEX


def _lps_ok(v) -> bool:
    return all(math.isfinite(x) and -1e4 <= x <= 0 for x in v)


def valid(e) -> bool:
    """The issue's domains, restated independently of pipeline/events.py."""
    if isinstance(e, Turn):
        return (_id_ok(e.session_id) and (e.turn_index is None or _index_ok(e.turn_index))
                and (e.turn_type != "main" or e.turn_index is not None)
                and all(t >= 0 for t in e.prompt_token_ids + e.response_token_ids) and _lps_ok(e.response_logprobs)
                and (len(e.response_logprobs) == len(e.response_token_ids) or
                     (e.source == "import" and not e.response_logprobs))
                and _index_ok(e.policy_version) and e.created_at >= 0
                and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in e.messages)
                and (e.logprob_temperature is None or 0 < e.logprob_temperature <= 100))
    if isinstance(e, SessionEnd):
        return _id_ok(e.session_id) and _id_ok(e.reason) and (e.turn_index is None or _index_ok(e.turn_index)) \
            and e.created_at >= 0 and (e.outcome is None or -1 <= e.outcome <= 1)
    if isinstance(e, Feedback):  # issue 40: a score in [-1, 1], a known source, a non-blank comment
        return (_id_ok(e.session_id) and _index_ok(e.turn_index) and -1 <= e.score <= 1 and _id_ok(e.feedback_id)
                and e.source in ("user", "reviewer", "app") and e.created_at >= 0
                and (e.comment is None or 0 < len(e.comment.strip()) and len(e.comment) <= 8000)
                and all(v is None or _id_ok(v) for v in (e.turn_request_id, e.response_id, e.tenant)))
    if isinstance(e, Sample):
        r = e.response_length
        ok = (_id_ok(e.sample_id, 4 * MAX_ID) and _id_ok(e.session_id) and _index_ok(e.turn_index)
              and _index_ok(e.policy_version) and 0 <= r <= len(e.tokens) and all(t >= 0 for t in e.tokens)
              and 0 < e.rollout_temperature <= 100 and (e.reward is None or -1 <= e.reward <= 1)
              and (e.reward_source is None or (e.reward is not None and all(
                  p in ("judge", "feedback", "outcome") for p in e.reward_source.split("+")))))
        for lps in (e.rollout_log_probs, e.teacher_log_probs):
            ok = ok and (lps is None or (len(lps) == r and _lps_ok(lps)))
        return ok
    return False


def base_records() -> list:
    turn = Turn(session_id="sess-1", turn_index=3, request_id="req-1", created_at=1_000, policy_version=2,
                messages=[{"role": "user", "content": "hi"}], prompt_token_ids=[1, 2, 3],
                response_token_ids=[4, 5, 6], response_logprobs=[-0.5, -1.25, -3.0], finish_reason="stop",
                logprob_temperature=0.6)
    end = SessionEnd(session_id="sess-1", reason="header", created_at=2_000, turn_index=3)
    sample = Sample(sample_id="sess-1:3:combine:req-1", session_id="sess-1", turn_index=3, policy_version=2,
                    kind="opd+rl", tokens=[1, 2, 3, 4, 5, 6], response_length=3,
                    rollout_log_probs=[-0.5, -1.25, -3.0], rollout_temperature=0.6, reward=1.0,
                    teacher_log_probs=[-0.25, -1.0, -2.0], votes=[[1, 1, None], [1, -1, 1]], hint="h",
                    judge="llm", created_at=3_000, turn_created_at=1_000)
    feedback = Feedback(session_id="sess-1", turn_index=3, score=-1.0, feedback_id="fb-1", turn_request_id="req-1",
                        response_id="chatcmpl-req-1", comment="use metres", source="reviewer", created_at=2_500)
    sample.reward_source, sample.reward_rule, sample.feedback_score = "judge+feedback", "weighted", -1.0
    return [turn, end, sample, feedback]


#: (event type, field, bad value): each outside the field's domain (or of the wrong type/length)
BAD = {
    "turn": [("session_id", ""), ("session_id", "x" * 257), ("turn_index", -1), ("turn_index", 2**40),
             ("policy_version", -3), ("created_at", -1), ("response_logprobs", [-3e38, -1.0, -1.0]),
             ("response_logprobs", [0.5, -1.0, -1.0]), ("response_logprobs", [-1.0]),
             ("response_token_ids", [-7, 5, 6]), ("prompt_token_ids", [1, -2]), ("messages", ["hi"]),
             ("messages", [{"content": "no role"}]), ("logprob_temperature", 1e9), ("logprob_temperature", 0.0),
             ("turn_index", "3"), ("session_id", 5)],
    "session_end": [("session_id", ""), ("session_id", "y" * 300), ("turn_index", -1), ("turn_index", 2**40),
                    ("reason", ""), ("created_at", -5), ("outcome", 1.5), ("outcome", float("nan")),
                    ("outcome", "good")],
    "feedback": [("session_id", ""), ("turn_index", -1), ("score", 2.0), ("score", float("nan")), ("score", None),
                 ("score", "1"), ("source", "boss"), ("comment", " "), ("comment", "x" * 8001), ("feedback_id", ""),
                 ("response_id", "r" * 300), ("created_at", -1)],
    "sample": [("sample_id", ""), ("session_id", ""), ("turn_index", -1), ("turn_index", 2**40),
               ("teacher_log_probs", [-3e38, -1.0, -2.0]), ("rollout_log_probs", [-1.0, 2.0, -1.0]),
               ("teacher_log_probs", [-1.0, -1.0]), ("reward", 3.0), ("reward", -1e30), ("tokens", [-1, 2, 3, 4, 5, 6]),
               ("rollout_temperature", 0.0), ("rollout_temperature", 1e6), ("votes", [[7, 1], [1]]),
               ("policy_version", -1), ("response_length", 9), ("reward_source", "votes"),
               ("reward_source", "feedback+judge"), ("reward_rule", "max"), ("feedback_score", 1.5),
               ("hint_source", "oracle")],
}
PACKED = {"prompt_token_ids": "<i4", "response_token_ids": "<i4", "tokens": "<i4", "response_logprobs": "<f4",
          "rollout_log_probs": "<f4", "teacher_log_probs": "<f4"}


def _with(ev, name, value) -> bytes:
    """``ev`` encoded with ``name`` replaced by ``value`` on the wire (bypassing encode's checks)."""
    obj = msgpack.unpackb(encode(ev), raw=False)
    obj[name] = np.asarray(value, dtype=PACKED[name]).tobytes() if name in PACKED and isinstance(value, list) \
        else value
    return msgpack.packb(obj, use_bin_type=True)


@pytest.mark.parametrize("etype,name,value", [(t, n, v) for t, items in BAD.items() for n, v in items],
                         ids=lambda x: str(x)[:20])
def test_out_of_domain_field_is_refused_naming_it(etype, name, value):
    ev = next(e for e in base_records() if e.TYPE == etype)
    with pytest.raises(MalformedEvent) as err:
        decode(_with(ev, name, value))
    assert f"{etype}.{name}" in str(err.value), str(err.value)


def test_valid_records_decode():
    for ev in base_records():
        assert valid(ev) and decode(encode(ev)) == ev


def _flip(data: bytes, rng: random.Random) -> bytes:
    b = bytearray(data)
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] = rng.randrange(256)
    return bytes(b)


def test_fuzz_no_invalid_record_is_accepted():
    """1000 corrupted records (half field-level, half byte flips): every accepted one is valid,
    every field-level corruption is refused."""
    rng = random.Random(24)
    accepted = refused = 0
    for i in range(1000):
        ev = rng.choice(base_records())
        if i % 2 == 0:
            name, value = rng.choice(BAD[ev.TYPE])
            data = _with(ev, name, value)
        else:
            data = _flip(encode(ev), rng)
        try:
            got = decode(data)
        except events.EventError as e:
            refused += 1
            assert str(e)  # the reason the dead-letter record carries
            continue
        assert i % 2 == 1, f"field corruption accepted: {got}"
        assert valid(got), f"invalid record accepted: {got}"
        accepted += 1
    assert refused >= 500 and accepted + refused == 1000
