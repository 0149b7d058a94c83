"""The policy under training: Megatron GPTModel + Megatron DDP + Megatron optimizer.

Optimizer choice: ``get_megatron_optimizer`` (Adam with decoupled weight decay, i.e. AdamW,
global-norm gradient clipping that knows which parameters are tensor-parallel shards) over
Megatron's ``DistributedDataParallel`` grad buffers. The same code then gives fp32 master
weights for bf16 training on GPUs (the distributed ZeRO-1 optimizer is left off so that
checkpoints stay plain per-rank state dicts); on the CPU it runs through
:mod:`pipeline.trainer.cpu_shim` (docs/environment.md §3: TP=2 and DP=2 reproduce the
single-process parameters). A plain ``torch.optim.AdamW`` would need none of the shim's
optimizer patches but would be wrong for bf16 parameters and for TP gradient norms.

One :meth:`PolicyTrainer.train_batch` = ``steps_per_batch`` optimizer steps over the whole batch,
each accumulating gradients over micro-batches (forward, log-probs at the sample's rollout
temperature through vocab-parallel cross-entropy, loss of :mod:`pipeline.trainer.loss`,
backward), then ``finalize_model_grads`` (DP/TP all-reduces) and ``optimizer.step()``.

With ``trainer.lora`` the base model is frozen and shared, and what a step trains is one LoRA
adapter (:mod:`pipeline.trainer.lora`), chosen per batch (``train_batch(..., adapter=name)``, one
per tenant): each adapter is its own :class:`Trainable` (Megatron DDP over its parameters alone,
and its own Megatron optimizer), so the same code path trains it and nothing of another tenant
moves. Without ``trainer.lora`` the one :class:`Trainable` is the whole model, as before.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pipeline import events, weightsync
from pipeline.config import TrainerConfig
from pipeline.trainer import batch as B
from pipeline.trainer import loss as L
from pipeline.trainer import model as M
from pipeline.trainer import prom
from pipeline.trainer.dist import Parallel

if TYPE_CHECKING:
    from pipeline.trainer.lora import LoraModel

log = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` -> fp32 on the CPU (log-prob parity needs it), bf16 on CUDA."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[name]


def vocab_parallel_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of softmax(logits) when the vocabulary is split over TP ranks.

    ``logits`` ``[..., V/tp]`` (this rank's slice) -> ``[...]`` full-vocabulary entropy
    ``H = log Z - sum_v p_v z_v``, with the max and both sums all-reduced over the TP group
    (differentiable: Megatron's ``reduce_from_tensor_model_parallel_region`` is an all-reduce in
    the forward pass and the identity in the backward pass).
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    m = logits.detach().max(dim=-1).values
    if ps.get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=ps.get_tensor_model_parallel_group())
    z = logits - m.unsqueeze(-1)
    e = torch.exp(z)
    s = reduce_from_tensor_model_parallel_region(e.sum(-1))
    ez = reduce_from_tensor_model_parallel_region((e * z).sum(-1))
    return torch.log(s) - ez / s


def token_log_probs(logits: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor,
                    entropy: str = "none", mask: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``targets`` under ``softmax(logits / T)`` with the vocabulary split over TP.

    Args:
        logits: ``[b, S, V/tp]`` from the model (any float dtype; computed in fp32).
        targets: ``[b, S]`` token ids.
        temperatures: ``[b]`` each sample's rollout temperature (the engine's log-probs are of
            the tempered distribution it sampled from).
        entropy: ``none``, ``metric`` (no grad) or ``grad`` (part of the loss).
        mask: ``[b, S]``; when given, only positions with ``mask > 0`` are computed (the rest are
            0), which skips the softmax work on prompt and padding positions.
    Returns:
        ``(log_probs [b, S], entropy [b, S] or None)``.
    """
    if mask is not None:
        sel = mask.to(logits.device) > 0
        return selected_log_probs(logits[sel], targets, temperatures, sel, entropy)
    scaled = logits.float() / temperatures.to(logits.device, torch.float32)[:, None, None]
    return _log_probs(scaled, targets, entropy)


def selected_log_probs(rows: torch.Tensor, targets: torch.Tensor, temperatures: torch.Tensor, sel: torch.Tensor,
                       entropy: str = "none") -> tuple[torch.Tensor, torch.Tensor | None]:
    """:func:`token_log_probs` from the logits at the positions ``sel`` alone.

    Args:
        rows: ``[N, V/tp]`` the logits of the ``N`` positions where ``sel`` is True, in row-major
            order (``logits[sel]``, or the model's output under :func:`pipeline.trainer.model.output_at`).
        targets: ``[b, S]`` token ids; temperatures: ``[b]``; sel: ``[b, S]`` bool.
        entropy: as in :func:`token_log_probs`.
    Returns:
        ``(log_probs [b, S], entropy [b, S] or None)``, 0 outside ``sel``.
    """
    sel = sel.to(rows.device)
    row_t = temperatures.to(rows.device, torch.float32)[:, None].expand(sel.shape)[sel]
    rows = rows.float()
    # a new tensor either way: the cross-entropy kernel works in place on its input
    scaled = rows / row_t[:, None] if bool((row_t != 1).any()) else rows.clone()
    logp, ent = _log_probs(scaled, targets.to(rows.device)[sel], entropy)
    full = torch.zeros(sel.shape, dtype=torch.float32, device=rows.device).index_put((sel,), logp)
    if ent is not None:
        ent = torch.zeros(sel.shape, dtype=torch.float32, device=rows.device).index_put((sel,), ent)
    return full, ent


def _log_probs(scaled: torch.Tensor, tgt: torch.Tensor, entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(log_softmax(scaled)[tgt], entropy or None)`` over a vocabulary split over TP (the last dim)."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    ent = None
    if entropy == "metric":
        with torch.no_grad():
            ent = vocab_parallel_entropy(scaled)
    elif entropy == "grad":
        ent = vocab_parallel_entropy(scaled)
        scaled = scaled.clone()  # the cross-entropy kernel works in place on its input
    return -vocab_parallel_cross_entropy(scaled, tgt), ent


def _any_rank(flag: bool, device: torch.device) -> bool:
    """True when ``flag`` is True on any rank of the world (MAX all-reduce; identity alone)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)


@dataclass
class _Prepared:
    """:meth:`PolicyTrainer._prepare`'s output (``keep``: input index of each kept sample;
    ``train_cache``: per micro-batch, the trainer's log-probs before the update, for TIS (None
    when TIS is off))."""

    keep: list[int]
    samples: list[events.Sample]
    weights: list[float]
    has_reward: torch.Tensor
    rewards: torch.Tensor
    rl_adv: torch.Tensor
    micro: list[B.MicroBatch]
    old_cache: list[torch.Tensor]
    ref_cache: list[torch.Tensor | None]
    train_cache: list[torch.Tensor | None]


def _signal_metrics(prep: _Prepared) -> dict[str, float]:
    """``rl_samples`` / ``opd_samples`` (trained samples with a reward / with teacher log-probs) and
    ``reward_mean`` (over the samples with a reward; absent when none) of a prepared batch."""
    metrics = {"rl_samples": float(prep.has_reward.sum()),
               "opd_samples": float(sum(s.teacher_log_probs is not None for s in prep.samples))}
    if bool(prep.has_reward.any()):
        metrics["reward_mean"] = float(prep.rewards[prep.has_reward].mean())
    return metrics


@dataclass
class StepResult:
    """What one :meth:`PolicyTrainer.train_batch` did (scalars; seconds for times).

    ``sample_advantages``: input index -> mean advantage over that sample's response tokens
    (first optimizer step), for each sample that was trained; samples left out are absent.
    """

    metrics: dict[str, float]
    skipped: bool
    sample_advantages: dict[int, float] = field(default_factory=dict)


@dataclass
class _Tally:
    """What :meth:`PolicyTrainer.train_batch` accumulates over its optimizer steps.

    ``diff``: this rank's train-vs-rollout ``|log-prob|`` sums and token counts (``current``,
    ``current_n``, ``stale``, ``stale_n``; first step); ``adv_means``: ``[kept samples]`` mean
    advantage per sample, this rank's share (first step); ``sums``: the DP-reduced loss statistics
    summed over steps; ``fb_s`` / ``opt_s``: seconds of forward/backward and of the optimizer;
    ``applied``: steps that changed the weights; ``grad_norm``: the last applied step's norm.
    """

    diff: dict[str, torch.Tensor]
    adv_means: torch.Tensor
    sums: dict[str, float] = field(default_factory=dict)
    fb_s: float = 0.0
    opt_s: float = 0.0
    applied: int = 0
    grad_norm: float | None = None

    @classmethod
    def empty(cls, num_samples: int) -> _Tally:
        """Nothing accumulated yet, for a batch of ``num_samples`` kept samples."""
        return cls({k: torch.zeros((), dtype=torch.float64) for k in ("current", "current_n", "stale", "stale_n")},
                   torch.zeros(num_samples, dtype=torch.float64))


@dataclass
class Trainable:
    """What an optimizer step updates: ``ddp`` (Megatron DDP over the trained parameters: the
    whole model, or one LoRA adapter), its ``optimizer``, and the optimizer ``steps`` it took."""

    ddp: Any
    optimizer: Any
    steps: int = 0


class PolicyTrainer:
    """The trained policy and its optimizer, on this process's TP/DP shard.

    Args:
        cfg: the ``trainer`` config section.
        hf_dir: HF folder of the initial policy (config, tokenizer and weights).
        par: this process's place from :func:`pipeline.trainer.dist.init`.
    """

    def __init__(self, cfg: TrainerConfig, hf_dir: str | Path, par: Parallel) -> None:
        self.cfg, self.par, self.hf_dir = cfg, par, Path(hf_dir)
        self.loss_params = L.LossParams.from_config(cfg)  # the config is frozen: built once
        self.arch = M.Arch.from_hf(self.hf_dir)
        self.dtype = resolve_dtype(cfg.dtype, par.device)
        t0 = time.perf_counter()
        self.model = M.build_model(self.arch, par.tp, self.dtype, par.device, local_spec=cfg.lora is not None,
                                   recompute_attention=cfg.recompute_attention)
        M.load_hf_weights(self.model, self.hf_dir, self.arch)
        #: what an optimizer step can update: ``None`` -> the whole model (full fine-tuning), or
        #: adapter name -> that adapter (``trainer.lora``); ``_unit`` is the one being trained
        self.trainables: dict[str | None, Trainable] = {}
        self.lora = None
        self.ddp = self.optimizer = None  # the full model's (None with LoRA: per adapter)
        if cfg.lora is None:
            self.trainables[None] = self._trainable(self.model)
            self.ddp, self.optimizer = self.trainables[None].ddp, self.trainables[None].optimizer
        else:
            from pipeline.trainer.lora import LoraModel

            self.lora = LoraModel(self.model, self.arch, cfg.lora.rank, cfg.lora.alpha, cfg.lora.targets)
        self._unit = self.trainables.get(None)
        self.ref_model = None  # with LoRA the reference is the shared base itself (adapters off)
        if cfg.kl_coef and self.lora is None:
            self.ref_model = M.build_model(self.arch, par.tp, self.dtype, par.device)
            M.load_hf_weights(self.ref_model, self.hf_dir, self.arch)
            self.ref_model.eval().requires_grad_(False)
        self.optimizer_steps = 0
        self.nonfinite_steps = 0  # optimizer steps skipped because the loss or a gradient was NaN/inf
        self.load_seconds = time.perf_counter() - t0

    def _trainable(self, module: torch.nn.Module) -> Trainable:
        """Megatron DDP and optimizer over ``module``'s trainable parameters (the whole model, or
        one LoRA adapter: each adapter gets its own grad buffer and Adam state)."""
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        cfg = self.cfg
        # The distributed (ZeRO-1) optimizer stays off: its state needs Megatron's sharded
        # checkpointing, while plain optimizer state dicts keep checkpoints simple per TP rank.
        ddp_cfg = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=False)
        ddp = DistributedDataParallel(config=self.model.config, ddp_config=ddp_cfg, module=module)
        ocfg = OptimizerConfig(
            optimizer="adam", lr=cfg.lr, min_lr=cfg.lr, weight_decay=cfg.weight_decay,
            adam_beta1=cfg.adam_beta1, adam_beta2=cfg.adam_beta2, adam_eps=cfg.adam_eps,
            clip_grad=cfg.clip_grad, bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype,
            use_distributed_optimizer=ddp_cfg.use_distributed_optimizer)
        unit = Trainable(ddp, get_megatron_optimizer(ocfg, [ddp]))
        self._set_hyperparameters(unit.optimizer, [])
        return unit

    @property
    def net(self):
        """The module a forward pass goes through: Megatron DDP over the model (full fine-tuning),
        or the base model itself, whose LoRA hooks add the selected adapter."""
        return self.ddp if self.lora is None else self.model

    # ------------------------------------------------------------ adapters (trainer.lora)

    def _need_lora(self) -> LoraModel:
        if self.lora is None:
            raise ValueError("trainer.lora is off (full fine-tuning): there are no adapters")
        return self.lora

    def adapters(self) -> list[str]:
        """Names of the LoRA adapters (one per tenant), sorted; ``[]`` without LoRA."""
        return sorted(n for n in self.trainables if n is not None)

    def add_adapter(self, name: str) -> None:
        """A fresh adapter ``name`` with its own optimizer state (``B = 0``: the base model until trained).

        Raises ``ValueError``: LoRA is off, the name is empty or longer than
        :data:`pipeline.events.MAX_ID_LEN`, or the adapter exists.
        """
        lora = self._need_lora()
        if not isinstance(name, str) or not 0 < len(name) <= events.MAX_ID_LEN:
            raise ValueError(f"adapter name {name!r}: must be 1..{events.MAX_ID_LEN} characters")
        self.trainables[name] = self._trainable(lora.add(name, seed=self.cfg.seed))

    def remove_adapter(self, name: str) -> None:
        """Forget adapter ``name`` and its optimizer state. Raises ``KeyError`` when absent."""
        self._need_lora().remove(name)
        del self.trainables[name]

    def reset_optimizer(self, adapter: str | None = None) -> None:
        """Forget the Adam moments (and step count: the bias correction restarts) of ``adapter``
        (None: the full weights); the weights are kept. ``trainer.poison_steps`` uses it so the
        inverted signal is not hidden by the momentum of earlier honest updates. Raises
        ``KeyError`` when there is no such trained unit."""
        opt = self.trainables[adapter].optimizer
        getattr(opt, "optimizer", opt).state.clear()

    def adapter_steps(self, name: str) -> int:
        """Optimizer steps adapter ``name`` has taken (``KeyError`` when absent)."""
        return self.trainables[name].steps

    @contextlib.contextmanager
    def _selected(self, adapter: str | None, train: bool) -> Iterator[None]:
        """Apply ``adapter`` and make it the trained unit inside the block.

        Full fine-tuning: ``adapter`` must be None. LoRA: ``train`` needs an adapter and creates
        it on its first batch; for scoring, None is the base model and an unknown name a
        ``KeyError``. Raises ``ValueError`` on a mismatch with ``trainer.lora``.
        """
        if self.lora is None:
            if adapter is not None:
                raise ValueError(f"adapter {adapter!r} given but trainer.lora is off (full fine-tuning)")
            yield
            return
        if train and adapter is None:
            raise ValueError("trainer.lora is on: train_batch needs adapter=<the tenant's adapter name>")
        if train and adapter not in self.trainables:
            self.add_adapter(adapter)
        before = self._unit
        self._unit = self.trainables.get(adapter)
        try:
            with self.lora.using(adapter):
                yield
        finally:
            self._unit = before

    # ------------------------------------------------------------ scoring

    def _forward(self, model, mb: B.MicroBatch, entropy: str = "none"):
        """``(log_probs [b, S], entropy or None)`` at the micro-batch's masked positions (0
        elsewhere): the output layer runs at those positions only (:func:`M.output_at`)."""
        mb = mb.to(self.par.device)
        sel = mb.mask > 0
        with M.output_at(model, sel):
            rows = model(mb.tokens, mb.position_ids, None)[0]  # [N, V/tp]
        return selected_log_probs(rows, mb.targets, mb.temperatures, sel, entropy)

    @torch.no_grad()
    def log_probs(self, samples: list[events.Sample], reference: bool = False,
                  adapter: str | None = None) -> list[list[float]]:
        """Each sample's response-token log-probs (nats, at its rollout temperature), no grad.

        Returns one list of ``response_length`` floats per sample, in input order (``loss_mask``
        is ignored: masked samples are scored too). ``reference`` scores with the frozen
        reference model (full fine-tuning: needs ``kl_coef > 0``; LoRA: the base model).
        ``adapter`` (LoRA only) scores with that adapter (None: the base model; ``KeyError``
        when it does not exist).
        """
        with self._selected(None if reference else adapter, train=False):
            model = self.ref_model if reference and self.lora is None else self.net
            if model is None:
                raise ValueError("no reference model (kl_coef is 0)")
            model.eval()
            out: list[list[float]] = [[] for _ in samples]
            for mb in B.split(samples, self.cfg.micro_batch_size, self.cfg.micro_batch_tokens, include_masked=True):
                lp, _ = self._forward(model, mb)
                lp = lp.float().cpu()
                for row, i in enumerate(mb.index):
                    out[i] = lp[row][mb.mask[row] > 0].tolist()
        return out

    def _reference_log_probs(self, mb: B.MicroBatch) -> torch.Tensor | None:
        """``[b, S]`` log-probs of the reference policy for the KL term (None when ``kl_coef`` is 0):
        the frozen copy of the initial model, or with LoRA the shared base (adapters off)."""
        if self.lora is not None and self.cfg.kl_coef:
            with self.lora.using(None):
                return self._forward(self.model, mb)[0].float()
        return self._forward(self.ref_model, mb)[0].float() if self.ref_model is not None else None

    # ------------------------------------------------------------ training

    def _advantages(self, mb: B.MicroBatch, old: torch.Tensor, rl_adv: torch.Tensor) -> torch.Tensor:
        """``[b, S]``: ``w_rl * grpo + w_opd * (teacher - old)``, each term exactly 0 on the
        samples that lack its signal (``rl_adv`` ``[b]`` is already 0 where there is no reward)."""
        mask = mb.mask.to(old.device)
        grpo = L.grpo_advantages(rl_adv.to(old.device), mask, has_reward=mb.has_reward)
        opd = L.opd_advantages(mb.teacher_log_probs.to(old.device), old, mask, has_teacher=mb.has_teacher)
        return L.combine_advantages(grpo, opd, self.cfg.w_rl, self.cfg.w_opd)

    def _prepare(self, samples: list[events.Sample], weights: list[float] | None) -> _Prepared:
        """The batch as this DP rank trains it: trainable samples, per-sample RL advantages over
        the whole batch, this rank's micro-batches and their behaviour / reference log-probs."""
        cfg, par = self.cfg, self.par
        weights = list(weights) if weights is not None else [1.0] * len(samples)
        keep = [i for i, s in enumerate(samples) if B.trainable(s) and weights[i] > 0]
        samples = [samples[i] for i in keep]
        weights = [weights[i] for i in keep]
        num_samples = len(samples)
        # the RL term per sample, over the whole batch (normalised over the samples with a reward)
        has_reward = torch.tensor([s.reward is not None for s in samples], dtype=torch.bool)
        rewards = torch.tensor([0.0 if s.reward is None else float(s.reward) for s in samples])
        rl_adv = L.grpo_advantages(rewards, torch.ones(num_samples, 1), cfg.normalize_advantages,
                                   has_reward=has_reward)[:, 0]
        # this DP rank's share of the batch (the loss is normalised by the global counts)
        mine = list(range(par.dp_rank, num_samples, par.dp))
        micro = B.split([samples[i] for i in mine], cfg.micro_batch_size, cfg.micro_batch_tokens,
                        weights=[weights[i] for i in mine])
        for mb in micro:
            mb.index = [mine[i] for i in mb.index]
        old_cache: list[torch.Tensor] = []
        ref_cache: list[torch.Tensor | None] = []
        train_cache: list[torch.Tensor | None] = []
        tis = cfg.tis_cap is not None
        with torch.no_grad():
            for mb in micro:
                # behaviour log-probs: the rollout ones, or recomputed under the current weights
                # (always for samples without rollout log-probs, e.g. imported turns: their
                # ratio starts at 1). TIS (only with old_log_probs=recompute, the config checks)
                # weighs by the recomputed vs the engine's log-probs.
                rollout = mb.rollout_log_probs.to(par.device)
                if cfg.old_log_probs == "recompute" or tis or not bool(mb.has_rollout.all()):
                    self.net.eval()
                    rec = self._forward(self.net, mb)[0].float()
                    old_cache.append(rec if cfg.old_log_probs == "recompute"
                                     else torch.where(mb.has_rollout[:, None].to(rec.device), rollout, rec))
                    train_cache.append(rec if tis else None)
                else:
                    old_cache.append(rollout)
                    train_cache.append(None)
                ref_cache.append(self._reference_log_probs(mb))
        return _Prepared(keep, samples, weights, has_reward, rewards, rl_adv, micro, old_cache, ref_cache, train_cache)

    @torch.no_grad()
    def advantages(self, samples: list[events.Sample], weights: list[float] | None = None,
                   adapter: str | None = None) -> list[list[float]]:
        """The per-token advantages :meth:`train_batch` would use on ``samples`` now (no update).

        Returns one list per input sample, in input order: ``response_length`` floats for the
        samples that would be trained, ``[]`` for the others (not :func:`batch.trainable`, or
        weight 0). Single-process only (every sample must be on this DP rank). ``adapter``: as
        in :meth:`log_probs`.
        """
        if self.par.dp != 1:
            raise ValueError("advantages() needs dp == 1")
        with self._selected(adapter, train=False):
            prep = self._prepare(samples, weights)
        out: list[list[float]] = [[] for _ in samples]
        for mb, old in zip(prep.micro, prep.old_cache):
            adv = self._advantages(mb, old, prep.rl_adv[mb.index]).float().cpu()
            for row, i in enumerate(mb.index):
                out[prep.keep[i]] = adv[row][mb.mask[row] > 0].tolist()
        return out

    def train_batch(self, samples: list[events.Sample], weights: list[float] | None = None,
                    policy_version: int | None = None, adapter: str | None = None) -> StepResult:
        """Run ``steps_per_batch`` optimizer steps on ``samples`` (every rank gets the same list).

        ``adapter``: with ``trainer.lora``, the adapter trained (required; created on its first
        batch: one per tenant, each with its own optimizer state, the base and every other adapter
        untouched); without LoRA it must be None (the whole model is trained).

        ``weights`` are per-sample loss weights (staleness down-weighting; default 1). Samples
        that are not :func:`batch.trainable` are not trained; with ``trainer.count_masked_samples``
        they still count in the ``sum_of_sample_mean`` denominator (the loss is divided by
        ``len(samples)``, slime's global batch size: 2 trainable samples of 16 weigh 1/16 each,
        not 1/2), else it is the number of trained samples. A batch without any trainable token
        makes no optimizer step (``skipped``): Adam's moments would still move the weights.
        ``policy_version`` is the version of the weights being trained (the stage's); it splits
        the train-vs-rollout figure (below). An optimizer step whose loss or gradients hold NaN/inf
        on any rank is not taken (weights and Adam moments unchanged) and counted in
        ``nonfinite_steps``; when no step of the batch was taken the result is ``skipped`` too (no
        new policy version, nothing exported).

        Metrics: ``loss, pg_loss, pg_clipfrac, ppo_kl, entropy, kl`` (means over the optimizer
        steps of the aggregated values), ``tis`` (the same, for the truncated importance weight
        exp(trainer - rollout log-prob) over the trained samples that have rollout log-probs; absent
        when TIS is off or no such sample was trained), ``grad_norm`` (last step taken; absent when
        none was taken or ``clip_grad`` is 0 and none was measured), ``train_samples``,
        ``train_tokens``, ``rl_samples`` / ``opd_samples`` (trained samples with a reward / with
        teacher log-probs), ``reward_mean`` (over the samples with a reward; absent when none),
        ``forward_backward_s``, ``optimizer_s``, ``nonfinite_steps``, and the train-vs-rollout figure: mean
        |trainer - rollout| log-prob (nats) over the response tokens of trained samples that
        have rollout log-probs (imported samples never count), before the update:
        ``logprob_abs_diff`` (all of them), ``logprob_abs_diff_current`` (samples generated by
        ``policy_version`` itself: the engine/trainer numerical mismatch, ~1e-6 on fp32 CPU) and
        ``logprob_abs_diff_stale`` (samples of other versions: policy drift plus mismatch), with
        their token counts ``logprob_tokens_current`` / ``logprob_tokens_stale``. A figure
        without tokens is absent, never 0; the split needs ``policy_version``.
        """
        with self._selected(adapter, train=True):
            return self._train(samples, weights, policy_version)

    def _train(self, samples: list[events.Sample], weights: list[float] | None,
               policy_version: int | None) -> StepResult:
        """:meth:`train_batch` on the selected trainable unit."""
        t0 = time.perf_counter()
        # prepare: trainable samples, RL advantages, this rank's micro-batches and their log-probs
        prep = self._prepare(samples, weights)
        totals = self._loss_totals(prep, batch_size=len(samples))
        metrics = {"train_samples": float(len(prep.samples)), "train_tokens": float(totals["num_tokens"])}
        if not prep.samples:  # no trainable token: no step (Adam's moments would still move the weights)
            return StepResult(metrics, skipped=True)
        metrics.update(_signal_metrics(prep))
        pre_s = time.perf_counter() - t0
        tally = _Tally.empty(len(prep.samples))
        for step in range(self.cfg.steps_per_batch):
            # forward/backward over the micro-batches, then guards and the optimizer step
            t1 = time.perf_counter()
            step_stats = self._forward_backward(prep, totals, tally if step == 0 else None, policy_version)
            t2 = time.perf_counter()
            ok, step_norm, _ = self._optimizer_step(step_stats.get("loss"))  # guards: no step on NaN/inf
            t3 = time.perf_counter()
            tally.fb_s += t2 - t1
            tally.opt_s += t3 - t2
            if ok:
                tally.applied += 1
                tally.grad_norm = step_norm
            else:
                log.warning("optimizer step skipped: non-finite loss or gradients (%d skipped so far); "
                            "the weights and the optimizer state are unchanged", self.nonfinite_steps)
            for k, v in self._all_reduce_dp(step_stats).items():
                tally.sums[k] = tally.sums.get(k, 0.0) + v
        # metrics (collective over DP)
        metrics.update(self._tally_metrics(tally, policy_version, pre_s))
        per_sample = self._sample_advantages(prep, tally.adv_means)
        return StepResult(metrics, skipped=tally.applied == 0, sample_advantages=per_sample)

    def _loss_totals(self, prep: _Prepared, batch_size: int) -> dict[str, int]:
        """The global batch's denominators, as :func:`loss.policy_loss` keyword arguments.

        ``num_samples``: ``sum_of_sample_mean``'s denominator, the trained samples, or
        (``trainer.count_masked_samples``) all ``batch_size`` samples handed in, masked ones
        included, as slime divides by the global batch size; ``num_tokens``: the trained response
        tokens; ``num_rollout_samples`` / ``num_rollout_tokens``: the same for the trained samples
        that have rollout log-probs (the ``tis`` figure's samples).
        """
        samples = prep.samples
        sampled = [s for s in samples if s.rollout_log_probs is not None]
        return {"num_samples": batch_size if self.cfg.count_masked_samples else len(samples),
                "num_tokens": sum(s.response_length for s in samples),
                "num_rollout_samples": len(sampled),
                "num_rollout_tokens": sum(s.response_length for s in sampled)}

    def _forward_backward(self, prep: _Prepared, totals: dict[str, int], first: _Tally | None,
                          policy_version: int | None) -> dict[str, torch.Tensor]:
        """One optimizer step's gradients: forward, loss and backward over this rank's micro-batches.

        Gradients accumulate in Megatron DDP's (zeroed) grad buffers. ``totals``: the global
        denominators (:meth:`_loss_totals`). ``first`` (on the first step only) collects the
        train-vs-rollout figure and each sample's mean advantage. Returns this rank's summed
        detached statistics of :func:`loss.policy_loss` plus ``loss`` (``{}`` without micro-batches).
        """
        self.net.train()
        self._unit.ddp.zero_grad_buffer()
        self._unit.optimizer.zero_grad()
        entropy_mode = "grad" if self.cfg.entropy_coef else "metric"
        step_stats: dict[str, torch.Tensor] = {}
        for mb, old, ref, train in zip(prep.micro, prep.old_cache, prep.ref_cache, prep.train_cache):
            logp, ent = self._forward(self.net, mb, entropy_mode)
            dev = logp.device
            mask = mb.mask.to(dev)
            adv = self._advantages(mb, old, prep.rl_adv[mb.index])
            loss, stats = L.policy_loss(
                logp, old, adv, mask, self.loss_params, entropy=ent, ref_log_probs=ref,
                rollout_log_probs=mb.rollout_log_probs.to(dev), train_log_probs=train, has_rollout=mb.has_rollout,
                sample_weights=mb.weights.to(dev), **totals)
            # Megatron DDP averages gradients over DP ranks; the loss is already a global mean
            (loss * self.par.dp).backward()
            stats["loss"] = loss.detach()
            for k, v in stats.items():
                step_stats[k] = step_stats.get(k, 0.0) + v.float().cpu()
            if first is not None:
                self._mismatch(first.diff, logp, mb, policy_version)
                first.adv_means[mb.index] = ((adv.detach() * mask).sum(1) / mask.sum(1).clamp(min=1)).double().cpu()
        return step_stats

    def _tally_metrics(self, tally: _Tally, policy_version: int | None, pre_s: float) -> dict[str, float]:
        """The batch's step metrics from ``tally`` (collective over DP; see :meth:`train_batch`):
        loss statistics averaged over the optimizer steps, the train-vs-rollout figures,
        ``grad_norm``, timings (``pre_s``: seconds of preparation, counted as forward/backward) and
        ``nonfinite_steps``."""
        n = self.cfg.steps_per_batch
        metrics = {k: v / n for k, v in tally.sums.items()}
        d = self._all_reduce_dp(tally.diff)
        if d["current_n"] + d["stale_n"] > 0:
            metrics["logprob_abs_diff"] = (d["current"] + d["stale"]) / (d["current_n"] + d["stale_n"])
        if policy_version is not None:
            for part in ("current", "stale"):
                metrics[f"logprob_tokens_{part}"] = d[f"{part}_n"]
                if d[f"{part}_n"] > 0:
                    metrics[f"logprob_abs_diff_{part}"] = d[part] / d[f"{part}_n"]
        # no step taken, or no clipping (Megatron then measures no norm and returns 0.0): no figure, not 0
        if tally.grad_norm is not None and self.cfg.clip_grad > 0:
            metrics["grad_norm"] = float(tally.grad_norm)
        metrics["forward_backward_s"] = tally.fb_s + pre_s
        metrics["optimizer_s"] = tally.opt_s
        metrics["nonfinite_steps"] = float(n - tally.applied)
        return metrics

    def _sample_advantages(self, prep: _Prepared, adv_means: torch.Tensor) -> dict[int, float]:
        """Input index -> mean advantage of each trained sample (collective over DP: each sample
        was on exactly one DP rank, so a sum gathers them)."""
        if self.par.dp > 1:
            import torch.distributed as dist
            from megatron.core import parallel_state as ps

            adv_means = adv_means.to(self.par.device)
            dist.all_reduce(adv_means, group=ps.get_data_parallel_group())
        return {prep.keep[i]: float(a) for i, a in enumerate(adv_means.cpu().tolist())}

    @staticmethod
    def _mismatch(acc: dict[str, torch.Tensor], logp: torch.Tensor, mb: B.MicroBatch,
                  policy_version: int | None) -> None:
        """Add ``|logp - rollout|`` sums and token counts of ``mb``'s samples that have rollout
        log-probs to ``acc``: ``current`` = generated by ``policy_version``, ``stale`` = the rest
        (everything when ``policy_version`` is None)."""
        dev = logp.device
        mask = mb.mask.to(dev) * mb.has_rollout.to(dev)[:, None]
        per_sample = ((logp.detach().float() - mb.rollout_log_probs.to(dev)).abs() * mask).sum(-1).double().cpu()
        tokens = mask.sum(-1).double().cpu()
        current = (mb.policy_versions == policy_version) if policy_version is not None \
            else torch.zeros(mb.size, dtype=torch.bool)
        for part, sel in (("current", current), ("stale", ~current)):
            acc[part] += per_sample[sel].sum()
            acc[f"{part}_n"] += tokens[sel].sum()

    def _optimizer_step(self, loss: torch.Tensor | None):
        """Reduce gradients, then step unless the loss or a gradient is NaN/inf on any rank.

        Returns ``(ok, grad_norm, zeros)``; ``ok`` is False (and nothing changed) on a skip.
        """
        from megatron.core.distributed import finalize_model_grads

        finalize_model_grads([self._unit.ddp])
        if not self._finite_everywhere(loss):
            self.nonfinite_steps += 1
            prom.NONFINITE.inc()
            return False, None, None
        ok, grad_norm, zeros = self._unit.optimizer.step()
        if not ok:  # a bf16/fp16 loss scaler found inf itself
            self.nonfinite_steps += 1
            prom.NONFINITE.inc()
            return False, grad_norm, zeros
        self._unit.steps += 1
        self.optimizer_steps += 1
        prom.OPTIMIZER_STEPS.inc()
        return ok, grad_norm, zeros

    def _grad_tensors(self) -> list[torch.Tensor]:
        """This rank's reduced gradients of the trained unit: Megatron DDP's flat grad buffers."""
        ddp = self._unit.ddp
        bufs = list(getattr(ddp, "buffers", [])) + list(getattr(ddp, "expert_parallel_buffers", []))
        if bufs:
            return [b.grad_data for b in bufs]
        return [p.main_grad for p in ddp.module.parameters() if getattr(p, "main_grad", None) is not None]

    def _finite_everywhere(self, loss: torch.Tensor | None) -> bool:
        """True when this step's loss and gradients are finite on every rank (collective).

        A rank without micro-batches contributes no loss; the verdict is all-reduced (MAX of a
        "bad" flag) over the whole world, so every rank takes the same branch.
        """
        bad = loss is not None and not bool(torch.isfinite(torch.as_tensor(loss)).all())
        if not bad:
            bad = any(not bool(torch.isfinite(g).all()) for g in self._grad_tensors())
        return not _any_rank(bad, self.par.device)

    def nonfinite_weights(self) -> list[str]:
        """Names of parameters holding NaN/inf on this rank (``[]`` when finite everywhere).

        Collective: the verdict is all-reduced, so on a rank whose own shard is finite while
        another rank's is not, the result is ``["<another rank>"]``; every rank sees a non-empty
        list together.
        """
        from pipeline.trainer.guards import nonfinite_parameters

        named = list(self.model.named_parameters())
        if self.lora is not None:
            named += [(f"lora.{n}.{k}", p) for n, ad in self.lora.adapters.items() for k, p in ad.named_parameters()]
        bad = nonfinite_parameters(named)
        if _any_rank(bool(bad), self.par.device) and not bad:
            return ["<another rank>"]
        return bad

    def apply_hyperparameters(self) -> list[str]:
        """Set every optimizer group's learning rate, weight decay, betas and eps from the config.

        Weight decay follows Megatron's convention: each group's ``wd_mult`` (0 for biases and
        1-D parameters such as norm weights, from ``get_standard_config_overrides``) times
        ``weight_decay``; learning rate: ``lr`` times the group's ``lr_mult``. Megatron applies
        these in its ``OptimizerParamScheduler``; the trainer uses a constant schedule, so it is
        done here, once at construction and again after a checkpoint is restored (the restored
        groups hold the hyper-parameters of the run that wrote it). Returns the changed values as
        ``"name old -> new"`` strings. With LoRA: every adapter's optimizer.
        """
        changes: list[str] = []
        for unit in self.trainables.values():
            self._set_hyperparameters(unit.optimizer, changes)
        return changes

    def _set_hyperparameters(self, optimizer, changes: list[str]) -> None:
        """:meth:`apply_hyperparameters` on one optimizer, appending its changes to ``changes``."""
        cfg = self.cfg
        for g in optimizer.param_groups:
            new = {"lr": cfg.lr * g.get("lr_mult", 1.0),
                   "weight_decay": cfg.weight_decay * g.get("wd_mult", 1.0),
                   "betas": (cfg.adam_beta1, cfg.adam_beta2), "eps": cfg.adam_eps}
            for k, v in new.items():
                old = tuple(g[k]) if k == "betas" and k in g else g.get(k)
                if k in g and old != v and f"{k} {old} -> {v}" not in changes:
                    changes.append(f"{k} {old} -> {v}")
                g[k] = v
            g["max_lr"] = g["min_lr"] = cfg.lr  # what Megatron's scheduler would read

    def _all_reduce_dp(self, stats: dict[str, Any]) -> dict[str, float]:
        """Sum scalar stats over DP ranks (each rank holds its micro-batches' share)."""
        if self.par.dp == 1:
            return {k: float(v) for k, v in stats.items()}
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        group = ps.get_data_parallel_group()
        # a rank without micro-batches has no stats: agree on the keys first, missing ones are 0
        names: list = [None] * self.par.dp
        dist.all_gather_object(names, sorted(stats), group=group)
        keys = sorted(set().union(*names))
        t = torch.tensor([float(stats.get(k, 0.0)) for k in keys], dtype=torch.float64, device=self.par.device)
        dist.all_reduce(t, group=group)
        return dict(zip(keys, t.tolist()))

    # ------------------------------------------------------------ export / state

    def _export_dtype(self) -> torch.dtype:
        return resolve_dtype(self.cfg.export_dtype, self.par.device) if self.cfg.export_dtype != "auto" else self.dtype

    def export(self, out_dir: str | Path) -> M.Exported | None:
        """Write the current weights as an HF folder (collective over TP; rank 0 writes).

        Raises ``ValueError`` with ``trainer.lora`` (the base never changes: :meth:`export_adapter`).
        """
        if self.lora is not None:
            raise ValueError("trainer.lora is on: the base is frozen; export an adapter with export_adapter()")
        return M.export_hf(self.model, self.arch, self.hf_dir, out_dir, dtype=self._export_dtype())

    def export_adapter(self, name: str, out_dir: str | Path) -> M.Exported | None:
        """Write adapter ``name`` alone as a PEFT folder (:func:`pipeline.trainer.lora.write_adapter_folder`).

        Collective over TP (the shards are gathered); global rank 0 writes and gets
        :class:`pipeline.trainer.model.Exported` (its ``sha256`` is the adapter's version), the
        others ``None``. ``adapter_config.json`` names ``trainer.model`` as the base. Raises
        ``KeyError`` for an unknown adapter, ``FileExistsError`` if ``out_dir`` exists.
        """
        from pipeline.trainer.lora import write_adapter_folder

        lora = self._need_lora()
        tensors = lora.hf_tensors(name, dtype=self._export_dtype())
        if tensors is None:
            return None
        return write_adapter_folder(tensors, lora.peft_config(self.cfg.model), out_dir)

    def load_adapter(self, name: str, folder: str | Path, sha256: str | None = None) -> str:
        """Resume adapter ``name`` from an exported PEFT folder (checksum verified; fresh optimizer state).

        Replaces the adapter if it exists. Returns the folder's sha256. Raises ``ValueError``
        (checksum mismatch, or the folder's rank / alpha / targets differ from ``trainer.lora``),
        ``FileNotFoundError``, ``KeyError`` (a tensor missing).
        """
        from pipeline.trainer.lora import read_adapter_folder

        lora = self._need_lora()
        config, tensors, digest = read_adapter_folder(folder, sha256)
        lora.check_config(config, str(folder))
        if name in self.trainables:
            self.remove_adapter(name)
        self.add_adapter(name)
        lora.load_hf_tensors(name, tensors)
        self.trainables[name].optimizer.reload_model_params()  # bf16: the fp32 master copies follow
        return digest

    def state_dict(self) -> dict[str, Any]:
        """This rank's model shard, optimizer state and step counter (for checkpoints).

        With LoRA: ``adapters`` (name -> its weights, optimizer state and steps) instead of the
        frozen base, which is always the one in ``hf_dir``.
        """
        if self.lora is None:
            return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                    "optimizer_steps": self.optimizer_steps}
        adapters = {n: {"weights": self.lora.adapters[n].state_dict(), "optimizer": t.optimizer.state_dict(),
                        "steps": t.steps} for n, t in self.trainables.items()}
        return {"adapters": adapters, "optimizer_steps": self.optimizer_steps}

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Restore :meth:`state_dict` (same TP size and model): weights, Adam moments, counters.

        The configured hyper-parameters (lr, weight decay, betas, eps) replace the checkpoint's
        (:meth:`apply_hyperparameters`); the changes are logged and returned. With LoRA the
        adapters become exactly the checkpoint's. Raises ``ValueError`` when the checkpoint is
        of the other kind (full fine-tuning vs LoRA).
        """
        if ("adapters" in state) != (self.lora is not None):
            raise ValueError("the checkpoint is of " + ("LoRA adapters" if "adapters" in state else
                             "full fine-tuning") + f" but trainer.lora is {'on' if self.lora else 'off'}")
        if self.lora is None:
            self.model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        else:
            for n in self.adapters():
                self.remove_adapter(n)
            for n, a in state["adapters"].items():
                self.add_adapter(n)
                self.lora.adapters[n].load_state_dict(a["weights"])
                self.trainables[n].optimizer.load_state_dict(a["optimizer"])
                self.trainables[n].steps = int(a["steps"])
        self.optimizer_steps = int(state["optimizer_steps"])
        changes = self.apply_hyperparameters()
        if changes:
            log.warning("configured optimizer hyper-parameters replace the checkpoint's: %s "
                        "(Adam moments restored)", "; ".join(changes))
        return changes

    def load_weights(self, hf_dir: str | Path) -> None:
        """Load the weights of an exported HF folder (checksum verified); optimizer state is fresh.

        With LoRA this replaces the frozen base (the adapters stay). Raises ``ValueError`` on a
        checksum mismatch and ``FileNotFoundError`` without weights.
        """
        weightsync.verify_folder(hf_dir)
        M.load_hf_weights(self.model, hf_dir, self.arch)
        if self.optimizer is not None:
            self.optimizer.reload_model_params()  # bf16: the fp32 master copies follow the new weights
