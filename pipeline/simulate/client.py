"""A minimal async OpenAI-chat client for simulated users and evaluation.

A client of the proxy (the user's side of the pipeline, with its session headers), or of an
engine for a baseline; it sends through the package's one HTTP pool
(:class:`pipeline.engine_api.transport.Transport`) and fails with its errors
(:class:`pipeline.engine_api.errors.EngineError`).

Sends ``POST {base_url}/v1/chat/completions`` with the pipeline's session headers
(``X-Session-Id``, ``X-Turn-Type``, ``X-Session-Done``) and reads back the reply text, the finish
reason, the token usage and the policy version that served it, wherever the server puts it:
``metadata.weight_version`` (SGLang's chat shape), ``choices[0].meta_info.weight_version``, or a
response header ``X-Weight-Version`` / ``X-Policy-Version``.

Retries only what cannot have reached the model: a connection that could not be opened
(:class:`EngineUnreachable`) and 429/503 answers (a proxy holding requests during a weight sync
may answer 503 when its hold times out); a time-out or a connection dropped after the request
was sent is not retried (the turn may have been served).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import orjson

from pipeline.engine_api.errors import EngineError, EngineUnreachable, retried
from pipeline.engine_api.transport import Transport

RETRY_STATUS = (429, 503)
CHAT_PATH = "/v1/chat/completions"
FEEDBACK_PATH = "/v1/feedback"
VERSION_HEADERS = ("x-weight-version", "x-policy-version")


@dataclass
class ChatReply:
    """One chat completion as the user sees it.

    ``completion_tokens`` / ``prompt_tokens`` come from ``usage`` (None if absent);
    ``policy_version`` is the server's weight version as a string (None if not reported);
    ``latency_s`` is wall time of the successful attempt in seconds.
    """

    content: str
    finish_reason: str | None
    completion_tokens: int | None
    prompt_tokens: int | None
    policy_version: str | None
    latency_s: float
    headers: dict[str, str] = field(default_factory=dict)
    id: str | None = None  # the answer's id (the proxy's: what POST /v1/feedback names)


def policy_version_of(body: dict, headers: dict | None = None) -> str | None:
    """The policy (weight) version reported by a chat response, as a string, or None."""
    meta = body.get("metadata")
    if isinstance(meta, dict) and meta.get("weight_version") is not None:
        return str(meta["weight_version"])
    choices = body.get("choices") or []
    if choices and isinstance(choices[0], dict):
        mi = choices[0].get("meta_info")
        if isinstance(mi, dict) and mi.get("weight_version") is not None:
            return str(mi["weight_version"])
    for key in ("policy_version", "weight_version"):
        if body.get(key) is not None:
            return str(body[key])
    if headers is not None:
        lower = {k.lower(): v for k, v in headers.items()}
        for h in VERSION_HEADERS:
            if lower.get(h):
                return str(lower[h])
    return None


def parse_reply(body: dict, headers: dict | None = None, latency_s: float = 0.0) -> ChatReply:
    """Turn an OpenAI chat-completion body into a :class:`ChatReply`. Raises :class:`EngineError`."""
    choices = body.get("choices") if isinstance(body, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(f"response has no choices: {str(body)[:200]}", None, body)
    msg = choices[0].get("message") or {}
    usage = body.get("usage") or {}
    return ChatReply(
        content=msg.get("content") or "",
        finish_reason=choices[0].get("finish_reason"),
        completion_tokens=usage.get("completion_tokens"),
        prompt_tokens=usage.get("prompt_tokens"),
        policy_version=policy_version_of(body, headers),
        latency_s=latency_s,
        headers={k.lower(): v for k, v in (headers or {}).items()},
        id=body.get("id") if isinstance(body.get("id"), str) else None,
    )


class ChatClient:
    """Async chat-completions client bound to one base URL (a proxy or an engine).

    Args:
        base_url: e.g. ``http://127.0.0.1:8000`` (``/v1/chat/completions`` is appended).
        model: the ``model`` field of every request.
        api_key: sent as ``Authorization: Bearer``; None sends nothing.
        timeout_s: per-request timeout in seconds.
        retries: extra attempts on a connection that could not be opened or HTTP 429/503
            (exponential back-off from 0.5 s with jitter, :mod:`pipeline.retry`).
        max_connections: connection-pool bound (concurrency is bounded by the caller too).
        tenant: sent as ``X-Tenant-Id`` on every request (the proxy's tenant when it has no key
            map: docs/tenants.md); None: no header.
    """

    def __init__(self, base_url: str, model: str = "default", api_key: str | None = None,
                 timeout_s: float = 300.0, retries: int = 3, max_connections: int = 64,
                 tenant: str | None = None) -> None:
        fixed = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        if tenant is not None:
            fixed["X-Tenant-Id"] = tenant
        self._t = Transport(base_url, timeout_s, max_connections, headers=fixed or None)
        self.url = self._t.base_url + CHAT_PATH
        self.model = model
        self.retries = retries

    async def chat(self, messages: list[dict], *, max_tokens: int, temperature: float = 1.0,
                   session_id: str | None = None, turn_type: str | None = None, session_done: bool = False,
                   extra: dict[str, Any] | None = None) -> ChatReply:
        """One non-streaming chat completion. Raises :class:`EngineError` after the retries
        (``status``: the HTTP status of an error answer, None when there was none)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages, "max_tokens": max_tokens,
                                "temperature": temperature, "stream": False}
        if extra:
            body.update(extra)
        headers = {}
        if session_id is not None:
            headers["X-Session-Id"] = session_id
        if turn_type is not None:
            headers["X-Turn-Type"] = turn_type
        if session_done:
            headers["X-Session-Done"] = "true"
        payload = orjson.dumps(body)

        async def once() -> ChatReply:
            t0 = time.monotonic()
            status, data, hdrs = await self._t.call("POST", CHAT_PATH, payload, headers=headers)
            if status != 200:
                raise EngineError(f"{self.url} answered {status}: {data[:300].decode('utf-8', 'replace')}", status)
            try:
                answer = orjson.loads(data)
            except orjson.JSONDecodeError as e:
                raise EngineError(f"{self.url} returned invalid JSON: {e}", 200) from e
            return parse_reply(answer, hdrs, time.monotonic() - t0)

        try:
            return await retried(once, self.retries + 1, 0.5, retry_if=_never_served)
        except EngineUnreachable as e:
            raise e.within(f"cannot reach {self.url}") from None
        except EngineError as e:
            raise e if e.status is not None else e.within(f"request to {self.url} failed") from None

    async def feedback(self, response_id: str, score: float, comment: str | None = None,
                       source: str = "user") -> dict:
        """``POST /v1/feedback`` on the proxy: ``score`` in [-1, 1] for the answer ``response_id``
        (docs/feedback.md). Raises :class:`EngineError` on an error answer (``status`` set)."""
        body: dict[str, Any] = {"response_id": response_id, "score": score, "source": source}
        if comment:
            body["comment"] = comment

        async def once() -> dict:
            status, data, _ = await self._t.call("POST", FEEDBACK_PATH, orjson.dumps(body))
            if status != 200:
                raise EngineError(f"{self._t.base_url}{FEEDBACK_PATH} answered {status}: "
                                  f"{data[:300].decode('utf-8', 'replace')}", status)
            return orjson.loads(data)

        return await retried(once, self.retries + 1, 0.5, retry_if=_never_served)

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._t.close()

    async def __aenter__(self) -> "ChatClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


def _never_served(e: EngineError) -> bool:
    """Whether a failed request surely did not reach the model: the connection could not be
    opened, or the answer was 429 / 503 (:data:`RETRY_STATUS`)."""
    return isinstance(e, EngineUnreachable) or e.status in RETRY_STATUS
