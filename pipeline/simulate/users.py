"""Simulated users: one coroutine per session, talking to the proxy like a real client.

GSM8K session (OpenClaw-RL's "user gives feedback on the answer" loop):

1. the user asks a problem (``X-Session-Id``, ``X-Turn-Type: main``);
2. the reply is graded (:mod:`pipeline.simulate.grading`) and answered with thanks, "too long"
   or a correction with a hint (:mod:`pipeline.simulate.feedback`);
3. after thanks, or after ``max_turns`` graded replies, the last feedback is sent in a request
   carrying ``X-Session-Done: true``: the proxy publishes the feedback as the ``next_state`` of
   the previous turn, then that request's own turn, then ``session_end``. That closing turn has
   no next state (the judge masks or drops it), so its ``max_tokens`` is small by default.

With ``UserSettings.thumbs`` (``--thumbs``), each graded reply also gets the user's thumb through
``POST /v1/feedback`` before the next request: +1 when the reply had the rewarded property, -1
otherwise, with a correction's worked step as the comment (the OPD hint). The judge then takes the
thumb as the turn's reward (explicit feedback takes precedence: docs/feedback.md).

MT-Bench session: the first question, the model's answer, then the real second-turn follow-up
(the ``next_state`` of turn 1) sent with ``X-Session-Done: true``; turn 2 has no next state.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass, field

from pipeline.engine_api.errors import EngineError
from pipeline.simulate.client import ChatClient, ChatReply
from pipeline.simulate.datasets import GSM8KProblem, MTBenchQuestion
from pipeline.simulate.feedback import decide
from pipeline.simulate.grading import count_words, grade_reply


@dataclass
class UserSettings:
    """Knobs of a simulated user (CLI flags of ``pipeline simulate``).

    Units: ``max_tokens`` / ``closing_max_tokens`` / ``max_reply_tokens`` in tokens,
    ``max_words`` in words (:func:`pipeline.simulate.grading.count_words`).
    """

    feedback: str = "brevity"
    max_turns: int = 3
    max_tokens: int = 96
    closing_max_tokens: int = 16
    temperature: float = 1.0
    max_words: int = 40
    max_reply_tokens: int = 64
    system_prompt: str | None = None
    thumbs: bool = False  # also send each graded reply's thumbs (+1 success, -1 else) to POST /v1/feedback


@dataclass
class TurnRecord:
    """One assistant reply as logged by the simulator (one JSONL line of ``--log``).

    ``closing`` marks the closing reply of a GSM8K session (sent with ``X-Session-Done``, answered
    by nobody, excluded from the reply statistics); ``graded`` is False for it and for MT-Bench
    replies (no gold answer); ``success``/``correct``/``brief`` are None when not graded.
    """

    session_id: str
    dataset: str
    item_id: str
    turn: int
    policy_version: str | None
    graded: bool
    words: int
    completion_tokens: int | None
    finish_reason: str | None
    brief: bool | None
    correct: bool | None
    success: bool | None
    feedback_kind: str | None
    feedback: str | None
    reply: str
    latency_s: float
    closing: bool = False
    time_ms: int = field(default_factory=lambda: int(time.time() * 1000))

    def to_json(self) -> dict:
        """Plain data for the JSONL log."""
        return asdict(self)


@dataclass
class SessionResult:
    """All logged replies of one session; ``error`` is set if a request failed (session cut short)."""

    session_id: str
    records: list[TurnRecord]
    error: str | None = None
    requests: int = 0


async def _ask(client: ChatClient, result: SessionResult, messages: list[dict], *, max_tokens: int,
               settings: UserSettings, done: bool) -> ChatReply:
    result.requests += 1
    return await client.chat(messages, max_tokens=max_tokens, temperature=settings.temperature,
                             session_id=result.session_id, turn_type="main", session_done=done)


def _start(settings: UserSettings, first: str) -> list[dict]:
    msgs = [{"role": "system", "content": settings.system_prompt}] if settings.system_prompt else []
    msgs.append({"role": "user", "content": first})
    return msgs


async def gsm8k_session(client: ChatClient, session_id: str, problem: GSM8KProblem, settings: UserSettings,
                        seed: int = 0, on_record=None) -> SessionResult:
    """Run one GSM8K session (module docstring); never raises on HTTP trouble (see ``error``)."""
    rng = random.Random(f"{seed}:{session_id}")
    result = SessionResult(session_id, [])
    messages = _start(settings, problem.question)
    corrections = 0
    try:
        for k in range(settings.max_turns):
            reply = await _ask(client, result, messages, max_tokens=settings.max_tokens, settings=settings,
                               done=False)
            grade = grade_reply(reply.content, completion_tokens=reply.completion_tokens,
                                finish_reason=reply.finish_reason, gold=problem.answer.final,
                                max_words=settings.max_words, max_tokens=settings.max_reply_tokens)
            fb = decide(settings.feedback, grade, problem.answer, rng, max_words=settings.max_words,
                        corrections_so_far=corrections)
            corrections += fb.kind == "correction"
            if settings.thumbs and reply.id:  # the explicit signal: a thumb, a correction's hint as its comment
                await client.feedback(reply.id, 1.0 if fb.success else -1.0, comment=fb.hint)
            rec = TurnRecord(session_id, "gsm8k", problem.id, k, reply.policy_version, True, grade.words,
                             reply.completion_tokens, reply.finish_reason, grade.brief, grade.correct, fb.success,
                             fb.kind, fb.text, reply.content, reply.latency_s)
            _emit(result, rec, on_record)
            messages = messages + [{"role": "assistant", "content": reply.content},
                                   {"role": "user", "content": fb.text}]
            if fb.success or k == settings.max_turns - 1:
                closing = await _ask(client, result, messages, max_tokens=settings.closing_max_tokens,
                                     settings=settings, done=True)
                _emit(result, _ungraded(session_id, "gsm8k", problem.id, k + 1, closing, closing=True), on_record)
                break
    except EngineError as e:
        result.error = str(e)
    return result


async def mt_bench_session(client: ChatClient, session_id: str, question: MTBenchQuestion, settings: UserSettings,
                           seed: int = 0, on_record=None) -> SessionResult:
    """Run one MT-Bench session: each real user turn in order, the last with ``X-Session-Done``."""
    result = SessionResult(session_id, [])
    messages = _start(settings, question.turns[0])
    try:
        for k in range(len(question.turns)):
            last = k == len(question.turns) - 1
            reply = await _ask(client, result, messages, max_tokens=settings.max_tokens, settings=settings,
                               done=last)
            _emit(result, _ungraded(session_id, "mt_bench", question.id, k, reply), on_record)
            if not last:
                messages = messages + [{"role": "assistant", "content": reply.content},
                                       {"role": "user", "content": question.turns[k + 1]}]
    except EngineError as e:
        result.error = str(e)
    return result


def _ungraded(session_id: str, dataset: str, item_id: str, turn: int, reply: ChatReply,
              closing: bool = False) -> TurnRecord:
    return TurnRecord(session_id, dataset, item_id, turn, reply.policy_version, False, count_words(reply.content),
                      reply.completion_tokens, reply.finish_reason, None, None, None, None, None, reply.content,
                      reply.latency_s, closing=closing)


def _emit(result: SessionResult, rec: TurnRecord, on_record) -> None:
    result.records.append(rec)
    if on_record is not None:
        on_record(rec)
