"""Advantages and losses against hand-computed values (clip boundaries, dual-clip, masks, empty)."""

from __future__ import annotations

import math

import pytest
import torch

from pipeline.trainer import loss as L

T = torch.tensor


def close(a, b, tol=1e-6):
    return torch.allclose(torch.as_tensor(a, dtype=torch.float32), torch.as_tensor(b, dtype=torch.float32),
                          atol=tol, rtol=0)


# ------------------------------------------------------------------ advantages


def test_grpo_broadcasts_reward_over_response_tokens():
    mask = T([[0, 1, 1, 0], [0, 0, 1, 1]])
    adv = L.grpo_advantages(T([1.0, -1.0]), mask)
    assert close(adv, [[0, 1, 1, 0], [0, 0, -1, -1]])


def test_grpo_normalization_by_hand():
    # rewards 1, 0, -1, 0: mean 0, Bessel-corrected std sqrt(2/3) = 0.81649658 (slime's)
    adv = L.grpo_advantages(T([1.0, 0.0, -1.0, 0.0]), torch.ones(4, 1), normalize=True, eps=0.0)
    s = math.sqrt(2 / 3)
    assert close(adv[:, 0], [1 / s, 0, -1 / s, 0], 1e-5)
    # equal rewards or one sample: zero advantage, never NaN
    assert close(L.grpo_advantages(T([1.0, 1.0]), torch.ones(2, 3), normalize=True), torch.zeros(2, 3))
    assert close(L.grpo_advantages(T([1.0]), torch.ones(1, 3), normalize=True), torch.zeros(1, 3))


def test_opd_is_teacher_minus_old_on_mask():
    adv = L.opd_advantages(T([[-1.0, -0.5, -2.0]]), T([[-3.0, -0.25, -1.0]]), T([[0, 1, 1]]))
    assert close(adv, [[0.0, -0.25, -1.0]])


def test_combine_weights():
    g, o = T([[1.0, 1.0]]), T([[0.5, -2.0]])
    assert close(L.combine_advantages(g, o, w_rl=0.5, w_opd=2.0), [[1.5, -3.5]])


# ------------------------------------------------------------------ KL


def test_kl_estimators_by_hand():
    lp, ref = T([-1.0, -2.0]), T([-1.5, -1.0])  # log_ratio = 0.5, -1.0
    assert close(L.approx_kl(lp, ref, "k1"), [0.5, -1.0])
    assert close(L.approx_kl(lp, ref, "k2"), [0.125, 0.5])
    k3 = [math.exp(-0.5) - 1 + 0.5, math.exp(1.0) - 1 - 1.0]
    assert close(L.approx_kl(lp, ref, "k3"), k3)
    assert close(L.approx_kl(lp, ref, "low_var_kl"), k3)
    # low_var_kl clamps at 10, k3 does not
    assert L.approx_kl(T([-20.0]), T([0.0]), "k3").item() > 1e8
    assert L.approx_kl(T([-20.0]), T([0.0]), "low_var_kl").item() == 10.0
    assert close(L.approx_kl(T([-1.0]), T([-1.0]), "k3"), [0.0])
    with pytest.raises(ValueError):
        L.approx_kl(lp, ref, "k4")


# ------------------------------------------------------------------ PPO clip


def _ppo(ratio, adv, **kw):
    lp = torch.log(T(ratio))
    return L.ppo_policy_loss(lp, torch.zeros_like(lp), T(adv), **kw)


def test_ppo_clip_boundaries_asymmetric():
    # eps_clip 0.2 (low), eps_clip_high 0.28 (DAPO clip-higher)
    ratio = [1.0, 1.2, 1.3, 0.9, 0.7, 1.3, 0.7]
    adv = [1.0, 1.0, 1.0, 1.0, 1.0, -1.0, -1.0]
    loss, clipfrac, ppo_kl = _ppo(ratio, adv, eps_clip=0.2, eps_clip_high=0.28)
    # A>0: loss = -A * min(r, 1.28) ; r=0.9 and 0.7 are not clipped from below for A>0 (max picks -r)
    # A<0: loss = A... = max(-A r, -A clamp(r)) = max(r, clamp(r)); r=1.3 -> 1.3 (unclipped),
    #      r=0.7 -> clamp 0.8 -> loss 0.8 (clipped)
    want = [-1.0, -1.2, -1.28, -0.9, -0.7, 1.3, 0.8]
    assert close(loss, want, 1e-6)
    assert close(clipfrac, [0, 0, 1, 0, 0, 0, 1])
    assert close(ppo_kl, [-math.log(r) for r in ratio], 1e-6)


def test_ppo_exactly_at_the_boundary_is_not_clipped():
    loss, clipfrac, _ = _ppo([1.25], [1.0], eps_clip=0.2, eps_clip_high=0.25)
    assert close(loss, [-1.25]) and clipfrac.item() == 0.0


def test_ppo_symmetric_default_high():
    loss, clipfrac, _ = _ppo([1.5, 0.5], [1.0, -1.0], eps_clip=0.2)
    assert close(loss, [-1.2, 0.8]) and close(clipfrac, [1, 1])


def test_dual_clip_caps_negative_advantage_loss():
    # A = -1, ratio 5: standard loss = max(5, 1.28) = 5; dual-clip c=3 caps at -A*c = 3
    loss, _, _ = _ppo([5.0, 2.0, 5.0], [-1.0, -1.0, 1.0], eps_clip=0.2, eps_clip_high=0.28, eps_clip_c=3.0)
    assert close(loss, [3.0, 2.0, -1.28])
    with pytest.raises(ValueError):
        _ppo([1.0], [1.0], eps_clip=0.2, eps_clip_c=1.0)


def test_ppo_gradient_is_zero_when_clipped():
    lp = torch.log(T([1.5, 1.1])).requires_grad_()
    loss, _, _ = L.ppo_policy_loss(lp, torch.zeros(2), T([1.0, 1.0]), 0.2, 0.28)
    loss.sum().backward()
    assert close(lp.grad, [0.0, -1.1], 1e-6)  # d(-r)/dlp = -r on the unclipped token


def test_truncated_is_weights():
    w = L.truncated_is_weights(T([0.0, 0.0, 0.0]), torch.log(T([0.5, 1.0, 4.0])), cap=1.5, floor=0.6)
    assert close(w, [1.5, 1.0, 0.6], 1e-6)  # exp(old - rollout) = 2, 1, 0.25


# ------------------------------------------------------------------ aggregation


def test_sum_of_sample_mean_and_token_mean_by_hand():
    v = T([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    m = T([[1, 1, 1], [1, 0, 0]])
    # sample means 2 and 4 -> (2 + 4) / 2 = 3 ; token mean (1+2+3+4) / 4 = 2.5
    assert close(L.aggregate(v, m, "sum_of_sample_mean"), 3.0)
    assert close(L.aggregate(v, m, "token_mean"), 2.5)
    # weights: sample 2 at half weight
    assert close(L.aggregate(v, m, "sum_of_sample_mean", sample_weights=T([1.0, 0.5])), 2.0)


def test_aggregate_over_micro_batches_sums_to_the_batch():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(6, 5, generator=g)
    m = (torch.rand(6, 5, generator=g) > 0.4).to(torch.float32)
    m[2] = 0  # a fully masked sample
    for mode in ("sum_of_sample_mean", "token_mean"):
        whole = L.aggregate(v, m, mode)
        ns, nt = int((m.sum(-1) > 0).sum()), int(m.sum())
        parts = sum(L.aggregate(v[i:i + 2], m[i:i + 2], mode, num_samples=ns, num_tokens=nt) for i in (0, 2, 4))
        assert close(parts, whole, 1e-6)


def _poison(x, mask, bad):
    """``x`` with ``bad`` (NaN, inf or -inf) at every masked-out position."""
    return torch.where(mask.bool(), x, torch.full_like(x, bad))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), 1e30])
def test_masked_positions_do_not_matter(bad):
    """Whatever sits at a masked-out position (padding, prompt, loss_mask 0: NaN, inf, huge), the
    loss, every statistic and the gradient are finite and exactly those of clean inputs (NaN x 0 is
    NaN: masking must select, not multiply)."""
    g = torch.Generator().manual_seed(0)
    n, length = 3, 6
    mask = T([[0, 1, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0]])
    clean = {k: -torch.rand(n, length, generator=g) for k in ("lp", "old", "ref", "rollout", "teacher", "train")}
    clean["adv"] = torch.randn(n, length, generator=g)
    clean["ent"] = torch.rand(n, length, generator=g)

    def run(inputs: dict):
        lp = inputs["lp"].clone().requires_grad_(True)
        adv = L.combine_advantages(L.grpo_advantages(T([1.0, -1.0, 0.5]), mask),
                                   L.opd_advantages(inputs["teacher"], inputs["old"], mask)) + inputs["adv"]
        params = L.LossParams(eps_clip=0.2, eps_clip_c=3.0, entropy_coef=0.01, kl_coef=0.1, tis_cap=2.0, agg=agg)
        loss, stats = L.policy_loss(lp, inputs["old"], adv, mask, params, entropy=inputs["ent"],
                                    ref_log_probs=inputs["ref"], rollout_log_probs=inputs["rollout"],
                                    train_log_probs=inputs["train"])
        loss.backward()
        return loss, stats, lp.grad

    dirty = {k: _poison(v, mask, bad) for k, v in clean.items()}
    for agg in ("sum_of_sample_mean", "token_mean"):
        want, got = run(clean), run(dirty)
        assert torch.isfinite(got[0]) and close(got[0], want[0]), (agg, got[0], want[0])
        for k in want[1]:
            assert torch.isfinite(got[1][k]) and close(got[1][k], want[1][k]), (agg, k)
        assert torch.isfinite(got[2]).all() and close(got[2], want[2])  # no NaN reaches the model
        for mode in ("sum_of_sample_mean", "token_mean"):
            assert close(L.aggregate(dirty["adv"], mask, mode), L.aggregate(clean["adv"], mask, mode))


def test_empty_batches_give_zero_not_nan():
    for mode in ("sum_of_sample_mean", "token_mean"):
        empty = torch.zeros(0, 0, requires_grad=True)
        out = L.aggregate(empty, torch.zeros(0, 0), mode)
        assert out.item() == 0.0
        out.backward()  # still part of the graph
        masked = torch.ones(2, 3, requires_grad=True)
        assert L.aggregate(masked, torch.zeros(2, 3), mode).item() == 0.0
    loss, stats = L.policy_loss(torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4), torch.zeros(0, 4),
                                L.LossParams(eps_clip=0.2))
    assert loss.item() == 0.0 and all(not torch.isnan(s) for s in stats.values())


# ------------------------------------------------------------------ staleness


def test_staleness_drop_and_downweight():
    versions = T([5, 4, 2, 0, 7])  # trainer at version 5; a sample "from the future" counts as 0
    assert L.staleness(versions, 5).tolist() == [0, 1, 3, 5, 0]
    w, keep = L.staleness_weights(versions, 5, max_staleness=2, policy="drop")
    assert keep.tolist() == [True, True, False, False, True] and w.tolist() == [1, 1, 0, 0, 1]
    w, keep = L.staleness_weights(versions, 5, max_staleness=2, policy="downweight", decay=0.5)
    assert keep.all() and close(w, [1, 1, 0.5, 0.125, 1])
    w, keep = L.staleness_weights(versions, 5, max_staleness=None)
    assert keep.all() and (w == 1).all()


# ------------------------------------------------------------------ total loss


def test_policy_loss_total_by_hand():
    # one sample, two response tokens; ratio 1 (on-policy), advantage 2 on both tokens
    lp = T([[-1.0, -2.0]], requires_grad=True)
    old = T([[-1.0, -2.0]])
    adv = T([[2.0, 2.0]])
    mask = T([[1.0, 1.0]])
    ent = T([[0.5, 1.5]])
    ref = T([[-1.5, -1.0]])  # k1 = [0.5, -1.0] -> mean -0.25
    params = L.LossParams(eps_clip=0.2, eps_clip_high=0.28, entropy_coef=0.1, kl_coef=0.5, kl_type="k1")
    loss, s = L.policy_loss(lp, old, adv, mask, params, entropy=ent, ref_log_probs=ref)
    # pg = mean(-2 * 1) = -2 ; entropy mean 1.0 ; loss = -2 - 0.1 * 1 + 0.5 * (-0.25) = -2.225
    assert close(s["pg_loss"], -2.0) and close(s["entropy"], 1.0) and close(s["kl"], -0.25)
    assert close(loss, -2.225)
    assert close(s["pg_clipfrac"], 0.0) and close(s["ppo_kl"], 0.0)
    loss.backward()
    # d/dlp: pg: -A * r / 2 = -1 per token ; kl k1: +0.5 / 2 = 0.25 per token
    assert close(lp.grad, [[-0.75, -0.75]])


def test_policy_loss_with_tis_needs_rollout_and_train_log_probs():
    lp = T([[0.0]])
    tis = L.LossParams(eps_clip=0.2, tis_cap=2.0)
    with pytest.raises(ValueError):
        L.policy_loss(lp, lp, lp, T([[1.0]]), tis, train_log_probs=lp)
    with pytest.raises(ValueError):  # the ratio is trainer vs engine: the trainer's log-probs are needed
        L.policy_loss(lp, lp, lp, T([[1.0]]), tis, rollout_log_probs=lp)
    loss, s = L.policy_loss(lp, lp, T([[1.0]]), T([[1.0]]), tis, rollout_log_probs=T([[-math.log(4.0)]]),
                            train_log_probs=lp)
    assert close(s["tis"], 2.0) and close(loss, -2.0)  # exp(0 + log 4) = 4, capped at 2
    no_tis = L.LossParams(eps_clip=0.2)
    assert "tis" not in L.policy_loss(lp, lp, T([[1.0]]), T([[1.0]]), no_tis)[1]  # TIS off: no figure


def test_tis_weight_is_trainer_vs_rollout_not_the_ppo_behaviour_log_probs():
    """PPO behaviour = the rollout log-probs (``old_log_probs: rollout``): the TIS weight must still
    be exp(trainer - rollout), per token, truncated (was exp(rollout - rollout) = 1: a no-op).
    A sample without rollout log-probs has weight 1 in the loss and is not in the ``tis`` figure."""
    rollout = T([[-1.0, -1.0, -1.0], [0.0, 0.0, 0.0]])
    train = T([[-0.7, -1.3, -0.95], [-2.0, -2.0, -2.0]])  # the trainer before the update
    lp = train.clone().requires_grad_(True)
    mask = T([[1, 1, 1], [1, 1, 1]])
    adv = T([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    has_rollout = torch.tensor([True, False])
    old = torch.where(has_rollout[:, None], rollout, train)
    cap, floor = 1.2, 0.9
    params = L.LossParams(eps_clip=0.2, eps_clip_high=0.28, tis_cap=cap, tis_floor=floor)
    loss, s = L.policy_loss(lp, old, adv, mask, params, rollout_log_probs=rollout, train_log_probs=train,
                            has_rollout=has_rollout)
    # by hand: weights clip(exp([0.3, -0.3, 0.05]), 0.9, 1.2) = [1.2, 0.9, 1.05127]
    w = [min(max(math.exp(d), floor), cap) for d in (0.3, -0.3, 0.05)]
    assert w[:2] == [1.2, 0.9]
    assert close(s["tis"], sum(w) / 3)  # the imported row's weight 1 is not counted
    # per token: PPO loss -A * clip(ratio) with ratio exp(train - rollout) = exp(d), times w
    ratio = [math.exp(d) for d in (0.3, -0.3, 0.05)]
    pg0 = [max(-r, -min(max(r, 0.8), 1.28)) * wi for r, wi in zip(ratio, w)]
    want = (sum(pg0) / 3 + (-1.0)) / 2  # the imported row: ratio 1, weight 1
    assert close(loss, want)
    assert "tis" not in L.policy_loss(lp, old, adv, mask, L.LossParams(eps_clip=0.2, tis_cap=cap),
                                      rollout_log_probs=rollout, train_log_probs=train,
                                      has_rollout=torch.tensor([False, False]))[1]
