"""An LLM judge's endpoint (OpenAI-compatible chat completions): votes sampled with time-outs,
retries and back-off. The client of the judge stage's ``llm`` backend
(:mod:`pipeline.judge.backends.llm`) and of the eval set's ``judge`` checks
(:mod:`pipeline.evaluator.judged`); both read the votes with :func:`pipeline.votes.parse_score`.
"""

from __future__ import annotations

import asyncio
import logging

import orjson

from pipeline.engine_api.client import EngineClient
from pipeline.engine_api.errors import EngineError, retried

log = logging.getLogger(__name__)


def judge_url(config) -> str:
    """Base URL of the judge endpoint (``judge.url``, else ``engine.url``), without a trailing /."""
    return (config.judge.url or config.engine.url).rstrip("/")


def completion_text(answer: dict) -> str:
    """The assistant text of a chat completion (content, else reasoning_content)."""
    try:
        msg = answer["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        return ""
    return msg.get("content") or msg.get("reasoning_content") or ""


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

    @classmethod
    def of(cls, config, max_connections: int = 512) -> "HttpJudge":
        """The judge endpoint of ``config`` (:func:`judge_url`; ``judge.vote_timeout_s``, ``retries``,
        ``retry_backoff_s``, ``api_key``)."""
        jc = config.judge
        key = jc.api_key.get_secret_value() if jc.api_key else None
        return cls(judge_url(config), jc.vote_timeout_s, jc.retries, jc.retry_backoff_s, api_key=key,
                   max_connections=max_connections)

    async def post(self, path: str, body: dict | bytes) -> dict:
        """POST ``body`` (a dict, or JSON already encoded) and return the parsed JSON answer.

        Raises:
            EngineError: every attempt failed (the last error), a non-retryable status came back
                (4xx other than 408/409/425/429), or the answer is not JSON.
        """
        return await retried(lambda: self.client.post(path, body), self.retries + 1, self.backoff_s)

    async def model_name(self, model: str) -> str:
        """``model``; for ``"default"`` the first model ``/v1/models`` lists (vLLM answers 404 for a
        model it does not serve), or ``"default"`` when that list cannot be read (logged)."""
        if model != "default":
            return model
        try:
            cards = (await self.client.models()).get("data") or []
            return str(cards[0]["id"]) if cards and cards[0].get("id") else model
        except (EngineError, KeyError, TypeError, AttributeError) as e:
            log.info("judge: /v1/models of %s not read (%s): votes name model %r", self.base_url, e, model)
            return model

    async def votes(self, model: str, messages: list[dict], n: int, temperature: float,
                    max_tokens: int) -> list[str | None]:
        """``n`` sampled answers to ``messages``, concurrently: each the completion's text, or None
        for a vote whose request failed after its retries (logged)."""
        body = orjson.dumps({"model": model, "messages": messages, "temperature": temperature,
                             "max_tokens": max_tokens, "stream": False})
        return list(await asyncio.gather(*(self._sample(body) for _ in range(max(1, n)))))

    async def _sample(self, body: bytes) -> str | None:
        try:
            return completion_text(await self.post("/v1/chat/completions", body))
        except EngineError as e:
            log.warning("judge vote failed: %s", e)
            return None

    async def aclose(self) -> None:
        await self.client.aclose()
