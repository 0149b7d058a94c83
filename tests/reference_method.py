"""An independent reference of the training signal, written from the method's definitions.

Plain Python and numpy (float64), no torch, nothing imported from ``pipeline``: tests compute the
expected value of a formula here and compare the real path (judge -> ``samples`` -> Megatron
trainer) with it. Keep it a second, readable implementation; never call the package from here.

Definitions (OpenClaw-RL: Binary RL, hindsight On-Policy Distillation and their combination;
PPO as used by slime):

- **Binary RL vote**: m judge votes, each in {+1, 0, -1} or failed (None). Failed votes are
  dropped; the most frequent value wins; a tie for the top count gives 0; no valid vote gives
  no vote at all (None: absent, not 0; OpenClaw-RL itself scores it 0).
- **Binary RL sample** (``rl`` mode): reward = the vote; trained (loss mask 1) when the vote is
  non-zero; a turn without a next state, or whose votes all failed, carries no reward and is
  never trained (not even by the at-least-one rule).
- **Hint selection**: of the m hint votes, a +1 vote whose stripped hint is longer than 10
  characters is a candidate; the longest candidate is the accepted hint (ties: the first); no
  candidate, no hint. A single candidate suffices, whatever the other votes say.
- **OPD dispatch** (``opd`` mode): an accepted hint gives a sample with teacher log-probs and no
  reward; no hint, no sample.
- **Combine dispatch** (``combine`` mode): a ±1 vote is an RL signal, a vote of 0 is none; an
  accepted hint gives teacher log-probs. Both -> one sample with both signals, one -> one sample
  with that signal only, neither -> no sample.
- **GRPO broadcast**: a sample's RL advantage is its reward on every response token. With
  normalisation, rewards are standardised over the samples of the batch that carry a reward:
  ``(r - mean) / (std + eps)`` with the Bessel-corrected std ``sqrt(sum (r - mean)^2 / (n - 1))``
  (slime's GRPO normalisation; 0 for a single rewarded sample). A sample without a reward has RL
  advantage 0 and takes no part in the mean or the std.
- **OPD token advantage**: ``teacher log-prob - behaviour log-prob`` per response token; 0 on
  every token of a sample without teacher log-probs.
- **Behaviour (old) log-probs**: the rollout log-probs recorded by the engine (mode
  ``rollout``), or the trainer's own log-probs before the update (mode ``recompute``). A
  sample without rollout log-probs (an imported conversation) always uses the recomputed ones.
- **Combine**: ``A = w_rl * grpo + w_opd * opd``.
- **PPO clip** per token: ``ratio = exp(logp - old)``,
  ``loss = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))``; dual clip with
  constant c > 1 caps the loss of a token with A < 0 at ``-A * c``. The clipped branch is
  "taken" when ``-A * clip(...) > -A * ratio``.
- **KL estimators** of KL(pi || pi_ref) from sampled-token log-probs, with
  ``d = logp - logp_ref``: k1 = d, k2 = d^2 / 2, k3 = exp(-d) - 1 + d (``low_var_kl``: k3
  clipped to [-10, 10]).
- **TIS**: per-token weight ``clip(exp(recomputed - rollout), floor, cap)`` on the
  policy-gradient loss, where ``recomputed`` is the trainer's own log-prob before the update
  (never the behaviour log-prob of the PPO ratio, which in mode ``rollout`` is the rollout
  log-prob itself and would make the weight 1); a sample without rollout log-probs has weight 1
  in the loss (nothing to correct) and is left out of the TIS statistic, which is the weight
  aggregated over the samples that have rollout log-probs (none: no statistic).
- **Aggregation** of per-token values x over the trained samples, with per-sample weights w:
  ``sum_of_sample_mean`` = sum_i w_i * mean_t x_it / (number of samples; when masked samples
  count toward the batch, the batch's size, masked ones included);
  ``token_mean`` = sum_i sum_t w_i * x_it / (number of tokens).
- **Train-vs-rollout figure**: mean |trainer log-prob - rollout log-prob| over the response
  tokens of samples that have rollout log-probs, split into samples of the trainer's own policy
  version (engine/trainer mismatch) and of other versions (policy drift); samples without
  rollout log-probs never enter it.

Use :class:`RefSample` (or :meth:`RefSample.of` on any object with the ``sample`` event's
fields) and :func:`objective` for a whole batch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Sequence

import numpy as np

Array = np.ndarray


# ------------------------------------------------------------------------- judge side


def majority_vote(votes: Sequence[int | None]) -> float | None:
    """Binary RL majority vote of ``votes`` (+1 / 0 / -1, None = a failed vote); None: no valid vote."""
    valid = [int(v) for v in votes if v is not None]
    if not valid:
        return None
    counts = Counter(valid).most_common()
    if len(counts) > 1 and counts[0][1] == counts[1][1]:
        return 0.0
    return float(counts[0][0])


def select_hint(answers: Sequence[tuple[int | None, str | None]], min_chars: int = 10) -> str | None:
    """The accepted OPD hint of m hint votes ``(vote, hint text or None)``, or None.

    A vote is a candidate when it is +1 and its stripped hint is longer than ``min_chars``; the
    longest candidate wins (ties: the first). One candidate is enough, whatever the other votes.
    """
    best = None
    for vote, hint in answers:
        h = (hint or "").strip()
        if vote == 1 and len(h) > min_chars and (best is None or len(h) > len(best)):
            best = h
    return best


def rl_signals(vote: float | None) -> tuple[float | None, int]:
    """``rl`` mode: (reward, loss_mask) of a turn; ``vote`` None = no judgement (no next state, or
    every vote failed).

    The at-least-one rule (OpenClaw-RL: a session's first judged turn trained with reward 0 when
    the session has no trained turn yet; here: the session's turn 0, see pipeline/judge/join.py)
    is not modelled here: pass its result as ``vote = 0`` and set the mask yourself (it never
    applies to ``vote`` None).
    """
    if vote is None:
        return None, 0
    return float(vote), int(vote != 0)


def opd_signals(hint_accepted: bool) -> tuple[None, bool] | None:
    """``opd`` mode: (no reward, has teacher) of a judged turn, or None: no sample without a hint."""
    return (None, True) if hint_accepted else None


def combine_signals(vote: float | None, hint_accepted: bool) -> tuple[float | None, bool] | None:
    """``combine`` mode: (reward or None, has teacher) of a judged turn, or None: no sample."""
    reward = float(vote) if vote in (1, -1) else None
    if reward is None and not hint_accepted:
        return None
    return reward, bool(hint_accepted)


# ------------------------------------------------------------------------- trainer side


@dataclass
class RefSample:
    """One trained sample as the reference sees it (R response tokens).

    ``reward`` None: no RL signal; ``teacher`` None: no hint; ``rollout`` None: not sampled by
    a recorded engine. Arrays are per response token, in nats.
    """

    response_length: int
    reward: float | None = None
    teacher: Sequence[float] | None = None
    rollout: Sequence[float] | None = None
    policy_version: int = 0
    weight: float = 1.0

    @classmethod
    def of(cls, sample, weight: float = 1.0) -> RefSample:
        """From any object with the ``sample`` event's fields (read only, no package code)."""
        def arr(x):
            return None if x is None else [float(v) for v in x]
        return cls(int(sample.response_length), None if sample.reward is None else float(sample.reward),
                   arr(sample.teacher_log_probs), arr(sample.rollout_log_probs), int(sample.policy_version),
                   float(weight))


def _a(x) -> Array:
    return np.asarray(x, dtype=np.float64)


def rl_advantages(rewards: Sequence[float | None], normalize: bool = False, eps: float = 1e-6) -> list[float]:
    """Per-sample RL advantage (GRPO; normalised over the samples that carry a reward)."""
    present = [r for r in rewards if r is not None]
    if normalize and present:
        mean = sum(present) / len(present)
        std = math.sqrt(sum((r - mean) ** 2 for r in present) / (len(present) - 1)) if len(present) > 1 else 0.0
        return [0.0 if r is None else (r - mean) / (std + eps) for r in rewards]
    return [0.0 if r is None else float(r) for r in rewards]


def grpo_broadcast(advantage: float, response_length: int) -> Array:
    """A sample's scalar advantage on each of its response tokens."""
    return np.full(response_length, float(advantage))


def opd_advantage(teacher: Sequence[float] | None, old: Sequence[float]) -> Array:
    """OPD token advantage ``teacher - old``; zeros when there is no teacher."""
    old = _a(old)
    if teacher is None:
        return np.zeros_like(old)
    return _a(teacher) - old


def behaviour_log_probs(sample: RefSample, recomputed: Sequence[float], mode: str = "rollout") -> Array:
    """The old log-probs of the PPO ratio and the OPD advantage (see the module docstring)."""
    if mode == "recompute" or sample.rollout is None:
        return _a(recomputed)
    if mode != "rollout":
        raise ValueError(mode)
    return _a(sample.rollout)


def combine(grpo: Array, opd: Array, w_rl: float = 1.0, w_opd: float = 1.0) -> Array:
    """``w_rl * grpo + w_opd * opd``."""
    return w_rl * _a(grpo) + w_opd * _a(opd)


def token_advantages(samples: Sequence[RefSample], old: Sequence[Sequence[float]], *, w_rl: float = 1.0,
                     w_opd: float = 1.0, normalize: bool = False, eps: float = 1e-6) -> list[Array]:
    """Per-token advantages of a batch of trained samples, given each sample's old log-probs."""
    rl = rl_advantages([s.reward for s in samples], normalize, eps)
    return [combine(grpo_broadcast(a, s.response_length), opd_advantage(s.teacher, o), w_rl, w_opd)
            for s, a, o in zip(samples, rl, old)]


def ppo_clip(logp: Sequence[float], old: Sequence[float], adv: Sequence[float], eps_low: float,
             eps_high: float | None = None, dual_clip: float | None = None) -> tuple[Array, Array, Array]:
    """Per-token (loss, clipped indicator, ppo_kl = old - logp)."""
    logp, old, adv = _a(logp), _a(old), _a(adv)
    eps_high = eps_low if eps_high is None else eps_high
    loss, clipped = np.empty_like(adv), np.empty_like(adv)
    for t in range(len(adv)):
        ratio = math.exp(logp[t] - old[t])
        unclipped = -adv[t] * ratio
        clipped_loss = -adv[t] * min(max(ratio, 1.0 - eps_low), 1.0 + eps_high)
        loss[t] = max(unclipped, clipped_loss)
        clipped[t] = 1.0 if clipped_loss > unclipped else 0.0
        if dual_clip is not None and adv[t] < 0:
            loss[t] = min(loss[t], -adv[t] * dual_clip)
    return loss, clipped, old - logp


def kl(logp: Sequence[float], ref: Sequence[float], kind: str = "low_var_kl") -> Array:
    """Per-token KL estimate k1 / k2 / k3 / low_var_kl."""
    d = _a(logp) - _a(ref)
    if kind == "k1":
        return d
    if kind == "k2":
        return d * d / 2.0
    k3 = np.exp(-d) - 1.0 + d
    if kind == "k3":
        return k3
    if kind == "low_var_kl":
        return np.clip(k3, -10.0, 10.0)
    raise ValueError(kind)


def tis_weights(recomputed: Sequence[float], rollout: Sequence[float] | None, cap: float,
                floor: float = 0.0) -> Array:
    """Truncated importance weights ``clip(exp(recomputed - rollout), floor, cap)``; ones when the
    sample has no rollout log-probs."""
    recomputed = _a(recomputed)
    if rollout is None:
        return np.ones_like(recomputed)
    return np.clip(np.exp(recomputed - _a(rollout)), floor, cap)


def aggregate(per_token: Sequence[Array], weights: Sequence[float], mode: str = "sum_of_sample_mean",
              batch_size: int | None = None) -> float:
    """Batch reduction of per-token values (see the module docstring); ``batch_size``: the
    ``sum_of_sample_mean`` denominator when masked samples count toward the batch (slime divides
    by the global batch size), default the number of trained samples."""
    if mode == "sum_of_sample_mean":
        rows = [w * float(np.mean(x)) for x, w in zip(per_token, weights) if len(x)]
        return sum(rows) / max(len(rows) if batch_size is None else batch_size, 1)
    if mode == "token_mean":
        n = sum(len(x) for x in per_token)
        return sum(w * float(np.sum(x)) for x, w in zip(per_token, weights)) / max(n, 1)
    raise ValueError(mode)


def logprob_mismatch(samples: Sequence[RefSample], trainer_logp: Sequence[Sequence[float]],
                     trainer_version: int) -> dict[str, float | None]:
    """Mean |trainer - rollout| log-prob: ``all``, ``current`` (the trainer's own version) and
    ``stale`` (other versions); None where no token qualifies. Samples without rollout
    log-probs are left out."""
    sums = {"all": [0.0, 0], "current": [0.0, 0], "stale": [0.0, 0]}
    for s, lp in zip(samples, trainer_logp):
        if s.rollout is None:
            continue
        d = np.abs(_a(lp) - _a(s.rollout))
        for key in ("all", "current" if s.policy_version == trainer_version else "stale"):
            sums[key][0] += float(d.sum())
            sums[key][1] += len(d)
    return {k: (v[0] / v[1] if v[1] else None) for k, v in sums.items()}


def objective(samples: Sequence[RefSample], logp: Sequence[Sequence[float]], recomputed: Sequence[Sequence[float]],
              *, old_mode: str = "rollout", w_rl: float = 1.0, w_opd: float = 1.0, normalize: bool = False,
              eps_clip: float = 0.2, eps_clip_high: float | None = None, dual_clip: float | None = None,
              tis_cap: float | None = None, tis_floor: float = 0.0, ref: Sequence[Sequence[float]] | None = None,
              kl_coef: float = 0.0, kl_type: str = "low_var_kl", agg: str = "sum_of_sample_mean") -> dict:
    """The whole batch: advantages, the PPO loss and its statistics, for trained ``samples``.

    ``logp``: the policy's current log-probs of each sample's response tokens; ``recomputed``:
    the policy's log-probs before the update (equal to ``logp`` on the first step); ``ref``: a
    frozen reference model's log-probs (for the KL term). Entropy is not modelled (pass an
    entropy coefficient of 0). Returns ``advantages`` (list of arrays) and the scalars
    ``loss``, ``pg_loss``, ``pg_clipfrac``, ``ppo_kl``, ``kl``, and ``tis`` (None when TIS is off
    or no sample has rollout log-probs).
    """
    old = [behaviour_log_probs(s, r, old_mode) for s, r in zip(samples, recomputed)]
    adv = token_advantages(samples, old, w_rl=w_rl, w_opd=w_opd, normalize=normalize)
    weights = [s.weight for s in samples]
    pg, clip, pkl, tis, tis_w = [], [], [], [], []
    for s, lp, o, rc, a in zip(samples, logp, old, recomputed, adv):
        loss, c, k = ppo_clip(lp, o, a, eps_clip, eps_clip_high, dual_clip)
        w = tis_weights(rc, s.rollout, tis_cap, tis_floor) if tis_cap is not None else np.ones(len(a))
        pg.append(loss * w)
        clip.append(c)
        pkl.append(k)
        if s.rollout is not None:
            tis.append(w)
            tis_w.append(s.weight)
    out = {"advantages": adv, "pg_loss": aggregate(pg, weights, agg), "pg_clipfrac": aggregate(clip, weights, agg),
           "ppo_kl": aggregate(pkl, weights, agg),
           "tis": aggregate(tis, tis_w, agg) if tis_cap is not None and tis else None, "kl": 0.0}
    if ref is not None:
        out["kl"] = aggregate([kl(lp, r, kl_type) for lp, r in zip(logp, ref)], weights, agg)
    out["loss"] = out["pg_loss"] + kl_coef * out["kl"]
    return out
