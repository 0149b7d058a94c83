"""Building :class:`pipeline.events.Sample` events from judged turns, per mode.

Modes (OpenClaw-RL):

- ``rl`` (Binary RL / GRPO): every main turn gives one sample, kind ``rl``. reward = the PRM
  majority vote in {-1, 0, 1}; loss_mask 0 when the turn has no next state, its generation did
  not finish, or the vote is 0, except for the at-least-one candidate (see
  :mod:`pipeline.judge.join`), trained with reward 0.
- ``opd`` (hindsight On-Policy Distillation): a judged turn with a hint and teacher log-probs
  gives one sample, kind ``opd`` (no reward). No hint, no teacher, or no next state: no sample.
- ``combine``: at most one sample per judged turn, its ``kind`` naming the signals it carries:
  hint (teacher log-probs) and a ±1 vote -> ``opd+rl``; hint only -> ``opd``; ±1 vote only ->
  ``rl`` (no teacher log-probs: never the rollout log-probs as a stand-in); neither -> none.

Absence is explicit, never a value that could be read as data: no teacher -> empty
``teacher_log_probs`` (and a kind without ``opd``); no reward -> a kind without ``rl``; no
rollout log-probs (an imported turn was never sampled) -> empty ``rollout_log_probs``.

A sample is a function of the records alone, so a replay (at any speed, after a restart)
produces identical samples: ``sample_id`` is ``<session>:<turn_index>:<mode>:<request_id>``
(the turn's own ``request_id``, copied by a replay; unique per request, so a new conversation
reusing a session id never shares an id), ``created_at`` is the event time (ms) of the record
that decided the sample (the next state, the session end, the superseding turn), and
``rollout_temperature`` is the turn's recorded effective temperature. ``votes``: rl: the PRM
votes (int, None = failed); opd: the hint votes; combine: ``[PRM votes, hint votes]``.
"""

from __future__ import annotations

import hashlib

from pipeline import events
from pipeline.sampling import effective_temperature

MODES = ("rl", "opd", "combine")


def turn_key(turn: events.Turn) -> str:
    """The turn's identity within its session: its ``request_id``, or (records without one) a
    digest of its content (``h`` + 16 hex of sha256 over created_at, prompt and response ids)."""
    if turn.request_id:
        return turn.request_id
    h = hashlib.sha256()
    h.update(f"{turn.session_id}|{turn.turn_index}|{turn.created_at}|".encode())
    h.update(repr((list(turn.prompt_token_ids), list(turn.response_token_ids))).encode())
    return "h" + h.hexdigest()[:16]


def sample_id(turn: events.Turn, mode: str) -> str:
    """The deterministic id of ``turn``'s sample in ``mode`` (see the module docstring)."""
    return f"{turn.session_id}:{turn.turn_index}:{mode}:{turn_key(turn)}"


def rollout_temperature(turn: events.Turn) -> float:
    """The temperature ``turn.response_logprobs`` are of (> 0): the recorded effective
    temperature, else (records that predate it, imports) the request's temperature under the
    engine's rule (greedy -> 1.0, unset -> 1.0)."""
    if turn.logprob_temperature is not None:
        return float(turn.logprob_temperature)
    try:
        return effective_temperature((turn.sampling or {}).get("temperature"))
    except ValueError:
        return 1.0


def make_sample(turn: events.Turn, mode: str, *, kind: str, reward: float, loss_mask: int, decided_at: int,
                votes=(), hint: str | None = None, teacher=None, judge: str = "") -> events.Sample:
    """One sample for ``turn``; ``teacher`` is a :class:`pipeline.judge.teacher.TeacherOutput`
    (R log-probs, optional R*k top-k) or None; ``decided_at`` is the deciding record's event time
    (ms). ``reward`` is only meaningful when ``kind`` contains ``rl``."""
    resp = list(turn.response_token_ids)
    r = len(resp)
    lps = list(turn.response_logprobs) if r and len(turn.response_logprobs) == r else []
    s = events.Sample(
        sample_id=sample_id(turn, mode), session_id=turn.session_id, turn_index=turn.turn_index,
        policy_version=turn.policy_version, kind=kind, tokens=list(turn.prompt_token_ids) + resp,
        response_length=r, rollout_log_probs=lps, rollout_temperature=rollout_temperature(turn),
        reward=float(reward), loss_mask=int(loss_mask) if r else 0, votes=list(votes), hint=hint, judge=judge,
        created_at=int(decided_at), turn_created_at=turn.created_at, source=turn.source)
    if teacher is not None:
        s.teacher_log_probs = list(teacher.log_probs)
        if teacher.topk_ids:
            s.teacher_top_k = len(teacher.topk_ids) // r if r else 0
            s.teacher_topk_ids = list(teacher.topk_ids)
            s.teacher_topk_log_probs = list(teacher.topk_log_probs)
    return s


def rl_sample(turn, verdict, candidate: bool, judge: str, decided_at: int) -> events.Sample:
    """Binary RL sample of a judged turn (``verdict``: :class:`Verdict`)."""
    mask = 1 if (verdict.score != 0 or candidate) else 0
    return make_sample(turn, "rl", kind="rl", reward=verdict.score, loss_mask=mask, votes=verdict.votes,
                       judge=judge, decided_at=decided_at)


def rl_flush_sample(turn, judge: str, decided_at: int) -> events.Sample:
    """Binary RL sample of a turn that was not judged (no next state, or its generation did not
    finish): reward 0, loss_mask 0 (accounting only)."""
    return make_sample(turn, "rl", kind="rl", reward=0.0, loss_mask=0, judge=judge, decided_at=decided_at)


def opd_sample(turn, hint: str, teacher, votes, judge: str, decided_at: int) -> events.Sample:
    """OPD sample: teacher log-probs under the hint; no reward (kind ``opd``)."""
    return make_sample(turn, "opd", kind="opd", reward=0.0, loss_mask=1, votes=votes, hint=hint, teacher=teacher,
                       judge=judge, decided_at=decided_at)


def combine_sample(turn, score: int, hint: str | None, teacher, votes, judge: str,
                   decided_at: int) -> events.Sample | None:
    """Combine sample, or None when there is neither teacher log-probs nor a ±1 vote.

    ``teacher`` is the hinted teacher output (None when there is no hint, the teacher failed or
    cannot score this turn); ``hint`` is recorded only with it.
    """
    has_rl = score in (1, -1)
    if teacher is not None:
        return make_sample(turn, "combine", kind="opd+rl" if has_rl else "opd", reward=score if has_rl else 0.0,
                           loss_mask=1, votes=votes, hint=hint, teacher=teacher, judge=judge, decided_at=decided_at)
    if has_rl:
        return make_sample(turn, "combine", kind="rl", reward=score, loss_mask=1, votes=votes, judge=judge,
                           decided_at=decided_at)
    return None
