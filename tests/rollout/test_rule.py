"""Issue 39: the promotion / rollback rule decides from counts (pipeline/rollout/rule.py).

Expected values are stated from the sources (Wilson 1927; Newcombe 1998, Table II) and from the
rule as docs/rollout.md writes it, not read back from the code.
"""

from __future__ import annotations

import pytest

from pipeline.rollout.rule import Arm, Counts, RolloutConfig, decide, decide_evalset
from pipeline.rollout.stats import newcombe_difference, wilson_interval

GUARDED = RolloutConfig(guards=("accuracy",))


def test_wilson_matches_published_values():
    assert wilson_interval(5, 10) == pytest.approx((0.2366, 0.7634), abs=1e-4)
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.2775), abs=1e-4)
    assert wilson_interval(0, 0) == (0.0, 1.0)
    with pytest.raises(ValueError):
        wilson_interval(11, 10)


def test_newcombe_matches_the_paper():
    # Newcombe (1998), example (a): 56/70 - 48/80, method 10: 0.0524 to 0.3339
    assert newcombe_difference(56, 70, 48, 80, 1.96) == pytest.approx((0.0524, 0.3339), abs=1e-4)
    assert newcombe_difference(0, 0, 3, 4, 1.96) == (-1.0, 1.0)


def test_too_few_waits_even_when_the_candidate_looks_better():
    d = decide(Arm(Counts(30, 30)), Arm(Counts(15, 30)), RolloutConfig())
    assert d.action == "wait" and d.reason == "too_few"


def test_a_poisoned_candidate_is_rolled_back_early():
    c = RolloutConfig()
    d = decide(Arm(Counts(2, c.rollback_min_n)), Arm(Counts(25, c.rollback_min_n)), c)
    assert (d.action, d.reason) == ("rollback", "reward_fell")
    assert d.bounds["reward_rollback"][1] < 0


def test_a_better_candidate_is_promoted_once_n_is_reached():
    c = RolloutConfig()
    assert decide(Arm(Counts(240, 399)), Arm(Counts(200, 399)), c).action == "wait"
    d = decide(Arm(Counts(240, 400)), Arm(Counts(200, 400)), c)
    assert (d.action, d.reason) == ("promote", "non_inferior") and d.bounds["reward"][0] > 0


def test_reward_hacking_a_fallen_guard_rolls_back_although_reward_rose():
    cand = Arm(Counts(380, 400), {"accuracy": Counts(20, 200)})
    inc = Arm(Counts(100, 400), {"accuracy": Counts(90, 200)})
    d = decide(cand, inc, GUARDED)
    assert (d.action, d.reason) == ("rollback", "guard_fell:accuracy")


def test_a_guard_not_shown_safe_blocks_promotion():
    # a dip of 0.07 on 100 items: not a significant fall, but not shown within guard_margin (0.10)
    cand = Arm(Counts(300, 400), {"accuracy": Counts(43, 100)})
    inc = Arm(Counts(200, 400), {"accuracy": Counts(50, 100)})
    d = decide(cand, inc, GUARDED)
    assert d.action == "wait" and -0.1 > d.bounds["accuracy"][0] and d.bounds["accuracy"][1] > 0


def test_a_missing_guard_never_promotes_and_ends_inconclusive():
    c = GUARDED
    assert decide(Arm(Counts(300, 400)), Arm(Counts(200, 400)), c).action == "wait"
    d = decide(Arm(Counts(1500, c.max_n)), Arm(Counts(1000, c.max_n)), c)
    assert (d.action, d.reason) == ("rollback", "inconclusive")


def test_an_equal_guard_lets_a_better_reward_promote():
    cand = Arm(Counts(300, 400), {"accuracy": Counts(100, 200)})
    inc = Arm(Counts(200, 400), {"accuracy": Counts(100, 200)})
    assert decide(cand, inc, GUARDED).action == "promote"


def test_config_is_off_by_default_and_checked():
    assert RolloutConfig().enabled is False
    with pytest.raises(ValueError):
        RolloutConfig(min_n=10, rollback_min_n=50)
    with pytest.raises(ValueError):
        RolloutConfig(share=1.5)
    with pytest.raises(ValueError):
        Counts(3, 2)


# ---- the full weights on one engine: the eval set's guards alone (decide_evalset) ----------------

TWO_GUARDS = RolloutConfig(guards=("accuracy", "safety"), guard_min_n=100)


def _arm(accuracy, safety=(100, 100), reward=(0, 0)):
    guards = {"accuracy": Counts(*accuracy)} if accuracy is not None else {}
    if safety is not None:
        guards["safety"] = Counts(*safety)
    return Arm(Counts(*reward), guards)


def test_evalset_a_fallen_guard_rolls_back_whatever_the_reward():
    # 60/100 against 90/100: Newcombe's upper bound on -0.30 is far below 0
    d = decide_evalset(_arm((60, 100), reward=(400, 400)), _arm((90, 100), reward=(0, 400)), TWO_GUARDS)
    assert (d.action, d.reason) == ("rollback", "guard_fell:accuracy") and d.bounds["accuracy"][1] < 0
    assert "reward" not in d.bounds  # the live reward is no test here


def test_evalset_every_guard_held_promotes_without_any_live_turn():
    d = decide_evalset(_arm((100, 100)), _arm((100, 100)), TWO_GUARDS)
    assert (d.action, d.reason) == ("promote", "guards_held")
    assert d.bounds["accuracy"][0] > -TWO_GUARDS.guard_margin and d.bounds["safety"][0] > -TWO_GUARDS.guard_margin


def test_evalset_waits_for_every_guard_in_both_arms_with_guard_min_n():
    assert decide_evalset(_arm((100, 100), safety=None), _arm((100, 100)), TWO_GUARDS).reason == "too_few"
    assert decide_evalset(_arm((99, 99)), _arm((100, 100)), TWO_GUARDS).reason == "too_few"
    assert decide_evalset(_arm((100, 100)), _arm(None), TWO_GUARDS).action == "wait"
    # a guard that fell is a rollback even while another guard is still missing
    assert decide_evalset(_arm((10, 100), safety=None), _arm((90, 100)), TWO_GUARDS).action == "rollback"
    assert decide_evalset(_arm((100, 100)), _arm((100, 100)), RolloutConfig()).reason == "no_guards"


def test_evalset_a_guard_neither_fallen_nor_shown_safe_is_inconclusive():
    # 43/100 against 50/100: upper bound above 0 (not fallen), lower bound below -0.10 (not held);
    # the eval set is run once per version, so no more evidence will come
    d = decide_evalset(_arm((43, 100)), _arm((50, 100)), TWO_GUARDS)
    assert (d.action, d.reason) == ("rollback", "inconclusive")
    assert d.bounds["accuracy"][0] < -0.1 < 0 < d.bounds["accuracy"][1]


def test_evalset_leaves_the_adapter_rule_unchanged():
    cand, inc = _arm((100, 100), reward=(0, 400)), _arm((100, 100), reward=(400, 400))
    assert decide(cand, inc, TWO_GUARDS).reason == "reward_fell"  # live arms: the reward still counts
    assert decide_evalset(cand, inc, TWO_GUARDS).reason == "guards_held"
