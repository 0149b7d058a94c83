"""Building :class:`pipeline.events.Sample` events from judged turns, per mode.

Every sample says which training signals it carries (see :class:`pipeline.events.Sample`): a
reward (None: no RL signal), teacher log-probs (None: no hint) and rollout log-probs (None: not
recorded by an engine, e.g. an imported conversation). Nothing absent is written as a value.

Modes (OpenClaw-RL):

- ``rl`` (Binary RL / GRPO): every main turn gives one sample. reward = the PRM majority vote in
  {-1, 0, 1} (a real 0 when the judge voted 0); loss_mask 0 when the vote is 0, except for the
  at-least-one candidate (see :mod:`pipeline.judge.join`), trained with reward 0. A turn that
  was not judged (no next state, or its generation did not finish) gives a sample with no
  reward and loss_mask 0 (accounting only); so does a turn whose votes all failed (backend
  errors, unparseable answers): no judgement is not a vote of 0, and such a turn is never
  promoted by the at-least-one rule.
- ``opd`` (hindsight On-Policy Distillation): a judged turn with a hint and teacher log-probs
  gives one sample with no reward. No hint, no teacher, or no next state: no sample.
- ``combine``: at most one sample per judged turn. A ±1 vote is the RL signal (a vote of 0, or
  no vote because every vote failed, is none), teacher log-probs under an accepted hint the OPD signal: both -> kind ``opd+rl``; hint
  only -> ``opd``; vote only -> ``rl`` (never the rollout log-probs as a stand-in teacher);
  neither -> no sample.

A sample is a function of the records alone, so a replay (at any speed, after a restart)
produces identical samples: ``sample_id`` is ``<session>:<turn_index>:<mode>:<request_id>``
(the turn's own ``request_id``, copied by a replay; unique per request, so a new conversation
reusing a session id never shares an id), prefixed by ``<tenant>/`` for a turn with a tenant
(each tenant its own id space); ``tenant`` and ``adapter`` are the turn's, ``created_at`` is the
event time (ms) of the record that decided the sample (the next state, the session end, the
superseding turn), and
``rollout_temperature`` is the turn's recorded effective temperature. ``votes``: rl: the PRM
votes (int, None = failed); opd: the hint votes; combine: ``[PRM votes, hint votes]``.
"""

from __future__ import annotations

import hashlib

from pipeline import events
from pipeline.sampling import effective_temperature

MODES = ("rl", "opd", "combine")
KIND = {"rl": "rl", "opd": "opd", "combine": "opd+rl"}  # the mode's kind when a sample carries no signal


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
    sid = f"{turn.session_id}:{turn.turn_index}:{mode}:{turn_key(turn)}"
    return sid if turn.tenant is None else f"{turn.tenant}/{sid}"


def rollout_temperature(turn: events.Turn) -> float:
    """The temperature (> 0) the turn's log-probs were computed at: the recorded effective
    temperature (``logprob_temperature``), else (records that predate it, imports) the engines'
    rule applied to the requested ``sampling.temperature`` (greedy -> 1.0, unset -> 1.0; a value
    no engine accepts -> 1.0)."""
    if turn.logprob_temperature is not None:
        return float(turn.logprob_temperature)
    try:
        return effective_temperature((turn.sampling or {}).get("temperature"))
    except ValueError:
        return 1.0


def rollout_log_probs(turn: events.Turn) -> list[float] | None:
    """The turn's rollout log-probs, or None when it has none for its response tokens."""
    lps = list(turn.response_logprobs)
    return lps if len(lps) == len(turn.response_token_ids) and (lps or turn.source != "import") else None


def make_sample(turn: events.Turn, mode: str, *, reward: float | None, loss_mask: int, decided_at: int | None = None,
                votes=(), hint: str | None = None, teacher=None, judge: str = "") -> events.Sample:
    """One sample for ``turn``.

    Args:
        reward: the RL signal, or None (none).
        teacher: a :class:`pipeline.judge.teacher.TeacherOutput` (the OPD signal: R log-probs,
            optional R*k top-k), or None.
        loss_mask: 1 to train; forced to 0 for an empty response.
        decided_at: the event time (ms) of the record that decided the sample (default: the
            turn's own event time).
    Raises:
        pipeline.events.MalformedEvent: loss_mask 1 without any signal, or arrays of the wrong length.
    """
    resp = list(turn.response_token_ids)
    r = len(resp)
    s = events.Sample(
        sample_id=sample_id(turn, mode), session_id=turn.session_id,
        turn_index=turn.turn_index, policy_version=turn.policy_version,
        kind=events.sample_kind(reward is not None, teacher is not None) or KIND[mode],
        tokens=list(turn.prompt_token_ids) + resp, response_length=r, rollout_log_probs=rollout_log_probs(turn),
        rollout_temperature=rollout_temperature(turn), reward=None if reward is None else float(reward),
        loss_mask=int(loss_mask) if r else 0, votes=list(votes), hint=hint, judge=judge,
        created_at=int(turn.created_at if decided_at is None else decided_at), turn_created_at=turn.created_at,
        source=turn.source, tenant=turn.tenant, adapter=dict(turn.adapter) if turn.adapter is not None else None)
    if teacher is not None:
        s.teacher_log_probs = list(teacher.log_probs)
        s.teacher_model, s.teacher_version = teacher.model, teacher.version
        if teacher.topk_ids:
            s.teacher_top_k = len(teacher.topk_ids) // r if r else 0
            s.teacher_topk_ids = list(teacher.topk_ids)
            s.teacher_topk_log_probs = list(teacher.topk_log_probs)
    s.validate()
    return s


def rl_sample(turn, verdict, candidate: bool, judge: str, decided_at: int | None = None) -> events.Sample:
    """Binary RL sample of a judged turn (``verdict``: :class:`Verdict`); reward = the vote.

    ``verdict.score`` None (every vote failed) gives no reward and loss_mask 0 whatever
    ``candidate`` says: the sample is carried for accounting (its failed votes), never trained.
    """
    if verdict.score is None:
        return make_sample(turn, "rl", reward=None, loss_mask=0, votes=verdict.votes, judge=judge,
                           decided_at=decided_at)
    mask = 1 if (verdict.score != 0 or candidate) else 0
    return make_sample(turn, "rl", reward=verdict.score, loss_mask=mask, votes=verdict.votes,
                       judge=judge, decided_at=decided_at)


def rl_flush_sample(turn, judge: str, decided_at: int | None = None) -> events.Sample:
    """Binary RL sample of a turn that was not judged (no next state, or its generation did not
    finish): no reward, loss_mask 0 (accounting only)."""
    return make_sample(turn, "rl", reward=None, loss_mask=0, judge=judge, decided_at=decided_at)


def opd_sample(turn, hint: str, teacher, votes, judge: str, decided_at: int | None = None) -> events.Sample:
    """OPD sample: teacher log-probs under the hint, no reward."""
    return make_sample(turn, "opd", reward=None, loss_mask=1, votes=votes, hint=hint, teacher=teacher, judge=judge,
                       decided_at=decided_at)


def combine_sample(turn, score: int | None, hint: str | None, teacher, votes, judge: str,
                   decided_at: int | None = None) -> events.Sample | None:
    """Combine sample, or None when there is neither teacher log-probs nor a ±1 vote.

    ``teacher`` is the hinted teacher output (None when there is no hint, the teacher failed or
    cannot score this turn); ``hint`` is recorded only with it. A vote of 0, or ``score`` None
    (every vote failed), is no RL signal.
    """
    reward = float(score) if score in (1, -1) else None
    if teacher is None and reward is None:
        return None
    return make_sample(turn, "combine", reward=reward, loss_mask=1, votes=votes,
                       hint=hint if teacher is not None else None, teacher=teacher, judge=judge,
                       decided_at=decided_at)
