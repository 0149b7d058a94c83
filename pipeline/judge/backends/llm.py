"""``llm`` backend: m sampled votes from an OpenAI-compatible endpoint (SGLang, vLLM, ...).

Each vote is one ``POST {judge.url}/v1/chat/completions`` with our PRM prompt (or the OPD hint
prompt) at ``judge.temperature``; the m votes run concurrently. A vote whose request fails
(connection error, time-out after ``judge.vote_timeout_s``, HTTP 408/409/425/429 or 5xx) is
retried ``judge.retries`` times with exponential back-off from ``judge.retry_backoff_s`` plus
jitter (:func:`pipeline.engine_api.errors.retried`), then counts as failed; another 4xx is not
retried. A 200 answer without a valid last ``\\boxed{}`` is a failed vote at once (a parse
failure, counted in ``pipeline_judge_parse_failures_total``). The score is the majority of the
valid votes; a tie gives 0 (OpenClaw-RL's PRM rule); no valid vote gives no score (None: the
turn carries no RL signal; OpenClaw-RL would score it 0).
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from pipeline.engine_api.client import EngineClient
from pipeline.engine_api.errors import EngineError, retried
from pipeline.judge import metrics
from pipeline.judge.backends.base import Backend, HintVerdict, Verdict
from pipeline.judge.parse import best_hint, hint_rejection, parse_hint, parse_score
from pipeline.votes import majority_vote
from pipeline.judge.prompts import JudgeInput, hint_messages, prm_messages

log = logging.getLogger(__name__)


def judge_url(config) -> str:
    """Base URL of the judge endpoint (``judge.url``, else ``engine.url``), without a trailing /."""
    return (config.judge.url or config.engine.url).rstrip("/")


class HttpJudge:
    """Judge calls with time-outs, retries and back-off, on an :class:`EngineClient` (its aiohttp
    pool, :mod:`pipeline.engine_api.transport`). Create it inside the event loop that uses it.

    Args:
        base_url: the endpoint's base URL.
        timeout_s: per-attempt time-out (whole request), seconds.
        retries: extra attempts after the first for retryable failures
            (:attr:`pipeline.engine_api.errors.EngineError.retryable`: a time-out, an unreachable
            endpoint, 5xx, 408/409/425/429).
        backoff_s: first back-off; doubles each retry, plus up to ``backoff_s`` of jitter.
        api_key: optional bearer token.
        max_connections: connection pool size.
    """

    def __init__(self, base_url: str, timeout_s: float, retries: int, backoff_s: float,
                 api_key: str | None = None, max_connections: int = 512) -> None:
        self.base_url = base_url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self.client = EngineClient(self.base_url, timeout_s, api_key, max_connections=max_connections)

    async def post(self, path: str, body: dict | bytes) -> dict:
        """POST ``body`` (a dict, or JSON already encoded) and return the parsed JSON answer.

        Raises:
            EngineError: every attempt failed (the last error), a non-retryable status came back
                (4xx other than 408/409/425/429), or the answer is not JSON.
        """
        return await retried(lambda: self.client.post(path, body), self.retries + 1, self.backoff_s)

    async def aclose(self) -> None:
        await self.client.aclose()


def completion_text(answer: dict) -> str:
    """The assistant text of a chat completion (content, else reasoning_content)."""
    try:
        msg = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return ""
    return msg.get("content") or msg.get("reasoning_content") or ""


class LLMBackend(Backend):
    """Sampled ``\\boxed{}`` votes from an LLM judge (production default; SGLang on a GPU)."""

    name = "llm"

    def __init__(self, config) -> None:
        super().__init__(config)
        self.jc = config.judge
        self.http: HttpJudge | None = None
        self.model = self.jc.model  # the model the votes name (start() reads "default" from /v1/models)

    async def start(self) -> None:
        key = self.jc.api_key.get_secret_value() if self.jc.api_key else None
        self.http = HttpJudge(judge_url(self.config), self.jc.vote_timeout_s, self.jc.retries,
                              self.jc.retry_backoff_s, api_key=key,
                              max_connections=max(16, self.jc.max_in_flight * max(1, self.jc.votes) * 2))
        self.model = self.jc.model
        if self.model == "default":  # vLLM answers 404 for a model it does not serve: name its first one
            try:
                cards = (await self.http.client.models()).get("data") or []
                self.model = str(cards[0]["id"]) if cards and cards[0].get("id") else self.model
            except (EngineError, KeyError, TypeError, AttributeError) as e:
                log.info("judge: /v1/models of %s not read (%s): votes name model %r", judge_url(self.config), e,
                         self.model)

    async def aclose(self) -> None:
        if self.http is not None:
            await self.http.aclose()

    async def _sample(self, body: bytes) -> str | None:
        try:
            return completion_text(await self.http.post("/v1/chat/completions", body))
        except EngineError as e:
            log.warning("judge vote failed: %s", e)
            return None

    async def _votes(self, messages: list[dict]) -> list[str | None]:
        n = max(1, self.jc.votes)
        body = orjson.dumps({"model": self.model, "messages": messages, "temperature": self.jc.temperature,
                             "max_tokens": self.jc.max_tokens, "stream": False})
        return list(await asyncio.gather(*(self._sample(body) for _ in range(n))))

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
