"""From ``samples`` events to padded micro-batch tensors (pure; no model, no Kafka).

Position convention: a sample has ``P`` prompt and ``R`` response tokens (``tokens`` has
``P + R``). The model's output at position ``t`` predicts token ``t + 1``, so response token ``j``
(index ``P + j``) is scored at position ``P + j - 1``. ``targets[t] = tokens[t + 1]`` and the
mask is 1 on positions ``P - 1 .. P + R - 2`` (when ``loss_mask`` is 1). Per-token inputs from the
event (rollout / teacher log-probs) are placed on those same positions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pipeline import events


def trainable(sample: events.Sample) -> bool:
    """A sample the loss can use: ``loss_mask == 1``, at least one prompt and one response token."""
    return bool(sample.loss_mask) and 0 < sample.response_length < len(sample.tokens)


@dataclass
class MicroBatch:
    """Padded tensors of ``b`` samples, ``S`` = longest sample length - 1 positions.

    - ``tokens`` ``[b, S]`` int64 (inputs, right-padded with 0), ``position_ids`` ``[b, S]``;
    - ``targets`` ``[b, S]`` int64: the next token at each position;
    - ``mask`` ``[b, S]`` float32: response positions of trainable samples;
    - ``rollout_log_probs``, ``teacher_log_probs`` ``[b, S]`` float32, filled on the response
      positions of samples that carry them (0 elsewhere: read them only through the flags);
    - ``rewards``, ``temperatures``, ``weights`` ``[b]`` float32 (``rewards`` 0 where absent);
    - ``has_reward``, ``has_teacher``, ``has_rollout`` ``[b]`` bool: which signals each sample
      carries (the event's ``reward`` / ``teacher_log_probs`` / ``rollout_log_probs`` not None);
    - ``policy_versions`` ``[b]`` int64: the version that generated each sample;
    - ``index``: each row's position in the batch the micro-batch came from.
    """

    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    mask: torch.Tensor
    rollout_log_probs: torch.Tensor
    teacher_log_probs: torch.Tensor
    rewards: torch.Tensor
    temperatures: torch.Tensor
    weights: torch.Tensor
    has_reward: torch.Tensor
    has_teacher: torch.Tensor
    has_rollout: torch.Tensor
    policy_versions: torch.Tensor
    index: list[int] = field(default_factory=list)

    @property
    def size(self) -> int:
        """Number of samples ``b``."""
        return int(self.tokens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Masked (trained) response tokens."""
        return int(self.mask.sum())

    def to(self, device: torch.device) -> MicroBatch:
        """The same micro-batch with every tensor on ``device``."""
        kw = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return MicroBatch(**kw)


def collate(samples: list[events.Sample], weights: list[float] | None = None,
            index: list[int] | None = None, include_masked: bool = False) -> MicroBatch:
    """Pad ``samples`` into one :class:`MicroBatch` (see the module docstring for positions).

    ``weights`` are per-sample loss weights (staleness; default 1). ``include_masked`` also marks
    the response positions of ``loss_mask = 0`` samples (for scoring, never for the loss).
    Raises ``ValueError`` on an empty list, a sample whose per-token arrays disagree with
    ``response_length``, or a temperature that is not > 0.
    """
    if not samples:
        raise ValueError("collate needs at least one sample")
    b = len(samples)
    S = max(len(s.tokens) for s in samples) - 1
    S = max(S, 1)
    tokens = torch.zeros(b, S, dtype=torch.int64)
    targets = torch.zeros(b, S, dtype=torch.int64)
    mask = torch.zeros(b, S, dtype=torch.float32)
    rollout = torch.zeros(b, S, dtype=torch.float32)
    teacher = torch.zeros(b, S, dtype=torch.float32)
    for i, s in enumerate(samples):
        ids = torch.as_tensor(s.tokens, dtype=torch.int64)
        n, R = len(ids), s.response_length
        if any(a is not None and len(a) != R for a in (s.rollout_log_probs, s.teacher_log_probs)):
            raise ValueError(f"sample {s.sample_id}: per-token arrays do not match response_length {R}")
        if n >= 2:
            tokens[i, :n - 1] = ids[:-1]
            targets[i, :n - 1] = ids[1:]
        if trainable(s) or (include_masked and 0 < R < n):
            lo, hi = n - R - 1, n - 1
            mask[i, lo:hi] = 1.0
            if s.rollout_log_probs is not None:
                rollout[i, lo:hi] = torch.as_tensor(s.rollout_log_probs, dtype=torch.float32)
            if s.teacher_log_probs is not None:
                teacher[i, lo:hi] = torch.as_tensor(s.teacher_log_probs, dtype=torch.float32)
    if any(not s.rollout_temperature > 0 for s in samples):
        raise ValueError("rollout_temperature must be > 0 (the temperature the log-probs were computed at)")
    if any(not s.rollout_temperature > 0 for s in samples):
        raise ValueError("rollout_temperature must be > 0 (the temperature the log-probs were computed at)")
    return MicroBatch(
        tokens=tokens, position_ids=torch.arange(S).unsqueeze(0).expand(b, S).contiguous(), targets=targets,
        mask=mask, rollout_log_probs=rollout, teacher_log_probs=teacher,
        rewards=torch.tensor([0.0 if s.reward is None else float(s.reward) for s in samples], dtype=torch.float32),
        temperatures=torch.tensor([float(s.rollout_temperature) for s in samples], dtype=torch.float32),
        weights=torch.tensor(weights if weights is not None else [1.0] * b, dtype=torch.float32),
        has_reward=torch.tensor([s.reward is not None for s in samples], dtype=torch.bool),
        has_teacher=torch.tensor([s.teacher_log_probs is not None for s in samples], dtype=torch.bool),
        has_rollout=torch.tensor([s.rollout_log_probs is not None for s in samples], dtype=torch.bool),
        policy_versions=torch.tensor([int(s.policy_version) for s in samples], dtype=torch.int64),
        index=list(index) if index is not None else list(range(b)),
    )


def split(samples: list[events.Sample], micro_batch_size: int, max_tokens: int = 0,
          weights: list[float] | None = None, include_masked: bool = False) -> list[MicroBatch]:
    """Sort by length (less padding) and cut into micro-batches of at most ``micro_batch_size``
    samples and, when ``max_tokens > 0``, at most ``max_tokens`` padded positions (``b * S``; a
    single longer sample still gets its own micro-batch). Memory per micro-batch is then bounded
    by ``max_tokens * vocab`` logits. Returns ``[]`` for no samples.
    """
    if micro_batch_size < 1:
        raise ValueError("micro_batch_size must be >= 1")
    order = sorted(range(len(samples)), key=lambda i: (len(samples[i].tokens), i))
    groups: list[list[int]] = []
    cur: list[int] = []
    for i in order:
        length = len(samples[i].tokens) - 1
        too_many = len(cur) >= micro_batch_size
        too_long = max_tokens > 0 and cur and (len(cur) + 1) * length > max_tokens
        if cur and (too_many or too_long):
            groups.append(cur)
            cur = []
        cur.append(i)
    if cur:
        groups.append(cur)
    w = weights if weights is not None else [1.0] * len(samples)
    return [collate([samples[i] for i in g], [w[i] for i in g], g, include_masked) for g in groups]
