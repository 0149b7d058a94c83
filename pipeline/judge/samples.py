"""Building :class:`pipeline.events.Sample` events from judged turns, per mode.

Modes (OpenClaw-RL):

- ``rl`` (Binary RL / GRPO): every main turn gives one sample, kind ``rl``. reward = the PRM
  majority vote in {-1, 0, 1}; loss_mask 0 when the turn has no next state or the vote is 0,
  except for the at-least-one candidate (see :mod:`pipeline.judge.join`), trained with reward 0.
- ``opd`` (hindsight On-Policy Distillation): a judged turn with a hint gives one sample, kind
  ``opd``, reward 0, loss_mask 1, teacher log-probs under the hinted prompt. No hint, or no next
  state: no sample.
- ``combine``: one sample per judged turn, kind ``opd+rl``: hint and a ±1 vote -> teacher
  log-probs + reward; hint only -> teacher log-probs, reward 0; ±1 vote only -> teacher
  log-probs = rollout log-probs (no distillation signal) + reward; neither -> no sample.

``sample_id`` is ``<session>:<turn_index>:<mode>``: a replayed turn reproduces its id.
``votes``: rl: the PRM votes (int, None = failed); opd: the hint votes; combine:
``[PRM votes, hint votes]``.
"""

from __future__ import annotations

from pipeline import events

MODES = ("rl", "opd", "combine")
KIND = {"rl": "rl", "opd": "opd", "combine": "opd+rl"}


def sample_id(session_id: str, turn_index: int, mode: str) -> str:
    """The deterministic id of a turn's sample in ``mode``."""
    return f"{session_id}:{turn_index}:{mode}"


def rollout_temperature(turn: events.Turn) -> float:
    """The sampling temperature the turn's log-probs refer to (1.0 when unspecified)."""
    t = (turn.sampling or {}).get("temperature")
    try:
        return 1.0 if t is None else float(t)
    except (TypeError, ValueError):
        return 1.0


def make_sample(turn: events.Turn, mode: str, *, reward: float, loss_mask: int, votes=(),
                hint: str | None = None, teacher=None, judge: str = "") -> events.Sample:
    """One sample for ``turn``; ``teacher`` is a :class:`pipeline.judge.teacher.TeacherOutput` or None.

    Turns imported without rollout log-probs carry zeros (``source`` tells the trainer).
    """
    resp = list(turn.response_token_ids)
    r = len(resp)
    lps = list(turn.response_logprobs) if len(turn.response_logprobs) == r else [0.0] * r
    s = events.Sample(
        sample_id=sample_id(turn.session_id, turn.turn_index, mode), session_id=turn.session_id,
        turn_index=turn.turn_index, policy_version=turn.policy_version, kind=KIND[mode],
        tokens=list(turn.prompt_token_ids) + resp, response_length=r, rollout_log_probs=lps,
        rollout_temperature=rollout_temperature(turn), reward=float(reward),
        loss_mask=int(loss_mask) if r else 0, votes=list(votes), hint=hint, judge=judge,
        created_at=events.now_ms(), turn_created_at=turn.created_at, source=turn.source)
    if teacher is not None:
        s.teacher_log_probs = list(teacher.log_probs)
        if teacher.topk_ids:
            s.teacher_top_k = len(teacher.topk_ids) // r if r else 0
            s.teacher_topk_ids = list(teacher.topk_ids)
            s.teacher_topk_log_probs = list(teacher.topk_log_probs)
    return s


def rl_sample(turn, verdict, candidate: bool, judge: str) -> events.Sample:
    """Binary RL sample of a judged turn (``verdict``: :class:`Verdict`)."""
    mask = 1 if (verdict.score != 0 or candidate) else 0
    return make_sample(turn, "rl", reward=verdict.score, loss_mask=mask, votes=verdict.votes, judge=judge)


def rl_flush_sample(turn, judge: str) -> events.Sample:
    """Binary RL sample of a turn that never got a next state (reward 0, loss_mask 0)."""
    return make_sample(turn, "rl", reward=0.0, loss_mask=0, judge=judge)


def opd_sample(turn, hint: str, teacher, votes, judge: str) -> events.Sample:
    """OPD sample: teacher log-probs under the hint, reward 0."""
    return make_sample(turn, "opd", reward=0.0, loss_mask=1, votes=votes, hint=hint, teacher=teacher, judge=judge)


class _SameAsRollout:
    def __init__(self, turn) -> None:
        r = len(turn.response_token_ids)
        self.log_probs = list(turn.response_logprobs) if len(turn.response_logprobs) == r else [0.0] * r
        self.topk_ids, self.topk_log_probs = [], []


def combine_sample(turn, score: int, hint: str | None, teacher, votes, judge: str) -> events.Sample | None:
    """Combine sample, or None when there is neither a usable hint nor a ±1 vote.

    ``teacher`` is the hinted teacher output (None when there is no hint or it failed).
    """
    if teacher is not None:
        return make_sample(turn, "combine", reward=score, loss_mask=1, votes=votes, hint=hint,
                           teacher=teacher, judge=judge)
    if score != 0:
        return make_sample(turn, "combine", reward=score, loss_mask=1, votes=votes,
                           teacher=_SameAsRollout(turn), judge=judge)
    return None
