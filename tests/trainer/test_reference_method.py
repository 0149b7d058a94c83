"""The independent reference (``tests/reference_method.py``): hand values from the method's
definitions, and the trainer's pure loss functions compared with it on random inputs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests import reference_method as ref
from pipeline.trainer import loss as L


# ------------------------------------------------------------------ the reference by hand


@pytest.mark.parametrize("votes, want", [
    ([1, 1, -1], 1.0), ([1, -1], 0.0), ([1, -1, 0], 0.0), ([None, None], None), ([], None),
    ([None, -1, None], -1.0), ([0, 0, 1], 0.0), ([-1, -1, 1, 1, 0], 0.0), ([1], 1.0),
])
def test_majority_vote(votes, want):
    assert ref.majority_vote(votes) == want


def test_hint_selection_by_hand():
    assert ref.select_hint([(1, "a longer hint here"), (1, "the longest hint of all"), (-1, None)]) == \
        "the longest hint of all"
    assert ref.select_hint([(-1, None), (-1, None), (1, "  one is enough  ")]) == "one is enough"
    assert ref.select_hint([(1, "ten chars!"), (1, "  padded   "), (None, "failed vote, long")]) is None
    assert ref.select_hint([(1, "first of two"), (1, "second of 2")]) == "first of two"
    assert ref.select_hint([]) is None


def test_judge_dispatch():
    assert ref.rl_signals(None) == (None, 0) and ref.rl_signals(0) == (0.0, 0) and ref.rl_signals(-1) == (-1.0, 1)
    assert ref.combine_signals(1, True) == (1.0, True)
    assert ref.combine_signals(0, True) == (None, True)
    assert ref.combine_signals(-1, False) == (-1.0, False)
    assert ref.combine_signals(0, False) is None
    assert ref.combine_signals(None, False) is None and ref.combine_signals(None, True) == (None, True)
    assert ref.opd_signals(True) == (None, True) and ref.opd_signals(False) is None


def test_grpo_broadcast_and_normalisation_over_rewarded_samples():
    assert ref.rl_advantages([1.0, None, -1.0]) == [1.0, 0.0, -1.0]
    got = ref.rl_advantages([1.0, 1.0, None, None], normalize=True)
    assert got == [0.0, 0.0, 0.0, 0.0]  # the two rewarded samples agree: nothing to prefer
    got = ref.rl_advantages([3.0, None, 1.0], normalize=True, eps=0.0)
    assert got == pytest.approx([2 ** -0.5, 0.0, -(2 ** -0.5)])  # mean 2, Bessel std sqrt(2 / 1)
    got = ref.rl_advantages([1.0, 0.0, -1.0, 0.0], normalize=True, eps=0.0)
    assert got == pytest.approx([1.5 ** 0.5, 0.0, -(1.5 ** 0.5), 0.0])  # std sqrt(2 / 3)
    assert ref.rl_advantages([1.0, None], normalize=True) == [0.0, 0.0]  # one rewarded sample: no spread
    assert ref.grpo_broadcast(-1.0, 3).tolist() == [-1.0, -1.0, -1.0]


def test_opd_and_combine_by_hand():
    assert ref.opd_advantage([-0.5, -2.0], [-1.0, -1.0]).tolist() == [0.5, -1.0]
    assert ref.opd_advantage(None, [-1.0, -1.0]).tolist() == [0.0, 0.0]
    # issue 11 case 3: a vote and no hint is [1, 1, 1], whatever the old log-probs
    s = ref.RefSample(3, reward=1.0)
    adv = ref.token_advantages([s], [[-2.3, -0.1, -1.0]])[0]
    assert adv.tolist() == [1.0, 1.0, 1.0]
    both = ref.RefSample(2, reward=-1.0, teacher=[-0.5, -2.0], rollout=[-1.0, -1.0])
    assert ref.token_advantages([both], [[-1.0, -1.0]], w_rl=2.0, w_opd=0.5)[0].tolist() == [-1.75, -2.5]


def test_behaviour_log_probs():
    sampled = ref.RefSample(2, reward=1.0, rollout=[-1.0, -2.0])
    imported = ref.RefSample(2, reward=1.0)
    assert ref.behaviour_log_probs(sampled, [-3.0, -3.0]).tolist() == [-1.0, -2.0]
    assert ref.behaviour_log_probs(sampled, [-3.0, -3.0], "recompute").tolist() == [-3.0, -3.0]
    assert ref.behaviour_log_probs(imported, [-3.0, -3.0]).tolist() == [-3.0, -3.0]


def test_ppo_clip_by_hand():
    # ratio 1.5, A = +1: clipped at 1 + 0.28; ratio 0.5, A = -1: clipped at 1 - 0.2
    loss, clipped, _ = ref.ppo_clip([math.log(1.5), math.log(0.5)], [0.0, 0.0], [1.0, -1.0], 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-1.28, 0.8]) and clipped.tolist() == [1.0, 1.0]
    # ratio 0.5, A = +1: unclipped branch (-0.5) is the max
    loss, clipped, _ = ref.ppo_clip([math.log(0.5)], [0.0], [1.0], 0.2, 0.28)
    assert loss.tolist() == pytest.approx([-0.5]) and clipped.tolist() == [0.0]
    # dual clip: ratio 5, A = -1: min(max(5, 1.28), 3) = 3
    loss, _, _ = ref.ppo_clip([math.log(5.0)], [0.0], [-1.0], 0.2, 0.28, dual_clip=3.0)
    assert loss.tolist() == pytest.approx([3.0])


def test_kl_estimators_by_hand():
    d = math.log(2.0)  # logp - ref
    assert ref.kl([d], [0.0], "k1").tolist() == pytest.approx([d])
    assert ref.kl([d], [0.0], "k2").tolist() == pytest.approx([d * d / 2])
    assert ref.kl([d], [0.0], "k3").tolist() == pytest.approx([0.5 - 1 + d])
    assert ref.kl([-20.0], [0.0], "low_var_kl").tolist() == [10.0]


def test_tis_and_aggregation_by_hand():
    assert ref.tis_weights([0.0, 0.0], [-math.log(4.0), math.log(4.0)], cap=2.0, floor=0.5).tolist() == \
        pytest.approx([2.0, 0.5])
    assert ref.tis_weights([0.0, 0.0], None, cap=2.0).tolist() == [1.0, 1.0]
    x = [np.array([1.0, 3.0]), np.array([6.0])]
    assert ref.aggregate(x, [1.0, 0.5], "sum_of_sample_mean") == pytest.approx((2.0 + 3.0) / 2)
    assert ref.aggregate(x, [1.0, 0.5], "token_mean") == pytest.approx((4.0 + 3.0) / 3)


def test_mismatch_figure_by_hand():
    samples = [ref.RefSample(2, 1.0, rollout=[-1.0, -1.0], policy_version=3),
               ref.RefSample(2, 1.0, rollout=[-1.0, -1.0], policy_version=2), ref.RefSample(2, 1.0)]
    got = ref.logprob_mismatch(samples, [[-1.0, -1.5], [-2.0, -2.0], [-9.0, -9.0]], trainer_version=3)
    assert got == {"all": pytest.approx(2.5 / 4), "current": pytest.approx(0.25), "stale": pytest.approx(1.0)}
    assert ref.logprob_mismatch(samples[2:], [[-9.0, -9.0]], 3) == {"all": None, "current": None, "stale": None}


# ------------------------------------------------------------------ the trainer's functions vs the reference


@st.composite
def batches(draw):
    n = draw(st.integers(1, 5))
    length = draw(st.integers(1, 6))
    lens = [draw(st.integers(1, length)) for _ in range(n)]
    lp = st.floats(-6.0, -0.01)
    out = []
    for r in lens:
        out.append(dict(
            r=r, reward=draw(st.none() | st.sampled_from([-1.0, 0.0, 1.0, 0.5])),
            teacher=draw(st.none() | st.lists(lp, min_size=r, max_size=r)),
            rollout=draw(st.none() | st.lists(lp, min_size=r, max_size=r)),
            old=draw(st.lists(lp, min_size=r, max_size=r)), logp=draw(st.lists(lp, min_size=r, max_size=r)),
            ref=draw(st.lists(lp, min_size=r, max_size=r)), weight=draw(st.sampled_from([1.0, 0.5, 0.25]))))
    return out, length


def _pad(rows, length, key):
    t = torch.zeros(len(rows), length, dtype=torch.float64)
    for i, row in enumerate(rows):
        if row[key] is not None:
            t[i, :row["r"]] = torch.tensor(row[key], dtype=torch.float64)
    return t


@settings(max_examples=120, deadline=None)
@given(b=batches(), normalize=st.booleans(), w=st.sampled_from([(1.0, 1.0), (0.5, 2.0)]),
       clip=st.sampled_from([(0.2, 0.28, None), (0.1, 0.1, 1.5)]), tis=st.sampled_from([None, (1.5, 0.8)]),
       kl=st.sampled_from(["k1", "k2", "k3", "low_var_kl"]), agg=st.sampled_from(["sum_of_sample_mean", "token_mean"]))
def test_loss_functions_match_the_reference(b, normalize, w, clip, tis, kl, agg):
    rows, length = b
    mask = torch.zeros(len(rows), length, dtype=torch.float64)
    for i, row in enumerate(rows):
        mask[i, :row["r"]] = 1.0
    flag = lambda key: torch.tensor([row[key] is not None for row in rows])  # noqa: E731
    rewards = torch.tensor([row["reward"] or 0.0 for row in rows], dtype=torch.float64)
    old = torch.where(flag("rollout")[:, None], _pad(rows, length, "rollout"), _pad(rows, length, "old"))
    grpo = L.grpo_advantages(rewards, mask, normalize, has_reward=flag("reward")).double()
    opd = L.opd_advantages(_pad(rows, length, "teacher"), old, mask, has_teacher=flag("teacher"))
    adv = L.combine_advantages(grpo, opd, *w)
    logp = _pad(rows, length, "logp")
    params = L.LossParams(eps_clip=clip[0], eps_clip_high=clip[1], eps_clip_c=clip[2], kl_coef=0.1, kl_type=kl,
                          tis_cap=tis[0] if tis else None, tis_floor=tis[1] if tis else 0.0, agg=agg)
    loss, stats = L.policy_loss(
        logp, old, adv, mask, params, ref_log_probs=_pad(rows, length, "ref"),
        rollout_log_probs=_pad(rows, length, "rollout"), train_log_probs=_pad(rows, length, "old"),
        has_rollout=flag("rollout"), sample_weights=torch.tensor([row["weight"] for row in rows], dtype=torch.float64))
    samples = [ref.RefSample(row["r"], row["reward"], row["teacher"], row["rollout"], weight=row["weight"])
               for row in rows]
    want = ref.objective(samples, [row["logp"] for row in rows], [row["old"] for row in rows], w_rl=w[0],
                         w_opd=w[1], normalize=normalize, eps_clip=clip[0], eps_clip_high=clip[1], dual_clip=clip[2],
                         tis_cap=tis[0] if tis else None, tis_floor=tis[1] if tis else 0.0,
                         ref=[row["ref"] for row in rows], kl_coef=0.1, kl_type=kl, agg=agg)
    for i, row in enumerate(rows):
        assert adv[i, :row["r"]].tolist() == pytest.approx(want["advantages"][i].tolist(), abs=1e-6)
        assert (adv[i, row["r"]:] == 0).all()
    # (the KL estimators compute in float32: relative 1e-6 on values up to 10)
    assert float(loss) == pytest.approx(want["loss"], rel=1e-6, abs=1e-6)
    for key in ("pg_loss", "pg_clipfrac", "ppo_kl", "kl"):
        assert float(stats[key]) == pytest.approx(want[key], rel=1e-6, abs=1e-6), key
    if want["tis"] is None:  # TIS off, or no sample with rollout log-probs: no figure (never 0 or 1)
        assert "tis" not in stats
    else:
        assert float(stats["tis"]) == pytest.approx(want["tis"], abs=1e-6)
