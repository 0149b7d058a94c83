"""Explicit feedback and session outcomes in the judge: which reward a turn trains with.

A turn can have up to three reward sources (:data:`pipeline.events.REWARD_SOURCES`):

- ``judge``: the PRM majority vote on its next state (``rl``: any vote, a 0 included; ``combine``:
  only a +-1 vote is an RL signal, as without feedback; ``opd``: none);
- ``feedback``: the latest ``feedback`` event read for it before it was decided (its ``score``);
- ``outcome``: the session outcome's discounted credit (:meth:`pipeline.judge.join.Joiner._credit`).

An absent source contributes nothing (never a 0). :class:`RewardPolicy` combines the present ones:

- ``precedence`` (default): the first present source in ``judge.reward_order`` (default
  ``feedback, outcome, judge``: explicit feedback wins) is the reward. The judge is not asked
  for votes when a source before it decides;
- ``weighted``: ``sum(w_s * r_s) / sum(w_s)`` over the present sources with a weight above 0
  (``judge.reward_weights``): a weighted mean, so it stays in [-1, 1].

A feedback ``comment`` is the turn's hint (``hint_source: feedback``): the teacher scores the
student's response under it (``opd``/``combine``), and no hint judge is asked. A turn with explicit
feedback or an outcome is always trained (loss_mask 1): it is a real signal, whatever the
at-least-one rule would have said.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline import events
from pipeline.judge.samples import make_sample


@dataclass(frozen=True)
class RewardPolicy:
    """How a turn's reward sources are combined (see the module docstring)."""

    rule: str = "precedence"
    order: tuple = ("feedback", "outcome", "judge")
    weights: dict = field(default_factory=lambda: {"judge": 1.0, "feedback": 1.0, "outcome": 1.0})

    def __post_init__(self) -> None:
        if self.rule not in events.REWARD_RULES:
            raise ValueError(f"judge.reward_rule must be one of {events.REWARD_RULES}, got {self.rule!r}")
        if sorted(self.order) != sorted(events.REWARD_SOURCES):
            raise ValueError(f"judge.reward_order must order exactly {events.REWARD_SOURCES}, got {self.order!r}")
        bad = {k: w for k, w in self.weights.items() if k not in events.REWARD_SOURCES or not w >= 0}
        if bad:
            raise ValueError(f"judge.reward_weights: unknown source or negative weight {bad}")

    @classmethod
    def of(cls, jc) -> RewardPolicy:
        """The policy of a :class:`pipeline.config.JudgeConfig`."""
        return cls(jc.reward_rule, tuple(jc.reward_order),
                   {**{"judge": 1.0, "feedback": 1.0, "outcome": 1.0}, **jc.reward_weights})

    def needs_judge(self, feedback: float | None, outcome: float | None) -> bool:
        """Whether the judge's votes can change the reward of a turn with these sources."""
        if self.rule == "weighted":
            return self.weights.get("judge", 0.0) > 0
        present = {"feedback": feedback, "outcome": outcome}
        return not any(present.get(s) is not None for s in self.order[:self.order.index("judge")])

    def decide(self, judge: float | None, feedback: float | None,
               outcome: float | None) -> tuple[float | None, str | None]:
        """``(reward, reward_source)`` from the present sources; ``(None, None)`` when none counts."""
        present = {k: v for k, v in (("judge", judge), ("feedback", feedback), ("outcome", outcome))
                   if v is not None}
        if self.rule == "precedence":
            first = next((s for s in self.order if s in present), None)
            return (None, None) if first is None else (float(present[first]), first)
        used = [s for s in events.REWARD_SOURCES if s in present and self.weights.get(s, 0.0) > 0]
        if not used:
            return None, None
        total = sum(self.weights[s] for s in used)
        value = sum(self.weights[s] * present[s] for s in used) / total
        return max(-1.0, min(1.0, value)), "+".join(used)


def explicit_sample(turn: events.Turn, mode: str, *, reward: float | None, source: str | None, rule: str,
                    feedback: events.Feedback | None, outcome: float | None, hint: str | None,
                    hint_source: str | None, teacher, votes, judge: str, decided_at: int) -> events.Sample | None:
    """The sample of a turn with explicit feedback or a session outcome, or None when it carries
    no signal (every source weighted 0 and no teacher). ``sample_id`` is the mode's, so a turn
    gives one sample whichever source decided it."""
    if reward is None and teacher is None:
        return None
    s = make_sample(turn, mode, reward=reward, loss_mask=1, votes=votes, hint=hint, teacher=teacher, judge=judge,
                    decided_at=decided_at)
    s.reward_source, s.reward_rule = source, rule if reward is not None else None
    s.feedback_score = None if feedback is None else float(feedback.score)
    s.outcome_reward = None if outcome is None else float(outcome)
    s.hint_source = hint_source if hint is not None else None
    s.validate()
    return s
