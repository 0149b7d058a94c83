"""Advantages and losses of the trainer: small pure tensor functions (no model, no state).

Shapes: ``n`` samples, ``L`` token positions per sample (padded); ``mask`` is ``[n, L]`` with 1
on the positions that predict a response token with ``loss_mask = 1`` and 0 elsewhere. Masking
selects (``torch.where``), never multiplies: whatever a masked-out position holds (padding, NaN,
inf) changes no value and no gradient, since NaN x 0 is NaN. All log-probs are natural-log probabilities (nats) of the sampled token. Everything is written to
follow OpenClaw-RL's use of slime (``slime/utils/ppo_utils.py`` and the policy loss in
``slime/backends/megatron_utils/loss.py``), re-derived here; each docstring names its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from pipeline.config import TrainerConfig

Tensor = torch.Tensor
KLType = Literal["k1", "k2", "k3", "low_var_kl"]
LossAgg = Literal["sum_of_sample_mean", "token_mean"]


# ---------------------------------------------------------------- advantages


def _select(x: Tensor, keep: Tensor) -> Tensor:
    """``x`` where ``keep`` (bool, broadcastable), exactly 0 elsewhere (a NaN or inf there is dropped,
    and no gradient flows to it)."""
    return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))


def grpo_advantages(rewards: Tensor, mask: Tensor, normalize: bool = False, eps: float = 1e-6,
                    has_reward: Tensor | None = None) -> Tensor:
    """GRPO / Binary-RL advantage: each sample's scalar reward broadcast over its response tokens.

    Args:
        rewards: ``[n]`` scalar rewards (Binary RL: the PRM majority vote in {-1, 0, 1}); the
            values of samples without a reward are ignored.
        mask: ``[n, L]`` response-token mask.
        normalize: subtract the mean reward and divide by the **Bessel-corrected** (sample,
            ``n - 1``) standard deviation plus ``eps``, both taken over the samples that carry a
            reward: slime's GRPO group normalisation (``torch.std``'s default), with the batch as
            the group (online samples of a live agent do not come in groups of the same prompt).
            OpenClaw-RL itself runs Binary RL with ``--disable-rewards-normalization`` (reward =
            advantage), which is this function's default; when on, it follows slime. One
            rewarded sample (no ``n - 1`` spread), or equal rewards, give zero advantage (no NaN).
        has_reward: ``[n]`` bool, which samples carry an RL signal (default: all). A sample
            without one gets advantage exactly 0 and takes no part in the normalisation.
    Returns:
        ``[n, L]`` advantages, 0 outside ``mask``.
    Source: OpenClaw-RL Binary RL (reward = advantage), slime ``--advantage-estimator grpo``.
    """
    r = rewards.to(torch.float32)
    present = torch.ones_like(r, dtype=torch.bool) if has_reward is None else has_reward.to(r.device, torch.bool)
    r = torch.where(present, r, torch.zeros_like(r))
    if normalize and bool(present.any()):
        kept = r[present]
        std = kept.std(unbiased=True) if kept.numel() > 1 else torch.zeros((), dtype=r.dtype, device=r.device)
        r = torch.where(present, (r - kept.mean()) / (std + eps), torch.zeros_like(r))
    return r[:, None] * mask.to(r.dtype)


def opd_advantages(teacher_log_probs: Tensor, old_log_probs: Tensor, mask: Tensor,
                   has_teacher: Tensor | None = None) -> Tensor:
    """On-policy distillation advantage: ``teacher log-prob - old log-prob`` per response token.

    Args:
        teacher_log_probs: ``[n, L]`` log p_teacher(token) where the teacher saw the hindsight hint
            (at the sample's rollout temperature).
        old_log_probs: ``[n, L]`` log-probs of the same tokens under the behaviour policy (the
            rollout log-probs, or the trainer's recomputed ones; see ``TrainerConfig.old_log_probs``).
        mask: ``[n, L]``.
        has_teacher: ``[n]`` bool, which samples carry teacher log-probs (default: all); the
            others get advantage exactly 0, whatever their ``teacher_log_probs`` rows hold.
    Returns:
        ``[n, L]``: positive where the hinted teacher likes the token more than the policy did.
    Source: OpenClaw-RL hindsight OPD (token-level advantage = teacher minus student log-prob).
    """
    adv = _select(teacher_log_probs - old_log_probs, mask != 0)
    if has_teacher is not None:
        adv = torch.where(has_teacher.to(adv.device, torch.bool)[:, None], adv, torch.zeros_like(adv))
    return adv


def combine_advantages(grpo: Tensor, opd: Tensor, w_rl: float = 1.0, w_opd: float = 1.0) -> Tensor:
    """OpenClaw-RL's combination: ``w_rl * grpo + w_opd * (teacher - old)``, all ``[n, L]``.

    Each term must already be 0 on samples that lack its signal (see ``has_reward`` /
    ``has_teacher`` above), so a missing signal contributes exactly nothing.
    """
    return w_rl * grpo + w_opd * opd


# ---------------------------------------------------------------- PPO pieces


def approx_kl(log_probs: Tensor, ref_log_probs: Tensor, kind: KLType = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from log-probs of sampled tokens (Schulman's k1/k2/k3).

    With ``log_ratio = log_probs - ref_log_probs``:
    ``k1 = log_ratio``; ``k2 = log_ratio**2 / 2``; ``k3 = exp(-log_ratio) - 1 + log_ratio``
    (non-negative, unbiased); ``low_var_kl`` = k3 clamped to [-10, 10] as in slime.
    Shapes: any, element-wise. Source: http://joschu.net/blog/kl-approx.html, slime
    ``compute_approx_kl``.
    """
    log_ratio = log_probs.float() - ref_log_probs.float()
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return log_ratio.pow(2) / 2
    if kind in ("k3", "low_var_kl"):
        k3 = torch.exp(-log_ratio) - 1 + log_ratio
        return k3.clamp(-10.0, 10.0) if kind == "low_var_kl" else k3
    raise ValueError(f"unknown KL estimator {kind!r} (k1, k2, k3, low_var_kl)")


def ppo_policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, eps_clip: float,
                    eps_clip_high: float | None = None, eps_clip_c: float | None = None
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """PPO clipped surrogate per token, with DAPO's asymmetric clip and optional dual-clip.

    ``ratio = exp(log_probs - old_log_probs)``;
    ``loss = max(-A * ratio, -A * clamp(ratio, 1 - eps_clip, 1 + eps_clip_high))``; with dual-clip
    (``eps_clip_c`` = c > 1) the loss of a negative-advantage token is further capped at ``-A * c``,
    so a huge ratio on a bad token cannot blow up the update.

    Args:
        log_probs: ``[n, L]`` current policy log-probs (with grad).
        old_log_probs: ``[n, L]`` behaviour log-probs (no grad).
        advantages: ``[n, L]``.
        eps_clip: lower clip range; ``eps_clip_high`` upper (default: ``eps_clip``).
        eps_clip_c: dual-clip constant (> 1) or None.
    Returns:
        ``(pg_losses, clipfrac, ppo_kl)``, each ``[n, L]``: per-token loss, 1.0 where the clipped
        branch was taken, and ``old - new`` log-prob (slime's ``ppo_kl``).
    Raises:
        ValueError: ``eps_clip_c <= 1``.
    Source: PPO (Schulman 2017), DAPO clip-higher (Yu 2025), dual-clip (Ye 2020); slime
    ``compute_policy_loss``.
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ppo_kl = old_log_probs - log_probs
    ratio = torch.exp(-ppo_kl)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    loss = torch.maximum(pg1, pg2)
    clipfrac = (pg2 > pg1).float()
    if eps_clip_c is not None:
        if eps_clip_c <= 1.0:
            raise ValueError(f"eps_clip_c must be > 1 for dual-clip, got {eps_clip_c}")
        pg3 = -advantages * eps_clip_c
        loss = torch.where(advantages < 0, torch.minimum(pg3, loss), loss)
    return loss, clipfrac, ppo_kl


def truncated_is_weights(train_log_probs: Tensor, rollout_log_probs: Tensor, cap: float,
                         floor: float = 0.0, has_rollout: Tensor | None = None) -> Tensor:
    """Truncated importance-sampling weights for the rollout-vs-training mismatch (no grad).

    ``w = clamp(exp(train - rollout), floor, cap)``, element-wise ``[n, L]``, where ``train`` is
    the trainer's own log-probs of the sampled tokens under the weights the samples are trained
    from (recomputed before the update: slime's ``log_probs``) and ``rollout`` the log-probs the
    engine reported when it sampled them. The engine (fp32 CPU server, SGLang in bf16) and the
    trainer compute slightly different probabilities; multiplying the per-token policy loss by
    ``w`` corrects that off-policyness while the cap keeps the variance bounded. ``train`` must
    never be the rollout log-probs themselves (the ratio would be 1: no correction), whatever
    the PPO ratio uses as its behaviour log-probs. ``has_rollout`` ``[n]`` bool (default: all): a
    sample without rollout log-probs has nothing to correct and gets weight exactly 1 in the
    loss (and is left out of the TIS statistic, see :func:`policy_loss`). Source: "Your efficient
    RL framework secretly brings you off-policy RL training" (Yao et al., 2025), slime
    ``--use-tis`` (``tis = exp(log_probs - rollout_log_probs)``, clamped to
    ``[tis_clip_low, tis_clip]``).
    """
    w = torch.exp(train_log_probs.detach() - rollout_log_probs.detach()).clamp(min=floor, max=cap)
    if has_rollout is not None:
        w = torch.where(has_rollout.to(w.device, torch.bool)[:, None], w, torch.ones_like(w))
    return w


# ---------------------------------------------------------------- aggregation


def aggregate(values: Tensor, mask: Tensor, mode: LossAgg = "sum_of_sample_mean",
              sample_weights: Tensor | None = None, num_samples: int | None = None,
              num_tokens: int | None = None) -> Tensor:
    """Reduce per-token values ``[n, L]`` to a scalar, consistently across micro-batches.

    - ``sum_of_sample_mean``: each sample's mean over its masked tokens, summed over samples and
      divided by ``num_samples`` (the number of samples with at least one masked token in the
      whole global batch; default: in ``values``). Every sample weighs the same whatever its
      length (slime's default ``sum_of_sample_mean`` divided by the global batch size).
    - ``token_mean``: the sum over all masked tokens divided by ``num_tokens`` (the global batch's
      masked-token count; default: in ``values``). Long responses weigh more.

    Summing the results of micro-batches that share the global ``num_samples`` / ``num_tokens``
    gives the result of the whole batch. ``sample_weights`` ``[n]`` scale each sample (staleness
    down-weighting). Empty input, or a mask with no 1, gives an exact 0 (never NaN) that is still
    connected to the graph of ``values``.
    """
    m = mask.to(values.dtype)
    v = _select(values, mask != 0) * m
    if sample_weights is not None:
        v = v * sample_weights.to(values.dtype)[:, None]
    if mode == "sum_of_sample_mean":
        per_sample = v.sum(-1) / m.sum(-1).clamp(min=1.0)
        denom = num_samples if num_samples is not None else int((m.sum(-1) > 0).sum())
        return per_sample.sum() / max(denom, 1)
    if mode == "token_mean":
        denom = num_tokens if num_tokens is not None else int(m.sum())
        return v.sum() / max(denom, 1)
    raise ValueError(f"unknown loss aggregation {mode!r} (sum_of_sample_mean, token_mean)")


# ---------------------------------------------------------------- staleness


def staleness(sample_versions: Tensor, trainer_version: int) -> Tensor:
    """``[n]`` integers: how many weight syncs ago each sample's policy was current (>= 0)."""
    return (trainer_version - sample_versions.to(torch.int64)).clamp(min=0)


def staleness_weights(sample_versions: Tensor, trainer_version: int, max_staleness: int | None,
                      policy: Literal["drop", "downweight"] = "drop", decay: float = 0.5
                      ) -> tuple[Tensor, Tensor]:
    """Per-sample weights under a staleness bound.

    A sample is stale when ``staleness > max_staleness``. ``drop``: weight 0 and ``keep`` False;
    ``downweight``: kept with weight ``decay ** (staleness - max_staleness)``. ``max_staleness``
    None disables the bound (all weights 1).

    Returns:
        ``(weights [n] float32, keep [n] bool)``.
    Source: asynchronous RL practice (AReaL's staleness bound; OpenClaw-RL trains on
    slightly off-policy samples and corrects with importance ratios).
    """
    s = staleness(sample_versions, trainer_version)
    weights = torch.ones(s.shape, dtype=torch.float32)
    keep = torch.ones(s.shape, dtype=torch.bool)
    if max_staleness is None:
        return weights, keep
    stale = s > max_staleness
    if policy == "drop":
        keep = ~stale
        weights = keep.to(torch.float32)
    elif policy == "downweight":
        weights = torch.where(stale, decay ** (s - max_staleness).to(torch.float32), weights)
    else:
        raise ValueError(f"unknown stale policy {policy!r} (drop, downweight)")
    return weights, keep


# ---------------------------------------------------------------- total loss


@dataclass(frozen=True)
class LossParams:
    """The hyper-parameters of :func:`policy_loss` (one set per run, from the trainer config).

    Fields:
        eps_clip: PPO clip range below 1 (ratio >= ``1 - eps_clip``), in (0, 1).
        eps_clip_high: clip range above 1 (DAPO clip-higher; ratio <= ``1 + eps_clip_high``),
            > 0; None: ``eps_clip``.
        eps_clip_c: dual-clip constant c > 1 (the loss of a negative-advantage token is capped at
            ``-A * c``); None: off.
        entropy_coef: weight (>= 0) of the entropy bonus (nats), subtracted from the loss.
        kl_coef: weight (>= 0) of the KL penalty (nats) to the reference policy, added to the loss.
        kl_type: the per-token KL estimator of :func:`approx_kl`.
        tis_cap: upper clamp (> 0) of the truncated importance-sampling weight
            ``exp(train - rollout log-prob)`` (:func:`truncated_is_weights`); None: TIS off.
        tis_floor: lower clamp (>= 0, below ``tis_cap``) of that weight.
        agg: how per-token values reduce to a scalar (:func:`aggregate`).
    """

    eps_clip: float
    eps_clip_high: float | None = None
    eps_clip_c: float | None = None
    entropy_coef: float = 0.0
    kl_coef: float = 0.0
    kl_type: KLType = "low_var_kl"
    tis_cap: float | None = None
    tis_floor: float = 0.0
    agg: LossAgg = "sum_of_sample_mean"

    @classmethod
    def from_config(cls, cfg: TrainerConfig) -> LossParams:
        """The loss hyper-parameters of the ``trainer`` config section (``loss_agg`` -> ``agg``)."""
        return cls(eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, eps_clip_c=cfg.eps_clip_c,
                   entropy_coef=cfg.entropy_coef, kl_coef=cfg.kl_coef, kl_type=cfg.kl_type,
                   tis_cap=cfg.tis_cap, tis_floor=cfg.tis_floor, agg=cfg.loss_agg)


def policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor, params: LossParams, *,
                entropy: Tensor | None = None, ref_log_probs: Tensor | None = None,
                rollout_log_probs: Tensor | None = None, train_log_probs: Tensor | None = None,
                has_rollout: Tensor | None = None, sample_weights: Tensor | None = None,
                num_samples: int | None = None, num_tokens: int | None = None,
                num_rollout_samples: int | None = None, num_rollout_tokens: int | None = None
                ) -> tuple[Tensor, dict[str, Tensor]]:
    """The trainer's objective for one micro-batch: ``pg_loss - entropy_coef * entropy + kl_coef * kl``.

    The hyper-parameters (clip ranges, coefficients, TIS clamps, aggregation) come from
    ``params`` (:class:`LossParams`). Every term is aggregated with :func:`aggregate`
    (``params.agg``, global ``num_samples`` / ``num_tokens``, ``sample_weights``), so summing
    micro-batch losses gives the batch loss. ``pg_loss`` is the PPO surrogate of
    :func:`ppo_policy_loss`, multiplied per token by :func:`truncated_is_weights` when
    ``params.tis_cap`` is set: ``exp(train_log_probs - rollout_log_probs)`` truncated to
    ``[tis_floor, tis_cap]`` (needs both; samples marked False in ``has_rollout`` ``[n]`` get
    weight 1). The KL term needs ``ref_log_probs`` (a frozen reference model); the entropy term
    needs ``entropy``.

    Args: ``[n, L]`` tensors as in the module docstring (``train_log_probs``: the trainer's
    log-probs before the update, no grad); ``params``: the loss hyper-parameters;
    ``sample_weights`` ``[n]``; ``num_samples`` / ``num_tokens``: the global batch's
    denominators of :func:`aggregate` (default: in this call); ``num_rollout_samples`` /
    ``num_rollout_tokens``: the global batch's counts of trained samples (tokens) that have
    rollout log-probs (default: in this call), the denominators of the ``tis`` statistic.
    Returns:
        ``(loss, stats)``: the scalar loss (with grad) and detached scalars ``pg_loss``,
        ``pg_clipfrac``, ``ppo_kl``, ``entropy``, ``kl`` — each aggregated the same way — and,
        only when ``tis_cap`` is set and this call holds a trained sample with rollout log-probs,
        ``tis``: the TIS weight aggregated over those samples alone (a sample without rollout
        log-probs has no ratio, so no fake 1 enters the figure; summed over micro-batches with the
        global counts it is the batch's figure, and a batch without any such sample has none).
    Raises:
        ValueError: ``tis_cap`` without ``rollout_log_probs`` or ``train_log_probs``; ``eps_clip_c <= 1``.
    Source: slime ``policy_loss_function`` (OpenClaw-RL's trainer).
    """
    def agg_(x: Tensor) -> Tensor:
        return aggregate(x, mask, params.agg, sample_weights, num_samples, num_tokens)

    keep = mask != 0  # masked-out positions are zeroed before any arithmetic (no NaN in the graph)
    log_probs, old_log_probs, advantages = (_select(x, keep) for x in (log_probs, old_log_probs, advantages))
    entropy, ref_log_probs, rollout_log_probs, train_log_probs = (
        None if x is None else _select(x, keep) for x in (entropy, ref_log_probs, rollout_log_probs, train_log_probs))

    pg, clipfrac, ppo_kl = ppo_policy_loss(log_probs, old_log_probs, advantages, params.eps_clip,
                                           params.eps_clip_high, params.eps_clip_c)
    zero = log_probs.sum() * 0.0
    tis = tis_stat = None
    if params.tis_cap is not None:
        if rollout_log_probs is None or train_log_probs is None:
            raise ValueError("tis_cap needs rollout_log_probs and train_log_probs (the trainer's own log-probs "
                             "before the update)")
        tis = truncated_is_weights(train_log_probs, rollout_log_probs, params.tis_cap, params.tis_floor, has_rollout)
        pg = pg * tis
        tis_mask = keep if has_rollout is None else keep & has_rollout.to(keep.device, torch.bool)[:, None]
        if bool(tis_mask.any()):
            tis_stat = aggregate(tis, tis_mask, params.agg, sample_weights, num_rollout_samples, num_rollout_tokens)
    pg_loss = agg_(pg)
    loss = pg_loss
    ent = agg_(entropy) if entropy is not None else zero
    if params.entropy_coef and entropy is not None:
        loss = loss - params.entropy_coef * ent
    kl = agg_(approx_kl(log_probs, ref_log_probs, params.kl_type)) if ref_log_probs is not None else zero
    if params.kl_coef and ref_log_probs is not None:
        loss = loss + params.kl_coef * kl
    stats = {"pg_loss": pg_loss, "pg_clipfrac": agg_(clipfrac), "ppo_kl": agg_(ppo_kl), "entropy": ent, "kl": kl}
    if tis_stat is not None:
        stats["tis"] = tis_stat
    return loss, {k: v.detach() for k, v in stats.items()}
