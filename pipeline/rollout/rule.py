"""The promotion / rollback rule: from per-arm counts, ``promote``, ``rollback`` or ``wait``.

Pure and deterministic: the same counts and config always give the same :class:`Decision`, so
a replay of the records (:mod:`pipeline.rollout.fold`) decides the same. The test (docs/rollout.md):

- ``d = p_candidate - p_incumbent`` of each metric (the live judged reward rate, and each guard
  of the eval set) is bounded by Newcombe's hybrid score interval
  (:func:`pipeline.rollout.stats.newcombe_difference`) at ``z`` (one-sided, 1.645: 95%).
- **rollback** when a guard fell (its upper bound on ``d`` < 0, both arms with
  ``guard_min_n``), or the reward fell (upper bound at ``rollback_z`` (2.326: 99% one-sided,
  stricter because the live reward is looked at after every sample) < 0, both arms with
  ``rollback_min_n``);
  a guard that fell rolls back even when the reward rose (the reward-hacking case);
- **promote** when both arms have ``min_n`` judged turns, the reward is non-inferior
  (lower bound on ``d`` > ``-margin``) and every configured guard is present in both arms
  (``guard_min_n``) and non-inferior (lower bound > ``-guard_margin``);
- **rollback** (``inconclusive``) when both arms reached ``max_n`` without a promotion;
- **wait** otherwise.

The **full weights on one engine** (:func:`decide_evalset`, rule :data:`EVALSET_RULE_NAME`): once
the candidate is live the one engine serves it to everyone, so there are no live arms to compare
and the eval set's guards alone decide (the live reward is still counted in the evidence):

- **rollback** ``guard_fell:<name>`` when a guard fell (as above);
- **promote** ``guards_held`` when every configured guard is present in both arms with
  ``guard_min_n`` items and non-inferior (lower bound > ``-guard_margin``);
- **rollback** ``inconclusive`` when every guard is present with ``guard_min_n`` items but one is
  neither fallen nor shown non-inferior (an eval set is run once per version: no more evidence
  will come);
- **wait** otherwise (``too_few``: a guard missing or below ``guard_min_n``; ``no_guards``: none
  configured, which the config refuses for full weights).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.rollout.stats import newcombe_difference

#: the decisions the rule gives
DECISIONS = ("promote", "rollback", "wait")
#: the name of the rule in every decision's evidence (change it when the rule changes)
RULE_NAME = "newcombe-noninferiority-v1"
#: the name of the full weights' eval-set gate (:func:`decide_evalset`) in its evidence
EVALSET_RULE_NAME = "newcombe-evalset-v1"


@dataclass(frozen=True)
class Counts:
    """``successes`` out of ``n`` (a judged reward > 0, or a guard's check passed).
    Raises ValueError unless 0 <= successes <= n."""

    successes: int = 0
    n: int = 0

    def __post_init__(self):
        if not 0 <= self.successes <= self.n:
            raise ValueError(f"successes {self.successes} not in [0, n={self.n}]")

    def add(self, success: bool) -> "Counts":
        return Counts(self.successes + bool(success), self.n + 1)


@dataclass(frozen=True)
class Arm:
    """One version's evidence: live judged reward counts and the eval set's guard counts by name."""

    reward: Counts = Counts()
    guards: dict = field(default_factory=dict)  # name -> Counts


@dataclass(frozen=True)
class RolloutConfig:
    """The rule's parameters (units: judged turns per arm; rates in [0, 1]).

    ``enabled``: False (the default) keeps today's behaviour: no canary, no decisions.
    ``share``: the canary's share of new sessions. ``guards``: the eval-set metrics that must
    not fall (empty: none). Defaults and their measured error rates: docs/rollout.md.
    Raises ValueError on an out-of-range value.
    """

    enabled: bool = False
    share: float = 0.1
    min_n: int = 400
    rollback_min_n: int = 50
    max_n: int = 2000
    margin: float = 0.05
    guard_margin: float = 0.10
    guard_min_n: int = 100
    z: float = 1.645
    rollback_z: float = 2.326
    guards: tuple = ()

    def __post_init__(self):
        if not 0.0 < self.share < 1.0:
            raise ValueError(f"rollout.share must be in (0, 1), got {self.share}")
        if not 1 <= self.rollback_min_n <= self.min_n <= self.max_n:
            raise ValueError("rollout needs 1 <= rollback_min_n <= min_n <= max_n")
        if not (0 <= self.margin < 1 and 0 <= self.guard_margin < 1 and self.z > 0 and self.rollback_z > 0
                and self.guard_min_n >= 1):
            raise ValueError("rollout.margin, guard_margin in [0, 1), z, rollback_z > 0, guard_min_n >= 1")


@dataclass(frozen=True)
class Decision:
    """The rule's answer: ``action`` in :data:`DECISIONS`, ``reason`` (``guard_fell:<name>``,
    ``reward_fell``, ``non_inferior``, ``inconclusive``, ``too_few``, ``undecided``; the eval-set
    gate's also ``guards_held`` and ``no_guards``) and
    ``bounds``: metric name (``reward`` or a guard; ``reward_rollback``: the reward's at ``rollback_z``, on a
    ``reward_fell``) -> ``[low, high]`` on candidate - incumbent."""

    action: str
    reason: str
    bounds: dict


def _bounds(cand: Counts, inc: Counts, z: float) -> list[float]:
    low, high = newcombe_difference(cand.successes, cand.n, inc.successes, inc.n, z)
    return [round(low, 6), round(high, 6)]


def _guards(candidate: Arm, incumbent: Arm, config: RolloutConfig, bounds: dict) -> tuple[str | None, bool, bool]:
    """Bound every configured guard into ``bounds`` (name -> ``[low, high]``) in config order and
    return ``(fallen, ready, held)``: the first guard whose upper bound is below 0 (None: none; the
    loop stops there), whether every guard is present in both arms with ``guard_min_n`` items,
    and whether every guard bounded so far is non-inferior (lower bound > ``-guard_margin``)."""
    ready = held = True
    for name in config.guards:
        c, i = candidate.guards.get(name), incumbent.guards.get(name)
        if c is None or i is None or min(c.n, i.n) < config.guard_min_n:
            ready = False
            continue
        bounds[name] = b = _bounds(c, i, config.z)
        if b[1] < 0:
            return name, ready, False
        held = held and b[0] > -config.guard_margin
    return None, ready, held


def decide(candidate: Arm, incumbent: Arm, config: RolloutConfig) -> Decision:
    """The rule of this module's docstring on ``candidate`` vs ``incumbent`` (live arms)."""
    bounds = {"reward": _bounds(candidate.reward, incumbent.reward, config.z)}
    fallen, ready, held = _guards(candidate, incumbent, config, bounds)
    if fallen is not None:
        return Decision("rollback", f"guard_fell:{fallen}", bounds)
    n = min(candidate.reward.n, incumbent.reward.n)
    fell = _bounds(candidate.reward, incumbent.reward, config.rollback_z)
    if n >= config.rollback_min_n and fell[1] < 0:
        return Decision("rollback", "reward_fell", {**bounds, "reward_rollback": fell})
    if n >= config.min_n and ready and held and bounds["reward"][0] > -config.margin:
        return Decision("promote", "non_inferior", bounds)
    if n >= config.max_n:
        return Decision("rollback", "inconclusive", bounds)
    return Decision("wait", "too_few" if n < config.min_n else "undecided", bounds)


def decide_evalset(candidate: Arm, incumbent: Arm, config: RolloutConfig) -> Decision:
    """The eval-set gate of the full weights on one engine (this module's docstring): the guards
    alone decide; ``bounds`` holds each guard bounded (no ``reward``: it is not a test here).
    Pure, as :func:`decide`."""
    if not config.guards:
        return Decision("wait", "no_guards", {})
    bounds: dict = {}
    fallen, ready, held = _guards(candidate, incumbent, config, bounds)
    if fallen is not None:
        return Decision("rollback", f"guard_fell:{fallen}", bounds)
    if not ready:
        return Decision("wait", "too_few", bounds)
    return Decision("promote", "guards_held", bounds) if held else Decision("rollback", "inconclusive", bounds)
