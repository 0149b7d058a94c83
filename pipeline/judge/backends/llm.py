"""``llm`` backend: m sampled votes from an OpenAI-compatible endpoint (SGLang, vLLM, ...).

Each vote is one ``POST {judge.url}/v1/chat/completions`` with our PRM prompt (or the OPD hint
prompt) at ``judge.temperature``; the m votes run concurrently. A vote whose request fails
(connection error, time-out after ``judge.vote_timeout_s``, HTTP 408/409/425/429 or 5xx) is
retried ``judge.retries`` times with exponential back-off from ``judge.retry_backoff_s`` plus
jitter (:class:`pipeline.engine_api.judging.HttpJudge`, the client it shares with the eval set's
``judge`` checks), then counts as failed; another 4xx is not retried. A 200 answer without a valid last ``\\boxed{}`` is a failed vote at once (a parse
failure, counted in ``pipeline_judge_parse_failures_total``). The score is the majority of the
valid votes; a tie gives 0 (OpenClaw-RL's PRM rule); no valid vote gives no score (None: the
turn carries no RL signal; OpenClaw-RL would score it 0).
"""

from __future__ import annotations

from pipeline.engine_api.judging import HttpJudge
from pipeline.judge import metrics
from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.judge.parse import best_hint, hint_rejection, parse_hint, parse_score
from pipeline.votes import majority_vote
from pipeline.judge.prompts import JudgeInput, hint_messages, prm_messages


class LLMBackend(Backend):
    """Sampled ``\\boxed{}`` votes from an LLM judge (production default; SGLang on a GPU)."""

    name = "llm"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.jc = config.judge
        self.http: HttpJudge | None = None
        self.model = self.jc.model  # the model the votes name (start() reads "default" from /v1/models)

    async def start(self) -> None:
        pool = max(16, self.jc.max_in_flight * max(1, self.jc.votes) * 2)
        self.http = HttpJudge.of(self.config, max_connections=pool)
        self.model = await self.http.model_name(self.jc.model)

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def _votes(self, messages: list[dict]) -> list[str | None]:
        return await self.http.votes(self.model, messages, self.jc.votes, self.jc.temperature, self.jc.max_tokens)

    async def score(self, inp: JudgeInput) -> Verdict:
        votes = []
        for text in await self._votes(prm_messages(inp)):
            v = parse_score(text) if text is not None else None
            if text is not None and v is None:
                metrics.PARSE_FAILURES.inc()
            metrics.count_vote(v)
            votes.append(v)
        return Verdict(majority_vote(votes), votes)

    async def hint(self, inp: JudgeInput) -> HintVerdict:
        votes, hints = [], []
        texts = await self._votes(hint_messages(inp))
        for text in texts:
            v, h = parse_hint(text, self.jc.hint_min_chars) if text is not None else (None, None)
            if text is not None and v is None:
                metrics.PARSE_FAILURES.inc()
            metrics.count_vote(v)
            votes.append(v)
            hints.append(h)
        hint = best_hint(hints)
        return HintVerdict(hint, votes, None if hint else hint_rejection(texts, self.jc.hint_min_chars))
