"""Token sampling and log-probs for a batch of rows (torch, fp32).

Log-prob convention (the same as SGLang's default): the reported log-prob of a token is
``log_softmax(processed_logits / T)`` where ``processed_logits`` has the logit bias, the
frequency/presence/repetition penalties, the min-new-tokens EOS mask and a grammar mask
(constrained decoding, :mod:`pipeline.engine.grammar`: disallowed tokens are ``-inf``, so the
log-probs are of the masked, renormalised distribution) applied, and ``T`` is the
request temperature (1.0 for greedy). Top-k / top-p / min-p truncation is applied *after* that,
for sampling only, so it never changes a reported log-prob. The sampling order (top-k, then
top-p on the cumulative sorted probabilities, then min-p relative to the top probability)
follows SGLang's torch-native sampler.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.engine.params import SamplingParams


@dataclass
class RowSpec:
    """What the sampler needs to know about one row.

    Attributes:
        params: the request's sampling parameters.
        output_ids: tokens generated so far (for penalties and min_new_tokens).
        stop_ids: token ids masked while ``len(output_ids) < min_new_tokens``.
        generator: private generator when the request set ``sampling_seed``.
        top_logprobs_num: how many top alternatives to report (0: none).
        token_ids_logprob: fixed ids whose log-probs are reported at every step.
        allowed: grammar bitmask of the allowed next tokens (:meth:`Matcher.mask
            <pipeline.engine.grammar.Matcher.mask>`), None when unconstrained.
    """

    params: SamplingParams
    output_ids: list[int]
    stop_ids: list[int]
    generator: torch.Generator | None
    top_logprobs_num: int = 0
    token_ids_logprob: list[int] | None = None
    allowed: bytes | None = None


@dataclass
class StepResult:
    """Per row: sampled id, its log-prob (nats), top-k ``[(lp, id)]`` and fixed-id log-probs."""

    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]] | None]
    fixed: list[list[tuple[float, int]] | None]


def allowed_tokens(bitmask: bytes, vocab_size: int) -> torch.Tensor:
    """A grammar bitmask (bit ``t % 8`` of byte ``t // 8`` set: token ``t`` allowed) as a bool
    tensor [vocab_size]; ids past the bitmask (a model vocabulary padded beyond the tokenizer's)
    are not allowed. ~0.05 ms for a 49k vocabulary (numpy's unpackbits)."""
    raw = np.frombuffer(bitmask, dtype=np.uint8)
    bits = np.unpackbits(raw, bitorder="little", count=min(vocab_size, 8 * raw.size))
    if bits.size < vocab_size:
        bits = np.concatenate([bits, np.zeros(vocab_size - bits.size, dtype=np.uint8)])
    return torch.from_numpy(bits.view(np.bool_))


def apply_processors(logits: torch.Tensor, rows: list[RowSpec]) -> None:
    """Logit bias, penalties, min-new-tokens masking and the grammar mask, in place on
    ``logits`` [B, V]."""
    for i, r in enumerate(rows):
        p = r.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)
        if p.min_new_tokens and len(r.output_ids) < p.min_new_tokens and r.stop_ids:
            logits[i, torch.tensor(r.stop_ids, dtype=torch.long)] = float("-inf")
        if p.needs_penalty and r.output_ids:
            uniq, counts = torch.tensor(r.output_ids, dtype=torch.long).unique(return_counts=True)
            if p.repetition_penalty != 1.0:
                sel = logits[i, uniq]
                logits[i, uniq] = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
            if p.frequency_penalty or p.presence_penalty:
                logits[i, uniq] -= p.frequency_penalty * counts.to(logits.dtype) + p.presence_penalty
        if r.allowed is not None:
            allowed = allowed_tokens(r.allowed, logits.shape[1])
            if bool(allowed.any()):  # none: the matcher failed; the row ends when it is fed the token
                logits[i].masked_fill_(~allowed, float("-inf"))


def log_probs(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits / T)`` in fp32. Shapes: logits [B, V], temperatures [B] -> [B, V]."""
    return torch.log_softmax(logits.float() / temperatures[:, None], dim=-1)


def sample_step(logits: torch.Tensor, rows: list[RowSpec], generator: torch.Generator) -> StepResult:
    """Process, score and sample one token per row.

    Args:
        logits: [B, V] next-token logits (modified in place by the processors).
        rows: B row specs, in batch order.
        generator: the engine's generator for rows without their own seed.
    Returns:
        :class:`StepResult` with B entries per list.
    """
    logits = logits.float()
    apply_processors(logits, rows)
    temps = torch.tensor([r.params.temperature for r in rows], dtype=torch.float32)
    logp = log_probs(logits, temps)  # [B, V], the reported distribution
    B, V = logp.shape
    chosen = torch.empty(B, dtype=torch.long)
    greedy = [i for i, r in enumerate(rows) if r.params.greedy]
    if greedy:
        chosen[greedy] = logp[greedy].argmax(-1)
    sampled = [i for i, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        sub = logp[sampled]
        probs = sub.exp()
        top_k = torch.tensor([min(rows[i].params.top_k, V) for i in sampled])
        top_p = torch.tensor([rows[i].params.top_p for i in sampled])
        min_p = torch.tensor([rows[i].params.min_p for i in sampled])
        truncate = bool((top_k < V).any() or (top_p < 1.0).any() or (min_p > 0.0).any())
        if truncate:
            if bool((top_p >= 1.0).all() and (min_p <= 0.0).all()):
                kmax = int(top_k.max())
                probs_sort, probs_idx = probs.topk(kmax, dim=-1)
            else:
                probs_sort, probs_idx = probs.sort(dim=-1, descending=True)
            ar = torch.arange(probs_sort.shape[1])[None, :]
            cum = probs_sort.cumsum(-1)
            probs_sort = probs_sort.masked_fill(ar >= top_k[:, None], 0.0)
            probs_sort = probs_sort.masked_fill((cum - probs_sort) > top_p[:, None], 0.0)
            probs_sort = probs_sort.masked_fill(probs_sort < probs_sort[:, :1] * min_p[:, None], 0.0)
            pick = _multinomial(probs_sort, [rows[i] for i in sampled], generator)
            chosen[sampled] = probs_idx.gather(1, pick[:, None])[:, 0]
        else:
            chosen[sampled] = _multinomial(probs, [rows[i] for i in sampled], generator)
    lps = logp.gather(1, chosen[:, None])[:, 0].tolist()
    top: list = [None] * B
    fixed: list = [None] * B
    for i, r in enumerate(rows):
        if r.top_logprobs_num > 0:
            vals, idx = logp[i].topk(min(r.top_logprobs_num, V))
            top[i] = [(v, t) for v, t in zip(vals.tolist(), idx.tolist()) if v != float("-inf")]
        if r.token_ids_logprob:
            ids = torch.tensor(r.token_ids_logprob, dtype=torch.long)
            fixed[i] = list(zip(logp[i, ids].tolist(), r.token_ids_logprob))
    return StepResult(chosen.tolist(), lps, top, fixed)


def _multinomial(probs: torch.Tensor, rows: list[RowSpec], generator: torch.Generator) -> torch.Tensor:
    """One draw per row of (unnormalised, non-negative) ``probs`` [b, K]; seeded rows use their own
    generator. Inverse-CDF sampling (cumsum + searchsorted), several times faster on the CPU than
    ``torch.multinomial`` for a 49k vocabulary; a zero-probability entry is never picked."""
    u = torch.empty(probs.shape[0], 1, dtype=probs.dtype)
    shared = [i for i, r in enumerate(rows) if r.generator is None]
    if shared:
        u[shared] = torch.rand(len(shared), 1, generator=generator, dtype=probs.dtype)
    for i, r in enumerate(rows):
        if r.generator is not None:
            u[i] = torch.rand(1, generator=r.generator, dtype=probs.dtype)
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)[:, 0]
    return idx.clamp_(max=probs.shape[1] - 1)
