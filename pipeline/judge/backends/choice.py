"""``choice`` backend: score the three answers instead of sampling votes.

The PRM prompt is rendered by :class:`pipeline.engine_api.render.ChatRenderer` with the judge model's chat
template (tokenizer from ``judge.tokenizer``, default ``engine.model``) and each candidate answer ``\\boxed{1}``,
``\\boxed{0}``, ``\\boxed{-1}`` is appended as token ids. One ``POST /generate`` per candidate with
``max_new_tokens=0``, ``return_logprob=true`` and ``logprob_start_len = P - 1`` (P = prompt
length) returns log p(candidate token | prefix) for exactly the candidate's tokens (SGLang's
``logprob_start_len`` semantics); the candidate with the highest summed log-prob (nats) is the
score. No sampling, so no parse failures, and a fraction of the tokens of m sampled votes.
A candidate whose request fails after retries scores -inf; all failed gives no score (``Verdict(None, [None])``: one failed vote, no RL signal).
Hints (OPD) are sampled votes, as in the ``llm`` backend.
"""

from __future__ import annotations

import asyncio
import logging
import math

from pipeline.engine_api.errors import EngineError
from pipeline.engine_api.render import ChatRenderer, PromptSpec, load_tokenizer
from pipeline.judge import metrics
from pipeline.judge.backends.base import Verdict
from pipeline.judge.backends.llm import LLMBackend
from pipeline.judge.prompts import JudgeInput, prm_messages

log = logging.getLogger(__name__)

CANDIDATES = ((1, "\\boxed{1}"), (0, "\\boxed{0}"), (-1, "\\boxed{-1}"))


class ChoiceBackend(LLMBackend):
    """Log-prob scoring of the candidates ``\\boxed{1|0|-1}`` through ``/generate``."""

    name = "choice"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.tokenizer = load_tokenizer(self.jc.tokenizer or config.engine.model, config.engine.cache_dir)
        self.renderer = ChatRenderer(self.tokenizer)
        self.cand_ids = [(v, list(self.tokenizer.encode(t, add_special_tokens=False))) for v, t in CANDIDATES]

    async def _logprob(self, prompt_ids: list[int], cand: list[int]) -> float:
        body = {"input_ids": prompt_ids + cand, "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True, "logprob_start_len": len(prompt_ids) - 1}
        try:
            ans = await self.http.post("/generate", body)
        except EngineError as e:
            log.warning("choice scoring failed: %s", e)
            return -math.inf
        if isinstance(ans, list):
            ans = ans[0] if ans else {}
        entries = (ans.get("meta_info") or {}).get("input_token_logprobs") or []
        lps = [e[0] for e in entries if isinstance(e, (list, tuple)) and e and e[0] is not None]
        if len(lps) < len(cand):
            log.warning("choice scoring: %d log-probs for %d candidate tokens", len(lps), len(cand))
            return -math.inf
        return float(sum(lps[-len(cand):]))

    async def score(self, inp: JudgeInput) -> Verdict:
        prompt = await asyncio.to_thread(self.renderer.render_spec, PromptSpec(prm_messages(inp)))
        lps = await asyncio.gather(*(self._logprob(prompt, ids) for _, ids in self.cand_ids))
        if all(lp == -math.inf for lp in lps):
            metrics.count_vote(None)
            return Verdict(None, [None])
        best = max(range(len(lps)), key=lambda i: lps[i])
        v = self.cand_ids[best][0]
        metrics.count_vote(v)
        return Verdict(v, [v])
